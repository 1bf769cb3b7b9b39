//! Resolving a request path beneath the root: `openat2(RESOLVE_BENEATH)`, or the
//! component-by-component `O_NOFOLLOW` walk where `openat2` is missing.

use std::collections::VecDeque;
use std::ffi::{OsStr, OsString};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::fs::{self as rfs, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

use super::FsError;
use crate::protocol::MAX_PATH;

/// Most symlinks followed while resolving one path (as the kernel's own limit).
const MAX_SYMLINKS: usize = 40;
/// How often `openat2` is retried when a concurrent rename makes it answer `EAGAIN`.
const EAGAIN_RETRIES: usize = 16;

/// Set once `openat2` answered `ENOSYS`: every later resolution walks.
static NO_OPENAT2: AtomicBool = AtomicBool::new(false);

/// How paths are resolved beneath the root.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Resolver {
    /// `openat2` with `RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`, walking if the kernel
    /// lacks it.
    #[default]
    Openat2,
    /// Always the component-by-component walk (tests of the fallback).
    Walk,
}

/// Checks a request path and makes it relative to `root`: see the [module
/// docs](super). The result may still hold `..` components, which the resolver follows
/// (they are not collapsed lexically: `link/..` is the parent of the link's target).
/// An empty result names the root itself.
pub fn parse_path(root: &Path, path: &str) -> Result<PathBuf, FsError> {
    let invalid = |why| FsError::InvalidPath {
        path: path.to_owned(),
        why,
    };
    if path.as_bytes().contains(&0) {
        return Err(invalid("it contains a NUL byte"));
    }
    if path.len() > MAX_PATH {
        return Err(invalid("it is longer than 4096 bytes"));
    }
    let p = Path::new(path);
    let rel = if p.is_absolute() {
        p.strip_prefix(root)
            .map_err(|_| FsError::Escape(path.to_owned()))?
    } else {
        p
    };
    let mut out = PathBuf::new();
    let mut depth = 0usize;
    for c in rel.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                depth = depth
                    .checked_sub(1)
                    .ok_or_else(|| FsError::Escape(path.to_owned()))?;
                out.push("..");
            }
            Component::Normal(n) => {
                depth += 1;
                out.push(n);
            }
            Component::RootDir | Component::Prefix(_) => return Err(invalid("it is malformed")),
        }
    }
    Ok(out)
}

/// An open root directory and the way paths are resolved beneath it.
pub struct Root {
    fd: OwnedFd,
    resolver: Resolver,
}

impl Root {
    /// Opens the root directory (the root's own path is trusted configuration).
    pub fn open(path: &Path, resolver: Resolver) -> Result<Root, FsError> {
        let fd = rfs::open(
            path,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| FsError::Root(path.display().to_string(), e.into()))?;
        Ok(Root { fd, resolver })
    }

    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Opens `rel` (from [`parse_path`]; `shown` is the request's path, for errors)
    /// beneath the root with `flags` (`O_CLOEXEC` is added) and, when creating, `mode`.
    pub fn open_beneath(
        &self,
        rel: &Path,
        shown: &str,
        flags: OFlags,
        mode: Mode,
    ) -> Result<OwnedFd, FsError> {
        let flags = flags | OFlags::CLOEXEC;
        if self.resolver == Resolver::Openat2 && !NO_OPENAT2.load(Ordering::Relaxed) {
            let path: &Path = if rel.as_os_str().is_empty() {
                Path::new(".")
            } else {
                rel
            };
            let how = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS;
            let mut tries = 0;
            loop {
                match rfs::openat2(&self.fd, path, flags, mode, how) {
                    Ok(fd) => return Ok(fd),
                    Err(Errno::AGAIN) if tries < EAGAIN_RETRIES => tries += 1,
                    Err(Errno::NOSYS) => {
                        log::info!("openat2 is missing: resolving paths component by component");
                        NO_OPENAT2.store(true, Ordering::Relaxed);
                        break;
                    }
                    Err(e) => return Err(FsError::from_errno("resolve", shown, e)),
                }
            }
        }
        walk(&self.fd, rel, shown, flags, mode)
    }

    /// The directory holding the last component of `rel`, and that component. Refuses a
    /// path whose last component is not a name (the root itself, or `..`).
    pub fn parent(&self, rel: &Path, shown: &str) -> Result<(OwnedFd, OsString), FsError> {
        let (Some(Component::Normal(name)), Some(parent)) =
            (rel.components().next_back(), rel.parent())
        else {
            return Err(FsError::InvalidPath {
                path: shown.to_owned(),
                why: "it does not end in a file name",
            });
        };
        let dir = self.open_beneath(
            parent,
            shown,
            OFlags::PATH | OFlags::DIRECTORY,
            Mode::empty(),
        )?;
        Ok((dir, name.to_owned()))
    }
}

/// The fallback resolver: follows `rel` one component at a time from `root`, opening
/// each with `O_NOFOLLOW` relative to the directory before it. Symlinks are read and
/// their targets spliced in (an absolute target is an escape); `..` goes back along the
/// walked directories and may not go above the root. The last component is opened with
/// `flags | O_NOFOLLOW`, so a symlink swapped in after it was looked at is refused.
fn walk(
    root: &OwnedFd,
    rel: &Path,
    shown: &str,
    flags: OFlags,
    mode: Mode,
) -> Result<OwnedFd, FsError> {
    let err = |e: Errno| FsError::from_errno("resolve", shown, e);
    let escape = || FsError::Escape(shown.to_owned());
    let probe_flags = OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC;

    let mut stack: Vec<OwnedFd> =
        vec![rfs::openat(root, ".", probe_flags, Mode::empty()).map_err(err)?];
    let mut pending: VecDeque<OsString> = rel.iter().map(OsStr::to_os_string).collect();
    let mut links = 0usize;

    while let Some(name) = pending.pop_front() {
        let bytes = name.as_bytes();
        if bytes.is_empty() || bytes == b"." || bytes == b"/" {
            continue;
        }
        if bytes == b".." {
            if stack.len() == 1 {
                return Err(escape());
            }
            stack.pop();
            continue;
        }
        let last = pending.is_empty();
        let dir = stack.last().ok_or_else(escape)?;
        let fd = match rfs::openat(dir, &name, probe_flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::NOENT) if last && flags.contains(OFlags::CREATE) => {
                return open_last(dir, &name, shown, flags, mode);
            }
            Err(e) => return Err(err(e)),
        };
        let st = rfs::fstat(&fd).map_err(err)?;
        match FileType::from_raw_mode(st.st_mode) {
            FileType::Symlink => {
                links += 1;
                if links > MAX_SYMLINKS {
                    return Err(FsError::Loop(shown.to_owned()));
                }
                let target = rfs::readlinkat(&fd, "", Vec::new()).map_err(err)?;
                let target = PathBuf::from(OsString::from_vec(target.into_bytes()));
                if target.is_absolute() {
                    return Err(escape());
                }
                for c in target.iter().rev() {
                    pending.push_front(c.to_os_string());
                }
            }
            _ if last => return open_last(dir, &name, shown, flags, mode),
            FileType::Directory => stack.push(fd),
            _ => return Err(FsError::NotADirectory(shown.to_owned())),
        }
    }
    // The path named the root or ended on `..`: open the directory reached.
    let dir = stack.last().ok_or_else(escape)?;
    rfs::openat(dir, ".", flags, mode).map_err(err)
}

/// Opens the last component of a walk, refusing a symlink there.
fn open_last(
    dir: &OwnedFd,
    name: &OsStr,
    shown: &str,
    flags: OFlags,
    mode: Mode,
) -> Result<OwnedFd, FsError> {
    rfs::openat(dir, name, flags | OFlags::NOFOLLOW, mode).map_err(|e| match e {
        // A symlink appeared where the walk had seen none (or O_PATH|O_NOFOLLOW was asked
        // on one): refuse rather than follow it.
        Errno::LOOP => FsError::Escape(shown.to_owned()),
        e => FsError::from_errno("resolve", shown, e),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::symlink;

    fn tree() -> (tempfile::TempDir, PathBuf) {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        fs::create_dir_all(root.join("a/b/c")).unwrap();
        fs::write(root.join("a/b/c/f"), b"inside").unwrap();
        fs::write(t.path().join("secret"), b"SECRET").unwrap();
        symlink("/", root.join("slash")).unwrap();
        symlink("..", root.join("up")).unwrap();
        symlink(t.path().join("secret"), root.join("abs")).unwrap();
        symlink("a/b", root.join("inner")).unwrap();
        symlink("../../..", root.join("a/b/c/top")).unwrap();
        symlink("../../../..", root.join("a/b/c/over")).unwrap();
        symlink("loop2", root.join("loop1")).unwrap();
        symlink("loop1", root.join("loop2")).unwrap();
        (t, root)
    }

    fn read(root: &Root, rel: &str) -> Result<String, FsError> {
        let fd = root.open_beneath(Path::new(rel), rel, OFlags::RDONLY, Mode::empty())?;
        Ok(fs::read_to_string(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&fd)
        ))
        .unwrap())
    }

    #[test]
    fn parse_path_checks_lexically() {
        let root = Path::new("/work/root");
        assert_eq!(parse_path(root, "a/./b").unwrap(), PathBuf::from("a/b"));
        assert_eq!(
            parse_path(root, "/work/root/a").unwrap(),
            PathBuf::from("a")
        );
        assert_eq!(parse_path(root, "/work/root").unwrap(), PathBuf::new());
        assert_eq!(parse_path(root, "").unwrap(), PathBuf::new());
        assert_eq!(parse_path(root, "a/../b").unwrap(), PathBuf::from("a/../b"));
        for bad in [
            "..",
            "../x",
            "a/../../x",
            "/etc/passwd",
            "/work/rootx/a",
            "/work/root/../x",
        ] {
            assert!(
                matches!(parse_path(root, bad), Err(FsError::Escape(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            parse_path(root, "a\0b"),
            Err(FsError::InvalidPath { .. })
        ));
        assert!(matches!(
            parse_path(root, &"a/".repeat(3000)),
            Err(FsError::InvalidPath { .. })
        ));
    }

    /// The kernel (or walk) refusals, with no lexical check in front.
    fn escapes_are_refused(resolver: Resolver) {
        let (_t, path) = tree();
        let root = Root::open(&path, resolver).unwrap();
        assert_eq!(read(&root, "a/b/c/f").unwrap(), "inside");
        assert_eq!(read(&root, "inner/c/f").unwrap(), "inside");
        assert_eq!(read(&root, "a/b/../b/c/f").unwrap(), "inside");
        assert_eq!(read(&root, "inner/../b/c/f").unwrap(), "inside");
        assert_eq!(read(&root, "a/b/c/top/a/b/c/f").unwrap(), "inside");
        for bad in [
            "../secret",
            "a/../../secret",
            "slash/etc/passwd",
            "up/secret",
            "abs",
            "a/b/c/over/secret",
            "inner/../../../secret",
        ] {
            match read(&root, bad) {
                Err(FsError::Escape(_)) => {}
                other => panic!("{resolver:?} {bad}: {:?}", other.map(|_| ())),
            }
        }
        assert!(matches!(read(&root, "loop1"), Err(FsError::Loop(_))));
        assert!(matches!(read(&root, "nope"), Err(FsError::NotFound(_))));
        assert!(matches!(
            read(&root, "a/b/c/f/x"),
            Err(FsError::NotADirectory(_))
        ));
        // Creating through a symlink that leaves the root is refused too.
        let created = root.open_beneath(
            Path::new("up/created"),
            "up/created",
            OFlags::WRONLY | OFlags::CREATE,
            Mode::from_raw_mode(0o644),
        );
        assert!(matches!(created, Err(FsError::Escape(_))));
        assert!(!path.parent().unwrap().join("created").exists());
    }

    #[test]
    fn openat2_refuses_escapes() {
        escapes_are_refused(Resolver::Openat2);
    }

    #[test]
    fn walk_refuses_escapes() {
        escapes_are_refused(Resolver::Walk);
    }

    #[test]
    fn parent_needs_a_name() {
        let (_t, path) = tree();
        let root = Root::open(&path, Resolver::Openat2).unwrap();
        let (_, name) = root.parent(Path::new("a/b"), "a/b").unwrap();
        assert_eq!(name, "b");
        assert!(matches!(
            root.parent(Path::new(""), ""),
            Err(FsError::InvalidPath { .. })
        ));
        assert!(matches!(
            root.parent(Path::new("a/.."), "a/.."),
            Err(FsError::InvalidPath { .. })
        ));
        assert!(matches!(
            root.parent(Path::new("up/x"), "up/x"),
            Err(FsError::Escape(_))
        ));
    }
}
