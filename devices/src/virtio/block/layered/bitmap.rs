//! A fixed-length bit set, one bit per cluster, with fast scans for set runs.

/// `len` bits in 64-bit words; bits at and past `len` are always clear.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Bitmap {
    words: Vec<u64>,
    len: u64,
}

/// Number of 64-bit words holding `len` bits.
pub(super) fn words_for(len: u64) -> usize {
    len.div_ceil(64) as usize
}

impl Bitmap {
    /// `len` clear bits.
    pub fn new(len: u64) -> Self {
        Self {
            words: vec![0; words_for(len)],
            len,
        }
    }

    /// `len` set bits.
    pub fn full(len: u64) -> Self {
        let mut b = Self {
            words: vec![u64::MAX; words_for(len)],
            len,
        };
        b.clear_tail();
        b
    }

    /// Bits from words (bit `i` is bit `i % 64` of word `i / 64`); `None` unless there
    /// are exactly enough words and the bits past `len` are clear.
    pub fn from_words(words: Vec<u64>, len: u64) -> Option<Self> {
        if words.len() != words_for(len) {
            return None;
        }
        let used = len % 64;
        let stray = match (words.last(), used) {
            (Some(&last), 1..) => last >> used != 0,
            _ => false,
        };
        (!stray).then_some(Self { words, len })
    }

    fn clear_tail(&mut self) {
        let used = self.len % 64;
        if let (Some(last), true) = (self.words.last_mut(), used != 0) {
            *last &= (1u64 << used) - 1;
        }
    }

    pub fn words(&self) -> &[u64] {
        &self.words
    }

    pub fn get(&self, i: u64) -> bool {
        i < self.len && self.words[(i / 64) as usize] & (1 << (i % 64)) != 0
    }

    /// Sets bit `i`; bits past the end are ignored.
    pub fn set(&mut self, i: u64) {
        if i < self.len {
            self.words[(i / 64) as usize] |= 1 << (i % 64);
        }
    }

    /// Sets bits `start..end` (those past the end are ignored), a word at a
    /// time.
    pub fn set_range(&mut self, start: u64, end: u64) {
        let end = end.min(self.len);
        let mut i = start;
        while i < end {
            let base = i - i % 64;
            let lo = i % 64;
            let hi = (end - base).min(64);
            let below_hi = if hi == 64 { u64::MAX } else { (1u64 << hi) - 1 };
            self.words[(base / 64) as usize] |= below_hi & (u64::MAX << lo);
            i = base + 64;
        }
    }

    pub fn clear_all(&mut self) {
        self.words.fill(0);
    }

    /// Number of set bits.
    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// Sets every bit set in `other` (of the same length).
    pub fn union_with(&mut self, other: &Bitmap) {
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a |= b;
        }
    }

    /// First bit at or after `from` whose value is `value`, or `len` if none.
    fn next(&self, from: u64, value: bool) -> u64 {
        let mut i = from;
        while i < self.len {
            let w = self.words[(i / 64) as usize];
            let w = if value { w } else { !w };
            let rest = w >> (i % 64);
            if rest != 0 {
                return (i + u64::from(rest.trailing_zeros())).min(self.len);
            }
            i = (i / 64 + 1) * 64;
        }
        self.len
    }

    /// The runs of set bits as `[start, end)`, in order; cost in proportion to the
    /// words scanned, so an empty map of millions of bits is quick.
    pub fn runs(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let mut pos = 0;
        std::iter::from_fn(move || {
            let start = self.next(pos, true);
            if start >= self.len {
                return None;
            }
            let end = self.next(start, false);
            pos = end;
            Some((start, end))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_get_count_and_runs() {
        let mut b = Bitmap::new(200);
        assert_eq!(b.runs().count(), 0);
        for i in [0, 1, 2, 63, 64, 65, 130, 199, 200, 1000] {
            b.set(i);
        }
        assert!(b.get(64) && !b.get(3) && !b.get(200));
        assert_eq!(b.count(), 8);
        let runs: Vec<_> = b.runs().collect();
        assert_eq!(runs, [(0, 3), (63, 66), (130, 131), (199, 200)]);
        let full = Bitmap::full(130);
        assert_eq!(full.count(), 130);
        assert_eq!(full.runs().collect::<Vec<_>>(), [(0, 130)]);
        let mut u = Bitmap::new(130);
        u.set(5);
        u.union_with(&full);
        assert_eq!(u, full);
        u.clear_all();
        assert_eq!(u.count(), 0);
    }

    #[test]
    fn set_range_sets_exactly_the_range() {
        for (len, start, end) in [
            (200, 0, 200),
            (200, 3, 4),
            (200, 60, 70),
            (200, 64, 128),
            (200, 63, 129),
            (200, 190, 300),
            (130, 5, 5),
        ] {
            let mut b = Bitmap::new(len);
            b.set_range(start, end);
            let mut want = Bitmap::new(len);
            for i in start..end {
                want.set(i);
            }
            assert_eq!(b, want, "{start}..{end} of {len}");
        }
    }

    #[test]
    fn from_words_checks_length_and_tail() {
        assert!(Bitmap::from_words(vec![u64::MAX; 2], 128).is_some());
        assert!(Bitmap::from_words(vec![u64::MAX; 2], 100).is_none());
        assert!(Bitmap::from_words(vec![0; 3], 128).is_none());
        let b = Bitmap::from_words(vec![1, 1 << 35], 100).unwrap();
        assert_eq!(b.runs().collect::<Vec<_>>(), [(0, 1), (99, 100)]);
        assert_eq!(Bitmap::new(0).runs().count(), 0);
    }
}
