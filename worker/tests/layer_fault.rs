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

/// A worker restored (mmap backend) from a fresh snapshot, whose base
/// memory layer was then truncated to nothing.
struct Truncated {
    _dir: TempDir,
    dir: std::path::PathBuf,
    child: std::process::Child,
    client: Option<Client>,
    log: std::path::PathBuf,
}

fn restore_then_truncate() -> Truncated {
    restore_then_truncate_with(|_| {})
}

/// [`restore_then_truncate`], running `before` just before the truncation.
fn restore_then_truncate_with(before: impl FnOnce(&mut Client)) -> Truncated {
    let dir = TempDir::new("layer-fault");
    let snap = make_snapshot(dir.path());
    let log = dir.path().join("b.log");
    let sock = dir.path().join("b.sock");
    let child = Command::new(env!("CARGO_BIN_EXE_sprout-worker"))
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
        net: None,
    })
    .expect("restore");
    call(&mut c, mb::CMD_ECHO, [1, 0, 0, 0]);
    before(&mut c);

    let m = snapshot::Snapshot::load(&snap).unwrap().manifest().clone();
    let data = snap.join(&m.memory_layers[0].data.name);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&data)
        .unwrap()
        .set_len(0)
        .unwrap();
    Truncated {
        dir: dir.path().to_owned(),
        _dir: dir,
        child,
        client: Some(c),
        log,
    }
}

impl Truncated {
    /// Waits for the worker to end; returns its status and its log.
    fn ended(&mut self) -> (std::process::ExitStatus, String) {
        let deadline = Instant::now() + T;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("the worker neither failed nor exited after its layer was truncated");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        (status, std::fs::read_to_string(&self.log).unwrap())
    }
}

fn assert_layer_fault(status: std::process::ExitStatus, text: &str) {
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

#[test]
fn truncating_a_layer_under_a_restored_vm_ends_its_worker_with_a_clear_reason() {
    require_kvm();
    let mut t = restore_then_truncate();
    // Reading all of guest RAM (a snapshot of it) touches the truncated
    // pages from the VMM itself (SIGBUS), unless a vCPU touches one first
    // (KVM_RUN fails with EFAULT): either way the same end.
    let snap2 = t.dir.join("snap2");
    let mut c = t.client.take().unwrap();
    let trigger = std::thread::spawn(move || c.snapshot(&snap2, false).is_ok());
    let (status, text) = t.ended();
    assert!(
        !trigger.join().unwrap(),
        "a snapshot of truncated memory succeeded"
    );
    assert_layer_fault(status, &text);
}

#[test]
fn a_vcpu_that_touches_a_truncated_layer_ends_its_worker_with_the_same_reason() {
    require_kvm();
    let mut t = restore_then_truncate_with(|c| {
        // The guest counts in a loop for minutes; the call gives up waiting
        // once the command is posted, and the guest goes on.
        let r = c.mailbox(
            0,
            mb::CMD_COUNT,
            [1 << 40, 0, 0, 0],
            Duration::from_millis(300),
        );
        assert!(r.is_err(), "a count of 2^40 answered: {r:?}");
    });
    // The truncation took the guest's code pages out from under it: its next
    // instruction fetch is a page KVM cannot fill. No host thread touches
    // guest RAM, so there is no SIGBUS: KVM_RUN fails with EFAULT (x86 KVM),
    // or the guest takes a page fault it cannot handle and triple-faults
    // (this project's software KVM). The worker says what lies behind it.
    let (status, text) = t.ended();
    assert_layer_fault(status, &text);
    assert!(
        text.contains("was truncated or changed while the VM used it ("),
        "the log does not name the layer: {text}"
    );
}
