//! Test helper: the driver's side of one split virtqueue, written straight into guest
//! memory. Unlike `virtio_queue::mock::MockSplitQueue` it keeps nothing but addresses
//! and never resets the rings, so it can carry on over a copy of guest memory (as a
//! restored VM does).

use virtio_queue::desc::RawDescriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use super::GuestMemoryMmap;

#[derive(Debug, Clone, Copy)]
pub(crate) struct Ring {
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    pub size: u16,
}

impl Ring {
    /// Rings packed from `base`: descriptor table, avail ring, used ring (4-aligned).
    pub fn at(base: u64, size: u16) -> Self {
        let desc = base;
        let avail = desc + 16 * u64::from(size);
        let used = (avail + 6 + 2 * u64::from(size) + 3) & !3;
        Self {
            desc,
            avail,
            used,
            size,
        }
    }

    /// (size, desc, avail, used), as `MmioTransport::drive_to_driver_ok` takes them.
    pub fn transport_queue(&self) -> (u16, u64, u64, u64) {
        (self.size, self.desc, self.avail, self.used)
    }

    /// A ready queue over these rings, as a transport hands it to a device.
    pub fn queue(&self) -> Queue {
        let mut q = Queue::new(self.size).unwrap();
        let split = |a: u64| (Some(a as u32), Some((a >> 32) as u32));
        let (lo, hi) = split(self.desc);
        q.set_desc_table_address(lo, hi);
        let (lo, hi) = split(self.avail);
        q.set_avail_ring_address(lo, hi);
        let (lo, hi) = split(self.used);
        q.set_used_ring_address(lo, hi);
        q.set_ready(true);
        q
    }

    fn read_u16(mem: &GuestMemoryMmap, at: u64) -> u16 {
        u16::from_le(mem.read_obj(GuestAddress(at)).unwrap())
    }

    /// Puts `descs` in the table from `slot` and offers the chain headed there.
    pub fn offer(&self, mem: &GuestMemoryMmap, descs: &[RawDescriptor], slot: u16) {
        for (i, d) in descs.iter().enumerate() {
            let at = self.desc + 16 * (u64::from(slot) + i as u64);
            mem.write_obj(*d, GuestAddress(at)).unwrap();
        }
        let idx = Self::read_u16(mem, self.avail + 2);
        let entry = self.avail + 4 + 2 * u64::from(idx % self.size);
        mem.write_obj(slot.to_le(), GuestAddress(entry)).unwrap();
        mem.write_obj(idx.wrapping_add(1).to_le(), GuestAddress(self.avail + 2))
            .unwrap();
    }

    /// Every used entry so far: (head, length).
    pub fn used(&self, mem: &GuestMemoryMmap) -> Vec<(u32, u32)> {
        let idx = Self::read_u16(mem, self.used + 2);
        (0..idx)
            .map(|i| {
                let at = self.used + 4 + 8 * u64::from(i % self.size);
                let id: u32 = mem.read_obj(GuestAddress(at)).unwrap();
                let len: u32 = mem.read_obj(GuestAddress(at + 4)).unwrap();
                (u32::from_le(id), u32::from_le(len))
            })
            .collect()
    }
}

/// Dispatches until one ends without re-kicking (bounded by `pending + 1`
/// rounds), and checks each served a full budget and re-kicked, but the last,
/// which served the rest: what a bounded dispatch of `pending` chains does.
/// `dispatch` serves once and says how many chains it took.
pub fn assert_bounded_dispatches(
    pending: usize,
    kick: &vmm_sys_util::eventfd::EventFd,
    mut dispatch: impl FnMut() -> usize,
) {
    use crate::virtio::MAX_CHAINS_PER_DISPATCH;
    assert!(
        pending > 2 * MAX_CHAINS_PER_DISPATCH,
        "offer more than the budget"
    );
    let mut dispatches = Vec::new();
    loop {
        let served = dispatch();
        let rekicked = kick.read().is_ok();
        dispatches.push((served, rekicked));
        if !rekicked || dispatches.len() > pending {
            break;
        }
    }
    let mut expected = vec![(MAX_CHAINS_PER_DISPATCH, true); pending / MAX_CHAINS_PER_DISPATCH];
    expected.push((pending % MAX_CHAINS_PER_DISPATCH, false));
    assert_eq!(dispatches, expected);
}
