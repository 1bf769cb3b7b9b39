//! Queue notifications for [`Block`] on the VMM's event loop.

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use log::{debug, warn};

use super::device::Block;
use crate::virtio::VirtioDevice;

impl MutEventSubscriber for Block {
    /// Registers each queue eventfd, tagged with its queue index.
    fn init(&mut self, ops: &mut EventOps) {
        for (idx, evt) in self.queue_events().iter().enumerate() {
            if let Err(e) = ops.add(Events::with_data(evt, idx as u32, EventSet::IN)) {
                warn!("virtio-blk: cannot watch queue {idx} eventfd: {e}");
            }
        }
    }

    /// Drains the notified queue's eventfd and, once activated, serves the queue.
    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        let idx = events.data() as usize;
        let Some(evt) = self.queue_event(idx) else {
            warn!("virtio-blk: event for unknown queue {idx}");
            return;
        };
        // Non-blocking: EAGAIN only means another wakeup already drained it.
        if let Err(e) = evt.read() {
            debug!("virtio-blk: queue {idx} eventfd read: {e}");
        }
        if self.is_activated() {
            if let Err(e) = self.process_queue() {
                warn!("virtio-blk: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use event_manager::{EventManager, SubscriberOps};
    use virtio_bindings::bindings::virtio_blk::{
        VIRTIO_BLK_S_OK, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_IN,
    };

    use super::super::test_utils::*;
    use super::super::QUEUE_SIZE;
    use super::*;
    use crate::virtio::test_ring::Ring;
    use crate::virtio::{INT_VRING, MAX_CHAINS_PER_DISPATCH};

    #[test]
    fn notification_serves_the_queue() {
        let img = TempImage::new(&[3u8; 4096]);
        let mem = guest_memory();
        let vq = MockQueue::new(&mem, QUEUE_SIZE);
        let block = Arc::new(Mutex::new(new_block(&img, false, "")));
        let mut em = EventManager::<Arc<Mutex<Block>>>::new().unwrap();
        em.add_subscriber(block.clone());

        // A notify before activation is drained and ignored.
        block.lock().unwrap().queue_events()[0].write(1).unwrap();
        assert_eq!(em.run_with_timeout(100).unwrap(), 1);
        assert!(block.lock().unwrap().queue_events()[0].read().is_err());

        activate(&mut block.lock().unwrap(), &mem, &vq);
        header(&mem, HDR, VIRTIO_BLK_T_IN, 2);
        let descs = [D(HDR, 16, false), D(DATA, 512, true), D(STATUS, 1, true)];
        vq.add_desc_chains(&chain(&descs, 0), 0).unwrap();
        block.lock().unwrap().queue_events()[0].write(1).unwrap();
        assert_eq!(em.run_with_timeout(100).unwrap(), 1);

        assert_eq!(vq.used().idx().load(), 1);
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK);
        let b = block.lock().unwrap();
        assert_eq!(b.interrupt().status(), INT_VRING);
        assert!(b.queue_events()[0].read().is_err(), "eventfd drained");
    }

    /// A guest that keeps the queue full must not hold one dispatch (and the device
    /// lock) for as long as it likes: each dispatch serves at most the budget and, with
    /// work left, re-kicks the queue's eventfd so the event loop comes back later.
    #[test]
    fn dispatch_is_bounded_and_rekicks_with_work_left() {
        let img = TempImage::new(&[0u8; 4096]);
        let mem = guest_memory();
        // More than 128 outstanding entries: the Ring helper, not MockSplitQueue.
        let ring = Ring::at(0, QUEUE_SIZE);
        let mut b = new_block(&img, false, "");
        let features = b.avail_features();
        b.activate(mem.clone(), features, vec![ring.queue()])
            .unwrap();
        header(&mem, HDR, VIRTIO_BLK_T_FLUSH, 0);
        let flush = chain(&[D(HDR, 16, false), D(STATUS, 1, true)], 0);
        let pending = 200;
        assert!(pending > 3 * MAX_CHAINS_PER_DISPATCH);
        for _ in 0..pending {
            ring.offer(&mem, &flush, 0);
        }
        let kick = b.queue_events()[0].try_clone().unwrap();
        crate::virtio::test_ring::assert_bounded_dispatches(pending, &kick, || {
            b.process_queue().unwrap()
        });
        assert_eq!(ring.used(&mem).len(), pending);
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK);
    }

    /// Through the event loop, the re-kicks finish the job.
    #[test]
    fn event_loop_finishes_a_queue_over_several_dispatches() {
        let img = TempImage::new(&[0u8; 4096]);
        let mem = guest_memory();
        let ring = Ring::at(0, QUEUE_SIZE);
        let mut dev = new_block(&img, false, "");
        let features = dev.avail_features();
        dev.activate(mem.clone(), features, vec![ring.queue()])
            .unwrap();
        let block = Arc::new(Mutex::new(dev));
        let mut em = EventManager::<Arc<Mutex<Block>>>::new().unwrap();
        em.add_subscriber(block.clone());
        header(&mem, HDR, VIRTIO_BLK_T_FLUSH, 0);
        let flush = chain(&[D(HDR, 16, false), D(STATUS, 1, true)], 0);
        for _ in 0..QUEUE_SIZE {
            ring.offer(&mem, &flush, 0);
        }
        block.lock().unwrap().queue_events()[0].write(1).unwrap();
        let mut turns = 0;
        while em.run_with_timeout(100).unwrap() > 0 {
            turns += 1;
            assert!(turns <= usize::from(QUEUE_SIZE), "the queue never drained");
        }
        assert_eq!(ring.used(&mem).len(), usize::from(QUEUE_SIZE));
        assert!(turns >= usize::from(QUEUE_SIZE) / MAX_CHAINS_PER_DISPATCH);
    }
}
