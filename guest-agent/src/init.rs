//! PID 1 in a VM: mount the basics, set the hostname, bring up `lo`, then run the agent
//! as a child (restarted if it dies) and reap every orphan.
//!
//! The agent proper runs in a child process so that this loop is the only `wait(-1)`
//! in the guest: tokio reaps the agent's own children, this loop reaps everything
//! re-parented to PID 1, and neither steals the other's exit statuses.
//!
//! Kernel command line options: `sprout.hostname=NAME` (default `sprout`),
//! `sprout.port=PORT` (vsock port, default 1024), `sprout.workspace=DEVICE` (an ext4
//! device mounted at `/workspace`; a tmpfs if absent).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use log::{error, info, warn};
use rustix::mount::{mount, MountFlags};
use rustix::process::{wait, Pid, WaitOptions};

use crate::main_process::SPEC_PATH;
use crate::protocol::DEFAULT_VSOCK_PORT;

/// Where the files root lives in a VM.
pub const WORKSPACE: &str = "/workspace";
const DEFAULT_HOSTNAME: &str = "sprout";
const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("Cannot mount {what} on {target}")]
    Mount {
        what: String,
        target: String,
        #[source]
        source: std::io::Error,
    },
}

/// Options read from the kernel command line.
#[derive(Debug, PartialEq, Eq)]
pub struct BootOptions {
    pub hostname: String,
    pub port: u32,
    pub workspace_device: Option<String>,
}

impl BootOptions {
    pub fn parse(cmdline: &str) -> BootOptions {
        let mut o = BootOptions {
            hostname: DEFAULT_HOSTNAME.into(),
            port: DEFAULT_VSOCK_PORT,
            workspace_device: None,
        };
        for word in cmdline.split_whitespace() {
            if let Some(v) = word.strip_prefix("sprout.hostname=") {
                o.hostname = v.into();
            } else if let Some(v) = word.strip_prefix("sprout.port=") {
                o.port = v.parse().unwrap_or(DEFAULT_VSOCK_PORT);
            } else if let Some(v) = word.strip_prefix("sprout.workspace=") {
                o.workspace_device = Some(v.into());
            }
        }
        o
    }
}

fn mount_one(source: &str, target: &str, fs: &str, flags: MountFlags) -> Result<(), InitError> {
    let _ = std::fs::create_dir_all(target);
    match mount(source, target, fs, flags, None) {
        // Already mounted (e.g. devtmpfs by the kernel): fine.
        Ok(()) | Err(rustix::io::Errno::BUSY) => Ok(()),
        Err(e) => Err(InitError::Mount {
            what: format!("{fs} ({source})"),
            target: target.into(),
            source: e.into(),
        }),
    }
}

fn setup(opts_from: impl FnOnce() -> String) -> BootOptions {
    let nosuid = MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC;
    let basics = [
        ("proc", "/proc", "proc", nosuid),
        ("sysfs", "/sys", "sysfs", nosuid),
        ("devtmpfs", "/dev", "devtmpfs", MountFlags::NOSUID),
        (
            "devpts",
            "/dev/pts",
            "devpts",
            MountFlags::NOSUID | MountFlags::NOEXEC,
        ),
        (
            "tmpfs",
            "/tmp",
            "tmpfs",
            MountFlags::NOSUID | MountFlags::NODEV,
        ),
    ];
    for (src, target, fs, flags) in basics {
        if let Err(e) = mount_one(src, target, fs, flags) {
            warn!("{e}: {:?}", std::error::Error::source(&e));
        }
    }
    let opts = BootOptions::parse(&opts_from());
    let ws = match &opts.workspace_device {
        Some(dev) => mount_one(
            dev,
            WORKSPACE,
            "ext4",
            MountFlags::NOSUID | MountFlags::NODEV,
        ),
        // The image's root set-up (sprout-init) already mounted the writable
        // disk's workspace here: keep it.
        None if is_mount_point(WORKSPACE) => Ok(()),
        None => mount_one(
            "tmpfs",
            WORKSPACE,
            "tmpfs",
            MountFlags::NOSUID | MountFlags::NODEV,
        ),
    };
    if let Err(e) = ws {
        error!("{e}: {:?}", std::error::Error::source(&e));
    }
    if let Err(e) = rustix::system::sethostname(opts.hostname.as_bytes()) {
        warn!("cannot set the hostname: {e}");
    }
    if let Err(e) = crate::sys::set_link_up("lo") {
        warn!("cannot bring up lo: {e}");
    }
    opts
}

/// Whether `path` is the root of a mount other than its parent's.
fn is_mount_point(path: &str) -> bool {
    use std::os::unix::fs::MetadataExt;
    let p = Path::new(path);
    match (
        std::fs::metadata(p),
        std::fs::metadata(p.parent().unwrap_or(Path::new("/"))),
    ) {
        (Ok(a), Ok(b)) => a.dev() != b.dev(),
        _ => false,
    }
}

/// The signal `reboot`, `halt` or `poweroff` (busybox) sent PID 1, 0 if none.
static SHUTDOWN: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn on_shutdown_signal(sig: libc::c_int) {
    SHUTDOWN.store(sig, std::sync::atomic::Ordering::SeqCst);
}

/// `reboot`, `halt` and `poweroff` in the guest signal PID 1 (SIGTERM,
/// SIGUSR1, SIGUSR2): each ends the VM the one way a microVM has, a reboot
/// (the VMM's i8042 reset). Without SA_RESTART the signal interrupts `wait`.
fn catch_shutdown_signals() {
    for sig in [libc::SIGTERM, libc::SIGUSR1, libc::SIGUSR2] {
        // SAFETY: a zeroed sigaction with an async-signal-safe handler (one
        // atomic store) and no flags is a valid argument; the old action is
        // not needed.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction =
                on_shutdown_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut act.sa_mask);
            libc::sigaction(sig, &act, std::ptr::null_mut());
        }
    }
}

fn shutdown_if_asked() {
    let sig = SHUTDOWN.load(std::sync::atomic::Ordering::SeqCst);
    if sig != 0 {
        info!("signal {sig}: syncing and rebooting");
        rustix::fs::sync();
        if let Err(e) = rustix::system::reboot(rustix::system::RebootCommand::Restart) {
            error!("reboot failed: {e}");
        }
    }
}

/// Runs as PID 1: never returns (PID 1 exiting panics the kernel).
pub fn run() -> ! {
    catch_shutdown_signals();
    let opts = setup(|| std::fs::read_to_string("/proc/cmdline").unwrap_or_default());
    let exe = std::env::current_exe().unwrap_or_else(|_| "/sbin/sprout-agent".into());
    let port = opts.port.to_string();
    // The image's main process (container runtime) is started once, by the
    // first agent: an agent restarted later does not start it again.
    let mut main = Path::new(SPEC_PATH).is_file();
    let mut spawn = || {
        let mut cmd = Command::new(&exe);
        cmd.args([
            "--listen-vsock",
            &port,
            "--root",
            WORKSPACE,
            "--allow-identity",
        ]);
        if std::mem::take(&mut main) {
            cmd.args(["--main", SPEC_PATH]);
        }
        cmd.env_clear()
            .env("PATH", PATH)
            .env("HOME", "/root")
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .current_dir(if Path::new(WORKSPACE).is_dir() {
                WORKSPACE
            } else {
                "/"
            })
            .spawn()
    };
    let mut agent: Option<Pid> = None;
    loop {
        shutdown_if_asked();
        if agent.is_none() {
            match spawn() {
                Ok(child) => {
                    info!("agent started as pid {}", child.id());
                    agent = Pid::from_raw(child.id() as i32);
                }
                Err(e) => {
                    error!("cannot start the agent: {e}");
                    std::thread::sleep(Duration::from_secs(1));
                    continue;
                }
            }
        }
        match wait(WaitOptions::empty()) {
            Ok(Some((pid, status))) if Some(pid) == agent => {
                error!("agent exited ({status:?}); restarting it");
                agent = None;
                std::thread::sleep(Duration::from_millis(100));
            }
            Ok(_) => {}
            Err(e) => {
                warn!("wait failed: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_options() {
        let o = BootOptions::parse(
            "console=ttyS0 sprout.hostname=box sprout.port=77 sprout.workspace=/dev/vdb",
        );
        assert_eq!(
            o,
            BootOptions {
                hostname: "box".into(),
                port: 77,
                workspace_device: Some("/dev/vdb".into())
            }
        );
        let d = BootOptions::parse("quiet sprout.port=x");
        assert_eq!(
            (d.hostname.as_str(), d.port, d.workspace_device),
            ("sprout", 1024, None)
        );
    }
}
