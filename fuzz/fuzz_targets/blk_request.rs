//! virtio-blk request parsing and serving: chains (header, data, status) from the
//! input against a 64 KiB in-memory disk.

#![no_main]

use devices::virtio::block::{Block, SECTOR_SIZE};
use devices::virtio::{VirtioDevice, VIRTIO_F_VERSION_1};
use libfuzzer_sys::fuzz_target;
use sprout_fuzz::{fill_data, guest_memory, place_queue, take_u8, MemDisk, QUEUE_SPAN};

const RAM: u64 = 0x1_0000;
const DISK: usize = 128 * SECTOR_SIZE as usize;

fuzz_target!(|data: &[u8]| {
    let mut input = data;
    let flags = take_u8(&mut input);
    let mem = guest_memory(RAM as usize);
    let q = place_queue(&mem, 0, &mut input);
    fill_data(&mem, QUEUE_SPAN, RAM, input);

    let disk = MemDisk(vec![0x5a; DISK]);
    let read_only = flags & 1 != 0;
    let mut blk = Block::with_backend(Box::new(disk), read_only, "fuzz").expect("block");
    let features = blk.avail_features() | VIRTIO_F_VERSION_1;
    if blk.activate(mem.clone(), features, vec![q]).is_err() {
        return;
    }
    let _ = blk.process_queue();
    // A second pass over a queue the first may have broken.
    let _ = blk.process_queue();
    assert_eq!(blk.capacity_sectors(), DISK as u64 / SECTOR_SIZE);
});
