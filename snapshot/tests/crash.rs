//! A writer SIGKILLed at random points never leaves a directory at the final
//! name unless it is complete: whatever is there loads and verifies.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{fill, kernel, shape, Rng};
use snapshot::{
    write_diff_layer, write_full_layer, DirtyBitmap, Snapshot, SnapshotWriter, PAGE_SIZE,
};

const CHILD_ENV: &str = "SPROUT_SNAPSHOT_CRASH_CHILD";
const PAGES: u64 = 3072; // 12 MiB of RAM

fn state() -> Vec<u8> {
    (0..1u32 << 20).map(|i| (i % 251) as u8).collect()
}

/// What the child does: write a large snapshot (fsync on, as in production).
fn write_big(dir: &Path) {
    let mut ram = vec![0u8; PAGES as usize * PAGE_SIZE];
    for p in 0..PAGES {
        // Data in 64-page runs: few extents, so deleting the files is quick
        // even with `-o discard`.
        if (p / 64) % 4 != 0 {
            fill(&mut ram, p, 3);
        }
    }
    let mut w = SnapshotWriter::new(&dir.join("snap"), shape(ram.len()), kernel(dir)).unwrap();
    w.write_state(&state()).unwrap();
    write_full_layer(&mut w, "mem", &ram).unwrap();
    let mut dirty = DirtyBitmap::new(PAGES);
    for p in (0..PAGES).filter(|p| p % 128 < 32) {
        dirty.set(p);
    }
    write_diff_layer(&mut w, "mem2", &ram, &dirty).unwrap();
    let disk = w.add_disk_file("vda", "vda.layer").unwrap();
    std::fs::write(disk, vec![9u8; 2 << 20]).unwrap();
    w.commit().unwrap();
}

/// Runs only as the child process of the test below.
#[test]
fn crash_child() {
    if let Ok(dir) = std::env::var(CHILD_ENV) {
        write_big(Path::new(&dir));
    }
}

fn spawn_child(dir: &Path) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_child", "--test-threads=1", "-q"])
        .env(CHILD_ENV, dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

#[test]
fn sigkill_at_random_points_never_leaves_a_partial_snapshot() {
    // How long one full write takes, to spread the kills over it.
    let dir = tempfile::tempdir().unwrap();
    let t = Instant::now();
    assert!(spawn_child(dir.path()).wait().unwrap().success());
    let full = t.elapsed();
    let s = Snapshot::load(&dir.path().join("snap")).unwrap();
    assert_eq!(s.state(), state());
    eprintln!("one full write takes {full:?}");

    let mut rng = Rng::seeded();
    let (mut complete, mut absent) = (0, 0);
    for i in 0..20 {
        let dir = tempfile::tempdir().unwrap();
        let mut child = spawn_child(dir.path());
        // Over the whole write and a little past its end.
        let at = Duration::from_micros(rng.below(full.as_micros() as u64 * 13 / 10 + 1));
        std::thread::sleep(at);
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let fin = dir.path().join("snap");
        if fin.exists() {
            let s = Snapshot::load(&fin)
                .unwrap_or_else(|e| panic!("kill {i} at {at:?} left a broken snapshot: {e}"));
            assert_eq!(s.state(), state());
            complete += 1;
        } else {
            absent += 1;
        }
    }
    eprintln!("20 kills: {complete} complete snapshots, {absent} with no snapshot");
    assert!(absent > 0, "no kill landed before the commit");
}
