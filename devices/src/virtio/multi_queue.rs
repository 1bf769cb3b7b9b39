//! What the devices with several queues (vsock, net) share on the queue
//! side: the queues with their guest memory while active, and the two
//! checks every dispatch makes, which mark the device as needing a reset
//! when the driver broke a queue.

use log::warn;
use virtio_queue::{Queue, QueueOwnedT, QueueT};

use super::GuestMemoryMmap;

/// A device's queues while it is active.
pub(crate) struct Active {
    pub(crate) mem: GuestMemoryMmap,
    pub(crate) queues: Vec<Queue>,
}

/// Whether queue `i` can be used now: false if the device is not active or
/// the queue not set up; a broken one sets `needs_reset` (logged as
/// `name`'s).
pub(crate) fn queue_usable(
    active: Option<&mut Active>,
    i: usize,
    needs_reset: &mut bool,
    name: &str,
) -> bool {
    let Some(a) = active else {
        return false;
    };
    match a.queues[i].iter(&a.mem) {
        Ok(_) => true,
        Err(virtio_queue::Error::QueueNotReady) => false,
        Err(e) => {
            warn!("{name}: queue {i} is broken: {e}");
            *needs_reset = true;
            false
        }
    }
}

/// Marks `head` of queue `i` used with `len` bytes; true if the driver
/// wants an interrupt. A used ring that cannot be written sets
/// `needs_reset`.
pub(crate) fn add_used(
    active: Option<&mut Active>,
    i: usize,
    (head, len): (u16, u32),
    needs_reset: &mut bool,
    name: &str,
) -> bool {
    let Some(a) = active else {
        return false;
    };
    let q = &mut a.queues[i];
    match q.add_used(&a.mem, head, len) {
        Ok(()) => q.needs_notification(&a.mem).unwrap_or(true),
        Err(e) => {
            warn!("{name}: queue {i} is broken: {e}");
            *needs_reset = true;
            false
        }
    }
}
