//! An owned range of host address space that a restore can map guest RAM into,
//! so the VMM can register the range with KVM ahead of time (registration is
//! the slow part of setting up guest memory) and map a snapshot over it later.

use std::io;
use std::ptr::NonNull;

/// Anonymous, private, no-reserve memory of `len` bytes: costs no RAM until
/// touched. Unmapped on drop unless handed to a restore backend.
pub struct Reservation {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a Reservation owns its mapping; nothing in it is tied to a thread.
unsafe impl Send for Reservation {}
// SAFETY: it exposes only the address and length, never the memory itself.
unsafe impl Sync for Reservation {}

/// Where a reservation of at least this much starts: the size of a
/// transparent huge page, so that guest RAM in it can be backed by huge
/// pages and KVM can map 2 MiB at a time (guest physical regions start
/// 2 MiB-aligned too).
pub const RESERVATION_ALIGN: usize = 2 << 20;

impl Reservation {
    /// `len` bytes, starting [`RESERVATION_ALIGN`]-aligned when `len` is at
    /// least that.
    pub fn new(len: usize) -> io::Result<Reservation> {
        if len == 0 || !len.is_multiple_of(crate::PAGE_SIZE) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("reservation of {len} bytes is not a whole number of pages"),
            ));
        }
        let align = if len >= RESERVATION_ALIGN {
            RESERVATION_ALIGN
        } else {
            crate::PAGE_SIZE
        };
        let mapped = len
            .checked_add(align - crate::PAGE_SIZE)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "reservation too large"))?;
        // SAFETY: a fresh mapping placed by the kernel (no MAP_FIXED), so it
        // overlaps nothing; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let at = p as usize;
        let start = at.next_multiple_of(align);
        let (head, tail) = (start - at, mapped - (start - at) - len);
        // SAFETY: both ranges lie inside the mapping just made, outside
        // [start, start + len), and nothing uses them; a failure leaves
        // address space mapped, never memory in use unmapped.
        unsafe {
            if head > 0 {
                libc::munmap(p, head);
            }
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
        }
        let ptr =
            NonNull::new(start as *mut u8).ok_or_else(|| io::Error::other("mmap returned NULL"))?;
        Ok(Reservation { ptr, len })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Gives up ownership: the caller now unmaps the range.
    pub(crate) fn into_raw(self) -> (NonNull<u8>, usize) {
        let r = (self.ptr, self.len);
        std::mem::forget(self);
        r
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // SAFETY: the mapping is ours and nothing borrows it.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_checked() {
        assert!(Reservation::new(0).is_err());
        assert!(Reservation::new(100).is_err());
        let r = Reservation::new(1 << 20).unwrap();
        assert_eq!(r.len(), 1 << 20);
        // SAFETY: the reservation is ours and readable.
        assert_eq!(unsafe { *r.as_ptr() }, 0);
    }

    /// Huge-page-sized reservations start on a huge page, whatever the
    /// kernel placed; all of it is usable and the slop is given back.
    #[test]
    fn large_reservations_are_huge_page_aligned() {
        for len in [2 << 20, (2 << 20) + 4096, 256 << 20] {
            let r = Reservation::new(len).unwrap();
            assert_eq!(r.as_ptr() as usize % RESERVATION_ALIGN, 0, "{len}");
            // SAFETY: the reservation is ours, `len` bytes, read-write.
            unsafe {
                *r.as_ptr() = 1;
                *r.as_ptr().add(len - 1) = 1;
            }
        }
    }
}
