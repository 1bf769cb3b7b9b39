//! The serial console: bytes written to the 8250's THR through its MMIO alias
//! (the VMM's serial never blocks, so no LSR polling).

use crate::mem::Regs;
use core::fmt::{self, Write};
use core::sync::atomic::{AtomicBool, Ordering};
use guest_abi::layout::SERIAL_MMIO;

const THR: u64 = 0;
static LOCK: AtomicBool = AtomicBool::new(false);

struct Console;

impl Write for Console {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        write_bytes(s.as_bytes());
        Ok(())
    }
}

fn write_bytes(b: &[u8]) {
    let uart = Regs(SERIAL_MMIO);
    for &c in b {
        uart.write8(THR, c);
    }
}

fn locked<R>(f: impl FnOnce() -> R) -> R {
    while LOCK
        .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        core::hint::spin_loop();
    }
    let r = f();
    LOCK.store(false, Ordering::Release);
    r
}

/// Prints formatted text, whole (other vCPUs' output does not interleave).
pub fn print(args: fmt::Arguments) {
    locked(|| {
        let _ = Console.write_fmt(args);
    });
}

/// Prints raw bytes, whole.
pub fn print_bytes(b: &[u8]) {
    locked(|| write_bytes(b));
}

/// Prints for a panic: takes the lock if it comes free soon, else prints anyway
/// (the panic may have struck while this vCPU held it).
pub fn print_panic(args: fmt::Arguments) {
    for _ in 0..(1 << 24) {
        if LOCK
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            let _ = Console.write_fmt(args);
            LOCK.store(false, Ordering::Release);
            return;
        }
        core::hint::spin_loop();
    }
    let _ = Console.write_fmt(args);
}

#[macro_export]
macro_rules! println {
    ($($arg:tt)*) => {
        $crate::serial::print(format_args!("{}\n", format_args!($($arg)*)))
    };
}
