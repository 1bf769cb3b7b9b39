//! What every single-queue virtio device (blk, rng) keeps on the queue side:
//! the queue's notify eventfd, the interrupt, the active queue with its guest
//! memory, the broken flag and what a restore recorded. The devices delegate
//! their `VirtioDevice` queue methods here.

use std::io;

use virtio_queue::Queue;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::{ActivateError, GuestMemoryMmap, Interrupt, VirtioDeviceState};

/// The queue while the device is active.
pub(crate) struct Active {
    pub(crate) mem: GuestMemoryMmap,
    pub(crate) queue: Queue,
    pub(crate) acked_features: u64,
}

pub(crate) struct SingleQueue {
    pub(crate) queue_evts: [EventFd; 1],
    pub(crate) interrupt: Interrupt,
    pub(crate) active: Option<Active>,
    /// The device hit a guest error it cannot serve past (DEVICE_NEEDS_RESET).
    pub(crate) needs_reset: bool,
    /// Set by a restore until the transport re-activates the device.
    pub(crate) restored: Option<VirtioDeviceState>,
}

impl SingleQueue {
    pub(crate) fn new() -> io::Result<Self> {
        Ok(Self {
            queue_evts: [EventFd::new(EFD_NONBLOCK)?],
            interrupt: Interrupt::new()?,
            active: None,
            needs_reset: false,
            restored: None,
        })
    }

    /// Takes the one queue the driver set up.
    pub(crate) fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        acked_features: u64,
        mut queues: Vec<Queue>,
    ) -> Result<(), ActivateError> {
        let got = queues.len();
        let (1, Some(queue)) = (got, queues.pop()) else {
            return Err(ActivateError::QueueCount { expected: 1, got });
        };
        // needs_reset is false here unless a restore brought it back: a device
        // only breaks while active, and a reset clears it.
        self.restored = None;
        self.active = Some(Active {
            mem,
            queue,
            acked_features,
        });
        Ok(())
    }

    pub(crate) fn reset(&mut self) {
        self.active = None;
        self.needs_reset = false;
        self.restored = None;
        self.interrupt.clear();
        // A notify that raced with the reset must not be served by the next activation.
        let _ = self.queue_evts[0].read();
    }

    pub(crate) fn active_queues(&self) -> &[Queue] {
        self.active
            .as_ref()
            .map_or(&[], |a| std::slice::from_ref(&a.queue))
    }
}
