//! virtio-mmio (version 2 only) and split virtqueues, driven from user mode.
//!
//! The rings live in .bss (identity-mapped, so their addresses are guest physical
//! addresses). Waiting for the device is idling (`boot::idle`), never a long spin:
//! the device's interrupt sets the wake flag, so a completion that lands between a
//! check and the idle call is not missed.

use crate::boot::idle;
use crate::mem::{Pool, Regs};
use core::sync::atomic::{compiler_fence, fence, Ordering};

const MAGIC_VALUE: u64 = 0x000;
const VERSION: u64 = 0x004;
const DEVICE_ID: u64 = 0x008;
const DEVICE_FEATURES: u64 = 0x010;
const DEVICE_FEATURES_SEL: u64 = 0x014;
const DRIVER_FEATURES: u64 = 0x020;
const DRIVER_FEATURES_SEL: u64 = 0x024;
const QUEUE_SEL: u64 = 0x030;
const QUEUE_NUM_MAX: u64 = 0x034;
const QUEUE_NUM: u64 = 0x038;
const QUEUE_READY: u64 = 0x044;
const QUEUE_NOTIFY: u64 = 0x050;
const INTERRUPT_STATUS: u64 = 0x060;
const INTERRUPT_ACK: u64 = 0x064;
const STATUS: u64 = 0x070;
const QUEUE_DESC: u64 = 0x080;
const QUEUE_DRIVER: u64 = 0x090;
const QUEUE_DEVICE: u64 = 0x0a0;
const CONFIG_GENERATION: u64 = 0x0fc;
const CONFIG: u64 = 0x100;

const MAGIC: u32 = 0x7472_6976; // "virt"
const S_ACKNOWLEDGE: u32 = 1;
const S_DRIVER: u32 = 2;
const S_DRIVER_OK: u32 = 4;
const S_FEATURES_OK: u32 = 8;
const S_FAILED: u32 = 128;

pub const ID_NET: u32 = 1;
pub const ID_BLOCK: u32 = 2;
pub const ID_RNG: u32 = 4;
pub const ID_VSOCK: u32 = 19;

pub const F_VERSION_1: u64 = 1 << 32;

pub const DESC_NEXT: u16 = 1;
pub const DESC_WRITE: u16 = 2;
const USED_NO_NOTIFY: u16 = 1;

/// Largest queue the guest sets up.
pub const QMAX: usize = 256;
/// Queues for all devices: up to 12 devices, vsock has 3.
const QUEUES: usize = 16;

#[repr(C)]
#[derive(Clone, Copy)]
struct Desc {
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
}

#[repr(C, align(4096))]
struct Avail {
    flags: u16,
    idx: u16,
    ring: [u16; QMAX],
}

#[repr(C)]
#[derive(Clone, Copy)]
struct UsedElem {
    id: u32,
    len: u32,
}

#[repr(C, align(4096))]
struct Used {
    flags: u16,
    idx: u16,
    ring: [UsedElem; QMAX],
}

#[repr(C, align(4096))]
pub struct QueueMem {
    desc: [Desc; QMAX],
    avail: Avail,
    used: Used,
}

static QUEUE_MEM: Pool<QueueMem, QUEUES> = Pool::zeroed();

/// One device's register window.
#[derive(Clone, Copy, Debug)]
pub struct Transport(Regs);

impl Transport {
    /// The device at `base`, if it is a virtio-mmio version 2 device: (transport, device ID).
    pub fn probe(base: u64) -> Option<(Self, u32)> {
        let r = Regs(base);
        if r.read(MAGIC_VALUE) != MAGIC || r.read(VERSION) != 2 {
            return None;
        }
        let id = r.read(DEVICE_ID);
        (id != 0).then_some((Self(r), id))
    }

    /// Reset, ACKNOWLEDGE, DRIVER, features, FEATURES_OK. Accepts VERSION_1 and those
    /// of `optional` the device offers; returns what was accepted.
    pub fn negotiate(&self, optional: u64) -> Option<u64> {
        let r = self.0;
        r.write(STATUS, 0);
        while r.read(STATUS) != 0 {
            core::hint::spin_loop();
        }
        r.write(STATUS, S_ACKNOWLEDGE);
        r.write(STATUS, S_ACKNOWLEDGE | S_DRIVER);
        r.write(DEVICE_FEATURES_SEL, 0);
        let lo = r.read(DEVICE_FEATURES) as u64;
        r.write(DEVICE_FEATURES_SEL, 1);
        let offered = lo | (r.read(DEVICE_FEATURES) as u64) << 32;
        if offered & F_VERSION_1 == 0 {
            self.fail();
            return None;
        }
        let accepted = offered & (F_VERSION_1 | optional);
        r.write(DRIVER_FEATURES_SEL, 0);
        r.write(DRIVER_FEATURES, accepted as u32);
        r.write(DRIVER_FEATURES_SEL, 1);
        r.write(DRIVER_FEATURES, (accepted >> 32) as u32);
        r.write(STATUS, S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK);
        if r.read(STATUS) & S_FEATURES_OK == 0 {
            self.fail();
            return None;
        }
        Some(accepted)
    }

    /// Sets up queue `index` with at most `want` entries.
    pub fn queue(&self, index: u32, want: u16) -> Option<Virtq> {
        let r = self.0;
        r.write(QUEUE_SEL, index);
        if r.read(QUEUE_READY) != 0 {
            return None;
        }
        let max = r.read(QUEUE_NUM_MAX);
        if max == 0 {
            return None;
        }
        // Queue sizes are powers of two.
        let mut size = (want as u32).min(max).min(QMAX as u32);
        size = 1 << (31 - size.leading_zeros());
        let mem: *mut QueueMem = QUEUE_MEM.take()?;
        r.write(QUEUE_NUM, size);
        // SAFETY: only field addresses are taken, no memory is accessed.
        let (desc, avail, used) = unsafe {
            (
                core::ptr::addr_of!((*mem).desc) as u64,
                core::ptr::addr_of!((*mem).avail) as u64,
                core::ptr::addr_of!((*mem).used) as u64,
            )
        };
        for (reg, addr) in [
            (QUEUE_DESC, desc),
            (QUEUE_DRIVER, avail),
            (QUEUE_DEVICE, used),
        ] {
            r.write(reg, addr as u32);
            r.write(reg + 4, (addr >> 32) as u32);
        }
        r.write(QUEUE_READY, 1);
        Some(Virtq {
            mem,
            size: size as u16,
            avail_idx: 0,
            last_used: 0,
            regs: r,
            index,
        })
    }

    pub fn driver_ok(&self) {
        let r = self.0;
        r.write(STATUS, r.read(STATUS) | S_DRIVER_OK);
    }

    pub fn fail(&self) {
        let r = self.0;
        r.write(STATUS, r.read(STATUS) | S_FAILED);
    }

    /// Acknowledges whatever the device signalled (call before looking at the rings).
    pub fn ack_interrupt(&self) {
        let s = self.0.read(INTERRUPT_STATUS);
        if s != 0 {
            self.0.write(INTERRUPT_ACK, s);
        }
    }

    pub fn config32(&self, off: u64) -> u32 {
        self.0.read(CONFIG + off)
    }

    /// A 64-bit config field, read twice if the device changed it meanwhile.
    pub fn config64(&self, off: u64) -> u64 {
        loop {
            let gen = self.0.read(CONFIG_GENERATION);
            let v = self.config32(off) as u64 | (self.config32(off + 4) as u64) << 32;
            if self.0.read(CONFIG_GENERATION) == gen {
                return v;
            }
        }
    }
}

/// A split virtqueue the driver owns. Descriptor use is the driver's business:
/// each driver here gives every buffer fixed descriptors.
pub struct Virtq {
    mem: *mut QueueMem,
    size: u16,
    avail_idx: u16,
    last_used: u16,
    regs: Regs,
    index: u32,
}

impl Virtq {
    pub fn size(&self) -> u16 {
        self.size
    }

    /// Fills descriptor `i`.
    pub fn set_desc(&mut self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        assert!(i < self.size && next < self.size);
        let d = Desc {
            addr,
            len,
            flags,
            next,
        };
        // SAFETY: `mem` is this queue's own ring memory; `i` is in bounds.
        unsafe { core::ptr::addr_of_mut!((*self.mem).desc[i as usize]).write_volatile(d) }
    }

    /// Makes the chain at `head` available (the device sees it after `kick`, or
    /// whenever it next looks).
    pub fn submit(&mut self, head: u16) {
        let slot = (self.avail_idx % self.size) as usize;
        self.avail_idx = self.avail_idx.wrapping_add(1);
        // SAFETY: the avail ring is this queue's own memory; `slot` < size <= QMAX.
        unsafe {
            core::ptr::addr_of_mut!((*self.mem).avail.ring[slot]).write_volatile(head);
            compiler_fence(Ordering::Release);
            core::ptr::addr_of_mut!((*self.mem).avail.idx).write_volatile(self.avail_idx);
        }
    }

    /// Notifies the device unless it asked not to be.
    pub fn kick(&self) {
        fence(Ordering::SeqCst);
        // SAFETY: the used ring's flags word, written by the device; volatile read.
        let flags = unsafe { core::ptr::addr_of!((*self.mem).used.flags).read_volatile() };
        if flags & USED_NO_NOTIFY == 0 {
            self.regs.write(QUEUE_NOTIFY, self.index);
        }
    }

    pub fn has_used(&self) -> bool {
        // SAFETY: the used index, written by the device; volatile read.
        let idx = unsafe { core::ptr::addr_of!((*self.mem).used.idx).read_volatile() };
        idx != self.last_used
    }

    /// The next used buffer: (head descriptor, bytes written by the device).
    pub fn pop_used(&mut self) -> Option<(u16, u32)> {
        if !self.has_used() {
            return None;
        }
        compiler_fence(Ordering::Acquire);
        let slot = (self.last_used % self.size) as usize;
        // SAFETY: the device published this element before bumping used.idx
        // (checked above); `slot` is in bounds.
        let e = unsafe { core::ptr::addr_of!((*self.mem).used.ring[slot]).read_volatile() };
        self.last_used = self.last_used.wrapping_add(1);
        Some((e.id as u16, e.len))
    }

    /// One pass of a hostile flood (`CMD_FLOOD`): makes `head` available again in
    /// every entry the device has returned (never more than a queue's worth ahead of
    /// its used index), notifies the device whatever its flags ask, and returns how
    /// many chains it returned since the last pass. Never waits.
    pub fn flood_pass(&mut self, head: u16) -> u64 {
        // SAFETY: the used index, written by the device; volatile read.
        let used = unsafe { core::ptr::addr_of!((*self.mem).used.idx).read_volatile() };
        let returned = used.wrapping_sub(self.last_used);
        self.last_used = used;
        while self.avail_idx.wrapping_sub(used) < self.size {
            self.submit(head);
        }
        fence(Ordering::SeqCst);
        self.regs.write(QUEUE_NOTIFY, self.index);
        u64::from(returned)
    }

    /// Idles until the device returns a buffer, then acknowledges its interrupt.
    pub fn wait_used(&mut self, t: &Transport) -> (u16, u32) {
        while !self.has_used() {
            idle();
        }
        t.ack_interrupt();
        self.pop_used().expect("used buffer")
    }
}
