//! The jail of a worker started by root with `--jail`, as Firecracker's
//! jailer does: its own mount namespace, with `--jail-root` a root holding
//! only what its VM needs, no new privileges, an unprivileged uid/gid with
//! no capabilities, and a seccomp filter per thread kind.
//!
//! [`enter`] runs on the main thread before any other thread exists
//! (credentials are per thread in the kernel: changing them while single-
//! threaded changes them for the whole process):
//!
//! 1. compile the seccomp filters and install the SIGSYS handler
//!    ([`seccomp::prepare`]);
//! 2. `unshare(CLONE_NEWNS)`;
//! 3. with `--jail-root DIR` ([`root`]): make every mount a slave (so the
//!    spawner's later mounts under DIR come in, and nothing mounted here
//!    goes out), mount the jail's `/dev` (a tmpfs with `kvm` and
//!    `userfaultfd` owned by the jail uid, `null`, `urandom`) and
//!    `/proc/self` in DIR, `pivot_root` into DIR and detach the host's
//!    root (from an initramfs root: move DIR over `/` and chroot). The spawner exposes files into DIR while the worker runs
//!    ([`Jail::expose`]), at the same paths as on the host.
//!    Without it: make every mount private and give the devices in place:
//!    `/dev/kvm`, `/dev/userfaultfd` and `/dev/net/tun` are root's (0600) on the host, so
//!    the worker mounts a small tmpfs, makes a node of each device there
//!    owned by the jail uid/gid (0600), and binds it over the path in
//!    `/dev`; the worker sees the rest of the host's file system with the
//!    jail uid's rights, and whatever it must write (its socket's
//!    directory, snapshot and scratch directories) must be writable by it;
//! 4. `PR_SET_NO_NEW_PRIVS`, then `setgroups([])`, `setresgid`,
//!    `setresuid`: with every uid non-zero the kernel clears the
//!    capabilities (CapEff 0).
//!
//! The VMM opens the devices by path whenever it needs them (a ready
//! worker's shell, a boot, a uffd restore).

pub mod filters;
pub mod ioctls;
mod names;
pub mod root;
pub mod seccomp;
pub mod tap;
#[cfg(feature = "test-hooks")]
pub mod test_hooks;

use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Gid, Mode, Uid};
use rustix::mount::{MountFlags, MountPropagationFlags, UnmountFlags};

pub use root::{Jail, CONTROL_SOCKET, WORKER_DIR};
pub use seccomp::{apply_or_exit, Kind, SECCOMP_EXIT};

/// nobody / nogroup.
pub const DEFAULT_UID: u32 = 65534;
pub const DEFAULT_GID: u32 = 65534;

/// The devices a VM opens, given to the jail uid inside its namespace.
const DEVICES: &[&str] = &["/dev/kvm", "/dev/userfaultfd", "/dev/net/tun"];

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JailOptions {
    pub uid: u32,
    pub gid: u32,
    /// `--jail-root DIR`: the jail root to `pivot_root` into (a
    /// [`Jail::root`], a shared mount made by [`Jail::create`]). `None`:
    /// the worker keeps the host's file system (with the jail uid's rights).
    pub root: Option<PathBuf>,
}

impl Default for JailOptions {
    fn default() -> Self {
        Self {
            uid: DEFAULT_UID,
            gid: DEFAULT_GID,
            root: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("--jail needs root (effective uid {0})")]
    NotRoot(u32),
    #[error("--jail needs uid and gid other than 0")]
    RootTarget,
    #[error("The jail must be entered before any thread starts ({0} running)")]
    Threads(usize),
    #[error(transparent)]
    Seccomp(#[from] seccomp::SeccompError),
    #[error("Cannot {0}")]
    Sys(&'static str, #[source] std::io::Error),
    #[error("Cannot give {0} to the jail")]
    Device(PathBuf, #[source] std::io::Error),
    #[error("Cannot {1} {0}")]
    Root(PathBuf, &'static str, #[source] std::io::Error),
}

fn sys<T>(what: &'static str, r: rustix::io::Result<T>) -> Result<T, JailError> {
    r.map_err(|e| JailError::Sys(what, e.into()))
}

fn threads() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Enters the jail (see the module docs). Call on the main thread, first.
pub fn enter(o: &JailOptions) -> Result<(), JailError> {
    let euid = rustix::process::geteuid().as_raw();
    if euid != 0 {
        return Err(JailError::NotRoot(euid));
    }
    if o.uid == 0 || o.gid == 0 {
        return Err(JailError::RootTarget);
    }
    match threads() {
        1 => {}
        n => return Err(JailError::Threads(n)),
    }
    // One malloc arena for every thread. glibc's per-thread arenas, when
    // they shrink a heap after large frees, read
    // /proc/sys/vm/overcommit_memory (once, lazily, from whichever thread
    // frees): an openat that no thread's filter allows, and which killed
    // an events thread after a burst of vsock traffic. The main arena
    // shrinks with brk, which every filter allows.
    // SAFETY: mallopt only sets a malloc parameter; no thread but this one
    // exists yet (checked above), so no arena is in use elsewhere.
    if unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) } != 1 {
        return Err(JailError::Sys(
            "limit malloc to one arena",
            std::io::Error::other("mallopt(M_ARENA_MAX) failed"),
        ));
    }
    seccomp::prepare()?;
    // Its own mount namespace, and its own network namespace: a worker
    // taken over by its guest reaches no TCP/IP service of the host (such as
    // sproutd's own API on loopback). Its own sockets are Unix sockets on
    // paths, which work across network namespaces; its VM's network device
    // is the TAP made below, which sproutd joins to the host from outside.
    // SAFETY: only CLONE_NEWNS and CLONE_NEWNET: no file descriptor table
    // is unshared, so no thread can see descriptors from another table.
    sys("unshare the mount and network namespaces", unsafe {
        rustix::thread::unshare_unsafe(
            rustix::thread::UnshareFlags::NEWNS | rustix::thread::UnshareFlags::NEWNET,
        )
    })?;
    // The VM's TAP, while the worker may still make one (see `tap`). A
    // host without /dev/net/tun runs sandboxes without a network (sproutd
    // says so): no TAP then, and no error.
    match tap::make(o.uid, o.gid) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(JailError::Sys(
                "make the sandbox's TAP",
                std::io::Error::new(e.kind(), e.to_string()),
            ))
        }
    }
    match &o.root {
        None => {
            sys(
                "make the mounts private",
                rustix::mount::mount_change(
                    "/",
                    MountPropagationFlags::REC | MountPropagationFlags::PRIVATE,
                ),
            )?;
            give_devices(o)?;
        }
        Some(root) => {
            // Slaves, not private: what the spawner mounts under the jail
            // root in the host's namespace must still come in.
            sys(
                "make the mounts slaves",
                rustix::mount::mount_change(
                    "/",
                    MountPropagationFlags::REC | MountPropagationFlags::DOWNSTREAM,
                ),
            )?;
            root::enter(root, o)?;
        }
    }
    sys("set no_new_privs", rustix::thread::set_no_new_privs(true))?;
    let (uid, gid) = (Uid::from_raw(o.uid), Gid::from_raw(o.gid));
    sys(
        "drop supplementary groups",
        rustix::thread::set_thread_groups(&[]),
    )?;
    sys(
        "set the gid",
        rustix::thread::set_thread_res_gid(gid, gid, gid),
    )?;
    sys(
        "set the uid",
        rustix::thread::set_thread_res_uid(uid, uid, uid),
    )?;
    Ok(())
}

/// Step 3: a node of each device owned by the jail uid, bound over its path.
fn give_devices(o: &JailOptions) -> Result<(), JailError> {
    let dir = std::env::temp_dir().join(format!(".sprout-jail-{}", std::process::id()));
    let dev_err = |p: &Path| {
        let p = p.to_owned();
        move |e: std::io::Error| JailError::Device(p, e)
    };
    std::fs::create_dir(&dir).map_err(dev_err(&dir))?;
    let r = (|| {
        sys(
            "mount the jail's device tmpfs",
            rustix::mount::mount(
                "sprout-jail",
                &dir,
                "tmpfs",
                MountFlags::NOSUID | MountFlags::NOEXEC,
                c"mode=0700,size=64k",
            ),
        )?;
        for dev in DEVICES {
            let path = Path::new(dev);
            let st = match rustix::fs::stat(path) {
                Ok(st) => st,
                // No such device on this host: the VMM does without it
                // (uffd falls back to the syscall).
                Err(rustix::io::Errno::NOENT) => continue,
                Err(e) => return Err(dev_err(path)(e.into())),
            };
            let node = dir.join(path.file_name().unwrap_or_default());
            rustix::fs::mknodat(
                rustix::fs::CWD,
                &node,
                FileType::CharacterDevice,
                Mode::from_raw_mode(0o600),
                st.st_rdev,
            )
            .map_err(|e| dev_err(path)(e.into()))?;
            rustix::fs::chown(
                &node,
                Some(Uid::from_raw(o.uid)),
                Some(Gid::from_raw(o.gid)),
            )
            .map_err(|e| dev_err(path)(e.into()))?;
            rustix::mount::mount_bind(&node, path).map_err(|e| dev_err(path)(e.into()))?;
        }
        Ok(())
    })();
    // The binds keep the tmpfs alive; its mount point goes.
    let _ = rustix::mount::unmount(&dir, UnmountFlags::DETACH);
    let _ = std::fs::remove_dir(&dir);
    r
}
