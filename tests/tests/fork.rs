//! Fork(n) of a running test guest under real KVM: children start where the
//! parent was, and nothing one writes afterwards (RAM or disk) is seen by the
//! parent, a sibling or an ancestor.

use std::os::unix::fs::FileExt;

use guest_abi::layout::{MIB, TESTGUEST_SCRATCH};
use guest_abi::mailbox as mb;
use sprout_tests::{boot, call, config, pattern_checksum, TempDir};
use vm_memory::{Bytes, GuestAddress};
use vmm::{DiskConfig, ForkOptions, ShellPool, Vm};

const BIG: u64 = 4096; // 16 MiB
const A: u64 = TESTGUEST_SCRATCH; // the parent's pattern
const B: u64 = TESTGUEST_SCRATCH + 32 * MIB; // each child's own pattern
const BUF: u64 = TESTGUEST_SCRATCH + 64 * MIB;

fn sector(tag: u64) -> Vec<u8> {
    (0..512u64).map(|i| (tag * 31 + i) as u8).collect()
}

fn write_sector(vm: &Vm, lba: u64, data: &[u8]) {
    vm.memory().write_slice(data, GuestAddress(BUF)).unwrap();
    call(vm, 0, mb::CMD_BLK_WRITE, [0, lba, BUF, 1]);
}

fn read_sector(vm: &Vm, lba: u64) -> Vec<u8> {
    call(vm, 0, mb::CMD_BLK_READ, [0, lba, BUF + MIB, 1]);
    let mut v = vec![0u8; 512];
    vm.memory()
        .read_slice(&mut v, GuestAddress(BUF + MIB))
        .unwrap();
    v
}

#[test]
fn eight_children_each_see_only_their_own_writes() {
    let dir = TempDir::new("fork8");
    let disk = dir.path().join("disk.img");
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    let (mut cfg, console) = config(1, 256);
    cfg.disks = vec![DiskConfig {
        path: disk.clone(),
        read_only: false,
        id: "d".into(),
        base: None,
    }];
    let mut parent = boot(cfg, &console);
    call(&parent, 0, mb::CMD_FILL, [A, BIG, 1, 0]);
    write_sector(&parent, 10, &sector(1000));

    let pool = ShellPool::new(1, 256);
    pool.fill(8).unwrap();
    let children = parent
        .fork(8, &ForkOptions::new(dir.path()), Some(&pool))
        .unwrap();
    assert_eq!(children.len(), 8);
    let ids: std::collections::HashSet<u64> = children.iter().map(|c| c.instance_id()).collect();
    assert_eq!(ids.len(), 8, "instance ids are distinct");
    assert!(!ids.contains(&parent.instance_id()));

    // Each child writes its own id (given by the host) to RAM and disk.
    for (i, c) in children.iter().enumerate() {
        let id = 100 + i as u64;
        call(c, 0, mb::CMD_FILL, [B, 256, id, 0]);
        write_sector(c, 20, &sector(id));
    }
    // The parent writes after the fork too.
    call(&parent, 0, mb::CMD_FILL, [B, 256, 7, 0]);
    write_sector(&parent, 10, &sector(2000));

    for (i, c) in children.iter().enumerate() {
        let id = 100 + i as u64;
        assert_eq!(
            call(c, 0, mb::CMD_CHECKSUM, [B, 256, 0, 0]).rets[0],
            pattern_checksum(id, B, 256)
        );
        assert_eq!(read_sector(c, 20), sector(id), "child {i} disk");
        // The parent's pre-fork state, not its later writes.
        assert_eq!(
            call(c, 0, mb::CMD_CHECKSUM, [A, BIG, 0, 0]).rets[0],
            pattern_checksum(1, A, BIG)
        );
        assert_eq!(
            read_sector(c, 10),
            sector(1000),
            "child {i} sees the parent's later write"
        );
    }
    // The parent saw none of the children's writes.
    assert_eq!(
        call(&parent, 0, mb::CMD_CHECKSUM, [A, BIG, 0, 0]).rets[0],
        pattern_checksum(1, A, BIG)
    );
    assert_eq!(
        call(&parent, 0, mb::CMD_CHECKSUM, [B, 256, 0, 0]).rets[0],
        pattern_checksum(7, B, 256)
    );
    assert_eq!(read_sector(&parent, 20), vec![0u8; 512]);
    let mut f = vec![0u8; 512];
    std::fs::File::open(&disk)
        .unwrap()
        .read_exact_at(&mut f, 20 * 512)
        .unwrap();
    assert_eq!(f, vec![0u8; 512], "a child wrote the parent's disk file");
    std::fs::File::open(&disk)
        .unwrap()
        .read_exact_at(&mut f, 10 * 512)
        .unwrap();
    assert_eq!(f, sector(2000));
}

#[test]
fn a_grandchild_sees_writes_before_its_fork_and_none_after() {
    let dir = TempDir::new("fork-gc");
    let (cfg, console) = config(1, 256);
    let mut parent = boot(cfg, &console);
    call(&parent, 0, mb::CMD_FILL, [A, 64, 1, 0]);
    let opts = ForkOptions::new(dir.path());
    let mut child = parent.fork(1, &opts, None).unwrap().pop().unwrap();
    call(&child, 0, mb::CMD_FILL, [B, 64, 5, 0]);
    call(&child, 0, mb::CMD_COUNT, [3, 0, 0, 0]);
    let grandchild = child.fork(1, &opts, None).unwrap().pop().unwrap();
    call(&child, 0, mb::CMD_FILL, [B, 64, 6, 0]);
    call(&parent, 0, mb::CMD_FILL, [A, 64, 2, 0]);
    assert_eq!(
        call(&grandchild, 0, mb::CMD_CHECKSUM, [B, 64, 0, 0]).rets[0],
        pattern_checksum(5, B, 64)
    );
    assert_eq!(
        call(&grandchild, 0, mb::CMD_CHECKSUM, [A, 64, 0, 0]).rets[0],
        pattern_checksum(1, A, 64)
    );
    assert_eq!(call(&grandchild, 0, mb::CMD_COUNT, [1, 0, 0, 0]).rets[0], 4);
    assert_eq!(
        call(&child, 0, mb::CMD_CHECKSUM, [B, 64, 0, 0]).rets[0],
        pattern_checksum(6, B, 64)
    );
    // A user diff snapshot on an ephemeral fork layer is refused clearly.
    let e = child
        .snapshot(&dir.path().join("s"), vmm::SnapshotKind::Diff)
        .unwrap_err();
    assert!(e.to_string().contains("fork layer"), "{e}");
    child
        .snapshot(&dir.path().join("s"), vmm::SnapshotKind::Full)
        .unwrap();
}

#[test]
fn children_outlive_their_parent_and_leave_no_files() {
    let dir = TempDir::new("fork-orphan");
    let (cfg, console) = config(1, 256);
    let mut parent = boot(cfg, &console);
    call(&parent, 0, mb::CMD_FILL, [A, 64, 3, 0]);
    let children = parent.fork(3, &ForkOptions::new(dir.path()), None).unwrap();
    drop(parent);
    for c in &children {
        assert_eq!(
            call(c, 0, mb::CMD_CHECKSUM, [A, 64, 0, 0]).rets[0],
            pattern_checksum(3, A, 64)
        );
        call(c, 0, mb::CMD_FILL, [B, 16, 1, 0]);
    }
    drop(children);
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}
