//! The userfaultfd ABI (linux/userfaultfd.h) as raw ioctls, wrapped in a
//! small safe [`Uffd`], plus the anonymous mapping it serves.
//!
//! The constants are this crate's own (checked against the C header's values
//! in the tests below), so no bindgen or libclang is needed.

use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

const UFFD_API: u64 = 0xAA;
const IOC_WRITE: u64 = 1;
const IOC_READ: u64 = 2;

const fn ioc(dir: u64, nr: u64, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | (0xAA << 8) | nr
}

const USERFAULTFD_IOC_NEW: u64 = ioc(0, 0x00, 0);
const UFFDIO_API: u64 = ioc(IOC_READ | IOC_WRITE, 0x3F, size_of::<UffdioApi>());
const UFFDIO_REGISTER: u64 = ioc(IOC_READ | IOC_WRITE, 0x00, size_of::<UffdioRegister>());
const UFFDIO_UNREGISTER: u64 = ioc(IOC_READ, 0x01, size_of::<UffdioRange>());
const UFFDIO_WAKE: u64 = ioc(IOC_READ, 0x02, size_of::<UffdioRange>());
const UFFDIO_COPY: u64 = ioc(IOC_READ | IOC_WRITE, 0x03, size_of::<UffdioCopy>());
const UFFDIO_ZEROPAGE: u64 = ioc(IOC_READ | IOC_WRITE, 0x04, size_of::<UffdioZeropage>());

const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;
/// Ioctl bits (`1 << _UFFDIO_*`) a registered range must offer.
const RANGE_IOCTLS_NEEDED: u64 = (1 << 0x02) | (1 << 0x03) | (1 << 0x04);

/// `sizeof(struct uffd_msg)`; the fault address is at byte 16.
pub(super) const MSG_SIZE: usize = 32;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

#[repr(C)]
struct UffdioZeropage {
    range: UffdioRange,
    mode: u64,
    zeropage: i64,
}

/// What a `UFFDIO_COPY` or `UFFDIO_ZEROPAGE` did.
#[derive(Debug)]
pub(super) enum Fill {
    /// All of it (and woke waiters on it).
    Done,
    /// The first `n` bytes (and woke waiters on them); go on after them.
    Partial(u64),
    /// The first page is already populated (nobody was woken).
    Exists,
    /// The address space was changing: try again.
    Again,
    Failed(io::Error),
}

/// A userfaultfd, non-blocking, with the API handshake done.
pub(super) struct Uffd {
    fd: OwnedFd,
}

impl AsFd for Uffd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Uffd {
    /// Opens a userfaultfd that handles kernel-mode faults too (KVM's and
    /// syscalls' accesses to guest memory): via `/dev/userfaultfd`, or the
    /// userfaultfd(2) syscall (which needs CAP_SYS_PTRACE for that when
    /// `vm.unprivileged_userfaultfd` is 0).
    pub(super) fn open() -> io::Result<Uffd> {
        let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        let dev = OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/userfaultfd")
            .and_then(|dev| {
                // SAFETY: USERFAULTFD_IOC_NEW takes the flags by value and
                // returns a new descriptor or -1; nothing else is touched.
                let fd = unsafe {
                    libc::ioctl(dev.as_raw_fd(), USERFAULTFD_IOC_NEW as libc::c_ulong, flags)
                };
                if fd < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(fd)
                }
            });
        let fd = match dev {
            Ok(fd) => fd,
            Err(dev_err) => {
                // SAFETY: userfaultfd(2) takes flags and returns a new
                // descriptor or -1.
                let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
                if fd < 0 {
                    let sys_err = io::Error::last_os_error();
                    return Err(io::Error::new(
                        sys_err.kind(),
                        format!("/dev/userfaultfd: {dev_err}; userfaultfd(2): {sys_err}"),
                    ));
                }
                fd as i32
            }
        };
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let uffd = Uffd { fd };
        let mut api = UffdioApi {
            api: UFFD_API,
            features: 0,
            ioctls: 0,
        };
        uffd.ioctl(UFFDIO_API, &mut api)?;
        Ok(uffd)
    }

    /// Issues `req` with `arg`, which is the struct the request is sized for.
    fn ioctl<T>(&self, req: u64, arg: &mut T) -> io::Result<()> {
        // SAFETY: every caller passes the request's own argument struct
        // (sizes are encoded in `req` and match `T`); the kernel reads and
        // writes only that struct, and acts on ranges registered with this
        // descriptor (memory the restore owns), never on Rust objects.
        let r = unsafe { libc::ioctl(self.fd.as_raw_fd(), req as libc::c_ulong, arg as *mut T) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    /// Registers `[start, start + len)` for missing-page faults.
    pub(super) fn register_missing(&self, start: usize, len: usize) -> io::Result<()> {
        let mut reg = UffdioRegister {
            range: range(start, len),
            mode: UFFDIO_REGISTER_MODE_MISSING,
            ioctls: 0,
        };
        self.ioctl(UFFDIO_REGISTER, &mut reg)?;
        if reg.ioctls & RANGE_IOCTLS_NEEDED != RANGE_IOCTLS_NEEDED {
            return Err(io::Error::other(
                "userfaultfd range lacks COPY/ZEROPAGE/WAKE",
            ));
        }
        Ok(())
    }

    /// Unregisters the range; the kernel wakes every thread waiting on it.
    pub(super) fn unregister(&self, start: usize, len: usize) -> io::Result<()> {
        self.ioctl(UFFDIO_UNREGISTER, &mut range(start, len))
    }

    /// Wakes threads waiting on faults in the range.
    pub(super) fn wake(&self, start: usize, len: usize) -> io::Result<()> {
        self.ioctl(UFFDIO_WAKE, &mut range(start, len))
    }

    /// Copies `len` bytes from `src` into the registered range at `dst`.
    /// `src` may be any address: the kernel reads it with `copy_from_user`
    /// and fails with EFAULT if it is not readable.
    pub(super) fn copy(&self, dst: usize, src: *const u8, len: usize) -> Fill {
        let mut c = UffdioCopy {
            dst: dst as u64,
            src: src as u64,
            len: len as u64,
            mode: 0,
            copy: 0,
        };
        let r = self.ioctl(UFFDIO_COPY, &mut c);
        fill_outcome(r, c.copy)
    }

    /// Maps the zero page over `len` bytes of the registered range at `dst`.
    pub(super) fn zeropage(&self, dst: usize, len: usize) -> Fill {
        let mut z = UffdioZeropage {
            range: range(dst, len),
            mode: 0,
            zeropage: 0,
        };
        let r = self.ioctl(UFFDIO_ZEROPAGE, &mut z);
        fill_outcome(r, z.zeropage)
    }
}

fn range(start: usize, len: usize) -> UffdioRange {
    UffdioRange {
        start: start as u64,
        len: len as u64,
    }
}

fn fill_outcome(r: io::Result<()>, done: i64) -> Fill {
    match r {
        Ok(()) => Fill::Done,
        Err(_) if done > 0 => Fill::Partial(done as u64),
        Err(e) => match e.raw_os_error() {
            Some(libc::EEXIST) => Fill::Exists,
            Some(libc::EAGAIN) => Fill::Again,
            _ => Fill::Failed(e),
        },
    }
}

/// Fault addresses in a buffer of `uffd_msg`s read from the descriptor.
pub(super) fn fault_addresses(buf: &[u8]) -> impl Iterator<Item = u64> + '_ {
    buf.chunks_exact(MSG_SIZE)
        .filter(|m| m[0] == UFFD_EVENT_PAGEFAULT)
        .map(|m| u64::from_ne_bytes(m[16..24].try_into().expect("8 bytes")))
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_kernel_header() {
        assert_eq!(UFFDIO_API, 0xc018_aa3f);
        assert_eq!(UFFDIO_REGISTER, 0xc020_aa00);
        assert_eq!(UFFDIO_UNREGISTER, 0x8010_aa01);
        assert_eq!(UFFDIO_WAKE, 0x8010_aa02);
        assert_eq!(UFFDIO_COPY, 0xc028_aa03);
        assert_eq!(UFFDIO_ZEROPAGE, 0xc020_aa04);
        assert_eq!(USERFAULTFD_IOC_NEW, 0xaa00);
    }
}
