//! Shared helpers for the snapshot integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use snapshot::{
    write_diff_layer, write_full_layer, DirtyBitmap, KernelIdentity, Shape, Snapshot,
    SnapshotWriter, PAGE_SIZE,
};

/// A small deterministic PRNG (xorshift64*).
pub struct Rng(pub u64);

impl Rng {
    pub fn seeded() -> Rng {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        let seed = t ^ u64::from(std::process::id()).rotate_left(32);
        eprintln!("rng seed {seed:#x}");
        Rng(seed | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

pub fn kernel(dir: &Path) -> KernelIdentity {
    let p = dir.join("vmlinux");
    if !p.exists() {
        std::fs::write(&p, vec![0x7fu8; 100_000]).unwrap();
    }
    KernelIdentity::of_file(&p).unwrap()
}

pub fn shape(mem: usize) -> Shape {
    Shape {
        vcpus: 1,
        mem_bytes: mem as u64,
    }
}

pub fn page(ram: &[u8], pfn: u64) -> &[u8] {
    &ram[pfn as usize * PAGE_SIZE..][..PAGE_SIZE]
}

/// Fills page `pfn` with a pattern from `seed` (never all zero).
pub fn fill(ram: &mut [u8], pfn: u64, seed: u64) {
    let p = &mut ram[pfn as usize * PAGE_SIZE..][..PAGE_SIZE];
    for (i, chunk) in p.chunks_mut(8).enumerate() {
        let v = (seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ pfn.rotate_left(17) ^ i as u64) | 1;
        chunk.copy_from_slice(&v.to_le_bytes());
    }
}

pub fn zero(ram: &mut [u8], pfn: u64) {
    ram[pfn as usize * PAGE_SIZE..][..PAGE_SIZE].fill(0);
}

pub fn write_full(dir: &Path, name: &str, ram: &Vec<u8>, state: &[u8]) -> Snapshot {
    let mut w = SnapshotWriter::new(&dir.join(name), shape(ram.len()), kernel(dir)).unwrap();
    w.set_fsync(false); // durability is not under test here
    w.write_state(state).unwrap();
    write_full_layer(&mut w, "mem", ram).unwrap();
    w.commit().unwrap()
}

pub fn write_diff(
    dir: &Path,
    name: &str,
    parent: &Snapshot,
    ram: &Vec<u8>,
    dirty: &DirtyBitmap,
) -> Snapshot {
    let mut w = SnapshotWriter::new(&dir.join(name), shape(ram.len()), kernel(dir)).unwrap();
    w.set_fsync(false);
    w.set_parent(parent).unwrap();
    w.write_state(b"diff state").unwrap();
    write_diff_layer(&mut w, "mem", ram, dirty).unwrap();
    w.commit().unwrap()
}

/// A base with a third of its pages filled, then a diff that changes some,
/// zeroes some (including pages the base had data in) and fills new ones;
/// then a second diff on top. Returns the top snapshot's dir and the final
/// RAM image.
pub fn layered(dir: &Path, pages: u64, rng: &mut Rng) -> (PathBuf, Vec<u8>) {
    let mut ram = vec![0u8; pages as usize * PAGE_SIZE];
    for p in 0..pages {
        if rng.below(3) == 0 {
            fill(&mut ram, p, 1);
        }
    }
    let base = write_full(dir, "base", &ram, b"base state");
    let mut prev = base;
    for gen in 2..4u64 {
        let mut dirty = DirtyBitmap::new(pages);
        for _ in 0..pages / 8 {
            let p = rng.below(pages);
            match rng.below(4) {
                0 => zero(&mut ram, p),
                _ => fill(&mut ram, p, gen * 1000 + rng.below(1000)),
            }
            dirty.set(p);
        }
        // A contiguous run too, so overlays coalesce.
        let start = rng.below(pages - 64);
        for p in start..start + 64 {
            fill(&mut ram, p, gen);
            dirty.set(p);
        }
        prev = write_diff(dir, &format!("diff{gen}"), &prev, &ram, &dirty);
    }
    (prev.dir().to_path_buf(), ram)
}
