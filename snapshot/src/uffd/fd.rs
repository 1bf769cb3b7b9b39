//! The userfaultfd, through the `userfaultfd` crate: opening it, registering
//! guest RAM, filling pages, waking waiters and reading fault addresses, with
//! the kernel's outcomes mapped to what the page server does next and errors
//! turned into [`io::Error`]s (so the crate's types stay out of this crate's
//! public API).

use std::ffi::c_void;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use userfaultfd::{Error, Event, EventBuffer, IoctlFlags, UffdBuilder};

use super::guest_ram::AnonMap;

/// What a `UFFDIO_COPY` or `UFFDIO_ZEROPAGE` did.
#[derive(Debug)]
pub(super) enum Fill {
    /// All of it (and woke waiters on it).
    Done,
    /// The first `n` bytes (and woke waiters on them); go on after them.
    Partial(u64),
    /// The first page is already populated (nobody was woken).
    Exists,
    /// The address space was changing, or (zeropage only) an unknown prefix
    /// was filled: try again.
    Again,
    Failed(io::Error),
}

/// A userfaultfd, non-blocking, close-on-exec, with the API handshake done.
pub(super) struct Uffd(userfaultfd::Uffd);

impl AsFd for Uffd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl Uffd {
    /// Opens a userfaultfd that handles kernel-mode faults too (KVM's and
    /// syscalls' accesses to guest memory): via `/dev/userfaultfd` if it
    /// exists, else the userfaultfd(2) syscall (which needs CAP_SYS_PTRACE
    /// for that when `vm.unprivileged_userfaultfd` is 0).
    pub(super) fn open() -> io::Result<Uffd> {
        UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            .user_mode_only(false)
            .create()
            .map(Uffd)
            .map_err(io_error)
    }

    /// Registers all of `map` for missing-page faults. Guest RAM is the only
    /// memory ever registered: the fills below rely on that.
    pub(super) fn register_missing(&self, map: &AnonMap) -> io::Result<()> {
        let needed = IoctlFlags::COPY | IoctlFlags::ZEROPAGE | IoctlFlags::WAKE;
        let offered = self
            .0
            .register(map.as_ptr().cast(), map.len())
            .map_err(io_error)?;
        if !offered.contains(needed) {
            return Err(io::Error::other(
                "userfaultfd range lacks COPY/ZEROPAGE/WAKE",
            ));
        }
        Ok(())
    }

    /// Unregisters the range; the kernel wakes every thread waiting on it.
    pub(super) fn unregister(&self, start: usize, len: usize) -> io::Result<()> {
        self.0.unregister(addr(start), len).map_err(io_error)
    }

    /// Wakes threads waiting on faults in the range.
    pub(super) fn wake(&self, start: usize, len: usize) -> io::Result<()> {
        self.0.wake(addr(start), len).map_err(io_error)
    }

    /// Copies `len` bytes from `src` into the registered range at `dst`, and
    /// wakes the waiters on what it filled. `src` may be any address: the
    /// kernel reads it with `copy_from_user` and fails with EFAULT if it is
    /// not readable.
    pub(super) fn copy(&self, dst: usize, src: *const u8, len: usize) -> Fill {
        // The kernel fills only missing pages (never replacing a present
        // one: EEXIST) and only inside ranges registered with this
        // descriptor (ENOENT elsewhere); `src` is read with
        // `copy_from_user`, so a bad one is EFAULT, not UB.
        // SAFETY: the only range ever registered is a restore's anonymous
        // guest RAM (`register_missing` takes the `AnonMap`), which no Rust
        // reference points into: only the guest, KVM and raw pointers reach it.
        let r = unsafe { self.0.copy(src.cast(), addr(dst), len, true) };
        match r {
            Ok(_) => Fill::Done,
            // EAGAIN, with the kernel's count: the bytes filled before it
            // stopped, or -EAGAIN (wrapped) when it filled none.
            Err(Error::PartiallyCopied(n)) if (n as isize) > 0 => Fill::Partial(n as u64),
            Err(Error::PartiallyCopied(_)) => Fill::Again,
            Err(Error::CopyFailed(e)) if e as i32 == libc::EEXIST => Fill::Exists,
            Err(e) => Fill::Failed(io_error(e)),
        }
    }

    /// Maps the zero page over `len` bytes of the registered range at `dst`,
    /// and wakes the waiters on what it filled.
    pub(super) fn zeropage(&self, dst: usize, len: usize) -> Fill {
        // SAFETY: as for `copy`: only missing pages of registered guest RAM,
        // which no Rust reference points into, are filled.
        let r = unsafe { self.0.zeropage(addr(dst), len, true) };
        match r {
            Ok(_) => Fill::Done,
            Err(Error::ZeropageFailed(e)) if e as i32 == libc::EEXIST => Fill::Exists,
            // The crate drops the count of a partial fill: trying the run
            // again finds its filled prefix present (EEXIST) and steps over it.
            Err(Error::ZeropageFailed(e)) if e as i32 == libc::EAGAIN => Fill::Again,
            Err(e) => Fill::Failed(io_error(e)),
        }
    }

    /// Reads the pending messages (at most the buffer's size) and appends the
    /// page-fault addresses among them to `addrs`. Returns how many messages
    /// were read: 0 when none was pending.
    pub(super) fn read_faults(
        &self,
        events: &mut EventBuffer,
        addrs: &mut Vec<u64>,
    ) -> io::Result<usize> {
        loop {
            match self.0.read_events(events) {
                Ok(msgs) => {
                    let mut n = 0;
                    for msg in msgs {
                        n += 1;
                        // No event features are enabled: anything else is
                        // nothing to serve.
                        if let Ok(Event::Pagefault { addr, .. }) = msg {
                            addrs.push(addr as u64);
                        }
                    }
                    return Ok(n);
                }
                Err(Error::SystemError(e)) if e as i32 == libc::EINTR => continue,
                Err(e) => return Err(io_error(e)),
            }
        }
    }
}

fn addr(a: usize) -> *mut c_void {
    a as *mut c_void
}

/// The crate's error as an [`io::Error`], keeping the errno where there is one.
fn io_error(e: Error) -> io::Error {
    match e {
        Error::SystemError(errno) | Error::CopyFailed(errno) | Error::ZeropageFailed(errno) => {
            io::Error::from_raw_os_error(errno as i32)
        }
        Error::OpenDevUserfaultfd(e) => io::Error::new(e.kind(), format!("/dev/userfaultfd: {e}")),
        e => io::Error::other(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PAGE_SIZE;

    fn registered(pages: usize) -> (Uffd, AnonMap) {
        let map = AnonMap::new(pages * PAGE_SIZE).unwrap();
        let uffd = Uffd::open().unwrap();
        uffd.register_missing(&map).unwrap();
        (uffd, map)
    }

    fn page(map: &AnonMap, pfn: usize) -> &[u8] {
        // SAFETY: the page was filled (so reading does not fault) and the
        // mapping outlives the borrow.
        unsafe { std::slice::from_raw_parts(map.as_ptr().add(pfn * PAGE_SIZE), PAGE_SIZE) }
    }

    /// The kernel's outcomes map to the page server's: done, already present,
    /// a partial copy with its count, a partial zero fill to try again, and a
    /// bad source as an error with its errno.
    #[test]
    fn fill_outcomes() {
        let (uffd, map) = registered(6);
        let at = |pfn: usize| map.addr() + pfn * PAGE_SIZE;
        let src = vec![7u8; 2 * PAGE_SIZE];
        assert!(matches!(
            uffd.copy(at(0), src.as_ptr(), PAGE_SIZE),
            Fill::Done
        ));
        assert_eq!(page(&map, 0), &src[..PAGE_SIZE]);
        assert!(matches!(
            uffd.copy(at(0), src.as_ptr(), PAGE_SIZE),
            Fill::Exists
        ));
        assert!(matches!(uffd.zeropage(at(0), PAGE_SIZE), Fill::Exists));

        // Page 2 present: copying pages 1..3 fills page 1, then stops.
        assert!(matches!(uffd.zeropage(at(2), PAGE_SIZE), Fill::Done));
        match uffd.copy(at(1), src.as_ptr(), 2 * PAGE_SIZE) {
            Fill::Partial(n) => assert_eq!(n, PAGE_SIZE as u64),
            other => panic!("{other:?}"),
        }
        assert_eq!(page(&map, 1), &src[..PAGE_SIZE]);
        assert_eq!(page(&map, 2), &[0u8; PAGE_SIZE][..]);

        // Page 4 present: zeroing pages 3..5 fills page 3, then stops; the
        // next try finds page 3 present.
        assert!(matches!(uffd.zeropage(at(4), PAGE_SIZE), Fill::Done));
        assert!(matches!(uffd.zeropage(at(3), 2 * PAGE_SIZE), Fill::Again));
        assert!(matches!(uffd.zeropage(at(3), 2 * PAGE_SIZE), Fill::Exists));
        assert_eq!(page(&map, 3), &[0u8; PAGE_SIZE][..]);

        match uffd.copy(at(5), std::ptr::null(), PAGE_SIZE) {
            Fill::Failed(e) => assert_eq!(e.raw_os_error(), Some(libc::EFAULT)),
            other => panic!("{other:?}"),
        }
        assert!(matches!(uffd.zeropage(at(5), PAGE_SIZE), Fill::Done));
        uffd.wake(map.addr(), map.len()).unwrap();
        uffd.unregister(map.addr(), map.len()).unwrap();
    }

    #[test]
    fn no_faults_pending_reads_nothing() {
        let (uffd, _map) = registered(1);
        let mut events = EventBuffer::new(4);
        let mut addrs = Vec::new();
        assert_eq!(uffd.read_faults(&mut events, &mut addrs).unwrap(), 0);
        assert!(addrs.is_empty());
    }
}
