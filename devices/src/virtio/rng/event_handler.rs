//! Queue notifications for [`Rng`] on the VMM's event loop.

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use log::{debug, warn};

use super::device::Rng;
use crate::virtio::VirtioDevice;

impl MutEventSubscriber for Rng {
    /// Registers each queue eventfd, tagged with its queue index.
    fn init(&mut self, ops: &mut EventOps) {
        for (idx, evt) in self.queue_events().iter().enumerate() {
            if let Err(e) = ops.add(Events::with_data(evt, idx as u32, EventSet::IN)) {
                warn!("virtio-rng: cannot watch queue {idx} eventfd: {e}");
            }
        }
    }

    /// Drains the notified queue's eventfd and, once activated, serves the queue.
    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        let idx = events.data() as usize;
        let Some(evt) = self.queue_events().get(idx) else {
            warn!("virtio-rng: event for unknown queue {idx}");
            return;
        };
        // Non-blocking: EAGAIN only means another wakeup already drained it.
        if let Err(e) = evt.read() {
            debug!("virtio-rng: queue {idx} eventfd read: {e}");
        }
        if self.is_activated() {
            if let Err(e) = self.process_queue() {
                warn!("virtio-rng: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use event_manager::{EventManager, SubscriberOps};
    use virtio_bindings::bindings::virtio_ring::VRING_DESC_F_WRITE;
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::Queue;
    use vm_memory::GuestAddress;

    use super::*;
    use crate::virtio::GuestMemoryMmap;
    use crate::virtio::INT_VRING;

    #[test]
    fn notification_serves_the_queue() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let vq = MockSplitQueue::new(&mem, 16);
        let rng = Arc::new(Mutex::new(Rng::new().unwrap()));
        let mut em = EventManager::<Arc<Mutex<Rng>>>::new().unwrap();
        em.add_subscriber(rng.clone());

        let q: Queue = vq.create_queue().unwrap();
        rng.lock()
            .unwrap()
            .activate(mem.clone(), 0, vec![q])
            .unwrap();
        let desc = Descriptor::new(0x8000, 64, VRING_DESC_F_WRITE as u16, 0);
        vq.add_desc_chains(&[RawDescriptor::from(desc)], 0).unwrap();
        rng.lock().unwrap().queue_events()[0].write(1).unwrap();
        assert_eq!(em.run_with_timeout(100).unwrap(), 1);

        assert_eq!(vq.used().idx().load(), 1);
        assert_eq!(vq.used().ring().ref_at(0).unwrap().load().len(), 64);
        let r = rng.lock().unwrap();
        assert_eq!(r.interrupt().status(), INT_VRING);
        assert!(r.queue_events()[0].read().is_err(), "eventfd drained");
    }
}
