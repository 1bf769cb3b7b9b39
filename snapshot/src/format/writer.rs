//! [`SnapshotWriter`]: builds a snapshot in `<final>.tmp-<random>` next to its
//! final name and publishes it with one atomic rename.
//!
//! Crash safety: the final name only ever appears through
//! `renameat2(RENAME_NOREPLACE)` of a directory whose files and manifest were
//! all written (and fsynced) first, so a process killed at any point leaves
//! either no directory at the final name or a complete one. A killed writer
//! leaves its `.tmp-*` directory behind; it never loads (it has no manifest
//! until its last step, and is never at the final name) and may be deleted.

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use rustix::fs::{renameat_with, RenameFlags, CWD};

use super::digest::scan_file;
use super::manifest::{
    self, DiskLayerEntry, FileEntry, KernelIdentity, Manifest, MemoryLayerEntry, ParentRef, Shape,
    SnapshotId, FORMAT_VERSION,
};
use super::{
    digest_bytes, random_u128, valid_file_name, Checksum, Snapshot, SnapshotError, MANIFEST_FILE,
    MAX_MEM_BYTES, STATE_FILE,
};
use crate::PAGE_SIZE;

/// What a writer's temporary directory has in its name: `<final>.tmp-<16 hex>`.
const TMP_MARK: &str = ".tmp-";

/// Whether `name` is that of a [`SnapshotWriter`]'s temporary directory,
/// which is still being written (or was left by a killed writer): nothing
/// in it is a snapshot yet.
pub fn is_unpublished(name: &std::ffi::OsStr) -> bool {
    let name = name.as_encoded_bytes();
    name.len() > TMP_MARK.len() + 16
        && name[name.len() - 16..].iter().all(u8::is_ascii_hexdigit)
        && name[..name.len() - 16].ends_with(TMP_MARK.as_bytes())
}

/// Writes one snapshot directory. Dropping it uncommitted removes the
/// temporary directory.
pub struct SnapshotWriter {
    final_dir: PathBuf,
    tmp_dir: PathBuf,
    committed: bool,
    fsync: bool,
    seal: bool,
    id: SnapshotId,
    shape: Shape,
    kernel: KernelIdentity,
    parent: Option<ParentRef>,
    names: HashSet<String>,
    state: Option<(FileEntry, Vec<u8>)>,
    memory_layers: Vec<MemoryLayerEntry>,
    /// Disk layers: name, then the files still to be digested at commit.
    disk_layers: Vec<(String, Vec<String>)>,
    files: Vec<String>,
}

impl SnapshotWriter {
    /// Starts a snapshot that [`SnapshotWriter::commit`] will publish at
    /// `final_dir`. Its parent directory must exist; `final_dir` must not.
    pub fn new(
        final_dir: &Path,
        shape: Shape,
        kernel: KernelIdentity,
    ) -> Result<SnapshotWriter, SnapshotError> {
        let mem = shape.mem_bytes;
        if mem == 0 || mem & (PAGE_SIZE as u64 - 1) != 0 || mem > MAX_MEM_BYTES {
            return Err(SnapshotError::BadShape(format!(
                "memBytes {mem} is not a page multiple in (0, 1 TiB]"
            )));
        }
        if shape.vcpus == 0 {
            return Err(SnapshotError::BadShape("vcpus is 0".into()));
        }
        let bad_path = || SnapshotError::BadPath(final_dir.to_path_buf());
        let name = final_dir.file_name().ok_or_else(bad_path)?;
        let parent = match final_dir.parent() {
            Some(p) if p.as_os_str().is_empty() => Path::new("."),
            Some(p) => p,
            None => return Err(bad_path()),
        };
        if final_dir.symlink_metadata().is_ok() {
            return Err(SnapshotError::Exists(final_dir.to_path_buf()));
        }
        let mut tmp_name = name.to_os_string();
        tmp_name.push(format!("{TMP_MARK}{:016x}", random_u128() as u64));
        let tmp_dir = parent.join(tmp_name);
        fs::create_dir(&tmp_dir).map_err(|e| SnapshotError::io("create", &tmp_dir, e))?;
        Ok(SnapshotWriter {
            final_dir: final_dir.to_path_buf(),
            tmp_dir,
            committed: false,
            fsync: true,
            seal: false,
            id: SnapshotId::random(),
            shape,
            kernel,
            parent: None,
            names: HashSet::from([STATE_FILE.to_string()]),
            state: None,
            memory_layers: Vec::new(),
            disk_layers: Vec::new(),
            files: Vec::new(),
        })
    }

    /// The new snapshot's id.
    pub fn id(&self) -> SnapshotId {
        self.id
    }

    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// The temporary directory files are written into.
    pub fn tmp_dir(&self) -> &Path {
        &self.tmp_dir
    }

    /// Whether [`SnapshotWriter::commit`] fsyncs (default: yes). Without it a
    /// snapshot still survives the writer process being killed, not a power
    /// loss or kernel crash.
    pub fn set_fsync(&mut self, fsync: bool) {
        self.fsync = fsync;
    }

    /// Whether [`SnapshotWriter::commit`] seals the snapshot (default: no):
    /// records that its files are the ones this process wrote, so a restore
    /// in another process checks their versions instead of hashing them.
    /// The seal is written into the directory before it is published,
    /// unsynced: the directory's fsync covers its name, and a seal lost to
    /// a crash costs only a hash.
    pub fn set_seal(&mut self, seal: bool) {
        self.seal = seal;
    }

    /// Records `parent` as the snapshot this one builds on (its shape must
    /// match). A sibling directory is recorded as `../<name>`, anything else
    /// by its canonical path.
    pub fn set_parent(&mut self, parent: &Snapshot) -> Result<(), SnapshotError> {
        if parent.shape() != self.shape {
            return Err(SnapshotError::BadShape(format!(
                "parent shape {:?} differs from {:?}",
                parent.shape(),
                self.shape
            )));
        }
        let canon = |p: &Path| fs::canonicalize(p).map_err(|e| SnapshotError::io("resolve", p, e));
        let pdir = canon(parent.dir())?;
        let mine = canon(&self.tmp_dir)?;
        let path = match (pdir.parent(), mine.parent(), pdir.file_name()) {
            (Some(a), Some(b), Some(name)) if a == b => Path::new("..").join(name),
            _ => pdir,
        };
        self.parent = Some(ParentRef {
            id: parent.id(),
            path,
        });
        Ok(())
    }

    /// Writes the VMM's state blob (`state.bin`).
    pub fn write_state(&mut self, bytes: &[u8]) -> Result<(), SnapshotError> {
        let path = self.tmp_dir.join(STATE_FILE);
        fs::write(&path, bytes).map_err(|e| SnapshotError::io("write", &path, e))?;
        let entry = FileEntry {
            name: STATE_FILE.into(),
            size: bytes.len() as u64,
            checksum: digest_bytes(bytes),
        };
        self.state = Some((entry, bytes.to_vec()));
        Ok(())
    }

    /// Reserves `file` in disk layer `layer` and returns the path to write it
    /// at (the caller creates it). It is digested at commit.
    pub fn add_disk_file(&mut self, layer: &str, file: &str) -> Result<PathBuf, SnapshotError> {
        let path = self.reserve(file)?;
        match self.disk_layers.iter_mut().find(|(n, _)| n == layer) {
            Some((_, files)) => files.push(file.into()),
            None => self.disk_layers.push((layer.into(), vec![file.into()])),
        }
        Ok(path)
    }

    /// Reserves another file (listed under `files`) and returns the path to
    /// write it at. It is digested at commit.
    pub fn add_file(&mut self, name: &str) -> Result<PathBuf, SnapshotError> {
        let path = self.reserve(name)?;
        self.files.push(name.into());
        Ok(path)
    }

    fn reserve(&mut self, name: &str) -> Result<PathBuf, SnapshotError> {
        if !valid_file_name(name) {
            return Err(SnapshotError::BadName(name.into()));
        }
        if !self.names.insert(name.into()) {
            return Err(SnapshotError::DuplicateName(name.into()));
        }
        Ok(self.tmp_dir.join(name))
    }

    /// Reserves `name` for a file the snapshot's directory has beside its
    /// listed ones (a fork layer's lease) and returns its path, for the
    /// caller to create: it is there from the moment the snapshot can be
    /// seen, without a rename of its own. The manifest does not list it; it
    /// is fsynced with the rest.
    pub fn unlisted_file(&mut self, name: &str) -> Result<PathBuf, SnapshotError> {
        self.reserve(name)
    }

    /// Creates a new file for a memory layer (used by `layers`).
    pub(crate) fn create_file(&mut self, name: &str) -> Result<(File, PathBuf), SnapshotError> {
        let path = self.reserve(name)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| SnapshotError::io("create", &path, e))?;
        Ok((file, path))
    }

    pub(crate) fn push_memory_layer(&mut self, layer: MemoryLayerEntry) {
        self.memory_layers.push(layer);
    }

    /// Publishes the snapshot: digests the added files, fsyncs every file,
    /// writes and fsyncs the manifest, fsyncs the directory, renames it to the
    /// final name (refusing if that exists) and fsyncs the parent directory.
    pub fn commit(mut self) -> Result<Snapshot, SnapshotError> {
        let (state, state_bytes) = self.state.take().ok_or(SnapshotError::NoState)?;
        let mut disk_layers = Vec::new();
        for (name, files) in &self.disk_layers {
            let files = files
                .iter()
                .map(|f| self.digest(f))
                .collect::<Result<Vec<_>, _>>()?;
            disk_layers.push(DiskLayerEntry {
                name: name.clone(),
                files,
            });
        }
        let files = self
            .files
            .iter()
            .map(|f| self.digest(f))
            .collect::<Result<Vec<_>, _>>()?;
        let created_unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let manifest = Manifest {
            format_version: FORMAT_VERSION,
            id: self.id,
            created_unix_ms,
            shape: self.shape,
            kernel: self.kernel.clone(),
            parent: self.parent.clone(),
            state,
            memory_layers: self.memory_layers.clone(),
            disk_layers,
            files,
            manifest_checksum: Checksum(0),
        };
        if self.fsync {
            for name in &self.names {
                let path = self.tmp_dir.join(name);
                let file = File::open(&path).map_err(|e| SnapshotError::io("open", &path, e))?;
                file.sync_all()
                    .map_err(|e| SnapshotError::io("fsync", &path, e))?;
            }
        }
        let (bytes, checksum) = manifest::encode(&manifest);
        let mpath = self.tmp_dir.join(MANIFEST_FILE);
        let mut mfile = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&mpath)
            .map_err(|e| SnapshotError::io("create", &mpath, e))?;
        mfile
            .write_all(&bytes)
            .map_err(|e| SnapshotError::io("write", &mpath, e))?;
        if self.seal {
            super::seal::seal_unpublished(&self.tmp_dir, &manifest)?;
        }
        if self.fsync {
            mfile
                .sync_all()
                .map_err(|e| SnapshotError::io("fsync", &mpath, e))?;
            sync_dir(&self.tmp_dir)?;
        }
        publish(&self.tmp_dir, &self.final_dir)?;
        self.committed = true;
        if self.fsync {
            let parent = match self.final_dir.parent() {
                Some(p) if !p.as_os_str().is_empty() => p,
                _ => Path::new("."),
            };
            sync_dir(parent)?;
        }
        let mut manifest = manifest;
        manifest.manifest_checksum = checksum;
        Ok(Snapshot {
            dir: self.final_dir.clone(),
            manifest,
            state: state_bytes,
            page_maps: Vec::new(),
        })
    }

    fn digest(&self, name: &str) -> Result<FileEntry, SnapshotError> {
        let path = self.tmp_dir.join(name);
        let file = File::open(&path).map_err(|e| SnapshotError::io("open", &path, e))?;
        let size = file
            .metadata()
            .map_err(|e| SnapshotError::io("stat", &path, e))?
            .len();
        let scan =
            scan_file(&file, size, |_| true).map_err(|e| SnapshotError::io("read", &path, e))?;
        Ok(FileEntry {
            name: name.into(),
            size,
            checksum: scan.checksum,
        })
    }
}

fn sync_dir(dir: &Path) -> Result<(), SnapshotError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| SnapshotError::io("fsync", dir, e))
}

/// Renames `tmp` to `dest` unless `dest` exists.
fn publish(tmp: &Path, dest: &Path) -> Result<(), SnapshotError> {
    match renameat_with(CWD, tmp, CWD, dest, RenameFlags::NOREPLACE) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::EXIST) | Err(rustix::io::Errno::NOTEMPTY) => {
            Err(SnapshotError::Exists(dest.to_path_buf()))
        }
        // A filesystem without RENAME_NOREPLACE: check, then rename. (A
        // directory renamed onto an empty directory would replace it.)
        Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOSYS) => {
            if dest.symlink_metadata().is_ok() {
                return Err(SnapshotError::Exists(dest.to_path_buf()));
            }
            fs::rename(tmp, dest).map_err(|e| SnapshotError::io("rename", tmp, e))
        }
        Err(e) => Err(SnapshotError::io("rename", tmp, e.into())),
    }
}

impl Drop for SnapshotWriter {
    fn drop(&mut self) {
        if !self.committed {
            if let Err(e) = fs::remove_dir_all(&self.tmp_dir) {
                log::warn!("Cannot remove {}: {e}", self.tmp_dir.display());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{kernel, shape};

    #[test]
    fn round_trip_with_disk_and_extra_files() {
        let dir = tempfile::tempdir().unwrap();
        let fin = dir.path().join("snap");
        let mut w = SnapshotWriter::new(&fin, shape(1 << 20), kernel(dir.path())).unwrap();
        let id = w.id();
        w.write_state(b"vm state").unwrap();
        let disk = w.add_disk_file("vda", "vda.layer").unwrap();
        let f = File::create(&disk).unwrap();
        f.set_len(1 << 30).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, b"block", 12345 * 4096).unwrap();
        fs::write(w.add_file("notes").unwrap(), b"extra").unwrap();
        let tmp = w.tmp_dir().to_path_buf();
        assert!(tmp
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("snap.tmp-"));
        let committed = w.commit().unwrap();
        assert!(!tmp.exists());
        let s = Snapshot::load(&fin).unwrap();
        assert_eq!(s.id(), id);
        assert_eq!(s.state(), b"vm state");
        assert_eq!(s.manifest(), committed.manifest());
        let layer = s.disk_layer("vda").unwrap();
        assert_eq!(layer.files[0].size, 1 << 30);
        assert_eq!(fs::read(s.extra_file("notes").unwrap()).unwrap(), b"extra");
        assert!(s.manifest().parent.is_none());
    }

    #[test]
    fn a_temporary_directory_is_known_by_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let w = SnapshotWriter::new(&dir.path().join("layer-1"), shape(4096), kernel(dir.path()))
            .unwrap();
        assert!(is_unpublished(w.tmp_dir().file_name().unwrap()));
        for name in [
            "layer-1",
            "a.tmp-",
            "a.tmp-0123",
            "a.tmp-0123456789abcdeg",
            ".tmp-",
        ] {
            assert!(!is_unpublished(std::ffi::OsStr::new(name)), "{name}");
        }
        assert!(is_unpublished(std::ffi::OsStr::new(
            "x.tmp-0123456789abcdef"
        )));
    }

    #[test]
    fn dropping_an_uncommitted_writer_removes_its_directory() {
        let dir = tempfile::tempdir().unwrap();
        let mut w =
            SnapshotWriter::new(&dir.path().join("s"), shape(4096), kernel(dir.path())).unwrap();
        w.write_state(b"x").unwrap();
        let tmp = w.tmp_dir().to_path_buf();
        assert!(tmp.exists());
        drop(w);
        assert!(!tmp.exists());
        assert!(!dir.path().join("s").exists());
    }

    #[test]
    fn refuses_an_existing_final_directory_and_bad_names() {
        let dir = tempfile::tempdir().unwrap();
        let fin = dir.path().join("s");
        let k = kernel(dir.path());
        let mut w = SnapshotWriter::new(&fin, shape(4096), k.clone()).unwrap();
        w.write_state(b"x").unwrap();
        assert!(matches!(
            w.add_file("../evil"),
            Err(SnapshotError::BadName(_))
        ));
        assert!(matches!(
            w.add_file(STATE_FILE),
            Err(SnapshotError::DuplicateName(_))
        ));
        fs::create_dir(&fin).unwrap();
        assert!(matches!(w.commit(), Err(SnapshotError::Exists(_))));
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            2,
            "temp dir left"
        );
        assert!(matches!(
            SnapshotWriter::new(&fin, shape(4096), k.clone()),
            Err(SnapshotError::Exists(_))
        ));
        assert!(SnapshotWriter::new(&dir.path().join("t"), shape(100), k).is_err());
    }

    #[test]
    fn commit_needs_state_and_written_files() {
        let dir = tempfile::tempdir().unwrap();
        let k = kernel(dir.path());
        let w = SnapshotWriter::new(&dir.path().join("a"), shape(4096), k.clone()).unwrap();
        assert!(matches!(w.commit(), Err(SnapshotError::NoState)));
        let mut w = SnapshotWriter::new(&dir.path().join("b"), shape(4096), k).unwrap();
        w.write_state(b"x").unwrap();
        w.add_file("never-written").unwrap();
        assert!(matches!(w.commit(), Err(SnapshotError::Missing { .. })));
        assert!(!dir.path().join("b").exists());
    }
}
