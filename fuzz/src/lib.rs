//! Shared harness of the virtio fuzz targets: a small guest RAM whose virtqueues (the
//! descriptor table and the available ring) are laid out from fuzz input.
//!
//! Input of one queue: byte 0 picks the queue size (`1 << (b % 9)`, 1 to 256), bytes
//! 1-2 are the driver's available index (little endian), then `size * 16` bytes of
//! descriptor table and `size * 2` bytes of available ring entries. Whatever input is
//! left fills the data area, where descriptors (whose addresses and lengths the input
//! chose) may point.

use std::io;

use devices::virtio::block::DiskBackend;
pub use devices::virtio::GuestMemoryMmap;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

/// Offsets of one queue's structures from its base.
pub const AVAIL_OFF: u64 = 0x1000;
pub const USED_OFF: u64 = 0x2000;
/// Room per queue.
pub const QUEUE_SPAN: u64 = 0x3000;

/// Takes `n` bytes from the front of `input` (fewer if it is shorter).
pub fn take<'a>(input: &mut &'a [u8], n: usize) -> &'a [u8] {
    let (a, b) = input.split_at(n.min(input.len()));
    *input = b;
    a
}

pub fn take_u8(input: &mut &[u8]) -> u8 {
    take(input, 1).first().copied().unwrap_or(0)
}

pub fn take_u16(input: &mut &[u8]) -> u16 {
    let b = take(input, 2);
    u16::from_le_bytes([
        b.first().copied().unwrap_or(0),
        b.get(1).copied().unwrap_or(0),
    ])
}

/// Guest RAM of `size` bytes at address 0.
pub fn guest_memory(size: usize) -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), size)]).expect("guest memory")
}

/// Lays out one queue at `base` from `input` and returns it, ready (the driver's view
/// is whatever the input made it: any descriptor may be bad).
pub fn place_queue(mem: &GuestMemoryMmap, base: u64, input: &mut &[u8]) -> Queue {
    let size = 1u16 << (take_u8(input) % 9);
    let avail_idx = take_u16(input);
    let table = take(input, usize::from(size) * 16);
    let ring = take(input, usize::from(size) * 2);
    mem.write_slice(table, GuestAddress(base))
        .expect("table fits");
    let avail = base + AVAIL_OFF;
    mem.write_obj(0u16, GuestAddress(avail))
        .expect("avail flags");
    mem.write_obj(avail_idx, GuestAddress(avail + 2))
        .expect("avail idx");
    mem.write_slice(ring, GuestAddress(avail + 4))
        .expect("ring fits");
    let mut q = Queue::new(256).expect("queue");
    q.set_size(size);
    set_addresses(&mut q, base);
    q.set_ready(true);
    q
}

/// Points `q` at the table, available and used rings of the queue at `base`.
pub fn set_addresses(q: &mut Queue, base: u64) {
    let split = |a: u64| (Some(a as u32), Some((a >> 32) as u32));
    let (l, h) = split(base);
    q.set_desc_table_address(l, h);
    let (l, h) = split(base + AVAIL_OFF);
    q.set_avail_ring_address(l, h);
    let (l, h) = split(base + USED_OFF);
    q.set_used_ring_address(l, h);
}

/// Fills guest RAM from `at` with what is left of the input.
pub fn fill_data(mem: &GuestMemoryMmap, at: u64, end: u64, input: &[u8]) {
    let n = input.len().min((end - at) as usize);
    mem.write_slice(&input[..n], GuestAddress(at))
        .expect("data fits");
}

/// A disk in memory, failing (never panicking) on accesses outside it.
pub struct MemDisk(pub Vec<u8>);

impl DiskBackend for MemDisk {
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let src = usize::try_from(offset)
            .ok()
            .and_then(|o| self.0.get(o..o.checked_add(buf.len())?))
            .ok_or(io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(src);
        Ok(())
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        let dst = usize::try_from(offset)
            .ok()
            .and_then(|o| self.0.get_mut(o..o.checked_add(buf.len())?))
            .ok_or(io::ErrorKind::UnexpectedEof)?;
        dst.copy_from_slice(buf);
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn size_bytes(&self) -> u64 {
        self.0.len() as u64
    }
}
