//! Leases on fork layers: who may still need a layer directory, counted by
//! the kernel across processes.
//!
//! A fork layer is a snapshot directory that nobody asked to keep: the parent
//! writes it, children in any process restore from it, and it must go away
//! when the last of them is gone — including when some of them die by
//! `kill -9`. Each user holds a **lease**: a shared `flock` on the layer's
//! `lease` file, through its own open file description. The kernel drops a
//! dead process's locks, so the count is never wrong.
//!
//! - The writer creates the lease file already locked in the layer's
//!   directory before publishing it, so a layer is never visible unleased.
//! - Anyone restoring a chain takes a lease on every fork layer in it
//!   ([`lease_chain`]) before using it, and keeps them for as long as it may
//!   build on that chain (its next diff) or hand it on (a fork of a fork).
//! - Dropping a lease releases it, then tries an exclusive lock without
//!   waiting: whoever gets it is the last user, unlinks the lease file (so a
//!   late taker sees the layer is gone) and removes the directory.
//! - A layer whose last user was killed is left with no lock held:
//!   [`sweep`] removes every such layer under a directory.
//!
//! Durable snapshots have no lease file and are never removed here.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use rustix::fs::{flock, FlockOperation};

/// The lease file inside a fork layer's directory.
pub const LEASE_FILE: &str = "lease";

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("Fork layer {0} is gone (its last user released it)")]
    Gone(PathBuf),
    #[error("Cannot lease fork layer {0}")]
    Io(PathBuf, #[source] io::Error),
}

/// One user's hold on a fork layer directory.
#[derive(Debug)]
pub struct LayerLease {
    dir: PathBuf,
    file: Option<File>,
}

impl LayerLease {
    /// Creates the lease file of a freshly written layer in `dir`, held by
    /// the caller (tests: a writer creates it before publishing, see
    /// [`LayerLease::open_unpublished`]).
    #[cfg(test)]
    pub(crate) fn create(dir: &Path) -> Result<LayerLease, LeaseError> {
        let file = Self::open_unpublished(&dir.join(LEASE_FILE))
            .map_err(|e| LeaseError::Io(dir.to_path_buf(), e))?;
        Ok(Self::published(dir, file))
    }

    /// Opens (creating it if need be) and locks the lease file at `path`,
    /// in the unpublished directory of a fork layer (see
    /// `SnapshotWriter::unlisted_file`), so that the layer has its lease
    /// from the moment it can be seen, without a rename ([`sweep`] leaves
    /// an unpublished directory alone, so the moment between the create
    /// and the lock is safe). Make the lease with [`LayerLease::published`]
    /// once the directory is.
    pub fn open_unpublished(path: &Path) -> io::Result<File> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)?;
        flock(&file, FlockOperation::LockShared)?;
        Ok(file)
    }

    /// The lease held through `file` (from [`LayerLease::open_unpublished`])
    /// on the fork layer published at `dir`.
    pub fn published(dir: &Path, file: File) -> LayerLease {
        LayerLease {
            dir: dir.to_path_buf(),
            file: Some(file),
        }
    }

    /// Takes a lease on an existing fork layer; `Ok(None)` when `dir` is not
    /// a fork layer (a durable snapshot, which needs none).
    pub fn acquire(dir: &Path) -> Result<Option<LayerLease>, LeaseError> {
        let path = dir.join(LEASE_FILE);
        let io_err = |e| LeaseError::Io(dir.to_path_buf(), e);
        let file = match OpenOptions::new().read(true).open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // A layer being removed has no lease file but still a directory.
                return if dir.join(snapshot::format::MANIFEST_FILE).exists() {
                    Ok(None)
                } else {
                    Err(LeaseError::Gone(dir.to_path_buf()))
                };
            }
            Err(e) => return Err(io_err(e)),
        };
        flock(&file, FlockOperation::LockShared).map_err(|e| io_err(e.into()))?;
        // The last user unlinks the file while holding it exclusively: a lock
        // on an unlinked file is a lease on nothing.
        if file.metadata().map_err(io_err)?.nlink() == 0 {
            return Err(LeaseError::Gone(dir.to_path_buf()));
        }
        Ok(Some(LayerLease {
            dir: dir.to_path_buf(),
            file: Some(file),
        }))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for LayerLease {
    fn drop(&mut self) {
        drop(self.file.take());
        if let Err(e) = remove_if_unused(&self.dir) {
            log::warn!("cannot remove fork layer {}: {e}", self.dir.display());
        }
    }
}

/// Leases every fork layer of a loaded chain (durable snapshots need none).
pub fn lease_chain(chain: &[snapshot::format::Snapshot]) -> Result<Vec<LayerLease>, LeaseError> {
    let mut out = Vec::new();
    for s in chain {
        if let Some(l) = LayerLease::acquire(s.dir())? {
            out.push(l);
        }
    }
    Ok(out)
}

/// Removes `dir` if it is a fork layer nobody holds. Returns whether it did.
fn remove_if_unused(dir: &Path) -> io::Result<bool> {
    let path = dir.join(LEASE_FILE);
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    match flock(&file, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) => return Ok(false),
        Err(e) => return Err(e.into()),
    }
    // Someone may have removed it between our open and our lock.
    if file.metadata()?.nlink() == 0 {
        return Ok(false);
    }
    std::fs::remove_file(&path)?;
    // Out of sight first, so nobody mistakes a half-removed layer for a
    // durable snapshot (a directory with a manifest and no lease file).
    let gone = dir.with_file_name(format!(
        ".gone-{}-{}",
        std::process::id(),
        dir.file_name().and_then(|n| n.to_str()).unwrap_or("layer")
    ));
    std::fs::rename(dir, &gone)?;
    std::fs::remove_dir_all(&gone)?;
    Ok(true)
}

/// Removes every fork layer directly under `dir` that no live process holds
/// (left by a last user that was killed). Returns how many it removed.
pub fn sweep(dir: &Path) -> io::Result<usize> {
    let mut n = 0;
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    for e in entries {
        let e = e?;
        // A layer being written has its lease file, maybe not yet locked,
        // before it is published.
        if snapshot::format::is_unpublished(&e.file_name()) {
            continue;
        }
        let p = e.path();
        if p.join(LEASE_FILE).is_file() && remove_if_unused(&p)? {
            n += 1;
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(root: &Path, name: &str) -> PathBuf {
        let d = root.join(name);
        std::fs::create_dir(&d).unwrap();
        std::fs::write(d.join("data"), b"x").unwrap();
        d
    }

    #[test]
    fn the_last_lease_removes_the_layer() {
        let root = tempfile::tempdir().unwrap();
        let d = layer(root.path(), "l1");
        let a = LayerLease::create(&d).unwrap();
        let b = LayerLease::acquire(&d).unwrap().expect("a fork layer");
        drop(a);
        assert!(d.exists(), "removed while a lease was held");
        drop(b);
        assert!(!d.exists());
        assert!(matches!(LayerLease::acquire(&d), Err(LeaseError::Gone(_))));
    }

    #[test]
    fn a_durable_snapshot_needs_no_lease() {
        let root = tempfile::tempdir().unwrap();
        let d = layer(root.path(), "snap");
        std::fs::write(d.join(snapshot::format::MANIFEST_FILE), b"{}").unwrap();
        assert!(LayerLease::acquire(&d).unwrap().is_none());
        assert_eq!(sweep(root.path()).unwrap(), 0);
        assert!(d.exists());
    }

    #[test]
    fn sweep_removes_only_unheld_layers() {
        let root = tempfile::tempdir().unwrap();
        let held = layer(root.path(), "held");
        let orphan = layer(root.path(), "orphan");
        let keep = LayerLease::create(&held).unwrap();
        // An orphan: a lease file nobody holds, as after its last user's kill -9.
        std::fs::write(orphan.join(LEASE_FILE), b"").unwrap();
        assert_eq!(sweep(root.path()).unwrap(), 1);
        assert!(!orphan.exists());
        assert!(held.exists(), "a held layer was swept");
        drop(keep);
        assert!(!held.exists());
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_layer_is_leased_from_before_it_is_published_and_never_swept_unpublished() {
        let root = tempfile::tempdir().unwrap();
        // Being written: its lease file is there, not yet locked.
        let writing = layer(root.path(), "l2.tmp-0123456789abcdef");
        std::fs::write(writing.join(LEASE_FILE), b"").unwrap();
        assert_eq!(sweep(root.path()).unwrap(), 0);
        assert!(writing.exists(), "a layer being written was swept");
        // Leased in its temporary directory (the file there already, or
        // not), then published by a rename.
        let file = LayerLease::open_unpublished(&writing.join(LEASE_FILE)).unwrap();
        let fin = root.path().join("l2");
        std::fs::rename(&writing, &fin).unwrap();
        let mine = LayerLease::published(&fin, file);
        assert_eq!(mine.dir(), fin);
        assert_eq!(sweep(root.path()).unwrap(), 0, "a held layer was swept");
        let other = LayerLease::acquire(&fin).unwrap().expect("a fork layer");
        drop(mine);
        assert!(fin.exists());
        drop(other);
        assert!(!fin.exists(), "the last lease did not remove it");
    }
}
