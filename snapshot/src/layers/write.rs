//! Writing memory layers into a [`SnapshotWriter`].

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use super::{DirtyBitmap, LayerError, PageMap, RamSource};
use crate::format::{
    digest_bytes, is_zero, FileEntry, MemoryLayerEntry, MemoryLayerKind, SnapshotWriter,
    SparseHasher,
};
use crate::PAGE_SIZE;

const PAGE: u64 = PAGE_SIZE as u64;
/// Pages read from a copying [`RamSource`] at a time.
const BATCH_PAGES: u64 = 256;

/// Writes a full layer `name` (and `name.map`): every non-zero page of `src`
/// at its natural offset, zero pages left as holes. Reads only
/// [`RamSource::data_ranges`] when the source knows them.
pub fn write_full_layer(
    w: &mut SnapshotWriter,
    name: &str,
    src: &dyn RamSource,
) -> Result<MemoryLayerEntry, LayerError> {
    let mut out = LayerOut::create(w, name, src, MemoryLayerKind::Full)?;
    let mem = out.mem;
    let mut ranges: Vec<(u64, u64)> = src
        .data_ranges()
        .unwrap_or_else(|| vec![(0, mem)])
        .into_iter()
        .map(|(s, e)| (s / PAGE, e.min(mem).div_ceil(PAGE)))
        .filter(|(s, e)| s < e)
        .collect();
    ranges.sort_unstable();
    let mut next = 0u64;
    for (s, e) in ranges {
        let s = s.max(next);
        if s < e {
            out.pages(src, s, e - s)?;
            next = e;
        }
    }
    out.finish(w)
}

/// Writes a diff layer `name` (and `name.map`): the pages marked in `dirty`,
/// at their natural offsets. A dirty page that is now zero is recorded as
/// present without data (it overrides lower layers) and left as a hole.
/// Costs in proportion to the dirty pages.
pub fn write_diff_layer(
    w: &mut SnapshotWriter,
    name: &str,
    src: &dyn RamSource,
    dirty: &DirtyBitmap,
) -> Result<MemoryLayerEntry, LayerError> {
    let pages = src.len() / PAGE;
    if dirty.pages() != pages {
        return Err(LayerError::BitmapSize {
            words: dirty.words().len(),
            pages,
        });
    }
    let mut out = LayerOut::create(w, name, src, MemoryLayerKind::Diff)?;
    for (first, count) in dirty.runs() {
        out.pages(src, first, count)?;
    }
    out.finish(w)
}

/// A layer being written: its files, page map and running digest.
struct LayerOut {
    kind: MemoryLayerKind,
    mem: u64,
    name: String,
    file: File,
    path: PathBuf,
    map_file: File,
    map_path: PathBuf,
    map: PageMap,
    hasher: SparseHasher,
    buf: Vec<u8>,
}

impl LayerOut {
    fn create(
        w: &mut SnapshotWriter,
        name: &str,
        src: &dyn RamSource,
        kind: MemoryLayerKind,
    ) -> Result<LayerOut, LayerError> {
        let mem = w.shape().mem_bytes;
        if src.len() != mem || src.as_slice().is_some_and(|s| s.len() as u64 != mem) {
            return Err(LayerError::SourceSize {
                actual: src.len(),
                expected: mem,
            });
        }
        let (file, path) = w.create_file(name)?;
        let (map_file, map_path) = w.create_file(&format!("{name}.map"))?;
        file.set_len(mem).map_err(|source| LayerError::Write {
            path: path.clone(),
            source,
        })?;
        let pages = mem / PAGE;
        let map = match kind {
            MemoryLayerKind::Full => PageMap::all_present(pages),
            MemoryLayerKind::Diff => PageMap::empty(pages),
        };
        Ok(LayerOut {
            kind,
            mem,
            name: name.into(),
            file,
            path,
            map_file,
            map_path,
            map,
            hasher: SparseHasher::new(),
            buf: Vec::new(),
        })
    }

    /// Takes pages `[first, first + count)` of `src` into the layer, in
    /// increasing order across calls.
    fn pages(&mut self, src: &dyn RamSource, first: u64, count: u64) -> Result<(), LayerError> {
        if let Some(all) = src.as_slice() {
            let s = (first * PAGE) as usize;
            let e = ((first + count) * PAGE) as usize;
            return self.take(first, &all[s..e]);
        }
        let mut buf = std::mem::take(&mut self.buf);
        let mut pfn = first;
        while pfn < first + count {
            let n = (first + count - pfn).min(BATCH_PAGES);
            buf.resize((n * PAGE) as usize, 0);
            src.read(pfn * PAGE, &mut buf)
                .map_err(|source| LayerError::Read {
                    offset: pfn * PAGE,
                    source,
                })?;
            self.take(pfn, &buf)?;
            pfn += n;
        }
        self.buf = buf;
        Ok(())
    }

    /// Records and writes the pages in `bytes` (page `first` onwards),
    /// writing each run of non-zero pages with one `pwrite`.
    fn take(&mut self, first: u64, bytes: &[u8]) -> Result<(), LayerError> {
        let mut run: Option<usize> = None;
        for (i, page) in bytes.chunks(PAGE_SIZE).enumerate() {
            let pfn = first + i as u64;
            if self.kind == MemoryLayerKind::Diff {
                self.map.set_present(pfn);
            }
            if is_zero(page) {
                if let Some(r) = run.take() {
                    self.write(first, r, &bytes[r * PAGE_SIZE..i * PAGE_SIZE])?;
                }
                continue;
            }
            self.map.set_data(pfn);
            self.hasher.chunk(pfn, page);
            run.get_or_insert(i);
        }
        if let Some(r) = run {
            self.write(first, r, &bytes[r * PAGE_SIZE..])?;
        }
        Ok(())
    }

    fn write(&self, first: u64, index: usize, bytes: &[u8]) -> Result<(), LayerError> {
        let at = (first + index as u64) * PAGE;
        self.file
            .write_all_at(bytes, at)
            .map_err(|source| LayerError::Write {
                path: self.path.clone(),
                source,
            })
    }

    fn finish(self, w: &mut SnapshotWriter) -> Result<MemoryLayerEntry, LayerError> {
        let map_bytes = self.map.encode();
        self.map_file
            .write_all_at(&map_bytes, 0)
            .map_err(|source| LayerError::Write {
                path: self.map_path.clone(),
                source,
            })?;
        let entry = MemoryLayerEntry {
            kind: self.kind,
            pages_present: self.map.present_count(),
            data_pages: self.map.data_count(),
            data: FileEntry {
                name: self.name.clone(),
                size: self.mem,
                checksum: self.hasher.finish(self.mem),
            },
            page_map: FileEntry {
                name: format!("{}.map", self.name),
                size: map_bytes.len() as u64,
                checksum: digest_bytes(&map_bytes),
            },
        };
        w.push_memory_layer(entry.clone());
        Ok(entry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Snapshot;
    use crate::testutil::{fill, full, kernel, shape};

    #[test]
    fn full_layer_leaves_zero_pages_as_holes() {
        let dir = tempfile::tempdir().unwrap();
        let pages = 4096u64;
        let mut ram = vec![0u8; pages as usize * PAGE_SIZE];
        for p in [0, 1, 2, 1000, 4095] {
            fill(&mut ram, p, 7);
        }
        let s = full(dir.path(), "s", &ram);
        let l = &s.manifest().memory_layers[0];
        assert_eq!((l.pages_present, l.data_pages), (pages, 5));
        let f = File::open(s.file_path(&l.data)).unwrap();
        let ext = crate::format::data_extents(&f, l.data.size).unwrap();
        let covered: u64 = ext.iter().map(|(a, b)| b - a).sum();
        assert!(covered < 64 * PAGE, "extents {ext:?}");
        Snapshot::load(s.dir()).unwrap();
    }

    #[test]
    fn copying_sources_and_data_ranges_give_the_same_layer() {
        struct Copying<'a>(&'a [u8], Option<Vec<(u64, u64)>>);
        impl RamSource for Copying<'_> {
            fn len(&self) -> u64 {
                self.0.len() as u64
            }
            fn read(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
                buf.copy_from_slice(&self.0[offset as usize..][..buf.len()]);
                Ok(())
            }
            fn data_ranges(&self) -> Option<Vec<(u64, u64)>> {
                self.1.clone()
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let mut ram = vec![0u8; 1000 * PAGE_SIZE];
        for p in [3, 300, 301, 302, 999] {
            fill(&mut ram, p, 9);
        }
        let reference = full(dir.path(), "ref", &ram).manifest().memory_layers[0].clone();
        let ranges = Some(vec![(3 * PAGE, 4 * PAGE), (290 * PAGE, 1000 * PAGE)]);
        for (i, src) in [Copying(&ram, None), Copying(&ram, ranges)]
            .iter()
            .enumerate()
        {
            let name = format!("c{i}");
            let mut w = SnapshotWriter::new(
                &dir.path().join(&name),
                shape(ram.len()),
                kernel(dir.path()),
            )
            .unwrap();
            w.write_state(b"s").unwrap();
            let l = write_full_layer(&mut w, "mem", src).unwrap();
            assert_eq!(l, reference);
            w.commit().unwrap();
        }
    }

    #[test]
    fn sizes_must_match() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = SnapshotWriter::new(
            &dir.path().join("s"),
            shape(8 * PAGE_SIZE),
            kernel(dir.path()),
        )
        .unwrap();
        let small = vec![0u8; 4 * PAGE_SIZE];
        assert!(matches!(
            write_full_layer(&mut w, "m", &small),
            Err(LayerError::SourceSize { .. })
        ));
        let ram = vec![0u8; 8 * PAGE_SIZE];
        assert!(matches!(
            write_diff_layer(&mut w, "d", &ram, &DirtyBitmap::new(9)),
            Err(LayerError::BitmapSize { .. })
        ));
    }
}
