//! What every single-queue virtio device (blk, rng) keeps on the queue side:
//! the queue's notify eventfd, the interrupt, the active queue with its guest
//! memory, the broken flag and what a restore recorded. The devices delegate
//! their `VirtioDevice` queue methods here, and serve the queue with
//! [`SingleQueue::serve`], which bounds each dispatch.

use std::io;
use std::sync::atomic::Ordering;

use log::warn;
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::chain::Table;
use super::{
    ActivateError, GuestMemoryMmap, Interrupt, VirtioDeviceState, INT_CONFIG, INT_VRING,
    MAX_CHAINS_PER_DISPATCH,
};

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
        // Chains may already wait: after a restore, the guest's notify (or a bounded
        // dispatch's re-kick) went to the old process's eventfd. A dispatch that finds
        // nothing is harmless.
        if let Err(e) = self.queue_evts[0].write(1) {
            warn!("cannot kick a queue at activation: {e}");
        }
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

    /// Serves available chains with `serve_chain` (which returns the used length), at
    /// most [`MAX_CHAINS_PER_DISPATCH`] of them; with the budget spent and chains left,
    /// writes the queue's own eventfd so the event loop comes back after the other
    /// ready events. Raises INT_VRING if any chain completed. Returns how many did.
    ///
    /// Does nothing before activation, on a queue the driver left unready, or once the
    /// queue is broken. A broken queue (avail index ahead by more than the queue size,
    /// a head index outside the table, a used ring that cannot be written) sets
    /// DEVICE_NEEDS_RESET, raises INT_CONFIG and returns the queue's error.
    pub(crate) fn serve(
        &mut self,
        name: &str,
        mut serve_chain: impl FnMut(DescriptorChain<&GuestMemoryMmap>, Table, &GuestMemoryMmap) -> u32,
    ) -> Result<usize, virtio_queue::Error> {
        if self.needs_reset {
            return Ok(0);
        }
        let Some(active) = self.active.as_mut() else {
            return Ok(0);
        };
        if !active.queue.ready() {
            return Ok(0);
        }
        let mem = &active.mem;
        let table = Table::of(&active.queue);
        let mut used = 0usize;
        // Ok(true): the budget is spent.
        let result = loop {
            if used == MAX_CHAINS_PER_DISPATCH {
                break Ok(true);
            }
            let chain = match active.queue.iter(mem) {
                Ok(mut avail) => avail.next(),
                Err(e) => break Err(e),
            };
            let Some(chain) = chain else {
                break Ok(false);
            };
            let head = chain.head_index();
            let len = serve_chain(chain, table, mem);
            if let Err(e) = active.queue.add_used(mem, head, len) {
                break Err(e);
            }
            used += 1;
        };
        // Without EVENT_IDX this is always true; a failure to read the ring just
        // means "notify".
        if used > 0 && active.queue.needs_notification(mem).unwrap_or(true) {
            signal(&self.interrupt, name, INT_VRING);
        }
        match result {
            Ok(spent) => {
                // An unreadable avail index counts as work left: the next dispatch
                // reports the broken queue.
                let more = || {
                    active
                        .queue
                        .avail_idx(mem, Ordering::Acquire)
                        .map_or(true, |idx| idx.0 != active.queue.next_avail())
                };
                if spent && more() {
                    if let Err(e) = self.queue_evts[0].write(1) {
                        warn!("{name}: cannot re-kick the queue: {e}");
                    }
                }
                Ok(used)
            }
            Err(e) => {
                warn!("{name}: request queue broken: {e}");
                self.needs_reset = true;
                signal(&self.interrupt, name, INT_CONFIG);
                Err(e)
            }
        }
    }

    pub(crate) fn active_queues(&self) -> &[Queue] {
        self.active
            .as_ref()
            .map_or(&[], |a| std::slice::from_ref(&a.queue))
    }
}

fn signal(interrupt: &Interrupt, name: &str, kind: u32) {
    if let Err(e) = interrupt.trigger(kind) {
        warn!("{name}: cannot raise interrupt: {e}");
    }
}
