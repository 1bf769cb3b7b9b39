//! virtio-rng (entropy device): fills the driver's device-writable buffers with bytes
//! from /dev/urandom.
//!
//! Limits: one queue of at most [`QUEUE_SIZE`] entries; at most [`MAX_CHAIN_BYTES`] bytes
//! per chain (the driver asks again for more). A chain with a device-readable
//! descriptor, a buffer outside guest RAM, or that is cut short (loop, bad `next`) is
//! returned with used length 0.
//!
//! Chains are filled whole within one event-loop dispatch, so a saved state
//! ([`RngState`]) never has one half done.

mod device;
mod event_handler;
mod persist;

use std::io;

pub use device::Rng;
pub use persist::RngState;

/// Maximum size of the request queue.
pub const QUEUE_SIZE: u16 = 256;
/// Most bytes filled per descriptor chain.
pub const MAX_CHAIN_BYTES: u32 = 64 * 1024;
/// The entropy source.
pub const ENTROPY_SOURCE: &str = "/dev/urandom";

#[derive(Debug, thiserror::Error)]
pub enum RngError {
    #[error("Cannot open {ENTROPY_SOURCE}")]
    Open(#[source] io::Error),
    #[error("Cannot create an eventfd")]
    EventFd(#[source] io::Error),
    #[error("Request queue is broken, the device needs a reset")]
    QueueBroken(#[source] virtio_queue::Error),
}
