//! Fork across worker processes, under real KVM with the test guest: every
//! child is its own process restored from the parent's fork layer into a
//! ready worker; children and parent live and die independently; fork layers
//! are removed once their last user is gone.

use std::path::{Path, PathBuf};
use std::time::Duration;

use guest_abi::layout::{MIB, TESTGUEST_SCRATCH};
use guest_abi::mailbox as mb;
use sprout_tests::{pattern_checksum, require_kvm, testguest, TempDir};
use sprout_worker::protocol::{Backend, BootSpec, RestoreSpec, Shape, WorkerState};
use sprout_worker::{Client, ErrorCode, ReadyPool, WorkerCommand, WorkerProcess};

const A: u64 = TESTGUEST_SCRATCH;
const B: u64 = TESTGUEST_SCRATCH + 32 * MIB;
const T: Duration = Duration::from_secs(60);
const SHAPE: Shape = Shape {
    vcpus: 1,
    mem_mib: 256,
};

fn cmd() -> WorkerCommand {
    WorkerCommand::new(env!("CARGO_BIN_EXE_sprout-worker"))
}

fn spec() -> vmm::config::VmSpec {
    let mut c = vmm::VmConfig::new(testguest());
    c.vcpus = SHAPE.vcpus;
    c.mem_mib = SHAPE.mem_mib;
    c.spec()
}

/// A worker booted with the test guest, answering its mailbox.
fn boot_parent(dir: &Path) -> WorkerProcess {
    require_kvm();
    let mut w = cmd()
        .spawn(
            &dir.join("parent.sock"),
            None,
            Some(&dir.join("parent.console")),
        )
        .expect("worker starts");
    w.client
        .call(&sprout_worker::Request::Boot(BootSpec {
            spec: spec(),
            instance_id: Some(0x1234),
        }))
        .expect("boot");
    w
}

fn call(c: &mut Client, cmd: u32, args: [u64; 4]) -> [u64; 4] {
    let (status, rets) = c.mailbox(0, cmd, args, T).expect("mailbox call");
    assert_eq!(status, 0, "mailbox status for command {cmd}");
    rets
}

fn fork_spec(dir: &Path) -> RestoreSpec {
    RestoreSpec {
        dir: dir.to_owned(),
        backend: Backend::Mmap,
        vsock_uds: None,
        instance_id: None,
        prefetch: false,
        net: None,
    }
}

/// Fork step 1 on `parent`, step 2 on `n` ready workers of `pool`, in parallel.
fn fork(parent: &mut Client, pool: &mut ReadyPool, n: usize, scratch: &Path) -> Vec<WorkerProcess> {
    let layer = parent.write_fork_layer(scratch).expect("fork layer");
    // Sealed by its writer: the children do not hash it again.
    let seal = std::fs::read_to_string(layer.dir.join(".sealed")).expect("a sealed fork layer");
    assert!(seal.lines().count() >= 1, "{seal}");
    let kids: Vec<WorkerProcess> = (0..n).map(|_| pool.take().expect("ready worker")).collect();
    std::thread::scope(|s| {
        let hs: Vec<_> = kids
            .into_iter()
            .map(|mut k| {
                let spec = fork_spec(&layer.dir);
                s.spawn(move || {
                    k.client.restore_fork_layer(spec).expect("child restores");
                    k
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn layers_in(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("sprout-layer-") || n.starts_with(".gone-"))
        })
        .collect()
}

/// Waits (bounded) until `f` holds.
fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t = std::time::Instant::now();
    while !f() {
        assert!(t.elapsed() < T, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn fork_four_across_processes_that_live_and_die_apart() {
    let dir = TempDir::new("xfork");
    let scratch = dir.path().join("layers");
    std::fs::create_dir(&scratch).unwrap();
    let mut parent = boot_parent(dir.path());
    call(&mut parent.client, mb::CMD_FILL, [A, 64, 1, 0]);
    let mut pool = ReadyPool::new(cmd(), dir.path(), SHAPE);
    pool.fill(5).expect("ready workers");

    let mut kids = fork(&mut parent.client, &mut pool, 4, &scratch);
    let parent_pid = parent.pid();
    let pids: std::collections::HashSet<u32> = kids.iter().map(|k| k.pid()).collect();
    assert_eq!(pids.len(), 4);
    assert!(!pids.contains(&parent_pid));
    let mut ids = std::collections::HashSet::new();
    for k in &mut kids {
        let d = k.client.describe().unwrap();
        assert_eq!(d.pid, k.pid(), "the child answers from its own process");
        assert_eq!(d.state, WorkerState::Running);
        assert!(ids.insert(d.instance_id.unwrap()), "instance ids differ");
        assert_ne!(d.instance_id, Some(0x1234));
        assert_eq!(d.lineage.fork_layers.len(), 1, "{d:?}");
    }
    // Each child has the parent's memory, then diverges.
    for (i, k) in kids.iter_mut().enumerate() {
        let r = call(&mut k.client, mb::CMD_CHECKSUM, [A, 64, 0, 0]);
        assert_eq!(r[0], pattern_checksum(1, A, 64), "child {i}");
        call(&mut k.client, mb::CMD_FILL, [B, 16, 100 + i as u64, 0]);
    }
    call(&mut parent.client, mb::CMD_FILL, [B, 16, 7, 0]);
    for (i, k) in kids.iter_mut().enumerate() {
        let r = call(&mut k.client, mb::CMD_CHECKSUM, [B, 16, 0, 0]);
        assert_eq!(r[0], pattern_checksum(100 + i as u64, B, 16), "child {i}");
    }
    let r = call(&mut parent.client, mb::CMD_CHECKSUM, [B, 16, 0, 0]);
    assert_eq!(r[0], pattern_checksum(7, B, 16));

    // kill -9 of one child: the parent and its siblings run on.
    let mut dead = kids.remove(0);
    dead.child.kill().unwrap();
    dead.child.wait().unwrap();
    call(&mut parent.client, mb::CMD_CHECKSUM, [A, 64, 0, 0]);
    for k in &mut kids {
        call(&mut k.client, mb::CMD_CHECKSUM, [A, 64, 0, 0]);
    }

    // A fork of a fork: the grandchild has its parent's writes.
    let mut gkids = fork(&mut kids[0].client, &mut pool, 1, &scratch);
    let r = call(&mut gkids[0].client, mb::CMD_CHECKSUM, [B, 16, 0, 0]);
    assert_eq!(r[0], pattern_checksum(101, B, 16));
    let r = call(&mut gkids[0].client, mb::CMD_CHECKSUM, [A, 64, 0, 0]);
    assert_eq!(r[0], pattern_checksum(1, A, 64));
    let d = gkids[0].client.describe().unwrap();
    assert_eq!(d.lineage.depth, 2, "a diff on the child's layer: {d:?}");

    // kill -9 of the parent: the children run on.
    parent.child.kill().unwrap();
    parent.child.wait().unwrap();
    for k in kids.iter_mut().chain(gkids.iter_mut()) {
        call(&mut k.client, mb::CMD_CHECKSUM, [A, 64, 0, 0]);
    }
    assert!(!layers_in(&scratch).is_empty());

    // Once every user is gone, no layer is left behind. The killed ones held
    // leases too: the kernel let go of theirs, and the last clean exit
    // removes each layer (a layer whose last user was killed is for
    // `vmm::lease::sweep`, tested in vmm).
    for mut k in kids.into_iter().chain(gkids) {
        k.client.stop().unwrap();
        k.child.wait().unwrap();
        assert!(!k.socket.exists(), "a stopped worker removes its socket");
    }
    assert!(
        layers_in(&scratch).is_empty(),
        "left behind: {:?}",
        layers_in(&scratch)
    );
}

#[test]
fn last_clean_user_removes_the_layer() {
    let dir = TempDir::new("xfork-clean");
    let scratch = dir.path().join("layers");
    std::fs::create_dir(&scratch).unwrap();
    let mut parent = boot_parent(dir.path());
    let mut pool = ReadyPool::new(cmd(), dir.path(), SHAPE);
    let kids = fork(&mut parent.client, &mut pool, 2, &scratch);
    assert_eq!(layers_in(&scratch).len(), 1);
    parent.client.stop().unwrap();
    parent.child.wait().unwrap();
    assert_eq!(layers_in(&scratch).len(), 1, "the children still hold it");
    for mut k in kids {
        k.client.stop().unwrap();
        k.child.wait().unwrap();
    }
    assert!(layers_in(&scratch).is_empty());
}

#[test]
fn a_worker_exits_with_its_vm() {
    let dir = TempDir::new("xfork-exit");
    let mut parent = boot_parent(dir.path());
    // The guest resets the machine: the worker ends, cleanly, and says so.
    let _ = parent.client.mailbox(0, mb::CMD_RESET, [0; 4], T);
    let status = parent.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    wait_until("the socket to go", || !parent.socket.exists());
}

#[test]
fn bad_restores_are_typed_errors_and_leave_the_worker_usable() {
    let dir = TempDir::new("xfork-bad");
    require_kvm();
    let mut pool = ReadyPool::new(cmd(), dir.path(), SHAPE);
    let mut w = pool.take().unwrap();
    let e = w
        .client
        .restore_fork_layer(fork_spec(&dir.path().join("nope")))
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::BadSnapshot), "{e}");
    // Its shell is spent, but it can still restore (and describe says so).
    assert_eq!(w.client.describe().unwrap().state, WorkerState::Empty);
    let e = w.client.write_fork_layer(dir.path()).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NoVm));
    w.client.stop().unwrap();
    w.child.wait().unwrap();
}

/// A ready worker (its shell built) boots a VM into that shell; one of
/// another shape drops its shell and boots the VM anew. Both run.
#[test]
fn a_ready_worker_boots_into_its_shell_or_anew() {
    require_kvm();
    let dir = TempDir::new("ready-boot");
    for (name, shape) in [
        ("same", SHAPE),
        (
            "other",
            Shape {
                vcpus: 2,
                mem_mib: 128,
            },
        ),
    ] {
        let mut w = cmd()
            .spawn(&dir.path().join(format!("{name}.sock")), Some(shape), None)
            .expect("ready worker starts");
        assert_eq!(w.client.describe().unwrap().state, WorkerState::Ready);
        w.client
            .call(&sprout_worker::Request::Boot(BootSpec {
                spec: spec(),
                instance_id: Some(0x77),
            }))
            .unwrap_or_else(|e| panic!("{name}: boot: {e}"));
        let d = w.client.describe().unwrap();
        assert_eq!(d.state, WorkerState::Running, "{name}");
        assert_eq!(d.instance_id, Some(0x77));
        let (status, rets) = w
            .client
            .mailbox(0, mb::CMD_ECHO, [0xb007, 0, 0, 0], T)
            .expect("the booted guest answers");
        assert_eq!((status, rets[0]), (0, 0xb007), "{name}");
        w.client.stop().unwrap();
        w.wait().unwrap();
    }
}

/// A full fork layer lets the parent's old chain go, and the worker removes
/// those layers (nobody else holds them) after it has answered, not before.
#[test]
fn a_full_fork_layer_lets_the_old_chain_go_after_its_answer() {
    let dir = TempDir::new("xfork-compact");
    let scratch = dir.path().join("layers");
    std::fs::create_dir(&scratch).unwrap();
    let mut parent = boot_parent(dir.path());
    let mut first = None;
    for i in 0..vmm::MAX_CHAIN_DEPTH {
        let l = parent
            .client
            .write_fork_layer(&scratch)
            .expect("fork layer");
        assert_eq!((l.depth, l.diff), (i + 1, i > 0), "layer {i}");
        first.get_or_insert(l.dir);
    }
    assert_eq!(layers_in(&scratch).len(), vmm::MAX_CHAIN_DEPTH);
    let full = parent
        .client
        .write_fork_layer(&scratch)
        .expect("fork layer");
    assert_eq!((full.depth, full.diff), (1, false));
    wait_until("the old chain to be removed", || {
        layers_in(&scratch) == vec![full.dir.clone()]
    });
    assert!(!first.unwrap().exists());
    // The parent runs on, and its next layer is a diff on the full one.
    call(&mut parent.client, mb::CMD_COUNT, [1, 0, 0, 0]);
    let next = parent
        .client
        .write_fork_layer(&scratch)
        .expect("fork layer");
    assert_eq!((next.depth, next.diff), (2, true));
    parent.client.stop().expect("stop");
    parent.child.wait().expect("parent exits");
    wait_until("every layer to go", || layers_in(&scratch).is_empty());
}
