//! [`DirtyBitmap`]: one bit per page of the RAM offset space, in
//! `KVM_GET_DIRTY_LOG`'s layout (bit `i % 64` of word `i / 64` is page `i`).

use super::LayerError;
use crate::PAGE_SIZE;

/// Number of `u64` words for `pages` bits.
pub(crate) fn words_for(pages: u64) -> usize {
    pages.div_ceil(64) as usize
}

/// A set of pages of the RAM offset space.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirtyBitmap {
    words: Vec<u64>,
    pages: u64,
}

impl DirtyBitmap {
    /// An empty bitmap over `pages` pages.
    pub fn new(pages: u64) -> DirtyBitmap {
        DirtyBitmap {
            words: vec![0; words_for(pages)],
            pages,
        }
    }

    /// An empty bitmap over `mem_bytes` of RAM (a page multiple).
    pub fn for_mem(mem_bytes: u64) -> DirtyBitmap {
        DirtyBitmap::new(mem_bytes / PAGE_SIZE as u64)
    }

    /// Takes KVM-layout words over `pages` pages. The word count must fit and
    /// no bit past the last page may be set.
    pub fn from_words(words: Vec<u64>, pages: u64) -> Result<DirtyBitmap, LayerError> {
        if words.len() != words_for(pages) {
            return Err(LayerError::BitmapSize {
                words: words.len(),
                pages,
            });
        }
        if tail_bits(&words, pages) != 0 {
            return Err(LayerError::BitmapTail { pages });
        }
        Ok(DirtyBitmap { words, pages })
    }

    pub fn pages(&self) -> u64 {
        self.pages
    }

    pub fn words(&self) -> &[u64] {
        &self.words
    }

    pub fn into_words(self) -> Vec<u64> {
        self.words
    }

    /// Marks page `pfn`. Panics if `pfn` is out of range.
    pub fn set(&mut self, pfn: u64) {
        assert!(pfn < self.pages, "pfn {pfn} out of {} pages", self.pages);
        self.words[(pfn / 64) as usize] |= 1 << (pfn % 64);
    }

    /// Whether page `pfn` is marked (false out of range).
    pub fn get(&self, pfn: u64) -> bool {
        pfn < self.pages && self.words[(pfn / 64) as usize] & (1 << (pfn % 64)) != 0
    }

    /// Marks every page marked in `other` (same page count).
    pub fn or(&mut self, other: &DirtyBitmap) -> Result<(), LayerError> {
        if other.pages != self.pages {
            return Err(LayerError::BitmapSize {
                words: other.words.len(),
                pages: self.pages,
            });
        }
        self.or_words(&other.words)
    }

    /// Marks every page marked in KVM-layout `words` (e.g. one more dirty
    /// log); `words` must have this bitmap's word count and no tail bits.
    pub fn or_words(&mut self, words: &[u64]) -> Result<(), LayerError> {
        if words.len() != self.words.len() {
            return Err(LayerError::BitmapSize {
                words: words.len(),
                pages: self.pages,
            });
        }
        if tail_bits(words, self.pages) != 0 {
            return Err(LayerError::BitmapTail { pages: self.pages });
        }
        for (a, b) in self.words.iter_mut().zip(words) {
            *a |= b;
        }
        Ok(())
    }

    /// Unmarks every page.
    pub fn clear(&mut self) {
        self.words.fill(0);
    }

    /// Number of marked pages.
    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// Marked pages in increasing order.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        iter_bits(&self.words)
    }

    /// Runs of consecutive marked pages as `(first, count)`.
    pub fn runs(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        runs_of(self.iter())
    }
}

/// Bits set past page `pages` in the last word.
pub(crate) fn tail_bits(words: &[u64], pages: u64) -> u64 {
    match (words.last(), pages % 64) {
        (Some(&w), used) if used != 0 => w & !((1u64 << used) - 1),
        _ => 0,
    }
}

/// Set bits of KVM-layout `words`, in increasing order.
pub(crate) fn iter_bits(words: &[u64]) -> impl Iterator<Item = u64> + '_ {
    words.iter().enumerate().flat_map(|(i, &w)| {
        let mut w = w;
        std::iter::from_fn(move || {
            if w == 0 {
                return None;
            }
            let b = w.trailing_zeros();
            w &= w - 1;
            Some(i as u64 * 64 + u64::from(b))
        })
    })
}

/// Coalesces increasing page numbers into `(first, count)` runs.
pub(crate) fn runs_of(mut pfns: impl Iterator<Item = u64>) -> impl Iterator<Item = (u64, u64)> {
    let mut cur: Option<(u64, u64)> = None;
    std::iter::from_fn(move || loop {
        match (pfns.next(), cur) {
            (Some(p), Some((s, n))) if p == s + n => cur = Some((s, n + 1)),
            (Some(p), Some(run)) => {
                cur = Some((p, 1));
                return Some(run);
            }
            (Some(p), None) => cur = Some((p, 1)),
            (None, run) => {
                cur = None;
                return run;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_iter_runs() {
        let mut b = DirtyBitmap::new(200);
        for p in [0, 1, 2, 63, 64, 65, 130, 199] {
            b.set(p);
        }
        assert_eq!(b.count(), 8);
        assert_eq!(
            b.iter().collect::<Vec<_>>(),
            vec![0, 1, 2, 63, 64, 65, 130, 199]
        );
        assert_eq!(
            b.runs().collect::<Vec<_>>(),
            vec![(0, 3), (63, 3), (130, 1), (199, 1)]
        );
        assert!(b.get(199) && !b.get(198) && !b.get(5000));
    }

    #[test]
    fn words_are_checked() {
        assert!(DirtyBitmap::from_words(vec![0; 3], 200).is_err());
        assert!(DirtyBitmap::from_words(vec![0, 0, 0, 1 << 8], 200).is_err());
        let mut a = DirtyBitmap::from_words(vec![1, 0, 0, 1 << 7], 200).unwrap();
        a.or_words(&[2, 0, 0, 0]).unwrap();
        assert_eq!(a.iter().collect::<Vec<_>>(), vec![0, 1, 199]);
        assert!(a.or_words(&[0, 0, 0, 1 << 9]).is_err());
        assert!(a.or(&DirtyBitmap::new(10)).is_err());
    }
}
