//! A layer file truncated under a running restored VM (mmap backend): the
//! worker holding it does not die silently or hang; it exits with
//! `snapshot::fault::LAYER_FAULT_EXIT` and logs why.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use guest_abi::layout::TESTGUEST_SCRATCH;
use guest_abi::mailbox as mb;
use sprout_tests::{require_kvm, testguest, TempDir};
use sprout_worker::protocol::{Backend, BootSpec, RestoreSpec};
use sprout_worker::{Client, Request, WorkerCommand};

const T: Duration = Duration::from_secs(60);
const PAGES: u64 = 1024;

fn spec() -> vmm::config::VmSpec {
    let mut c = vmm::VmConfig::new(testguest());
    c.mem_mib = 128;
    c.spec()
}

fn call(c: &mut Client, cmd: u32, args: [u64; 4]) -> [u64; 4] {
    let (status, rets) = c.mailbox(0, cmd, args, T).expect("mailbox call");
    assert_eq!(status, 0, "mailbox status for command {cmd}");
    rets
}

/// A snapshot of a booted test guest whose scratch RAM holds a pattern.
fn make_snapshot(dir: &Path) -> std::path::PathBuf {
    let mut w = WorkerCommand::new(env!("CARGO_BIN_EXE_sprout-worker"))
        .spawn(&dir.join("a.sock"), None, None)
        .expect("worker starts");
    w.client
        .call(&Request::Boot(BootSpec {
            spec: spec(),
            instance_id: None,
        }))
        .expect("boot");
    call(
        &mut w.client,
        mb::CMD_FILL,
        [TESTGUEST_SCRATCH, PAGES, 5, 0],
    );
    let snap = dir.join("snap");
    w.client.snapshot(&snap, false).expect("snapshot");
    w.client.stop().unwrap();
    w.child.wait().unwrap();
    snap
}

#[test]
fn truncating_a_layer_under_a_restored_vm_ends_its_worker_with_a_clear_reason() {
    require_kvm();
    let dir = TempDir::new("layer-fault");
    let snap = make_snapshot(dir.path());
    let log = dir.path().join("b.log");
    let sock = dir.path().join("b.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_sprout-worker"))
        .arg("--socket")
        .arg(&sock)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut c = Client::connect_wait(&sock, T).expect("worker listens");
    c.restore(RestoreSpec {
        dir: snap.clone(),
        backend: Backend::Mmap,
        vsock_uds: None,
        instance_id: None,
        prefetch: false,
    })
    .expect("restore");
    call(&mut c, mb::CMD_ECHO, [1, 0, 0, 0]);

    let m = snapshot::Snapshot::load(&snap).unwrap().manifest().clone();
    let data = snap.join(&m.memory_layers[0].data.name);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&data)
        .unwrap()
        .set_len(0)
        .unwrap();
    // Reading all of guest RAM (a snapshot of it) touches the truncated
    // pages from the VMM itself.
    let snap2 = dir.path().join("snap2");
    let trigger = std::thread::spawn(move || {
        let r = c.snapshot(&snap2, false);
        (r.is_ok(), c)
    });
    let deadline = Instant::now() + T;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the worker neither failed nor exited after its layer was truncated");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (snapshot_ok, _c) = trigger.join().unwrap();
    assert!(!snapshot_ok, "a snapshot of truncated memory succeeded");
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        status.code(),
        Some(snapshot::fault::LAYER_FAULT_EXIT),
        "worker ended with {status:?}; its log: {text}"
    );
    assert!(
        text.contains(snapshot::fault::LAYER_FAULT_MESSAGE.trim_end()),
        "log: {text}"
    );
}
