//! virtio-vsock: guest stream sockets whose host side is a Unix socket per VM.
//!
//! The host side follows the "hybrid" model: the device listens on one Unix socket,
//! `uds_path`, and speaks plain Unix streams to host processes.
//!
//! - **Host to guest**: a host process connects to `uds_path` and writes the line
//!   `CONNECT <port>\n` (decimal port, at most [`MAX_CONNECT_LINE`] bytes with the
//!   newline). The device asks the guest for a connection to `<guest_cid>:<port>` from
//!   a host port it allocates. If the guest accepts, the device writes `OK <host_port>\n`
//!   and from then on the stream carries the connection's bytes both ways. If the guest
//!   refuses, does not answer within [`CONNECT_TIMEOUT`], or the line is bad, the device
//!   closes the stream.
//! - **Guest to host**: a guest connection to CID 2 port `P` makes the device connect to
//!   the Unix socket `<uds_path>_<P>`; the connection is refused (RST) if nothing listens
//!   there.
//!
//! Files: `packet` (the header and moving packets through descriptor chains),
//! `handshake` (the `CONNECT` line), `connection` (one stream: credit, buffering,
//! shutdown), `muxer` (the connection table and packet routing), `device` (the
//! [`VirtioDevice`](super::VirtioDevice)) and `event_handler` (its event-loop side).
//!
//! Snapshots (`persist`, [`VsockState`]) keep the guest CID, the negotiated features and
//! a pending transport-reset event, not connections: host streams cannot be carried
//! into another process, so whatever a connection had buffered (host-to-guest bytes not
//! yet in an rx buffer, queued RSTs) is dropped. A restored device starts with no
//! connections; once the VM runs the VMM calls [`Vsock::send_transport_reset`] and the
//! guest drops its side of them. Packets are moved whole within one event-loop
//! dispatch, so a state saved between dispatches has none half done.
//!
//! Every guest value is hostile: malformed packets are dropped or answered with RST, the
//! host never buffers more for a connection than the credit it advertised
//! ([`CONN_BUF_SIZE`]), and the number of connections is bounded (a per-device budget,
//! [`DEFAULT_MAX_CONNECTIONS`] unless set, at most [`MAX_CONNECTIONS`]).

mod connection;
mod device;
mod event_handler;
mod handshake;
mod muxer;
mod packet;
mod persist;
#[cfg(test)]
mod tests;

use std::io;
use std::path::PathBuf;
use std::time::Duration;

pub use device::Vsock;
pub use persist::VsockState;

/// The host's CID, source of every packet the device sends.
pub const HOST_CID: u64 = 2;
/// Maximum size of each of the three queues (rx, tx, event).
pub const QUEUE_SIZE: u16 = 256;
/// Most data bytes in one packet, either way; longer guest packets are refused.
pub const MAX_PKT_DATA: u32 = 64 * 1024;
/// Receive buffer each connection advertises to the guest (`buf_alloc`): the most the
/// host buffers for it when the host stream is slow.
pub const CONN_BUF_SIZE: u32 = 256 * 1024;
/// The highest connection budget a device accepts ([`Vsock::set_max_connections`]).
pub const MAX_CONNECTIONS: usize = 1024;
/// Most live connections (including host connections still sending their `CONNECT`
/// line) unless configured otherwise; more are refused: host streams are closed,
/// guest requests get RST. Each holds one host fd and at most [`CONN_BUF_SIZE`]
/// of buffers, so this bounds both per VM (256 fds, 64 MiB).
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// Longest `CONNECT <port>\n` line, newline included.
pub const MAX_CONNECT_LINE: usize = 32;
/// How long a host stream may take to send its `CONNECT` line, and the guest to answer
/// a connection request.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    #[error("Guest CID {0} is invalid: use 3 to 4294967294")]
    InvalidCid(u64),
    #[error("Vsock socket path {} already exists", .0.display())]
    PathExists(PathBuf),
    #[error("Cannot bind the vsock socket {}", path.display())]
    Bind {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("Cannot create an eventfd")]
    EventFd(#[source] io::Error),
    #[error("Cannot create a timer")]
    Timer(#[source] io::Error),
}
