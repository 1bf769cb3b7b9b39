//! The emulated hardware-virtualization lab (`tests/lab/`) as a test fixture.
//!
//! A Linux guest cannot run on this project's machines' own KVM (see
//! docs/guest.md), so Linux-guest tests run a shell script inside the lab: QEMU
//! in pure emulation with an emulated AMD SVM CPU, Debian's cloud kernel and
//! `kvm_amd nested=1`, where `sprout` gets a `/dev/kvm` with real KVM semantics.
//! On a host with hardware virtualization the same scripts run directly.
//!
//! ```no_run
//! let out = sprout_tests::lab::run("sprout vm run --image test --exec 'uname -r'");
//! out.assert_success();
//! assert!(out.stdout.contains("6.12"));
//! ```
//!
//! The lab is built (or found in the cache) once per test process with
//! `tests/lab/build.sh`; at most `SPROUT_LAB_JOBS` (default 2) outer VMs run at
//! once. Timeouts are host time.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Host-time limit of one lab run unless a test sets its own.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
/// `tests/lab/run.sh` exit codes that mean the lab itself failed.
const LAB_TIMEOUT: i32 = 124;
const LAB_BROKEN: i32 = 125;
const LAB_LOCKUP: i32 = 126;
/// The emulated machine froze: no heartbeat from the lab's kernel (run.sh
/// dumps where its CPUs were; docs/architecture.md, issue 18).
const LAB_FROZEN: i32 = 127;

/// What a script printed inside the lab and how it ended.
#[derive(Debug)]
pub struct LabOutput {
    /// The script's exit status.
    pub status: i32,
    /// The script's output (stdout and stderr, as the serial console shows them).
    pub stdout: String,
    /// `run.sh`'s own messages.
    pub stderr: String,
    /// Host time the whole run took (outer boot included).
    pub elapsed: Duration,
}

impl LabOutput {
    /// Panics, showing the output, unless the script exited 0.
    pub fn assert_success(&self) -> &Self {
        assert_eq!(
            self.status, 0,
            "lab script failed with status {}\n--- output ---\n{}\n--- lab ---\n{}",
            self.status, self.stdout, self.stderr
        );
        self
    }

    /// The output lines that start with `prefix`, with the prefix removed.
    pub fn values(&self, prefix: &str) -> Vec<&str> {
        self.stdout
            .lines()
            .filter_map(|l| l.strip_prefix(prefix))
            .map(str::trim)
            .collect()
    }

    /// The first line that starts with `prefix`, as JSON (a panic with the
    /// output if there is none or it is not JSON).
    pub fn json(&self, prefix: &str) -> serde_json::Value {
        let v = self.values(prefix);
        let line = v
            .first()
            .unwrap_or_else(|| panic!("no {prefix} line\n{}", self.stdout));
        serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("{prefix} {line:?}: {e}\n{}", self.stdout))
    }
}

/// A script to run in the lab.
pub struct Script {
    text: String,
    timeout: Duration,
    files: Vec<PathBuf>,
    smp: Option<u8>,
}

impl Script {
    pub fn new(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            timeout: DEFAULT_TIMEOUT,
            files: Vec::new(),
            smp: None,
        }
    }

    /// Host-time limit for the whole run.
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }

    /// Copies `path` to `/lab/` inside the lab.
    pub fn file(mut self, path: impl Into<PathBuf>) -> Self {
        self.files.push(path.into());
        self
    }

    /// vCPUs of the outer VM.
    pub fn smp(mut self, n: u8) -> Self {
        self.smp = Some(n);
        self
    }

    /// Runs the script; panics if the lab itself fails (not built, timed out,
    /// no exit marker), with the console in the message.
    pub fn run(self) -> LabOutput {
        let root = repo_root();
        let lab = ensure_built(&root);
        let _slot = Slot::take();
        // The lab is an emulated machine running an emulated one. A run
        // that hangs there, or whose outer kernel locks up, is retried once;
        // one whose whole emulated machine froze (issue 18: QEMU's CPU
        // parked at one guest-kernel RIP, no heartbeat: the emulator's, not
        // Sprout's) up to twice. Each retry is loud, with the failed run's
        // console in the test's output; past that it is a failure.
        let (mut freezes, mut hangs) = (0, 0);
        let mut out = self.run_once(&root, lab);
        loop {
            match out.status {
                LAB_FROZEN if freezes < 2 => freezes += 1,
                LAB_TIMEOUT | LAB_LOCKUP if hangs < 1 => hangs += 1,
                _ => return self.judge(out),
            }
            eprintln!(
                "lab: the run hung, the lab's kernel locked up or the emulated machine froze \
                 (status {}); retrying. The failed run:\n--- output ---\n{}\n--- lab ---\n{}",
                out.status, out.stdout, out.stderr
            );
            out = self.run_once(&root, lab);
        }
    }

    fn run_once(&self, root: &Path, lab: &Path) -> LabOutput {
        let dir = tempdir();
        let script = dir.join("script.sh");
        std::fs::write(&script, &self.text).expect("write the lab script");
        let mut cmd = Command::new("bash");
        // This checkout's lab, not whichever `<cache>/lab` names when the
        // run starts: another checkout's build (a CI clone beside a working
        // tree) moves that link.
        cmd.arg(root.join("tests/lab/run.sh"))
            .env("SPROUT_LAB", lab)
            .arg("--timeout")
            .arg(self.timeout.as_secs().max(1).to_string());
        if let Some(n) = self.smp {
            cmd.arg("--smp").arg(n.to_string());
        }
        cmd.arg(&script).args(&self.files);
        let t = Instant::now();
        let out = cmd.output().expect("run tests/lab/run.sh");
        let elapsed = t.elapsed();
        let _ = std::fs::remove_dir_all(&dir);
        LabOutput {
            status: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            elapsed,
        }
    }

    fn judge(&self, out: LabOutput) -> LabOutput {
        match out.status {
            LAB_TIMEOUT => panic!(
                "the lab run passed its {:?} host-time limit\n--- output ---\n{}\n--- lab ---\n{}",
                self.timeout, out.stdout, out.stderr
            ),
            LAB_LOCKUP => panic!(
                "the lab's own kernel locked up\n--- output ---\n{}\n--- lab ---\n{}",
                out.stdout, out.stderr
            ),
            LAB_FROZEN => panic!(
                "the emulated machine froze (no heartbeat from the lab's kernel)\n--- output \
                 ---\n{}\n--- lab ---\n{}",
                out.stdout, out.stderr
            ),
            LAB_BROKEN => panic!(
                "the lab failed (see its console)\n--- output ---\n{}\n--- lab ---\n{}",
                out.stdout, out.stderr
            ),
            _ => out,
        }
    }
}

/// Runs `script` in the lab with the default limits.
pub fn run(script: &str) -> LabOutput {
    Script::new(script).run()
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

/// Builds the lab (a cache hit unless an input changed) once per process;
/// its directory, as build.sh prints it (`$SPROUT_LAB` if that is set).
fn ensure_built(root: &Path) -> &'static Path {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let r = BUILT.get_or_init(|| {
        let out = Command::new("bash")
            .arg(root.join("tests/lab/build.sh"))
            .output()
            .map_err(|e| format!("cannot run tests/lab/build.sh: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "tests/lab/build.sh failed ({}):\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        if let Some(dir) = std::env::var_os("SPROUT_LAB").filter(|d| !d.is_empty()) {
            return Ok(PathBuf::from(dir));
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        match stdout.lines().rev().find(|l| !l.trim().is_empty()) {
            Some(dir) => Ok(PathBuf::from(dir.trim())),
            None => Err("tests/lab/build.sh printed no lab directory".into()),
        }
    });
    match r {
        Ok(dir) => dir,
        Err(e) => panic!("the lab is not available: {e}"),
    }
}

fn tempdir() -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let p = std::env::temp_dir().join(format!(
        "sprout-labtest-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&p).expect("temp dir");
    p
}

/// One of the `SPROUT_LAB_JOBS` outer-VM slots of this process.
struct Slot;

static SLOTS: Mutex<usize> = Mutex::new(0);
static FREED: Condvar = Condvar::new();

impl Slot {
    fn take() -> Slot {
        let max = std::env::var("SPROUT_LAB_JOBS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n: &usize| n > 0)
            .unwrap_or(2);
        let mut used = SLOTS.lock().unwrap_or_else(|e| e.into_inner());
        while *used >= max {
            used = FREED.wait(used).unwrap_or_else(|e| e.into_inner());
        }
        *used += 1;
        Slot
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut used = SLOTS.lock().unwrap_or_else(|e| e.into_inner());
        *used -= 1;
        FREED.notify_one();
    }
}
