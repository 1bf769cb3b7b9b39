//! `selftest` on the command line: vCPU 0 runs a few commands through the same
//! code the mailbox uses, prints `selftest: <name> ok|FAIL|skip ...` for each and
//! `selftest: done`, then resets the machine.

use crate::boot;
use crate::bootparams::BootInfo;
use crate::devices::Devices;
use crate::mailbox::{Cmd, Mailbox, Reply};
use crate::println;
use core::fmt;
use guest_abi::layout::{HIMEM_START, TESTGUEST_SCRATCH};
use guest_abi::mailbox::*;

fn report(name: fmt::Arguments, ok: bool, detail: fmt::Arguments) {
    let verdict = if ok { "ok" } else { "FAIL" };
    println!("selftest: {} {} {}", name, verdict, detail);
}

/// `n` bytes at `gpa` in hex.
struct Hex(u64, usize);

impl fmt::Display for Hex {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        for i in 0..self.1 as u64 {
            // SAFETY: the self-test's own scratch buffer, checked by the command
            // that filled it.
            let b = unsafe { ((self.0 + i) as *const u8).read_volatile() };
            write!(f, "{:02x}", b)?;
        }
        Ok(())
    }
}

pub fn run(mbox: &Mailbox, info: &BootInfo, d: &mut Devices) -> ! {
    let mut sectors = [0u64; guest_abi::layout::VIRTIO_MMIO_MAX as usize];
    for (s, b) in sectors.iter_mut().zip(&d.blk) {
        *s = b.as_ref().map_or(0, |b| b.capacity);
    }
    let mut call = |cmd: u32, args: [u64; 4]| match mbox.run(
        &Cmd { seq: 0, cmd, args },
        info,
        Some(&mut *d),
    ) {
        Reply::Done(status, rets) => (status, rets),
        Reply::Later => (STATUS_BAD_CMD, [0; 4]),
    };
    let buf = TESTGUEST_SCRATCH;

    let (_, p) = call(CMD_PROBE, [0; 4]);
    let (nblk, vsock, rng) = (p[0], p[1] == 1, p[2] == 1);
    report(
        format_args!("probe"),
        true,
        format_args!(
            "blk={} vsock={} rng={} cid={}",
            nblk, vsock as u8, rng as u8, p[3]
        ),
    );

    let (s, m) = call(CMD_MEMINFO, [0; 4]);
    report(
        format_args!("meminfo"),
        s == STATUS_OK && m[2] == 1,
        format_args!("usable={:#x} end={:#x}", m[0], m[1]),
    );

    let (s1, f) = call(CMD_FILL, [buf, 16, 0x5eed, 0]);
    let (s2, c) = call(CMD_CHECKSUM, [buf, 16, 0, 0]);
    report(
        format_args!("fill"),
        s1 == STATUS_OK && s2 == STATUS_OK && f[0] == c[0] && f[0] != 0,
        format_args!("checksum={:#018x}", f[0]),
    );

    let (s, _) = call(CMD_FILL, [HIMEM_START, 1, 0, 0]);
    report(
        format_args!("bad-arg"),
        s == STATUS_BAD_ARG,
        format_args!("status={}", s),
    );

    for dev in 0..nblk {
        let at = buf + 0x10_0000;
        let (s, _) = call(CMD_BLK_READ, [dev, 0, at, 1]);
        let (si, _) = call(CMD_BLK_ID, [dev, at + 0x1000, 0, 0]);
        report(
            format_args!("blk{}", dev),
            s == STATUS_OK && si == STATUS_OK,
            format_args!(
                "status={}/{} sectors={} sector0={}",
                s,
                si,
                sectors[dev as usize],
                Hex(at, 16)
            ),
        );
    }

    if rng {
        let at = buf + 0x20_0000;
        let (s, _) = call(CMD_RNG_READ, [at, 32, 0, 0]);
        // SAFETY: 32 bytes of the self-test's scratch buffer, just filled.
        let nonzero = (0..32).any(|i| unsafe { ((at + i) as *const u8).read_volatile() } != 0);
        report(
            format_args!("rng"),
            s == STATUS_OK && nonzero,
            format_args!("status={} bytes={}", s, Hex(at, 16)),
        );
    } else {
        println!("selftest: rng skip no device");
    }

    println!("selftest: done");
    boot::reset()
}
