//! The seal: a durable record that a snapshot's files were verified, bound
//! to the exact file versions verified, so that a restore in another
//! process does not hash them again.
//!
//! [`seal`] writes `.sealed` in a snapshot directory once every listed
//! file has been verified in full by this process: one line per file, its
//! checksum and its version (device, inode, size, mtime and ctime, in ns).
//! A later load trusts a line only for a file whose version is exactly
//! that and whose listed checksum is that (any write to a file changes its
//! ctime, which user space cannot set back, so a file changed after the
//! seal is verified again), and trusts the seal only if it is owned by
//! root or by this process's user and writable by nobody else. The seal is
//! a name no manifest may list (it starts with a dot). A seal that does
//! not parse, or is over [`MAX_SEAL_BYTES`], is ignored: the files are
//! verified as if there were none.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use super::digest::Checksum;
use super::manifest::Manifest;
use super::verify::{file_version, is_verified, FileVersion};
use super::{Snapshot, SnapshotError};

/// The seal's name in a snapshot directory.
pub const SEAL_FILE: &str = ".sealed";
/// Largest seal read.
pub const MAX_SEAL_BYTES: u64 = 256 * 1024;

/// Writes `snap`'s seal: every listed data file this process has verified
/// in full at its current version (in practice: all of them, right after a
/// [`Snapshot::load`]). Replaces any seal there; written to a temporary
/// name, synced and renamed.
pub fn seal(snap: &Snapshot) -> Result<usize, SnapshotError> {
    seal_with(snap, true, is_verified)
}

fn seal_with(
    snap: &Snapshot,
    durable: bool,
    include: impl Fn(&FileVersion, Checksum) -> bool,
) -> Result<usize, SnapshotError> {
    let dir = snap.dir();
    let (text, n) = lines(dir, snap.manifest(), include)?;
    let tmp = dir.join(format!("{SEAL_FILE}.tmp"));
    let path = dir.join(SEAL_FILE);
    let write = || -> std::io::Result<()> {
        let f = create(&tmp, &text)?;
        if durable {
            f.sync_all()?;
        }
        std::fs::rename(&tmp, &path)?;
        if durable {
            File::open(dir)?.sync_all()?;
        }
        Ok(())
    };
    write().map_err(|err| {
        let _ = std::fs::remove_file(&tmp);
        SnapshotError::io("write", &path, err)
    })?;
    Ok(n)
}

/// Writes the seal of a snapshot that [`super::SnapshotWriter`] wrote and
/// is about to publish, without reading it back: every listed file at its
/// current version, with the checksums of the bytes the writer wrote (a
/// fork layer that child processes load next, a snapshot a fresh worker
/// restores: they trust the writer's data either way). Into the still
/// unpublished directory `dir`, under its own name (nobody reads the
/// directory before the rename that publishes it, and a writer killed
/// before that leaves a directory that never loads), and unsynced: it is
/// written after the data it names (synced first for a durable snapshot,
/// whose directory fsync covers the seal's name), so a seal that survives
/// a crash names file versions that survived too, and a lost or torn one
/// costs only a hash. A file changed after this changes its ctime (on
/// kernels with fine-grained timestamps, those since 6.13, even within the
/// same clock tick: the `fstat` here asks for them), and is verified again.
pub(super) fn seal_unpublished(dir: &Path, m: &Manifest) -> Result<usize, SnapshotError> {
    let (text, n) = lines(dir, m, |_, _| true)?;
    let path = dir.join(SEAL_FILE);
    create(&path, &text).map_err(|err| SnapshotError::io("write", &path, err))?;
    Ok(n)
}

/// The seal's lines for `m`'s listed data files in `dir` that `include`
/// takes, and how many there are.
fn lines(
    dir: &Path,
    m: &Manifest,
    include: impl Fn(&FileVersion, Checksum) -> bool,
) -> Result<(String, usize), SnapshotError> {
    let entries = m
        .memory_layers
        .iter()
        .map(|l| &l.data)
        .chain(m.disk_layers.iter().flat_map(|d| &d.files))
        .chain(&m.files);
    let mut text = String::new();
    let mut n = 0;
    for e in entries {
        let path = dir.join(&e.name);
        let file = File::open(&path).map_err(|err| SnapshotError::io("open", &path, err))?;
        let Some(v) = file_version(&file) else {
            continue;
        };
        if !include(&v, e.checksum) {
            continue;
        }
        let (dev, ino, size, ms, mns, cs, cns) = v;
        text.push_str(&format!(
            "{} {dev} {ino} {size} {ms} {mns} {cs} {cns} {}\n",
            e.checksum, e.name
        ));
        n += 1;
    }
    Ok((text, n))
}

/// Creates (or truncates) `path` with `text`, mode 0644 (a seal writable by
/// others is not trusted).
fn create(path: &Path, text: &str) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o644)
        .open(path)?;
    f.write_all(text.as_bytes())?;
    Ok(f)
}

/// The trusted lines of `dir`'s seal: file name -> (version, checksum).
/// Empty when there is no seal, or it is not to be trusted.
pub(super) fn sealed(dir: &Path) -> HashMap<String, (FileVersion, Checksum)> {
    read(dir).unwrap_or_default()
}

fn read(dir: &Path) -> Option<HashMap<String, (FileVersion, Checksum)>> {
    let mut f = File::open(dir.join(SEAL_FILE)).ok()?;
    let meta = f.metadata().ok()?;
    if !trusted(meta.uid(), meta.mode(), rustix::process::geteuid().as_raw()) {
        return None;
    }
    if meta.len() > MAX_SEAL_BYTES {
        return None;
    }
    let mut text = String::new();
    (&mut f)
        .take(MAX_SEAL_BYTES)
        .read_to_string(&mut text)
        .ok()?;
    parse(&text)
}

/// Whether a seal owned by `uid` with `mode` is trusted by user `euid`.
fn trusted(uid: u32, mode: u32, euid: u32) -> bool {
    (uid == 0 || uid == euid) && mode & 0o022 == 0 && mode & 0o170000 == 0o100000
}

fn parse(text: &str) -> Option<HashMap<String, (FileVersion, Checksum)>> {
    let mut out = HashMap::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        let [sum, dev, ino, size, ms, mns, cs, cns, name] = f.as_slice() else {
            return None;
        };
        let v: FileVersion = (
            dev.parse().ok()?,
            ino.parse().ok()?,
            size.parse().ok()?,
            ms.parse().ok()?,
            mns.parse().ok()?,
            cs.parse().ok()?,
            cns.parse().ok()?,
        );
        out.insert((*name).to_owned(), (v, Checksum::from_hex(sum)?));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_seal_of_root_or_this_user_writable_by_no_one_else_is_trusted() {
        assert!(trusted(0, 0o100644, 65534));
        assert!(trusted(1000, 0o100600, 1000));
        assert!(!trusted(1000, 0o100644, 65534), "another user's");
        assert!(!trusted(0, 0o100664, 65534), "group-writable");
        assert!(!trusted(0, 0o100646, 65534), "world-writable");
        assert!(!trusted(0, 0o120777, 0), "a link");
    }

    #[test]
    fn a_seal_that_does_not_parse_is_ignored_whole() {
        let sum = Checksum(7);
        let good = format!("{sum} 1 2 3 4 5 6 7 memory\n");
        let m = parse(&good).unwrap();
        assert_eq!(m["memory"], ((1, 2, 3, 4, 5, 6, 7), sum));
        assert!(parse(&format!("{good}junk\n")).is_none());
        assert!(parse("zz 1 2 3 4 5 6 7 memory\n").is_none());
        assert!(parse(&format!("{sum} 1 2 3 4 5 6 memory\n")).is_none());
    }
}
