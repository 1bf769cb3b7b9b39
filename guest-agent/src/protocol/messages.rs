//! Every message of the protocol, and the kind code each travels under.
//!
//! Requests (host to agent) have kinds `0x01xx`, answers and events (agent to host)
//! `0x02xx`. Kind codes and the order of enum variants and struct fields are part of the
//! wire format (postcard encodes variants by index and fields in order): never reorder
//! them; a change is a new [`VERSION`](super::VERSION).

use serde::{Deserialize, Serialize};

use super::ProtocolError;

/// Bytes that postcard encodes as one length-prefixed blob rather than element by element.
pub type Bytes = serde_bytes::ByteBuf;

// ---------------------------------------------------------------- requests

/// Liveness and version check; answered by [`Pong`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ping {}

/// What a process reads on stdin.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum StdinMode {
    /// `/dev/null`.
    #[default]
    Null,
    /// These bytes, then end of file (bounded by the frame size: use `Stream` for more).
    Bytes(Bytes),
    /// Sent as [`StdinData`] frames on the same connection, ended by [`StdinClose`].
    Stream,
}

/// uid and gid to run a process as (supplementary groups are dropped).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct User {
    pub uid: u32,
    pub gid: u32,
}

/// Runs a process; answered by [`ExecStarted`] (or [`ErrorMsg`]), then [`Output`]
/// chunks, then exactly one [`Exit`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exec {
    /// Program to run: a path, or a name looked up in `PATH`. With `shell`, a shell
    /// command line.
    pub command: String,
    /// Arguments after the program name (`argv[1..]`). With `shell`, `$0`, `$1`, ...
    pub argv: Vec<String>,
    /// Run `/bin/sh -c command argv...` instead of executing `command` directly.
    pub shell: bool,
    /// Variables set on top of the agent's environment (or of an empty one).
    pub env: Vec<(String, String)>,
    /// Start from an empty environment instead of the agent's.
    pub clear_env: bool,
    /// Working directory: absolute, or relative to the agent's files root (the default).
    pub cwd: Option<String>,
    pub user: Option<User>,
    pub stdin: StdinMode,
    /// Kill the whole process group with SIGKILL after this many milliseconds.
    pub timeout_ms: Option<u64>,
    /// Per-stream output cap in bytes; the agent's own cap if absent or larger. For a
    /// background process only this cap applies (none if absent): its ring bounds memory.
    pub output_limit: Option<u64>,
    /// Keep the process running independently of any connection (protocol 2): the
    /// answer is [`ExecStarted`] alone; its output goes to a bounded ring of events read
    /// with [`Attach`], its stdin (with [`StdinMode::Stream`]) is fed by [`ProcStdin`].
    pub background: bool,
}

/// A chunk of stdin for a running exec (request id of the [`Exec`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StdinData {
    pub data: Bytes,
}

/// Closes the stdin of a running exec.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StdinClose {}

/// Sends `signal` to the process group of exec `exec_id`; answered by [`Done`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Kill {
    pub exec_id: u64,
    pub signal: i32,
}

/// Replays the kept events of background process `exec_id` with a sequence number over
/// `after_seq` (all kept events if absent), then streams its live events until its exit.
/// Answered by [`Attached`], then [`ProcOutput`], [`Gap`] and finally [`ProcExit`]
/// events, then [`Done`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attach {
    pub exec_id: u64,
    pub after_seq: Option<u64>,
}

/// Writes `data` (at most [`MAX_CHUNK`](super::MAX_CHUNK) bytes) to the stdin of
/// background process `exec_id`, then closes it if `close` and every byte went in.
/// Answered by [`Written`] with the bytes the process took within the agent's wait.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcStdin {
    pub exec_id: u64,
    pub data: Bytes,
    pub close: bool,
}

/// Lists the background processes the agent keeps (running, and the most recently
/// finished); answered by [`Procs`] batches, the last with `more: false`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcList {}

/// Lists a directory; answered by [`Entries`] batches, the last with `more: false`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct List {
    pub path: String,
}

/// Describes one path without following a final symlink; answered by [`StatResult`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stat {
    pub path: String,
}

/// Reads `len` bytes (to the end if absent) from `offset`; answered by [`ReadData`]
/// chunks then [`ReadEnd`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Read {
    pub path: String,
    pub offset: u64,
    pub len: Option<u64>,
}

/// How [`Write`] opens its file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum WriteMode {
    /// Create it, or truncate it if it exists.
    #[default]
    Truncate,
    /// Create it; fail with `AlreadyExists` if it exists.
    CreateNew,
    /// Create it, or append to it if it exists.
    Append,
}

/// Opens a file for writing; answered by [`Done`] once open. The host then sends
/// [`WriteData`] chunks and a [`WriteEnd`]; the agent answers [`Written`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Write {
    pub path: String,
    pub mode: WriteMode,
    /// Permission bits of a created file (default 0o644, umask applies).
    pub perm: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteData {
    pub data: Bytes,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteEnd {}

/// Creates a directory (and its missing parents with `parents`); answered by [`Done`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mkdir {
    pub path: String,
    pub parents: bool,
    /// Permission bits (default 0o755, umask applies).
    pub perm: Option<u32>,
}

/// Removes a file, symlink or empty directory (any directory with `recursive`);
/// answered by [`Done`]. Symlinks are removed, never followed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Remove {
    pub path: String,
    pub recursive: bool,
}

/// Renames `from` to `to` (replacing `to` as rename(2) does); answered by [`Done`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rename {
    pub from: String,
    pub to: String,
}

/// Re-identifies the guest after a restore or fork; answered by [`IdentityDone`].
/// Refused with `Forbidden` unless the agent runs with `--allow-identity`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// New instance id: 1 to 64 characters of `[A-Za-z0-9-]`.
    pub instance_id: String,
    /// Wall-clock time, nanoseconds since the Unix epoch.
    pub unix_time_ns: u64,
    /// Exactly [`IDENTITY_ENTROPY_LEN`](super::IDENTITY_ENTROPY_LEN) bytes.
    pub entropy: Bytes,
    /// Hostname to set; the instance id if absent.
    pub hostname: Option<String>,
}

/// [`Identity`], with the machine id to give the guest (`/etc/machine-id`) in
/// place of a new random one: the host's id for the machine this guest is, so
/// a machine restored as itself (a wake) keeps its id, and a new machine (a
/// fork) gets its own. Answered by [`IdentityDone`]; refused as `Identity` is.
/// An agent older than this request answers `UnknownKind` (the host then
/// sends `Identity`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentityAs {
    pub identity: Identity,
    /// 32 lowercase hex digits, not all zero (machine-id(5)).
    pub machine_id: String,
}

/// Opens a TCP connection to `port` on the guest's loopback (127.0.0.1, then ::1);
/// answered by [`Done`], after which the connection carries that TCP stream's bytes
/// both ways, unframed, until either side closes. Refused with `Refused` when nothing
/// listens there. An agent older than this request answers `UnknownKind`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortConnect {
    /// 1 to 65535.
    pub port: u16,
}

/// Configures a guest network interface: its MAC address, one IPv4 address, the
/// default route and the resolver; answered by [`NetConfigured`]. Everything is
/// checked before anything changes (a bad value is `BadRequest`, an interface that does
/// not exist `NotFound`); a step that fails is `Io`, naming the step. It changes the
/// machine the agent runs on: refused with `Forbidden` unless the agent runs with
/// `--allow-identity`. An agent older than this request answers `UnknownKind`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetConfigure {
    /// A unicast Ethernet address (the low bit of the first byte clear), not all zeroes.
    pub mac: [u8; 6],
    /// The IPv4 address, in network order (`[10, 0, 0, 2]` is 10.0.0.2).
    pub address: [u8; 4],
    /// Length of the subnet prefix: 1 to 30.
    pub prefix_len: u8,
    /// Default route through this router (within the subnet), replacing every other
    /// default route. If absent, no default route is added (and none through this
    /// interface is left: it goes down and up).
    pub gateway: Option<[u8; 4]>,
    /// At most [`MAX_NET_DNS`](super::MAX_NET_DNS) name servers written to
    /// `/etc/resolv.conf`, replacing it; left as it is if empty.
    pub dns: Vec<[u8; 4]>,
    /// The interface (at most [`MAX_IFNAME`](super::MAX_IFNAME) bytes, no `/`); the
    /// first non-loopback interface of `/sys/class/net`, by name, if absent.
    pub interface: Option<String>,
}

// ---------------------------------------------------------------- answers and events

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pong {
    /// The agent's crate version.
    pub agent_version: String,
    pub protocol: u16,
    pub max_payload: u32,
    /// The agent accepts [`Identity`] (and [`NetConfigure`], which the same permission
    /// gates).
    pub identity_allowed: bool,
}

/// Why a request failed. Codes are stable (encoded by index): add only at the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    /// Malformed or out-of-place request.
    BadRequest,
    /// Frame of another protocol version.
    UnsupportedVersion,
    /// Unknown message kind.
    UnknownKind,
    /// A length or count over a limit.
    TooLarge,
    NotFound,
    AlreadyExists,
    NotADirectory,
    IsADirectory,
    NotEmpty,
    PermissionDenied,
    /// The path leaves the files root (`..`, absolute outside it, a symlink out).
    PathEscape,
    /// The path is malformed: NUL byte, too long, names the root where a child is needed.
    InvalidPath,
    /// The process could not be started.
    SpawnFailed,
    /// No running exec has this id.
    NoSuchExec,
    /// Too many concurrent execs.
    Busy,
    /// The agent was not started with the permission this request needs.
    Forbidden,
    InvalidSignal,
    /// Any other I/O failure.
    Io,
    Internal,
    /// The stdin of a background process is closed (or was never a stream).
    StdinClosed,
    /// Nothing accepted a [`PortConnect`]'s connection.
    Refused,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorMsg {
    pub code: ErrorCode,
    pub message: String,
}

/// Generic success.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Done {}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecStarted {
    /// Agent-wide id for [`Kill`].
    pub exec_id: u64,
    pub pid: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StreamKind {
    Stdout,
    Stderr,
}

/// A chunk of output, in the order the agent read it from that stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Output {
    pub stream: StreamKind,
    pub data: Bytes,
}

/// The last event of an exec.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exit {
    /// Exit code, if the process exited.
    pub code: Option<i32>,
    /// Signal number, if a signal killed it.
    pub signal: Option<i32>,
    /// From spawn to exit, in microseconds.
    pub duration_us: u64,
    /// The timeout expired and the agent killed the process group.
    pub timed_out: bool,
    /// Output past the cap was read and discarded.
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    /// Bytes the process wrote to each stream, sent or not.
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileInfo {
    /// Last path component, lossily UTF-8.
    pub name: String,
    /// The exact name bytes when they are not UTF-8.
    pub raw_name: Option<Bytes>,
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits (`mode & 0o7777`).
    pub mode: u32,
    pub mtime_sec: i64,
    pub mtime_nsec: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entries {
    pub entries: Vec<FileInfo>,
    /// More batches follow.
    pub more: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatResult {
    pub info: FileInfo,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadData {
    pub data: Bytes,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadEnd {
    /// Bytes sent.
    pub bytes: u64,
    /// The read stopped at the end of the file.
    pub eof: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Written {
    pub bytes: u64,
}

/// The answer to [`Attach`], before any event.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attached {
    pub exec_id: u64,
    pub pid: u32,
    /// The process has not exited yet.
    pub running: bool,
    /// Sequence number of the oldest event kept.
    pub first_seq: u64,
    /// Sequence number the next event will have (one past the newest).
    pub next_seq: u64,
}

/// A chunk of a background process's output, event number `seq`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcOutput {
    pub seq: u64,
    pub stream: StreamKind,
    pub data: Bytes,
}

/// The exit of a background process: its last event, number `seq`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcExit {
    pub seq: u64,
    pub exit: Exit,
}

/// Events `first_seq..=last_seq` were dropped from the ring before this reader got them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gap {
    pub first_seq: u64,
    pub last_seq: u64,
    /// Output bytes those events held, when the agent knows (a reader from the start, or
    /// one that fell behind while attached); absent for a reader resuming from an event
    /// the ring no longer holds.
    pub bytes: Option<u64>,
}

/// One background process.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcInfo {
    pub exec_id: u64,
    pub pid: u32,
    /// The command and its arguments joined by spaces, for display (cut at
    /// [`MAX_PROC_COMMAND`](super::MAX_PROC_COMMAND) bytes).
    pub command: String,
    pub running: bool,
    /// Set once the process has exited (its last event).
    pub exit: Option<Exit>,
    /// When it started: milliseconds since the Unix epoch (the guest's clock).
    pub started_unix_ms: u64,
    /// Its stdin is a stream still open for [`ProcStdin`].
    pub stdin_open: bool,
    /// Oldest event kept, and the number the next event will have.
    pub first_seq: u64,
    pub next_seq: u64,
    /// Events and output bytes the ring dropped to stay within its bound.
    pub dropped_events: u64,
    pub dropped_bytes: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Procs {
    pub procs: Vec<ProcInfo>,
    /// More batches follow.
    pub more: bool,
}

/// What an identity refresh did; each step is tried even if an earlier one failed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentityDone {
    pub clock_set: bool,
    pub entropy_added: bool,
    pub crng_reseeded: bool,
    pub hostname: Option<String>,
    pub machine_id: Option<String>,
    /// One line per failed step.
    pub errors: Vec<String>,
}

/// The answer to [`NetConfigure`]: it was applied whole.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetConfigured {
    /// The interface configured (the one chosen, when the request named none).
    pub interface: String,
}

macro_rules! messages {
    ($($variant:ident = $code:literal,)*) => {
        /// Every message, by kind.
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub enum Message {
            $($variant($variant),)*
        }

        /// Kind codes.
        pub mod kind {
            $(#[allow(non_upper_case_globals)] pub const $variant: u16 = $code;)*
        }

        impl Message {
            /// The kind code this message travels under.
            pub fn kind(&self) -> u16 {
                match self {
                    $(Message::$variant(_) => $code,)*
                }
            }

            /// A short name for logs and errors.
            pub fn name(&self) -> &'static str {
                match self {
                    $(Message::$variant(_) => stringify!($variant),)*
                }
            }

            pub(super) fn encode_payload(&self, out: Vec<u8>) -> Result<Vec<u8>, ProtocolError> {
                let r = match self {
                    $(Message::$variant(m) => postcard::to_extend(m, out),)*
                };
                r.map_err(|source| ProtocolError::Encode { kind: self.kind(), source })
            }

            pub(super) fn decode_payload(kind: u16, payload: &[u8]) -> Result<Message, ProtocolError> {
                fn take<'a, T: Deserialize<'a>>(kind: u16, p: &'a [u8]) -> Result<T, ProtocolError> {
                    let (v, rest) = postcard::take_from_bytes(p)
                        .map_err(|source| ProtocolError::Payload { kind, source })?;
                    if rest.is_empty() {
                        Ok(v)
                    } else {
                        Err(ProtocolError::TrailingBytes { kind, extra: rest.len() })
                    }
                }
                match kind {
                    $($code => Ok(Message::$variant(take(kind, payload)?)),)*
                    _ => Err(ProtocolError::UnknownKind(kind)),
                }
            }
        }

        $(impl From<$variant> for Message {
            fn from(m: $variant) -> Self {
                Message::$variant(m)
            }
        })*
    };
}

messages! {
    Ping = 0x0101,
    Exec = 0x0102,
    StdinData = 0x0103,
    StdinClose = 0x0104,
    Kill = 0x0105,
    Attach = 0x0106,
    ProcStdin = 0x0107,
    ProcList = 0x0108,
    List = 0x0110,
    Stat = 0x0111,
    Read = 0x0112,
    Write = 0x0113,
    WriteData = 0x0114,
    WriteEnd = 0x0115,
    Mkdir = 0x0116,
    Remove = 0x0117,
    Rename = 0x0118,
    Identity = 0x0120,
    IdentityAs = 0x0121,
    PortConnect = 0x0130,
    NetConfigure = 0x0140,
    Pong = 0x0201,
    ErrorMsg = 0x0202,
    Done = 0x0203,
    ExecStarted = 0x0204,
    Output = 0x0205,
    Exit = 0x0206,
    Entries = 0x0207,
    StatResult = 0x0208,
    ReadData = 0x0209,
    ReadEnd = 0x020a,
    Written = 0x020b,
    IdentityDone = 0x020c,
    Attached = 0x020d,
    ProcOutput = 0x020e,
    ProcExit = 0x020f,
    Gap = 0x0210,
    Procs = 0x0211,
    NetConfigured = 0x0212,
}

impl ErrorMsg {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}
