//! virtio-net (device id 1) over a TAP device: the guest's Ethernet frames
//! go to a TAP interface on the host, and the TAP's frames to the guest.
//!
//! Two queues, receive and transmit, of at most [`QUEUE_SIZE`] entries. Each
//! frame carries the 12-byte virtio 1.x header (`virtio_net_hdr_v1`), which
//! the TAP takes as its vnet header: checksum and TCP segmentation offloads
//! (`CSUM`, `GUEST_CSUM`, `HOST_TSO4/6`, `GUEST_TSO4/6`) are offered and
//! passed through to the host kernel. Mergeable receive buffers are not
//! offered: the driver posts buffers a whole frame fits in.
//!
//! The guest is hostile: a chain is walked within the queue size (no
//! indirect tables), a transmit chain must be device-readable and hold a
//! header and at most [`MAX_PACKET`] bytes, a receive chain device-writable;
//! a chain that breaks a rule is returned with length 0 and counted, and
//! never stops the queue. Each dispatch serves at most
//! `MAX_CHAINS_PER_DISPATCH` chains per queue, then the device kicks itself
//! for the rest, so a guest that floods its transmit queue cannot hold the
//! event loop. A frame the TAP cannot take now (its queue is full) is
//! dropped, as a congested link drops it, and counted.
//!
//! It is an `event_manager::MutEventSubscriber`: register it with the
//! event loop and it serves both queues and the TAP.
//!
//! Its state ([`NetState`]) is saved with a snapshot; a restore gives it a
//! TAP of its own, and a MAC of its own if asked.
//!
//! Not built yet (issue 17): the VMM's wiring, the per-sandbox network
//! namespace, and the guest's address after a restore.

mod device;
mod event_handler;
mod persist;
mod tap;

pub use device::{Net, NetStats};
pub use persist::{NetRestoreArgs, NetState};
pub use tap::{Tap, TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6, TUN_F_TSO_ECN};

use std::io;

/// Maximum size of each queue.
pub const QUEUE_SIZE: u16 = 256;
/// The virtio 1.x net header (`virtio_net_hdr_v1`, with `num_buffers`).
pub const HDR_SIZE: usize = 12;
/// Most bytes of one frame with its header: a 64 KiB TCP segment with its
/// Ethernet (and VLAN) header, as Linux's driver sizes its big receive
/// buffers.
pub const MAX_PACKET: usize = 65562;

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("Cannot open the TAP device {0}")]
    Tap(String, #[source] io::Error),
    #[error("Cannot create an eventfd")]
    EventFd(#[source] io::Error),
    #[error("{0:02x?} is not a unicast MAC address")]
    BadMac([u8; 6]),
}

#[cfg(test)]
mod tests;
