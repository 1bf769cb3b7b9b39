//! The file operations, synchronous (the server runs them on blocking threads).

use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

use super::{FsError, Root};
use crate::protocol::{Bytes, FileInfo, FileKind, WriteMode};

/// Deepest directory tree a recursive remove descends (one descriptor per level).
pub const MAX_REMOVE_DEPTH: usize = 256;

/// A [`FileInfo`] from a stat result.
pub fn file_info(name: &[u8], st: &rfs::Stat) -> FileInfo {
    let (name, raw_name) = match std::str::from_utf8(name) {
        Ok(s) => (s.to_owned(), None),
        Err(_) => (
            String::from_utf8_lossy(name).into_owned(),
            Some(Bytes::from(name.to_vec())),
        ),
    };
    let kind = match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => FileKind::File,
        FileType::Directory => FileKind::Dir,
        FileType::Symlink => FileKind::Symlink,
        _ => FileKind::Other,
    };
    FileInfo {
        name,
        raw_name,
        kind,
        size: st.st_size.max(0) as u64,
        mode: st.st_mode & 0o7777,
        mtime_sec: st.st_mtime,
        mtime_nsec: st.st_mtime_nsec as u32,
    }
}

fn last_is_name(rel: &Path) -> bool {
    matches!(rel.components().next_back(), Some(Component::Normal(_)))
}

/// Describes `rel` without following a final symlink.
pub fn stat(root: &Root, rel: &Path, shown: &str) -> Result<FileInfo, FsError> {
    if !last_is_name(rel) {
        // The root, or a path ending in `..`: a directory.
        let fd = root.open_beneath(rel, shown, OFlags::PATH | OFlags::DIRECTORY, Mode::empty())?;
        let st = rfs::fstat(&fd).map_err(|e| FsError::from_errno("stat", shown, e))?;
        return Ok(file_info(b"", &st));
    }
    let (dir, name) = root.parent(rel, shown)?;
    let st = rfs::statat(&dir, &name, AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| FsError::from_errno("stat", shown, e))?;
    Ok(file_info(name.as_bytes(), &st))
}

/// Lists directory `rel`, handing entries (without `.` and `..`) to `batch` in groups of
/// at most `batch_len`. Entries that vanish while listing are skipped.
pub fn list(
    root: &Root,
    rel: &Path,
    shown: &str,
    batch_len: usize,
    mut batch: impl FnMut(Vec<FileInfo>) -> bool,
) -> Result<(), FsError> {
    let fd = root.open_beneath(
        rel,
        shown,
        OFlags::RDONLY | OFlags::DIRECTORY,
        Mode::empty(),
    )?;
    let err = |e| FsError::from_errno("list", shown, e);
    let dir = rfs::Dir::read_from(&fd).map_err(err)?;
    let mut out = Vec::with_capacity(batch_len);
    for entry in dir {
        let entry = entry.map_err(err)?;
        let name = entry.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        let st = match rfs::statat(&fd, OsStr::from_bytes(name), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => continue,
            Err(e) => return Err(err(e)),
        };
        out.push(file_info(name, &st));
        if out.len() == batch_len
            && !batch(std::mem::replace(&mut out, Vec::with_capacity(batch_len)))
        {
            return Ok(());
        }
    }
    batch(out);
    Ok(())
}

/// Checks that `fd` (opened with `O_NONBLOCK`, so that a FIFO cannot block the open)
/// is a regular file with a single link, and makes it blocking; the file and its stat.
///
/// A second link may be a name outside the root for the same inode (a hard link made
/// inside the root to a file outside it), so a file with more than one link is neither
/// read nor written. The check is on the opened descriptor, so it is about the very
/// inode the caller gets.
fn regular_file(fd: OwnedFd, shown: &str) -> Result<(File, rfs::Stat), FsError> {
    let err = |e| FsError::from_errno("open", shown, e);
    let st = rfs::fstat(&fd).map_err(err)?;
    match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => {}
        FileType::Directory => return Err(FsError::IsADirectory(shown.to_owned())),
        _ => return Err(FsError::NotAFile(shown.to_owned())),
    }
    if st.st_nlink > 1 {
        return Err(FsError::HardLinked(shown.to_owned(), st.st_nlink as u64));
    }
    let fl = rfs::fcntl_getfl(&fd).map_err(err)?;
    rfs::fcntl_setfl(&fd, fl - OFlags::NONBLOCK).map_err(err)?;
    Ok((File::from(fd), st))
}

/// Opens regular file `rel` for reading (symlinks beneath the root are followed).
/// Returns the file and its size. A file with more than one link is refused.
pub fn open_read(root: &Root, rel: &Path, shown: &str) -> Result<(File, u64), FsError> {
    let fd = root.open_beneath(rel, shown, OFlags::RDONLY | OFlags::NONBLOCK, Mode::empty())?;
    let (file, st) = regular_file(fd, shown)?;
    Ok((file, st.st_size.max(0) as u64))
}

/// Opens regular file `rel` for writing as `mode` says, creating it with `perm`. An
/// existing file with more than one link is refused, and untouched: the open does not
/// truncate (`O_TRUNC` would act before the link count could be checked); a truncating
/// write truncates after the check.
pub fn open_write(
    root: &Root,
    rel: &Path,
    shown: &str,
    mode: WriteMode,
    perm: u32,
) -> Result<File, FsError> {
    let mut flags = OFlags::WRONLY | OFlags::CREATE | OFlags::NONBLOCK;
    flags |= match mode {
        WriteMode::Truncate => OFlags::empty(),
        WriteMode::CreateNew => OFlags::EXCL,
        WriteMode::Append => OFlags::APPEND,
    };
    let fd = root.open_beneath(rel, shown, flags, Mode::from_raw_mode(perm & 0o7777))?;
    let (file, st) = regular_file(fd, shown)?;
    if mode == WriteMode::Truncate && st.st_size != 0 {
        rfs::ftruncate(&file, 0).map_err(|e| FsError::from_errno("truncate", shown, e))?;
    }
    Ok(file)
}

/// Creates directory `rel`; with `parents`, its missing parents too, and an existing
/// directory is fine (`mkdir -p`).
pub fn mkdir(
    root: &Root,
    rel: &Path,
    shown: &str,
    parents: bool,
    perm: u32,
) -> Result<(), FsError> {
    let mode = Mode::from_raw_mode(perm & 0o7777);
    if !parents {
        let (dir, name) = root.parent(rel, shown)?;
        return rfs::mkdirat(&dir, &name, mode).map_err(|e| FsError::from_errno("mkdir", shown, e));
    }
    let is_dir =
        |p: &Path| root.open_beneath(p, shown, OFlags::PATH | OFlags::DIRECTORY, Mode::empty());
    let mut prefix = PathBuf::new();
    for c in rel.components() {
        prefix.push(c);
        if !matches!(c, Component::Normal(_)) {
            continue;
        }
        match is_dir(&prefix) {
            Ok(_) => continue,
            Err(FsError::NotFound(_)) => {}
            Err(e) => return Err(e),
        }
        let (dir, name) = root.parent(&prefix, shown)?;
        match rfs::mkdirat(&dir, &name, mode) {
            Ok(()) => {}
            // Made meanwhile by someone else (or a dangling symlink): check it again.
            Err(Errno::EXIST) => {
                is_dir(&prefix)?;
            }
            Err(e) => return Err(FsError::from_errno("mkdir", shown, e)),
        }
    }
    // The root itself, or a path ending in `..`: it must be a directory.
    is_dir(rel).map(|_| ())
}

/// Removes `rel`: a file or symlink, an empty directory, or with `recursive` any
/// directory tree. Symlinks are never followed.
pub fn remove(root: &Root, rel: &Path, shown: &str, recursive: bool) -> Result<(), FsError> {
    let (dir, name) = root.parent(rel, shown)?;
    let err = |e| FsError::from_errno("remove", shown, e);
    let st = rfs::statat(&dir, &name, AtFlags::SYMLINK_NOFOLLOW).map_err(err)?;
    if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
        return rfs::unlinkat(&dir, &name, AtFlags::empty()).map_err(err);
    }
    if recursive {
        remove_tree(&dir, &name, shown, 0)
    } else {
        rfs::unlinkat(&dir, &name, AtFlags::REMOVEDIR).map_err(err)
    }
}

/// Removes directory `name` in `parent` and everything under it.
fn remove_tree(parent: &OwnedFd, name: &OsStr, shown: &str, depth: usize) -> Result<(), FsError> {
    let err = |e| FsError::from_errno("remove", shown, e);
    if depth >= MAX_REMOVE_DEPTH {
        return Err(FsError::TooDeep(shown.to_owned()));
    }
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let fd = match rfs::openat(parent, name, flags, Mode::empty()) {
        Ok(fd) => fd,
        // Replaced by a file or a symlink meanwhile: remove that, do not follow it.
        Err(Errno::NOTDIR | Errno::LOOP) => {
            return rfs::unlinkat(parent, name, AtFlags::empty()).map_err(err)
        }
        Err(e) => return Err(err(e)),
    };
    let mut names = Vec::new();
    for entry in rfs::Dir::read_from(&fd).map_err(err)? {
        let entry = entry.map_err(err)?;
        let n = entry.file_name().to_bytes();
        if n != b"." && n != b".." {
            names.push(OsStr::from_bytes(n).to_owned());
        }
    }
    for n in names {
        match rfs::statat(&fd, &n, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => {
                remove_tree(&fd, &n, shown, depth + 1)?
            }
            Ok(_) => match rfs::unlinkat(&fd, &n, AtFlags::empty()) {
                Ok(()) | Err(Errno::NOENT) => {}
                Err(e) => return Err(err(e)),
            },
            Err(Errno::NOENT) => {}
            Err(e) => return Err(err(e)),
        }
    }
    rfs::unlinkat(parent, name, AtFlags::REMOVEDIR).map_err(err)
}

/// Renames `from` to `to`, both beneath the root.
pub fn rename(root: &Root, from: (&Path, &str), to: (&Path, &str)) -> Result<(), FsError> {
    let (fdir, fname) = root.parent(from.0, from.1)?;
    let (tdir, tname) = root.parent(to.0, to.1)?;
    rfs::renameat(&fdir, &fname, &tdir, &tname).map_err(|e| match e {
        Errno::XDEV => FsError::Io {
            op: "rename across filesystems",
            path: from.1.to_owned(),
            source: e.into(),
        },
        e => FsError::from_errno("rename", from.1, e),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::files::Resolver;
    use std::fs;
    use std::os::unix::fs::symlink;

    #[test]
    fn mkdir_p_list_stat_remove_rename() {
        let t = tempfile::tempdir().unwrap();
        let root = Root::open(t.path(), Resolver::Openat2).unwrap();
        mkdir(&root, Path::new("a/b/c"), "a/b/c", true, 0o755).unwrap();
        mkdir(&root, Path::new("a/b/c"), "a/b/c", true, 0o755).unwrap();
        assert!(matches!(
            mkdir(&root, Path::new("a/b"), "a/b", false, 0o755),
            Err(FsError::AlreadyExists(_))
        ));
        fs::write(t.path().join("a/f"), b"12345").unwrap();
        assert!(matches!(
            mkdir(&root, Path::new("a/f/x"), "a/f/x", true, 0o755),
            Err(FsError::NotADirectory(_))
        ));
        let info = stat(&root, Path::new("a/f"), "a/f").unwrap();
        assert_eq!(
            (info.name.as_str(), info.kind, info.size),
            ("f", FileKind::File, 5)
        );
        let mut all = Vec::new();
        list(&root, Path::new("a"), "a", 1, |b| {
            all.extend(b);
            true
        })
        .unwrap();
        all.sort_by(|x, y| x.name.cmp(&y.name));
        let names: Vec<_> = all.iter().map(|i| (i.name.as_str(), i.kind)).collect();
        assert_eq!(names, [("b", FileKind::Dir), ("f", FileKind::File)]);
        rename(
            &root,
            (Path::new("a/f"), "a/f"),
            (Path::new("a/b/g"), "a/b/g"),
        )
        .unwrap();
        assert_eq!(fs::read(t.path().join("a/b/g")).unwrap(), b"12345");
        assert!(matches!(
            remove(&root, Path::new("a"), "a", false),
            Err(FsError::NotEmpty(_))
        ));
        remove(&root, Path::new("a"), "a", true).unwrap();
        assert!(!t.path().join("a").exists());
    }

    #[test]
    fn recursive_remove_unlinks_symlinks_without_following() {
        let t = tempfile::tempdir().unwrap();
        let outside = t.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("keep"), b"x").unwrap();
        let rootp = t.path().join("root");
        fs::create_dir_all(rootp.join("d/e")).unwrap();
        symlink(&outside, rootp.join("d/e/link")).unwrap();
        let root = Root::open(&rootp, Resolver::Walk).unwrap();
        remove(&root, Path::new("d"), "d", true).unwrap();
        assert!(!rootp.join("d").exists());
        assert!(outside.join("keep").exists());
    }
}
