//! One virtio-blk request: parse a descriptor chain, check it, run it against the disk.
//!
//! Layout accepted (virtio 1.2, 5.2.6): a device-readable header descriptor of at least
//! 16 bytes (type u32, reserved u32, sector u64), then data descriptors (device-writable
//! for IN and GET_ID, device-readable for OUT), then a device-writable status descriptor
//! of at least one byte whose first byte receives the status.
//!
//! A chain whose status byte cannot be written (no writable last descriptor, the status
//! outside guest RAM, a chain cut short by a loop or a bad `next`, an indirect
//! descriptor: VIRTIO_F_INDIRECT_DESC is never offered) is returned with used
//! length 0. Any other fault answers IOERR; an unknown request type answers UNSUPP.

use crate::virtio::chain::{self, Table};
use crate::virtio::GuestMemoryMmap;
use log::debug;
use virtio_bindings::bindings::virtio_blk::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH,
    VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::DescriptorChain;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::backend::DiskBackend;
use super::{ID_BYTES, MAX_REQUEST_DATA, SECTOR_SIZE};

const HEADER_LEN: u32 = 16;

/// What the device knows about the disk behind it.
pub(super) struct DiskInfo<'a> {
    pub read_only: bool,
    pub capacity_bytes: u64,
    pub id: &'a [u8; ID_BYTES],
}

/// Why a request failed: the status to answer and, for the debug log, why.
struct Reject {
    status: u32,
    why: &'static str,
}

fn ioerr(why: &'static str) -> Reject {
    Reject {
        status: VIRTIO_BLK_S_IOERR,
        why,
    }
}

/// Is `[addr, addr+len)` inside guest RAM?
fn in_ram(mem: &GuestMemoryMmap, addr: GuestAddress, len: u32) -> bool {
    GuestMemoryBackend::check_range(mem, addr, len as usize)
}

/// Serves one chain; returns the number of bytes written into device-writable
/// descriptors (the used length).
pub(super) fn serve(
    chain: DescriptorChain<&GuestMemoryMmap>,
    table: Table,
    mem: &GuestMemoryMmap,
    disk: &mut dyn DiskBackend,
    info: &DiskInfo<'_>,
    buf: &mut Vec<u8>,
) -> u32 {
    let head = chain.head_index();
    let descs = match chain::descriptors(&chain, table) {
        Ok(descs) => descs,
        Err(e) => {
            debug!("virtio-blk: chain {head} refused: {e}");
            return 0;
        }
    };
    let Some((status_desc, rest)) = descs.split_last() else {
        return 0;
    };
    if !status_desc.is_write_only() || status_desc.len() < 1 || !in_ram(mem, status_desc.addr(), 1)
    {
        debug!("virtio-blk: chain {head} has no writable status byte");
        return 0;
    }
    let (status, written) = match execute(mem, disk, info, rest, buf) {
        Ok(written) => (VIRTIO_BLK_S_OK, written),
        Err(r) => {
            debug!("virtio-blk: request {head} failed: {}", r.why);
            (r.status, 0)
        }
    };
    if mem.write_obj(status as u8, status_desc.addr()).is_err() {
        return 0;
    }
    // Data written is bounded by MAX_REQUEST_DATA, so this cannot overflow.
    written + 1
}

/// Checks and runs the request made of `descs` (header and data, without the status).
/// Returns the number of data bytes written to guest memory.
fn execute(
    mem: &GuestMemoryMmap,
    disk: &mut dyn DiskBackend,
    info: &DiskInfo<'_>,
    descs: &[Descriptor],
    buf: &mut Vec<u8>,
) -> Result<u32, Reject> {
    let Some((hdr, data)) = descs.split_first() else {
        return Err(ioerr("no header"));
    };
    if hdr.is_write_only() {
        return Err(ioerr("header is device-writable"));
    }
    if hdr.len() < HEADER_LEN {
        return Err(ioerr("header shorter than 16 bytes"));
    }
    let mut raw = [0u8; HEADER_LEN as usize];
    mem.read_slice(&mut raw, hdr.addr())
        .map_err(|_| ioerr("header outside guest memory"))?;
    let kind = u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]);
    let sector = u64::from_le_bytes([
        raw[8], raw[9], raw[10], raw[11], raw[12], raw[13], raw[14], raw[15],
    ]);

    let device_writes = match kind {
        VIRTIO_BLK_T_IN | VIRTIO_BLK_T_GET_ID => true,
        VIRTIO_BLK_T_OUT | VIRTIO_BLK_T_FLUSH => false,
        _ => {
            return Err(Reject {
                status: VIRTIO_BLK_S_UNSUPP,
                why: "unsupported request type",
            })
        }
    };
    let total = check_data(mem, data, device_writes)?;

    match kind {
        VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
            if !u64::from(total).is_multiple_of(SECTOR_SIZE) {
                return Err(ioerr("data length not a multiple of 512"));
            }
            let start = sector
                .checked_mul(SECTOR_SIZE)
                .ok_or(ioerr("sector out of range"))?;
            let end = start
                .checked_add(u64::from(total))
                .ok_or(ioerr("sector out of range"))?;
            if end > info.capacity_bytes {
                return Err(ioerr("sector out of range"));
            }
            if kind == VIRTIO_BLK_T_IN {
                read_into_guest(mem, disk, data, start, buf)?;
                Ok(total)
            } else if info.read_only {
                Err(ioerr("write to a read-only disk"))
            } else {
                write_from_guest(mem, disk, data, start, buf)?;
                Ok(0)
            }
        }
        VIRTIO_BLK_T_FLUSH => {
            if !info.read_only {
                disk.flush().map_err(|_| ioerr("flush failed"))?;
            }
            Ok(0)
        }
        _ => write_id(mem, data, info.id),
    }
}

/// Every data descriptor must have the right direction and lie in guest RAM; their total
/// length is at most MAX_REQUEST_DATA.
fn check_data(
    mem: &GuestMemoryMmap,
    data: &[Descriptor],
    device_writes: bool,
) -> Result<u32, Reject> {
    let mut total: u32 = 0;
    for d in data {
        if d.is_write_only() != device_writes {
            return Err(ioerr("data descriptor has the wrong direction"));
        }
        total = total
            .checked_add(d.len())
            .filter(|&t| t <= MAX_REQUEST_DATA)
            .ok_or(ioerr("request data too large"))?;
        if !in_ram(mem, d.addr(), d.len()) {
            return Err(ioerr("data descriptor outside guest memory"));
        }
    }
    Ok(total)
}

fn read_into_guest(
    mem: &GuestMemoryMmap,
    disk: &mut dyn DiskBackend,
    data: &[Descriptor],
    mut offset: u64,
    buf: &mut Vec<u8>,
) -> Result<(), Reject> {
    for d in data {
        let chunk = sized(buf, d.len());
        disk.read_at(chunk, offset)
            .map_err(|_| ioerr("disk read failed"))?;
        mem.write_slice(chunk, d.addr())
            .map_err(|_| ioerr("data descriptor outside guest memory"))?;
        offset += u64::from(d.len());
    }
    Ok(())
}

fn write_from_guest(
    mem: &GuestMemoryMmap,
    disk: &mut dyn DiskBackend,
    data: &[Descriptor],
    mut offset: u64,
    buf: &mut Vec<u8>,
) -> Result<(), Reject> {
    for d in data {
        let chunk = sized(buf, d.len());
        mem.read_slice(chunk, d.addr())
            .map_err(|_| ioerr("data descriptor outside guest memory"))?;
        disk.write_at(chunk, offset)
            .map_err(|_| ioerr("disk write failed"))?;
        offset += u64::from(d.len());
    }
    Ok(())
}

/// Writes the id (NUL-padded to 20 bytes) into the data descriptors, as much as fits.
fn write_id(
    mem: &GuestMemoryMmap,
    data: &[Descriptor],
    id: &[u8; ID_BYTES],
) -> Result<u32, Reject> {
    let mut left: &[u8] = id;
    let mut written = 0u32;
    for d in data {
        if left.is_empty() {
            break;
        }
        let n = left.len().min(d.len() as usize);
        mem.write_slice(&left[..n], d.addr())
            .map_err(|_| ioerr("data descriptor outside guest memory"))?;
        left = &left[n..];
        written += n as u32;
    }
    Ok(written)
}

/// The first `len` bytes of the reusable bounce buffer (len <= MAX_REQUEST_DATA).
fn sized(buf: &mut Vec<u8>, len: u32) -> &mut [u8] {
    let len = len as usize;
    if buf.len() < len {
        buf.resize(len, 0);
    }
    &mut buf[..len]
}

#[cfg(test)]
mod tests {
    //! Malformed chains: each fails its own request, never the device.

    use super::super::test_utils::*;
    use super::super::{Block, QUEUE_SIZE};
    use super::*;
    use crate::virtio::VirtioDevice;
    use virtio_bindings::bindings::virtio_ring::{
        VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
    };
    use virtio_queue::desc::RawDescriptor;

    fn check(descs: &[D], kind: u32, expect: (u32, Option<u32>)) {
        let img = TempImage::new(&[0x5a; 8192]);
        let mem = guest_memory();
        let vq = MockQueue::new(&mem, QUEUE_SIZE);
        let mut b = new_block(&img, false, "");
        activate(&mut b, &mem, &vq);
        header(&mem, HDR, kind, 0);
        mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        let (id, len) = run(&mut b, &vq, descs);
        assert_eq!((id, len), (0, expect.0));
        if let Some(st) = expect.1 {
            assert_eq!(status(&mem), st);
        } else {
            assert_eq!(status(&mem), 0xff, "status byte untouched");
        }
        assert!(!b.needs_reset());
        assert_ok_after(&mut b, &mem, &vq);
        assert_eq!(std::fs::read(&img.0).unwrap(), vec![0x5a; 8192]);
    }

    /// A good request still works after a bad one.
    fn assert_ok_after(b: &mut Block, mem: &GuestMemoryMmap, vq: &MockQueue<'_>) {
        header(mem, HDR, VIRTIO_BLK_T_IN, 1);
        let descs = [D(HDR, 16, false), D(DATA, 512, true), D(STATUS, 1, true)];
        assert_eq!(run(b, vq, &descs), (0, 513));
        assert_eq!(status(mem), VIRTIO_BLK_S_OK);
    }

    const IOERR: (u32, Option<u32>) = (1, Some(VIRTIO_BLK_S_IOERR));
    const DROPPED: (u32, Option<u32>) = (0, None);

    #[test]
    fn data_outside_guest_ram() {
        let descs = [D(HDR, 16, false), D(OUTSIDE, 512, true), D(STATUS, 1, true)];
        check(&descs, VIRTIO_BLK_T_IN, IOERR);
        // Straddling the end of RAM.
        let descs = [
            D(HDR, 16, false),
            D(RAM - 256, 512, false),
            D(STATUS, 1, true),
        ];
        check(&descs, VIRTIO_BLK_T_OUT, IOERR);
        // Near the top of the address space.
        let descs = [
            D(HDR, 16, false),
            D(u64::MAX - 100, 512, true),
            D(STATUS, 1, true),
        ];
        check(&descs, VIRTIO_BLK_T_IN, IOERR);
        let descs = [D(HDR, 16, false), D(OUTSIDE, 20, true), D(STATUS, 1, true)];
        check(&descs, VIRTIO_BLK_T_GET_ID, IOERR);
    }

    #[test]
    fn header_outside_guest_ram() {
        let descs = [
            D(OUTSIDE, 16, false),
            D(DATA, 512, true),
            D(STATUS, 1, true),
        ];
        check(&descs, VIRTIO_BLK_T_IN, IOERR);
    }

    #[test]
    fn status_outside_guest_ram() {
        let descs = [D(HDR, 16, false), D(DATA, 512, true), D(OUTSIDE, 1, true)];
        check(&descs, VIRTIO_BLK_T_IN, DROPPED);
    }

    #[test]
    fn wrong_direction() {
        // Reads into device-readable buffers.
        let descs = [D(HDR, 16, false), D(DATA, 512, false), D(STATUS, 1, true)];
        check(&descs, VIRTIO_BLK_T_IN, IOERR);
        // Writes from device-writable buffers.
        let descs = [D(HDR, 16, false), D(DATA, 512, true), D(STATUS, 1, true)];
        check(&descs, VIRTIO_BLK_T_OUT, IOERR);
        // One wrong segment among good ones.
        let descs = [
            D(HDR, 16, false),
            D(DATA, 512, false),
            D(DATA + 512, 512, true),
            D(STATUS, 1, true),
        ];
        check(&descs, VIRTIO_BLK_T_OUT, IOERR);
        // A device-writable header.
        let descs = [D(HDR, 16, true), D(DATA, 512, true), D(STATUS, 1, true)];
        check(&descs, VIRTIO_BLK_T_IN, IOERR);
        // A device-readable status.
        let descs = [D(HDR, 16, false), D(DATA, 512, true), D(STATUS, 1, false)];
        check(&descs, VIRTIO_BLK_T_IN, DROPPED);
    }

    #[test]
    fn short_header_and_status() {
        let descs = [D(HDR, 8, false), D(DATA, 512, true), D(STATUS, 1, true)];
        check(&descs, VIRTIO_BLK_T_IN, IOERR);
        let descs = [D(HDR, 0, false), D(STATUS, 1, true)];
        check(&descs, VIRTIO_BLK_T_FLUSH, IOERR);
        let descs = [D(HDR, 16, false), D(DATA, 512, true), D(STATUS, 0, true)];
        check(&descs, VIRTIO_BLK_T_IN, DROPPED);
    }

    #[test]
    fn missing_status() {
        // The last descriptor is data the device may not write.
        let descs = [D(HDR, 16, false), D(DATA, 512, false)];
        check(&descs, VIRTIO_BLK_T_OUT, DROPPED);
    }

    #[test]
    fn head_only_chain() {
        check(&[D(HDR, 16, false)], VIRTIO_BLK_T_IN, DROPPED);
        // A lone writable descriptor has no header: it gets IOERR in its first byte.
        check(&[D(STATUS, 16, true)], VIRTIO_BLK_T_IN, IOERR);
    }

    #[test]
    fn looping_and_dangling_chains() {
        let img = TempImage::new(&[0x5a; 8192]);
        let mem = guest_memory();
        let vq = MockQueue::new(&mem, QUEUE_SIZE);
        let mut b = new_block(&img, false, "");
        activate(&mut b, &mem, &vq);
        header(&mem, HDR, VIRTIO_BLK_T_IN, 0);
        let next = VRING_DESC_F_NEXT as u16;
        let write = VRING_DESC_F_WRITE as u16;
        let desc =
            |addr, len, flags, next| RawDescriptor::from(Descriptor::new(addr, len, flags, next));

        // header -> data -> status -> back to header.
        let looped = [
            desc(HDR, 16, next, 1),
            desc(DATA, 512, next | write, 2),
            desc(STATUS, 1, next | write, 0),
        ];
        assert_eq!(run_raw(&mut b, &vq, &looped), (0, 0));
        // A descriptor pointing at itself.
        let selfloop = [desc(HDR, 16, next, 0)];
        assert_eq!(run_raw(&mut b, &vq, &selfloop), (0, 0));
        // `next` beyond the table.
        let dangling = [desc(HDR, 16, next, 1), desc(STATUS, 1, next | write, 999)];
        assert_eq!(run_raw(&mut b, &vq, &dangling), (0, 0));
        assert!(!b.needs_reset());
        assert_ok_after(&mut b, &mem, &vq);
    }

    /// VIRTIO_F_INDIRECT_DESC is never offered, so a chain with an indirect descriptor
    /// fails its request (like a loop does) instead of carrying up to 65,535
    /// descriptors from a guest-chosen table.
    #[test]
    fn indirect_descriptors_are_refused() {
        let img = TempImage::new(&[0x5a; 8192]);
        let mem = guest_memory();
        let vq = MockQueue::new(&mem, QUEUE_SIZE);
        let mut b = new_block(&img, false, "");
        activate(&mut b, &mem, &vq);
        assert_eq!(
            b.avail_features() & crate::virtio::VIRTIO_F_INDIRECT_DESC,
            0,
            "INDIRECT_DESC offered"
        );
        header(&mem, HDR, VIRTIO_BLK_T_IN, 0);
        let indirect = VRING_DESC_F_INDIRECT as u16;
        let next = VRING_DESC_F_NEXT as u16;
        let desc =
            |addr, len, flags, next| RawDescriptor::from(Descriptor::new(addr, len, flags, next));
        let put = |at: u64, descs: &[RawDescriptor]| {
            for (i, d) in descs.iter().enumerate() {
                mem.write_obj(*d, GuestAddress(at + 16 * i as u64)).unwrap();
            }
        };
        // A whole, well-formed request behind one indirect descriptor.
        let table = DATA + 0x1_0000;
        let whole = [D(HDR, 16, false), D(DATA, 512, true), D(STATUS, 1, true)];
        put(table, &chain(&whole, 0));
        mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        assert_eq!(
            run_raw(&mut b, &vq, &[desc(table, 48, indirect, 0)]),
            (0, 0)
        );
        assert_eq!(status(&mem), 0xff, "status byte untouched");
        // The data and status behind an indirect descriptor after a direct header.
        let tail_table = table + 0x100;
        put(tail_table, &chain(&whole[1..], 0));
        let mixed = [desc(HDR, 16, next, 1), desc(tail_table, 32, indirect, 0)];
        assert_eq!(run_raw(&mut b, &vq, &mixed), (0, 0));
        assert_eq!(status(&mem), 0xff, "status byte untouched");
        assert!(!b.needs_reset());
        assert_ok_after(&mut b, &mem, &vq);
    }
}
