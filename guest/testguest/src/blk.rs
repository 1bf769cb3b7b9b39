//! virtio-blk: one request at a time, data straight from/to the host's buffer.

use crate::mem::Pool;
use crate::virtio::{Transport, Virtq, DESC_NEXT, DESC_WRITE, QMAX};
use guest_abi::mailbox::{STATUS_IO_ERROR, STATUS_OK};

const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const T_FLUSH: u32 = 4;
const T_GET_ID: u32 = 8;
const F_FLUSH: u64 = 1 << 9;
const S_OK: u8 = 0;
pub const SECTOR: u64 = 512;
/// Sectors per request (larger transfers are split).
pub const CHUNK: u64 = 2048;
/// Bytes of a device ID.
pub const ID_BYTES: u32 = 20;

/// Request header and status byte (device-readable and device-writable parts).
#[repr(C, align(64))]
struct ReqMem {
    hdr: [u8; 16],
    status: u8,
}

static REQ_MEM: Pool<ReqMem, { guest_abi::layout::VIRTIO_MMIO_MAX as usize }> = Pool::zeroed();

pub struct Blk {
    t: Transport,
    q: Virtq,
    req: *mut ReqMem,
    flush: bool,
    /// Size in sectors.
    pub capacity: u64,
}

impl Blk {
    pub fn new(t: Transport) -> Option<Self> {
        let features = t.negotiate(F_FLUSH)?;
        let q = t.queue(0, QMAX as u16)?;
        let req: *mut ReqMem = REQ_MEM.take()?;
        let capacity = t.config64(0);
        t.driver_ok();
        Some(Self {
            t,
            q,
            req,
            flush: features & F_FLUSH != 0,
            capacity,
        })
    }

    /// Runs one request; `data` is (gpa, len, device writes it).
    fn request(&mut self, ty: u32, sector: u64, data: Option<(u64, u32, bool)>) -> u32 {
        let mut hdr = [0u8; 16];
        hdr[0..4].copy_from_slice(&ty.to_le_bytes());
        hdr[8..16].copy_from_slice(&sector.to_le_bytes());
        // SAFETY: `req` is this device's own request memory; the device does not
        // touch it while no request is outstanding (requests run one at a time).
        let (hdr_addr, status_addr) = unsafe {
            core::ptr::addr_of_mut!((*self.req).hdr).write_volatile(hdr);
            core::ptr::addr_of_mut!((*self.req).status).write_volatile(0xff);
            (
                core::ptr::addr_of!((*self.req).hdr) as u64,
                core::ptr::addr_of!((*self.req).status) as u64,
            )
        };
        match data {
            Some((addr, len, device_writes)) => {
                self.q.set_desc(0, hdr_addr, 16, DESC_NEXT, 1);
                let w = if device_writes { DESC_WRITE } else { 0 };
                self.q.set_desc(1, addr, len, DESC_NEXT | w, 2);
            }
            None => self.q.set_desc(0, hdr_addr, 16, DESC_NEXT, 2),
        }
        self.q.set_desc(2, status_addr, 1, DESC_WRITE, 0);
        self.q.submit(0);
        self.q.kick();
        self.q.wait_used(&self.t);
        // SAFETY: the device wrote the status byte before returning the buffer.
        let status = unsafe { core::ptr::addr_of!((*self.req).status).read_volatile() };
        if status == S_OK {
            STATUS_OK
        } else {
            STATUS_IO_ERROR
        }
    }

    /// Sets up the one read chain `CMD_FLOOD` posts again and again: `sectors` sectors
    /// from sector 0 into `gpa` (descriptors 0..=2; head 0).
    pub fn flood_chain(&mut self, gpa: u64, sectors: u64) {
        let mut hdr = [0u8; 16];
        hdr[0..4].copy_from_slice(&T_IN.to_le_bytes());
        // SAFETY: `req` is this device's own request memory. From now on the device
        // keeps writing the status byte; nothing reads it.
        let (hdr_addr, status_addr) = unsafe {
            core::ptr::addr_of_mut!((*self.req).hdr).write_volatile(hdr);
            (
                core::ptr::addr_of!((*self.req).hdr) as u64,
                core::ptr::addr_of!((*self.req).status) as u64,
            )
        };
        let len = (sectors.clamp(1, CHUNK) * SECTOR) as u32;
        self.q.set_desc(0, hdr_addr, 16, DESC_NEXT, 1);
        self.q.set_desc(1, gpa, len, DESC_NEXT | DESC_WRITE, 2);
        self.q.set_desc(2, status_addr, 1, DESC_WRITE, 0);
    }

    /// One flood pass (see `Virtq::flood_pass`): chains the device returned.
    pub fn flood_pass(&mut self) -> u64 {
        self.q.flood_pass(0)
    }

    /// Reads (`write == false`) or writes `sectors` sectors at `sector` to/from `gpa`.
    pub fn rw(&mut self, write: bool, sector: u64, gpa: u64, sectors: u64) -> u32 {
        let mut done = 0;
        while done < sectors {
            let n = (sectors - done).min(CHUNK);
            let (ty, dev_writes) = if write { (T_OUT, false) } else { (T_IN, true) };
            let data = (gpa + done * SECTOR, (n * SECTOR) as u32, dev_writes);
            let s = self.request(ty, sector + done, Some(data));
            if s != STATUS_OK {
                return s;
            }
            done += n;
        }
        STATUS_OK
    }

    /// Flushes the device's write cache (a no-op if it has none to flush).
    pub fn flush(&mut self) -> u32 {
        if !self.flush {
            return STATUS_OK;
        }
        self.request(T_FLUSH, 0, None)
    }

    /// The 20-byte device ID, into `gpa`.
    pub fn id(&mut self, gpa: u64) -> u32 {
        self.request(T_GET_ID, 0, Some((gpa, ID_BYTES, true)))
    }
}
