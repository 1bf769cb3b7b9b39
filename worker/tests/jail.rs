//! Jailed workers (`--jail`), under real KVM with the test guest: each runs
//! as nobody in its own mount namespace under per-thread seccomp filters
//! and still boots, snapshots, writes and restores fork layers, restores by
//! uffd, moves disk and vsock traffic; a worker whose filter refuses a
//! syscall (or an ioctl request no list has, or one its owner may make but
//! its vCPU or uffd thread may not) dies alone, saying which. With
//! a jail root a worker sees only its root and what is exposed into it,
//! even files exposed after it started, and its jail goes when it does.
//!
//! These tests need root (the jail drops from root to nobody); they fail,
//! never skip, without it.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use guest_abi::layout::{MIB, TESTGUEST_SCRATCH};
use guest_abi::mailbox as mb;
use sprout_tests::{host_connect, pattern_checksum, require_kvm, testguest, TempDir};
use sprout_worker::jail::{Jail, DEFAULT_GID, DEFAULT_UID, SECCOMP_EXIT};
use sprout_worker::protocol::{Backend, BootSpec, RestoreSpec, Shape, WorkerState};
use sprout_worker::{Client, ReadyPool, WorkerCommand, WorkerProcess};

const A: u64 = TESTGUEST_SCRATCH;
const B: u64 = TESTGUEST_SCRATCH + 32 * MIB;
const T: Duration = Duration::from_secs(60);
const SHAPE: Shape = Shape {
    vcpus: 2,
    mem_mib: 256,
};

fn require_root() {
    let euid = rustix::process::geteuid().as_raw();
    assert_eq!(
        euid, 0,
        "the jail tests need root: a jailed worker drops from root to nobody \
         (run them as root, as CI does)"
    );
    require_kvm();
}

fn cmd() -> WorkerCommand {
    WorkerCommand::new(env!("CARGO_BIN_EXE_sprout-worker")).jailed(DEFAULT_UID, DEFAULT_GID)
}

/// Jailed workers with a jail root each, under `base`.
fn rooted(base: &JailBase) -> WorkerCommand {
    cmd().jail_root(base.0.path())
}

/// A base of jail roots: whatever a failed test leaves is unmounted before
/// the directory is deleted (never deleting through an exposed bind).
struct JailBase(TempDir);

impl JailBase {
    fn new(tag: &str) -> Self {
        Self(TempDir::new(tag))
    }

    /// The jails left in it.
    fn left(&self) -> Vec<PathBuf> {
        std::fs::read_dir(self.0.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect()
    }
}

impl Drop for JailBase {
    fn drop(&mut self) {
        for d in self.left() {
            let _ = Jail::open(d).remove();
        }
    }
}

/// The names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// A directory the jail uid may write (sockets, snapshots, scratch).
fn jail_dir(tag: &str) -> TempDir {
    let d = TempDir::new(tag);
    chown(d.path());
    d
}

fn chown(p: &Path) {
    rustix::fs::chown(
        p,
        Some(rustix::fs::Uid::from_raw(DEFAULT_UID)),
        Some(rustix::fs::Gid::from_raw(DEFAULT_GID)),
    )
    .unwrap();
}

fn sub(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::create_dir(&p).unwrap();
    chown(&p);
    p
}

fn call(c: &mut Client, cmd: u32, args: [u64; 4]) -> [u64; 4] {
    let (status, rets) = c.mailbox(0, cmd, args, T).expect("mailbox call");
    assert_eq!(status, 0, "mailbox status for command {cmd}");
    rets
}

/// The lines of `/proc/<pid>/status` that show the jail.
fn jail_status(pid: u32) -> Vec<String> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .filter(|l| {
            [
                "Uid:",
                "Gid:",
                "CapEff:",
                "CapPrm:",
                "NoNewPrivs:",
                "Seccomp:",
            ]
            .iter()
            .any(|k| l.starts_with(k))
        })
        .map(str::to_owned)
        .collect()
}

fn assert_jailed(pid: u32) {
    let st = jail_status(pid);
    eprintln!("worker {pid}: {st:?}");
    for want in [
        "Seccomp:\t2",
        "CapEff:\t0000000000000000",
        "CapPrm:\t0000000000000000",
        "NoNewPrivs:\t1",
        "Uid:\t65534\t65534\t65534\t65534",
        "Gid:\t65534\t65534\t65534\t65534",
    ] {
        assert!(st.iter().any(|l| l == want), "{want:?} not in {st:?}");
    }
    for kind in ["mnt", "net"] {
        let ns = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/{kind}")).unwrap();
        assert_ne!(ns(&pid.to_string()), ns("self"), "its own {kind} namespace");
    }
}

/// A jailed worker booted with the test guest, with a disk and vsock.
fn boot(dir: &Path) -> (WorkerProcess, PathBuf) {
    let disk = dir.join("disk.img");
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    chown(&disk);
    let uds = dir.join("vsock.sock");
    let mut c = vmm::VmConfig::new(testguest());
    c.vcpus = SHAPE.vcpus;
    c.mem_mib = SHAPE.mem_mib;
    c.disks = vec![vmm::DiskConfig {
        path: disk,
        read_only: false,
        id: "jail0".into(),
        base: None,
    }];
    c.vsock = Some(vmm::VsockConfig {
        guest_cid: 42,
        uds_path: uds.clone(),
    });
    c.rng = true;
    let mut w = cmd()
        .spawn(
            &dir.join("parent.sock"),
            None,
            Some(&dir.join("parent.console")),
        )
        .expect("jailed worker starts");
    w.client
        .call(&sprout_worker::Request::Boot(BootSpec {
            spec: c.spec(),
            instance_id: Some(0x1a11),
        }))
        .expect("boot");
    (w, uds)
}

fn spec(dir: &Path, backend: Backend, vsock_uds: PathBuf) -> RestoreSpec {
    RestoreSpec {
        dir: dir.to_owned(),
        backend,
        vsock_uds: Some(vsock_uds),
        instance_id: None,
        prefetch: false,
        net: None,
    }
}

/// Disk, rng and vsock traffic through the jailed VM's event loop.
fn devices(c: &mut Client, uds: &Path) {
    call(c, mb::CMD_FILL, [B, 1, 9, 0]);
    call(c, mb::CMD_BLK_WRITE, [0, 8, B, 8]);
    call(c, mb::CMD_BLK_FLUSH, [0, 0, 0, 0]);
    call(c, mb::CMD_BLK_READ, [0, 8, B + 8 * 4096, 8]);
    call(c, mb::CMD_RNG_READ, [B, 64, 0, 0]);
    let mut s = host_connect(uds, mb::VSOCK_ECHO_PORT);
    s.write_all(b"through the jail").unwrap();
    let mut got = [0u8; 16];
    s.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"through the jail");
    // The guest connects out to a host listener (the events thread's
    // socket and connect); the jail uid must be able to connect to it.
    let port = 5000;
    let path = PathBuf::from(format!("{}_{port}", uds.display()));
    let _ = std::fs::remove_file(&path);
    let l = UnixListener::bind(&path).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).unwrap();
    let host = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = [0u8; 16];
        s.read_exact(&mut buf).unwrap();
        s.write_all(b"pong").unwrap();
    });
    let r = call(c, mb::CMD_VSOCK_SEND, [port, B, 16, 0]);
    host.join().unwrap();
    assert_eq!(r[0], 4, "the host's reply reached the guest");
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_jailed_worker_boots_snapshots_and_forks_into_jailed_ready_workers() {
    require_root();
    let dir = jail_dir("jail-fork");
    let (mut parent, uds) = boot(dir.path());
    assert_jailed(parent.pid());
    call(&mut parent.client, mb::CMD_FILL, [A, 64, 1, 0]);
    devices(&mut parent.client, &uds);
    parent.client.pause().unwrap();
    parent.client.resume().unwrap();
    // Made by the worker, in a directory the jail uid may write.
    let full = dir.path().join("full");
    let diff = dir.path().join("diff");
    parent.client.pause().unwrap();
    parent.client.snapshot(&full, false).expect("full snapshot");
    parent.client.resume().unwrap();
    call(&mut parent.client, mb::CMD_FILL, [A, 8, 2, 0]);
    parent.client.pause().unwrap();
    parent.client.snapshot(&diff, true).expect("diff snapshot");
    parent.client.resume().unwrap();
    let m = parent.client.metrics().expect("metrics");
    assert!(m.rss_kib > 0, "{m:?}");
    let scratch = sub(dir.path(), "layers");
    let layer = parent
        .client
        .write_fork_layer(&scratch)
        .expect("fork layer");
    // A jailed writer seals its layer too (owned by the jail uid, as its
    // jailed children are: they trust it).
    let seal = std::fs::metadata(layer.dir.join(".sealed")).expect("a sealed fork layer");
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&seal), 65534);

    let mut pool = ReadyPool::new(cmd(), dir.path(), SHAPE);
    pool.fill(2).expect("jailed ready workers");
    let mut kid = pool.take().unwrap();
    assert_jailed(kid.pid());
    kid.client
        .restore_fork_layer(spec(
            &layer.dir,
            Backend::Mmap,
            dir.path().join("kid.vsock"),
        ))
        .expect("the jailed child restores the fork layer");
    let d = kid.client.describe().unwrap();
    assert_eq!((d.state, d.pid), (WorkerState::Running, kid.pid()));
    let r = call(&mut kid.client, mb::CMD_CHECKSUM, [A + 8 * 4096, 56, 0, 0]);
    assert_eq!(r[0], pattern_checksum(1, A + 8 * 4096, 56));
    devices(&mut kid.client, &dir.path().join("kid.vsock"));
    assert_jailed(kid.pid());

    // uffd: a durable diff snapshot restored into a jailed ready shell.
    let mut u = pool.take().unwrap();
    u.client
        .restore(spec(&diff, Backend::Uffd, dir.path().join("u.vsock")))
        .expect("uffd restore into a jailed ready worker");
    let r = call(&mut u.client, mb::CMD_CHECKSUM, [A, 8, 0, 0]);
    assert_eq!(r[0], pattern_checksum(2, A, 8));
    devices(&mut u.client, &dir.path().join("u.vsock"));
    let m = u.client.metrics().unwrap();
    assert!(m.uffd_faults.is_some(), "{m:?}");

    // A diff fork layer, restored into a jailed empty worker (no shell: it
    // builds its VM after the jail), then a guest reset ends it cleanly.
    call(&mut parent.client, mb::CMD_FILL, [B, 4, 3, 0]);
    let layer2 = parent
        .client
        .write_fork_layer(&scratch)
        .expect("diff fork layer");
    assert!(layer2.diff, "{layer2:?}");
    let mut e = cmd()
        .spawn(&dir.path().join("empty.sock"), None, None)
        .expect("jailed empty worker");
    e.client
        .restore_fork_layer(spec(&layer2.dir, Backend::Mmap, dir.path().join("e.vsock")))
        .expect("restore into an empty jailed worker");
    let r = call(&mut e.client, mb::CMD_CHECKSUM, [B, 4, 0, 0]);
    assert_eq!(r[0], pattern_checksum(3, B, 4));
    let _ = e.client.mailbox(0, mb::CMD_RESET, [0; 4], T);
    let st = e.child.wait().unwrap();
    assert!(st.success(), "a jailed worker ends with its VM: {st:?}");

    // A durable full snapshot, mmap-restored into an empty jailed worker.
    let mut m = cmd()
        .spawn(&dir.path().join("mmap.sock"), None, None)
        .expect("jailed empty worker");
    m.client
        .restore(spec(&full, Backend::Mmap, dir.path().join("m.vsock")))
        .expect("mmap restore");
    let r = call(&mut m.client, mb::CMD_CHECKSUM, [A, 64, 0, 0]);
    assert_eq!(r[0], pattern_checksum(1, A, 64));

    for mut w in [parent, kid, u, m] {
        w.client.stop().unwrap();
        let st = w.child.wait().unwrap();
        assert!(st.success(), "a jailed worker stops cleanly: {st:?}");
        assert!(!w.socket.exists());
    }
}

/// Starts a jailed worker (ready for `shape` when given) with the test hook
/// (`SPROUT_WORKER_TEST_FORBIDDEN_SYSCALL`, compiled in only for these
/// tests: `sprout_worker::jail::test_hooks`) set to `hook`; its process, its
/// socket and its stderr's file.
fn doomed(dir: &Path, hook: &str, shape: Option<Shape>) -> (std::process::Child, PathBuf, PathBuf) {
    let sock = dir.join(format!("doomed-{hook}.sock"));
    let log = dir.join(format!("doomed-{hook}.log"));
    let mut c = Command::new(env!("CARGO_BIN_EXE_sprout-worker"));
    c.arg("--socket").arg(&sock).arg("--jail");
    if let Some(s) = shape {
        c.args(["--vcpus", &s.vcpus.to_string()])
            .args(["--memory-mib", &s.mem_mib.to_string()]);
    }
    let child = c
        .env("SPROUT_WORKER_TEST_FORBIDDEN_SYSCALL", hook)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    (child, sock, log)
}

/// Waits for `child` to die of its filter: status 159, and a message on
/// its stderr (`log`) holding each of `want`.
fn died_of_its_filter(mut child: std::process::Child, log: &Path, want: &[&str]) {
    let st = child.wait().unwrap();
    assert_eq!(
        st.code(),
        Some(SECCOMP_EXIT),
        "{st:?} (signal {:?})",
        st.signal()
    );
    let msg = std::fs::read_to_string(log).unwrap();
    for w in want {
        assert!(msg.contains(w), "{w:?} not in stderr: {msg}");
    }
}

/// Starts a jailed worker with the test hook set to `hook`, checks it dies
/// on its first request with status 159 and a message holding each of
/// `want`, and that a jailed sibling answers on.
fn refused(tag: &str, hook: &str, want: &[&str]) {
    require_root();
    let dir = jail_dir(tag);
    let mut pool = ReadyPool::new(cmd(), dir.path(), SHAPE);
    let mut sibling = pool.take().expect("a jailed sibling");
    let (child, sock, log) = doomed(dir.path(), hook, None);
    let mut c = Client::connect_wait(&sock, T).expect("it comes up");
    assert!(c.describe().is_err(), "it dies on its first request");
    died_of_its_filter(child, &log, want);
    // Its sibling answers on.
    assert_eq!(sibling.client.describe().unwrap().state, WorkerState::Ready);
    sibling.client.stop().unwrap();
    sibling.child.wait().unwrap();
}

#[test]
fn a_refused_syscall_ends_that_worker_alone_and_says_which() {
    refused(
        "jail-sigsys",
        "1",
        &["forbidden syscall", "(getppid)", "owner filter"],
    );
}

/// The filters allow ioctls by exact request number: one of KVM's type
/// (0xAE) that no thread issues (KVM_SET_IDENTITY_MAP_ADDR) is refused by
/// the kernel even on the owner thread, whose filter has the most KVM
/// requests.
#[test]
fn a_kvm_ioctl_of_an_unlisted_number_is_refused() {
    let req = format!(
        "request {:#x}",
        sprout_worker::jail::ioctls::KVM_SET_IDENTITY_MAP_ADDR
    );
    refused(
        "jail-ioctl",
        "ioctl",
        &["forbidden syscall 16 (ioctl)", &req, "owner filter"],
    );
}

/// A vCPU thread is held to its own list, not the owner's it started under:
/// a worker whose vCPU thread, once confined, asks for an ioctl the owner
/// may make and a vCPU may not (KVM_SET_USER_MEMORY_REGION) dies as its VM
/// boots, status 159, naming the thread, its filter and the request; a
/// jailed sibling's running VM runs on, its devices answering.
#[test]
fn a_vcpu_thread_ioctl_off_its_list_ends_that_worker_alone() {
    require_root();
    let dir = jail_dir("jail-vcpu-ioctl");
    let (mut sibling, uds) = boot(dir.path());
    call(&mut sibling.client, mb::CMD_FILL, [A, 8, 5, 0]);
    let (child, sock, log) = doomed(dir.path(), "vcpu-ioctl", None);
    let mut c = Client::connect_wait(&sock, T).expect("it comes up");
    assert_eq!(c.describe().unwrap().state, WorkerState::Empty);
    let mut cfg = vmm::VmConfig::new(testguest());
    cfg.vcpus = SHAPE.vcpus;
    cfg.mem_mib = SHAPE.mem_mib;
    // The answer may come before the vCPU thread starts, or never.
    let _ = c.call(&sprout_worker::Request::Boot(BootSpec {
        spec: cfg.spec(),
        instance_id: None,
    }));
    let req = format!(
        "request {:#x}",
        sprout_worker::jail::ioctls::KVM_SET_USER_MEMORY_REGION
    );
    died_of_its_filter(
        child,
        &log,
        &[
            "thread sprout-vcpu",
            "(vcpu filter) made forbidden syscall 16 (ioctl)",
            &req,
        ],
    );
    let r = call(&mut sibling.client, mb::CMD_CHECKSUM, [A, 8, 0, 0]);
    assert_eq!(r[0], pattern_checksum(5, A, 8));
    devices(&mut sibling.client, &uds);
    assert_eq!(
        sibling.client.describe().unwrap().state,
        WorkerState::Running
    );
    sibling.client.stop().unwrap();
    assert!(sibling.child.wait().unwrap().success());
}

/// A jailed worker's threads may free much memory at once: glibc's
/// per-thread malloc arenas read /proc/sys/vm/overcommit_memory as they
/// first shrink a heap, an openat no filter allows (it once killed an
/// events thread after a burst of vsock traffic). The jail keeps every
/// thread on the main arena, which shrinks with brk: a worker whose events
/// thread allocates and frees 32 MiB runs on.
#[test]
fn a_jailed_thread_that_frees_much_memory_runs_on() {
    require_root();
    let dir = jail_dir("jail-heap-churn");
    let (mut child, sock, log) = doomed(dir.path(), "heap-churn", None);
    let mut c = Client::connect_wait(&sock, T).expect("it comes up");
    let mut cfg = vmm::VmConfig::new(testguest());
    cfg.vcpus = SHAPE.vcpus;
    cfg.mem_mib = SHAPE.mem_mib;
    c.call(&sprout_worker::Request::Boot(BootSpec {
        spec: cfg.spec(),
        instance_id: None,
    }))
    .expect("it boots");
    call(&mut c, mb::CMD_FILL, [A, 8, 7, 0]);
    let r = call(&mut c, mb::CMD_CHECKSUM, [A, 8, 0, 0]);
    assert_eq!(r[0], pattern_checksum(7, A, 8));
    assert_eq!(c.describe().unwrap().state, WorkerState::Running);
    assert!(
        child.try_wait().unwrap().is_none(),
        "it died: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    c.stop().unwrap();
    assert!(child.wait().unwrap().success());
}

/// Likewise the uffd page server: a ready worker restoring a snapshot by
/// userfaultfd, whose uffd thread, once confined, asks for UFFDIO_REGISTER
/// (the owner's request, not the page server's), dies with status 159
/// naming it; the sibling that made the snapshot runs on.
#[test]
fn the_uffd_thread_ioctl_off_its_list_ends_that_worker_alone() {
    require_root();
    let dir = jail_dir("jail-uffd-ioctl");
    let (mut sibling, uds) = boot(dir.path());
    call(&mut sibling.client, mb::CMD_FILL, [A, 8, 6, 0]);
    let full = dir.path().join("full");
    sibling.client.pause().unwrap();
    sibling.client.snapshot(&full, false).expect("snapshot");
    sibling.client.resume().unwrap();
    let (child, sock, log) = doomed(dir.path(), "uffd-ioctl", Some(SHAPE));
    let mut c = Client::connect_wait(&sock, T).expect("it comes up");
    assert_eq!(c.describe().unwrap().state, WorkerState::Ready);
    let _ = c.restore(spec(&full, Backend::Uffd, dir.path().join("doomed.vsock")));
    let req = format!(
        "request {:#x}",
        sprout_worker::jail::ioctls::UFFDIO_REGISTER
    );
    died_of_its_filter(
        child,
        &log,
        &[
            "thread sprout-uffd (uffd filter) made forbidden syscall 16 (ioctl)",
            &req,
        ],
    );
    let r = call(&mut sibling.client, mb::CMD_CHECKSUM, [A, 8, 0, 0]);
    assert_eq!(r[0], pattern_checksum(6, A, 8));
    devices(&mut sibling.client, &uds);
    assert_eq!(
        sibling.client.describe().unwrap().state,
        WorkerState::Running
    );
    sibling.client.stop().unwrap();
    assert!(sibling.child.wait().unwrap().success());
}

/// A rooted worker sees nothing of the host: from the host, its
/// `/proc/PID/root` holds only the jail's own entries (the devices, its
/// `/proc/self`, its `/worker`: no `/etc`, no host `/tmp`); from inside, a
/// restore from a marker directory in the host's `/tmp` that holds a
/// manifest fails as a missing file; and its jail is gone once it has
/// exited.
#[test]
fn a_rooted_worker_sees_only_its_jail() {
    require_root();
    let base = JailBase::new("jail-base-see");
    let dir = jail_dir("jail-see");
    let marker = TempDir::new("jail-marker");
    std::fs::write(marker.path().join("manifest.json"), b"{}").unwrap();
    let mut pool = ReadyPool::new(rooted(&base), dir.path(), SHAPE);
    let mut w = pool.take().expect("a rooted ready worker");
    assert_jailed(w.pid());
    let root = PathBuf::from(format!("/proc/{}/root", w.pid()));
    assert_eq!(names(&root), ["dev", "proc", "worker"]);
    assert_eq!(
        names(&root.join("dev")),
        ["kvm", "net", "null", "urandom", "userfaultfd"]
    );
    assert_eq!(names(&root.join("dev/net")), ["tun"]);
    assert_eq!(names(&root.join("proc")), ["self"]);
    assert!(!root.join("etc/passwd").exists());
    assert!(!root.join(marker.path().strip_prefix("/").unwrap()).exists());
    let st = std::fs::read_to_string(root.join("proc/self/status")).unwrap();
    assert!(
        st.contains(&format!("Pid:\t{}", w.pid())),
        "its own /proc/self"
    );
    // Its own status through its /proc/self: the metrics read it.
    let m = w.client.metrics().expect("metrics in the jail");
    assert!(m.rss_kib > 0, "{m:?}");
    let jail = w.jail.clone().expect("a jail");
    assert!(jail
        .host_path(Path::new(sprout_worker::jail::CONTROL_SOCKET))
        .exists());

    // On the host the marker holds a manifest; in the jail it is missing.
    let e = w
        .client
        .restore(spec(
            marker.path(),
            Backend::Mmap,
            dir.path().join("x.vsock"),
        ))
        .expect_err("a host path is not in the jail");
    let msg = e.to_string();
    let want = format!("{}/manifest.json is missing", marker.path().display());
    assert!(msg.contains(&want), "{msg}");
    let _ = w.client.stop();
    let st = w.wait().unwrap();
    eprintln!("worker ended: {st:?}");
    assert!(!jail.dir().exists(), "its jail is removed");
    assert!(w.socket.symlink_metadata().is_err(), "and its socket link");
    assert!(base.left().is_empty(), "{:?}", base.left());
}

/// Rooted workers, under real KVM: an empty one boots the test guest from a
/// kernel exposed read-only and a data directory exposed writable after it
/// started, snapshots (full and diff) and writes a fork layer into that
/// directory; rooted ready workers, started before any of those files
/// existed, restore them (mmap, uffd, a fork layer) once exposed; disk,
/// rng and vsock traffic works; each stays jailed; every jail goes with its
/// worker.
#[test]
fn rooted_workers_boot_and_restore_from_files_exposed_after_they_started() {
    require_root();
    let base = JailBase::new("jail-base-run");
    let dir = jail_dir("jail-run");
    let mut pool = ReadyPool::new(rooted(&base), dir.path(), SHAPE);
    pool.fill(3).expect("rooted ready workers");

    let disk = dir.path().join("disk.img");
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    chown(&disk);
    let uds = dir.path().join("vsock.sock");
    let mut c = vmm::VmConfig::new(testguest());
    c.vcpus = SHAPE.vcpus;
    c.mem_mib = SHAPE.mem_mib;
    c.disks = vec![vmm::DiskConfig {
        path: disk,
        read_only: false,
        id: "jail0".into(),
        base: None,
    }];
    c.vsock = Some(vmm::VsockConfig {
        guest_cid: 42,
        uds_path: uds.clone(),
    });
    c.rng = true;
    let mut parent = rooted(&base)
        .spawn(&dir.path().join("parent.sock"), None, None)
        .expect("a rooted empty worker");
    let pj = parent.jail.clone().unwrap();
    // Exposed after it started, at the same paths.
    let kernel = pj.expose(&testguest(), true).unwrap();
    assert_eq!(kernel, testguest().canonicalize().unwrap());
    pj.expose(dir.path(), false).unwrap();
    parent
        .client
        .call(&sprout_worker::Request::Boot(BootSpec {
            spec: c.spec(),
            instance_id: Some(0x1a11),
        }))
        .expect("boot from exposed files");
    assert_jailed(parent.pid());
    // Read-only stays read-only inside.
    let inside = PathBuf::from(format!("/proc/{}/root", parent.pid()))
        .join(kernel.strip_prefix("/").unwrap());
    let e = std::fs::OpenOptions::new()
        .write(true)
        .open(&inside)
        .expect_err("the kernel is read-only in the jail");
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");

    call(&mut parent.client, mb::CMD_FILL, [A, 64, 1, 0]);
    devices(&mut parent.client, &uds);
    let full = dir.path().join("full");
    let diff = dir.path().join("diff");
    parent.client.pause().unwrap();
    parent.client.snapshot(&full, false).expect("full snapshot");
    parent.client.resume().unwrap();
    assert!(
        full.join("manifest.json").exists(),
        "written to the host's directory"
    );
    call(&mut parent.client, mb::CMD_FILL, [A, 8, 2, 0]);
    parent.client.pause().unwrap();
    parent.client.snapshot(&diff, true).expect("diff snapshot");
    parent.client.resume().unwrap();
    let scratch = sub(dir.path(), "layers");
    let layer = parent
        .client
        .write_fork_layer(&scratch)
        .expect("fork layer");

    let expose = |w: &WorkerProcess| {
        let j = w.jail.as_ref().unwrap();
        j.expose(&testguest(), true).unwrap();
        j.expose(dir.path(), false).unwrap();
    };
    let mut m = pool.take().unwrap();
    expose(&m);
    m.client
        .restore(spec(&full, Backend::Mmap, dir.path().join("m.vsock")))
        .expect("mmap restore into a rooted ready worker");
    let r = call(&mut m.client, mb::CMD_CHECKSUM, [A, 64, 0, 0]);
    assert_eq!(r[0], pattern_checksum(1, A, 64));
    devices(&mut m.client, &dir.path().join("m.vsock"));
    assert_jailed(m.pid());

    let mut u = pool.take().unwrap();
    expose(&u);
    u.client
        .restore(spec(&diff, Backend::Uffd, dir.path().join("u.vsock")))
        .expect("uffd restore into a rooted ready worker");
    let r = call(&mut u.client, mb::CMD_CHECKSUM, [A, 8, 0, 0]);
    assert_eq!(r[0], pattern_checksum(2, A, 8));
    devices(&mut u.client, &dir.path().join("u.vsock"));
    assert!(u.client.metrics().unwrap().uffd_faults.is_some());
    assert_jailed(u.pid());

    let mut kid = pool.take().unwrap();
    expose(&kid);
    kid.client
        .restore_fork_layer(spec(
            &layer.dir,
            Backend::Mmap,
            dir.path().join("kid.vsock"),
        ))
        .expect("a rooted child restores the fork layer");
    let r = call(&mut kid.client, mb::CMD_CHECKSUM, [A + 8 * 4096, 56, 0, 0]);
    assert_eq!(r[0], pattern_checksum(1, A + 8 * 4096, 56));
    devices(&mut kid.client, &dir.path().join("kid.vsock"));
    assert_jailed(kid.pid());

    // A guest reset ends a worker by itself; its jail goes once reaped.
    let kj = kid.jail.clone().unwrap();
    let _ = kid.client.mailbox(0, mb::CMD_RESET, [0; 4], T);
    let st = kid.wait().unwrap();
    assert!(st.success(), "a rooted worker ends with its VM: {st:?}");
    assert!(!kj.dir().exists());

    let jails: Vec<Jail> = [&parent, &m, &u]
        .iter()
        .map(|w| w.jail.clone().unwrap())
        .collect();
    for mut w in [parent, m, u] {
        w.client.stop().unwrap();
        let st = w.wait().unwrap();
        assert!(st.success(), "a rooted worker stops cleanly: {st:?}");
        assert!(!w.socket.exists());
    }
    for j in jails {
        assert!(!j.dir().exists(), "{} left", j.dir().display());
    }
    drop(pool);
    assert!(base.left().is_empty(), "{:?}", base.left());
    // The exposed directory and the kernel are still there.
    assert!(full.join("manifest.json").exists() && testguest().exists());
}

/// Each jailed worker has its own network namespace holding a TAP, `tap0`,
/// that its jail made (persistent, owned by the jail uid): its VM's network
/// device attaches to it after the worker gave up root, the device
/// activates (its offloads set from a vCPU thread) under the filters, and
/// the VM runs on.
#[test]
fn a_jailed_workers_vm_attaches_to_the_tap_its_jail_made() {
    require_root();
    if !Path::new("/dev/net/tun").exists() {
        eprintln!("skipped: this host has no /dev/net/tun");
        return;
    }
    let dir = jail_dir("jail-tap");
    let mut w = cmd()
        .spawn(
            &dir.path().join("w.sock"),
            None,
            Some(&dir.path().join("w.console")),
        )
        .expect("jailed worker starts");
    let ns = format!("--net=/proc/{}/ns/net", w.pid());
    let link = || {
        let o = std::process::Command::new("nsenter")
            .args([ns.as_str(), "ip", "-d", "link", "show", "tap0"])
            .output()
            .expect("nsenter runs");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let before = link();
    for want in ["tun type tap", "persist on"] {
        assert!(before.contains(want), "{want:?} not in {before}");
    }
    // ip names the owner when the host has a name for it.
    assert!(
        before.contains("user nobody") || before.contains("user 65534"),
        "owned by the jail uid: {before}"
    );
    let mut c = vmm::VmConfig::new(testguest());
    c.vcpus = SHAPE.vcpus;
    c.mem_mib = SHAPE.mem_mib;
    c.net = Some(vmm::config::NetConfig {
        tap: "tap0".into(),
        mac: [0x02, 0, 0, 0, 0x7a, 0x01],
    });
    w.client
        .call(&sprout_worker::Request::Boot(BootSpec {
            spec: c.spec(),
            instance_id: None,
        }))
        .expect("a boot with a network device in the jail");
    let d = w.client.describe().unwrap();
    assert_eq!(d.state, WorkerState::Running);
    assert_eq!(d.config.unwrap().net.unwrap().tap, "tap0");
    // A frame from the guest (its header and 60 bytes of its zeroed
    // scratch memory) reaches the TAP: the kernel counts it received.
    let up = std::process::Command::new("nsenter")
        .args([ns.as_str(), "ip", "link", "set", "tap0", "up"])
        .status()
        .unwrap();
    assert!(up.success());
    call(&mut w.client, mb::CMD_NET_SEND, [B, 12 + 60, 0, 0]);
    let stats = std::process::Command::new("nsenter")
        .args([ns.as_str(), "cat", "/proc/net/dev"])
        .output()
        .unwrap();
    let stats = String::from_utf8_lossy(&stats.stdout).into_owned();
    let rx: Vec<u64> = stats
        .lines()
        .find_map(|l| l.trim().strip_prefix("tap0:"))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|v| v.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(rx.get(1), Some(&1), "one frame received by tap0: {stats}");
    let after = link();
    assert!(after.contains("vnet_hdr on"), "{after}");
    w.client.stop().unwrap();
    w.wait().unwrap();
}
