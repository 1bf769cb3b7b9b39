//! [`Snapshot::load`] and [`Snapshot::load_chain`]: every check a snapshot
//! passes before anything uses it.

use std::collections::HashSet;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::digest::{scan_file, Checksum};
use super::manifest::{self, FileEntry, Manifest, MemoryLayerEntry, MemoryLayerKind};
use super::{
    digest_bytes, valid_file_name, Snapshot, SnapshotError, MANIFEST_FILE, MAX_CHAIN_DEPTH,
    MAX_MANIFEST_BYTES, MAX_MEM_BYTES, MAX_STATE_BYTES, STATE_FILE,
};
use crate::layers::PageMap;
use crate::PAGE_SIZE;

/// What a load does with a snapshot's data files.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Data {
    /// Hashes each (unless verified before at its version, or sealed).
    Hash,
    /// Takes each at its listed checksum ([`Snapshot::load_written`]).
    AsListed,
}

pub(super) fn load(dir: &Path, data: Data) -> Result<Snapshot, SnapshotError> {
    let path = dir.join(MANIFEST_FILE);
    let bytes = read_bounded(&path, MAX_MANIFEST_BYTES)?;
    let manifest = manifest::decode(&bytes, &path)?;
    check_manifest(&manifest, &path)?;
    let state = read_verified(dir, &manifest.state, MAX_STATE_BYTES)?;
    // What a trusted seal says was verified, bound to exact file versions.
    let sealed = super::seal::sealed(dir);
    let page_maps = manifest
        .memory_layers
        .iter()
        .map(|l| verify_memory_layer(dir, l, manifest.shape.mem_bytes, &sealed, data).map(Arc::new))
        .collect::<Result<Vec<_>, _>>()?;
    for entry in manifest.disk_layers.iter().flat_map(|d| &d.files) {
        verify_file(dir, entry, &sealed, data)?;
    }
    for entry in &manifest.files {
        verify_file(dir, entry, &sealed, data)?;
    }
    Ok(Snapshot {
        dir: dir.to_path_buf(),
        manifest,
        state,
        page_maps,
    })
}

pub(super) fn load_chain(dir: &Path) -> Result<Vec<Snapshot>, SnapshotError> {
    let mut chain = vec![load(dir, Data::Hash)?];
    let mut seen = HashSet::from([chain[0].id()]);
    loop {
        let child = chain.last().expect("chain is never empty");
        let Some(parent) = child.manifest.parent.clone() else {
            break;
        };
        if chain.len() >= MAX_CHAIN_DEPTH {
            return Err(SnapshotError::ChainTooDeep(dir.to_path_buf()));
        }
        let pdir = child.dir.join(&parent.path);
        let mismatch = |reason: String| SnapshotError::ChainMismatch {
            path: pdir.clone(),
            reason,
        };
        let p = load(&pdir, Data::Hash)?;
        if p.id() != parent.id {
            return Err(mismatch(format!(
                "its id is {}, the child expects {}",
                p.id(),
                parent.id
            )));
        }
        if !seen.insert(p.id()) {
            return Err(SnapshotError::ChainLoop {
                path: pdir.clone(),
                id: p.id(),
            });
        }
        if p.shape() != child.shape() {
            return Err(mismatch(format!(
                "shape {:?} differs from the child's {:?}",
                p.shape(),
                child.shape()
            )));
        }
        if !p.kernel().same_kernel(child.kernel()) {
            return Err(mismatch("it was taken with another kernel".into()));
        }
        chain.push(p);
    }
    chain.reverse();
    Ok(chain)
}

/// Structural checks the checksum cannot give: sane shape, plain and unique
/// file names.
fn check_manifest(m: &Manifest, path: &Path) -> Result<(), SnapshotError> {
    let invalid = |reason: String| SnapshotError::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    let mem = m.shape.mem_bytes;
    if mem == 0 || mem & (PAGE_SIZE as u64 - 1) != 0 || mem > MAX_MEM_BYTES {
        return Err(invalid(format!(
            "memBytes {mem} is not a page multiple in (0, 1 TiB]"
        )));
    }
    if m.shape.vcpus == 0 {
        return Err(invalid("vcpus is 0".into()));
    }
    let mut names = HashSet::new();
    let all = std::iter::once(&m.state)
        .chain(m.memory_layers.iter().flat_map(|l| [&l.data, &l.page_map]))
        .chain(m.disk_layers.iter().flat_map(|d| &d.files))
        .chain(&m.files);
    for e in all {
        if !valid_file_name(&e.name) {
            return Err(invalid(format!("bad file name {:?}", e.name)));
        }
        if !names.insert(e.name.as_str()) {
            return Err(invalid(format!("file {:?} is listed twice", e.name)));
        }
    }
    if m.state.name != STATE_FILE {
        return Err(invalid(format!("state file is {:?}", m.state.name)));
    }
    Ok(())
}

/// Opens a listed file and checks its size against the manifest.
fn open_sized(dir: &Path, entry: &FileEntry) -> Result<(File, PathBuf), SnapshotError> {
    let path = dir.join(&entry.name);
    let file = File::open(&path).map_err(|e| SnapshotError::io("open", &path, e))?;
    let actual = file
        .metadata()
        .map_err(|e| SnapshotError::io("stat", &path, e))?
        .len();
    check_size(&path, actual, entry.size)?;
    Ok((file, path))
}

fn check_size(path: &Path, actual: u64, expected: u64) -> Result<(), SnapshotError> {
    let path = path.to_path_buf();
    if actual < expected {
        return Err(SnapshotError::Truncated {
            path,
            actual,
            expected,
        });
    }
    if actual > expected {
        return Err(SnapshotError::TooLong {
            path,
            actual,
            expected,
        });
    }
    Ok(())
}

/// A file version: device, inode, size, mtime and ctime (ns). Any write to
/// the file changes its ctime, which user space cannot set back.
pub(super) type FileVersion = (u64, u64, u64, i64, i64, i64, i64);

pub(super) fn file_version(file: &File) -> Option<FileVersion> {
    use std::os::unix::fs::MetadataExt;
    let m = file.metadata().ok()?;
    Some((
        m.dev(),
        m.ino(),
        m.size(),
        m.mtime(),
        m.mtime_nsec(),
        m.ctime(),
        m.ctime_nsec(),
    ))
}

/// File versions this process has verified in full against a checksum: a
/// restore of the same unchanged snapshot does not hash its data again.
fn verified() -> &'static std::sync::Mutex<std::collections::HashMap<FileVersion, Checksum>> {
    static CACHE: std::sync::OnceLock<
        std::sync::Mutex<std::collections::HashMap<FileVersion, Checksum>>,
    > = std::sync::OnceLock::new();
    CACHE.get_or_init(Default::default)
}

#[cfg(test)]
thread_local! {
    /// Files this thread hashed (tests: whether a load hashed at all).
    static HASHED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

fn count_hash() {
    #[cfg(test)]
    HASHED.with(|h| h.set(h.get() + 1));
}

/// Forgets every verification this process remembers (tests: a restore in
/// a new process).
#[cfg(test)]
pub(super) fn forget_verified() {
    verified().lock().unwrap_or_else(|p| p.into_inner()).clear();
}

/// Bound on remembered verifications (old entries are forgotten wholesale).
const MAX_VERIFIED: usize = 4096;

/// Whether this process verified version `v` against `checksum`.
pub(super) fn is_verified(v: &FileVersion, checksum: Checksum) -> bool {
    let cache = verified().lock().unwrap_or_else(|p| p.into_inner());
    cache.get(v) == Some(&checksum)
}

/// Whether `file` (listed as `entry` in `dir`'s manifest) needs no hashing:
/// this process verified it at its current version, `sealed` (the
/// directory's trusted seal, [`super::seal`]) records that version and
/// checksum, or the load takes data files as listed ([`Data::AsListed`]).
/// A version taken so is remembered as verified.
fn verified_before(
    file: &File,
    entry: &FileEntry,
    sealed: &std::collections::HashMap<String, (FileVersion, Checksum)>,
    data: Data,
) -> bool {
    let Some(v) = file_version(file) else {
        return false;
    };
    if is_verified(&v, entry.checksum) {
        return true;
    }
    let ok = data == Data::AsListed || sealed.get(&entry.name) == Some(&(v, entry.checksum));
    if ok {
        remember_verified(file, entry.checksum);
    }
    ok
}

fn remember_verified(file: &File, checksum: Checksum) {
    if let Some(v) = file_version(file) {
        let mut cache = verified().lock().unwrap_or_else(|p| p.into_inner());
        if cache.len() >= MAX_VERIFIED {
            cache.clear();
        }
        cache.insert(v, checksum);
    }
}

fn verify_file(
    dir: &Path,
    entry: &FileEntry,
    sealed: &std::collections::HashMap<String, (FileVersion, Checksum)>,
    data: Data,
) -> Result<(), SnapshotError> {
    let (file, path) = open_sized(dir, entry)?;
    if verified_before(&file, entry, sealed, data) {
        return Ok(());
    }
    count_hash();
    let scan =
        scan_file(&file, entry.size, |_| true).map_err(|e| SnapshotError::io("read", &path, e))?;
    if scan.checksum != entry.checksum {
        return Err(SnapshotError::ChecksumMismatch { path });
    }
    remember_verified(&file, entry.checksum);
    Ok(())
}

/// Reads a whole listed file (at most `max` bytes) and checks its digest.
fn read_verified(dir: &Path, entry: &FileEntry, max: u64) -> Result<Vec<u8>, SnapshotError> {
    let path = dir.join(&entry.name);
    if entry.size > max {
        return Err(SnapshotError::Invalid {
            path,
            reason: format!("{} bytes is more than the {max} allowed", entry.size),
        });
    }
    let (mut file, path) = open_sized(dir, entry)?;
    let mut bytes = Vec::with_capacity(entry.size as usize);
    file.read_to_end(&mut bytes)
        .map_err(|e| SnapshotError::io("read", &path, e))?;
    check_size(&path, bytes.len() as u64, entry.size)?;
    if digest_bytes(&bytes) != entry.checksum {
        return Err(SnapshotError::ChecksumMismatch { path });
    }
    Ok(bytes)
}

/// Reads and checks a layer's page map (shared with `LayerStack::open`).
pub(crate) fn read_page_map(
    dir: &Path,
    layer: &MemoryLayerEntry,
    mem_bytes: u64,
) -> Result<PageMap, SnapshotError> {
    let pages = mem_bytes / PAGE_SIZE as u64;
    let path = dir.join(&layer.page_map.name);
    let invalid = |reason: String| SnapshotError::Invalid {
        path: path.clone(),
        reason,
    };
    let expected = PageMap::encoded_len(pages);
    if layer.page_map.size != expected {
        return Err(invalid(format!(
            "listed as {} bytes, a page map for {pages} pages is {expected}",
            layer.page_map.size
        )));
    }
    let bytes = read_verified(dir, &layer.page_map, expected)?;
    let map = PageMap::decode(&bytes, pages).map_err(|r| invalid(r.into()))?;
    let present = map.present_count();
    let data = map.data_count();
    if layer.kind == MemoryLayerKind::Full && present != pages {
        return Err(invalid("a full layer's page map lacks pages".into()));
    }
    if present != layer.pages_present || data != layer.data_pages {
        return Err(invalid(format!(
            "holds {present} present and {data} data pages, the manifest says {} and {}",
            layer.pages_present, layer.data_pages
        )));
    }
    Ok(map)
}

fn verify_memory_layer(
    dir: &Path,
    layer: &MemoryLayerEntry,
    mem_bytes: u64,
    sealed: &std::collections::HashMap<String, (FileVersion, Checksum)>,
    data: Data,
) -> Result<PageMap, SnapshotError> {
    let map = read_page_map(dir, layer, mem_bytes)?;
    let (file, path) = open_sized(dir, &layer.data)?;
    if layer.data.size != mem_bytes {
        return Err(SnapshotError::Invalid {
            path,
            reason: format!(
                "listed as {} bytes, memBytes is {mem_bytes}",
                layer.data.size
            ),
        });
    }
    if verified_before(&file, &layer.data, sealed, data) {
        return Ok(map);
    }
    count_hash();
    let scan = scan_file(&file, mem_bytes, |pfn| map.has_data(pfn))
        .map_err(|e| SnapshotError::io("read", &path, e))?;
    if scan.checksum != layer.data.checksum {
        return Err(SnapshotError::ChecksumMismatch { path });
    }
    if scan.unexpected_chunk.is_some() || scan.data_chunks != layer.data_pages {
        return Err(SnapshotError::Invalid {
            path,
            reason: "its data pages do not match its page map".into(),
        });
    }
    remember_verified(&file, layer.data.checksum);
    Ok(map)
}

fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>, SnapshotError> {
    let file = File::open(path).map_err(|e| SnapshotError::io("open", path, e))?;
    let mut bytes = Vec::new();
    file.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| SnapshotError::io("read", path, e))?;
    if bytes.len() as u64 > max {
        return Err(SnapshotError::Invalid {
            path: path.to_path_buf(),
            reason: format!("longer than {max} bytes"),
        });
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::manifest::{encode, ParentRef, SnapshotId};
    use crate::format::Checksum;
    use crate::layers::DirtyBitmap;
    use crate::testutil::{diff, fill, full, kernel, shape};
    use crate::SnapshotWriter;

    /// Rewrites `dir`'s manifest through `f`, with a valid checksum.
    fn rewrite(dir: &Path, f: impl FnOnce(&mut Manifest)) {
        let path = dir.join(MANIFEST_FILE);
        let mut m = manifest::decode(&std::fs::read(&path).unwrap(), &path).unwrap();
        f(&mut m);
        std::fs::write(&path, encode(&m).0).unwrap();
    }

    fn chain(dir: &Path, n: usize) -> Vec<Snapshot> {
        let mut ram = vec![0u8; 16 * PAGE_SIZE];
        fill(&mut ram, 0, 1);
        let mut out = vec![full(dir, "s0", &ram)];
        for i in 1..n {
            let mut dirty = DirtyBitmap::new(16);
            fill(&mut ram, i as u64 % 16, i as u8);
            dirty.set(i as u64 % 16);
            let s = diff(dir, &format!("s{i}"), out.last().unwrap(), &ram, &dirty);
            out.push(s);
        }
        out
    }

    #[test]
    fn chain_is_base_first_and_parents_are_relative() {
        let dir = tempfile::tempdir().unwrap();
        let c = chain(dir.path(), 3);
        let loaded = Snapshot::load_chain(c[2].dir()).unwrap();
        let ids: Vec<_> = loaded.iter().map(|s| s.id()).collect();
        assert_eq!(ids, c.iter().map(|s| s.id()).collect::<Vec<_>>());
        let parent = c[2].manifest().parent.as_ref().unwrap();
        assert_eq!(parent.path, Path::new("../s1"));
    }

    #[test]
    fn a_chain_copied_elsewhere_loads_once_relinked_and_not_to_another_parent() {
        let dir = tempfile::tempdir().unwrap();
        let c = chain(dir.path(), 2);
        // Copied as an import on another node would: each snapshot in its own
        // directory, the parent no longer at the path the child recorded.
        let other = tempfile::tempdir().unwrap();
        let (p, k) = (other.path().join("a/s"), other.path().join("b/s"));
        for (from, to) in [(c[0].dir(), &p), (c[1].dir(), &k)] {
            std::fs::create_dir_all(to).unwrap();
            for e in std::fs::read_dir(from).unwrap() {
                let e = e.unwrap();
                std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
            }
        }
        assert!(
            Snapshot::load_chain(&k).is_err(),
            "the old parent path is gone"
        );
        assert!(crate::format::relink_parent(&k, &p).unwrap());
        assert!(
            !crate::format::relink_parent(&k, &p).unwrap(),
            "already there"
        );
        let loaded = Snapshot::load_chain(&k).unwrap();
        assert_eq!(loaded.len(), 2);
        assert_eq!(loaded[0].id(), c[0].id());
        // Pointed at a snapshot that is not its parent: refused on load.
        std::fs::create_dir_all(other.path().join("x")).unwrap();
        let stranger = chain(&other.path().join("x"), 1);
        crate::format::relink_parent(&k, stranger[0].dir()).unwrap();
        assert!(Snapshot::load_chain(&k).is_err());
        // A base has no parent to relink.
        assert!(!crate::format::relink_parent(&p, &k).unwrap());
    }

    #[test]
    fn chain_refuses_loops_mismatches_and_depth() {
        let dir = tempfile::tempdir().unwrap();
        let c = chain(dir.path(), 2);
        let (s0, s1) = (c[0].dir(), c[1].dir());
        let p1 = c[1].manifest().parent.clone();
        let s1_id = c[1].id();
        // s0 -> s1 -> s0: a loop.
        rewrite(s0, |m| {
            m.parent = Some(ParentRef {
                id: s1_id,
                path: "../s1".into(),
            })
        });
        let e = Snapshot::load_chain(s1).unwrap_err();
        assert!(matches!(e, SnapshotError::ChainLoop { .. }), "{e}");
        rewrite(s0, |m| m.parent = None);
        // The parent is not the snapshot the child recorded.
        rewrite(s1, |m| m.parent.as_mut().unwrap().id = SnapshotId(5));
        let e = Snapshot::load_chain(s1).unwrap_err();
        assert!(matches!(e, SnapshotError::ChainMismatch { .. }), "{e}");
        rewrite(s1, |m| m.parent = p1.clone());
        // Another shape or kernel.
        rewrite(s0, |m| m.shape.vcpus = 2);
        let e = Snapshot::load_chain(s1).unwrap_err();
        assert!(e.to_string().contains("shape"), "{e}");
        rewrite(s0, |m| {
            m.shape.vcpus = 1;
            m.kernel.checksum = Checksum(1);
        });
        let e = Snapshot::load_chain(s1).unwrap_err();
        assert!(e.to_string().contains("kernel"), "{e}");
        // A snapshot that is its own parent.
        let s0_id = c[0].id();
        rewrite(s0, |m| {
            m.kernel = c[1].kernel().clone();
            m.parent = Some(ParentRef {
                id: s0_id,
                path: ".".into(),
            });
        });
        let e = Snapshot::load_chain(s0).unwrap_err();
        assert!(matches!(e, SnapshotError::ChainLoop { .. }), "{e}");
    }

    #[test]
    fn chain_depth_is_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let c = chain(dir.path(), MAX_CHAIN_DEPTH);
        Snapshot::load_chain(c.last().unwrap().dir()).unwrap();
        let mut ram = vec![0u8; 16 * PAGE_SIZE];
        fill(&mut ram, 0, 1);
        let over = diff(
            dir.path(),
            "over",
            c.last().unwrap(),
            &ram,
            &DirtyBitmap::new(16),
        );
        let e = Snapshot::load_chain(over.dir()).unwrap_err();
        assert!(matches!(e, SnapshotError::ChainTooDeep(_)), "{e}");
    }

    #[test]
    fn manifest_checks_beyond_the_checksum() {
        let dir = tempfile::tempdir().unwrap();
        let mut w =
            SnapshotWriter::new(&dir.path().join("s"), shape(PAGE_SIZE), kernel(dir.path()))
                .unwrap();
        w.write_state(b"x").unwrap();
        let s = w.commit().unwrap();
        rewrite(s.dir(), |m| m.state.name = "../../etc/passwd".into());
        let e = Snapshot::load(s.dir()).unwrap_err();
        assert!(e.to_string().contains("bad file name"), "{e}");
        rewrite(s.dir(), |m| {
            m.state.name = STATE_FILE.into();
            m.shape.mem_bytes = 4097;
        });
        let e = Snapshot::load(s.dir()).unwrap_err();
        assert!(e.to_string().contains("memBytes"), "{e}");
    }

    #[test]
    fn a_file_changed_in_place_after_a_good_load_is_verified_again() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let mut ram = vec![0u8; 64 * crate::PAGE_SIZE];
        crate::testutil::fill(&mut ram, 3, 7);
        let s = crate::testutil::full(dir.path(), "s", &ram);
        let d = s.dir().to_path_buf();
        let layer = s.manifest().memory_layers[0].data.name.clone();
        assert!(Snapshot::load(&d).is_ok());
        assert!(Snapshot::load(&d).is_ok(), "loads again (from the cache)");
        // Same size, one byte changed in place: a new ctime, so it is hashed again.
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(d.join(&layer))
            .unwrap();
        f.write_all_at(&[0x5a], 3 * crate::PAGE_SIZE as u64 + 9)
            .unwrap();
        drop(f);
        let e = Snapshot::load(&d).unwrap_err();
        assert!(matches!(e, SnapshotError::ChecksumMismatch { .. }), "{e}");
    }

    /// A full snapshot of 64 pages filled from `seed`, and its memory
    /// layer's file name.
    fn sealable(dir: &Path, seed: u64) -> (Snapshot, String) {
        let mut ram = vec![0u8; 64 * crate::PAGE_SIZE];
        crate::testutil::fill(&mut ram, seed, 9);
        let s = crate::testutil::full(dir, "s", &ram);
        let layer = s.manifest().memory_layers[0].data.name.clone();
        (s, layer)
    }

    /// Writes one byte of `layer` in place (a new ctime) and checks that a
    /// load in a new process refuses it.
    fn changed_in_place_is_refused(d: &Path, layer: &str, at: u64) {
        use std::os::unix::fs::FileExt;
        forget_verified();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(d.join(layer))
            .unwrap();
        f.write_all_at(&[0xa5], at).unwrap();
        drop(f);
        let e = Snapshot::load(d).unwrap_err();
        assert!(matches!(e, SnapshotError::ChecksumMismatch { .. }), "{e}");
    }

    #[test]
    fn a_snapshot_its_writer_seals_before_publishing_loads_unhashed_until_it_changes() {
        use crate::format::is_unpublished;
        use crate::layers::write_full_layer;
        let dir = tempfile::tempdir().unwrap();
        let mut ram = vec![0u8; 64 * crate::PAGE_SIZE];
        crate::testutil::fill(&mut ram, 7, 3);
        for durable in [false, true] {
            let d = dir.path().join(format!("s-{durable}"));
            let k = crate::testutil::kernel(dir.path());
            let mut w = SnapshotWriter::new(&d, crate::testutil::shape(ram.len()), k).unwrap();
            assert!(is_unpublished(w.tmp_dir().file_name().unwrap()));
            w.set_fsync(durable);
            w.set_seal(true);
            w.write_state(b"sealed as written").unwrap();
            write_full_layer(&mut w, "mem", &ram).unwrap();
            // An unlisted file (a lease) is published with it.
            let lease = w.unlisted_file("lease").unwrap();
            std::fs::write(&lease, b"x").unwrap();
            assert!(matches!(
                w.unlisted_file("lease"),
                Err(SnapshotError::DuplicateName(_))
            ));
            assert!(w.unlisted_file(".sealed").is_err(), "a dot name");
            let s = w.commit().unwrap();
            assert_eq!(std::fs::read(d.join("lease")).unwrap(), b"x");
            let layer = s.manifest().memory_layers[0].data.name.clone();
            assert!(crate::format::seal::sealed(&d).contains_key(&layer));
            // As a new process: the seal is used, nothing is hashed.
            forget_verified();
            let before = HASHED.with(|h| h.get());
            assert!(Snapshot::load(&d).is_ok());
            assert_eq!(HASHED.with(|h| h.get()), before, "nothing hashed");
            changed_in_place_is_refused(&d, &layer, 7 * crate::PAGE_SIZE as u64 + 3);
        }
        // Nothing temporary is left.
        assert!(std::fs::read_dir(dir.path())
            .unwrap()
            .all(|e| !is_unpublished(&e.unwrap().file_name())));
    }

    #[test]
    fn a_sealed_snapshot_loads_unhashed_in_a_new_process_and_a_change_after_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (s, layer) = sealable(dir.path(), 5);
        let d = s.dir().to_path_buf();
        let n = crate::format::seal::seal(&Snapshot::load(&d).unwrap()).unwrap();
        assert!(n >= 1, "the memory layer is sealed");
        let sealed = crate::format::seal::sealed(&d);
        assert!(sealed.contains_key(&layer), "{sealed:?}");
        // As a new process: nothing remembered, the seal is used (nothing
        // is hashed).
        forget_verified();
        let before = HASHED.with(|h| h.get());
        assert!(Snapshot::load(&d).is_ok());
        assert_eq!(
            HASHED.with(|h| h.get()),
            before,
            "a sealed load hashes nothing"
        );
        // Without the seal, the same load hashes.
        forget_verified();
        std::fs::rename(d.join(".sealed"), d.join("sealed.off")).unwrap();
        assert!(Snapshot::load(&d).is_ok());
        assert!(HASHED.with(|h| h.get()) > before);
        std::fs::rename(d.join("sealed.off"), d.join(".sealed")).unwrap();
        // Changed in place after the seal: a new ctime, hashed, refused.
        changed_in_place_is_refused(&d, &layer, 5 * crate::PAGE_SIZE as u64 + 1);
    }

    /// `load_written` (sproutd, after a jailed worker wrote a snapshot)
    /// hashes none of the data files but checks everything else; sealed
    /// after it, a load in a new process hashes nothing, and a file changed
    /// after the seal is still hashed and refused.
    #[test]
    fn a_written_snapshot_is_taken_at_its_listed_data_checksums_and_checked_otherwise() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let (s, layer) = sealable(dir.path(), 11);
        let d = s.dir().to_path_buf();
        // As sproutd finds it once it has taken the files back: no seal.
        let _ = std::fs::remove_file(d.join(".sealed"));
        forget_verified();
        let before = HASHED.with(|h| h.get());
        let w = Snapshot::load_written(&d).unwrap();
        assert_eq!(HASHED.with(|h| h.get()), before, "no data file hashed");
        assert!(crate::format::seal::seal(&w).unwrap() >= 1);
        assert!(crate::format::seal::sealed(&d).contains_key(&layer));
        forget_verified();
        assert!(Snapshot::load(&d).is_ok());
        assert_eq!(HASHED.with(|h| h.get()), before, "sealed: nothing hashed");
        changed_in_place_is_refused(&d, &layer, 2 * crate::PAGE_SIZE as u64 + 5);

        // The rest is checked: a page map changed in place, a short data file.
        std::fs::create_dir(dir.path().join("b")).unwrap();
        std::fs::create_dir(dir.path().join("c")).unwrap();
        let (s, _) = sealable(&dir.path().join("b"), 12);
        let d = s.dir().to_path_buf();
        let _ = std::fs::remove_file(d.join(".sealed"));
        let map = s.manifest().memory_layers[0].page_map.name.clone();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(d.join(&map))
            .unwrap();
        let mut b = [0u8; 1];
        std::fs::File::open(d.join(&map))
            .unwrap()
            .read_exact_at(&mut b, 0)
            .unwrap();
        f.write_all_at(&[b[0] ^ 1], 0).unwrap();
        drop(f);
        forget_verified();
        let e = Snapshot::load_written(&d).unwrap_err();
        assert!(matches!(e, SnapshotError::ChecksumMismatch { .. }), "{e}");
        let (s, _) = sealable(&dir.path().join("c"), 13);
        let d = s.dir().to_path_buf();
        let _ = std::fs::remove_file(d.join(".sealed"));
        let data = d.join(&s.manifest().memory_layers[0].data.name);
        let len = std::fs::metadata(&data).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&data)
            .unwrap()
            .set_len(len - 1)
            .unwrap();
        forget_verified();
        assert!(Snapshot::load_written(&d).is_err(), "a short data file");
    }
}
