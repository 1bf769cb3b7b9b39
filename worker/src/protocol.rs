//! The worker control protocol: typed, versioned, length-prefixed frames on a
//! Unix stream socket. Both sides use this module.
//!
//! A frame is a 12-byte header then a postcard payload:
//!
//! ```text
//! offset 0  magic    b"SPWK"
//!        4  version  u16 LE  (PROTOCOL_VERSION)
//!        6  flags    u16 LE  (0)
//!        8  length   u32 LE  payload bytes, at most MAX_FRAME
//!       12  payload  postcard(Request) from the client, postcard(Response) back
//! ```
//!
//! One request at a time per connection, each answered by one response, in
//! order. The length is checked before anything is allocated. A bad magic,
//! an unknown version, an oversized length or a payload that does not decode
//! is answered (best effort) with an [`ErrorCode`] and the connection is
//! closed; other connections are not affected.

use std::io::{self, Read, Write};
use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

pub const MAGIC: [u8; 4] = *b"SPWK";
/// Bumped whenever a message changes shape (2: a disk's base in
/// [`vmm::config::DiskConfig`]). A worker of another version (one a previous
/// sproutd left) is reported as speaking that version.
pub const PROTOCOL_VERSION: u16 = 2;
pub const HEADER_LEN: usize = 12;
/// Largest payload either side accepts.
pub const MAX_FRAME: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("Connection error")]
    Io(#[from] io::Error),
    #[error("Not a worker protocol frame (magic {0:02x?})")]
    BadMagic([u8; 4]),
    #[error("Protocol version {0} is not spoken here (this side speaks {PROTOCOL_VERSION})")]
    Version(u16),
    #[error("Frame of {0} bytes is over the {MAX_FRAME}-byte limit")]
    TooLarge(u64),
    #[error("Frame payload does not decode")]
    Decode(#[source] postcard::Error),
    #[error("Cannot encode a frame")]
    Encode(#[source] postcard::Error),
}

impl FrameError {
    /// The code a peer is told before the connection closes.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Io(_) => ErrorCode::Io,
            Self::BadMagic(_) => ErrorCode::BadFrame,
            Self::Version(_) => ErrorCode::UnsupportedVersion,
            Self::TooLarge(_) => ErrorCode::FrameTooLarge,
            Self::Decode(_) => ErrorCode::BadRequest,
            Self::Encode(_) => ErrorCode::Internal,
        }
    }
}

/// Encodes `msg` as one frame.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, FrameError> {
    let mut out = vec![0u8; HEADER_LEN];
    out = postcard::to_extend(msg, out).map_err(FrameError::Encode)?;
    let len = out.len() - HEADER_LEN;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len as u64));
    }
    out[0..4].copy_from_slice(&MAGIC);
    out[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out[8..12].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(out)
}

pub fn write_frame<T: Serialize>(w: &mut impl Write, msg: &T) -> Result<(), FrameError> {
    w.write_all(&encode(msg)?)?;
    Ok(())
}

/// Reads one frame; `Ok(None)` at a clean end of stream (before a header).
pub fn read_frame<T: DeserializeOwned>(r: &mut impl Read) -> Result<Option<T>, FrameError> {
    let mut h = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match r.read(&mut h[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let len = parse_header(&h)?;
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)?;
    decode(&payload).map(Some)
}

/// Checks a header; the payload length it announces.
pub fn parse_header(h: &[u8; HEADER_LEN]) -> Result<usize, FrameError> {
    let magic = [h[0], h[1], h[2], h[3]];
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != PROTOCOL_VERSION {
        return Err(FrameError::Version(version));
    }
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len as u64));
    }
    Ok(len)
}

/// Decodes a payload; trailing bytes are refused.
pub fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, FrameError> {
    let (v, rest) = postcard::take_from_bytes(payload).map_err(FrameError::Decode)?;
    if !rest.is_empty() {
        return Err(FrameError::Decode(postcard::Error::DeserializeBadEncoding));
    }
    Ok(v)
}

/// Guest memory restore backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Backend {
    Mmap,
    Uffd,
}

impl From<Backend> for vmm::MemoryBackend {
    fn from(b: Backend) -> Self {
        match b {
            Backend::Mmap => vmm::MemoryBackend::Mmap,
            Backend::Uffd => vmm::MemoryBackend::Uffd,
        }
    }
}

/// What to boot: the machine of [`vmm::config::VmSpec`] and its instance id.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootSpec {
    pub spec: vmm::config::VmSpec,
    pub instance_id: Option<u64>,
}

/// What to restore, and how.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoreSpec {
    /// A snapshot or fork layer directory.
    pub dir: PathBuf,
    pub backend: Backend,
    /// Where the restored VM's vsock device listens (needed if it has one).
    pub vsock_uds: Option<PathBuf>,
    /// The new VM's instance id; a random one if `None`.
    pub instance_id: Option<u64>,
    /// uffd: prefetch the snapshot's recorded working set.
    pub prefetch: bool,
    /// The TAP and MAC of the restored VM's network device (needed if the
    /// snapshot has one; its own MAC is replaced by this one).
    #[serde(default)]
    pub net: Option<vmm::config::NetConfig>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Who and what this worker is: answered with [`Response::Description`].
    Describe,
    /// Boots a VM (the worker must hold none).
    Boot(BootSpec),
    /// Restores a durable snapshot into this worker (into its shell if ready).
    Restore(RestoreSpec),
    Pause,
    Resume,
    /// Writes a snapshot into `dir`, which must not exist.
    Snapshot {
        dir: PathBuf,
        diff: bool,
    },
    /// Fork step 1: writes a fork layer under `scratch_dir`; answered with
    /// [`Response::ForkLayer`].
    WriteForkLayer {
        scratch_dir: PathBuf,
    },
    /// Fork step 2: restores a fork layer into this (ready) worker.
    RestoreForkLayer(RestoreSpec),
    /// Stops the VM; the worker exits once it has answered.
    Stop,
    Metrics,
    /// The test guest's mailbox: one call on vCPU `cpu`.
    Mailbox {
        cpu: u8,
        cmd: u32,
        args: [u64; 4],
        timeout_ms: u32,
    },
    /// What each vCPU does (counters, and registers read in a moment's
    /// pause): answered with [`Response::Vcpus`]. For a watchdog that must
    /// tell a spinning guest from a vCPU that never runs.
    Vcpus,
    /// [`Request::Restore`], with read-only disk `i`'s image read at
    /// `images[i]` rather than where the snapshot recorded it
    /// ([`vmm::RestoreOptions::image_paths`]). Last: a new kind, so every
    /// other message keeps its encoding (no version bump).
    RestoreOver {
        spec: RestoreSpec,
        images: std::collections::BTreeMap<usize, PathBuf>,
    },
}

impl Request {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Describe => "describe",
            Self::Boot(_) => "boot",
            Self::Restore(_) => "restore",
            Self::Pause => "pause",
            Self::Resume => "resume",
            Self::Snapshot { .. } => "snapshot",
            Self::WriteForkLayer { .. } => "write_fork_layer",
            Self::RestoreForkLayer(_) => "restore_fork_layer",
            Self::Stop => "stop",
            Self::Metrics => "metrics",
            Self::Mailbox { .. } => "mailbox",
            Self::Vcpus => "vcpus",
            Self::RestoreOver { .. } => "restore_over",
        }
    }
}

/// A worker's state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WorkerState {
    /// No VM; a shell of `shape` is built and waits for a restore.
    Ready,
    /// No VM and no shell (a restore into the shell failed, or none was asked for).
    Empty,
    /// A VM is built but has not run yet.
    Created,
    Running,
    Paused,
    /// The VM has ended; the worker is about to exit.
    Exited(String),
    /// The VMM could not bring every vCPU into one state.
    Failed(String),
}

impl std::fmt::Display for WorkerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Ready => f.write_str("ready"),
            Self::Empty => f.write_str("empty"),
            Self::Created => f.write_str("created"),
            Self::Running => f.write_str("running"),
            Self::Paused => f.write_str("paused"),
            Self::Exited(r) => write!(f, "exited {r}"),
            Self::Failed(r) => write!(f, "failed {r}"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shape {
    pub vcpus: u8,
    pub mem_mib: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum GuestKind {
    /// Sprout's test guest (a mailbox, no agent).
    TestGuest,
    /// A Linux guest (the agent on vsock, if its image has one).
    Linux,
}

/// Where the VM comes from.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineageInfo {
    /// The snapshot or fork layer the next layer builds on.
    pub parent: Option<PathBuf>,
    /// Layers in the parent's chain.
    pub depth: usize,
    /// Fork layers this worker holds a lease on.
    pub fork_layers: Vec<PathBuf>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Description {
    pub protocol: u16,
    pub pid: u32,
    /// When the worker process started, Unix time in milliseconds.
    pub started_at_ms: u64,
    pub socket: PathBuf,
    pub state: WorkerState,
    pub shape: Option<Shape>,
    pub instance_id: Option<u64>,
    pub guest: Option<GuestKind>,
    pub config: Option<vmm::config::VmSpec>,
    pub lineage: LineageInfo,
    pub vsock_uds: Option<PathBuf>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkLayerInfo {
    pub dir: PathBuf,
    pub diff: bool,
    pub depth: usize,
    /// How long the parent was paused to write it.
    pub pause_us: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Metrics {
    /// Resident and proportional set size of the whole worker process.
    pub rss_kib: u64,
    pub pss_kib: u64,
    /// Memory this process wrote that no other process shares (guest pages
    /// it dirtied, plus the VMM's own heap).
    pub private_dirty_kib: u64,
    /// CPU time of the vCPU threads, user plus system.
    pub vcpu_time_us: u64,
    /// How long the last snapshot or fork layer kept the vCPUs paused.
    pub last_pause_us: u64,
    /// uffd restores: pages served by fault and by prefetch.
    pub uffd_faults: Option<u64>,
    pub uffd_prefetched: Option<u64>,
}

/// A stable error code: clients branch on these, never on messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorCode {
    /// Not a frame of this protocol.
    BadFrame,
    UnsupportedVersion,
    FrameTooLarge,
    /// A frame that decodes to no valid request, or a request with bad values.
    BadRequest,
    /// The request is impossible in the worker's state (the answer says which).
    InvalidState,
    /// The worker holds no VM.
    NoVm,
    /// The worker already holds a VM.
    HasVm,
    /// The snapshot's shape differs from the worker's shell.
    ShapeMismatch,
    /// A diff snapshot without an earlier one.
    NoParent,
    /// A durable diff on a fork layer, which is not kept.
    EphemeralParent,
    /// A snapshot or layer that is missing, corrupt or inconsistent.
    BadSnapshot,
    /// A fork layer released by its last user.
    LayerGone,
    /// The request does not apply to this guest (a mailbox call to Linux).
    NotSupported,
    Timeout,
    Io,
    Kvm,
    /// The worker is ending.
    Ending,
    Internal,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::BadFrame => "bad_frame",
            Self::UnsupportedVersion => "unsupported_version",
            Self::FrameTooLarge => "frame_too_large",
            Self::BadRequest => "bad_request",
            Self::InvalidState => "invalid_state",
            Self::NoVm => "no_vm",
            Self::HasVm => "has_vm",
            Self::ShapeMismatch => "shape_mismatch",
            Self::NoParent => "no_parent",
            Self::EphemeralParent => "ephemeral_parent",
            Self::BadSnapshot => "bad_snapshot",
            Self::LayerGone => "layer_gone",
            Self::NotSupported => "not_supported",
            Self::Timeout => "timeout",
            Self::Io => "io",
            Self::Kvm => "kvm",
            Self::Ending => "ending",
            Self::Internal => "internal",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message} ({code})")]
pub struct WorkerError {
    pub code: ErrorCode,
    pub message: String,
}

impl WorkerError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    Ok,
    Description(Box<Description>),
    ForkLayer(ForkLayerInfo),
    Metrics(Metrics),
    Mailbox { status: u32, rets: [u64; 4] },
    Error(WorkerError),
    Vcpus(Vec<vmm::VcpuReport>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let reqs = [
            Request::Describe,
            Request::Snapshot {
                dir: "/tmp/x".into(),
                diff: true,
            },
            Request::RestoreForkLayer(RestoreSpec {
                dir: "/tmp/l".into(),
                backend: Backend::Uffd,
                vsock_uds: Some("/tmp/v".into()),
                instance_id: Some(u64::MAX),
                prefetch: false,
                net: None,
            }),
            Request::RestoreOver {
                spec: RestoreSpec {
                    dir: "/tmp/s".into(),
                    backend: Backend::Mmap,
                    vsock_uds: None,
                    instance_id: None,
                    prefetch: true,
                    net: None,
                },
                images: [(0, "/i/a.ext4".into()), (3, "/i/b.ext4".into())].into(),
            },
            Request::Mailbox {
                cpu: 1,
                cmd: 2,
                args: [3, 4, 5, 6],
                timeout_ms: 7,
            },
        ];
        for r in reqs {
            let f = encode(&r).unwrap();
            let back: Request = read_frame(&mut f.as_slice()).unwrap().unwrap();
            assert_eq!(back, r);
        }
        let e = Response::Error(WorkerError::new(ErrorCode::InvalidState, "paused"));
        let f = encode(&e).unwrap();
        assert_eq!(read_frame::<Response>(&mut f.as_slice()).unwrap(), Some(e));
    }

    #[test]
    fn bad_headers_are_refused_before_allocating() {
        let good = encode(&Request::Describe).unwrap();
        let mut bad = good.clone();
        bad[0] = b'X';
        assert!(matches!(
            read_frame::<Request>(&mut bad.as_slice()),
            Err(FrameError::BadMagic(_))
        ));
        let mut other = good.clone();
        other[4..6].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
        let e = read_frame::<Request>(&mut other.as_slice()).unwrap_err();
        assert_eq!(e.code(), ErrorCode::UnsupportedVersion);
        let mut huge = good.clone();
        huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        // Only the header is there: a reader that allocated first would
        // have tried 4 GiB.
        let e = read_frame::<Request>(&mut &huge[..HEADER_LEN]).unwrap_err();
        assert_eq!(e.code(), ErrorCode::FrameTooLarge);
        let mut trailing = good.clone();
        trailing.push(0);
        trailing[8..12].copy_from_slice(&((good.len() - HEADER_LEN + 1) as u32).to_le_bytes());
        assert_eq!(
            read_frame::<Request>(&mut trailing.as_slice())
                .unwrap_err()
                .code(),
            ErrorCode::BadRequest
        );
        assert!(read_frame::<Request>(&mut &[][..]).unwrap().is_none());
        assert!(matches!(
            read_frame::<Request>(&mut &good[..5]),
            Err(FrameError::Io(_))
        ));
    }

    #[test]
    fn random_payloads_never_panic() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for n in 0..20_000usize {
            let len = n % 200;
            let buf: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let _ = decode::<Request>(&buf);
            let _ = decode::<Response>(&buf);
        }
    }
}
