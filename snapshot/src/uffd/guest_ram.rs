//! Guest RAM of a uffd restore: the anonymous mapping the page server fills,
//! and the protection that fails it closed.

use std::io;
use std::ptr::NonNull;

/// An anonymous, private, no-reserve mapping: the restored guest RAM.
pub(super) struct AnonMap {
    ptr: NonNull<u8>,
    len: usize,
}

impl AnonMap {
    pub(super) fn new(len: usize) -> io::Result<AnonMap> {
        let (ptr, len) = crate::Reservation::new(len)?.into_raw();
        Ok(AnonMap { ptr, len })
    }

    /// Anonymous memory in place of `at` (MAP_FIXED over the reservation, so
    /// the address stays the one the caller registered with KVM).
    pub(super) fn new_in(at: crate::Reservation) -> io::Result<AnonMap> {
        let (ptr, len) = at.into_raw();
        // SAFETY: the reservation's range is ours alone (it was handed over);
        // replacing it in place affects no other memory; the result is checked.
        let p = unsafe {
            libc::mmap(
                ptr.as_ptr().cast(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED || p.cast() != ptr.as_ptr() {
            let e = io::Error::last_os_error();
            // SAFETY: as above, the range is ours; drop whatever is there.
            unsafe { libc::munmap(ptr.as_ptr().cast(), len) };
            return Err(e);
        }
        Ok(AnonMap { ptr, len })
    }

    pub(super) fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    pub(super) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }
}

/// Makes `[addr, addr + len)` inaccessible: later accesses fault with SIGSEGV
/// from user space and EFAULT from the kernel (syscalls, KVM).
pub(super) fn protect_none(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: callers pass the restore's own mapping, which outlives the page
    // server (joined before unmapping); taking access away cannot make Rust
    // code unsound, as no Rust reference into guest RAM exists here.
    let r = unsafe { libc::mprotect(addr as *mut libc::c_void, len, libc::PROT_NONE) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

// SAFETY: the mapping is owned by this value and only handed out as an
// address; ownership may move between threads.
unsafe impl Send for AnonMap {}
// SAFETY: `&AnonMap` exposes only the address and length.
unsafe impl Sync for AnonMap {}

impl Drop for AnonMap {
    fn drop(&mut self) {
        // SAFETY: exactly the region mapped in `new`, unmapped once, after the
        // page server that used its address has been joined.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}
