//! Walking a descriptor chain the guest offered, within what was negotiated.
//!
//! `virtio_queue::DescriptorChain`'s own iterator follows `VIRTQ_DESC_F_INDIRECT` into
//! a guest-chosen table of up to 65,535 descriptors whatever the features, and ends
//! silently on an error. No device here offers `VIRTIO_F_INDIRECT_DESC`, so devices
//! walk chains with [`descriptors`] instead: a chain with an indirect descriptor is
//! refused, and no walk goes past the queue size. A refused chain fails its request,
//! like any malformed chain; the queue itself is not broken by it.

use virtio_queue::desc::split::Descriptor;
use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress};

use super::GuestMemoryMmap;

/// Size of one split-queue descriptor.
const DESC_SIZE: u64 = 16;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ChainError {
    #[error(
        "Descriptor {0} refers to an indirect table, VIRTIO_F_INDIRECT_DESC was not negotiated"
    )]
    Indirect(u16),
    #[error("Descriptor index {0} is outside the table")]
    OutsideTable(u16),
    #[error("Descriptor {0} cannot be read from guest memory")]
    Unreadable(u16),
    #[error("Descriptor chain is longer than the queue")]
    TooLong,
    #[error("Descriptor chain holds more than 4 GiB")]
    TooLarge,
}

/// Where a queue's descriptor table is, and how many entries it has.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Table {
    addr: GuestAddress,
    size: u16,
}

impl Table {
    pub(crate) fn of(q: &Queue) -> Self {
        Self {
            addr: GuestAddress(q.desc_table()),
            size: q.size(),
        }
    }
}

/// The descriptors of `chain`, read from `table`: at most the table size of them, none
/// an indirect one, every `next` inside the table, at most 4 GiB in all, the last one
/// without NEXT.
pub(crate) fn descriptors(
    chain: &DescriptorChain<&GuestMemoryMmap>,
    table: Table,
) -> Result<Vec<Descriptor>, ChainError> {
    let mem = chain.memory();
    let mut out = Vec::new();
    let mut idx = chain.head_index();
    let mut total = 0u32;
    loop {
        if out.len() >= usize::from(table.size) {
            return Err(ChainError::TooLong);
        }
        if idx >= table.size {
            return Err(ChainError::OutsideTable(idx));
        }
        let desc: Descriptor = table
            .addr
            .checked_add(u64::from(idx) * DESC_SIZE)
            .and_then(|at| mem.read_obj(at).ok())
            .ok_or(ChainError::Unreadable(idx))?;
        if desc.refers_to_indirect_table() {
            return Err(ChainError::Indirect(idx));
        }
        total = total.checked_add(desc.len()).ok_or(ChainError::TooLarge)?;
        out.push(desc);
        if !desc.has_next() {
            return Ok(out);
        }
        idx = desc.next();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::test_ring::Ring;
    use virtio_bindings::bindings::virtio_ring::{
        VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
    };
    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::QueueOwnedT;

    const QSIZE: u16 = 16;
    const N: u16 = VRING_DESC_F_NEXT as u16;

    fn desc(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
        RawDescriptor::from(Descriptor::new(addr, len, flags, next))
    }

    /// Offers `raw` from slot 0 of a fresh queue and walks the chain.
    fn walk(raw: &[RawDescriptor]) -> Result<Vec<Descriptor>, ChainError> {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let ring = Ring::at(0, QSIZE);
        ring.offer(&mem, raw, 0);
        let mut q = ring.queue();
        let table = Table::of(&q);
        let chain = q.iter(&mem).unwrap().next().unwrap();
        descriptors(&chain, table)
    }

    #[test]
    fn walks_a_direct_chain() {
        let w = VRING_DESC_F_WRITE as u16;
        let got = walk(&[desc(0x8000, 16, N, 1), desc(0x9000, 1, w, 0)]).unwrap();
        let got: Vec<_> = got.iter().map(|d| (d.addr().0, d.len())).collect();
        assert_eq!(got, [(0x8000, 16), (0x9000, 1)]);
    }

    #[test]
    fn refuses_indirect_loops_and_strays() {
        let ind = VRING_DESC_F_INDIRECT as u16;
        assert_eq!(
            walk(&[desc(0x8000, 16, ind, 0)]).err(),
            Some(ChainError::Indirect(0))
        );
        assert_eq!(
            walk(&[desc(0x8000, 16, N, 1), desc(0x9000, 0xffff * 16, ind, 0)]).err(),
            Some(ChainError::Indirect(1))
        );
        assert_eq!(
            walk(&[desc(0x8000, 16, N, 0)]).err(),
            Some(ChainError::TooLong)
        );
        assert_eq!(
            walk(&[desc(0x8000, 16, N, QSIZE)]).err(),
            Some(ChainError::OutsideTable(QSIZE))
        );
        assert_eq!(
            walk(&[desc(0, u32::MAX, N, 1), desc(0, 1, 0, 0)]).err(),
            Some(ChainError::TooLarge)
        );
    }
}
