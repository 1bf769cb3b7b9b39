//! virtio devices end to end: the test guest drives virtio-blk, virtio-vsock
//! and virtio-rng through virtio-mmio under real KVM; the host checks files,
//! sockets and guest memory.

use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::Duration;

use guest_abi::layout::{MIB, TESTGUEST_SCRATCH};
use guest_abi::mailbox as mb;
use sprout_tests::{boot, call, config, host_connect, TempDir, TIMEOUT};
use vm_memory::{Bytes, GuestAddress};
use vmm::{DiskConfig, VsockConfig};

const SECTOR: u64 = 512;

fn sector_bytes(tag: u8, sector: u64) -> Vec<u8> {
    (0..SECTOR)
        .map(|i| tag ^ (sector as u8).wrapping_mul(31) ^ (i as u8))
        .collect()
}

fn make_base_image(path: &Path, sectors: u64) {
    let mut data = Vec::with_capacity((sectors * SECTOR) as usize);
    for s in 0..sectors {
        data.extend(sector_bytes(0xb0, s));
    }
    std::fs::write(path, data).unwrap();
}

#[test]
fn blk_writes_land_in_the_disk_file_and_the_base_stays_intact() {
    let dir = TempDir::new("blk");
    let base = dir.path().join("base.img");
    let disk = dir.path().join("disk.img");
    make_base_image(&base, 64);
    let base_before = std::fs::read(&base).unwrap();
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(16 << 30)
        .unwrap(); // 16 GiB sparse
    let (mut cfg, console) = config(1, 256);
    cfg.disks = vec![
        DiskConfig {
            path: base.clone(),
            read_only: true,
            id: "base-image".into(),
            base: None,
        },
        DiskConfig {
            path: disk.clone(),
            read_only: false,
            id: "scratch-disk".into(),
            base: None,
        },
    ];
    let vm = boot(cfg, &console);
    let mem = vm.memory();
    let r = call(&vm, 0, mb::CMD_PROBE, [0; 4]);
    assert_eq!(r.rets[0], 2, "two virtio-blk devices");

    // Base image: sectors read back intact.
    let buf = TESTGUEST_SCRATCH;
    call(&vm, 0, mb::CMD_BLK_READ, [0, 3, buf, 2]);
    let mut got = vec![0u8; 1024];
    mem.read_slice(&mut got, GuestAddress(buf)).unwrap();
    assert_eq!(&got[..512], &sector_bytes(0xb0, 3)[..]);
    assert_eq!(&got[512..], &sector_bytes(0xb0, 4)[..]);

    // Writing the read-only base fails and changes nothing.
    let r = vm
        .mailbox()
        .unwrap()
        .call(0, mb::CMD_BLK_WRITE, [0, 3, buf, 1], TIMEOUT)
        .unwrap();
    assert_eq!(r.status, mb::STATUS_IO_ERROR);

    // A sector written by the guest lands in the writable disk file, far into it.
    let data: Vec<u8> = (0..SECTOR).map(|i| (i * 7 + 1) as u8).collect();
    mem.write_slice(&data, GuestAddress(buf + MIB)).unwrap();
    let far = (8u64 << 30) / SECTOR + 7;
    call(&vm, 0, mb::CMD_BLK_WRITE, [1, far, buf + MIB, 1]);
    call(&vm, 0, mb::CMD_BLK_FLUSH, [1, 0, 0, 0]);
    let f = std::fs::File::open(&disk).unwrap();
    let mut on_disk = vec![0u8; SECTOR as usize];
    f.read_exact_at(&mut on_disk, far * SECTOR).unwrap();
    assert_eq!(on_disk, data);
    // And reads back through the guest.
    call(&vm, 0, mb::CMD_BLK_READ, [1, far, buf + 2 * MIB, 1]);
    let mut back = vec![0u8; SECTOR as usize];
    mem.read_slice(&mut back, GuestAddress(buf + 2 * MIB))
        .unwrap();
    assert_eq!(back, data);

    // Past the end of the disk: an I/O error, not a crash.
    let r = vm
        .mailbox()
        .unwrap()
        .call(0, mb::CMD_BLK_READ, [0, 64, buf, 1], TIMEOUT)
        .unwrap();
    assert_eq!(r.status, mb::STATUS_IO_ERROR);

    // GET_ID.
    call(&vm, 0, mb::CMD_BLK_ID, [1, buf + 3 * MIB, 0, 0]);
    let mut id = [0u8; 20];
    mem.read_slice(&mut id, GuestAddress(buf + 3 * MIB))
        .unwrap();
    assert_eq!(&id[..12], b"scratch-disk");

    drop(vm);
    assert_eq!(
        std::fs::read(&base).unwrap(),
        base_before,
        "base image changed"
    );
}

fn vsock_vm(dir: &TempDir) -> (vmm::Vm, std::path::PathBuf) {
    let uds = dir.path().join("vsock.sock");
    let (mut cfg, console) = config(1, 256);
    cfg.vsock = Some(VsockConfig {
        guest_cid: 42,
        uds_path: uds.clone(),
    });
    let vm = boot(cfg, &console);
    let r = call(&vm, 0, mb::CMD_PROBE, [0; 4]);
    assert_eq!((r.rets[1], r.rets[3]), (1, 42), "vsock present with CID 42");
    (vm, uds)
}

#[test]
fn vsock_guest_connects_to_a_host_listener() {
    let dir = TempDir::new("vsock-g2h");
    let (vm, uds) = vsock_vm(&dir);
    let port = 5000;
    let listener = UnixListener::bind(format!("{}_{port}", uds.display())).unwrap();
    let host = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf).unwrap();
        let got = buf[..n].to_vec();
        s.write_all(b"pong from host").unwrap();
        got
    });
    let msg = b"ping from guest";
    let gpa = TESTGUEST_SCRATCH;
    vm.memory().write_slice(msg, GuestAddress(gpa)).unwrap();
    let r = call(&vm, 0, mb::CMD_VSOCK_SEND, [port, gpa, msg.len() as u64, 0]);
    assert_eq!(host.join().unwrap(), msg);
    assert_eq!(r.rets[0], 14);
    let mut reply = [0u8; 14];
    vm.memory()
        .read_slice(&mut reply, GuestAddress(gpa))
        .unwrap();
    assert_eq!(&reply, b"pong from host");

    // Nobody listens on another port: the guest is refused, not hung.
    let r = vm
        .mailbox()
        .unwrap()
        .call(0, mb::CMD_VSOCK_SEND, [5001, gpa, 4, 0], TIMEOUT)
        .unwrap();
    assert_eq!(r.status, mb::STATUS_REFUSED);
}

#[test]
fn vsock_host_connects_to_the_guest_many_at_once() {
    let dir = TempDir::new("vsock-h2g");
    let (vm, uds) = vsock_vm(&dir);
    let mut conns: Vec<UnixStream> = (0..8)
        .map(|_| host_connect(&uds, mb::VSOCK_ECHO_PORT))
        .collect();
    // Interleave messages over all connections; each gets its own echo.
    for round in 0..3 {
        for (i, c) in conns.iter_mut().enumerate() {
            c.write_all(format!("conn {i} round {round};").as_bytes())
                .unwrap();
        }
        for (i, c) in conns.iter_mut().enumerate() {
            let want = format!("conn {i} round {round};");
            let mut got = vec![0u8; want.len()];
            c.read_exact(&mut got).unwrap();
            assert_eq!(String::from_utf8_lossy(&got), want);
        }
    }
    // A larger message crosses several rx buffers and credit updates.
    let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let mut c = conns.pop().unwrap();
    let writer = {
        let mut w = c.try_clone().unwrap();
        let big = big.clone();
        std::thread::spawn(move || w.write_all(&big).unwrap())
    };
    let mut got = vec![0u8; big.len()];
    c.read_exact(&mut got).unwrap();
    writer.join().unwrap();
    assert!(got == big, "200 kB echo differs");

    // A port nobody listens on: the host side is closed.
    let mut s = UnixStream::connect(&uds).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    s.write_all(b"CONNECT 9999\n").unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(!String::from_utf8_lossy(&rest).starts_with("OK"));
    drop(vm);
    // The socket file goes with the VM.
    std::thread::sleep(Duration::from_millis(10));
    assert!(!uds.exists(), "vsock socket left behind");
}

#[test]
fn rng_fills_guest_memory_with_fresh_bytes() {
    let (mut cfg, console) = config(1, 128);
    cfg.rng = true;
    let vm = boot(cfg, &console);
    let a = TESTGUEST_SCRATCH;
    let b = a + 8192;
    call(&vm, 0, mb::CMD_RNG_READ, [a, 4096, 0, 0]);
    call(&vm, 0, mb::CMD_RNG_READ, [b, 4096, 0, 0]);
    let mut x = vec![0u8; 4096];
    let mut y = vec![0u8; 4096];
    vm.memory().read_slice(&mut x, GuestAddress(a)).unwrap();
    vm.memory().read_slice(&mut y, GuestAddress(b)).unwrap();
    assert_ne!(x, y);
    assert!(
        x.iter().filter(|&&v| v == 0).count() < 64,
        "mostly zero: not filled"
    );
}

/// Tries the `CONNECT` handshake; `None` if the VM closed the stream first
/// (refused by its connection budget).
fn try_host_connect(uds: &Path, port: u32) -> Option<UnixStream> {
    use std::io::{BufRead, BufReader};
    let mut s = UnixStream::connect(uds).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    s.write_all(format!("CONNECT {port}\n").as_bytes()).ok()?;
    let mut line = String::new();
    match BufReader::new(&mut s).read_line(&mut line) {
        Ok(_) if line.starts_with("OK ") => Some(s),
        _ => None,
    }
}

/// A host opening more vsock connections than the VM's budget gets the extra
/// ones closed at once; the accepted ones and the guest keep working, and a
/// closed connection frees its place.
#[test]
fn vsock_connections_beyond_the_budget_are_refused_and_the_vm_keeps_serving() {
    let dir = TempDir::new("vsock-budget");
    let uds = dir.path().join("vsock.sock");
    let (mut cfg, console) = config(1, 128);
    cfg.vsock = Some(VsockConfig {
        guest_cid: 42,
        uds_path: uds.clone(),
    });
    cfg.vsock_max_connections = 4;
    let vm = boot(cfg, &console);
    let mut conns: Vec<UnixStream> = (0..4)
        .map(|_| host_connect(&uds, mb::VSOCK_ECHO_PORT))
        .collect();
    for _ in 0..3 {
        assert!(
            try_host_connect(&uds, mb::VSOCK_ECHO_PORT).is_none(),
            "a connection beyond the budget was accepted"
        );
    }
    for (i, c) in conns.iter_mut().enumerate() {
        let msg = format!("conn {i}");
        c.write_all(msg.as_bytes()).unwrap();
        let mut got = vec![0u8; msg.len()];
        c.read_exact(&mut got).unwrap();
        assert_eq!(got, msg.as_bytes());
    }
    assert_eq!(call(&vm, 0, mb::CMD_ECHO, [7, 0, 0, 0]).rets[0], 7);
    // Closing one frees its place (once the guest has seen the close).
    drop(conns.pop());
    let deadline = std::time::Instant::now() + TIMEOUT;
    let mut again = loop {
        if let Some(s) = try_host_connect(&uds, mb::VSOCK_ECHO_PORT) {
            break s;
        }
        assert!(std::time::Instant::now() < deadline, "no place freed");
        std::thread::sleep(Duration::from_millis(50));
    };
    again.write_all(b"again").unwrap();
    let mut got = [0u8; 5];
    again.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"again");
}

/// A writable disk made as an empty top over a read-only template (what a
/// Linux sandbox's disk is): the guest reads the template through it, its
/// writes land in the top only, a snapshot of it restores without the
/// template (its disk layer holds every cluster), and the template never
/// changes.
#[test]
fn a_disk_that_is_a_top_over_a_template_reads_it_and_writes_only_the_top() {
    use vmm::{MemoryBackend, RestoreOptions, SnapshotKind, Vm};
    let dir = TempDir::new("blk-base");
    let template = dir.path().join("template.img");
    let top = dir.path().join("disk.img");
    make_base_image(&template, 64);
    let template_before = std::fs::read(&template).unwrap();
    std::fs::File::create(&top)
        .unwrap()
        .set_len(64 * SECTOR)
        .unwrap();
    let (mut cfg, console) = config(1, 256);
    cfg.disks = vec![DiskConfig {
        path: top.clone(),
        read_only: false,
        id: "disk".into(),
        base: Some(template.clone()),
    }];
    let mut vm = boot(cfg, &console);
    let mem = vm.memory();
    let buf = TESTGUEST_SCRATCH;

    // The template shows through the empty top.
    call(&vm, 0, mb::CMD_BLK_READ, [0, 9, buf, 2]);
    let mut got = vec![0u8; 1024];
    mem.read_slice(&mut got, GuestAddress(buf)).unwrap();
    assert_eq!(&got[..512], &sector_bytes(0xb0, 9)[..]);
    assert_eq!(&got[512..], &sector_bytes(0xb0, 10)[..]);

    // One sector written: its cluster (sectors 8 to 15) is copied up whole.
    let data: Vec<u8> = (0..SECTOR).map(|i| (i * 5 + 3) as u8).collect();
    mem.write_slice(&data, GuestAddress(buf + MIB)).unwrap();
    call(&vm, 0, mb::CMD_BLK_WRITE, [0, 10, buf + MIB, 1]);
    call(&vm, 0, mb::CMD_BLK_FLUSH, [0, 0, 0, 0]);
    let on_top = std::fs::read(&top).unwrap();
    assert_eq!(&on_top[10 * 512..11 * 512], &data[..]);
    assert_eq!(&on_top[9 * 512..10 * 512], &sector_bytes(0xb0, 9)[..]);
    assert!(
        on_top[..8 * 512].iter().all(|&b| b == 0),
        "the top holds one cluster"
    );
    assert!(on_top[16 * 512..].iter().all(|&b| b == 0));

    // Restored from a snapshot, with the template gone, it is the same disk.
    let snap = dir.path().join("snap");
    vm.snapshot(&snap, SnapshotKind::Full).unwrap();
    drop(vm);
    assert_eq!(std::fs::read(&template).unwrap(), template_before);
    std::fs::rename(&template, dir.path().join("moved.img")).unwrap();
    let mut o = RestoreOptions::new(MemoryBackend::Mmap);
    o.scratch_dir = dir.path().to_path_buf();
    let r = Vm::restore(&snap, o).unwrap();
    let mem = r.memory();
    for (sector, want) in [
        (9, sector_bytes(0xb0, 9)),
        (10, data.clone()),
        (40, sector_bytes(0xb0, 40)),
    ] {
        call(&r, 0, mb::CMD_BLK_READ, [0, sector, buf + 2 * MIB, 1]);
        let mut back = vec![0u8; SECTOR as usize];
        mem.read_slice(&mut back, GuestAddress(buf + 2 * MIB))
            .unwrap();
        assert_eq!(back, want, "sector {sector} after the restore");
    }
}

#[test]
fn a_base_under_a_read_only_disk_or_missing_is_refused() {
    let dir = TempDir::new("blk-base-bad");
    let img = dir.path().join("a.img");
    make_base_image(&img, 8);
    let (mut cfg, _) = config(1, 256);
    let disk = |read_only, base: &Path| DiskConfig {
        path: img.clone(),
        read_only,
        id: "d".into(),
        base: Some(base.to_path_buf()),
    };
    cfg.disks = vec![disk(true, &img)];
    assert!(matches!(
        cfg.validate(),
        Err(vmm::config::ConfigError::ReadOnlyBase(_))
    ));
    cfg.disks = vec![disk(false, &dir.path().join("missing"))];
    assert!(matches!(
        cfg.validate(),
        Err(vmm::config::ConfigError::DiskMissing(_))
    ));
}
