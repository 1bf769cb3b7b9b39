//! [`LayerStack`]: the memory layers of a snapshot chain, each data file
//! mapped read-only once, answering "what is in page `pfn`" top-down.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;
use std::sync::Arc;

use super::filemap::FileMap;
use super::{LayerError, PageMap};
use crate::format::{read_page_map, MemoryLayerKind, Snapshot, SnapshotError};
use crate::PAGE_SIZE;

const PAGE: u64 = PAGE_SIZE as u64;

/// The contents of one page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Page<'a> {
    Zero,
    /// Exactly [`PAGE_SIZE`] bytes, borrowed from the layer's mapping.
    Data(&'a [u8]),
}

/// Where a page comes from: zero, or the data of layer `i` (0 is the base).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PageSource {
    Zero,
    Layer(usize),
}

struct Layer {
    path: PathBuf,
    file: File,
    map: FileMap,
    pages: Arc<PageMap>,
}

/// The data files of a [`LayerStack`]'s layers, kept open by whatever maps
/// them (the `mmap` backend's guest RAM) after the stack itself is gone.
///
/// When the kernel cannot fill a page of such a mapping because its file was
/// truncated, the access that faults decides what is seen: a host thread
/// takes SIGBUS ([`crate::fault`]), but a vCPU's access in guest mode makes
/// `KVM_RUN` fail with `EFAULT` (or, on some hypervisors, becomes a guest
/// page fault that ends in a triple fault). [`LayerFiles::changed`] tells
/// that apart from any other guest failure.
#[derive(Debug)]
pub struct LayerFiles {
    size: u64,
    files: Vec<(PathBuf, File)>,
}

impl LayerFiles {
    /// The first layer file whose size is no longer the RAM size it was
    /// verified and mapped with (or that cannot be inspected any more).
    pub fn changed(&self) -> Option<PathBuf> {
        first_changed(self.size, self.files.iter().map(|(p, f)| (p, f)))
    }
}

/// The first of `files` whose size is no longer `size` (or that cannot be
/// inspected any more).
fn first_changed<'a>(
    size: u64,
    mut files: impl Iterator<Item = (&'a PathBuf, &'a File)>,
) -> Option<PathBuf> {
    files
        .find(|(_, f)| f.metadata().map_or(true, |m| m.len() != size))
        .map(|(p, _)| p.clone())
}

/// The memory layers of a snapshot chain, from the topmost full layer (the
/// base) up through the diff layers above it.
///
/// Each layer's data file is mapped `MAP_SHARED`, `PROT_READ` once, and kept
/// open; its size is checked against the verified manifest at open. Snapshot
/// files must not change while a stack is open (they never do once
/// committed): a file truncated under the mapping faults with SIGBUS, which
/// ends the process with a clear reason ([`crate::fault`]).
pub struct LayerStack {
    mem_bytes: u64,
    pages: u64,
    layers: Vec<Layer>,
}

impl LayerStack {
    /// Opens the memory layers of `chain` (base first, as
    /// [`Snapshot::load_chain`] returns it). Layers under the topmost full
    /// layer are not needed and not opened. Page maps are the ones the
    /// snapshots' load decoded and checked (read and checked again only for
    /// a snapshot that was written, not loaded); data files must still have
    /// the verified size.
    pub fn open(chain: &[Snapshot]) -> Result<LayerStack, LayerError> {
        let mem_bytes = chain.first().ok_or(LayerError::NoBase)?.shape().mem_bytes;
        if chain.iter().any(|s| s.shape().mem_bytes != mem_bytes) {
            return Err(LayerError::MemMismatch);
        }
        let all: Vec<_> = chain
            .iter()
            .flat_map(|s| {
                s.manifest()
                    .memory_layers
                    .iter()
                    .enumerate()
                    .map(move |(i, l)| (s, i, l))
            })
            .collect();
        let base = all
            .iter()
            .rposition(|(_, _, l)| l.kind == MemoryLayerKind::Full)
            .ok_or(LayerError::NoBase)?;
        let len = usize::try_from(mem_bytes).map_err(|_| LayerError::MemMismatch)?;
        let mut layers = Vec::with_capacity(all.len() - base);
        for &(snap, i, entry) in &all[base..] {
            let pages = match snap.page_map(i) {
                Some(p) => p.clone(),
                None => Arc::new(read_page_map(snap.dir(), entry, mem_bytes)?),
            };
            let path = snap.file_path(&entry.data);
            let file = File::open(&path).map_err(|e| SnapshotError::io("open", &path, e))?;
            let size = file
                .metadata()
                .map_err(|e| SnapshotError::io("stat", &path, e))?
                .len();
            if size != mem_bytes {
                return Err(LayerError::Changed { path });
            }
            let map = FileMap::new(&file, len).map_err(|source| LayerError::Map {
                path: path.clone(),
                source,
            })?;
            layers.push(Layer {
                path,
                file,
                map,
                pages,
            });
        }
        Ok(LayerStack {
            mem_bytes,
            pages: mem_bytes / PAGE,
            layers,
        })
    }

    pub fn mem_bytes(&self) -> u64 {
        self.mem_bytes
    }

    /// Number of pages of the RAM offset space.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Number of layers in use: the base and the diffs above it.
    pub fn depth(&self) -> usize {
        self.layers.len()
    }

    /// The contents of page `pfn`, from the topmost layer that has it.
    /// Panics if `pfn >= self.pages()`.
    pub fn lookup(&self, pfn: u64) -> Page<'_> {
        match self.source(pfn) {
            PageSource::Zero => Page::Zero,
            PageSource::Layer(i) => {
                // SAFETY: `pfn < pages` (checked in `source`), so the page lies
                // inside layer `i`'s mapping of `mem_bytes`, which lives as long
                // as `&self`; the mapping is read-only and the file immutable.
                Page::Data(unsafe { std::slice::from_raw_parts(self.page_ptr(i, pfn), PAGE_SIZE) })
            }
        }
    }

    /// Where page `pfn` comes from. Panics if `pfn >= self.pages()`.
    pub(crate) fn source(&self, pfn: u64) -> PageSource {
        assert!(pfn < self.pages, "pfn {pfn} out of {} pages", self.pages);
        for (i, l) in self.layers.iter().enumerate().skip(1).rev() {
            if l.pages.is_present(pfn) {
                return if l.pages.has_data(pfn) {
                    PageSource::Layer(i)
                } else {
                    PageSource::Zero
                };
            }
        }
        if self.layers[0].pages.has_data(pfn) {
            PageSource::Layer(0)
        } else {
            PageSource::Zero
        }
    }

    /// The source of `pfn` and how many pages from `pfn` on (at most `max`)
    /// share it; a run from one layer is contiguous in its file.
    pub(crate) fn run(&self, pfn: u64, max: u64) -> (PageSource, u64) {
        let src = self.source(pfn);
        let limit = max.min(self.pages - pfn);
        let mut n = 1;
        while n < limit && self.source(pfn + n) == src {
            n += 1;
        }
        (src, n)
    }

    /// Address of page `pfn` in layer `layer`'s read-only mapping.
    pub(crate) fn page_ptr(&self, layer: usize, pfn: u64) -> *const u8 {
        assert!(pfn < self.pages);
        // SAFETY: pfn < pages, so the offset is inside the mapping of
        // `mem_bytes` bytes.
        unsafe { self.layers[layer].map.as_ptr().add((pfn * PAGE) as usize) }
    }

    /// A handle on every layer's data file (the same open files), to check
    /// later whether one changed under a VM that maps it: see [`LayerFiles`].
    pub fn files(&self) -> std::io::Result<LayerFiles> {
        let files = self
            .layers
            .iter()
            .map(|l| Ok((l.path.clone(), l.file.try_clone()?)))
            .collect::<std::io::Result<_>>()?;
        Ok(LayerFiles {
            size: self.mem_bytes,
            files,
        })
    }

    /// The first layer whose data file no longer has the size it was opened
    /// with (see [`LayerFiles::changed`]).
    pub fn changed_layer(&self) -> Option<PathBuf> {
        first_changed(
            self.mem_bytes,
            self.layers.iter().map(|l| (&l.path, &l.file)),
        )
    }

    /// The data file of layer `layer`.
    pub(crate) fn layer_fd(&self, layer: usize) -> BorrowedFd<'_> {
        self.layers[layer].file.as_fd()
    }

    pub(crate) fn layer_path(&self, layer: usize) -> &PathBuf {
        &self.layers[layer].path
    }

    /// Pages decided by the diff layers (above the base), as coalesced runs
    /// `(first, count, source)`: what a restore must lay over the base.
    pub(crate) fn overlay_runs(&self) -> Vec<(u64, u64, PageSource)> {
        let mut out: Vec<(u64, u64, PageSource)> = Vec::new();
        let diffs = &self.layers[1..];
        if diffs.is_empty() {
            return out;
        }
        let words = self.layers[0].pages.present.len();
        for w in 0..words {
            let any = diffs.iter().fold(0u64, |a, l| a | l.pages.present[w]);
            let mut bits = any;
            while bits != 0 {
                let b = u64::from(bits.trailing_zeros());
                bits &= bits - 1;
                let pfn = w as u64 * 64 + b;
                let src = self.source(pfn);
                match out.last_mut() {
                    Some((s, n, last)) if *last == src && *s + *n == pfn => *n += 1,
                    _ => out.push((pfn, 1, src)),
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::DirtyBitmap;
    use crate::testutil::{diff, fill, full, zero};

    #[test]
    fn a_truncated_layer_file_is_named_by_the_stack_and_its_files() {
        let dir = tempfile::tempdir().unwrap();
        let pages = 64u64;
        let mut ram = vec![0u8; pages as usize * PAGE_SIZE];
        fill(&mut ram, 1, 1);
        let base = full(dir.path(), "base", &ram);
        let mut dirty = DirtyBitmap::new(pages);
        fill(&mut ram, 2, 2);
        dirty.set(2);
        let d1 = diff(dir.path(), "d1", &base, &ram, &dirty);
        let chain = Snapshot::load_chain(d1.dir()).unwrap();
        let stack = LayerStack::open(&chain).unwrap();
        let files = stack.files().unwrap();
        assert_eq!(stack.changed_layer(), None);
        assert_eq!(files.changed(), None);
        let top = stack.layer_path(1).clone();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&top)
            .unwrap()
            .set_len(PAGE)
            .unwrap();
        assert_eq!(stack.changed_layer(), Some(top.clone()));
        drop(stack);
        // The files outlive the stack (the mmap backend keeps only them).
        assert_eq!(files.changed(), Some(top));
    }

    #[test]
    fn lookup_is_top_down_and_zeroed_pages_override() {
        let dir = tempfile::tempdir().unwrap();
        let pages = 300u64;
        let mut ram = vec![0u8; pages as usize * PAGE_SIZE];
        for p in [1, 2, 3, 100, 200] {
            fill(&mut ram, p, 1);
        }
        let base = full(dir.path(), "base", &ram);
        let mut dirty = DirtyBitmap::new(pages);
        fill(&mut ram, 2, 2); // changed
        zero(&mut ram, 3); // back to zero
        fill(&mut ram, 150, 2); // new
        for p in [2, 3, 150] {
            dirty.set(p);
        }
        let d1 = diff(dir.path(), "d1", &base, &ram, &dirty);
        let mut dirty = DirtyBitmap::new(pages);
        fill(&mut ram, 3, 3); // zero, then data again
        dirty.set(3);
        let d2 = diff(dir.path(), "d2", &d1, &ram, &dirty);
        let chain = Snapshot::load_chain(d2.dir()).unwrap();
        let stack = LayerStack::open(&chain).unwrap();
        assert_eq!(stack.depth(), 3);
        for pfn in 0..pages {
            let want = &ram[pfn as usize * PAGE_SIZE..][..PAGE_SIZE];
            match stack.lookup(pfn) {
                Page::Zero => assert!(want.iter().all(|&b| b == 0), "page {pfn}"),
                Page::Data(d) => assert_eq!(d, want, "page {pfn}"),
            }
        }
        assert_eq!(stack.source(3), PageSource::Layer(2));
        assert_eq!(stack.source(2), PageSource::Layer(1));
        assert_eq!(stack.source(0), PageSource::Zero);
        assert_eq!(stack.run(1, 10), (PageSource::Layer(0), 1));
        assert_eq!(stack.run(4, 1000), (PageSource::Zero, 96));
        // Without d2, page 3 is a zero page that overrides the base's data.
        let chain = Snapshot::load_chain(d1.dir()).unwrap();
        let stack = LayerStack::open(&chain).unwrap();
        assert_eq!(stack.lookup(3), Page::Zero);
        assert_eq!(
            stack.overlay_runs(),
            vec![
                (2, 1, PageSource::Layer(1)),
                (3, 1, PageSource::Zero),
                (150, 1, PageSource::Layer(1))
            ]
        );
    }

    #[test]
    fn a_chain_without_a_full_layer_is_refused() {
        assert!(matches!(LayerStack::open(&[]), Err(LayerError::NoBase)));
    }
}
