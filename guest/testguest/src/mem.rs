//! Raw memory helpers: device registers and statics handed out once.

use core::cell::UnsafeCell;
use core::mem::MaybeUninit;
use core::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// A window of 32-bit (and 8-bit) device registers, reached from user mode through
/// the identity map (every access exits to the VMM or the in-kernel APICs).
#[derive(Clone, Copy, Debug)]
pub struct Regs(pub u64);

impl Regs {
    pub fn read(self, off: u64) -> u32 {
        // SAFETY: `self.0 + off` is a device register inside the identity-mapped
        // 0..16 GiB; a volatile read has no effect on Rust-visible memory.
        unsafe { ((self.0 + off) as *const u32).read_volatile() }
    }

    pub fn write(self, off: u64, v: u32) {
        // SAFETY: as in `read`; device registers are not Rust-visible memory.
        unsafe { ((self.0 + off) as *mut u32).write_volatile(v) }
    }

    pub fn write8(self, off: u64, v: u8) {
        // SAFETY: as in `write`.
        unsafe { ((self.0 + off) as *mut u8).write_volatile(v) }
    }
}

/// A zero-initialised static (it lands in .bss) that one caller takes for good.
pub struct Once<T> {
    taken: AtomicBool,
    cell: UnsafeCell<MaybeUninit<T>>,
}

// SAFETY: the cell is handed out at most once (`taken`), so it is never shared.
unsafe impl<T: Send> Sync for Once<T> {}

impl<T> Once<T> {
    /// The value must be valid when all-zero bytes (plain integers and arrays of them).
    pub const fn zeroed() -> Self {
        Self {
            taken: AtomicBool::new(false),
            cell: UnsafeCell::new(MaybeUninit::zeroed()),
        }
    }

    /// The value, the first time; `None` afterwards.
    // Sound despite `&self -> &mut`: `taken` lets exactly one caller through.
    #[allow(clippy::mut_from_ref)]
    pub fn take(&'static self) -> Option<&'static mut T> {
        if self.taken.swap(true, Ordering::AcqRel) {
            return None;
        }
        // SAFETY: only the caller that flipped `taken` gets here, once; the bytes
        // are all zero, which every `Once::zeroed` user's type accepts.
        Some(unsafe { (*self.cell.get()).assume_init_mut() })
    }
}

/// `N` zero-initialised statics handed out one by one.
pub struct Pool<T, const N: usize> {
    next: AtomicUsize,
    cells: UnsafeCell<MaybeUninit<[T; N]>>,
}

// SAFETY: each element is handed out at most once (`next` only grows).
unsafe impl<T: Send, const N: usize> Sync for Pool<T, N> {}

impl<T, const N: usize> Pool<T, N> {
    /// The elements must be valid when all-zero bytes.
    pub const fn zeroed() -> Self {
        Self {
            next: AtomicUsize::new(0),
            cells: UnsafeCell::new(MaybeUninit::zeroed()),
        }
    }

    /// The next element, while there are any.
    // Sound despite `&self -> &mut`: `next` hands each element out once.
    #[allow(clippy::mut_from_ref)]
    pub fn take(&'static self) -> Option<&'static mut T> {
        let i = self.next.fetch_add(1, Ordering::AcqRel);
        if i >= N {
            return None;
        }
        // SAFETY: index `i` is handed out exactly once and is in bounds; the
        // element is all-zero bytes, valid for the element type.
        Some(unsafe { &mut *(self.cells.get() as *mut T).add(i) })
    }
}
