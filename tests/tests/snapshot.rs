//! Snapshot and restore of the test guest under real KVM, with both memory
//! backends: RAM, vCPU and device state continue where they were.

use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

use guest_abi::layout::{MIB, TESTGUEST_SCRATCH};
use guest_abi::mailbox as mb;
use sprout_tests::{boot, call, config, host_connect, pattern_checksum, TempDir};
use vm_memory::{Bytes, GuestAddress};
use vmm::{DiskConfig, MemoryBackend, RestoreOptions, SnapshotKind, Vm, VsockConfig};

const PAGES: u64 = 256; // 1 MiB pattern

fn opts(backend: MemoryBackend, dir: &TempDir, tag: &str) -> RestoreOptions {
    let mut o = RestoreOptions::new(backend);
    o.vsock_uds = Some(dir.path().join(format!("{tag}.vsock")));
    o.scratch_dir = dir.path().to_path_buf();
    o
}

#[test]
fn counter_pattern_and_registers_continue_after_restore_with_each_backend() {
    let dir = TempDir::new("snap-basic");
    let (cfg, console) = config(2, 256);
    let mut vm = boot(cfg, &console);
    let gpa = TESTGUEST_SCRATCH + 3 * MIB;
    call(&vm, 0, mb::CMD_FILL, [gpa, PAGES, 0xabc, 0]);
    call(&vm, 0, mb::CMD_COUNT, [1000, 0, 0, 0]);
    call(&vm, 1, mb::CMD_COUNT, [77, 0, 0, 0]);
    let snap = dir.path().join("snap");
    vm.snapshot(&snap, SnapshotKind::Full).unwrap();
    // The original runs on and diverges.
    assert_eq!(call(&vm, 0, mb::CMD_COUNT, [1, 0, 0, 0]).rets[0], 1001);
    call(&vm, 0, mb::CMD_FILL, [gpa, PAGES, 0xdef, 0]);

    for backend in [MemoryBackend::Mmap, MemoryBackend::Uffd] {
        let r = Vm::restore(&snap, opts(backend, &dir, "a")).unwrap();
        let m = r.mailbox().unwrap();
        assert_eq!(m.counter(0).unwrap(), 1000, "{backend:?}");
        assert_eq!(call(&r, 0, mb::CMD_COUNT, [5, 0, 0, 0]).rets[0], 1005);
        assert_eq!(call(&r, 1, mb::CMD_COUNT, [3, 0, 0, 0]).rets[0], 80);
        let c = call(&r, 0, mb::CMD_CHECKSUM, [gpa, PAGES, 0, 0]).rets[0];
        assert_eq!(c, pattern_checksum(0xabc, gpa, PAGES), "{backend:?}");
        // The guest keeps running: a fresh fill and a reset still work.
        call(&r, 1, mb::CMD_FILL, [gpa + 8 * MIB, 16, 1, 0]);
        drop(r);
    }
    // The original is untouched by its restores.
    let c = call(&vm, 0, mb::CMD_CHECKSUM, [gpa, PAGES, 0, 0]).rets[0];
    assert_eq!(c, pattern_checksum(0xdef, gpa, PAGES));
}

#[test]
fn twenty_restores_in_a_row_all_answer() {
    let dir = TempDir::new("snap-20");
    let (cfg, console) = config(1, 256);
    let mut vm = boot(cfg, &console);
    call(&vm, 0, mb::CMD_COUNT, [10, 0, 0, 0]);
    let snap = dir.path().join("snap");
    vm.snapshot(&snap, SnapshotKind::Full).unwrap();
    drop(vm);
    for i in 0..20 {
        let backend = if i % 2 == 0 {
            MemoryBackend::Mmap
        } else {
            MemoryBackend::Uffd
        };
        let r = Vm::restore(&snap, opts(backend, &dir, "x")).unwrap();
        assert_eq!(
            call(&r, 0, mb::CMD_COUNT, [1, 0, 0, 0]).rets[0],
            11,
            "restore {i}"
        );
    }
}

#[test]
fn a_diff_on_a_full_restores_the_later_state() {
    let dir = TempDir::new("snap-diff");
    let (cfg, console) = config(1, 512);
    let mut vm = boot(cfg, &console);
    let a = TESTGUEST_SCRATCH;
    let b = TESTGUEST_SCRATCH + 64 * MIB;
    call(&vm, 0, mb::CMD_FILL, [a, PAGES, 1, 0]);
    let full = dir.path().join("full");
    vm.snapshot(&full, SnapshotKind::Full).unwrap();
    // Change some pages, and zero a page the full layer holds.
    call(&vm, 0, mb::CMD_FILL, [b, PAGES, 2, 0]);
    call(&vm, 0, mb::CMD_COUNT, [42, 0, 0, 0]);
    vm.memory()
        .write_slice(&[0u8; 4096], GuestAddress(a))
        .unwrap();
    let diff = dir.path().join("diff");
    vm.snapshot(&diff, SnapshotKind::Diff).unwrap();
    // The diff holds only what changed: far smaller than the full.
    let used = |p: &Path| -> u64 {
        std::fs::read_dir(p)
            .unwrap()
            .map(|e| {
                use std::os::unix::fs::MetadataExt;
                e.unwrap().metadata().unwrap().blocks() * 512
            })
            .sum()
    };
    assert!(used(&diff) < 3 * MIB, "diff uses {} bytes", used(&diff));
    drop(vm);
    for backend in [MemoryBackend::Mmap, MemoryBackend::Uffd] {
        let r = Vm::restore(&diff, opts(backend, &dir, "d")).unwrap();
        assert_eq!(r.mailbox().unwrap().counter(0).unwrap(), 42);
        let cb = call(&r, 0, mb::CMD_CHECKSUM, [b, PAGES, 0, 0]).rets[0];
        assert_eq!(cb, pattern_checksum(2, b, PAGES), "{backend:?}");
        // Page `a` went back to zero; the rest of the full layer's pattern stays.
        let mut page = [1u8; 4096];
        r.memory().read_slice(&mut page, GuestAddress(a)).unwrap();
        assert!(
            page.iter().all(|&x| x == 0),
            "{backend:?}: zeroed page restored"
        );
        let rest = call(&r, 0, mb::CMD_CHECKSUM, [a + 4096, PAGES - 1, 0, 0]).rets[0];
        assert_eq!(rest, pattern_checksum(1, a + 4096, PAGES - 1));
        // The full alone still restores the earlier state.
        let f = Vm::restore(&full, opts(backend, &dir, "f")).unwrap();
        assert_eq!(f.mailbox().unwrap().counter(0).unwrap(), 0);
    }
}

/// Tracking starts at a VM's first instruction: a diff taken right after a
/// restore holds the pages the guest wrote since and hardly more, with either
/// backend (neither what the restore itself put into memory nor the
/// snapshot's pages).
#[test]
fn a_diff_after_a_restore_holds_only_what_the_guest_wrote_since() {
    let dir = TempDir::new("snap-diff-after-restore");
    let (cfg, console) = config(1, 256);
    let mut vm = boot(cfg, &console);
    let a = TESTGUEST_SCRATCH;
    let b = TESTGUEST_SCRATCH + 16 * MIB;
    call(&vm, 0, mb::CMD_FILL, [a, PAGES, 1, 0]);
    let full = dir.path().join("full");
    vm.snapshot(&full, SnapshotKind::Full).unwrap();
    drop(vm);
    let full_pages = snapshot::format::Snapshot::load(&full)
        .unwrap()
        .manifest()
        .memory_layers[0]
        .data_pages;
    assert!(
        full_pages > PAGES,
        "the full layer holds {full_pages} pages"
    );
    for (i, backend) in [MemoryBackend::Mmap, MemoryBackend::Uffd]
        .into_iter()
        .enumerate()
    {
        let mut r = Vm::restore(&full, opts(backend, &dir, &format!("r{i}"))).unwrap();
        call(&r, 0, mb::CMD_FILL, [b, 16, 2, 0]);
        let diff = dir.path().join(format!("diff{i}"));
        r.snapshot(&diff, SnapshotKind::Diff).unwrap();
        let layers = snapshot::format::Snapshot::load(&diff)
            .unwrap()
            .manifest()
            .memory_layers
            .clone();
        let top = layers.last().unwrap();
        // The 16 filled, and the few the guest's stack and mailbox touch.
        assert!(
            (16..16 + 16).contains(&top.pages_present),
            "{backend:?}: the diff holds {} pages",
            top.pages_present
        );
        drop(r);
        let back = Vm::restore(&diff, opts(backend, &dir, &format!("d{i}"))).unwrap();
        let c = call(&back, 0, mb::CMD_CHECKSUM, [b, 16, 0, 0]).rets[0];
        assert_eq!(c, pattern_checksum(2, b, 16), "{backend:?}");
        let c = call(&back, 0, mb::CMD_CHECKSUM, [a, PAGES, 0, 0]).rets[0];
        assert_eq!(c, pattern_checksum(1, a, PAGES), "{backend:?}");
    }
}

/// A durable diff copies its dirty pages and disk clusters out while the VM
/// is paused and writes them after it runs again: what it holds is the paused
/// instant, not what the guest writes while the layers are being written. A
/// diff larger than `vmm::STAGE_LIMIT` is written while paused, to the same
/// effect.
#[test]
fn a_staged_diff_holds_the_paused_instant_of_memory_and_disk() {
    let dir = TempDir::new("snap-staged");
    let disk = dir.path().join("disk.img");
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    let (mut cfg, console) = config(1, 512);
    cfg.disks = vec![DiskConfig {
        path: disk,
        read_only: false,
        id: "data".into(),
        base: None,
    }];
    let mut vm = boot(cfg, &console);
    let (a, buf) = (TESTGUEST_SCRATCH, TESTGUEST_SCRATCH + 2 * MIB);
    let sector = |vm: &Vm, byte: u8| {
        vm.memory()
            .write_slice(&[byte; 512], GuestAddress(buf))
            .unwrap();
        call(vm, 0, mb::CMD_BLK_WRITE, [0, 8, buf, 1]);
    };
    call(&vm, 0, mb::CMD_FILL, [a, PAGES, 1, 0]);
    sector(&vm, 0x11);
    vm.snapshot(&dir.path().join("full"), SnapshotKind::Full)
        .unwrap();
    assert_eq!(vm.last_staged_bytes(), 0, "a full snapshot is not staged");
    call(&vm, 0, mb::CMD_FILL, [a, PAGES, 2, 0]);
    sector(&vm, 0x22);
    let diff = dir.path().join("diff");
    vm.snapshot(&diff, SnapshotKind::Diff).unwrap();
    let staged = vm.last_staged_bytes();
    assert!(
        (PAGES * 4096 + 4096..vmm::STAGE_LIMIT).contains(&staged),
        "staged {staged} bytes"
    );
    // The guest runs on and overwrites both.
    call(&vm, 0, mb::CMD_FILL, [a, PAGES, 3, 0]);
    sector(&vm, 0x33);

    // Over the limit: 260 MiB dirty, written while paused.
    let big = 260 * MIB / 4096;
    call(
        &vm,
        0,
        mb::CMD_FILL,
        [TESTGUEST_SCRATCH + 4 * MIB, big, 4, 0],
    );
    let over = dir.path().join("over");
    vm.snapshot(&over, SnapshotKind::Diff).unwrap();
    assert_eq!(
        vm.last_staged_bytes(),
        0,
        "a diff over the limit is written paused"
    );
    drop(vm);

    for backend in [MemoryBackend::Mmap, MemoryBackend::Uffd] {
        for (snap, mem, disk) in [(&diff, 2, 0x22), (&over, 3, 0x33)] {
            let r = Vm::restore(snap, opts(backend, &dir, "r")).unwrap();
            let c = call(&r, 0, mb::CMD_CHECKSUM, [a, PAGES, 0, 0]).rets[0];
            assert_eq!(c, pattern_checksum(mem, a, PAGES), "{backend:?} {snap:?}");
            call(&r, 0, mb::CMD_BLK_READ, [0, 8, buf, 1]);
            let mut back = [0u8; 512];
            r.memory().read_slice(&mut back, GuestAddress(buf)).unwrap();
            assert_eq!(back, [disk; 512], "{backend:?} {snap:?}");
            if snap == &over {
                let c = call(
                    &r,
                    0,
                    mb::CMD_CHECKSUM,
                    [TESTGUEST_SCRATCH + 4 * MIB, big, 0, 0],
                );
                assert_eq!(
                    c.rets[0],
                    pattern_checksum(4, TESTGUEST_SCRATCH + 4 * MIB, big)
                );
            }
        }
    }
}

#[test]
fn devices_continue_after_restore_and_disks_diverge_privately() {
    let dir = TempDir::new("snap-dev");
    let disk = dir.path().join("disk.img");
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    let (mut cfg, console) = config(1, 256);
    cfg.disks = vec![DiskConfig {
        path: disk.clone(),
        read_only: false,
        id: "data".into(),
        base: None,
    }];
    cfg.vsock = Some(VsockConfig {
        guest_cid: 9,
        uds_path: dir.path().join("orig.vsock"),
    });
    cfg.rng = true;
    let mut vm = boot(cfg, &console);
    let buf = TESTGUEST_SCRATCH;
    let before: Vec<u8> = (0..512u32).map(|i| (i % 200) as u8).collect();
    vm.memory().write_slice(&before, GuestAddress(buf)).unwrap();
    call(&vm, 0, mb::CMD_BLK_WRITE, [0, 100, buf, 1]);
    // A vsock exchange before the snapshot.
    let mut c = host_connect(&dir.path().join("orig.vsock"), mb::VSOCK_ECHO_PORT);
    c.write_all(b"before").unwrap();
    let mut got = [0u8; 6];
    c.read_exact(&mut got).unwrap();
    let snap = dir.path().join("snap");
    vm.snapshot(&snap, SnapshotKind::Full).unwrap();
    // The original overwrites its sector after the snapshot.
    vm.memory()
        .write_slice(&[0xee; 512], GuestAddress(buf))
        .unwrap();
    call(&vm, 0, mb::CMD_BLK_WRITE, [0, 100, buf, 1]);

    let o = opts(MemoryBackend::Uffd, &dir, "restored");
    let uds = o.vsock_uds.clone().unwrap();
    let r = Vm::restore(&snap, o).unwrap();
    // blk: the restored disk has the sector as it was at the snapshot...
    call(&r, 0, mb::CMD_BLK_READ, [0, 100, buf + MIB, 1]);
    let mut back = vec![0u8; 512];
    r.memory()
        .read_slice(&mut back, GuestAddress(buf + MIB))
        .unwrap();
    assert_eq!(back, before);
    // ...and its writes go to its private top, never to the original file.
    r.memory()
        .write_slice(&[0x5a; 512], GuestAddress(buf))
        .unwrap();
    call(&r, 0, mb::CMD_BLK_WRITE, [0, 200, buf, 1]);
    call(&r, 0, mb::CMD_BLK_READ, [0, 200, buf + MIB, 1]);
    r.memory()
        .read_slice(&mut back, GuestAddress(buf + MIB))
        .unwrap();
    assert_eq!(back, vec![0x5a; 512]);
    let mut on_file = vec![0u8; 512];
    std::fs::File::open(&disk)
        .unwrap()
        .read_exact_at(&mut on_file, 200 * 512)
        .unwrap();
    assert_eq!(
        on_file,
        vec![0u8; 512],
        "restored VM wrote the original disk"
    );
    std::fs::File::open(&disk)
        .unwrap()
        .read_exact_at(&mut on_file, 100 * 512)
        .unwrap();
    assert_eq!(
        on_file,
        vec![0xee; 512],
        "original VM's write is in its file"
    );
    // vsock: the guest saw a transport reset; new connections work both ways.
    let mut c2 = host_connect(&uds, mb::VSOCK_ECHO_PORT);
    c2.write_all(b"after restore").unwrap();
    let mut got = [0u8; 13];
    c2.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"after restore");
    let port = 6000u64;
    let listener =
        std::os::unix::net::UnixListener::bind(format!("{}_{port}", uds.display())).unwrap();
    let host = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut b = [0u8; 5];
        s.read_exact(&mut b).unwrap();
        s.write_all(b"yes").unwrap();
        b
    });
    r.memory().write_slice(b"hello", GuestAddress(buf)).unwrap();
    let rep = call(&r, 0, mb::CMD_VSOCK_SEND, [port, buf, 5, 0]);
    assert_eq!(&host.join().unwrap(), b"hello");
    assert_eq!(rep.rets[0], 3);
    // rng still serves.
    call(&r, 0, mb::CMD_RNG_READ, [buf, 64, 0, 0]);
    drop(r);
    drop(vm);
    // The restored VM's private disk top leaves nothing behind.
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("sprout-disk-"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn corrupt_snapshots_are_refused_naming_the_file() {
    let dir = TempDir::new("snap-corrupt");
    let (cfg, console) = config(1, 128);
    let mut vm = boot(cfg, &console);
    call(&vm, 0, mb::CMD_FILL, [TESTGUEST_SCRATCH, 16, 3, 0]);
    let good = dir.path().join("good");
    vm.snapshot(&good, SnapshotKind::Full).unwrap();
    drop(vm);
    let files: Vec<String> = std::fs::read_dir(&good)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for name in ["manifest.json", "state.bin", "memory", "memory.map"] {
        let f = files
            .iter()
            .find(|f| f.as_str() == name)
            .unwrap_or_else(|| panic!("no {name} in {files:?}"))
            .clone();
        for damage in ["truncate-half", "flip"] {
            let bad = dir.path().join(format!("bad-{name}-{damage}"));
            std::fs::create_dir(&bad).unwrap();
            for g in &files {
                std::fs::copy(good.join(g), bad.join(g)).unwrap();
            }
            let p = bad.join(&f);
            let mut bytes = std::fs::read(&p).unwrap();
            match damage {
                "truncate-half" => bytes.truncate(bytes.len() / 2),
                _ => {
                    // Flip a byte in the data, past any header.
                    let at = bytes
                        .iter()
                        .position(|&b| b != 0)
                        .unwrap_or(0)
                        .max(bytes.len() / 3);
                    bytes[at] ^= 0x40;
                }
            }
            std::fs::write(&p, bytes).unwrap();
            let t = std::time::Instant::now();
            let err = match Vm::restore(&bad, opts(MemoryBackend::Mmap, &dir, "c")) {
                Ok(_) => panic!("{name} {damage}: restored"),
                Err(e) => format!("{:#}", anyhow_chain(&e)),
            };
            assert!(t.elapsed().as_secs() < 1, "{name} {damage}: slow refusal");
            assert!(
                err.contains(&format!("{}/{name} ", bad.display()))
                    || err.ends_with(&format!("{}/{name}", bad.display()))
                    || err.contains(&format!("{}/{name}:", bad.display())),
                "{name} {damage}: error does not name the file: {err}"
            );
        }
    }
}

/// What a snapshot's writer seals is what it wrote: with the seals taken
/// away, a full snapshot and a diff on it (its pages staged while paused
/// and written after) are hashed on load and match their manifests. sproutd
/// takes a worker's checksums for its data files on this basis
/// (`Snapshot::load_written`).
#[test]
fn the_checksums_a_writer_seals_are_those_of_the_bytes_it_wrote() {
    let dir = TempDir::new("snap-sealed-true");
    let (cfg, console) = config(1, 128);
    let mut vm = boot(cfg, &console);
    call(&vm, 0, mb::CMD_FILL, [TESTGUEST_SCRATCH, 64, 3, 0]);
    let full = dir.path().join("full");
    vm.snapshot(&full, SnapshotKind::Full).unwrap();
    call(
        &vm,
        0,
        mb::CMD_FILL,
        [TESTGUEST_SCRATCH + 8 * MIB, 40, 4, 0],
    );
    let diff = dir.path().join("diff");
    vm.snapshot(&diff, SnapshotKind::Diff).unwrap();
    assert!(
        vm.last_staged_bytes() > 0,
        "the diff was staged while paused"
    );
    drop(vm);
    for d in [&full, &diff] {
        std::fs::remove_file(d.join(".sealed")).expect("the writer sealed it");
    }
    // Nothing sealed and nothing this process verified before: every data
    // file is hashed against the manifest's checksum.
    let chain = snapshot::format::Snapshot::load_chain(&diff).expect("matches its manifests");
    assert_eq!(chain.len(), 2);
}

/// A snapshot is verified once, as written: its seal names the exact file
/// versions the writer's checksums are of. A data file changed in place
/// afterwards (same size, same inode) has another version and is refused.
#[test]
fn a_snapshot_is_sealed_as_written_and_a_change_after_is_refused() {
    use std::os::unix::io::AsRawFd;
    let dir = TempDir::new("snap-sealed");
    let (cfg, console) = config(1, 128);
    let mut vm = boot(cfg, &console);
    call(&vm, 0, mb::CMD_FILL, [TESTGUEST_SCRATCH, 16, 5, 0]);
    let snap = dir.path().join("s");
    vm.snapshot(&snap, SnapshotKind::Full).unwrap();
    drop(vm);
    let seal = std::fs::read_to_string(snap.join(".sealed")).expect("the writer sealed it");
    assert!(
        seal.lines().any(|l| l.ends_with(" memory")),
        "the memory layer is in the seal: {seal}"
    );
    // Unchanged, it restores (from the seal, not a hash: see the snapshot
    // crate's tests and `report -- workers`).
    let vm = Vm::restore(&snap, opts(MemoryBackend::Mmap, &dir, "a")).unwrap();
    drop(vm);
    // One byte of the first data page flipped in place.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(snap.join("memory"))
        .unwrap();
    // SAFETY: lseek on an open, owned descriptor.
    let data = unsafe { libc::lseek(f.as_raw_fd(), 0, libc::SEEK_DATA) };
    assert!(data >= 0, "the memory layer holds data");
    let mut page = vec![0u8; 4096];
    f.read_exact_at(&mut page, data as u64).unwrap();
    let at = page.iter().position(|&b| b != 0).unwrap_or(0);
    page[at] ^= 0x40;
    f.write_all_at(&page[at..at + 1], data as u64 + at as u64)
        .unwrap();
    drop(f);
    let err = match Vm::restore(&snap, opts(MemoryBackend::Mmap, &dir, "b")) {
        Ok(_) => panic!("a snapshot changed after its seal restored"),
        Err(e) => anyhow_chain(&e),
    };
    assert!(
        err.contains(&format!("{}/memory", snap.display())),
        "the error names the changed file: {err}"
    );
}

/// A snapshot records which version of each read-only image the guest saw;
/// a restore over the same bytes (even another file's) works, over an image
/// that was rebuilt or changed since is refused, naming it, before the guest
/// runs with another file system under its page cache.
#[test]
fn a_restore_over_a_changed_read_only_image_is_refused() {
    let dir = TempDir::new("snap-image");
    let (image, bytes, mut vm) = boot_over_image(&dir, 253);
    let sector = |vm: &Vm| read_sector(vm, 9);
    assert_eq!(sector(&vm), bytes[9 * 512..10 * 512]);
    let snap = dir.path().join("snap");
    vm.snapshot(&snap, SnapshotKind::Full).unwrap();
    drop(vm);
    // Replaced by a copy of the same bytes (another inode): the same image.
    let put = |b: &[u8]| {
        let tmp = dir.path().join("image.tmp");
        std::fs::write(&tmp, b).unwrap();
        std::fs::rename(&tmp, &image).unwrap();
    };
    put(&bytes);
    let r = Vm::restore(&snap, opts(MemoryBackend::Mmap, &dir, "same")).unwrap();
    assert_eq!(sector(&r), bytes[9 * 512..10 * 512]);
    drop(r);
    // Rebuilt: one byte of its head differs (as an ext4 superblock's UUID
    // would), or its size.
    let mut rebuilt = bytes.clone();
    rebuilt[1024 + 0x68] ^= 1;
    let mut grown = bytes.clone();
    grown.extend_from_slice(&[0; 512]);
    for (what, b) in [("rebuilt", &rebuilt), ("grown", &grown)] {
        put(b);
        let e = match Vm::restore(&snap, opts(MemoryBackend::Uffd, &dir, what)) {
            Ok(_) => panic!("{what}: restored over another image"),
            Err(e) => e,
        };
        assert_eq!(e.code(), "image_changed", "{what}: {e}");
        let msg = anyhow_chain(&e);
        assert!(
            msg.contains(&image.display().to_string()) && msg.contains("rebuilt or changed"),
            "{what}: {msg}"
        );
    }
    // The image it was taken over, back: it restores again.
    put(&bytes);
    let r = Vm::restore(&snap, opts(MemoryBackend::Mmap, &dir, "back")).unwrap();
    assert_eq!(sector(&r), bytes[9 * 512..10 * 512]);
}

/// A rebuild leaves the old image at another path (sproutd pins every image
/// version it boots): the snapshot says where and which image it read, and
/// restores over that copy, which its restored VM then records.
#[test]
fn a_read_only_image_can_be_given_at_another_path() {
    let dir = TempDir::new("snap-image-path");
    let (image, bytes, mut vm) = boot_over_image(&dir, 251);
    let sector = |vm: &Vm| read_sector(vm, 5);
    assert_eq!(sector(&vm), bytes[5 * 512..6 * 512]);
    let snap = dir.path().join("snap");
    vm.snapshot(&snap, SnapshotKind::Full).unwrap();
    drop(vm);
    let identity = devices::virtio::block::ImageIdentity::of_path(&image).unwrap();
    assert_eq!(
        vmm::VmState::recorded_images(&snap).unwrap(),
        vec![vmm::RecordedImage {
            disk: 0,
            path: image.clone(),
            identity: Some(identity),
        }]
    );
    // The image is rebuilt in place; the old one survives as a link.
    let kept = dir.path().join("kept.img");
    std::fs::hard_link(&image, &kept).unwrap();
    let mut rebuilt = bytes.clone();
    rebuilt[1024 + 0x68] ^= 1;
    let tmp = dir.path().join("image.tmp");
    std::fs::write(&tmp, &rebuilt).unwrap();
    std::fs::rename(&tmp, &image).unwrap();
    let at = |disk: usize, path: &std::path::Path, what: &str| {
        let mut o = opts(MemoryBackend::Mmap, &dir, what);
        o.image_paths.insert(disk, path.to_owned());
        Vm::restore(&snap, o)
    };
    let mut r = at(0, &kept, "kept").unwrap();
    assert_eq!(sector(&r), bytes[5 * 512..6 * 512]);
    // Its own snapshots name the path it read.
    let again = dir.path().join("again");
    r.snapshot(&again, SnapshotKind::Full).unwrap();
    drop(r);
    assert_eq!(vmm::VmState::recorded_images(&again).unwrap()[0].path, kept);
    // Another image at the given path is still refused, and so is a path
    // for a disk that is no image.
    let e = at(0, &image, "rebuilt")
        .err()
        .expect("restored over another image");
    assert_eq!(e.code(), "image_changed", "{e}");
    let e = at(1, &kept, "no disk")
        .err()
        .expect("restored with a bad disk");
    assert_eq!(e.code(), "bad_request", "{e}");
    assert!(e.to_string().contains("Disk 1"), "{e}");
}

/// A test guest VM over a 1 MiB read-only image of bytes `i % modulus`
/// in `dir`: the image's path, its bytes, the VM.
fn boot_over_image(dir: &TempDir, modulus: u32) -> (std::path::PathBuf, Vec<u8>, Vm) {
    let image = dir.path().join("image.img");
    let bytes: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % modulus) as u8).collect();
    std::fs::write(&image, &bytes).unwrap();
    let (mut cfg, console) = config(1, 128);
    cfg.disks = vec![DiskConfig {
        path: image.clone(),
        read_only: true,
        id: "image".into(),
        base: None,
    }];
    (image, bytes, boot(cfg, &console))
}

/// Sector `n` of the VM's image, as its guest reads it.
fn read_sector(vm: &Vm, n: u64) -> Vec<u8> {
    call(vm, 0, mb::CMD_BLK_READ, [0, n, TESTGUEST_SCRATCH, 1]);
    let mut got = vec![0u8; 512];
    vm.memory()
        .read_slice(&mut got, GuestAddress(TESTGUEST_SCRATCH))
        .unwrap();
    got
}

fn anyhow_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        s.push_str(": ");
        s.push_str(&x.to_string());
        src = x.source();
    }
    s
}

#[test]
fn restores_into_prebuilt_shells_with_each_backend() {
    let dir = TempDir::new("snap-shell");
    let (cfg, console) = config(2, 256);
    let mut vm = boot(cfg, &console);
    call(&vm, 0, mb::CMD_COUNT, [500, 0, 0, 0]);
    call(&vm, 1, mb::CMD_FILL, [TESTGUEST_SCRATCH, PAGES, 9, 0]);
    let snap = dir.path().join("snap");
    vm.snapshot(&snap, SnapshotKind::Full).unwrap();
    drop(vm);
    let pool = vmm::ShellPool::new(2, 256);
    pool.fill(3).unwrap();
    assert_eq!(pool.len(), 3);
    for backend in [
        MemoryBackend::Mmap,
        MemoryBackend::Uffd,
        MemoryBackend::Mmap,
    ] {
        let r = Vm::restore_in(pool.take().unwrap(), &snap, opts(backend, &dir, "s")).unwrap();
        assert_eq!(
            call(&r, 0, mb::CMD_COUNT, [1, 0, 0, 0]).rets[0],
            501,
            "{backend:?}"
        );
        let c = call(&r, 1, mb::CMD_CHECKSUM, [TESTGUEST_SCRATCH, PAGES, 0, 0]).rets[0];
        assert_eq!(
            c,
            pattern_checksum(9, TESTGUEST_SCRATCH, PAGES),
            "{backend:?}"
        );
    }
    assert!(pool.is_empty());
    // A shell of another shape is refused, not used.
    let wrong = vmm::VmShell::new(1, 256).unwrap();
    let err = Vm::restore_in(wrong, &snap, opts(MemoryBackend::Mmap, &dir, "w"))
        .err()
        .unwrap();
    assert!(err.to_string().contains("shell"), "{err}");
}

/// Every CPUID leaf and subleaf (0-3) the guest can read on vCPU `cpu`,
/// basic and extended.
fn cpuid_table(vm: &Vm, cpu: u8) -> Vec<(u32, u32, [u64; 4])> {
    let mut out = Vec::new();
    for base in [0u32, 0x8000_0000] {
        let max = call(vm, cpu, mb::CMD_CPUID, [u64::from(base), 0, 0, 0]).rets[0] as u32;
        assert!(
            max >= base && max - base < 0x100,
            "leaf {base:#x} says {max:#x}"
        );
        for leaf in base..=max {
            for sub in 0..4 {
                let r = call(vm, cpu, mb::CMD_CPUID, [u64::from(leaf), sub, 0, 0]).rets;
                out.push((leaf, sub as u32, r));
            }
        }
    }
    out
}

type CpuidTables = [Vec<(u32, u32, [u64; 4])>; 2];

/// Panics naming the first leaf where `got` differs from `want`.
fn same_cpuid(got: &CpuidTables, want: &CpuidTables, how: &str) {
    for cpu in 0..2 {
        assert_eq!(
            got[cpu].len(),
            want[cpu].len(),
            "{how}: vCPU {cpu}'s leaves"
        );
        for (g, w) in got[cpu].iter().zip(&want[cpu]) {
            assert_eq!(g, w, "{how}: vCPU {cpu}, CPUID (leaf, subleaf, regs)");
        }
    }
}

/// A shell's vCPUs get the boot CPUID ahead of time, and a boot or restore
/// into the shell keeps it instead of setting it again when it is the one
/// wanted: the guest must read the same CPUID every way it starts.
#[test]
fn the_guest_reads_one_cpuid_booted_or_restored_with_or_without_a_shell() {
    let dir = TempDir::new("snap-cpuid");
    let (cfg, console) = config(2, 256);
    let tables = |vm: &Vm| -> CpuidTables { [cpuid_table(vm, 0), cpuid_table(vm, 1)] };
    let mut vm = boot(cfg.clone(), &console);
    let want = tables(&vm);
    // Sanity: leaf 1 EBX holds each vCPU's own APIC id.
    let apic_id = |t: &[(u32, u32, [u64; 4])]| {
        let (_, _, r) = t.iter().find(|(l, s, _)| (*l, *s) == (1, 0)).unwrap();
        r[1] >> 24
    };
    assert_eq!((apic_id(&want[0]), apic_id(&want[1])), (0, 1));

    let shelled = Vm::start_in(cfg, Some(vmm::VmShell::new(2, 256).unwrap())).unwrap();
    let m = shelled.mailbox().unwrap();
    for c in 0..2 {
        m.wait_ready(c, std::time::Duration::from_secs(30)).unwrap();
    }
    same_cpuid(&tables(&shelled), &want, "booted into a shell");
    drop(shelled);

    let snap = dir.path().join("snap");
    vm.snapshot(&snap, SnapshotKind::Full).unwrap();
    drop(vm);
    let r = Vm::restore(&snap, opts(MemoryBackend::Mmap, &dir, "a")).unwrap();
    same_cpuid(&tables(&r), &want, "restored");
    drop(r);
    for backend in [MemoryBackend::Mmap, MemoryBackend::Uffd] {
        let shell = vmm::VmShell::new(2, 256).unwrap();
        let r = Vm::restore_in(shell, &snap, opts(backend, &dir, "b")).unwrap();
        same_cpuid(
            &tables(&r),
            &want,
            &format!("restored into a shell ({backend:?})"),
        );
    }
}

/// Restore opens the disk layer files the verified manifest lists, whatever
/// they are called, and never a file it did not list: here the listed files
/// are renamed (the manifest follows), and decoys under the names the VMM
/// writes hold garbage.
#[test]
fn disk_layers_come_from_the_manifest_not_from_file_names() {
    let dir = TempDir::new("snap-disknames");
    let disk = dir.path().join("disk.img");
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let (mut cfg, console) = config(1, 128);
    cfg.disks = vec![DiskConfig {
        path: disk,
        read_only: false,
        id: "data".into(),
        base: None,
    }];
    let mut vm = boot(cfg, &console);
    let buf = TESTGUEST_SCRATCH;
    let before: Vec<u8> = (0..512u32).map(|i| (i % 251) as u8).collect();
    vm.memory().write_slice(&before, GuestAddress(buf)).unwrap();
    call(&vm, 0, mb::CMD_BLK_WRITE, [0, 7, buf, 1]);
    let snap = dir.path().join("snap");
    vm.snapshot(&snap, SnapshotKind::Full).unwrap();
    drop(vm);

    let mut m = snapshot::Snapshot::load(&snap).unwrap().manifest().clone();
    let layer = m.disk_layers.first_mut().expect("a disk layer");
    for (i, f) in layer.files.iter_mut().enumerate() {
        let new = format!("renamed-{i}.bin");
        std::fs::rename(snap.join(&f.name), snap.join(&new)).unwrap();
        std::fs::write(snap.join(&f.name), vec![0xa5u8; 4096]).unwrap();
        f.name = new;
    }
    snapshot::format::rewrite_manifest(&snap, &m).unwrap();

    let r = Vm::restore(&snap, opts(MemoryBackend::Mmap, &dir, "r")).unwrap();
    call(&r, 0, mb::CMD_BLK_READ, [0, 7, buf + MIB, 1]);
    let mut back = vec![0u8; 512];
    r.memory()
        .read_slice(&mut back, GuestAddress(buf + MIB))
        .unwrap();
    assert_eq!(back, before);
}
