//! Dirty pages copied out of guest RAM while the VM is paused, so that the diff
//! layer holding them can be written and fsynced after the VM runs again: the
//! pause costs a memory copy of the dirty pages, not their write and fsync.

use std::io;

use super::{DirtyBitmap, LayerError, RamSource};
use crate::PAGE_SIZE;

const PAGE: u64 = PAGE_SIZE as u64;

/// One run of staged pages: `count` pages from page `first`, at byte `at` of
/// the staging buffer.
#[derive(Clone, Copy, Debug)]
struct Run {
    first: u64,
    count: u64,
    at: usize,
}

/// A copy of the pages a [`DirtyBitmap`] marks, served as a [`RamSource`] of
/// the same RAM size. Reading a page that was not staged is an error (the
/// diff writer reads only the pages of the bitmap it was staged from).
pub struct StagedPages {
    len: u64,
    runs: Vec<Run>,
    data: Vec<u8>,
}

impl StagedPages {
    /// Copies the pages `dirty` marks out of `src` (the VM must be paused).
    pub fn capture(src: &dyn RamSource, dirty: &DirtyBitmap) -> Result<Self, LayerError> {
        let pages = src.len() / PAGE;
        if dirty.pages() != pages {
            return Err(LayerError::BitmapSize {
                words: dirty.words().len(),
                pages,
            });
        }
        let bytes = usize::try_from(dirty.count() * PAGE).map_err(|_| LayerError::Read {
            offset: 0,
            source: io::Error::other("too many dirty pages to stage"),
        })?;
        let mut data = vec![0u8; bytes];
        let mut runs = Vec::new();
        let mut at = 0usize;
        for (first, count) in dirty.runs() {
            let n = (count * PAGE) as usize;
            src.read(first * PAGE, &mut data[at..at + n])
                .map_err(|source| LayerError::Read {
                    offset: first * PAGE,
                    source,
                })?;
            runs.push(Run { first, count, at });
            at += n;
        }
        Ok(Self {
            len: src.len(),
            runs,
            data,
        })
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.data.len() as u64
    }
}

impl RamSource for StagedPages {
    fn len(&self) -> u64 {
        self.len
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let page = offset / PAGE;
        // The last run starting at or before `page`.
        let i = self.runs.partition_point(|r| r.first <= page);
        let run = i.checked_sub(1).map(|i| self.runs[i]);
        let end = offset.checked_add(buf.len() as u64);
        match (run, end) {
            (Some(r), Some(end))
                if offset.is_multiple_of(PAGE) && end <= (r.first + r.count) * PAGE =>
            {
                let at = r.at + (offset - r.first * PAGE) as usize;
                buf.copy_from_slice(&self.data[at..at + buf.len()]);
                Ok(())
            }
            _ => Err(io::Error::other(format!(
                "{} bytes at {offset:#x} were not staged",
                buf.len()
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RAM whose every byte is a function of its offset.
    struct Pattern(u64);

    impl RamSource for Pattern {
        fn len(&self) -> u64 {
            self.0
        }
        fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
            for (i, b) in buf.iter_mut().enumerate() {
                *b = ((offset + i as u64) / PAGE * 7 + (offset + i as u64)) as u8;
            }
            Ok(())
        }
    }

    #[test]
    fn staged_pages_read_back_as_the_source_and_nothing_else() {
        let src = Pattern(64 * PAGE);
        let mut words = vec![0u64; 1];
        // Pages 1-3, 10 and 63.
        words[0] = 0b1110 | 1 << 10 | 1 << 63;
        let dirty = DirtyBitmap::from_words(words, 64).unwrap();
        let s = StagedPages::capture(&src, &dirty).unwrap();
        assert_eq!(s.bytes(), 5 * PAGE);
        assert_eq!(s.len(), src.len());
        for (first, count) in [(1u64, 3u64), (2, 2), (10, 1), (63, 1)] {
            let mut a = vec![0u8; (count * PAGE) as usize];
            let mut b = a.clone();
            s.read(first * PAGE, &mut a).unwrap();
            src.read(first * PAGE, &mut b).unwrap();
            assert_eq!(a, b, "pages {first}+{count}");
        }
        let mut one = vec![0u8; PAGE as usize];
        // Not staged, across a run's end, not page-aligned, past the end.
        for off in [0, 4 * PAGE, 9 * PAGE, PAGE + 1, 64 * PAGE] {
            assert!(s.read(off, &mut one).is_err(), "offset {off:#x}");
        }
        let mut two = vec![0u8; 2 * PAGE as usize];
        assert!(s.read(3 * PAGE, &mut two).is_err());
        assert!(s.read(10 * PAGE, &mut two).is_err());
    }

    #[test]
    fn a_bitmap_of_another_size_is_refused() {
        let dirty = DirtyBitmap::from_words(vec![1], 64).unwrap();
        assert!(StagedPages::capture(&Pattern(32 * PAGE), &dirty).is_err());
    }
}
