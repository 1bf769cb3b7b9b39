//! Helpers for integration tests that boot the test guest under real KVM.

pub mod lab;

use std::path::{Path, PathBuf};
use std::time::Duration;

use guest_abi::mailbox as mb;
use vmm::mailbox::Reply;
use vmm::{ConsoleBuffer, SerialOutput, Vm, VmConfig};

/// Generous: guest supervisor code is emulated on this machine's KVM.
pub const TIMEOUT: Duration = Duration::from_secs(30);

/// Fails the test with a clear message when KVM is not usable: these tests
/// are never skipped silently.
pub fn require_kvm() {
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        panic!(
            "/dev/kvm cannot be opened ({e}): these tests boot real guests under KVM and need \
             read/write access to /dev/kvm"
        );
    }
}

/// The built test guest.
pub fn testguest() -> PathBuf {
    let p = PathBuf::from(testguest_build::TESTGUEST_PATH);
    assert!(p.is_file(), "test guest not built at {}", p.display());
    p
}

/// A test guest VM config with its console captured.
pub fn config(vcpus: u8, mem_mib: u64) -> (VmConfig, ConsoleBuffer) {
    require_kvm();
    let console = ConsoleBuffer::new(1 << 20);
    let mut c = VmConfig::new(testguest());
    c.vcpus = vcpus;
    c.mem_mib = mem_mib;
    c.serial = SerialOutput::Buffer(console.clone());
    (c, console)
}

/// Boots `cfg` and waits until every vCPU serves its mailbox.
pub fn boot(cfg: VmConfig, console: &ConsoleBuffer) -> Vm {
    let n = cfg.vcpus;
    let vm = Vm::start(cfg).expect("VM starts");
    let mbox = vm.mailbox().expect("test guest has a mailbox");
    for c in 0..n {
        if let Err(e) = mbox.wait_ready(c, TIMEOUT) {
            panic!("vCPU {c} not ready: {e}\nconsole:\n{}", console.text());
        }
    }
    vm
}

/// Runs a mailbox command and checks it succeeded.
pub fn call(vm: &Vm, cpu: u8, cmd: u32, args: [u64; 4]) -> Reply {
    let r = vm
        .mailbox()
        .expect("mailbox")
        .call(cpu, cmd, args, TIMEOUT)
        .unwrap_or_else(|e| panic!("command {cmd} on vCPU {cpu}: {e}"));
    assert_eq!(
        r.status,
        mb::STATUS_OK,
        "command {cmd} on vCPU {cpu}: {r:?}"
    );
    r
}

/// The checksum the test guest returns for `pages` pages at `gpa` filled by
/// `CMD_FILL` with `seed`.
pub fn pattern_checksum(seed: u64, gpa: u64, pages: u64) -> u64 {
    use guest_abi::mailbox::{checksum_step, pattern_word};
    (0..pages * 512).fold(0, |acc, i| {
        checksum_step(acc, pattern_word(seed, gpa + i * 8))
    })
}

/// Connects to a VM's vsock host socket and asks for guest `port` (the
/// `CONNECT <port>` handshake); panics unless the guest accepts.
pub fn host_connect(uds: &Path, port: u32) -> std::os::unix::net::UnixStream {
    use std::io::{BufRead, BufReader, Write};
    let mut s = std::os::unix::net::UnixStream::connect(uds).expect("connect to the vsock socket");
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    s.write_all(format!("CONNECT {port}\n").as_bytes()).unwrap();
    let mut line = String::new();
    BufReader::new(&mut s).read_line(&mut line).unwrap();
    assert!(line.starts_with("OK "), "handshake answer {line:?}");
    s
}

/// A unique scratch directory under the system temp dir, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "sprout-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&p).expect("temp dir");
        Self(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Open file descriptors of this process.
pub fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Threads of this process.
pub fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}
