//! The async host client of the agent, shared by the VMM and the service.
//!
//! It reaches the agent through a Unix socket: the agent's own (`--listen-unix`, an
//! agent run as a host process) or a VM's vsock device, after the `CONNECT <port>\n` /
//! `OK <host port>\n` handshake ([`Endpoint`]).
//!
//! Connections: each exec gets a connection of its own, closed when the exec ends, so
//! that a slow reader of one exec never holds up another and the socket's own flow
//! control is the backpressure. Every other request borrows an idle connection from a
//! small pool (or opens one), runs to its final answer and gives it back. A connection
//! that fails is dropped and the pool emptied; an idle one is checked before reuse, so
//! after the guest side resets (agent restarted, VM restored) a call fails at most once
//! with [`ClientError::Disconnected`] (or an I/O error) and the next call reconnects.
//!
//! Timeouts: [`ClientConfig::connect_timeout`] bounds connecting (and the vsock
//! handshake); [`ClientConfig::request_timeout`] bounds each wait for an answer frame.
//! An exec's output may pause for as long as the process likes: only an exec with
//! `timeout_ms` gets a client deadline (`timeout_ms` + `request_timeout`).
//!
//! Everything the agent sends is bounded in bytes before the client keeps it: frames by
//! the protocol ([`MAX_PAYLOAD`](crate::protocol::MAX_PAYLOAD)), listings by
//! [`ClientConfig::max_list_entries`] and [`ClientConfig::max_list_bytes`], reads by the
//! length asked for (a guest that sends more is refused with
//! [`ClientError::Overrun`]), collected exec output and whole-file reads by the caller's
//! cap, and texts the agent sends (error messages, identity refresh reports) are clipped
//! to [`MAX_AGENT_TEXT`] bytes (so is the interface name a network configuration
//! answers). Background processes: a process listing by
//! [`ClientConfig::max_procs`] (each command clipped), an attach's events one frame at
//! a time (checked: numbers only go up, chunks of 1 to `MAX_CHUNK` bytes) and, collected,
//! by the caller's cap.

mod exec;
mod files;
mod net;
mod ports;
mod procs;

use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::time::timeout;

pub use exec::{ExecEvent, ExecOutput, ExecSession, ExecStdin};
pub use files::{FileReader, WriteOptions};
pub use ports::PortStream;
pub use procs::{ProcCollected, ProcEvent, ProcStream};

use crate::protocol::{
    ErrorCode, ErrorMsg, FileInfo, Identity, IdentityDone, Kill, Message, Mkdir, Ping, Pong,
    Remove, Rename, Stat,
};
use crate::wire::{write_frame, FrameReader, WireError};

/// Where the agent is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// The agent's own Unix socket.
    Unix(PathBuf),
    /// A VM's vsock device: its host Unix socket and the agent's vsock port.
    Vsock { uds_path: PathBuf, port: u32 },
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "{}", p.display()),
            Endpoint::Vsock { uds_path, port } => write!(f, "{} port {port}", uds_path.display()),
        }
    }
}

#[derive(Clone, Debug)]
pub struct ClientConfig {
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
    /// Idle connections kept for reuse.
    pub max_idle: usize,
    /// Most entries a listing may return.
    pub max_list_entries: usize,
    /// Most bytes a listing may hold (see [`list_entry_bytes`]).
    pub max_list_bytes: usize,
    /// Most background processes a process listing may return (each entry is bounded:
    /// its command is clipped to [`MAX_PROC_COMMAND`](crate::protocol::MAX_PROC_COMMAND)
    /// bytes).
    pub max_procs: usize,
}

/// Default of [`ClientConfig::max_list_bytes`]: 8 MiB of names and entries.
pub const DEFAULT_MAX_LIST_BYTES: usize = 8 << 20;

/// Longest text from the agent (an error message, one line of an identity refresh
/// report, a host name) the client keeps; the rest is cut off.
pub const MAX_AGENT_TEXT: usize = 4096;

/// Most lines of an identity refresh report the client keeps.
pub const MAX_AGENT_REPORT_LINES: usize = 16;

/// What one listing entry costs against [`ClientConfig::max_list_bytes`]: the entry
/// itself plus its name bytes.
pub fn list_entry_bytes(e: &FileInfo) -> usize {
    std::mem::size_of::<FileInfo>() + e.name.len() + e.raw_name.as_ref().map_or(0, |r| r.len())
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
            max_idle: 8,
            max_list_entries: 1_000_000,
            max_list_bytes: DEFAULT_MAX_LIST_BYTES,
            max_procs: 4096,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("Cannot connect to the agent at {endpoint}")]
    Connect {
        endpoint: String,
        #[source]
        source: io::Error,
    },
    #[error("Connecting to the agent at {0} timed out")]
    ConnectTimeout(String),
    #[error("The vsock device did not connect port {port}: {reason}")]
    Handshake { port: u32, reason: String },
    #[error("The agent did not answer within {0:?}")]
    Timeout(Duration),
    #[error("The agent closed the connection")]
    Disconnected,
    #[error("Connection to the agent failed")]
    Io(#[source] io::Error),
    #[error("The agent broke the protocol")]
    Protocol(#[source] WireError),
    #[error("The agent answered {got} where {expected} was expected")]
    Unexpected { expected: &'static str, got: String },
    #[error("Agent refused the request ({code:?}): {message}")]
    Agent { code: ErrorCode, message: String },
    #[error("{what} is over the client's limit of {limit}")]
    TooLarge { what: &'static str, limit: u64 },
    #[error("The agent sent {got} bytes or more of a read of at most {asked}")]
    Overrun { asked: u64, got: u64 },
    /// A call the client refuses before sending anything (say, a background exec
    /// given to [`Client::exec`]).
    #[error("{0}")]
    Misuse(&'static str),
}

impl ClientError {
    /// The agent's error code, when the agent refused the request.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Agent { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// The connection is gone or unusable (as opposed to a refused request).
    pub fn is_connection(&self) -> bool {
        matches!(
            self,
            ClientError::Disconnected
                | ClientError::Io(_)
                | ClientError::Protocol(_)
                | ClientError::Timeout(_)
                | ClientError::Unexpected { .. }
                | ClientError::Overrun { .. }
        )
    }
}

impl From<WireError> for ClientError {
    fn from(e: WireError) -> Self {
        match e {
            WireError::Io(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::UnexpectedEof
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::BrokenPipe
                        | io::ErrorKind::ConnectionAborted
                ) =>
            {
                ClientError::Disconnected
            }
            WireError::Io(e) => ClientError::Io(e),
            WireError::Truncated => ClientError::Disconnected,
            e => ClientError::Protocol(e),
        }
    }
}

/// `s` cut to at most `max` (at least 3) bytes at a character boundary, ending in `…`
/// if cut.
pub(crate) fn clip(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max.saturating_sub('…'.len_utf8());
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
    s
}

/// The agent's refusal, its message clipped to [`MAX_AGENT_TEXT`].
fn agent_error(e: ErrorMsg) -> ClientError {
    ClientError::Agent {
        code: e.code,
        message: clip(e.message, MAX_AGENT_TEXT),
    }
}

/// `got`, which is not the `expected` answer, as an error.
fn unexpected(expected: &'static str, got: Message) -> ClientError {
    match got {
        Message::ErrorMsg(e) => agent_error(e),
        other => ClientError::Unexpected {
            expected,
            got: other.name().to_owned(),
        },
    }
}

/// One connection to the agent.
pub(crate) struct Conn {
    reader: FrameReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    next_id: u64,
}

impl Conn {
    fn new(stream: UnixStream) -> Self {
        let (r, w) = stream.into_split();
        Self {
            reader: FrameReader::new(r),
            writer: w,
            next_id: 1,
        }
    }

    /// Sends `msg` as a new request; its id.
    async fn send(&mut self, msg: &Message) -> Result<u64, ClientError> {
        let id = self.next_id;
        self.next_id += 1;
        write_frame(&mut self.writer, id, msg).await?;
        Ok(id)
    }

    async fn send_as(&mut self, id: u64, msg: &Message) -> Result<(), ClientError> {
        write_frame(&mut self.writer, id, msg).await?;
        Ok(())
    }

    /// The next frame, which must answer request `id`, within `limit`.
    async fn recv(&mut self, id: u64, limit: Duration) -> Result<Message, ClientError> {
        let frame = timeout(limit, self.reader.next())
            .await
            .map_err(|_| ClientError::Timeout(limit))??
            .ok_or(ClientError::Disconnected)?;
        if frame.request_id != id {
            return Err(ClientError::Unexpected {
                expected: "an answer to the request",
                got: format!("{} for request {}", frame.msg.name(), frame.request_id),
            });
        }
        Ok(frame.msg)
    }

    /// An idle connection is usable if nothing arrived on it and it is not closed.
    fn is_idle_and_open(&self) -> bool {
        if self.reader.buffered() > 0 {
            return false;
        }
        let mut b = [0u8; 1];
        matches!(self.reader.get_ref().try_read(&mut b), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }
}

struct Inner {
    endpoint: Endpoint,
    config: ClientConfig,
    idle: Mutex<Vec<Conn>>,
}

/// The agent client. Cheap to clone; clones share the connection pool.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl Client {
    pub fn new(endpoint: Endpoint, config: ClientConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                endpoint,
                config,
                idle: Mutex::new(Vec::new()),
            }),
        }
    }

    pub fn endpoint(&self) -> &Endpoint {
        &self.inner.endpoint
    }

    pub fn config(&self) -> &ClientConfig {
        &self.inner.config
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<Conn>> {
        self.inner.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Opens a new connection (with the vsock handshake if needed).
    async fn connect(&self) -> Result<Conn, ClientError> {
        let cfg = &self.inner.config;
        let ep = &self.inner.endpoint;
        let attempt = async {
            let path = match ep {
                Endpoint::Unix(p) | Endpoint::Vsock { uds_path: p, .. } => p,
            };
            let mut tries = 0;
            loop {
                tries += 1;
                let mut stream =
                    UnixStream::connect(path)
                        .await
                        .map_err(|source| ClientError::Connect {
                            endpoint: ep.to_string(),
                            source,
                        })?;
                if let Endpoint::Vsock { port, .. } = ep {
                    match vsock_handshake(&mut stream, *port).await {
                        Err(Handshake::Unsent(e)) if tries < CONNECT_TRIES => {
                            log::debug!(
                                "vsock: the device closed the stream before CONNECT ({e}); again"
                            );
                            continue;
                        }
                        Err(h) => return Err(h.into_error(*port)),
                        Ok(()) => {}
                    }
                }
                return Ok(Conn::new(stream));
            }
        };
        timeout(cfg.connect_timeout, attempt)
            .await
            .map_err(|_| ClientError::ConnectTimeout(ep.to_string()))?
    }

    /// An idle connection that is still open, or a new one.
    async fn checkout(&self) -> Result<Conn, ClientError> {
        loop {
            let Some(conn) = self.idle().pop() else {
                return self.connect().await;
            };
            if conn.is_idle_and_open() {
                return Ok(conn);
            }
        }
    }

    fn checkin(&self, conn: Conn) {
        let mut idle = self.idle();
        if idle.len() < self.inner.config.max_idle {
            idle.push(conn);
        }
    }

    /// Forgets every idle connection (after one failed, the others likely did too).
    fn reset_pool(&self) {
        self.idle().clear();
    }

    /// Runs `f` on a pooled connection; gives the connection back only if `f` finished
    /// cleanly (an agent error answer counts as clean).
    async fn with_conn<T>(
        &self,
        f: impl AsyncFnOnce(&mut Conn) -> Result<T, ClientError>,
    ) -> Result<T, ClientError> {
        let mut conn = self.checkout().await?;
        match f(&mut conn).await {
            Ok(v) => {
                self.checkin(conn);
                Ok(v)
            }
            Err(e @ ClientError::Agent { .. }) => {
                self.checkin(conn);
                Err(e)
            }
            Err(e) => {
                self.reset_pool();
                Err(e)
            }
        }
    }

    /// Sends `msg` and returns its single answer.
    async fn unary(&self, msg: Message) -> Result<Message, ClientError> {
        let limit = self.inner.config.request_timeout;
        self.with_conn(async |c: &mut Conn| {
            let id = c.send(&msg).await?;
            match c.recv(id, limit).await? {
                Message::ErrorMsg(e) => Err(agent_error(e)),
                m => Ok(m),
            }
        })
        .await
    }

    async fn done(&self, msg: Message) -> Result<(), ClientError> {
        match self.unary(msg).await? {
            Message::Done(_) => Ok(()),
            m => Err(unexpected("Done", m)),
        }
    }

    pub async fn ping(&self) -> Result<Pong, ClientError> {
        match self.unary(Ping {}.into()).await? {
            Message::Pong(mut p) => {
                p.agent_version = clip(p.agent_version, MAX_AGENT_TEXT);
                Ok(p)
            }
            m => Err(unexpected("Pong", m)),
        }
    }

    /// Sends `signal` to the process group of a running exec, foreground or background.
    pub async fn kill(&self, exec_id: u64, signal: i32) -> Result<(), ClientError> {
        self.done(Kill { exec_id, signal }.into()).await
    }

    pub async fn stat(&self, path: &str) -> Result<FileInfo, ClientError> {
        match self.unary(Stat { path: path.into() }.into()).await? {
            Message::StatResult(s) => Ok(s.info),
            m => Err(unexpected("StatResult", m)),
        }
    }

    pub async fn mkdir(&self, path: &str, parents: bool) -> Result<(), ClientError> {
        let req = Mkdir {
            path: path.into(),
            parents,
            perm: None,
        };
        self.done(req.into()).await
    }

    pub async fn remove(&self, path: &str, recursive: bool) -> Result<(), ClientError> {
        let req = Remove {
            path: path.into(),
            recursive,
        };
        self.done(req.into()).await
    }

    pub async fn rename(&self, from: &str, to: &str) -> Result<(), ClientError> {
        let req = Rename {
            from: from.into(),
            to: to.into(),
        };
        self.done(req.into()).await
    }

    /// Re-identifies the guest (only an agent run with `--allow-identity` accepts it).
    pub async fn identity_refresh(&self, req: Identity) -> Result<IdentityDone, ClientError> {
        match self.unary(req.into()).await? {
            Message::IdentityDone(d) => Ok(clip_report(d)),
            m => Err(unexpected("IdentityDone", m)),
        }
    }

    /// [`Client::identity_refresh`], giving the guest `machine_id` (see
    /// [`IdentityAs`](crate::protocol::IdentityAs)). An agent that predates it
    /// answers `UnknownKind` (a [`ClientError::Agent`]).
    pub async fn identity_refresh_as(
        &self,
        identity: Identity,
        machine_id: &str,
    ) -> Result<IdentityDone, ClientError> {
        let req = crate::protocol::IdentityAs {
            identity,
            machine_id: machine_id.to_owned(),
        };
        match self.unary(req.into()).await? {
            Message::IdentityDone(d) => Ok(clip_report(d)),
            m => Err(unexpected("IdentityDone", m)),
        }
    }
}

/// `d` with its texts clipped: at most [`MAX_AGENT_REPORT_LINES`] error lines of at
/// most [`MAX_AGENT_TEXT`] bytes each, names of at most [`MAX_AGENT_TEXT`] bytes.
fn clip_report(mut d: IdentityDone) -> IdentityDone {
    let dropped = d.errors.len().saturating_sub(MAX_AGENT_REPORT_LINES);
    d.errors.truncate(MAX_AGENT_REPORT_LINES);
    d.errors = d
        .errors
        .into_iter()
        .map(|l| clip(l, MAX_AGENT_TEXT))
        .collect();
    if dropped > 0 {
        d.errors.push(format!("({dropped} more lines dropped)"));
    }
    d.hostname = d.hostname.map(|h| clip(h, MAX_AGENT_TEXT));
    d.machine_id = d.machine_id.map(|m| clip(m, MAX_AGENT_TEXT));
    d
}

/// Connection attempts (within [`ClientConfig::connect_timeout`]) when the vsock
/// device closes the stream before the `CONNECT` line could be written. The device
/// drops a host stream whose line comes late (a starved host process, as in the
/// emulated lab under load); nothing reached the agent then, so trying again cannot
/// run anything twice. A refusal after the line (nothing listens on the port) is
/// never tried again.
const CONNECT_TRIES: usize = 3;

/// How a vsock handshake failed.
#[derive(Debug)]
enum Handshake {
    /// The `CONNECT` line could not be written: the device had closed the stream.
    Unsent(io::Error),
    /// After the line: refused, or a bad answer.
    Failed(String),
}

impl Handshake {
    fn into_error(self, port: u32) -> ClientError {
        let reason = match self {
            Self::Unsent(e) => format!("cannot send CONNECT: {e}"),
            Self::Failed(r) => r,
        };
        ClientError::Handshake { port, reason }
    }
}

/// `CONNECT <port>\n`, then `OK <host port>\n` read byte by byte (nothing past it).
async fn vsock_handshake(stream: &mut UnixStream, port: u32) -> Result<(), Handshake> {
    let fail = Handshake::Failed;
    stream
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .await
        .map_err(Handshake::Unsent)?;
    let mut line = Vec::with_capacity(32);
    loop {
        let mut b = [0u8; 1];
        match stream.read(&mut b).await {
            Ok(0) => {
                return Err(fail(
                    "refused (nothing listens there, or the guest is not up)".into(),
                ))
            }
            Ok(_) if b[0] == b'\n' => break,
            Ok(_) if line.len() < 32 => line.push(b[0]),
            Ok(_) => return Err(fail("answer line too long".into())),
            Err(e) => return Err(fail(format!("cannot read the answer: {e}"))),
        }
    }
    match std::str::from_utf8(&line)
        .ok()
        .and_then(|l| l.strip_prefix("OK "))
    {
        Some(n) if n.parse::<u32>().is_ok() => Ok(()),
        _ => Err(fail(format!(
            "unexpected answer {:?}",
            String::from_utf8_lossy(&line)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    #[test]
    fn clip_cuts_at_a_character_boundary() {
        assert_eq!(clip("short".into(), 16), "short");
        let c = clip("é".repeat(100), 16);
        assert!(c.len() <= 16 && c.ends_with('…'), "{c:?}");
        assert_eq!(clip("abcdef".into(), 2), "…");
        let d = clip_report(IdentityDone {
            errors: vec!["e".repeat(MAX_AGENT_TEXT * 2); 100],
            ..IdentityDone::default()
        });
        assert_eq!(d.errors.len(), MAX_AGENT_REPORT_LINES + 1);
        assert!(d.errors.iter().all(|l| l.len() <= MAX_AGENT_TEXT));
    }

    #[tokio::test]
    async fn vsock_handshake_reads_exactly_one_line() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("v.sock");
        let l = UnixListener::bind(&path).unwrap();
        let dev = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = [0u8; 13];
            s.read_exact(&mut buf).await.unwrap();
            assert_eq!(&buf, b"CONNECT 1024\n");
            // The answer and the first agent bytes in one write: the handshake must
            // not swallow the latter.
            s.write_all(b"OK 5000\nAB").await.unwrap();
            s
        });
        let mut s = UnixStream::connect(&path).await.unwrap();
        vsock_handshake(&mut s, 1024).await.unwrap();
        let mut rest = [0u8; 2];
        s.read_exact(&mut rest).await.unwrap();
        assert_eq!(&rest, b"AB");
        drop(dev.await.unwrap());

        let l = UnixListener::bind(t.path().join("w.sock")).unwrap();
        tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            drop(s);
        });
        let mut s = UnixStream::connect(t.path().join("w.sock")).await.unwrap();
        assert!(matches!(
            vsock_handshake(&mut s, 7).await,
            Err(Handshake::Failed(_))
        ));
    }
}
