//! Memory layers: writing them ([`write_full_layer`], [`write_diff_layer`])
//! from a [`RamSource`], and reading a stack of them ([`LayerStack`]).
//!
//! A layer is a sparse data file exactly `memBytes` long, each page at its
//! natural offset, plus a page map (`<name>.map`) with two bitmaps: the pages
//! the layer decides (present: all of them for a full layer, the dirty ones
//! for a diff) and those of them that hold data. A present page without data
//! is zero, even if a lower layer has data there: that is how a diff records
//! a page that went back to zero. Data pages are never all-zero, so the data
//! file has data exactly where the map says.

mod bitmap;
mod extents;
mod filemap;
mod pagemap;
mod stack;
mod staged;
mod write;

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

pub use bitmap::DirtyBitmap;
pub(crate) use extents::fiemap_extents;
pub(crate) use pagemap::PageMap;
pub(crate) use stack::PageSource;
pub use stack::{LayerFiles, LayerStack, Page};
pub use staged::StagedPages;
pub use write::{write_diff_layer, write_full_layer};

use crate::format::SnapshotError;

#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error("RAM source is {actual} bytes, the snapshot's memory is {expected}")]
    SourceSize { actual: u64, expected: u64 },
    #[error("Dirty bitmap of {words} words does not cover {pages} pages")]
    BitmapSize { words: usize, pages: u64 },
    #[error("Dirty bitmap marks pages past the last of {pages}")]
    BitmapTail { pages: u64 },
    #[error("Cannot read guest RAM at offset {offset:#x}")]
    Read {
        offset: u64,
        #[source]
        source: io::Error,
    },
    #[error("Cannot write memory layer file {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("Snapshot file error")]
    Snapshot(#[from] SnapshotError),
    #[error("The snapshot chain has no full memory layer")]
    NoBase,
    #[error("Snapshots in the chain disagree on memory size")]
    MemMismatch,
    #[error("Memory layer {path} changed since it was verified")]
    Changed { path: PathBuf },
    #[error("Cannot map memory layer {path}")]
    Map {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Guest RAM as the layer writers see it: the RAM offset space `[0, len)`.
/// The VMM implements it over guest memory (with the VM paused).
pub trait RamSource {
    /// Size of the RAM offset space in bytes.
    fn len(&self) -> u64;

    /// Fills `buf` with the bytes at `offset`.
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// All of RAM as one slice, when it is one host mapping that nothing
    /// writes while the slice is borrowed (the VM is paused): the writers then
    /// check and write pages in place, without copying.
    fn as_slice(&self) -> Option<&[u8]> {
        None
    }

    /// Byte ranges `(start, end)` outside which RAM is known to be zero, e.g.
    /// the pages a booted VM's RAM holds (`/proc/self/pagemap`), or the data
    /// extents of a file (`SEEK_DATA`): a full layer then reads only
    /// those. `None` means all of RAM may hold data.
    fn data_ranges(&self) -> Option<Vec<(u64, u64)>> {
        None
    }
}

impl RamSource for Vec<u8> {
    fn len(&self) -> u64 {
        Vec::len(self) as u64
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        SliceSource(&self[..]).read(offset, buf)
    }

    fn as_slice(&self) -> Option<&[u8]> {
        Some(&self[..])
    }
}

/// A [`RamSource`] over a byte slice.
pub struct SliceSource<'a>(pub &'a [u8]);

impl RamSource for SliceSource<'_> {
    fn len(&self) -> u64 {
        self.0.len() as u64
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let src = usize::try_from(offset)
            .ok()
            .and_then(|o| self.0.get(o..o.checked_add(buf.len())?))
            .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
        buf.copy_from_slice(src);
        Ok(())
    }

    fn as_slice(&self) -> Option<&[u8]> {
        Some(self.0)
    }
}

/// A [`RamSource`] over a file holding RAM at offset 0:
/// `pread`, and its data extents as [`RamSource::data_ranges`].
pub struct FileSource<'a> {
    file: &'a File,
    len: u64,
}

impl<'a> FileSource<'a> {
    /// RAM is the first `len` bytes of `file`.
    pub fn new(file: &'a File, len: u64) -> FileSource<'a> {
        FileSource { file, len }
    }
}

impl RamSource for FileSource<'_> {
    fn len(&self) -> u64 {
        self.len
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    fn data_ranges(&self) -> Option<Vec<(u64, u64)>> {
        crate::format::data_extents(self.file, self.len).ok()
    }
}
