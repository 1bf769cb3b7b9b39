//! [`FileMap`]: a read-only `MAP_SHARED` mapping of a whole file.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;

/// A read-only shared mapping of the first `len` bytes of a file.
///
/// The file must not shrink while mapped (snapshot files never change once
/// committed): reading a page past its end faults with SIGBUS, which ends
/// the process with a clear reason ([`crate::fault`]).
pub(crate) struct FileMap {
    ptr: NonNull<u8>,
    len: usize,
    /// A SIGBUS here ends the process with a clear reason ([`crate::fault`]).
    _fault: crate::fault::FaultGuard,
}

// SAFETY: the mapping is read-only and owned by this value until drop; its
// address may be shared with or sent to other threads.
unsafe impl Send for FileMap {}
// SAFETY: as above: `&FileMap` only gives out reads of read-only memory.
unsafe impl Sync for FileMap {}

impl FileMap {
    /// Maps `len` (> 0) bytes of `file`; the caller checked the file is at
    /// least that long.
    pub(crate) fn new(file: &File, len: usize) -> io::Result<FileMap> {
        // SAFETY: a fresh read-only shared mapping placed by the kernel (no
        // MAP_FIXED), so it overlaps no existing memory; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr =
            NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave NULL"))?;
        Ok(FileMap {
            ptr,
            len,
            _fault: crate::fault::FaultGuard::new(ptr.as_ptr(), len),
        })
    }

    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for FileMap {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `new`, unmapped once; no borrow
        // of it outlives `self`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}
