//! Sprout's test guest. boot.rs holds all supervisor code (a few emulated
//! instructions); everything from [`user_main`] on runs in user mode, natively.
#![no_std]
#![no_main]

mod blk;
mod boot;
mod bootparams;
mod devices;
mod ioapic;
mod mailbox;
mod mem;
mod net;
mod rng;
mod selftest;
mod serial;
mod tables;
mod virtio;
mod vsock;

use bootparams::BootInfo;
use core::sync::atomic::{AtomicBool, Ordering};
use devices::Devices;
use guest_abi::layout::MAILBOX_MMIO;
use guest_abi::mailbox::{PANIC_USER, REG_PANIC};
use mailbox::{Mailbox, Reply};

/// Set by vCPU 0 once interrupts are routed and devices are up.
static ROUTED: AtomicBool = AtomicBool::new(false);

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    serial::print_panic(format_args!("testguest panic: {}\n", info));
    mem::Regs(MAILBOX_MMIO).write(REG_PANIC, PANIC_USER);
    loop {
        boot::idle();
    }
}

/// First user-mode code on every vCPU (RDI and RSI as the VMM set them).
extern "C" fn user_main(cpu: u64, zero_page: u64) -> ! {
    let cpu = cpu as u32;
    println!("sprout testguest: cpu {} up", cpu);
    let info = BootInfo::read(zero_page);
    let mbox = Mailbox::new(cpu);
    let mut devs = None;
    if cpu == 0 {
        ioapic::route_all(&info);
        let mut d = Devices::probe(&info);
        ROUTED.store(true, Ordering::Release);
        if info.has_word(b"selftest") {
            selftest::run(&mbox, &info, &mut d);
        }
        devs = Some(d);
    } else {
        while !ROUTED.load(Ordering::Acquire) {
            core::hint::spin_loop();
        }
    }
    mbox.ready();
    serve(&mbox, &info, devs.as_mut())
}

/// Serves the mailbox (and, on vCPU 0, vsock) forever, idling when there is nothing to do.
fn serve(mbox: &Mailbox, info: &BootInfo, mut devs: Option<&mut Devices>) -> ! {
    // The sequence number of a command still running.
    let mut running: Option<u32> = None;
    loop {
        let mut busy = false;
        if let Some(v) = devs.as_mut().and_then(|d| d.vsock.as_mut()) {
            busy |= v.poll();
            if let Some((status, len)) = v.take_result() {
                if let Some(seq) = running.take() {
                    mbox.finish(seq, status, [len, 0, 0, 0]);
                }
            }
        }
        if running.is_none() {
            if let Some(c) = mbox.next() {
                busy = true;
                match mbox.run(&c, info, devs.as_deref_mut()) {
                    Reply::Done(status, rets) => mbox.finish(c.seq, status, rets),
                    Reply::Later => running = Some(c.seq),
                }
            }
        }
        if !busy {
            boot::idle();
        }
    }
}
