//! A layered copy-on-write disk: read-only layers under one private writable top.
//!
//! The disk is cut into clusters of [`CLUSTER_SIZE`] bytes (the last one may be shorter).
//! Each read-only layer is a data file of the full disk size (sparse: cluster `i` at
//! offset `i * 4096`) plus a cluster map saying which clusters it holds (`mapfile`
//! describes the format); a plain raw image is a layer without a map that holds every
//! cluster (when it is the bottom layer, its holes count as absent, which reads the
//! same). Above them sits the top: a sparse file private to this disk, with two bitmaps
//! in memory, `allocated` (clusters the top holds) and `dirty` (written since the last
//! [`LayeredDisk::mark_clean`]).
//!
//! - A read takes each cluster from the highest layer that holds it; zeros if none.
//! - A write goes to the top. A cluster the top does not hold yet and the write covers
//!   only in part is first copied up whole from the layers below, so the rest of it
//!   keeps its contents.
//! - [`LayeredDisk::write_layer`] freezes the disk into a new layer: `Full` (every
//!   cluster any layer holds: the new layer alone is the whole disk) or `Diff` (only
//!   clusters written since the last `mark_clean`, to stack on the layers it was
//!   taken over). Only clusters present are read and written, and all-zero clusters
//!   become holes, so a layer costs in proportion to the data, not the disk size.
//!
//! The top made by [`LayeredDisk::create`] is not persistent: it is unlinked as soon as
//! it is created and lives as long as the disk; persistence comes from layers written at
//! snapshots, so a flush does nothing (`write_layer` syncs the files it writes). A top
//! opened from an existing file ([`LayeredDisk::open_file`],
//! [`LayeredDisk::open_file_over`]: a VM's own writable disk, possibly over a read-only
//! template) is kept, and a flush syncs it.
//!
//! Limits: disk size a multiple of 512 bytes, at most [`MAX_DISK_SIZE`]; at most
//! [`MAX_LAYERS`] read-only layers. Memory: one bit per cluster per layer, plus two for
//! the top (512 KiB per bitmap for a 16 GiB disk).

mod bitmap;
mod mapfile;
#[cfg(test)]
mod tests;

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use bitmap::Bitmap;
pub use mapfile::MapError;

use super::backend::DiskBackend;
use super::SECTOR_SIZE;
use crate::bus::lock;

/// Size of a cluster, the unit of copy-on-write and of layer maps.
pub const CLUSTER_SIZE: u64 = 4096;
/// Largest disk: 1 TiB (a bitmap of 32 MiB).
pub const MAX_DISK_SIZE: u64 = 1 << 40;
/// Most read-only layers in one stack.
pub const MAX_LAYERS: usize = 64;
/// Clusters moved per read/write while writing a layer (1 MiB).
const CHUNK_CLUSTERS: u64 = 256;

#[derive(Debug, thiserror::Error)]
pub enum LayeredError {
    #[error("Disk size {0} is not a multiple of 512 between 512 and 1 TiB")]
    DiskSize(u64),
    #[error("{0} layers given, at most 64 are supported")]
    TooManyLayers(usize),
    #[error("Cannot open disk layer {}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("Disk layer {} is {found} bytes, the disk is {disk}", path.display())]
    LayerSize {
        path: PathBuf,
        found: u64,
        disk: u64,
    },
    #[error("Bad cluster map {}", path.display())]
    Map {
        path: PathBuf,
        #[source]
        source: MapError,
    },
    #[error("File {} already exists", .0.display())]
    Exists(PathBuf),
    #[error("Cannot create {}", path.display())]
    Create {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("Cannot write layer file {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("Cannot read the disk while writing a layer")]
    Read(#[source] io::Error),
}

/// The files of one read-only layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerFiles {
    /// Data, the full disk size (sparse); cluster `i` at offset `i * CLUSTER_SIZE`.
    pub data: PathBuf,
    /// Its cluster map (written by [`LayeredDisk::write_layer`]); `None` for a raw image,
    /// which holds every cluster.
    pub map: Option<PathBuf>,
}

impl LayerFiles {
    /// A raw disk image as a layer.
    pub fn raw(data: impl Into<PathBuf>) -> Self {
        Self {
            data: data.into(),
            map: None,
        }
    }

    /// A layer written by [`LayeredDisk::write_layer`].
    pub fn mapped(data: impl Into<PathBuf>, map: impl Into<PathBuf>) -> Self {
        Self {
            data: data.into(),
            map: Some(map.into()),
        }
    }
}

/// Which clusters [`LayeredDisk::write_layer`] puts in the new layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Every cluster held anywhere in the stack: the layer is the whole disk.
    Full,
    /// Clusters written since the last [`LayeredDisk::mark_clean`]: stack it on the
    /// layers the disk had then.
    Diff,
}

/// What [`LayeredDisk::write_layer`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerStats {
    /// Clusters the new layer's map marks present.
    pub clusters: u64,
    /// Bytes written to the data file (all-zero clusters are left as holes).
    pub data_bytes: u64,
    /// Size of the map file.
    pub map_bytes: u64,
}

/// One read-only layer, open.
struct Layer {
    file: File,
    /// The clusters it holds. `None` for a raw bottom layer until a layer is
    /// written from the disk: it is read for every cluster no layer above
    /// holds, its holes reading as zeros, the same as absent; its data
    /// extents are looked up only when a full layer needs them (a walk that
    /// costs a boot ~20 ms where the host kernel is emulated).
    present: Option<Bitmap>,
}

/// The writable top.
struct Top {
    file: File,
    allocated: Bitmap,
    dirty: Bitmap,
    /// A file that outlives the disk ([`LayeredDisk::open_file_over`]),
    /// which a guest flush syncs; not an unlinked scratch top.
    kept: bool,
}

/// Where one cluster's bytes come from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Source {
    Top,
    Layer(usize),
    Zeros,
}

struct Inner {
    /// Bottom first.
    layers: Vec<Layer>,
    top: Top,
    /// Copy-up and layer-writing buffer.
    scratch: Vec<u8>,
}

/// A copy-on-write disk over read-only layers. Shared (in an `Arc`) between the block
/// device, which reads and writes it as its [`DiskBackend`], and the VMM, which writes
/// its layers at snapshots; an internal lock orders the two.
pub struct LayeredDisk {
    size: u64,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for LayeredDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayeredDisk")
            .field("size", &self.size)
            .field("layers", &lock(&self.inner).layers.len())
            .finish_non_exhaustive()
    }
}

fn open_layer(files: &LayerFiles, size: u64, bottom: bool) -> Result<Layer, LayeredError> {
    let path = &files.data;
    let file = File::open(path).map_err(|source| LayeredError::Open {
        path: path.clone(),
        source,
    })?;
    let found = file
        .metadata()
        .map_err(|source| LayeredError::Open {
            path: path.clone(),
            source,
        })?
        .len();
    if found != size {
        return Err(LayeredError::LayerSize {
            path: path.clone(),
            found,
            disk: size,
        });
    }
    let clusters = size.div_ceil(CLUSTER_SIZE);
    let present = match &files.map {
        Some(map) => Some(
            mapfile::read(map, size).map_err(|source| LayeredError::Map {
                path: map.clone(),
                source,
            })?,
        ),
        None if bottom => None,
        None => Some(Bitmap::full(clusters)),
    };
    Ok(Layer { file, present })
}

/// Checks a layer's cluster map file `bytes` as opening a disk of
/// `disk_size` bytes over the layer does; the runs `[start, end)` of the
/// clusters it holds, in order. For fuzzing and tools: a disk reads its maps
/// itself.
pub fn decode_layer_map(bytes: &[u8], disk_size: u64) -> Result<Vec<(u64, u64)>, MapError> {
    mapfile::decode(bytes, disk_size).map(|m| m.runs().collect())
}

/// The cluster map file a layer write makes for a disk of `disk_size` bytes
/// whose layer holds `runs` (`[start, end)`, in order, not touching; runs
/// past the disk's end are cut there).
pub fn encode_layer_map(runs: &[(u64, u64)], disk_size: u64) -> Vec<u8> {
    let mut map = Bitmap::new(disk_size.div_ceil(CLUSTER_SIZE));
    for &(start, end) in runs {
        map.set_range(start, end);
    }
    mapfile::encode(&map, disk_size)
}

/// The clusters of a raw file that hold data (SEEK_DATA/SEEK_HOLE); every cluster if
/// the file system cannot tell.
fn data_clusters(file: &File, size: u64) -> Bitmap {
    use rustix::fs::{seek, SeekFrom};
    let clusters = size.div_ceil(CLUSTER_SIZE);
    let mut map = Bitmap::new(clusters);
    let mut pos = 0;
    while pos < size {
        let start = match seek(file, SeekFrom::Data(pos)) {
            Ok(s) => s,
            Err(rustix::io::Errno::NXIO) => break,
            Err(_) => return Bitmap::full(clusters),
        };
        let end = match seek(file, SeekFrom::Hole(start)) {
            Ok(e) => e.min(size),
            Err(_) => return Bitmap::full(clusters),
        };
        for c in start / CLUSTER_SIZE..end.div_ceil(CLUSTER_SIZE) {
            map.set(c);
        }
        pos = end.max(start + 1);
    }
    map
}

impl LayeredDisk {
    /// A disk of `size` bytes over `layers` (bottom first, each checked: size, map),
    /// with a new empty top created at `top_path` (which must not exist; the file is
    /// unlinked at once and its space freed when the disk is dropped).
    pub fn create(
        layers: Vec<LayerFiles>,
        top_path: &Path,
        size: u64,
    ) -> Result<Self, LayeredError> {
        if size == 0 || !size.is_multiple_of(SECTOR_SIZE) || size > MAX_DISK_SIZE {
            return Err(LayeredError::DiskSize(size));
        }
        if layers.len() > MAX_LAYERS {
            return Err(LayeredError::TooManyLayers(layers.len()));
        }
        let opened = layers
            .iter()
            .enumerate()
            .map(|(i, l)| open_layer(l, size, i == 0))
            .collect::<Result<Vec<_>, _>>()?;
        let file = create_new(top_path)?;
        let _ = std::fs::remove_file(top_path);
        file.set_len(size).map_err(|source| LayeredError::Create {
            path: top_path.to_owned(),
            source,
        })?;
        let clusters = size.div_ceil(CLUSTER_SIZE);
        Ok(Self {
            size,
            inner: Mutex::new(Inner {
                layers: opened,
                top: Top {
                    file,
                    allocated: Bitmap::new(clusters),
                    dirty: Bitmap::new(clusters),
                    kept: false,
                },
                scratch: Vec::new(),
            }),
        })
    }

    /// A disk with no lower layers whose top is the existing file at
    /// `top_path`: guest writes land in that file, and its data extents are
    /// the clusters the top already holds. Snapshots copy only those (full)
    /// or what was written since the last mark (diff).
    pub fn open_file(top_path: &Path) -> Result<Self, LayeredError> {
        Self::open_file_over(Vec::new(), top_path)
    }

    /// A disk whose top is the existing file at `top_path`, kept (guest
    /// writes land in it; a guest flush syncs it), over `layers` (bottom
    /// first, each the top's size). The top holds the clusters that are data
    /// extents in it: a cluster it never held reads from the layers. So the
    /// top must stay on a file system that keeps written blocks as data
    /// (not one that turns written zeros into holes, as ZFS with compression
    /// does): otherwise a zeroed cluster would read as the layer below.
    pub fn open_file_over(layers: Vec<LayerFiles>, top_path: &Path) -> Result<Self, LayeredError> {
        if layers.len() > MAX_LAYERS {
            return Err(LayeredError::TooManyLayers(layers.len()));
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(top_path)
            .map_err(|source| LayeredError::Open {
                path: top_path.to_owned(),
                source,
            })?;
        let size = file
            .metadata()
            .map_err(|source| LayeredError::Open {
                path: top_path.to_owned(),
                source,
            })?
            .len();
        if size == 0 || !size.is_multiple_of(SECTOR_SIZE) || size > MAX_DISK_SIZE {
            return Err(LayeredError::DiskSize(size));
        }
        let opened = layers
            .iter()
            .enumerate()
            .map(|(i, l)| open_layer(l, size, i == 0))
            .collect::<Result<Vec<_>, _>>()?;
        let clusters = size.div_ceil(CLUSTER_SIZE);
        let allocated = data_clusters(&file, size);
        Ok(Self {
            size,
            inner: Mutex::new(Inner {
                layers: opened,
                top: Top {
                    file,
                    allocated,
                    dirty: Bitmap::new(clusters),
                    kept: true,
                },
                scratch: Vec::new(),
            }),
        })
    }

    /// Disk size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Number of read-only layers under the top.
    pub fn layer_count(&self) -> usize {
        lock(&self.inner).layers.len()
    }

    /// Clusters the top holds.
    pub fn allocated_clusters(&self) -> u64 {
        lock(&self.inner).top.allocated.count()
    }

    /// Clusters written since the last [`LayeredDisk::mark_clean`].
    pub fn dirty_clusters(&self) -> u64 {
        lock(&self.inner).top.dirty.count()
    }

    /// Forgets which clusters were written: the next `Diff` layer holds only later
    /// writes. Call it once the layer written before it is safely stored.
    pub fn mark_clean(&self) {
        lock(&self.inner).top.dirty.clear_all();
    }

    /// Writes the disk's contents as a new layer: data to `out_data` (sparse, the disk
    /// size) and its map to `out_map`, neither of which may exist; both are synced.
    /// On failure, the files it created are removed.
    pub fn write_layer(
        &self,
        out_data: &Path,
        out_map: &Path,
        kind: LayerKind,
    ) -> Result<LayerStats, LayeredError> {
        self.write_layer_with(out_data, out_map, kind, true)
    }

    /// [`LayeredDisk::write_layer`] without the syncs: for a layer that is not kept
    /// past its process's users (a fork layer), which a crash may lose whole. An
    /// fsync here is a journal commit, a millisecond or more on a real disk.
    pub fn write_layer_unsynced(
        &self,
        out_data: &Path,
        out_map: &Path,
        kind: LayerKind,
    ) -> Result<LayerStats, LayeredError> {
        self.write_layer_with(out_data, out_map, kind, false)
    }

    fn write_layer_with(
        &self,
        out_data: &Path,
        out_map: &Path,
        kind: LayerKind,
        sync: bool,
    ) -> Result<LayerStats, LayeredError> {
        if out_map.symlink_metadata().is_ok() {
            return Err(LayeredError::Exists(out_map.to_owned()));
        }
        let mut inner = lock(&self.inner);
        let map = match kind {
            LayerKind::Full => {
                let mut all = inner.top.allocated.clone();
                for l in &mut inner.layers {
                    let present = l
                        .present
                        .get_or_insert_with(|| data_clusters(&l.file, self.size));
                    all.union_with(present);
                }
                all
            }
            LayerKind::Diff => inner.top.dirty.clone(),
        };
        let out = create_new(out_data)?;
        let result = self.write_layer_files(&mut inner, &map, &out, out_data, out_map, sync);
        if result.is_err() {
            let _ = std::fs::remove_file(out_data);
        }
        result
    }

    fn write_layer_files(
        &self,
        inner: &mut Inner,
        map: &Bitmap,
        out: &File,
        out_data: &Path,
        out_map: &Path,
        sync: bool,
    ) -> Result<LayerStats, LayeredError> {
        let werr = |source| LayeredError::Write {
            path: out_data.to_owned(),
            source,
        };
        out.set_len(self.size).map_err(werr)?;
        let mut scratch = std::mem::take(&mut inner.scratch);
        let mut data_bytes = 0;
        let mut result = Ok(());
        'runs: for (start, end) in map.runs() {
            let mut c = start;
            while c < end {
                let n = (end - c).min(CHUNK_CLUSTERS);
                let off = c * CLUSTER_SIZE;
                let len = ((c + n) * CLUSTER_SIZE).min(self.size) - off;
                scratch.resize(len as usize, 0);
                if let Err(e) = inner.read(&mut scratch, off, true) {
                    result = Err(LayeredError::Read(e));
                    break 'runs;
                }
                match write_nonzero(out, &scratch, off) {
                    Ok(written) => data_bytes += written,
                    Err(e) => {
                        result = Err(werr(e));
                        break 'runs;
                    }
                }
                c += n;
            }
        }
        inner.scratch = scratch;
        result?;
        if sync {
            out.sync_all().map_err(werr)?;
        }
        let map_bytes = write_map(out_map, map, self.size, sync)?;
        Ok(LayerStats {
            clusters: map.count(),
            data_bytes,
            map_bytes,
        })
    }

    /// The clusters written since the last [`LayeredDisk::mark_clean`], copied
    /// out (from the page cache, typically) for [`StagedLayer::write`], which
    /// writes them as a diff layer later; the disk is marked clean at once, so
    /// writes from now on count toward the next diff. Costs a read of the
    /// dirty clusters, which the caller bounds with [`LayeredDisk::dirty_clusters`].
    pub fn stage_diff(&self) -> Result<StagedLayer, LayeredError> {
        let mut inner = lock(&self.inner);
        let map = inner.top.dirty.clone();
        let mut runs = Vec::new();
        for (start, end) in map.runs() {
            let off = start * CLUSTER_SIZE;
            let len = (end * CLUSTER_SIZE).min(self.size) - off;
            let mut buf = vec![0u8; len as usize];
            inner
                .read(&mut buf, off, true)
                .map_err(LayeredError::Read)?;
            runs.push((off, buf));
        }
        inner.top.dirty.clear_all();
        Ok(StagedLayer {
            size: self.size,
            map,
            runs,
        })
    }

    fn check_range(&self, len: usize, offset: u64) -> io::Result<()> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "access beyond the end of the disk",
            )),
        }
    }
}

/// A diff layer's clusters copied out of a [`LayeredDisk`] by
/// [`LayeredDisk::stage_diff`], to be written after the VM runs again.
pub struct StagedLayer {
    size: u64,
    map: Bitmap,
    runs: Vec<(u64, Vec<u8>)>,
}

impl StagedLayer {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.runs.iter().map(|(_, b)| b.len() as u64).sum()
    }

    /// Writes the layer: data to `out_data` (sparse, the disk size) and its
    /// map to `out_map`, neither of which may exist; both are synced. On
    /// failure, the files it created are removed.
    pub fn write(&self, out_data: &Path, out_map: &Path) -> Result<LayerStats, LayeredError> {
        if out_map.symlink_metadata().is_ok() {
            return Err(LayeredError::Exists(out_map.to_owned()));
        }
        let out = create_new(out_data)?;
        let werr = |source| LayeredError::Write {
            path: out_data.to_owned(),
            source,
        };
        let result = (|| {
            out.set_len(self.size).map_err(werr)?;
            let mut data_bytes = 0;
            for (off, buf) in &self.runs {
                data_bytes += write_nonzero(&out, buf, *off).map_err(werr)?;
            }
            out.sync_all().map_err(werr)?;
            let map_bytes = write_map(out_map, &self.map, self.size, true)?;
            Ok(LayerStats {
                clusters: self.map.count(),
                data_bytes,
                map_bytes,
            })
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(out_data);
        }
        result
    }
}

/// Writes the cluster map of a layer (and syncs it if `sync`).
fn write_map(out_map: &Path, map: &Bitmap, size: u64, sync: bool) -> Result<u64, LayeredError> {
    mapfile::write(out_map, map, size, sync).map_err(|e| match e {
        MapError::Io(source) if source.kind() == io::ErrorKind::AlreadyExists => {
            LayeredError::Exists(out_map.to_owned())
        }
        MapError::Io(source) => LayeredError::Write {
            path: out_map.to_owned(),
            source,
        },
        source => LayeredError::Map {
            path: out_map.to_owned(),
            source,
        },
    })
}

/// Writes the clusters of `buf` (disk bytes from `off`) that are not all zero, runs
/// of them at a time; returns the bytes written.
fn write_nonzero(out: &File, buf: &[u8], off: u64) -> io::Result<u64> {
    let cs = CLUSTER_SIZE as usize;
    let nonzero = |i: usize| {
        buf[i * cs..buf.len().min((i + 1) * cs)]
            .iter()
            .any(|&b| b != 0)
    };
    let count = buf.len().div_ceil(cs);
    let mut written = 0;
    let mut i = 0;
    while i < count {
        if !nonzero(i) {
            i += 1;
            continue;
        }
        let start = i;
        while i < count && nonzero(i) {
            i += 1;
        }
        let bytes = &buf[start * cs..buf.len().min(i * cs)];
        out.write_all_at(bytes, off + (start * cs) as u64)?;
        written += bytes.len() as u64;
    }
    Ok(written)
}

fn create_new(path: &Path) -> Result<File, LayeredError> {
    File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|source| match source.kind() {
            io::ErrorKind::AlreadyExists => LayeredError::Exists(path.to_owned()),
            _ => LayeredError::Create {
                path: path.to_owned(),
                source,
            },
        })
}

impl Inner {
    fn source(&self, cluster: u64, with_top: bool) -> Source {
        if with_top && self.top.allocated.get(cluster) {
            return Source::Top;
        }
        match self
            .layers
            .iter()
            .rposition(|l| l.present.as_ref().is_none_or(|p| p.get(cluster)))
        {
            Some(i) => Source::Layer(i),
            None => Source::Zeros,
        }
    }

    /// Fills `buf` with the disk from `off` (within the disk), cluster by cluster from
    /// the highest layer holding each, runs of one source at a time; the top is
    /// skipped unless `with_top`.
    fn read(&self, buf: &mut [u8], off: u64, with_top: bool) -> io::Result<()> {
        let end = off + buf.len() as u64;
        let mut pos = off;
        while pos < end {
            let src = self.source(pos / CLUSTER_SIZE, with_top);
            let mut run_end = ((pos / CLUSTER_SIZE + 1) * CLUSTER_SIZE).min(end);
            while run_end < end && self.source(run_end / CLUSTER_SIZE, with_top) == src {
                run_end = (run_end + CLUSTER_SIZE).min(end);
            }
            let part = &mut buf[(pos - off) as usize..(run_end - off) as usize];
            match src {
                Source::Top => self.top.file.read_exact_at(part, pos)?,
                Source::Layer(i) => self.layers[i].file.read_exact_at(part, pos)?,
                Source::Zeros => part.fill(0),
            }
            pos = run_end;
        }
        Ok(())
    }

    /// Gives the top its own copy of `cluster` from the layers below.
    fn copy_up(&mut self, cluster: u64, size: u64) -> io::Result<()> {
        let off = cluster * CLUSTER_SIZE;
        let len = (off + CLUSTER_SIZE).min(size) - off;
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.resize(len as usize, 0);
        let r = self
            .read(&mut scratch, off, false)
            .and_then(|()| self.top.file.write_all_at(&scratch, off));
        self.scratch = scratch;
        r?;
        self.top.allocated.set(cluster);
        self.top.dirty.set(cluster);
        Ok(())
    }

    fn write(&mut self, buf: &[u8], off: u64, size: u64) -> io::Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let end = off + buf.len() as u64;
        let (first, last) = (off / CLUSTER_SIZE, (end - 1) / CLUSTER_SIZE);
        for c in [first, last] {
            let start = c * CLUSTER_SIZE;
            let covered = off <= start && end >= (start + CLUSTER_SIZE).min(size);
            if !covered && !self.top.allocated.get(c) {
                self.copy_up(c, size)?;
            }
        }
        self.top.file.write_all_at(buf, off)?;
        for c in first..=last {
            self.top.allocated.set(c);
            self.top.dirty.set(c);
        }
        Ok(())
    }
}

impl DiskBackend for Arc<LayeredDisk> {
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.check_range(buf.len(), offset)?;
        lock(&self.inner).read(buf, offset, true)
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.check_range(buf.len(), offset)?;
        lock(&self.inner).write(buf, offset, self.size)
    }

    /// Syncs a kept top (the guest asked for its writes to be durable);
    /// nothing for a scratch top, which does not outlive the disk (see the
    /// module docs).
    fn flush(&mut self) -> io::Result<()> {
        let inner = lock(&self.inner);
        if inner.top.kept {
            inner.top.file.sync_data()?;
        }
        Ok(())
    }

    fn size_bytes(&self) -> u64 {
        self.size
    }
}
