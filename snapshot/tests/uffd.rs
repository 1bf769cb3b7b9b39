//! The userfaultfd backend with real faults from real threads.

mod common;

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use common::{layered, page, Rng};
use snapshot::uffd::WorkingSetError;
use snapshot::{LayerStack, Snapshot, UffdOptions, UffdRestore, WorkingSet, PAGE_SIZE};

fn restore(top: &std::path::Path, opts: UffdOptions) -> UffdRestore {
    let stack = Arc::new(LayerStack::open(&Snapshot::load_chain(top).unwrap()).unwrap());
    let len = stack.mem_bytes();
    UffdRestore::start(stack, len, opts).unwrap()
}

/// Reads a page of guest RAM directly (a user-mode access).
fn read_page(base: usize, pfn: u64) -> &'static [u8] {
    // SAFETY: every test keeps its restore alive while its threads read.
    unsafe { std::slice::from_raw_parts((base + pfn as usize * PAGE_SIZE) as *const u8, PAGE_SIZE) }
}

/// A pipe, to make the kernel read guest RAM (a kernel-mode access, as KVM's).
struct Pipe(OwnedFd, OwnedFd);

impl Pipe {
    fn new() -> Pipe {
        let mut fds = [0; 2];
        // SAFETY: pipe2 fills two new descriptors into the array.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: both descriptors are fresh and owned by nothing else.
        unsafe { Pipe(OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    }

    /// Copies page `pfn` through the kernel into `out`.
    fn read_page(&self, base: usize, pfn: u64, out: &mut [u8]) -> io::Result<()> {
        let src = base + pfn as usize * PAGE_SIZE;
        // SAFETY: write(2) only reads `PAGE_SIZE` bytes at `src` (in the
        // restore's mapping); a bad address yields EFAULT, not UB.
        let n = unsafe { libc::write(self.1.as_raw_fd(), src as *const _, PAGE_SIZE) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        assert_eq!(n as usize, PAGE_SIZE);
        // SAFETY: read(2) writes at most `out.len()` bytes into `out`.
        let n = unsafe { libc::read(self.0.as_raw_fd(), out.as_mut_ptr().cast(), out.len()) };
        assert_eq!(n as usize, PAGE_SIZE);
        Ok(())
    }
}

/// Waits (bounded) for the server's counters to catch up: a fill wakes the
/// faulting thread before the server counts it.
fn settle(r: &UffdRestore, populated: u64) -> snapshot::UffdStats {
    let t = Instant::now();
    loop {
        let st = r.stats();
        if st.populated >= populated || t.elapsed() > Duration::from_secs(5) {
            return st;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn random_touches_see_the_right_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::seeded();
    let (top, ram) = layered(dir.path(), 4096, &mut rng);
    let r = restore(&top, UffdOptions::default());
    let base = r.as_ptr() as usize;
    let pfns: Vec<u64> = (0..3000).map(|_| rng.below(4096)).collect();
    let ram = Arc::new(ram);
    let ram2 = ram.clone();
    let touched = pfns.clone();
    std::thread::spawn(move || {
        let pipe = Pipe::new();
        let mut buf = vec![0u8; PAGE_SIZE];
        for (i, &pfn) in touched.iter().enumerate() {
            if i % 2 == 0 {
                assert!(read_page(base, pfn) == page(&ram2, pfn), "page {pfn}");
            } else {
                pipe.read_page(base, pfn, &mut buf).unwrap();
                assert!(buf == page(&ram2, pfn), "page {pfn} via the kernel");
            }
        }
    })
    .join()
    .unwrap();
    let mut distinct = pfns.clone();
    distinct.sort_unstable();
    distinct.dedup();
    let st = settle(&r, distinct.len() as u64);
    assert_eq!(st.populated, distinct.len() as u64, "{st:?}");
    assert!(st.faults >= distinct.len() as u64, "{st:?}");
}

#[test]
fn many_concurrent_faulting_threads() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::seeded();
    let (top, ram) = layered(dir.path(), 2048, &mut rng);
    let r = restore(&top, UffdOptions::default());
    let base = r.as_ptr() as usize;
    let ram = Arc::new(ram);
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let ram = ram.clone();
            let mut order: Vec<u64> = (0..1024).collect();
            let mut rng = Rng(rng.next() | 1);
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
            std::thread::spawn(move || {
                for pfn in order {
                    let pfn = pfn * 2 + t % 2; // even threads even pages, odd odd
                    assert!(read_page(base, pfn) == page(&ram, pfn), "page {pfn}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let st = settle(&r, 2048);
    assert_eq!(st.populated, 2048, "{st:?}");
    eprintln!("{st:?}");
}

#[test]
fn the_recorded_working_set_is_prefetched_without_faults() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::seeded();
    let (top, ram) = layered(dir.path(), 4096, &mut rng);
    let ws_pfns: Vec<u64> = (0..600).map(|_| rng.below(4096)).collect();
    let expected = WorkingSet::from_pfns(4096, ws_pfns.iter().copied());

    // First restore: record what the "guest" touches in its first moments.
    let first = restore(
        &top,
        UffdOptions {
            record_working_set_for: Some(Duration::from_millis(300)),
            ..Default::default()
        },
    );
    let base = first.as_ptr() as usize;
    let touched = ws_pfns.clone();
    std::thread::spawn(move || {
        for pfn in touched {
            std::hint::black_box(read_page(base, pfn)[100]);
        }
    })
    .join()
    .unwrap();
    let t = Instant::now();
    let ws = loop {
        if let Some(ws) = first.working_set() {
            break ws;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "no working set");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(ws, expected);
    let top_snap = Snapshot::load(&top).unwrap();
    assert!(WorkingSet::load(&top_snap).unwrap().is_none());
    ws.save(&top_snap).unwrap();
    drop(first);

    // Later restore: prefetch it; touching it faults not once.
    let ws = WorkingSet::load(&top_snap).unwrap().unwrap();
    assert_eq!(ws, expected);
    let second = restore(
        &top,
        UffdOptions {
            prefetch: Some(ws),
            ..Default::default()
        },
    );
    let st = second.stats();
    assert_eq!(st.pages_prefetched, expected.len(), "{st:?}");
    eprintln!(
        "prefetched {} pages in {:?}",
        expected.len(),
        st.prefetch_time
    );
    let base = second.as_ptr() as usize;
    let ram = Arc::new(ram);
    let ram2 = ram.clone();
    let pfns: Vec<u64> = expected.pfns().collect();
    std::thread::spawn(move || {
        for pfn in pfns {
            assert!(read_page(base, pfn) == page(&ram2, pfn), "page {pfn}");
        }
    })
    .join()
    .unwrap();
    assert_eq!(second.stats().faults, 0);
    // A page outside the set still faults, and is right.
    let outside = (0..4096).find(|&p| !expected.contains(p)).unwrap();
    assert!(read_page(base, outside) == page(&ram, outside));
    assert_eq!(second.stats().faults, 1);
}

#[test]
fn a_working_set_file_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::seeded();
    let (top, _) = layered(dir.path(), 1024, &mut rng);
    let top = Snapshot::load(&top).unwrap();
    let base = Snapshot::load(&dir.path().join("base")).unwrap();
    let ws = WorkingSet::from_pfns(1024, [1, 2, 3, 500]);
    ws.save(&top).unwrap();
    assert_eq!(WorkingSet::load(&top).unwrap(), Some(ws.clone()));
    // Another snapshot's set is refused.
    std::fs::copy(
        top.dir().join("working-set.bin"),
        base.dir().join("working-set.bin"),
    )
    .unwrap();
    assert!(matches!(
        WorkingSet::load(&base),
        Err(WorkingSetError::OtherSnapshot { .. })
    ));
    // A flipped byte is refused.
    let p = top.dir().join("working-set.bin");
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[50] ^= 4;
    std::fs::write(&p, &bytes).unwrap();
    let e = WorkingSet::load(&top).unwrap_err().to_string();
    assert!(e.contains("working-set.bin"), "{e}");
    // The wrong size for the RAM is refused before anything is prefetched.
    let stack = Arc::new(LayerStack::open(&Snapshot::load_chain(top.dir()).unwrap()).unwrap());
    let opts = UffdOptions {
        prefetch: Some(WorkingSet::from_pfns(10, [1])),
        ..Default::default()
    };
    assert!(UffdRestore::start(stack, 1024 * PAGE_SIZE as u64, opts).is_err());
}

#[test]
fn stopping_mid_way_fails_accesses_instead_of_hanging() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::seeded();
    let (top, ram) = layered(dir.path(), 4096, &mut rng);
    let r = restore(&top, UffdOptions::default());
    let base = r.as_ptr() as usize;
    let (progress_tx, progress) = mpsc::channel();
    let (done_tx, done) = mpsc::channel();
    std::thread::spawn(move || {
        let pipe = Pipe::new();
        let mut buf = vec![0u8; PAGE_SIZE];
        for pfn in 0..4096 {
            if let Err(e) = pipe.read_page(base, pfn, &mut buf) {
                done_tx.send((pfn, Some(e))).unwrap();
                return;
            }
            assert!(buf == page(&ram, pfn), "page {pfn}");
            let _ = progress_tx.send(pfn);
            std::thread::sleep(Duration::from_micros(200));
        }
        done_tx.send((4096, None)).unwrap();
    });
    // Let it get going, then pull the server away.
    while progress.recv_timeout(Duration::from_secs(10)).unwrap() < 100 {}
    let t = Instant::now();
    r.stop();
    let stopped = t.elapsed();
    let (at, err) = done
        .recv_timeout(Duration::from_secs(10))
        .expect("the toucher hung after stop");
    let err = err.expect("the toucher never saw an error");
    assert_eq!(err.raw_os_error(), Some(libc::EFAULT), "{err}");
    let st = r.stats();
    assert!(st.failed_closed && !st.running, "{st:?}");
    eprintln!("stop took {stopped:?}; the toucher got {err} at page {at}");
    assert!(stopped < Duration::from_secs(1));
}

const CHILD_ENV: &str = "SPROUT_SNAPSHOT_UFFD_CHILD";

/// Run only as the child of the test below: touch guest RAM directly after
/// the server stopped. Expected to die by SIGSEGV.
#[test]
fn direct_access_child() {
    let Ok(top) = std::env::var(CHILD_ENV) else {
        return;
    };
    let r = restore(std::path::Path::new(&top), UffdOptions::default());
    r.stop();
    let b = read_page(r.as_ptr() as usize, 7)[0];
    println!("read {b} after stop: not expected");
}

#[test]
fn a_direct_access_after_stop_dies_by_sigsegv() {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::seeded();
    let (top, _) = layered(dir.path(), 256, &mut rng);
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "direct_access_child", "--test-threads=1", "-q"])
        .env(CHILD_ENV, &top)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(20) {
            child.kill().unwrap();
            panic!("the child hung on a page after stop");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(status.signal(), Some(libc::SIGSEGV), "{status:?}");
}

#[test]
fn background_population_fills_everything_and_keeps_ram_after_stop() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::seeded();
    let (top, ram) = layered(dir.path(), 4096, &mut rng);
    let r = restore(
        &top,
        UffdOptions {
            populate_in_background: true,
            ..Default::default()
        },
    );
    let t = Instant::now();
    while r.stats().populated < 4096 {
        assert!(t.elapsed() < Duration::from_secs(20), "{:?}", r.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    eprintln!(
        "background fill of 16 MiB took {:?}: {:?}",
        t.elapsed(),
        r.stats()
    );
    r.stop();
    let st = r.stats();
    assert!(!st.failed_closed, "{st:?}");
    assert_eq!(
        st.pages_background + st.pages_prefetched + st.faults,
        st.populated
    );
    let base = r.as_ptr() as usize;
    for pfn in 0..4096 {
        assert!(read_page(base, pfn) == page(&ram, pfn), "page {pfn}");
    }
}
