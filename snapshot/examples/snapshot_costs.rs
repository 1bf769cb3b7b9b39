//! Measures the snapshot crate's own costs on a 512 MiB RAM image with
//! 16 MiB of data: writing, loading (verify), layer stack open, and both
//! restore backends. Run with:
//!
//! ```text
//! cargo run --release -p snapshot --example snapshot_costs [-- RUNS]
//! ```

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use snapshot::mmap::{map_private, map_private_with, MapOptions};
use snapshot::{
    write_diff_layer, write_full_layer, DirtyBitmap, KernelIdentity, LayerStack, Shape, Snapshot,
    SnapshotWriter, UffdOptions, UffdRestore, WorkingSet, PAGE_SIZE,
};

const MEM: usize = 512 << 20;
const PAGES: u64 = (MEM / PAGE_SIZE) as u64;
const DATA_PAGES: u64 = 4096; // 16 MiB

fn fill(ram: &mut [u8], pfn: u64, seed: u64) {
    let p = &mut ram[pfn as usize * PAGE_SIZE..][..PAGE_SIZE];
    for (i, c) in p.chunks_mut(8).enumerate() {
        c.copy_from_slice(&((seed ^ pfn << 20 ^ i as u64) | 1).to_le_bytes());
    }
}

/// `DATA_PAGES` pages: clustered in 64-page runs, or scattered one by one.
fn data_pfns(scattered: bool) -> Vec<u64> {
    if scattered {
        (0..DATA_PAGES)
            .map(|i| i * (PAGES / DATA_PAGES) + 7)
            .collect()
    } else {
        (0..DATA_PAGES)
            .map(|i| (i / 64) * (PAGES / (DATA_PAGES / 64)) + i % 64)
            .collect()
    }
}

fn stats(name: &str, mut v: Vec<Duration>) {
    v.sort();
    let p = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    println!(
        "{name:<58} p50 {:>9.3} ms  p99 {:>9.3} ms  (n={})",
        p(0.5).as_secs_f64() * 1e3,
        p(0.99).as_secs_f64() * 1e3,
        v.len()
    );
}

fn time<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let r = f();
    (r, t.elapsed())
}

fn writer(dir: &Path, name: &str, kernel: &KernelIdentity, fsync: bool) -> SnapshotWriter {
    let shape = Shape {
        vcpus: 1,
        mem_bytes: MEM as u64,
    };
    let mut w = SnapshotWriter::new(&dir.join(name), shape, kernel.clone()).unwrap();
    w.set_fsync(fsync);
    w.write_state(&[1u8; 64 << 10]).unwrap();
    w
}

/// Flushes dirty pages, so earlier writes do not throttle the next measurement.
fn sync() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
}

fn main() {
    let runs: usize = std::env::args().nth(1).map_or(30, |a| a.parse().unwrap());
    let root = tempfile::Builder::new()
        .prefix("snapshot-costs")
        .tempdir_in(std::env::temp_dir())
        .unwrap();
    let dir = root.path();
    std::fs::write(dir.join("vmlinux"), vec![0x90u8; 30 << 20]).unwrap();
    let (kernel, t) = time(|| KernelIdentity::of_file(&dir.join("vmlinux")).unwrap());
    println!(
        "kernel identity of a 30 MiB kernel: {:.3} ms (then cached)",
        t.as_secs_f64() * 1e3
    );

    for scattered in [false, true] {
        let label = if scattered { "scattered" } else { "clustered" };
        println!("\n== 512 MiB RAM, 16 MiB of data {label} ==");
        let mut ram = vec![0u8; MEM];
        let pfns = data_pfns(scattered);
        for &p in &pfns {
            fill(&mut ram, p, 1);
        }
        let mut full_times = Vec::new();
        for i in 0..runs.min(10) {
            let mut w = writer(dir, &format!("{label}-full{i}"), &kernel, false);
            let (_, t) = time(|| {
                write_full_layer(&mut w, "mem", &ram).unwrap();
                w.commit().unwrap()
            });
            full_times.push(t);
        }
        stats("full snapshot, no fsync (scans all 512 MiB)", full_times);
        let base_dir = dir.join(format!("{label}-full0"));
        let base = Snapshot::load(&base_dir).unwrap();

        // Diff snapshots with 16 MiB dirty.
        let mut dirty = DirtyBitmap::new(PAGES);
        for (k, &p) in pfns.iter().enumerate() {
            fill(&mut ram, p, 2 + k as u64);
            dirty.set(p);
        }
        for fsync in [false, true] {
            sync();
            let mut v = Vec::new();
            for i in 0..if fsync { runs.min(5) } else { runs } {
                let mut w = writer(dir, &format!("{label}-diff{fsync}{i}"), &kernel, fsync);
                w.set_parent(&base).unwrap();
                let (_, t) = time(|| {
                    write_diff_layer(&mut w, "mem", &ram, &dirty).unwrap();
                    w.commit().unwrap()
                });
                v.push(t);
            }
            stats(&format!("diff snapshot, 16 MiB dirty, fsync={fsync}"), v);
        }
        let top = dir.join(format!("{label}-difffalse0"));
        sync();

        let v: Vec<_> = (0..runs)
            .map(|_| time(|| Snapshot::load(&base_dir).unwrap()).1)
            .collect();
        stats("Snapshot::load (verify) of the full snapshot, warm", v);
        let v: Vec<_> = (0..runs)
            .map(|_| time(|| Snapshot::load(&top).unwrap()).1)
            .collect();
        stats("Snapshot::load (verify) of the diff snapshot, warm", v);
        let v: Vec<_> = (0..runs)
            .map(|_| time(|| Snapshot::load_chain(&top).unwrap()).1)
            .collect();
        stats("Snapshot::load_chain (full + diff), warm", v);
        let chain = Snapshot::load_chain(&top).unwrap();
        let v: Vec<_> = (0..runs)
            .map(|_| time(|| LayerStack::open(&chain).unwrap()).1)
            .collect();
        stats("LayerStack::open (full + diff)", v);
        let stack = Arc::new(LayerStack::open(&chain).unwrap());

        let mut v = Vec::new();
        let mut touch = Vec::new();
        let mut last = None;
        for _ in 0..runs {
            let (m, t) = time(|| map_private(&stack, MEM as u64).unwrap());
            v.push(t);
            let (_, t) = time(|| {
                for &p in &pfns {
                    // SAFETY: the mapping is live and only this loop reads it.
                    unsafe { std::ptr::read_volatile(m.as_ptr().add(p as usize * PAGE_SIZE)) };
                }
            });
            touch.push(t);
            last = Some(m.stats());
        }
        stats("mmap: map_private (full + diff)", v);
        let opts = MapOptions {
            copy_runs_below: 2,
            ..Default::default()
        };
        let v: Vec<_> = (0..runs)
            .map(|_| time(|| map_private_with(&stack, MEM as u64, opts).unwrap()).1)
            .collect();
        stats("mmap: map_private copying 1-page runs", v);
        stats("mmap: then read the 16 MiB of data pages (faults)", touch);
        println!("   mmap stats: {:?}", last.unwrap());

        let ws = WorkingSet::from_pfns(PAGES, pfns.iter().copied());
        for prefetch in [false, true] {
            let mut start = Vec::new();
            let mut touch = Vec::new();
            let mut pre = Vec::new();
            for _ in 0..runs {
                let opts = UffdOptions {
                    prefetch: prefetch.then(|| ws.clone()),
                    ..Default::default()
                };
                let (r, t) = time(|| UffdRestore::start(stack.clone(), MEM as u64, opts).unwrap());
                start.push(t);
                pre.push(r.stats().prefetch_time);
                let (_, t) = time(|| {
                    for &p in &pfns {
                        // SAFETY: the restore is live and only this loop reads it.
                        unsafe { std::ptr::read_volatile(r.as_ptr().add(p as usize * PAGE_SIZE)) };
                    }
                });
                touch.push(t);
                if prefetch {
                    assert_eq!(r.stats().faults, 0);
                }
            }
            stats(&format!("uffd: start, prefetch={prefetch}"), start);
            if prefetch {
                stats("uffd:   of which prefetching 16 MiB (4096 pages)", pre);
            }
            stats(
                &format!("uffd: then read the 16 MiB of data pages, prefetch={prefetch}"),
                touch,
            );
        }
    }
}
