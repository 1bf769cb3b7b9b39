//! Writes the seed corpora of the `worker_frame`, `state_blob`, `manifest`,
//! `layer_map` and `mmio_transport` targets: a few valid inputs each, small.
//!
//!   cd fuzz && cargo run --example seeds
//!
//! Re-run it (and commit the result) when a format changes.

use std::fs;
use std::path::{Path, PathBuf};

use snapshot::format::fuzzing::encode_manifest;
use snapshot::format::{
    DiskLayerEntry, FileEntry, KernelIdentity, Manifest, MemoryLayerEntry, MemoryLayerKind,
    ParentRef, Shape, SnapshotId, FORMAT_VERSION,
};
use snapshot::Checksum;
use sprout_worker::protocol::{
    encode, Backend, BootSpec, Description, ErrorCode, ForkLayerInfo, GuestKind, LineageInfo,
    Metrics, Request, Response, RestoreSpec, Shape as WorkerShape, WorkerError, WorkerState,
    PROTOCOL_VERSION,
};
use vmm::config::VmSpec;
use vmm::{DiskConfig, VmState, VsockConfig, STATE_VERSION};

fn corpus(target: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn spec() -> VmSpec {
    VmSpec {
        kernel: "vmlinux".into(),
        cmdline: "console=ttyS0".into(),
        vcpus: 2,
        mem_mib: 128,
        disks: vec![
            DiskConfig {
                path: "disk.img".into(),
                read_only: true,
                id: "root".into(),
                base: None,
            },
            DiskConfig {
                path: "top.img".into(),
                read_only: false,
                id: "disk".into(),
                base: Some("template.img".into()),
            },
        ],
        vsock: Some(VsockConfig {
            guest_cid: 3,
            uds_path: "v.sock".into(),
        }),
        rng: true,
        net: None,
    }
}

fn worker_frame() {
    let dir = corpus("worker_frame");
    let restore = RestoreSpec {
        dir: "snap".into(),
        backend: Backend::Uffd,
        vsock_uds: Some("v.sock".into()),
        instance_id: Some(7),
        prefetch: true,
        net: None,
    };
    let requests = [
        ("describe", Request::Describe),
        (
            "boot",
            Request::Boot(BootSpec {
                spec: spec(),
                instance_id: Some(1),
            }),
        ),
        ("restore", Request::Restore(restore.clone())),
        (
            "restore-over",
            Request::RestoreOver {
                spec: restore.clone(),
                images: [(0, "image.ext4".into())].into(),
            },
        ),
        (
            "snapshot",
            Request::Snapshot {
                dir: "s".into(),
                diff: true,
            },
        ),
        (
            "write-fork-layer",
            Request::WriteForkLayer {
                scratch_dir: "f".into(),
            },
        ),
        ("restore-fork-layer", Request::RestoreForkLayer(restore)),
        (
            "mailbox",
            Request::Mailbox {
                cpu: 1,
                cmd: 2,
                args: [3, 4, 5, u64::MAX],
                timeout_ms: 100,
            },
        ),
    ];
    let mut all = vec![0u8];
    for (name, r) in &requests {
        let f = encode(r).unwrap();
        all.extend_from_slice(&f);
        fs::write(dir.join(format!("req-{name}")), [&[0u8][..], &f].concat()).unwrap();
    }
    for r in [
        Request::Pause,
        Request::Resume,
        Request::Metrics,
        Request::Stop,
    ] {
        all.extend_from_slice(&encode(&r).unwrap());
    }
    fs::write(dir.join("req-stream"), &all).unwrap();

    let responses = [
        ("ok", Response::Ok),
        (
            "description",
            Response::Description(Box::new(Description {
                protocol: PROTOCOL_VERSION,
                pid: 42,
                started_at_ms: 1,
                socket: "w.sock".into(),
                state: WorkerState::Exited("halt".into()),
                shape: Some(WorkerShape {
                    vcpus: 1,
                    mem_mib: 64,
                }),
                instance_id: Some(9),
                guest: Some(GuestKind::Linux),
                config: Some(spec()),
                lineage: LineageInfo {
                    parent: Some("p".into()),
                    depth: 2,
                    fork_layers: vec!["l".into()],
                },
                vsock_uds: None,
            })),
        ),
        (
            "fork-layer",
            Response::ForkLayer(ForkLayerInfo {
                dir: "l".into(),
                diff: false,
                depth: 1,
                pause_us: 300,
            }),
        ),
        (
            "metrics",
            Response::Metrics(Metrics {
                rss_kib: 1,
                uffd_faults: Some(5),
                ..Metrics::default()
            }),
        ),
        (
            "mailbox",
            Response::Mailbox {
                status: 0,
                rets: [1, 2, 3, 4],
            },
        ),
        (
            "error",
            Response::Error(WorkerError::new(ErrorCode::InvalidState, "paused")),
        ),
    ];
    let mut all = vec![1u8];
    for (name, r) in &responses {
        let f = encode(r).unwrap();
        all.extend_from_slice(&f);
        fs::write(dir.join(format!("resp-{name}")), [&[1u8][..], &f].concat()).unwrap();
    }
    fs::write(dir.join("resp-stream"), &all).unwrap();
    // A header announcing more than MAX_FRAME.
    let mut huge = encode(&Request::Describe).unwrap();
    huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    fs::write(dir.join("req-too-large"), [&[0u8][..], &huge].concat()).unwrap();
}

fn state_blob() {
    let dir = corpus("state_blob");
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/golden/state.bin");
    let golden = fs::read(golden).unwrap();
    // The version 2 blob this build still reads.
    let v2 = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/golden/state-v2.bin");
    fs::write(dir.join("golden-v2"), fs::read(v2).unwrap()).unwrap();
    // The golden blob: one vCPU, virtio-blk, vsock and rng.
    fs::write(dir.join("golden"), &golden).unwrap();
    let mut st = VmState::decode(&golden).unwrap();
    st.vcpus.clear();
    fs::write(dir.join("no-vcpus"), st.encode().unwrap()).unwrap();
    st.virtio.truncate(1);
    fs::write(dir.join("no-vcpus-blk-only"), st.encode().unwrap()).unwrap();
    st.virtio.clear();
    fs::write(dir.join("no-vcpus-no-virtio"), st.encode().unwrap()).unwrap();
    st.version = STATE_VERSION + 1;
    fs::write(dir.join("other-version"), st.encode().unwrap()).unwrap();
}

fn manifest() {
    let dir = corpus("manifest");
    let file = |name: &str| FileEntry {
        name: name.into(),
        size: 4096,
        checksum: Checksum(0x0123_4567_89ab_cdef),
    };
    let mut m = Manifest {
        format_version: FORMAT_VERSION,
        id: SnapshotId(0xfeed),
        created_unix_ms: 1_700_000_000_000,
        shape: Shape {
            vcpus: 1,
            mem_bytes: 1 << 20,
        },
        kernel: KernelIdentity {
            path: "/boot/vmlinux".into(),
            size: 10,
            checksum: Checksum(3),
        },
        parent: None,
        state: file("state.bin"),
        memory_layers: vec![MemoryLayerEntry {
            kind: MemoryLayerKind::Full,
            pages_present: 256,
            data_pages: 1,
            data: file("mem"),
            page_map: file("mem.map"),
        }],
        disk_layers: vec![],
        files: vec![],
        manifest_checksum: Checksum(0),
    };
    // Mode byte 0: checked as is; 1: the harness seals it (same bytes here).
    let put = |name: &str, m: &Manifest| {
        let b = encode_manifest(m);
        fs::write(dir.join(name), [&[0u8][..], &b].concat()).unwrap();
    };
    put("full", &m);
    m.parent = Some(ParentRef {
        id: SnapshotId(1),
        path: "../base".into(),
    });
    m.memory_layers[0].kind = MemoryLayerKind::Diff;
    m.disk_layers = vec![DiskLayerEntry {
        name: "disk0".into(),
        files: vec![file("disk0.data"), file("disk0.map")],
    }];
    m.files = vec![file("extra")];
    put("diff", &m);
    m.format_version = FORMAT_VERSION + 1;
    put("other-version", &m);
    // Sealed by the harness: an edited field behind a stale checksum.
    m.format_version = FORMAT_VERSION;
    let mut b = encode_manifest(&m);
    let s = String::from_utf8(b)
        .unwrap()
        .replace("\"vcpus\": 1", "\"vcpus\": 0");
    b = s.into_bytes();
    fs::write(dir.join("sealed-zero-vcpus"), [&[1u8][..], &b].concat()).unwrap();
}

fn mmio_transport() {
    let dir = corpus("mmio_transport");
    const READ: u8 = 0;
    const WRITE: u8 = 1;
    const SERVE: u8 = 2;
    let op = |kind: u8, offset: u16, value: u32| {
        let o = offset.to_le_bytes();
        let v = value.to_le_bytes();
        [kind, o[0], o[1], 0, v[0], v[1], v[2], v[3]]
    };
    // virtio-rng bring-up with an 8-entry queue: descriptors at 0x0, available ring
    // at 0x80, used ring at 0x100, one write-only 64-byte buffer at 0x200.
    let bring_up = [
        op(WRITE, 0x070, 0),
        op(WRITE, 0x070, 1),
        op(WRITE, 0x070, 3),
        op(READ, 0x010, 0),
        op(WRITE, 0x014, 1),
        op(READ, 0x010, 0),
        op(WRITE, 0x024, 1),
        op(WRITE, 0x020, 1),
        op(WRITE, 0x070, 0xb),
        op(READ, 0x070, 0),
        op(WRITE, 0x030, 0),
        op(READ, 0x034, 0),
        op(WRITE, 0x038, 8),
        op(WRITE, 0x080, 0),
        op(WRITE, 0x084, 0),
        op(WRITE, 0x090, 0x80),
        op(WRITE, 0x094, 0),
        op(WRITE, 0x0a0, 0x100),
        op(WRITE, 0x0a4, 0),
        op(WRITE, 0x044, 1),
        op(WRITE, 0x070, 0xf),
        op(WRITE, 0x050, 0),
        op(SERVE, 0, 0),
        op(READ, 0x060, 0),
        op(WRITE, 0x064, 1),
        op(READ, 0x100, 0),
    ];
    let mut ram = vec![0u8; 0x98];
    // Descriptor 0: addr 0x200, len 64, flags WRITE.
    ram[0..8].copy_from_slice(&0x200u64.to_le_bytes());
    ram[8..12].copy_from_slice(&64u32.to_le_bytes());
    ram[12..14].copy_from_slice(&2u16.to_le_bytes());
    // Available ring: flags 0, idx 1, ring[0] = 0.
    ram[0x82..0x84].copy_from_slice(&1u16.to_le_bytes());
    let write = |name: &str, ops: &[[u8; 8]], ram: &[u8]| {
        let mut b = vec![ops.len() as u8];
        for o in ops {
            b.extend_from_slice(o);
        }
        b.extend_from_slice(ram);
        fs::write(dir.join(name), b).unwrap();
    };
    write("bring-up-and-serve", &bring_up, &ram);
    // Then a reset and a second bring-up whose queue is out of RAM: activation fails.
    let mut again = bring_up[..16].to_vec();
    again[13] = op(WRITE, 0x080, 0xffff_0000);
    again.extend_from_slice(&[
        op(WRITE, 0x044, 1),
        op(WRITE, 0x070, 0xf),
        op(READ, 0x070, 0),
        op(WRITE, 0x070, 0),
    ]);
    write("bad-queue-then-reset", &again, &ram);
    // FAILED after DRIVER_OK, odd widths and config space.
    let mut failed = bring_up[..21].to_vec();
    failed.extend_from_slice(&[
        op(WRITE, 0x070, 0x80),
        op(WRITE, 0x101, 0),
        [READ, 0x00, 0x01, 3, 0, 0, 0, 0],
        [WRITE, 0x70, 0x00, 1, 0, 0, 0, 0],
    ]);
    write("failed-after-driver-ok", &failed, &ram);
}

/// Disk layer maps: runs (a few, none), a bitmap (too many runs to be
/// shorter), each for the disk size its header states.
fn layer_map() {
    use devices::virtio::block::encode_layer_map;
    let dir = corpus("layer_map");
    let small = 100 * 4096 + 512;
    let every_other: Vec<(u64, u64)> = (0..101).step_by(2).map(|i| (i, i + 1)).collect();
    for (name, runs, disk) in [
        ("runs", vec![(0, 3), (64, 65), (100, 101)], 32 << 20),
        ("empty", vec![], 64 << 20),
        ("bitmap", every_other, small),
        ("full", vec![(0, 101)], small),
    ] {
        fs::write(dir.join(name), encode_layer_map(&runs, disk)).unwrap();
    }
}

fn main() {
    worker_frame();
    state_blob();
    manifest();
    layer_map();
    mmio_transport();
}
