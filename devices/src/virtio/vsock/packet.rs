//! The virtio-vsock packet header, and moving packets through descriptor chains.
//!
//! A tx chain (driver to device) must be all device-readable: the 44-byte header, then
//! exactly `len` data bytes, split across descriptors any way the driver likes. An rx
//! chain (device to driver) must be all device-writable and hold at least a header.
//! Chains are walked with [`chain::descriptors`]: no indirect descriptors, at most the
//! queue size of them.

use crate::virtio::chain::{self, ChainError, Table};
use crate::virtio::GuestMemoryMmap;
use virtio_queue::DescriptorChain;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

use super::MAX_PKT_DATA;

/// Size of `struct virtio_vsock_hdr`.
pub const HDR_SIZE: usize = 44;

/// The only socket type supported: stream.
pub const TYPE_STREAM: u16 = 1;

pub const OP_REQUEST: u16 = 1;
pub const OP_RESPONSE: u16 = 2;
pub const OP_RST: u16 = 3;
pub const OP_SHUTDOWN: u16 = 4;
pub const OP_RW: u16 = 5;
pub const OP_CREDIT_UPDATE: u16 = 6;
pub const OP_CREDIT_REQUEST: u16 = 7;

/// OP_SHUTDOWN flag: the sender will receive no more data.
pub const SHUTDOWN_RCV: u32 = 1;
/// OP_SHUTDOWN flag: the sender will send no more data.
pub const SHUTDOWN_SEND: u32 = 2;

/// Event queue event id: the transport was reset (e.g. after a snapshot restore).
pub const EVENT_TRANSPORT_RESET: u32 = 0;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PacketError {
    #[error("Descriptor chain refused")]
    Chain(#[from] ChainError),
    #[error("Descriptor chain has a buffer of the wrong direction")]
    WrongDirection,
    #[error("Descriptor chain buffer is outside guest memory")]
    OutsideMemory,
    #[error("Descriptor chain holds {0} bytes, too few for the packet")]
    TooShort(usize),
    #[error("Packet data length {} is over the limit", .0.len)]
    DataTooLong(Header),
    #[error("Packet header says {} data bytes, the chain holds {got}", hdr.len)]
    LenMismatch { hdr: Header, got: u64 },
}

impl PacketError {
    /// The packet header, if it could be read before the error was found.
    pub fn header(&self) -> Option<&Header> {
        match self {
            Self::DataTooLong(hdr) | Self::LenMismatch { hdr, .. } => Some(hdr),
            _ => None,
        }
    }
}

/// `struct virtio_vsock_hdr`, all fields little endian on the wire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

impl Header {
    pub fn from_bytes(b: &[u8; HDR_SIZE]) -> Self {
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or_default());
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or_default());
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap_or_default());
        Self {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }

    pub fn to_bytes(self) -> [u8; HDR_SIZE] {
        let mut b = [0u8; HDR_SIZE];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }

    /// An RST answering `self`: source and destination swapped, nothing else set.
    pub fn rst_reply(&self) -> Self {
        Self {
            src_cid: self.dst_cid,
            dst_cid: self.src_cid,
            src_port: self.dst_port,
            dst_port: self.src_port,
            type_: TYPE_STREAM,
            op: OP_RST,
            ..Self::default()
        }
    }
}

/// A packet the driver sent.
#[derive(Debug)]
pub struct TxPacket {
    pub hdr: Header,
    pub data: Vec<u8>,
}

/// One buffer of a chain, already checked to be inside guest memory.
#[derive(Clone, Copy, Debug)]
struct Region {
    addr: GuestAddress,
    len: usize,
}

/// The buffers of `chain`, which must all have the direction `writable`. Stops adding
/// buffers once `limit` bytes are covered (the rest are still direction-checked);
/// returns the buffers and the total length of the whole chain.
fn regions(
    chain: DescriptorChain<&GuestMemoryMmap>,
    table: Table,
    writable: bool,
    limit: usize,
) -> Result<(Vec<Region>, u64), PacketError> {
    let mem = chain.memory();
    let mut out = Vec::new();
    let mut covered = 0usize;
    let mut total = 0u64;
    for desc in chain::descriptors(&chain, table)? {
        if desc.is_write_only() != writable {
            return Err(PacketError::WrongDirection);
        }
        let len = desc.len() as usize;
        total += u64::from(desc.len());
        if len == 0 || covered >= limit {
            continue;
        }
        if !GuestMemoryBackend::check_range(mem, desc.addr(), len) {
            return Err(PacketError::OutsideMemory);
        }
        let take = len.min(limit - covered);
        out.push(Region {
            addr: desc.addr(),
            len: take,
        });
        covered += take;
    }
    Ok((out, total))
}

/// Copies `buf.len()` bytes starting at byte `offset` of `regions` into `buf`.
fn read_regions(
    mem: &GuestMemoryMmap,
    regions: &[Region],
    mut offset: usize,
    buf: &mut [u8],
) -> Result<(), PacketError> {
    let mut done = 0;
    for r in regions {
        if done == buf.len() {
            break;
        }
        if offset >= r.len {
            offset -= r.len;
            continue;
        }
        let n = (r.len - offset).min(buf.len() - done);
        let addr = r
            .addr
            .checked_add(offset as u64)
            .ok_or(PacketError::OutsideMemory)?;
        mem.read_slice(&mut buf[done..done + n], addr)
            .map_err(|_| PacketError::OutsideMemory)?;
        done += n;
        offset = 0;
    }
    if done == buf.len() {
        Ok(())
    } else {
        Err(PacketError::TooShort(done))
    }
}

/// Reads and checks the packet in a tx chain. The header must be complete, `len` at
/// most [`MAX_PKT_DATA`] and equal to the data bytes the chain holds.
pub fn read_tx(
    chain: DescriptorChain<&GuestMemoryMmap>,
    table: Table,
) -> Result<TxPacket, PacketError> {
    let mem = chain.memory();
    let limit = HDR_SIZE + MAX_PKT_DATA as usize;
    let (regions, total) = regions(chain.clone(), table, false, limit)?;
    if total < HDR_SIZE as u64 {
        return Err(PacketError::TooShort(total as usize));
    }
    let mut raw = [0u8; HDR_SIZE];
    read_regions(mem, &regions, 0, &mut raw)?;
    let hdr = Header::from_bytes(&raw);
    if hdr.len > MAX_PKT_DATA {
        return Err(PacketError::DataTooLong(hdr));
    }
    let got = total - HDR_SIZE as u64;
    if got != u64::from(hdr.len) {
        return Err(PacketError::LenMismatch { hdr, got });
    }
    let mut data = vec![0u8; hdr.len as usize];
    read_regions(mem, &regions, HDR_SIZE, &mut data)?;
    Ok(TxPacket { hdr, data })
}

/// A device-writable chain, checked and ready to receive one packet (or event).
#[derive(Debug)]
pub struct WritableChain {
    regions: Vec<Region>,
    cap: usize,
}

impl WritableChain {
    /// Checks `chain`: every buffer device-writable and inside guest memory, at least
    /// `min` bytes in all. Capacity beyond a header and [`MAX_PKT_DATA`] is not used.
    pub fn new(
        chain: DescriptorChain<&GuestMemoryMmap>,
        table: Table,
        min: usize,
    ) -> Result<Self, PacketError> {
        let (regions, _) = regions(chain, table, true, HDR_SIZE + MAX_PKT_DATA as usize)?;
        let cap = regions.iter().map(|r| r.len).sum();
        if cap < min {
            return Err(PacketError::TooShort(cap));
        }
        Ok(Self { regions, cap })
    }

    /// How many data bytes fit after a packet header.
    pub fn data_capacity(&self) -> usize {
        self.cap.saturating_sub(HDR_SIZE)
    }

    /// Writes `parts` one after the other from the start; returns the bytes written.
    pub fn write(&self, mem: &GuestMemoryMmap, parts: &[&[u8]]) -> Result<u32, PacketError> {
        let mut region = 0;
        let mut offset = 0;
        let mut written = 0usize;
        for part in parts {
            let mut part = *part;
            while !part.is_empty() {
                let r = self
                    .regions
                    .get(region)
                    .ok_or(PacketError::TooShort(self.cap))?;
                let n = (r.len - offset).min(part.len());
                let addr = r
                    .addr
                    .checked_add(offset as u64)
                    .ok_or(PacketError::OutsideMemory)?;
                mem.write_slice(&part[..n], addr)
                    .map_err(|_| PacketError::OutsideMemory)?;
                part = &part[n..];
                offset += n;
                written += n;
                if offset == r.len {
                    region += 1;
                    offset = 0;
                }
            }
        }
        Ok(written as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::{Queue, QueueOwnedT};

    const RAM: u64 = 0x10_0000;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM as usize)]).unwrap()
    }

    fn desc(addr: u64, len: u32, write: bool, next: Option<u16>) -> RawDescriptor {
        let mut flags = if write { VRING_DESC_F_WRITE as u16 } else { 0 };
        if next.is_some() {
            flags |= VRING_DESC_F_NEXT as u16;
        }
        RawDescriptor::from(Descriptor::new(addr, len, flags, next.unwrap_or(0)))
    }

    /// Puts `descs` (already linked) in a fresh queue and returns its first chain.
    fn with_chain<R>(
        m: &GuestMemoryMmap,
        descs: &[RawDescriptor],
        f: impl FnOnce(DescriptorChain<&GuestMemoryMmap>, Table) -> R,
    ) -> R {
        let vq = MockSplitQueue::new(m, 16);
        vq.add_desc_chains(descs, 0).unwrap();
        let mut q: Queue = vq.create_queue().unwrap();
        let table = Table::of(&q);
        let chain = q.iter(m).unwrap().next().unwrap();
        f(chain, table)
    }

    fn hdr(len: u32) -> Header {
        Header {
            src_cid: 3,
            dst_cid: 2,
            src_port: 1000,
            dst_port: 2000,
            len,
            type_: TYPE_STREAM,
            op: OP_RW,
            flags: 0,
            buf_alloc: 4096,
            fwd_cnt: 7,
        }
    }

    #[test]
    fn header_round_trip_and_layout() {
        let h = hdr(5);
        let b = h.to_bytes();
        assert_eq!(Header::from_bytes(&b), h);
        assert_eq!(&b[24..28], &5u32.to_le_bytes());
        assert_eq!(&b[30..32], &OP_RW.to_le_bytes());
        let r = h.rst_reply();
        assert_eq!(
            (r.src_cid, r.dst_cid, r.src_port, r.dst_port),
            (2, 3, 2000, 1000)
        );
        assert_eq!(r.op, OP_RST);
    }

    #[test]
    fn reads_header_and_data_split_anywhere() {
        let m = mem();
        let mut bytes = hdr(6).to_bytes().to_vec();
        bytes.extend_from_slice(b"abcdef");
        m.write_slice(&bytes[..30], GuestAddress(0x1_0000)).unwrap();
        m.write_slice(&bytes[30..], GuestAddress(0x2_0000)).unwrap();
        let descs = [
            desc(0x1_0000, 30, false, Some(1)),
            desc(0x2_0000, 20, false, None),
        ];
        let p = with_chain(&m, &descs, read_tx).unwrap();
        assert_eq!(p.hdr, hdr(6));
        assert_eq!(p.data, b"abcdef");
    }

    #[test]
    fn rejects_bad_tx_chains() {
        let m = mem();
        m.write_slice(&hdr(6).to_bytes(), GuestAddress(0x1_0000))
            .unwrap();
        // Short header.
        let e = with_chain(&m, &[desc(0x1_0000, 20, false, None)], read_tx).unwrap_err();
        assert_eq!(e, PacketError::TooShort(20));
        // Head only: len says 6, no data.
        let e = with_chain(&m, &[desc(0x1_0000, 44, false, None)], read_tx).unwrap_err();
        assert!(matches!(e, PacketError::LenMismatch { got: 0, .. }));
        assert_eq!(e.header(), Some(&hdr(6)));
        // Writable buffer in a tx chain.
        let descs = [
            desc(0x1_0000, 44, false, Some(1)),
            desc(0x2_0000, 6, true, None),
        ];
        assert_eq!(
            with_chain(&m, &descs, read_tx).unwrap_err(),
            PacketError::WrongDirection
        );
        // Data outside RAM.
        let descs = [
            desc(0x1_0000, 44, false, Some(1)),
            desc(RAM - 2, 6, false, None),
        ];
        assert_eq!(
            with_chain(&m, &descs, read_tx).unwrap_err(),
            PacketError::OutsideMemory
        );
        // Huge len.
        m.write_slice(&hdr(u32::MAX).to_bytes(), GuestAddress(0x1_0000))
            .unwrap();
        let descs = [
            desc(0x1_0000, 44, false, Some(1)),
            desc(0x2_0000, 100, false, None),
        ];
        let e = with_chain(&m, &descs, read_tx).unwrap_err();
        assert!(matches!(e, PacketError::DataTooLong(_)));
        // A chain of more than 4 GiB is refused before its header is looked at.
        let descs = [
            desc(0x1_0000, 44, false, Some(1)),
            desc(0x2_0000, u32::MAX, false, None),
        ];
        assert_eq!(
            with_chain(&m, &descs, read_tx).unwrap_err(),
            PacketError::Chain(ChainError::TooLarge)
        );
        // A descriptor that loops to itself: refused once the walk reaches the queue
        // size.
        m.write_slice(&hdr(100).to_bytes(), GuestAddress(0x1_0000))
            .unwrap();
        let descs = [
            desc(0x1_0000, 44, false, Some(1)),
            desc(0x2_0000, 10, false, Some(1)),
        ];
        let vq = MockSplitQueue::new(&m, 16);
        vq.add_desc_chains(&descs, 0).unwrap();
        let mut q: Queue = vq.create_queue().unwrap();
        let table = Table::of(&q);
        let chain = q.iter(&m).unwrap().next().unwrap();
        assert_eq!(
            read_tx(chain, table).unwrap_err(),
            PacketError::Chain(ChainError::TooLong)
        );
    }

    #[test]
    fn writable_chain_checks_and_writes() {
        let m = mem();
        let descs = [
            desc(0x1_0000, 10, true, Some(1)),
            desc(0x2_0000, 100, true, None),
        ];
        let w = with_chain(&m, &descs, |c, t| WritableChain::new(c, t, HDR_SIZE)).unwrap();
        assert_eq!(w.data_capacity(), 110 - HDR_SIZE);
        let h = hdr(3).to_bytes();
        assert_eq!(w.write(&m, &[&h, b"xyz"]).unwrap(), 47);
        let mut back = [0u8; 47];
        m.read_slice(&mut back[..10], GuestAddress(0x1_0000))
            .unwrap();
        m.read_slice(&mut back[10..], GuestAddress(0x2_0000))
            .unwrap();
        assert_eq!(&back[..44], &h);
        assert_eq!(&back[44..], b"xyz");
        assert!(w.write(&m, &[&[0u8; 111]]).is_err());

        let short = [desc(0x1_0000, 20, true, None)];
        assert_eq!(
            with_chain(&m, &short, |c, t| WritableChain::new(c, t, HDR_SIZE)).unwrap_err(),
            PacketError::TooShort(20)
        );
        let readable = [desc(0x1_0000, 64, false, None)];
        assert_eq!(
            with_chain(&m, &readable, |c, t| WritableChain::new(c, t, HDR_SIZE)).unwrap_err(),
            PacketError::WrongDirection
        );
        let outside = [desc(RAM + 0x1000, 64, true, None)];
        assert_eq!(
            with_chain(&m, &outside, |c, t| WritableChain::new(c, t, HDR_SIZE)).unwrap_err(),
            PacketError::OutsideMemory
        );
    }
}
