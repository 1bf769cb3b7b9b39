//! The `uffd` restore backend: guest RAM is anonymous private memory
//! registered with userfaultfd (missing-page mode), filled by a page-server
//! thread from the [`LayerStack`]: `UFFDIO_COPY` straight from the layer
//! file's mapping for data pages, `UFFDIO_ZEROPAGE` for zero pages.
//!
//! * **Prefetch**: [`UffdOptions::prefetch`] fills a [`WorkingSet`] in bulk
//!   before [`UffdRestore::start`] returns (runs from one layer are one
//!   multi-page `UFFDIO_COPY`), so the guest does not fault on it.
//! * **Recording**: with [`UffdOptions::record_working_set_for`], the pages
//!   faulted in during that long after start (plus any prefetched) become
//!   [`UffdRestore::working_set`], to [`WorkingSet::save`] beside the snapshot.
//! * **Background**: [`UffdOptions::populate_in_background`] fills the rest,
//!   a batch at a time, between faults.
//! * Races: a page already present (`EEXIST`) is just woken; `EAGAIN` is
//!   retried, then the waiter is woken to fault again. Every fill wakes its
//!   waiters.
//!
//! **Stopping.** [`UffdRestore::stop`] (also on drop) ends the server
//! promptly through an eventfd. If every page was in by then, guest RAM stays
//! usable and is unregistered. Otherwise the server fails closed: guest RAM is
//! made `PROT_NONE` and unregistered, which wakes every waiting access. From
//! then on any access to guest RAM fails instead of hanging: SIGSEGV in a user
//! space thread, EFAULT from a syscall, and an error from `KVM_RUN` (EFAULT or
//! `KVM_EXIT_MEMORY_FAULT`) in a vCPU. The same happens if the server fails
//! (its error is in [`UffdRestore::server_error`]) or panics.

mod fd;
mod guest_ram;
mod server;
mod working_set;

use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use rustix::event::{eventfd, EventfdFlags};

pub use working_set::{WorkingSet, WorkingSetError, WORKING_SET_FILE};

use crate::layers::LayerStack;
use fd::Uffd;
use guest_ram::AnonMap;
use server::{Server, Shared};

#[derive(Debug, thiserror::Error)]
pub enum UffdError {
    #[error("Restore asks for {asked} bytes of RAM, the snapshot has {actual}")]
    Size { asked: u64, actual: u64 },
    #[error("Working set is for {actual} pages, the snapshot has {expected}")]
    WorkingSetPages { actual: u64, expected: u64 },
    #[error("Cannot map guest RAM")]
    Map(#[source] std::io::Error),
    #[error("Cannot open a userfaultfd")]
    Open(#[source] std::io::Error),
    #[error("Cannot register guest RAM with userfaultfd")]
    Register(#[source] std::io::Error),
    #[error("Cannot create the page server's eventfd")]
    EventFd(#[source] std::io::Error),
    #[error("Cannot prefetch the working set")]
    Prefetch(#[source] std::io::Error),
    #[error("Cannot start the page server thread")]
    Spawn(#[source] std::io::Error),
}

/// How [`UffdRestore::start`] fills guest RAM.
#[derive(Clone, Debug, Default)]
pub struct UffdOptions {
    /// Pages to fill before the guest runs.
    pub prefetch: Option<WorkingSet>,
    /// Record the pages faulted in during this long after start.
    pub record_working_set_for: Option<Duration>,
    /// Fill every other page too, in the background.
    pub populate_in_background: bool,
}

/// Counters of a [`UffdRestore`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UffdStats {
    /// Fault messages served (including duplicates and races).
    pub faults: u64,
    /// Pages filled by the prefetch.
    pub pages_prefetched: u64,
    /// Pages filled in the background.
    pub pages_background: u64,
    /// Pages filled with `UFFDIO_ZEROPAGE` (any path).
    pub zero_pages: u64,
    /// Pages filled with `UFFDIO_COPY` (any path).
    pub copied_pages: u64,
    /// Fills that found the page already present (`EEXIST`) and woke it.
    pub already_present: u64,
    /// Distinct pages filled so far.
    pub populated: u64,
    /// Pages of guest RAM.
    pub pages: u64,
    /// Time the prefetch took in [`UffdRestore::start`].
    pub prefetch_time: Duration,
    /// The page server is serving.
    pub running: bool,
    /// The server ended before every page was filled: guest RAM is
    /// inaccessible.
    pub failed_closed: bool,
}

/// Guest RAM restored through userfaultfd, with its page server.
pub struct UffdRestore {
    thread: Mutex<Option<JoinHandle<()>>>,
    stop_fd: Arc<OwnedFd>,
    shared: Arc<Shared>,
    pages: u64,
    /// Dropped after the server thread is joined (in `Drop`).
    map: AnonMap,
    _uffd: Arc<Uffd>,
    /// The layers the server reads (shared with it), to tell a truncated
    /// one from other failures.
    stack: Arc<LayerStack>,
}

impl UffdRestore {
    /// Maps `mem_bytes` (the stack's size) of anonymous memory, registers it,
    /// prefetches `opts.prefetch` and starts the page server.
    pub fn start(
        stack: Arc<LayerStack>,
        mem_bytes: u64,
        opts: UffdOptions,
    ) -> Result<UffdRestore, UffdError> {
        Self::start_impl(stack, mem_bytes, opts, None)
    }

    /// [`UffdRestore::start`] into `at` (length `mem_bytes`), which becomes
    /// guest RAM at the address the caller registered with KVM.
    pub fn start_in(
        stack: Arc<LayerStack>,
        mem_bytes: u64,
        opts: UffdOptions,
        at: crate::Reservation,
    ) -> Result<UffdRestore, UffdError> {
        Self::start_impl(stack, mem_bytes, opts, Some(at))
    }

    fn start_impl(
        stack: Arc<LayerStack>,
        mem_bytes: u64,
        opts: UffdOptions,
        at: Option<crate::Reservation>,
    ) -> Result<UffdRestore, UffdError> {
        if mem_bytes != stack.mem_bytes() {
            return Err(UffdError::Size {
                asked: mem_bytes,
                actual: stack.mem_bytes(),
            });
        }
        if let Some(ws) = &opts.prefetch {
            if ws.mem_pages() != stack.pages() {
                return Err(UffdError::WorkingSetPages {
                    actual: ws.mem_pages(),
                    expected: stack.pages(),
                });
            }
        }
        let len = mem_bytes as usize;
        let map = match at {
            Some(r) if r.len() != len => {
                return Err(UffdError::Size {
                    asked: r.len() as u64,
                    actual: mem_bytes,
                })
            }
            Some(r) => AnonMap::new_in(r),
            None => AnonMap::new(len),
        }
        .map_err(UffdError::Map)?;
        let uffd = Arc::new(Uffd::open().map_err(UffdError::Open)?);
        uffd.register_missing(&map).map_err(UffdError::Register)?;
        let stop_fd = Arc::new(
            eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
                .map_err(|e| UffdError::EventFd(e.into()))?,
        );
        let shared = Arc::new(Shared::default());
        let pages = stack.pages();
        let mut server = Server::new(
            uffd.clone(),
            stop_fd.clone(),
            map.addr(),
            len,
            stack.clone(),
            shared.clone(),
            opts.record_working_set_for,
            opts.populate_in_background,
        );
        if let Some(ws) = opts.prefetch {
            server.prefetch(ws).map_err(UffdError::Prefetch)?;
        }
        shared.running.store(true, Relaxed);
        let thread = std::thread::Builder::new()
            .name("sprout-uffd".into())
            .spawn(move || {
                crate::thread_hook::thread_started(crate::thread_hook::ThreadKind::Uffd);
                server.run()
            })
            .map_err(|e| {
                shared.running.store(false, Relaxed);
                UffdError::Spawn(e)
            })?;
        Ok(UffdRestore {
            thread: Mutex::new(Some(thread)),
            stop_fd,
            shared,
            pages,
            map,
            _uffd: uffd,
            stack,
        })
    }

    /// The first layer file the server reads that changed size since it
    /// was opened: see [`crate::layers::LayerFiles`].
    pub fn changed_layer(&self) -> Option<std::path::PathBuf> {
        self.stack.changed_layer()
    }

    /// Start of guest RAM (the RAM offset space).
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }

    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    pub fn stats(&self) -> UffdStats {
        let s = &self.shared;
        UffdStats {
            faults: s.faults.load(Relaxed),
            pages_prefetched: s.prefetched.load(Relaxed),
            pages_background: s.background.load(Relaxed),
            zero_pages: s.zero_pages.load(Relaxed),
            copied_pages: s.copied_pages.load(Relaxed),
            already_present: s.already_present.load(Relaxed),
            populated: s.populated.load(Relaxed),
            pages: self.pages,
            prefetch_time: Duration::from_nanos(s.prefetch_ns.load(Relaxed)),
            running: s.running.load(Relaxed),
            failed_closed: s.failed_closed.load(Relaxed),
        }
    }

    /// The recorded working set, once the recording window has passed (or
    /// the server stopped); `None` before, or if nothing was recorded.
    pub fn working_set(&self) -> Option<WorkingSet> {
        self.shared
            .working_set
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Why the page server stopped on its own, if it did.
    pub fn server_error(&self) -> Option<String> {
        self.shared
            .error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Stops the page server and waits for it (promptly: it polls an
    /// eventfd). See the module docs for what guest RAM does afterwards.
    /// Calling it again does nothing.
    pub fn stop(&self) {
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = thread {
            if let Err(e) = rustix::io::write(&*self.stop_fd, &1u64.to_ne_bytes()) {
                log::error!("Cannot signal the page server to stop: {e}");
            }
            if t.join().is_err() {
                log::error!("The userfaultfd page server panicked");
            }
        }
    }
}

impl Drop for UffdRestore {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Snapshot;
    use crate::testutil::{fill, full};
    use crate::PAGE_SIZE;

    #[test]
    fn serves_faults_and_stops() {
        let dir = tempfile::tempdir().unwrap();
        let pages = 64u64;
        let mut ram = vec![0u8; pages as usize * PAGE_SIZE];
        for p in 0..pages / 2 {
            fill(&mut ram, p * 2, 5);
        }
        let s = full(dir.path(), "s", &ram);
        let stack = Arc::new(LayerStack::open(&[Snapshot::load(s.dir()).unwrap()]).unwrap());
        let r = UffdRestore::start(stack, ram.len() as u64, UffdOptions::default()).unwrap();
        let addr = r.as_ptr() as usize;
        let expect = ram.clone();
        // Touch from another thread: a fault the server must answer.
        let t = std::thread::spawn(move || {
            for pfn in (0..pages as usize).rev() {
                let got =
                    // SAFETY: the restore's mapping stays alive until after join.
                    unsafe { std::slice::from_raw_parts((addr + pfn * PAGE_SIZE) as *const u8, PAGE_SIZE) };
                assert!(got == &expect[pfn * PAGE_SIZE..][..PAGE_SIZE], "page {pfn}");
            }
        });
        t.join().unwrap();
        assert!(r.stats().running);
        r.stop();
        let st = r.stats();
        assert_eq!(st.faults, pages);
        assert_eq!((st.copied_pages, st.zero_pages), (pages / 2, pages / 2));
        assert!(!st.running && !st.failed_closed, "{st:?}");
        // Every page was in: memory stays usable after stop.
        // SAFETY: still mapped; the test is the only user.
        assert_eq!(unsafe { r.as_ptr().read() }, ram[0]);
    }

    /// A thread already waiting on a fault when the server goes away is
    /// woken and fails (EFAULT from a syscall), deterministically.
    #[test]
    fn a_waiting_fault_is_released_when_the_server_closes() {
        use std::os::fd::{AsRawFd, FromRawFd};
        let dir = tempfile::tempdir().unwrap();
        let mut ram = vec![0u8; 16 * PAGE_SIZE];
        fill(&mut ram, 0, 1);
        let s = full(dir.path(), "s", &ram);
        let stack = Arc::new(LayerStack::open(&[Snapshot::load(s.dir()).unwrap()]).unwrap());
        let map = AnonMap::new(ram.len()).unwrap();
        let uffd = Arc::new(Uffd::open().unwrap());
        uffd.register_missing(&map).unwrap();
        let stop = Arc::new(eventfd(0, EventfdFlags::CLOEXEC).unwrap());
        let shared = Arc::new(Shared::default());
        let mut server = Server::new(
            uffd,
            stop,
            map.addr(),
            map.len(),
            stack,
            shared.clone(),
            None,
            false,
        );
        let mut fds = [0; 2];
        // SAFETY: pipe2 fills two fresh descriptors into the array.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: the descriptors are fresh and owned by nothing else.
        let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let (tx, rx) = std::sync::mpsc::channel();
        let addr = map.addr();
        std::thread::spawn(move || {
            // SAFETY: write(2) reads a page of the registered mapping, which
            // outlives this thread's use (the test waits for the result).
            let n = unsafe { libc::write(wr.as_raw_fd(), addr as *const _, PAGE_SIZE) };
            tx.send((n, std::io::Error::last_os_error())).unwrap();
        });
        std::thread::sleep(Duration::from_millis(200));
        assert!(
            rx.try_recv().is_err(),
            "the access did not wait for a server"
        );
        server.close();
        let (n, err) = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("still waiting");
        assert_eq!((n, err.raw_os_error()), (-1, Some(libc::EFAULT)));
        assert!(shared.failed_closed.load(Relaxed));
        drop(rd);
    }
}
