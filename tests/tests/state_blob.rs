//! The VM state blob (`state.bin`): a real snapshot's blob decodes and
//! re-encodes to the same bytes, and a committed golden blob still decodes with
//! this build's types, so a state type cannot change shape without a version
//! bump.
//!
//! Re-bless the golden blob (after bumping `devices::state::versions`) with
//! `SPROUT_BLESS=1 cargo test -p sprout-tests --test state_blob`, and commit it.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use devices::virtio::block::ImageIdentity;
use guest_abi::layout::TESTGUEST_SCRATCH;
use guest_abi::mailbox as mb;
use sprout_tests::{boot, call, config, host_connect, TempDir};
use vmm::vm_state::{DevState, DiskImage};
use vmm::{DiskConfig, SnapshotKind, StateBlobError, VmState, VsockConfig, STATE_VERSION};

/// The read-only image of [`snapshot_state`]'s VM: 128 KiB of a fixed
/// pattern, so its identity is the same on every machine.
fn image_bytes() -> Vec<u8> {
    (0..128u32 << 10).map(|i| (i * 7 % 251) as u8).collect()
}

/// Boots a test guest with a writable disk, a read-only image, vsock and
/// rng, uses each device, snapshots it and returns its `state.bin`.
fn snapshot_state(dir: &TempDir, vcpus: u8) -> Vec<u8> {
    let disk = dir.path().join("disk.img");
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let image = dir.path().join("image.img");
    std::fs::write(&image, image_bytes()).unwrap();
    let uds = dir.path().join("vm.vsock");
    let (mut cfg, console) = config(vcpus, 128);
    cfg.disks = vec![
        DiskConfig {
            path: disk,
            read_only: false,
            id: "data".into(),
            base: None,
        },
        DiskConfig {
            path: image,
            read_only: true,
            id: "image".into(),
            base: None,
        },
    ];
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
    assert_eq!(st.spec.disks.len(), 2);
    assert_eq!(st.spec.disks[0].id, "data");
    assert!(!st.spec.disks[0].read_only);
    assert!(st.spec.disks[1].read_only);
    // The image's identity, as the device read it when it opened it.
    let identity = ImageIdentity {
        size: 128 << 10,
        head: xxhash_rust::xxh3::xxh3_128(&image_bytes()[..64 << 10]),
    };
    assert_eq!(st.images, [DiskImage { disk: 1, identity }]);
    assert_eq!(st.spec.vsock.as_ref().map(|v| v.guest_cid), Some(9));
    assert!(st.spec.rng);
    let kinds: Vec<_> = st.virtio.iter().map(|s| s.dev.kind()).collect();
    assert_eq!(
        kinds,
        ["virtio-blk", "virtio-blk", "virtio-vsock", "virtio-rng"]
    );
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
    match &st.virtio[2].dev {
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
    st.spec.disks[1].path = "image.img".into();
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

/// A version 2 blob (before images were recorded, `golden/state-v2.bin`)
/// still decodes: as this version's with no image recorded, so its restores
/// check none. Its bytes are this version's without the trailing empty list.
#[test]
fn a_version_2_blob_reads_back_with_no_images() {
    let old =
        std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("golden/state-v2.bin")).unwrap();
    assert_eq!(VmState::version_of(&old).unwrap(), 2);
    let st = VmState::decode(&old).unwrap();
    assert!(st.images.is_empty());
    assert_eq!(st.spec.disks.len(), 1);
    let now = st.encode().unwrap();
    assert_eq!(now[0], STATE_VERSION as u8);
    assert!(now[1..now.len() - 1] == old[1..] && now[now.len() - 1] == 0);
    // Version 1 (never written by a release that recorded anything else) is not read.
    let mut v1 = old.clone();
    v1[0] = 1;
    assert!(matches!(
        VmState::decode(&v1),
        Err(StateBlobError::Version { found: 1 })
    ));
}

/// A recorded image must be of a read-only disk of the spec, and recorded once.
#[test]
fn an_image_recorded_for_a_writable_or_missing_disk_is_refused() {
    let golden = std::fs::read(golden_path()).unwrap();
    let st = VmState::decode(&golden).unwrap();
    let identity = st.images[0].identity;
    for (bad, disk) in [(0usize, 0usize), (5, 5), (1, 1)] {
        let mut st = VmState::decode(&golden).unwrap();
        if bad == 1 {
            // Twice.
            st.images.push(DiskImage { disk, identity });
        } else {
            st.images = vec![DiskImage { disk, identity }];
        }
        let blob = st.encode().unwrap();
        assert!(
            matches!(VmState::decode(&blob), Err(StateBlobError::ImageOfNoImage(d)) if d == disk),
            "disk {disk}"
        );
    }
}
