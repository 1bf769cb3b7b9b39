//! The VM state blob (`state.bin`): a real snapshot's blob decodes and
//! re-encodes to the same bytes, and a committed golden blob still decodes with
//! this build's types, so a state type cannot change shape without a version
//! bump.
//!
//! Re-bless the golden blob (after bumping `devices::state::versions`) with
//! `SPROUT_BLESS=1 cargo test -p sprout-tests --test state_blob`, and commit it.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use guest_abi::layout::TESTGUEST_SCRATCH;
use guest_abi::mailbox as mb;
use sprout_tests::{boot, call, config, host_connect, TempDir};
use vmm::vm_state::DevState;
use vmm::{DiskConfig, SnapshotKind, VmState, VsockConfig, STATE_VERSION};

/// Boots a test guest with a writable disk, vsock and rng, uses each device,
/// snapshots it and returns its `state.bin`.
fn snapshot_state(dir: &TempDir, vcpus: u8) -> Vec<u8> {
    let disk = dir.path().join("disk.img");
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let uds = dir.path().join("vm.vsock");
    let (mut cfg, console) = config(vcpus, 128);
    cfg.disks = vec![DiskConfig {
        path: disk,
        read_only: false,
        id: "data".into(),
        base: None,
    }];
    cfg.vsock = Some(VsockConfig {
        guest_cid: 9,
        uds_path: uds.clone(),
    });
    cfg.rng = true;
    let mut vm = boot(cfg, &console);
    let buf = TESTGUEST_SCRATCH;
    call(&vm, 0, mb::CMD_BLK_WRITE, [0, 3, buf, 1]);
    call(&vm, 0, mb::CMD_RNG_READ, [buf, 64, 0, 0]);
    let mut c = host_connect(&uds, mb::VSOCK_ECHO_PORT);
    c.write_all(b"ping").unwrap();
    let mut got = [0u8; 4];
    c.read_exact(&mut got).unwrap();
    let snap = dir.path().join("snap");
    vm.snapshot(&snap, SnapshotKind::Full).unwrap();
    std::fs::read(snap.join("state.bin")).unwrap()
}

/// The fields every blob of this test's VM has.
fn check_fields(st: &VmState, vcpus: u8) {
    assert_eq!(st.version, STATE_VERSION);
    assert_eq!(st.spec.vcpus, vcpus);
    assert_eq!(st.spec.mem_mib, 128);
    assert_eq!(st.vcpus.len(), usize::from(vcpus));
    assert_eq!(st.entry, vmm::vm::EntryKind::Direct);
    assert_eq!(st.spec.disks.len(), 1);
    assert_eq!(st.spec.disks[0].id, "data");
    assert!(!st.spec.disks[0].read_only);
    assert_eq!(st.spec.vsock.as_ref().map(|v| v.guest_cid), Some(9));
    assert!(st.spec.rng);
    let kinds: Vec<_> = st.virtio.iter().map(|s| s.dev.kind()).collect();
    assert_eq!(kinds, ["virtio-blk", "virtio-vsock", "virtio-rng"]);
    for s in &st.virtio {
        assert!(s.transport.device_activated, "{} not active", s.dev.kind());
    }
    match &st.virtio[0].dev {
        DevState::Block { disk, state } => {
            assert_eq!(*disk, 0);
            assert_eq!(state.capacity_bytes, 1 << 20);
        }
        _ => unreachable!(),
    }
    match &st.virtio[1].dev {
        DevState::Vsock(v) => assert_eq!(v.guest_cid, 9),
        _ => unreachable!(),
    }
    assert_eq!(st.mailbox_ready, (1u8 << vcpus) - 1);
}

#[test]
fn the_whole_vm_state_round_trips_byte_for_byte() {
    let dir = TempDir::new("state-rt");
    let blob = snapshot_state(&dir, 2);
    let st = VmState::decode(&blob).unwrap();
    check_fields(&st, 2);
    assert!(
        st.encode().unwrap() == blob,
        "the VM state does not re-encode to the same bytes"
    );
}

fn golden_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("golden/state.bin")
}

/// A blob for the golden file: a real snapshot's, with this machine's paths
/// replaced by fixed ones.
fn bless(path: &Path) {
    let dir = TempDir::new("state-bless");
    let mut st = VmState::decode(&snapshot_state(&dir, 1)).unwrap();
    st.spec.kernel = "testguest".into();
    st.spec.disks[0].path = "disk.img".into();
    if let Some(v) = st.spec.vsock.as_mut() {
        v.uds_path = "vm.vsock".into();
    }
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, st.encode().unwrap()).unwrap();
}

#[test]
fn the_golden_state_blob_decodes_with_this_builds_types() {
    let path = golden_path();
    if std::env::var_os("SPROUT_BLESS").is_some_and(|v| v == "1") {
        bless(&path);
    }
    let golden = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; create it with SPROUT_BLESS=1 cargo test -p sprout-tests --test state_blob",
            path.display()
        )
    });
    let version = VmState::version_of(&golden).unwrap();
    assert_eq!(
        version, STATE_VERSION,
        "the golden state blob is version {version}, this build writes {STATE_VERSION}: \
         re-bless it (SPROUT_BLESS=1 cargo test -p sprout-tests --test state_blob) and commit it"
    );
    let changed = "a state type changed shape but the state version did not: bump it (and the \
                   device's) in devices::state::versions, then re-bless the golden blob";
    let st = VmState::decode(&golden).unwrap_or_else(|e| panic!("{changed}: {e}"));
    assert!(st.encode().unwrap() == golden, "{changed}");
    check_fields(&st, 1);
    assert_eq!(st.spec.kernel, Path::new("testguest"));
    assert_eq!(st.spec.disks[0].path, Path::new("disk.img"));
}
