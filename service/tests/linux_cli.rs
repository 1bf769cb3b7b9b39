//! `sprout vm run` for Linux guests, on this host directly: bad input is
//! refused clearly (never a panic), and a host whose KVM cannot run Linux
//! guests is detected and refused fast, pointing at the lab. (Linux guests
//! themselves are tested in the lab: tests/tests/lab_linux.rs.)

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

struct Tmp(PathBuf);

impl Tmp {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("sprout-linux-cli-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
    /// A file that passes the ext4 superblock check (magic at byte 1080).
    fn ext4(&self, name: &str) -> PathBuf {
        let mut b = vec![0u8; 64 * 1024];
        b[1080..1082].copy_from_slice(&0xef53u16.to_le_bytes());
        let p = self.0.join(name);
        std::fs::write(&p, b).unwrap();
        p
    }
    /// An ELF64 x86_64 executable header with no program headers behind it:
    /// it passes the CLI's checks and fails only when the VMM loads it.
    fn elf(&self, name: &str) -> PathBuf {
        let mut h = vec![0u8; 64];
        h[0..4].copy_from_slice(b"\x7fELF");
        h[4] = 2;
        h[5] = 1;
        h[16] = 2;
        h[18] = 62;
        h[54] = 56;
        h[56] = 1;
        self.file(name, &h)
    }
    fn file(&self, name: &str, contents: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, contents).unwrap();
        p
    }
}

impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn sprout(cache: &Path, args: &[&str]) -> (Output, Duration) {
    let t = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_sprout"))
        .args(args)
        .env("SPROUT_CACHE", cache)
        .output()
        .expect("run sprout");
    (out, t.elapsed())
}

fn refused(cache: &Path, args: &[&str], says: &str) -> Duration {
    let (out, took) = sprout(cache, args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} should fail");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(err.contains(says), "{args:?}: expected {says:?} in: {err}");
    took
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn bad_input_is_refused_clearly() {
    let t = Tmp::new("bad");
    let empty_cache = t.0.join("no-cache");
    let kernel = t.elf("vmlinux");
    let not_elf = t.file("bzImage", b"MZ not an ELF file");
    let image = t.ext4("image.ext4");
    let junk = t.file("junk.img", &[0x55; 8192]);
    let (k, i) = (s(&kernel), s(&image));
    // Nothing built yet: the defaults say how to build them.
    refused(
        &empty_cache,
        &["vm", "run", "--exec", "true"],
        "guest/build-kernel.sh",
    );
    refused(
        &empty_cache,
        &["vm", "run", "--kernel", k, "--image", "default"],
        "guest/build-images.sh default",
    );
    refused(
        &empty_cache,
        &[
            "vm",
            "run",
            "--kernel",
            "/nonexistent/vmlinux",
            "--image",
            i,
        ],
        "does not exist",
    );
    refused(
        &empty_cache,
        &["vm", "run", "--kernel", s(&not_elf), "--image", i],
        "not a kernel Sprout can boot",
    );
    refused(
        &empty_cache,
        &["vm", "run", "--kernel", k, "--image", s(&junk)],
        "not an ext4 image",
    );
    refused(
        &empty_cache,
        &[
            "vm",
            "run",
            "--kernel",
            k,
            "--image",
            "/nonexistent/root.ext4",
        ],
        "does not exist",
    );
    refused(
        &empty_cache,
        &["vm", "run", "--kernel", k, "--image", i, "--disk", s(&junk)],
        "not an ext4 image",
    );
    for mem in ["0", "100000"] {
        refused(
            &empty_cache,
            &[
                "vm",
                "run",
                "--kernel",
                k,
                "--image",
                i,
                "--memory-mib",
                mem,
            ],
            "128 to 8192",
        );
    }
    refused(
        &empty_cache,
        &["vm", "run", "--kernel", k, "--image", i, "--cpus", "9"],
        "use 1 to 4",
    );
}

fn cpu_has_hardware_virtualization() -> bool {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("flags"))
        .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"))
}

/// On a host whose /dev/kvm has no hardware virtualization behind it (this
/// project's machines), a Linux guest is refused at once with the reason and
/// the way to the lab; elsewhere the probe passes and the (fake) kernel is
/// what gets refused.
#[test]
fn a_kvm_that_cannot_run_linux_is_refused_fast() {
    let t = Tmp::new("probe");
    let kernel = t.elf("vmlinux");
    let image = t.ext4("image.ext4");
    let template = t.ext4("scratch.ext4");
    std::fs::create_dir_all(t.0.join("images")).unwrap();
    std::fs::rename(&template, t.0.join("images/scratch.ext4")).unwrap();
    let args = [
        "vm",
        "run",
        "--kernel",
        s(&kernel),
        "--image",
        s(&image),
        "--exec",
        "true",
    ];
    if cpu_has_hardware_virtualization() {
        refused(&t.0, &args, "Cannot load the kernel");
        return;
    }
    let took = refused(&t.0, &args, "cannot run Linux guests");
    let (out, _) = sprout(&t.0, &args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tests/lab/run.sh"), "{err}");
    assert!(err.contains("ring-0 test code"), "{err}");
    // The whole process, not only the probe: well under a second.
    assert!(took < Duration::from_secs(2), "took {took:?}");
}
