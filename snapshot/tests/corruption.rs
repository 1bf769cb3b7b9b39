//! Every kind of damage to every file of a snapshot is refused, quickly, with
//! an error that names the file.

mod common;

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{fill, kernel, shape, write_full};
use snapshot::{write_diff_layer, DirtyBitmap, Snapshot, SnapshotWriter, PAGE_SIZE};

const PAGES: u64 = 2048;
const DISK_BYTES: u64 = 64 << 20;
/// Pages with data in the diff layer (the others of the diff are zero).
const DATA_PFN: u64 = 10;
const HOLE_PFN: u64 = 1500;

/// A diff snapshot `victim` (on a full `base`) with a disk layer and an
/// extra file.
fn victim(dir: &Path) -> PathBuf {
    let mut ram = vec![0u8; PAGES as usize * PAGE_SIZE];
    for p in (0..PAGES).step_by(4) {
        fill(&mut ram, p, 1);
    }
    let base = write_full(dir, "base", &ram, b"base");
    let mut dirty = DirtyBitmap::new(PAGES);
    for p in (DATA_PFN..DATA_PFN + 200).step_by(2) {
        fill(&mut ram, p, 2);
        dirty.set(p);
    }
    dirty.set(4 * 100); // back to zero
    ram[400 * PAGE_SIZE..401 * PAGE_SIZE].fill(0);
    let mut w = SnapshotWriter::new(&dir.join("victim"), shape(ram.len()), kernel(dir)).unwrap();
    w.set_fsync(false);
    w.set_parent(&base).unwrap();
    w.write_state(&vec![0x5au8; 10_000]).unwrap();
    write_diff_layer(&mut w, "mem", &ram, &dirty).unwrap();
    let disk = File::create(w.add_disk_file("vda", "vda.layer").unwrap()).unwrap();
    disk.set_len(DISK_BYTES).unwrap();
    disk.write_all_at(&[7u8; 8192], 1 << 20).unwrap();
    fs::write(w.add_file("notes").unwrap(), b"some notes for the devices").unwrap();
    w.commit().unwrap().dir().to_path_buf()
}

/// Applies `damage` to a fresh victim's `file` and checks the load error.
fn refused(file: &str, want: &str, damage: impl FnOnce(&Path)) {
    let dir = tempfile::tempdir().unwrap();
    let v = victim(dir.path());
    let path = v.join(file);
    damage(&path);
    let t = Instant::now();
    let err = Snapshot::load_chain(&v).expect_err("damaged snapshot loaded");
    let took = t.elapsed();
    let msg = err.to_string();
    assert!(
        msg.contains(file),
        "{file}: message does not name it: {msg}"
    );
    assert!(msg.contains(want), "{file}: expected {want:?} in: {msg}");
    assert!(took < Duration::from_secs(1), "{file}: took {took:?}");
}

fn truncate(to: impl Fn(u64) -> u64) -> impl FnOnce(&Path) {
    move |p: &Path| {
        let f = OpenOptions::new().write(true).open(p).unwrap();
        let len = f.metadata().unwrap().len();
        f.set_len(to(len)).unwrap();
    }
}

fn flip(at: impl Fn(u64) -> u64) -> impl FnOnce(&Path) {
    move |p: &Path| {
        let f = OpenOptions::new().read(true).write(true).open(p).unwrap();
        let at = at(f.metadata().unwrap().len());
        let mut b = [0u8];
        f.read_exact_at(&mut b, at).unwrap();
        f.write_all_at(&[b[0] ^ 0x10], at).unwrap();
    }
}

const FILES: [&str; 6] = [
    "manifest.json",
    "state.bin",
    "mem",
    "mem.map",
    "vda.layer",
    "notes",
];

#[test]
fn the_victim_is_whole() {
    let dir = tempfile::tempdir().unwrap();
    let v = victim(dir.path());
    assert_eq!(Snapshot::load_chain(&v).unwrap().len(), 2);
    let mut listed: Vec<String> = fs::read_dir(&v)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    listed.sort();
    let mut want = FILES.to_vec();
    want.sort();
    assert_eq!(listed, want);
}

#[test]
fn truncated_files_are_refused() {
    for file in FILES {
        // The manifest is checked as a whole: a cut one fails to parse or
        // to match its checksum.
        let want = |w: &'static str| if file == "manifest.json" { "" } else { w };
        refused(file, want("truncated"), truncate(|_| 0));
        refused(file, want("truncated"), truncate(|n| n / 2));
        refused(file, want("truncated"), truncate(|n| n - 1));
    }
}

#[test]
fn flipped_bytes_are_refused() {
    refused("state.bin", "Checksum mismatch", flip(|n| n / 2));
    refused(
        "mem",
        "Checksum mismatch",
        flip(|_| DATA_PFN * PAGE_SIZE as u64 + 77),
    );
    refused(
        "mem",
        "Checksum mismatch",
        flip(|_| HOLE_PFN * PAGE_SIZE as u64 + 5),
    );
    refused("mem.map", "Checksum mismatch", flip(|n| n - 3));
    refused("vda.layer", "Checksum mismatch", flip(|_| (1 << 20) + 100));
    refused("vda.layer", "Checksum mismatch", flip(|_| 40 << 20));
    refused("notes", "Checksum mismatch", flip(|_| 0));
    for at in [0u64, 1, 100, 300, 1000] {
        refused("manifest.json", "", flip(move |n| at.min(n - 1)));
    }
    refused("manifest.json", "", flip(|n| n - 1));
    refused("manifest.json", "", flip(|n| n - 6));
}

#[test]
fn grown_and_missing_files_are_refused() {
    for file in FILES {
        if file != "manifest.json" {
            refused(file, "too long", truncate(|n| n + 1));
        }
        refused(file, "missing", |p| fs::remove_file(p).unwrap());
    }
}

#[test]
fn another_format_version_is_named() {
    refused("manifest.json", "version 2", |p| {
        let s = fs::read_to_string(p).unwrap();
        assert!(s.contains("\"formatVersion\": 1,"));
        fs::write(
            p,
            s.replace("\"formatVersion\": 1,", "\"formatVersion\": 2,"),
        )
        .unwrap();
    });
    refused("manifest.json", "supported: 1", |p| {
        let s = fs::read_to_string(p).unwrap();
        fs::write(
            p,
            s.replace("\"formatVersion\": 1,", "\"formatVersion\": 77,"),
        )
        .unwrap();
    });
}

#[test]
fn a_damaged_parent_is_refused_too() {
    let dir = tempfile::tempdir().unwrap();
    let v = victim(dir.path());
    flip(|_| 4 * PAGE_SIZE as u64 + 9)(&dir.path().join("base/mem"));
    let err = Snapshot::load_chain(&v).unwrap_err().to_string();
    assert!(
        err.contains("base/mem") && err.contains("Checksum"),
        "{err}"
    );
    fs::remove_dir_all(dir.path().join("base")).unwrap();
    let err = Snapshot::load_chain(&v).unwrap_err().to_string();
    assert!(err.contains("missing"), "{err}");
}
