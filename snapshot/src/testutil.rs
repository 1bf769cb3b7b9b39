//! Helpers for the unit tests: RAM images and snapshots of them.

use std::path::Path;

use crate::format::{KernelIdentity, Shape, Snapshot, SnapshotWriter};
use crate::layers::{write_diff_layer, write_full_layer, DirtyBitmap};
use crate::PAGE_SIZE;

pub(crate) fn kernel(dir: &Path) -> KernelIdentity {
    let p = dir.join("vmlinux");
    if !p.exists() {
        std::fs::write(&p, b"not really a kernel").unwrap();
    }
    KernelIdentity::of_file(&p).unwrap()
}

pub(crate) fn shape(mem: usize) -> Shape {
    Shape {
        vcpus: 1,
        mem_bytes: mem as u64,
    }
}

/// Fills page `pfn` with a pattern derived from `seed` (never all zero).
pub(crate) fn fill(ram: &mut [u8], pfn: u64, seed: u8) {
    let page = &mut ram[pfn as usize * PAGE_SIZE..][..PAGE_SIZE];
    for (i, b) in page.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31) ^ seed ^ (pfn as u8);
    }
    page[0] = seed | 1;
}

pub(crate) fn zero(ram: &mut [u8], pfn: u64) {
    ram[pfn as usize * PAGE_SIZE..][..PAGE_SIZE].fill(0);
}

pub(crate) fn full(dir: &Path, name: &str, ram: &Vec<u8>) -> Snapshot {
    let mut w = SnapshotWriter::new(&dir.join(name), shape(ram.len()), kernel(dir)).unwrap();
    w.set_fsync(false); // durability is not under test here
    w.write_state(b"state of the full snapshot").unwrap();
    write_full_layer(&mut w, "mem", ram).unwrap();
    w.commit().unwrap()
}

pub(crate) fn diff(
    dir: &Path,
    name: &str,
    parent: &Snapshot,
    ram: &Vec<u8>,
    dirty: &DirtyBitmap,
) -> Snapshot {
    let mut w = SnapshotWriter::new(&dir.join(name), shape(ram.len()), kernel(dir)).unwrap();
    w.set_fsync(false);
    w.set_parent(parent).unwrap();
    w.write_state(b"state of the diff snapshot").unwrap();
    write_diff_layer(&mut w, "mem", ram, dirty).unwrap();
    w.commit().unwrap()
}
