//! Snapshot, restore, pause and resume on the test guest: 1 vCPU, 512 MiB.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use guest_abi::layout::{MIB, TESTGUEST_SCRATCH};
use guest_abi::mailbox as mb;
use vmm::{ConsoleBuffer, MemoryBackend, RestoreOptions, SerialOutput, SnapshotKind, Vm, VmConfig};

use super::row;

const T: Duration = Duration::from_secs(30);

pub fn boot() -> anyhow::Result<Vm> {
    let mut c = VmConfig::new(testguest_build::TESTGUEST_PATH);
    c.mem_mib = 512;
    c.serial = SerialOutput::Buffer(ConsoleBuffer::new(4096));
    let vm = Vm::start(c)?;
    vm.mailbox().expect("mailbox").wait_ready(0, T)?;
    // A guest that has been running: 8 MiB of its RAM written.
    echo(&vm, mb::CMD_FILL, [TESTGUEST_SCRATCH, 2048, 1, 0])?;
    Ok(vm)
}

pub fn echo(vm: &Vm, cmd: u32, args: [u64; 4]) -> anyhow::Result<()> {
    let r = vm.mailbox().expect("mailbox").call(0, cmd, args, T)?;
    anyhow::ensure!(r.is_ok(), "command {cmd} failed: {r:?}");
    Ok(())
}

fn drop_caches() {
    // Needs root; without it the "dropped" rows are warm and say so.
    if std::fs::write("/proc/sys/vm/drop_caches", "3").is_err() {
        eprintln!("cannot drop the page cache (not root?)");
    }
}

pub struct Dir(pub PathBuf);
impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The scratch directory of a run (snapshots, fork layers, sockets) under
/// `$TMPDIR` or /tmp. Its filesystem matters: fork layers are files, and
/// creating them on ext4 costs several times what it does on tmpfs
/// (docs/benchmarks.md), so the run says which it is on.
pub fn scratch() -> anyhow::Result<Dir> {
    let d = std::env::temp_dir().join(format!("sprout-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d)?;
    eprintln!(
        "report: scratch directory {} on {} (set TMPDIR for another)",
        d.display(),
        fs_type(&d)
    );
    Ok(Dir(d))
}

/// The type of the filesystem `path` is on, from /proc/mounts (the longest
/// mount point above it), or "an unknown filesystem". An ext4 without a
/// journal says so: it will not reuse an inode freed in the last minutes,
/// so creating files there slows as fork layers come and go
/// (docs/benchmarks.md).
fn fs_type(path: &Path) -> String {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    let Some((_, ty, dev)) = mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (dev, at, ty) = (f.next()?, f.next()?, f.next()?);
            path.starts_with(at)
                .then(|| (at.len(), ty.to_string(), dev.to_string()))
        })
        .max()
    else {
        return "an unknown filesystem".into();
    };
    if ty == "ext4" && ext4_journal(&dev) == Some(false) {
        return "ext4 without a journal (slow to create files after deleting \
                many: docs/benchmarks.md)"
            .into();
    }
    ty
}

/// Whether the ext4 on block device `dev` (`/dev/vda`) has a journal: jbd2
/// lists each journal it runs in /proc/fs/jbd2 as `<device>-<inode>`. None
/// when that cannot be read.
fn ext4_journal(dev: &str) -> Option<bool> {
    let name = Path::new(dev).file_name()?.to_str()?;
    let prefix = format!("{name}-");
    let entries = std::fs::read_dir("/proc/fs/jbd2").ok()?;
    Some(
        entries
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with(&prefix)),
    )
}

fn restore_opts(backend: MemoryBackend, prefetch: bool, dir: &Path) -> RestoreOptions {
    let mut o = RestoreOptions::new(backend);
    o.prefetch = prefetch;
    o.record_working_set_for = None;
    o.scratch_dir = dir.to_path_buf();
    o
}

pub fn run(runs: usize) -> anyhow::Result<()> {
    let dir = scratch()?;
    let mut vm = boot()?;

    let (mut pause, mut resume) = (Vec::new(), Vec::new());
    for _ in 0..runs * 10 {
        let t = Instant::now();
        vm.pause()?;
        pause.push(t.elapsed());
        let t = Instant::now();
        vm.resume()?;
        resume.push(t.elapsed());
    }
    row("pause (1 vCPU, running guest idle in HLT)", pause);
    row("resume", resume);

    let (mut full, mut diff, mut window) = (Vec::new(), Vec::new(), Vec::new());
    let mut full_window = Vec::new();
    for i in 0..runs {
        let p = dir.0.join(format!("full{i}"));
        let t = Instant::now();
        vm.snapshot(&p, SnapshotKind::Full)?;
        full.push(t.elapsed());
        full_window.push(vm.last_pause());
        // 16 MiB dirtied by the guest, then a diff.
        echo(
            &vm,
            mb::CMD_FILL,
            [TESTGUEST_SCRATCH + 64 * MIB, 4096, i as u64, 0],
        )?;
        let d = dir.0.join(format!("diff{i}"));
        let t = Instant::now();
        vm.snapshot(&d, SnapshotKind::Diff)?;
        diff.push(t.elapsed());
        window.push(vm.last_pause());
        if i + 1 < runs {
            std::fs::remove_dir_all(&d)?;
            std::fs::remove_dir_all(&p)?;
        }
    }
    row(
        "full snapshot, 512 MiB guest with ~10 MiB touched (fsync'd)",
        full,
    );
    row(
        "full snapshot: pause window (files written, fsynced and published after)",
        full_window,
    );
    row(
        "diff snapshot, 16 MiB dirty: call to durable (fsync'd)",
        diff,
    );
    row(
        "diff snapshot, 16 MiB dirty: pause window (pages copied out, written after)",
        window,
    );
    let snap = dir.0.join(format!("diff{}", runs - 1));
    drop(vm);

    // Record the working set once (first restore), for the prefetch rows.
    {
        let mut o = restore_opts(MemoryBackend::Uffd, true, &dir.0);
        o.record_working_set_for = Some(Duration::from_millis(300));
        let r = Vm::restore(&snap, o)?;
        echo(&r, mb::CMD_ECHO, [1, 0, 0, 0])?;
        std::thread::sleep(Duration::from_millis(350));
        anyhow::ensure!(r.save_working_set()?, "no working set recorded");
    }

    let pool = vmm::ShellPool::new(1, 512);
    for (name, backend) in [("mmap", MemoryBackend::Mmap), ("uffd", MemoryBackend::Uffd)] {
        let mut answered = Vec::new();
        for _ in 0..runs {
            pool.fill(1)?; // ahead of time, not measured
            let t = Instant::now();
            let r = Vm::restore_in(pool.take()?, &snap, restore_opts(backend, false, &dir.0))?;
            echo(&r, mb::CMD_ECHO, [7, 0, 0, 0])?;
            answered.push(t.elapsed());
            drop(r);
        }
        row(
            &format!("restore into a pre-built shell to first answer, {name}, page cache warm"),
            answered,
        );
    }

    for (name, backend, prefetch) in [
        ("mmap", MemoryBackend::Mmap, false),
        ("uffd", MemoryBackend::Uffd, false),
        ("uffd + prefetch", MemoryBackend::Uffd, true),
    ] {
        for cache in ["warm", "dropped"] {
            let (mut running, mut answered) = (Vec::new(), Vec::new());
            for _ in 0..runs {
                if cache == "dropped" {
                    drop_caches();
                }
                let t = Instant::now();
                let r = Vm::restore(&snap, restore_opts(backend, prefetch, &dir.0))?;
                running.push(t.elapsed());
                echo(&r, mb::CMD_ECHO, [7, 0, 0, 0])?;
                answered.push(t.elapsed());
                drop(r);
            }
            row(
                &format!("restore to running, {name}, page cache {cache}"),
                running,
            );
            row(
                &format!("restore to first answer (mailbox; wake from HLT emulated), {name}, page cache {cache}"),
                answered,
            );
        }
    }
    Ok(())
}
