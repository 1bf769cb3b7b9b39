//! The descriptor chain walk: a queue whose table and available ring come from the
//! input, walked by virtio-queue (direct, indirect, loops, bad `next`) the way the
//! devices do, then served by the virtio-rng device, whose chain handling is the
//! simplest device-side walk.

#![no_main]

use devices::virtio::rng::Rng;
use devices::virtio::{VirtioDevice, VIRTIO_F_VERSION_1};
use libfuzzer_sys::fuzz_target;
use sprout_fuzz::{fill_data, guest_memory, place_queue, QUEUE_SPAN};
use virtio_queue::{QueueOwnedT, QueueT};

const RAM: u64 = 0x1_0000;

fuzz_target!(|data: &[u8]| {
    let mut input = data;
    let mem = guest_memory(RAM as usize);
    let mut q = place_queue(&mem, 0, &mut input);
    fill_data(&mem, QUEUE_SPAN, RAM, input);
    // The same queue again for the device (the raw walk below moves this one on).
    let queue_for_device = place_queue(&mem, 0, &mut &data[..]);

    // The raw walk.
    if let Ok(iter) = q.iter(&mem) {
        let mut heads = Vec::new();
        for chain in iter {
            let head = chain.head_index();
            let mut total = 0u64;
            let mut n = 0usize;
            for d in chain.clone() {
                n += 1;
                // A chain is bounded by the queue size plus one indirect table
                // (at most 2^16 - 1 entries).
                assert!(n <= 256 + usize::from(u16::MAX), "chain walk did not stop");
                total += u64::from(d.len());
            }
            let readable = chain.clone().readable().count();
            let writable = chain.writable().count();
            assert!(readable + writable <= n);
            let _ = total;
            heads.push(head);
        }
        for head in heads {
            let _ = q.add_used(&mem, head, 0);
        }
    }

    // The device's walk over the same queue.
    let mut rng = Rng::new().expect("rng");
    if rng
        .activate(mem.clone(), VIRTIO_F_VERSION_1, vec![queue_for_device])
        .is_ok()
    {
        let _ = rng.process_queue();
        let _ = rng.process_queue();
    }
});
