//! The command mailbox (guest_abi::mailbox): this vCPU's slot and the commands.

use crate::boot;
use crate::bootparams::BootInfo;
use crate::devices::{probe_rets, Devices};
use crate::mem::Regs;
use crate::{blk, serial, vsock};
use core::ptr::addr_of_mut;
use core::sync::atomic::{compiler_fence, Ordering};
use guest_abi::layout::{MAILBOX_GPA, MAILBOX_MMIO, PAGE_SIZE};
use guest_abi::mailbox::*;

/// A command read from the slot.
#[derive(Clone, Copy, Debug)]
pub struct Cmd {
    pub seq: u32,
    pub cmd: u32,
    pub args: [u64; 4],
}

pub enum Reply {
    Done(u32, [u64; 4]),
    /// Still running (`CMD_VSOCK_SEND`); the main loop finishes it.
    Later,
}

/// This vCPU's slot.
pub struct Mailbox {
    cpu: u32,
    slot: *mut Slot,
}

impl Mailbox {
    pub fn new(cpu: u32) -> Self {
        Self {
            cpu,
            slot: (MAILBOX_GPA + cpu as u64 * SLOT_SIZE) as *mut Slot,
        }
    }

    fn doorbell(&self, reg: u64) {
        Regs(MAILBOX_MMIO).write(reg, self.cpu);
    }

    /// Tells the host this vCPU serves its slot.
    pub fn ready(&self) {
        self.doorbell(REG_READY);
    }

    /// The command the host posted, if it is new.
    pub fn next(&self) -> Option<Cmd> {
        let s = self.slot;
        // SAFETY: the slot is this vCPU's part of the mailbox page (identity-mapped
        // low RAM), shared with the host only: volatile accesses.
        unsafe {
            let seq = addr_of_mut!((*s).seq).read_volatile();
            if seq == addr_of_mut!((*s).done_seq).read_volatile() {
                return None;
            }
            // The host writes seq last.
            compiler_fence(Ordering::Acquire);
            Some(Cmd {
                seq,
                cmd: addr_of_mut!((*s).cmd).read_volatile(),
                args: addr_of_mut!((*s).args).read_volatile(),
            })
        }
    }

    /// rets, status, done_seq, then the doorbell.
    pub fn finish(&self, seq: u32, status: u32, rets: [u64; 4]) {
        let s = self.slot;
        // SAFETY: as in `next`.
        unsafe {
            addr_of_mut!((*s).rets).write_volatile(rets);
            addr_of_mut!((*s).status).write_volatile(status);
            compiler_fence(Ordering::Release);
            addr_of_mut!((*s).done_seq).write_volatile(seq);
        }
        self.doorbell(REG_DONE);
    }

    fn counter(&self) -> *mut u64 {
        // SAFETY: only the field address is taken.
        unsafe { addr_of_mut!((*self.slot).counter) }
    }

    /// Runs `c`. `devs` is `Some` on vCPU 0 only.
    pub fn run(&self, c: &Cmd, info: &BootInfo, devs: Option<&mut Devices>) -> Reply {
        let [a0, a1, a2, _] = c.args;
        let r = match c.cmd {
            CMD_ECHO => Ok([a0, self.cpu as u64, 0, 0]),
            CMD_FILL => words(info, a0, a1).map(|n| [fill(a0, n, a2), 0, 0, 0]),
            CMD_CHECKSUM => words(info, a0, a1).map(|n| [checksum(a0, n), 0, 0, 0]),
            CMD_COUNT => Ok([count(self.counter(), a0), 0, 0, 0]),
            CMD_MEMINFO => Ok(meminfo(info)),
            CMD_CPUID => {
                // SAFETY: CPUID exists on every x86_64 CPU and has no side
                // effects here.
                let r = unsafe { core::arch::x86_64::__cpuid_count(a0 as u32, a1 as u32) };
                Ok([r.eax, r.ebx, r.ecx, r.edx].map(u64::from))
            }
            CMD_PRINT => buffer(info, a0, a1).map(|p| {
                // SAFETY: `buffer` checked the range is host scratch RAM.
                serial::print_bytes(unsafe { core::slice::from_raw_parts(p, a1 as usize) });
                [0; 4]
            }),
            CMD_PROBE => Ok(probe_rets(devs.as_deref())),
            CMD_RESET => boot::reset(),
            CMD_FLOOD => match devs {
                Some(d) => return self.flood(c, info, d),
                None => Err(STATUS_NO_DEVICE),
            },
            CMD_BLK_READ | CMD_BLK_WRITE | CMD_BLK_FLUSH | CMD_BLK_ID | CMD_RNG_READ
            | CMD_VSOCK_SEND | CMD_NET_SEND | CMD_NET_RECV => match devs {
                Some(d) => return device_cmd(c, info, d),
                None => Err(STATUS_NO_DEVICE),
            },
            _ => Err(STATUS_BAD_CMD),
        };
        match r {
            Ok(rets) => Reply::Done(STATUS_OK, rets),
            Err(status) => Reply::Done(status, [0; 4]),
        }
    }
}

impl Mailbox {
    /// `CMD_FLOOD`: answers a bad request; otherwise answers "started" and floods
    /// the chosen queues forever from this vCPU, in user mode.
    fn flood(&self, c: &Cmd, info: &BootInfo, d: &mut Devices) -> Reply {
        let [targets, dev, gpa, sectors] = c.args;
        if targets == 0 || targets & !(FLOOD_BLK | FLOOD_RNG) != 0 {
            return done(STATUS_BAD_ARG);
        }
        if !(1..=blk::CHUNK).contains(&sectors)
            || gpa % 8 != 0
            || buffer(info, gpa, flood_bytes(sectors)).is_err()
        {
            return done(STATUS_BAD_ARG);
        }
        let mut blk = None;
        if targets & FLOOD_BLK != 0 {
            // The field, not `Devices::blk`, so that `d.rng` stays free to borrow.
            let slot = usize::try_from(dev).ok().and_then(|i| d.blk.get_mut(i));
            let Some(b) = slot.and_then(Option::as_mut) else {
                return done(STATUS_NO_DEVICE);
            };
            b.flood_chain(gpa, sectors);
            blk = Some(b);
        }
        let mut rng = None;
        if targets & FLOOD_RNG != 0 {
            let Some(r) = d.rng.as_mut() else {
                return done(STATUS_NO_DEVICE);
            };
            r.flood_chain(gpa + sectors * blk::SECTOR, FLOOD_RNG_BYTES as u32);
            rng = Some(r);
        }
        let counts = flood_counts_gpa(gpa, sectors) as *mut u64;
        // SAFETY: checked above: host scratch RAM lent to this command, 8-byte aligned.
        unsafe { counts.cast::<[u64; 2]>().write_volatile([0; 2]) };
        self.finish(c.seq, STATUS_OK, [targets, 0, 0, 0]);
        let counter = self.counter();
        let mut total = [0u64; 2];
        loop {
            let returned = [
                blk.as_mut().map_or(0, |b| b.flood_pass()),
                rng.as_mut().map_or(0, |r| r.flood_pass()),
            ];
            if returned == [0; 2] {
                continue;
            }
            total = [total[0] + returned[0], total[1] + returned[1]];
            // SAFETY: the counter lives in this vCPU's slot, only this vCPU writes it;
            // `counts` as above.
            unsafe {
                counter.write_volatile(counter.read_volatile() + returned[0] + returned[1]);
                counts.cast::<[u64; 2]>().write_volatile(total);
            }
        }
    }
}

fn done(status: u32) -> Reply {
    Reply::Done(status, [0; 4])
}

fn device_cmd(c: &Cmd, info: &BootInfo, d: &mut Devices) -> Reply {
    let [a0, a1, a2, a3] = c.args;
    match c.cmd {
        CMD_BLK_READ | CMD_BLK_WRITE => {
            let Some(b) = d.blk(a0) else {
                return done(STATUS_NO_DEVICE);
            };
            match a3.checked_mul(blk::SECTOR) {
                Some(len) if buffer(info, a2, len).is_ok() => {
                    done(b.rw(c.cmd == CMD_BLK_WRITE, a1, a2, a3))
                }
                _ => done(STATUS_BAD_ARG),
            }
        }
        CMD_BLK_FLUSH => match d.blk(a0) {
            Some(b) => done(b.flush()),
            None => done(STATUS_NO_DEVICE),
        },
        CMD_BLK_ID => match d.blk(a0) {
            Some(b) if buffer(info, a1, blk::ID_BYTES as u64).is_ok() => done(b.id(a1)),
            Some(_) => done(STATUS_BAD_ARG),
            None => done(STATUS_NO_DEVICE),
        },
        CMD_NET_SEND | CMD_NET_RECV => match d.net.as_mut() {
            Some(n) if a1 <= 65_562 && buffer(info, a0, a1).is_ok() => {
                let (status, len) = if c.cmd == CMD_NET_SEND {
                    n.send(a0, a1 as u32)
                } else {
                    n.recv(a0, a1 as u32)
                };
                Reply::Done(status, [u64::from(len), 0, 0, 0])
            }
            Some(_) => done(STATUS_BAD_ARG),
            None => done(STATUS_NO_DEVICE),
        },
        CMD_RNG_READ => match d.rng.as_mut() {
            Some(r) if a1 <= 4096 && buffer(info, a0, a1).is_ok() => done(r.read(a0, a1 as u32)),
            Some(_) => done(STATUS_BAD_ARG),
            None => done(STATUS_NO_DEVICE),
        },
        CMD_VSOCK_SEND => {
            let Some(v) = d.vsock.as_mut() else {
                return done(STATUS_NO_DEVICE);
            };
            let (Ok(port), true) = (
                u32::try_from(a0),
                buffer(info, a1, a2.max(vsock::MAX_REPLY)).is_ok(),
            ) else {
                return done(STATUS_BAD_ARG);
            };
            match v.start_send(port, a1, a2) {
                Ok(()) => Reply::Later,
                Err(s) => done(s),
            }
        }
        _ => done(STATUS_BAD_CMD),
    }
}

/// `[gpa, gpa + len)` as a pointer, if it is host scratch RAM.
fn buffer(info: &BootInfo, gpa: u64, len: u64) -> Result<*mut u8, u32> {
    if info.buffer_ok(gpa, len) {
        Ok(gpa as *mut u8)
    } else {
        Err(STATUS_BAD_ARG)
    }
}

/// `pages` pages of 8-byte words at `gpa`: how many words, if it is host scratch RAM.
fn words(info: &BootInfo, gpa: u64, pages: u64) -> Result<u64, u32> {
    let len = pages.checked_mul(PAGE_SIZE).ok_or(STATUS_BAD_ARG)?;
    if gpa % 8 != 0 {
        return Err(STATUS_BAD_ARG);
    }
    buffer(info, gpa, len).map(|_| len / 8)
}

fn fill(gpa: u64, words: u64, seed: u64) -> u64 {
    let mut sum = 0;
    for i in 0..words {
        let addr = gpa + i * 8;
        let w = pattern_word(seed, addr);
        // SAFETY: `words` checked the range is host scratch RAM lent to this command.
        unsafe { (addr as *mut u64).write_volatile(w) };
        sum = checksum_step(sum, w);
    }
    sum
}

fn checksum(gpa: u64, words: u64) -> u64 {
    let mut sum = 0;
    for i in 0..words {
        // SAFETY: `words` checked the range is host scratch RAM lent to this command.
        let w = unsafe { ((gpa + i * 8) as *const u64).read_volatile() };
        sum = checksum_step(sum, w);
    }
    sum
}

/// Adds 1 to the slot's counter `n` times (a plain user-mode loop).
fn count(counter: *mut u64, n: u64) -> u64 {
    for _ in 0..n {
        // SAFETY: the counter lives in this vCPU's slot; only this vCPU writes it.
        unsafe { counter.write_volatile(counter.read_volatile() + 1) };
    }
    // SAFETY: as above.
    unsafe { counter.read_volatile() }
}

fn meminfo(info: &BootInfo) -> [u64; 4] {
    let end = info.ram_end();
    let mut ok = 0;
    if end >= PAGE_SIZE {
        let (first, last) = ((end - PAGE_SIZE) as *mut u64, (end - 8) as *mut u64);
        // SAFETY: the last page of usable RAM (identity-mapped; RAM is at least
        // 128 MiB, so it is never this image); the old words are put back.
        unsafe {
            let old = (first.read_volatile(), last.read_volatile());
            first.write_volatile(0x5eed_0000_0000_0001);
            last.write_volatile(!0x5eed_0000_0000_0001);
            if first.read_volatile() == 0x5eed_0000_0000_0001
                && last.read_volatile() == !0x5eed_0000_0000_0001
            {
                ok = 1;
            }
            first.write_volatile(old.0);
            last.write_volatile(old.1);
        }
    }
    [info.usable_bytes(), end, ok, 0]
}
