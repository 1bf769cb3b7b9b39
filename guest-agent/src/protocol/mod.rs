//! The agent's wire protocol: framing ([`frame`]) and messages ([`messages`]).
//!
//! Free of any I/O runtime: the agent and the host client drive it with tokio, the fuzz
//! target calls [`decode`] on raw bytes. `docs/protocol.md` is the reference.
//!
//! A frame is a fixed [`HEADER_LEN`]-byte header (magic, version, kind, request id,
//! payload length, all little endian) followed by a postcard-encoded payload of at most
//! [`MAX_PAYLOAD`] bytes. The header is checked (magic, version, length bound) before a
//! single payload byte is awaited or allocated.

mod frame;
mod messages;

pub use frame::{decode, decode_message, encode, encode_into, Frame, Header};
pub use messages::*;

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"SPAG";
/// The protocol version this build speaks (and the only one it accepts).
///
/// 1: exec, files, identity. 2: background processes (`Exec.background`, `Attach`,
/// `ProcStdin`, `ProcList` and their answers).
pub const VERSION: u16 = 2;
/// Size of the frame header.
pub const HEADER_LEN: usize = 20;
/// Largest payload of one frame. Data moves in chunks of at most [`MAX_CHUNK`] bytes,
/// well below it.
pub const MAX_PAYLOAD: u32 = 1 << 20;
/// Largest data chunk (exec output, stdin, file data) either side sends in one frame.
pub const MAX_CHUNK: usize = 256 * 1024;
/// Longest path, in bytes, a request may name.
pub const MAX_PATH: usize = 4096;
/// Default per-stream output cap of an exec (stdout and stderr each).
pub const DEFAULT_OUTPUT_LIMIT: u64 = 16 << 20;
/// Longest command line a process listing shows, in bytes.
pub const MAX_PROC_COMMAND: usize = 1024;
/// Default bound, in bytes, of a background process's ring of events.
pub const DEFAULT_RING_BYTES: usize = 1 << 20;
/// Default number of finished background processes kept (oldest evicted first).
pub const DEFAULT_MAX_FINISHED: usize = 64;
/// Vsock port the agent listens on in a VM.
pub const DEFAULT_VSOCK_PORT: u32 = 1024;
/// Bytes of entropy an identity refresh carries.
pub const IDENTITY_ENTROPY_LEN: usize = 64;
/// Most name servers a [`NetConfigure`] may carry.
pub const MAX_NET_DNS: usize = 4;
/// Longest network interface name, in bytes (Linux's `IFNAMSIZ` less its NUL).
pub const MAX_IFNAME: usize = 15;

#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("Bad frame magic {0:02x?}: not a Sprout agent stream")]
    BadMagic([u8; 4]),
    #[error("Unsupported protocol version {got}: this side speaks version {VERSION}")]
    UnsupportedVersion { got: u16 },
    #[error("Frame payload of {len} bytes is over the limit of {MAX_PAYLOAD}")]
    TooLarge { len: u64 },
    #[error("Unknown message kind {0:#06x}")]
    UnknownKind(u16),
    #[error("Malformed payload for message kind {kind:#06x}")]
    Payload {
        kind: u16,
        #[source]
        source: postcard::Error,
    },
    #[error("Payload for message kind {kind:#06x} has {extra} trailing bytes")]
    TrailingBytes { kind: u16, extra: usize },
    #[error("Cannot encode message kind {kind:#06x}")]
    Encode {
        kind: u16,
        #[source]
        source: postcard::Error,
    },
}
