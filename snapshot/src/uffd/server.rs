//! The page server: fills guest RAM from the layer stack, on faults, for a
//! prefetch, and in the background; records the working set; and, when it
//! ends before every page is in, makes guest RAM inaccessible so that no
//! access can wait for it forever.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};

use userfaultfd::EventBuffer;

use super::fd::{Fill, Uffd};
use super::guest_ram;
use super::WorkingSet;
use crate::layers::{LayerStack, PageSource};
use crate::PAGE_SIZE;

const PAGE: u64 = PAGE_SIZE as u64;
/// Pages filled per background step, between looks at pending faults.
const BACKGROUND_BATCH: u64 = 512;
/// Fault messages read at once.
const MSGS: usize = 64;
/// Tries of an `EAGAIN`ing fill before waking the waiter to fault again.
const AGAIN_TRIES: u32 = 100;

/// State shared between the page server and [`super::UffdRestore`].
#[derive(Default)]
pub(super) struct Shared {
    pub faults: AtomicU64,
    pub prefetched: AtomicU64,
    pub background: AtomicU64,
    pub zero_pages: AtomicU64,
    pub copied_pages: AtomicU64,
    pub already_present: AtomicU64,
    pub populated: AtomicU64,
    pub prefetch_ns: AtomicU64,
    pub running: AtomicBool,
    pub failed_closed: AtomicBool,
    pub error: Mutex<Option<String>>,
    pub working_set: Mutex<Option<WorkingSet>>,
}

/// Why pages are being filled (for the statistics).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Why {
    Fault,
    Prefetch,
    Background,
}

pub(super) struct Server {
    uffd: Arc<Uffd>,
    stop: Arc<OwnedFd>,
    base: usize,
    len: usize,
    stack: Arc<LayerStack>,
    shared: Arc<Shared>,
    populated: Vec<u64>,
    populated_count: u64,
    record_for: Option<Duration>,
    record: Option<(Instant, Vec<u64>)>,
    prefetched: Option<WorkingSet>,
    background: Option<u64>,
}

impl Server {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        uffd: Arc<Uffd>,
        stop: Arc<OwnedFd>,
        base: usize,
        len: usize,
        stack: Arc<LayerStack>,
        shared: Arc<Shared>,
        record_for: Option<Duration>,
        background: bool,
    ) -> Server {
        let pages = stack.pages();
        Server {
            uffd,
            stop,
            base,
            len,
            stack,
            shared,
            populated: vec![0; pages.div_ceil(64) as usize],
            populated_count: 0,
            record_for,
            record: None,
            prefetched: None,
            background: background.then_some(0),
        }
    }

    /// Fills the working set's pages, coalescing runs that come from one
    /// place into one ioctl. Runs before the server thread starts.
    pub(super) fn prefetch(&mut self, ws: WorkingSet) -> io::Result<()> {
        let start = Instant::now();
        for &(first, count) in ws.runs() {
            self.fill(first, count, Why::Prefetch)?;
        }
        self.shared
            .prefetch_ns
            .store(start.elapsed().as_nanos() as u64, Relaxed);
        self.prefetched = Some(ws);
        Ok(())
    }

    /// Serves until stopped or broken, then closes up (see [`Server::close`]),
    /// also if it panics.
    pub(super) fn run(self) {
        let mut this = CloseOnExit(self);
        let s = &mut this.0;
        // The recording window starts now, when the guest can first run.
        s.record = s.record_for.map(|d| (Instant::now() + d, Vec::new()));
        if let Err(e) = s.serve() {
            log::error!("userfaultfd page server failed: {e}");
            *s.shared.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.to_string());
        }
    }

    fn serve(&mut self) -> io::Result<()> {
        let mut events = EventBuffer::new(MSGS);
        let mut addrs = Vec::with_capacity(MSGS);
        loop {
            let timeout = if self.background.is_some() {
                Some(Duration::ZERO)
            } else {
                self.record
                    .as_ref()
                    .map(|(d, _)| d.saturating_duration_since(Instant::now()))
            };
            let ts = timeout.map(|t| Timespec {
                tv_sec: t.as_secs() as _,
                tv_nsec: t.subsec_nanos() as _,
            });
            let mut fds = [
                PollFd::new(&*self.uffd, PollFlags::IN),
                PollFd::new(&*self.stop, PollFlags::IN),
            ];
            match poll(&mut fds, ts.as_ref()) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
            let (uffd_ev, stop_ev) = (fds[0].revents(), fds[1].revents());
            if !stop_ev.is_empty() {
                return Ok(());
            }
            if uffd_ev.intersects(PollFlags::ERR | PollFlags::HUP | PollFlags::NVAL) {
                return Err(io::Error::other("userfaultfd reported an error"));
            }
            if uffd_ev.contains(PollFlags::IN) {
                self.drain_faults(&mut events, &mut addrs)?;
            }
            self.end_recording_if_due();
            self.background_step()?;
        }
    }

    fn drain_faults(&mut self, events: &mut EventBuffer, addrs: &mut Vec<u64>) -> io::Result<()> {
        loop {
            addrs.clear();
            let n = self.uffd.read_faults(events, addrs)?;
            for &addr in addrs.iter() {
                let Some(off) = (addr as usize)
                    .checked_sub(self.base)
                    .filter(|&o| o < self.len)
                else {
                    continue;
                };
                let pfn = off as u64 / PAGE;
                self.shared.faults.fetch_add(1, Relaxed);
                if let Some((_, pfns)) = &mut self.record {
                    pfns.push(pfn);
                }
                // Fill even if already marked populated: the page may have
                // been discarded since; EEXIST then just wakes the waiter.
                self.fill(pfn, 1, Why::Fault)?;
            }
            if n < MSGS {
                return Ok(());
            }
        }
    }

    fn end_recording_if_due(&mut self) {
        if self
            .record
            .as_ref()
            .is_some_and(|(d, _)| Instant::now() >= *d)
        {
            self.finish_recording();
        }
    }

    fn finish_recording(&mut self) {
        if let Some((_, pfns)) = self.record.take() {
            let pages = self.stack.pages();
            let earlier = self.prefetched.as_ref().map(|w| w.pfns());
            let ws =
                WorkingSet::from_pfns(pages, pfns.into_iter().chain(earlier.into_iter().flatten()));
            *self
                .shared
                .working_set
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Some(ws);
        }
    }

    fn background_step(&mut self) -> io::Result<()> {
        let Some(cursor) = self.background else {
            return Ok(());
        };
        let pages = self.stack.pages();
        let end = (cursor + BACKGROUND_BATCH).min(pages);
        let mut pfn = cursor;
        while pfn < end {
            if self.is_populated(pfn) {
                pfn += 1;
                continue;
            }
            let mut n = 1;
            while pfn + n < end && !self.is_populated(pfn + n) {
                n += 1;
            }
            self.fill(pfn, n, Why::Background)?;
            pfn += n;
        }
        self.background = (end < pages).then_some(end);
        Ok(())
    }

    fn is_populated(&self, pfn: u64) -> bool {
        self.populated[(pfn / 64) as usize] & (1 << (pfn % 64)) != 0
    }

    fn mark(&mut self, first: u64, count: u64) {
        for pfn in first..first + count {
            let w = &mut self.populated[(pfn / 64) as usize];
            if *w & (1 << (pfn % 64)) == 0 {
                *w |= 1 << (pfn % 64);
                self.populated_count += 1;
            }
        }
        self.shared.populated.store(self.populated_count, Relaxed);
    }

    /// Fills pages `[first, first + count)`, one ioctl per run of pages
    /// that come from one place.
    fn fill(&mut self, first: u64, count: u64, why: Why) -> io::Result<()> {
        let end = first + count;
        let mut pfn = first;
        while pfn < end {
            let (src, n) = self.stack.run(pfn, end - pfn);
            self.fill_run(pfn, n, src, why)?;
            pfn += n;
        }
        Ok(())
    }

    fn fill_run(&mut self, first: u64, count: u64, src: PageSource, why: Why) -> io::Result<()> {
        let mut done = 0;
        let mut again = 0;
        while done < count {
            let pfn = first + done;
            let dst = self.base + (pfn * PAGE) as usize;
            let len = ((count - done) * PAGE) as usize;
            let outcome = match src {
                PageSource::Zero => self.uffd.zeropage(dst, len),
                PageSource::Layer(i) => self.uffd.copy(dst, self.stack.page_ptr(i, pfn), len),
            };
            let filled = match outcome {
                Fill::Done => count - done,
                Fill::Partial(bytes) => (bytes / PAGE).max(1).min(count - done),
                Fill::Exists => {
                    self.uffd.wake(dst, PAGE_SIZE)?;
                    self.shared.already_present.fetch_add(1, Relaxed);
                    self.mark(pfn, 1);
                    done += 1;
                    continue;
                }
                Fill::Again if again < AGAIN_TRIES => {
                    again += 1;
                    std::thread::yield_now();
                    continue;
                }
                Fill::Again => {
                    // Let the waiters fault again; they will come back.
                    self.uffd.wake(dst, len)?;
                    return Ok(());
                }
                Fill::Failed(e) => return Err(e),
            };
            self.mark(pfn, filled);
            let kind = match src {
                PageSource::Zero => &self.shared.zero_pages,
                PageSource::Layer(_) => &self.shared.copied_pages,
            };
            kind.fetch_add(filled, Relaxed);
            match why {
                Why::Prefetch => self.shared.prefetched.fetch_add(filled, Relaxed),
                Why::Background => self.shared.background.fetch_add(filled, Relaxed),
                Why::Fault => 0,
            };
            done += filled;
        }
        Ok(())
    }

    /// Ends serving. If every page is in, guest RAM stays usable and is
    /// unregistered (a page discarded later reads as zero, as anonymous memory
    /// does). Otherwise guest RAM is made inaccessible first, so that every
    /// waiting and later access fails (SIGSEGV from user space, EFAULT from
    /// the kernel and KVM) instead of waiting for a server that is gone.
    pub(super) fn close(&mut self) {
        self.finish_recording();
        if self.populated_count < self.stack.pages() {
            if let Err(e) = guest_ram::protect_none(self.base, self.len) {
                log::error!("Cannot protect unserved guest RAM: {e}");
            }
            self.shared.failed_closed.store(true, Relaxed);
        }
        if let Err(e) = self.uffd.unregister(self.base, self.len) {
            log::error!("Cannot unregister guest RAM from userfaultfd: {e}");
            let _ = self.uffd.wake(self.base, self.len);
        }
        self.shared.running.store(false, Relaxed);
    }
}

/// Runs [`Server::close`] however the server thread ends.
struct CloseOnExit(Server);

impl Drop for CloseOnExit {
    fn drop(&mut self) {
        self.0.close();
    }
}
