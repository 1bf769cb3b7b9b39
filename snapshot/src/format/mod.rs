//! The snapshot directory: its manifest, the crash-safe [`SnapshotWriter`]
//! and the verifying [`Snapshot::load`].
//!
//! ```text
//! <dir>/manifest.json   version, id, shape, kernel, parent, files, checksums
//! <dir>/state.bin       the VMM's opaque state blob
//! <dir>/<layer>         memory layer data (sparse, memBytes long)
//! <dir>/<layer>.map     its page map (present and data bitmaps)
//! <dir>/<disk files>    disk layer files and other added files
//! ```

mod digest;
mod manifest;
pub mod seal;
mod verify;
mod writer;

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

pub use digest::Checksum;
pub use manifest::{
    DiskLayerEntry, FileEntry, KernelIdentity, Manifest, MemoryLayerEntry, MemoryLayerKind,
    ParentRef, Shape, SnapshotId, FORMAT_VERSION,
};
pub use writer::{is_unpublished, SnapshotWriter};

pub(crate) use digest::{data_extents, digest_bytes, is_zero, SparseHasher};
pub(crate) use manifest::random_u128;
pub(crate) use verify::read_page_map;

/// The crate-private manifest parser, for the `fuzz/` crate only: not an API.
#[doc(hidden)]
pub mod fuzzing {
    use std::path::Path;

    use super::{manifest, Manifest, SnapshotError, MANIFEST_FILE};

    /// `manifest.json`'s parser, as [`super::Snapshot::load`] runs it.
    pub fn decode_manifest(bytes: &[u8]) -> Result<Manifest, SnapshotError> {
        manifest::decode(bytes, Path::new(MANIFEST_FILE))
    }

    /// The bytes the snapshot writer writes for `m`.
    pub fn encode_manifest(m: &Manifest) -> Vec<u8> {
        manifest::encode(m).0
    }

    /// Puts the checksum the parser expects into `bytes`, where it looks for
    /// it; false if there is no place for one.
    pub fn seal_manifest(bytes: &mut [u8]) -> bool {
        manifest::seal(bytes)
    }
}

/// The manifest's file name.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The state blob's file name.
pub const STATE_FILE: &str = "state.bin";
/// Longest parent chain [`Snapshot::load_chain`] follows.
pub const MAX_CHAIN_DEPTH: usize = 64;
/// Largest manifest read.
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;
/// Largest state blob read.
pub const MAX_STATE_BYTES: u64 = 256 << 20;
/// Largest RAM offset space accepted (1 TiB).
pub const MAX_MEM_BYTES: u64 = 1 << 40;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("Snapshot directory {0} already exists")]
    Exists(PathBuf),
    #[error("Snapshot path {0} has no parent directory or no name")]
    BadPath(PathBuf),
    #[error("Invalid snapshot file name {0:?}")]
    BadName(String),
    #[error("File name {0:?} is used twice in one snapshot")]
    DuplicateName(String),
    #[error("Snapshot has no state blob")]
    NoState,
    #[error("Invalid snapshot shape: {0}")]
    BadShape(String),
    #[error("Cannot {op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("Snapshot file {path} is missing")]
    Missing { path: PathBuf },
    #[error("Snapshot file {path} is truncated: {actual} bytes, expected {expected}")]
    Truncated {
        path: PathBuf,
        actual: u64,
        expected: u64,
    },
    #[error("Snapshot file {path} is too long: {actual} bytes, expected {expected}")]
    TooLong {
        path: PathBuf,
        actual: u64,
        expected: u64,
    },
    #[error("Checksum mismatch in snapshot file {path}")]
    ChecksumMismatch { path: PathBuf },
    #[error("Unsupported snapshot format version {found} in {path} (supported: {supported})")]
    Version {
        path: PathBuf,
        found: u64,
        supported: u32,
    },
    #[error("Snapshot manifest {path} is not valid JSON for this format")]
    Malformed {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("Snapshot file {path} is invalid: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error("Snapshot chain from {0} is longer than {MAX_CHAIN_DEPTH} snapshots")]
    ChainTooDeep(PathBuf),
    #[error("Snapshot chain loops: {path} is snapshot {id} again")]
    ChainLoop { path: PathBuf, id: SnapshotId },
    #[error("Parent snapshot {path} does not fit its child: {reason}")]
    ChainMismatch { path: PathBuf, reason: String },
}

impl SnapshotError {
    pub(crate) fn io(op: &'static str, path: &Path, source: io::Error) -> SnapshotError {
        if source.kind() == io::ErrorKind::NotFound {
            return SnapshotError::Missing {
                path: path.to_path_buf(),
            };
        }
        SnapshotError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// A loaded, verified snapshot.
#[derive(Clone, Debug)]
pub struct Snapshot {
    dir: PathBuf,
    manifest: Manifest,
    state: Vec<u8>,
    /// Its memory layers' page maps, decoded and checked by the load that
    /// verified it, in manifest order (empty for a snapshot just written):
    /// a [`crate::LayerStack`] takes them instead of reading them again.
    page_maps: Vec<std::sync::Arc<crate::layers::PageMap>>,
}

impl Snapshot {
    /// Loads `dir` and verifies it: the manifest's version and checksum, then
    /// every listed file's presence, size and checksum (sparse files are read
    /// only where they hold data), and each memory layer against its page map.
    pub fn load(dir: &Path) -> Result<Snapshot, SnapshotError> {
        verify::load(dir, verify::Data::Hash)
    }

    /// Loads `dir` as [`Snapshot::load`] does, but takes its data files
    /// (memory layers, disk layers, other listed files) at the checksums its
    /// manifest lists instead of hashing them: for a process that has just
    /// had the snapshot written by a writer whose word it takes for those,
    /// as every restore does already once the writer has sealed the
    /// snapshot (docs/snapshot-format.md, "Loading"). Everything else
    /// is checked: the manifest, the state blob and each page map (read
    /// and checksummed in full), and each data file's presence and size.
    /// The data files are then remembered as verified at their current
    /// versions, so [`seal::seal`] seals them.
    pub fn load_written(dir: &Path) -> Result<Snapshot, SnapshotError> {
        verify::load(dir, verify::Data::AsListed)
    }

    /// Loads `dir` and its ancestors through their parent links, each verified
    /// as by [`Snapshot::load`], and returns them base first. Refuses a chain
    /// longer than [`MAX_CHAIN_DEPTH`], one that loops, and a parent whose id,
    /// shape or kernel differ from what its child recorded.
    pub fn load_chain(dir: &Path) -> Result<Vec<Snapshot>, SnapshotError> {
        verify::load_chain(dir)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Memory layer `i`'s page map, as its load checked it (`None` for a
    /// snapshot that was written, not loaded).
    pub(crate) fn page_map(&self, i: usize) -> Option<&std::sync::Arc<crate::layers::PageMap>> {
        self.page_maps.get(i)
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn id(&self) -> SnapshotId {
        self.manifest.id
    }

    pub fn shape(&self) -> Shape {
        self.manifest.shape
    }

    pub fn kernel(&self) -> &KernelIdentity {
        &self.manifest.kernel
    }

    /// The verified state blob.
    pub fn state(&self) -> &[u8] {
        &self.state
    }

    /// The parent's directory, resolved against this snapshot's directory.
    pub fn parent_dir(&self) -> Option<PathBuf> {
        self.manifest
            .parent
            .as_ref()
            .map(|p| self.dir.join(&p.path))
    }

    /// Path of a file listed in the manifest (a disk layer file, an added
    /// file, a memory layer file).
    pub fn file_path(&self, entry: &FileEntry) -> PathBuf {
        self.dir.join(&entry.name)
    }

    /// The disk layer called `name`, if this snapshot has one. A block
    /// device's layer lists its data file, then its page map.
    pub fn disk_layer(&self, name: &str) -> Option<&DiskLayerEntry> {
        self.manifest.disk_layers.iter().find(|d| d.name == name)
    }

    /// The added file called `name`, if this snapshot has one.
    pub fn extra_file(&self, name: &str) -> Option<PathBuf> {
        self.manifest
            .files
            .iter()
            .find(|f| f.name == name)
            .map(|f| self.file_path(f))
    }
}

/// Writes `m` as `dir`'s `manifest.json`, with its checksum filled in: for
/// tools that rename or replace listed files (and tests of odd snapshots).
/// The files it lists are checked by the next [`Snapshot::load`], as always.
pub fn rewrite_manifest(dir: &Path, m: &Manifest) -> Result<(), SnapshotError> {
    let (bytes, _) = manifest::encode(m);
    let path = dir.join(MANIFEST_FILE);
    std::fs::write(&path, bytes).map_err(|e| SnapshotError::io("write", &path, e))
}

/// Whether `name` may name a file in a snapshot directory: 1 to 128 of
/// `[A-Za-z0-9._-]`, not starting with a dot, not the manifest.
pub fn valid_file_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name != MANIFEST_FILE
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl KernelIdentity {
    /// The identity of the kernel file at `path`. Digests are cached per
    /// (device, inode, size, mtime, ctime), so asking again is cheap.
    pub fn of_file(path: &Path) -> Result<KernelIdentity, SnapshotError> {
        type Key = (u64, u64, u64, i64, i64, i64, i64);
        static CACHE: OnceLock<Mutex<HashMap<Key, Checksum>>> = OnceLock::new();
        let file = File::open(path).map_err(|e| SnapshotError::io("open", path, e))?;
        let md = file
            .metadata()
            .map_err(|e| SnapshotError::io("stat", path, e))?;
        let key = (
            md.dev(),
            md.ino(),
            md.size(),
            md.mtime(),
            md.mtime_nsec(),
            md.ctime(),
            md.ctime_nsec(),
        );
        let cache = CACHE.get_or_init(Default::default);
        let cached = cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
            .copied();
        let checksum = match cached {
            Some(c) => c,
            None => {
                let c = digest::scan_file(&file, md.size(), |_| true)
                    .map_err(|e| SnapshotError::io("read", path, e))?
                    .checksum;
                cache
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(key, c);
                c
            }
        };
        Ok(KernelIdentity {
            path: path.to_path_buf(),
            size: md.size(),
            checksum,
        })
    }

    /// Same contents (the path is not compared).
    pub fn same_kernel(&self, other: &KernelIdentity) -> bool {
        self.size == other.size && self.checksum == other.checksum
    }
}

/// Points the diff snapshot in `dir` at its parent's new directory
/// `parent_dir`, for a chain that was copied elsewhere (an import on
/// another node): `manifest.json` is read and checked, its parent path
/// replaced, and written again (its checksum made anew) through a
/// temporary file renamed over it, then synced. Nothing else changes: the
/// parent's id is kept, so a load still refuses a parent that is not the
/// one recorded. False if the snapshot has no parent or already points
/// there. A seal (see [`seal`]) of `dir` is stale after this: seal again.
pub fn relink_parent(dir: &Path, parent_dir: &Path) -> Result<bool, SnapshotError> {
    let path = dir.join(MANIFEST_FILE);
    let bytes = std::fs::read(&path).map_err(|e| SnapshotError::io("read", &path, e))?;
    let mut m = manifest::decode(&bytes, &path)?;
    let Some(parent) = m.parent.as_mut() else {
        return Ok(false);
    };
    if parent.path == parent_dir {
        return Ok(false);
    }
    parent.path = parent_dir.to_path_buf();
    let (out, _) = manifest::encode(&m);
    let tmp = dir.join(".manifest.json.relink");
    let write = || -> io::Result<()> {
        use std::io::Write as _;
        let mut f = File::create(&tmp)?;
        f.write_all(&out)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        File::open(dir)?.sync_all()
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        SnapshotError::io("rewrite", &path, e)
    })?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names() {
        assert!(valid_file_name("mem-0.map"));
        assert!(!valid_file_name("../x"));
        assert!(!valid_file_name(".hidden"));
        assert!(!valid_file_name("a/b"));
        assert!(!valid_file_name(MANIFEST_FILE));
        assert!(!valid_file_name(""));
        assert!(!valid_file_name(&"a".repeat(129)));
    }

    #[test]
    fn kernel_identity_tracks_contents() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("vmlinux");
        std::fs::write(&p, b"kernel one").unwrap();
        let a = KernelIdentity::of_file(&p).unwrap();
        assert!(a.same_kernel(&KernelIdentity::of_file(&p).unwrap()));
        std::fs::write(&p, b"kernel number two").unwrap();
        let b = KernelIdentity::of_file(&p).unwrap();
        assert!(!a.same_kernel(&b));
        assert!(matches!(
            KernelIdentity::of_file(&dir.path().join("none")),
            Err(SnapshotError::Missing { .. })
        ));
    }
}
