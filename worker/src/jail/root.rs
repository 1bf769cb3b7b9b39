//! A jail root (`--jail-root DIR`): the worker `pivot_root`s into a
//! directory holding only what its VM needs, and sees nothing else of the
//! host.
//!
//! # Design
//!
//! Workers are started into a ready pool before anyone knows which kernel,
//! disks, snapshot or fork layer they will use, so the jail cannot be filled
//! before the worker starts (Firecracker's jailer copies or links every file
//! into the chroot first; a ready worker has no such list). Instead the
//! spawner, in the host's mount namespace, keeps a door open into each
//! worker's root and mounts files into it later:
//!
//! - [`Jail::create`] makes `<base>/<id>/root` with a skeleton (`/dev`,
//!   `/proc/self`, and `/worker`, the worker's own directory, owned by the
//!   jail uid), binds it onto itself and makes that mount **shared**.
//! - The worker, after `unshare(CLONE_NEWNS)`, makes every mount a
//!   **slave** (not private): its copy of the jail root then still receives
//!   the mounts the spawner makes under it in the host namespace, while
//!   nothing it mounts goes back. In its own namespace it mounts a tmpfs on
//!   `/dev` with the nodes its VM opens (`kvm`, `userfaultfd` owned by the
//!   jail uid; `null`, `urandom`), read-only once made, binds its own
//!   `/proc/<pid>` on `/proc/self` (read-only: metrics and the fd links read
//!   it; no other process is visible), then `pivot_root`s into the root and
//!   detaches the old one: the host's file system is gone from its view.
//!   (A host running from its initramfs, as the emulated lab does, has a
//!   `rootfs` root that `pivot_root` cannot move: there the worker moves
//!   the jail root over `/` and chroots into it, as `switch_root` does.)
//! - [`Jail::expose`] bind-mounts a host file or directory into the root at
//!   **the same absolute path** (a detached clone, made `nosuid,nodev` and
//!   read-only if asked, then moved into place, so the worker's copy gets
//!   the same flags), and the mount propagates into the running worker.
//!   The same path inside and out is deliberate: snapshots and fork layers
//!   record paths (the kernel and disk images of the VM's spec, parent
//!   layers), and a path written by one jailed worker must mean the same
//!   file to the host and to every other jail it is exposed into. Requests
//!   carry paths as the worker sees them, which for an exposed path is the
//!   host's path.
//! - The worker's control socket is `/worker/control.sock` inside its root;
//!   the spawner puts a symbolic link to it at the socket path its caller
//!   asked for, so a socket that is gone (the link dangles) still means the
//!   worker is gone. Whatever else the worker writes outside exposed
//!   directories (vsock sockets, restored disks' private tops: the default
//!   scratch directory is `/worker`) is in `/worker`, under
//!   [`Jail::host_path`] on the host.
//! - [`Jail::remove`], once the worker has exited, detaches every mount
//!   under the root and deletes `<base>/<id>`, and refuses to delete
//!   anything while a mount is left under it (so an exposed host directory
//!   is never deleted through its bind).
//!
//! Only files are exposed: the base must not lie inside an exposed
//! directory (it is refused), or a worker would see the other workers'
//! roots. Exposures are not recursive (a mount under an exposed directory
//! is not carried in).

use std::ffi::OsStr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use rustix::fs::{FileType, Gid, Mode, OFlags, ResolveFlags, Uid, CWD};
use rustix::mount::{
    MountFlags, MountPropagationFlags, MoveMountFlags, OpenTreeFlags, UnmountFlags,
};

use super::{JailError, JailOptions};

/// The worker's own directory inside its root, owned by the jail uid.
pub const WORKER_DIR: &str = "/worker";
/// The worker's control socket inside its root.
pub const CONTROL_SOCKET: &str = "/worker/control.sock";
/// Paths of the root that are the jail's own: never exposed over.
const RESERVED: &[&str] = &["/dev", "/proc", WORKER_DIR];

/// The nodes made in the jail's `/dev`: name, mode, owned by the jail uid
/// (else root's). A node whose host device is missing is left out (uffd
/// falls back to the syscall).
const DEVICES: &[(&str, u32, bool)] = &[
    ("kvm", 0o600, true),
    ("userfaultfd", 0o600, true),
    // The rng device's entropy source.
    ("urandom", 0o666, false),
    ("null", 0o666, false),
    // The sandbox's TAP (see `super::tap`), attached to by the VMM.
    ("net/tun", 0o600, true),
];

fn root_err(root: &Path, what: &'static str) -> impl FnOnce(rustix::io::Errno) -> JailError {
    let root = root.to_owned();
    move |e| JailError::Root(root, what, e.into())
}

fn io_root_err(root: &Path, what: &'static str) -> impl FnOnce(std::io::Error) -> JailError {
    let root = root.to_owned();
    move |e| JailError::Root(root, what, e)
}

/// The worker's side (see the module docs), as root in its new mount
/// namespace whose mounts are already slaves: `/dev`, `/proc/self`, then
/// `pivot_root`.
pub(super) fn enter(root: &Path, o: &JailOptions) -> Result<(), JailError> {
    let dev = root.join("dev");
    let proc_self = root.join("proc/self");
    for d in [&dev, &proc_self] {
        std::fs::create_dir_all(d).map_err(io_root_err(root, "make the skeleton of"))?;
    }
    rustix::mount::mount(
        "sprout-dev",
        &dev,
        "tmpfs",
        MountFlags::NOSUID | MountFlags::NOEXEC,
        c"mode=0755,size=64k",
    )
    .map_err(root_err(root, "mount /dev in"))?;
    for &(name, mode, jail_owned) in DEVICES {
        let host = Path::new("/dev").join(name);
        let st = match rustix::fs::stat(&host) {
            Ok(st) => st,
            Err(rustix::io::Errno::NOENT) => continue,
            Err(e) => return Err(JailError::Device(host, e.into())),
        };
        let node = dev.join(name);
        if let Some(parent) = node.parent().filter(|p| *p != dev) {
            std::fs::create_dir_all(parent)
                .map_err(io_root_err(root, "make a /dev directory in"))?;
        }
        let dev_err = |e: rustix::io::Errno| JailError::Device(host.clone(), e.into());
        rustix::fs::mknodat(
            CWD,
            &node,
            FileType::CharacterDevice,
            Mode::from_raw_mode(mode),
            st.st_rdev,
        )
        .map_err(dev_err)?;
        // mknod's mode is masked by the umask.
        rustix::fs::chmod(&node, Mode::from_raw_mode(mode)).map_err(dev_err)?;
        if jail_owned {
            rustix::fs::chown(
                &node,
                Some(Uid::from_raw(o.uid)),
                Some(Gid::from_raw(o.gid)),
            )
            .map_err(dev_err)?;
        }
    }
    rustix::mount::mount_remount(
        &dev,
        MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NOEXEC,
        "",
    )
    .map_err(root_err(root, "make /dev read-only in"))?;
    let pid = format!("/proc/{}", rustix::process::getpid().as_raw_nonzero());
    rustix::mount::mount_bind(pid.as_str(), &proc_self)
        .map_err(root_err(root, "bind /proc/self in"))?;
    rustix::mount::mount_remount(
        &proc_self,
        MountFlags::BIND
            | MountFlags::RDONLY
            | MountFlags::NOSUID
            | MountFlags::NODEV
            | MountFlags::NOEXEC,
        "",
    )
    .map_err(root_err(root, "make /proc/self read-only in"))?;
    // The new root on top of the old, then the old detached: nothing of the
    // host's tree is left in this namespace.
    rustix::process::chdir(root).map_err(root_err(root, "enter"))?;
    match rustix::process::pivot_root(".", ".") {
        Ok(()) => rustix::mount::unmount(".", UnmountFlags::DETACH)
            .map_err(root_err(root, "detach the host's root from"))?,
        // The host runs from its initramfs (`rootfs`, as the emulated lab
        // does), which pivot_root cannot put aside: as switch_root does,
        // the jail root is moved over `/` and the worker chroots into it.
        // The rootfs stays beneath, out of reach: leaving a chroot takes
        // CAP_SYS_CHROOT, which the worker gives up below (step 4), and it
        // holds no descriptor of a directory outside.
        Err(rustix::io::Errno::INVAL) if root_is_rootfs() => {
            rustix::mount::mount_move(".", "/")
                .map_err(root_err(root, "move over the initramfs root"))?;
            rustix::process::chroot(".").map_err(root_err(root, "chroot into"))?;
        }
        Err(e) => {
            return Err(root_err(
                root,
                "pivot_root into (it must be a mount point, as Jail::create makes it)",
            )(e))
        }
    }
    rustix::process::chdir("/").map_err(root_err(root, "enter"))?;
    Ok(())
}

/// Whether this mount namespace runs on the initramfs: its `/` is a mount
/// of type `rootfs`, which has no parent to pivot away from.
fn root_is_rootfs() -> bool {
    std::fs::read_to_string("/proc/self/mountinfo").is_ok_and(|s| mountinfo_has_rootfs(&s))
}

/// Whether a mountinfo text has a `rootfs` mount on `/`.
fn mountinfo_has_rootfs(s: &str) -> bool {
    s.lines().any(|l| {
        // "ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [TAGS...] - FSTYPE SRC OPTS"
        let (head, tail) = l.split_once(" - ").unwrap_or((l, ""));
        head.split(' ').nth(4) == Some("/") && tail.split(' ').next() == Some("rootfs")
    })
}

/// A worker's jail directory, seen from the host (the spawner's side; see
/// the module docs). Dropping it leaves it in place (the worker outlives
/// its starter); [`remove`](Self::remove) deletes it once the worker is gone.
#[derive(Debug, Clone)]
pub struct Jail {
    dir: PathBuf,
    root: PathBuf,
}

impl Jail {
    /// Makes `<base>/<id>/root`, its skeleton (`/worker` owned by
    /// `uid`/`gid`), and the shared self-bind the worker's exposures
    /// propagate through. Needs root.
    pub fn create(base: &Path, id: &str, uid: u32, gid: u32) -> Result<Jail, JailError> {
        if id.is_empty() || id.contains('/') || id == "." || id == ".." {
            return Err(JailError::Root(
                base.join(id),
                "name a jail directory",
                std::io::ErrorKind::InvalidInput.into(),
            ));
        }
        std::fs::create_dir_all(base).map_err(io_root_err(base, "make the jail base"))?;
        let base = base
            .canonicalize()
            .map_err(io_root_err(base, "resolve the jail base"))?;
        let dir = base.join(id);
        std::fs::create_dir(&dir).map_err(io_root_err(&dir, "make"))?;
        let jail = Jail {
            root: dir.join("root"),
            dir,
        };
        let made = (|| {
            let root = &jail.root;
            std::fs::create_dir(root).map_err(io_root_err(root, "make"))?;
            for d in ["dev", "proc", "proc/self", "worker"] {
                std::fs::create_dir(root.join(d))
                    .map_err(io_root_err(root, "make the skeleton of"))?;
            }
            let w = root.join("worker");
            rustix::fs::chown(&w, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
                .map_err(root_err(root, "give /worker to the jail uid in"))?;
            rustix::fs::chmod(&w, Mode::from_raw_mode(0o700))
                .map_err(root_err(root, "set the mode of /worker in"))?;
            rustix::mount::mount_bind(root, root).map_err(root_err(root, "bind"))?;
            rustix::mount::mount_change(root, MountPropagationFlags::SHARED)
                .map_err(root_err(root, "share"))?;
            Ok(())
        })();
        match made {
            Ok(()) => Ok(jail),
            Err(e) => {
                let _ = jail.remove();
                Err(e)
            }
        }
    }

    /// The jail at `dir` (`<base>/<id>`, as [`create`](Self::create) made
    /// it): for a manager that re-adopts a running worker.
    pub fn open(dir: impl Into<PathBuf>) -> Jail {
        let dir = dir.into();
        Jail {
            root: dir.join("root"),
            dir,
        }
    }

    /// `<base>/<id>`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The worker's `/`, on the host (what `--jail-root` names).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where `jail_path` (a path as the worker sees it) is on the host.
    pub fn host_path(&self, jail_path: &Path) -> PathBuf {
        self.root
            .join(jail_path.strip_prefix("/").unwrap_or(jail_path))
    }

    /// Bind-mounts `host` (a file or directory) into the jail at the same
    /// absolute path, read-only if `read_only`, and returns that path (as
    /// the worker sees it). Works while the worker runs: the mount
    /// propagates into its namespace. Needs root.
    pub fn expose(&self, host: &Path, read_only: bool) -> Result<PathBuf, JailError> {
        let err = |what| io_root_err(host, what);
        let path = host.canonicalize().map_err(err("expose"))?;
        let refuse = |why: &'static str| {
            Err(JailError::Root(
                path.clone(),
                why,
                std::io::ErrorKind::InvalidInput.into(),
            ))
        };
        if path == Path::new("/") {
            return refuse("expose (the host's root)");
        }
        if RESERVED.iter().any(|r| path.starts_with(r)) {
            return refuse("expose (a path the jail keeps for itself: /dev, /proc, /worker)");
        }
        if self.dir.starts_with(&path) || path.starts_with(&self.dir) {
            return refuse("expose (it holds the jail, or is in it)");
        }
        let is_dir = path.is_dir();
        // A detached copy of the host's mount of `path`, its flags set
        // before it is attached: the worker's propagated copy takes them.
        let tree = rustix::mount::open_tree(
            CWD,
            &path,
            OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC,
        )
        .map_err(|e| err("clone a mount of")(e.into()))?;
        let mut attr = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV;
        if read_only {
            attr |= MOUNT_ATTR_RDONLY;
        }
        set_mount_attr(&tree, attr).map_err(err("set the mount flags of"))?;
        let target = self.mount_point(&path, is_dir)?;
        rustix::mount::move_mount(
            tree.as_fd(),
            "",
            target.as_fd(),
            "",
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
        )
        .map_err(|e| err("mount into the jail")(e.into()))?;
        Ok(path)
    }

    /// Makes (as root, 0755) the directories down to `path` inside the root
    /// and the mount point itself, walking one component at a time by
    /// descriptor with no symbolic link followed, so nothing the worker
    /// wrote can turn the mount aside; returns the mount point, `O_PATH`.
    fn mount_point(&self, path: &Path, is_dir: bool) -> Result<OwnedFd, JailError> {
        let e = |what| root_err(&self.root, what);
        let dir_flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let resolve = ResolveFlags::NO_SYMLINKS | ResolveFlags::BENEATH;
        let mut cur = rustix::fs::open(&self.root, dir_flags, Mode::empty())
            .map_err(e("open the root of"))?;
        let comps: Vec<&OsStr> = path
            .components()
            .filter_map(|c| match c {
                Component::Normal(s) => Some(s),
                _ => None,
            })
            .collect();
        for (i, c) in comps.iter().enumerate() {
            let last = i + 1 == comps.len();
            if last && !is_dir {
                match rustix::fs::openat2(
                    &cur,
                    *c,
                    OFlags::CREATE | OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o644),
                    resolve,
                ) {
                    Ok(_) => {}
                    Err(err) => return Err(e("make a mount point in")(err)),
                }
                return rustix::fs::openat2(
                    &cur,
                    *c,
                    OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                    resolve,
                )
                .map_err(e("open a mount point in"));
            }
            match rustix::fs::mkdirat(&cur, *c, Mode::from_raw_mode(0o755)) {
                Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                Err(err) => return Err(e("make a directory in")(err)),
            }
            cur = rustix::fs::openat2(&cur, *c, dir_flags, Mode::empty(), resolve)
                .map_err(e("walk"))?;
        }
        Ok(cur)
    }

    /// Once its worker has exited: detaches every mount under the root (in
    /// the host's namespace) and deletes `<base>/<id>`. Deletes nothing
    /// while any mount is left under it.
    pub fn remove(&self) -> Result<(), JailError> {
        match rustix::mount::unmount(&self.root, UnmountFlags::DETACH | UnmountFlags::NOFOLLOW) {
            // EINVAL: not a mount point (never bound, or already removed).
            Ok(()) | Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => {}
            Err(e) => return Err(root_err(&self.root, "detach")(e)),
        }
        if let Some(m) = mounts_under(&self.dir) {
            return Err(JailError::Root(
                m,
                "remove the jail: a mount is left at",
                std::io::ErrorKind::ResourceBusy.into(),
            ));
        }
        match std::fs::remove_dir_all(&self.dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_root_err(&self.dir, "remove")(e)),
        }
    }
}

const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;

/// `struct mount_attr` (`linux/mount.h`).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// `mount_setattr(fd, "", AT_EMPTY_PATH, {attr_set})` (not in rustix).
fn set_mount_attr(fd: &OwnedFd, set: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let attr = MountAttr {
        attr_set: set,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: the path is a valid NUL-terminated string, `attr` a valid
    // `mount_attr` of the size passed, both live across the call; the
    // descriptor is open (borrowed from `fd`).
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            fd.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A mount point at or under `dir` in this process's namespace, if any.
fn mounts_under(dir: &Path) -> Option<PathBuf> {
    let s = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    s.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(OsStr::from_bytes(&unescape(m))))
        .find(|m| m.starts_with(dir))
}

/// Undoes mountinfo's octal escapes (`\040` for a space, ...).
fn unescape(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            let o = &b[i + 1..i + 4];
            if o.iter().all(|c| (b'0'..=b'7').contains(c)) {
                let v = o.iter().fold(0u32, |v, c| v * 8 + u32::from(c - b'0'));
                out.push(v as u8);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape(r"/a\040b/c"), b"/a b/c");
        assert_eq!(unescape(r"/plain"), b"/plain");
        assert_eq!(unescape(r"/end\04"), b"/end\\04");
    }

    #[test]
    fn an_initramfs_root_is_told_from_a_disk_root() {
        let initramfs = "1 1 0:2 / / rw - rootfs rootfs rw,size=1010708k\n\
                         22 1 0:21 / /proc rw,relatime - proc proc rw\n";
        assert!(mountinfo_has_rootfs(initramfs));
        let disk = "25 1 254:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n\
                    26 25 0:5 / /dev rw,nosuid shared:2 - devtmpfs udev rw\n";
        assert!(!mountinfo_has_rootfs(disk));
        // A rootfs somewhere else is not the root.
        assert!(!mountinfo_has_rootfs(
            "30 25 0:2 / /mnt rw - rootfs rootfs rw\n"
        ));
    }

    #[test]
    fn host_paths_are_under_the_root() {
        let j = Jail::open("/base/w1");
        assert_eq!(j.root(), Path::new("/base/w1/root"));
        assert_eq!(
            j.host_path(Path::new(CONTROL_SOCKET)),
            Path::new("/base/w1/root/worker/control.sock")
        );
    }
}
