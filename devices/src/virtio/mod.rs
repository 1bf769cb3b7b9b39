//! virtio devices and the virtio-mmio transport they are reached through.
//!
//! A device implements [`VirtioDevice`] (what the transport needs) and
//! `event_manager::MutEventSubscriber` (its queue and backend events, handled on
//! the VMM's event-loop thread). The device owns one [`EventFd`] per queue: the VMM
//! registers each with KVM as an ioeventfd on the transport's QueueNotify register,
//! and the transport also writes it when a notify reaches it as an MMIO exit.

use std::io;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use virtio_queue::Queue;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::state::StateError;

/// Guest memory as devices see it: every write made through it (a device
/// filling a buffer) is recorded in a per-page dirty bitmap, which diff
/// snapshots combine with KVM's own dirty log.
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<vm_memory::bitmap::AtomicBitmap>;

pub mod block;
pub(crate) mod chain;
pub mod mmio;
mod multi_queue;
pub mod net;
pub mod rng;
mod single_queue;
#[cfg(test)]
pub(crate) mod test_ring;
pub mod vsock;

/// virtio device ids.
pub const TYPE_NET: u32 = 1;
pub const TYPE_BLOCK: u32 = 2;
pub const TYPE_RNG: u32 = 4;
pub const TYPE_VSOCK: u32 = 19;

/// Interrupt status bits (virtio-mmio InterruptStatus).
pub const INT_VRING: u32 = 0x1;
pub const INT_CONFIG: u32 = 0x2;

/// Feature bit every device offers: the device is virtio 1.x.
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;

/// Feature bit for indirect descriptor tables. No device offers it, and descriptor
/// chains with an indirect descriptor are refused (see `chain`).
pub const VIRTIO_F_INDIRECT_DESC: u64 = 1 << 28;

/// Most descriptor chains a device takes from one queue in one event-loop dispatch.
/// A guest that keeps bumping the avail index would otherwise hold the dispatch (and
/// the device lock) as long as it liked. A device that spends the budget with work
/// left re-kicks itself (writes an eventfd it watches), so the event loop comes back
/// to the queue after the other ready events.
pub(crate) const MAX_CHAINS_PER_DISPATCH: usize = 64;

/// A device's interrupt line: a status word the transport exposes, and an
/// eventfd the VMM routes to the device's GSI with KVM irqfd.
#[derive(Debug)]
pub struct Interrupt {
    status: InterruptStatus,
    evt: EventFd,
}

/// The status word of an [`Interrupt`], shared between the device and its transport:
/// the driver's InterruptStatus reads and InterruptACK writes use it without the
/// device lock, so they never wait behind a dispatch that holds it.
#[derive(Debug, Clone, Default)]
pub struct InterruptStatus(Arc<AtomicU32>);

impl InterruptStatus {
    pub fn get(&self) -> u32 {
        self.0.load(Ordering::SeqCst)
    }

    /// The guest acknowledged these bits.
    pub fn ack(&self, bits: u32) {
        self.0.fetch_and(!bits, Ordering::SeqCst);
    }
}

impl Interrupt {
    pub fn new() -> io::Result<Self> {
        Ok(Self {
            status: InterruptStatus::default(),
            evt: EventFd::new(EFD_NONBLOCK)?,
        })
    }

    /// Sets `kind` (`INT_VRING` or `INT_CONFIG`) in the status and raises the line.
    pub fn trigger(&self, kind: u32) -> io::Result<()> {
        self.status.0.fetch_or(kind, Ordering::SeqCst);
        self.evt.write(1)
    }

    pub fn status(&self) -> u32 {
        self.status.get()
    }

    /// A handle on the status word, for the transport.
    pub fn shared_status(&self) -> InterruptStatus {
        self.status.clone()
    }

    /// The guest acknowledged these bits.
    pub fn ack(&self, bits: u32) {
        self.status.ack(bits);
    }

    pub fn clear(&self) {
        self.status.0.store(0, Ordering::SeqCst);
    }

    /// Restores a saved status; a non-zero one raises the line once more (the guest
    /// may not have seen it before the snapshot; a spurious interrupt is harmless).
    pub fn restore_status(&self, bits: u32) -> io::Result<()> {
        self.status.0.store(bits, Ordering::SeqCst);
        if bits != 0 {
            self.evt.write(1)?;
        }
        Ok(())
    }

    pub fn eventfd(&self) -> &EventFd {
        &self.evt
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    #[error("Device needs {expected} queues, driver set up {got}")]
    QueueCount { expected: usize, got: usize },
    #[error("Device backend failed to start")]
    Backend(#[source] io::Error),
}

/// The part of a virtio device's saved state every device has: whether the driver had
/// activated it, with which features, and whether it had found the driver's queues
/// broken (DEVICE_NEEDS_RESET). Embedded in each device's own state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VirtioDeviceState {
    pub activated: bool,
    pub acked_features: u64,
    pub needs_reset: bool,
}

impl VirtioDeviceState {
    /// Checks the values a device of kind `what` offering `avail_features` could have.
    pub(crate) fn validate(
        &self,
        what: &'static str,
        avail_features: u64,
    ) -> Result<(), StateError> {
        if self.activated {
            let unoffered = self.acked_features & !avail_features;
            if unoffered != 0 {
                return Err(StateError::invalid(
                    what,
                    format!("acked features {unoffered:#x} were never offered"),
                ));
            }
        } else if self.acked_features != 0 || self.needs_reset {
            return Err(StateError::invalid(
                what,
                "an inactive device has acked features or needs a reset",
            ));
        }
        Ok(())
    }
}

/// What the virtio-mmio transport needs from a device.
pub trait VirtioDevice: Send {
    /// One of the `TYPE_*` ids.
    fn device_type(&self) -> u32;
    /// Largest size of each queue; its length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Feature bits the device offers (include `VIRTIO_F_VERSION_1`).
    fn avail_features(&self) -> u64;
    /// Reads device config space; bytes past its end read as zero.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Writes device config space; the default ignores writes.
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
    /// The driver set DRIVER_OK: start serving these queues with the negotiated features.
    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        acked_features: u64,
        queues: Vec<Queue>,
    ) -> Result<(), ActivateError>;
    /// The driver wrote 0 to Status: drop the queues and go back to the initial state.
    fn reset(&mut self);
    /// One eventfd per queue, signalled when the driver notifies that queue.
    fn queue_events(&self) -> &[EventFd];
    /// The device's interrupt line.
    fn interrupt(&self) -> &Interrupt;
    /// The device hit a guest error it cannot serve past (DEVICE_NEEDS_RESET).
    fn needs_reset(&self) -> bool {
        false
    }
    fn is_activated(&self) -> bool;
    /// The queues the device serves, with their live ring indices (the transport's own
    /// copies stop at DRIVER_OK); empty before activation. Read by the transport's
    /// `save_state`.
    fn active_queues(&self) -> &[Queue];
    /// What the device's own restore recorded about its activation, until the
    /// transport's restore re-activates it (or a reset); `None` for a device that was
    /// not restored. `MmioTransport::restore` checks it against the transport's state.
    fn restored_state(&self) -> Option<VirtioDeviceState>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interrupt_status_and_ack() {
        let i = Interrupt::new().unwrap();
        i.trigger(INT_VRING).unwrap();
        i.trigger(INT_CONFIG).unwrap();
        assert_eq!(i.status(), INT_VRING | INT_CONFIG);
        assert_eq!(i.eventfd().read().unwrap(), 2);
        i.ack(INT_VRING);
        assert_eq!(i.status(), INT_CONFIG);
    }
}
