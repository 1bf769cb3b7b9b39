//! A memory layer's page map file (`<layer>.map`): which pages the layer
//! decides (present) and which of those hold data (the rest are zero).
//!
//! ```text
//! 0   8  magic "SPRTPMAP"
//! 8   4  version (1), little endian
//! 12  4  flags (0)
//! 16  8  pages
//! 24     present bitmap: ceil(pages / 64) u64 words, little endian
//! ..     data bitmap: as many words; data is a subset of present
//! ```

use super::bitmap::{tail_bits, words_for};

const MAGIC: &[u8; 8] = b"SPRTPMAP";
const VERSION: u32 = 1;
const HEADER: u64 = 24;

/// The two bitmaps of a memory layer, over `pages` pages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PageMap {
    pub pages: u64,
    pub present: Vec<u64>,
    pub data: Vec<u64>,
}

impl PageMap {
    /// A map with nothing present.
    pub(crate) fn empty(pages: u64) -> PageMap {
        PageMap {
            pages,
            present: vec![0; words_for(pages)],
            data: vec![0; words_for(pages)],
        }
    }

    /// A map with every page present and none holding data.
    pub(crate) fn all_present(pages: u64) -> PageMap {
        let mut m = PageMap::empty(pages);
        m.present.fill(u64::MAX);
        if pages & 63 != 0 {
            if let Some(last) = m.present.last_mut() {
                *last = (1u64 << (pages % 64)) - 1;
            }
        }
        m
    }

    /// Size of the encoded map for `pages` pages.
    pub(crate) fn encoded_len(pages: u64) -> u64 {
        HEADER + 16 * words_for(pages) as u64
    }

    pub(crate) fn set_present(&mut self, pfn: u64) {
        self.present[(pfn / 64) as usize] |= 1 << (pfn % 64);
    }

    pub(crate) fn set_data(&mut self, pfn: u64) {
        self.data[(pfn / 64) as usize] |= 1 << (pfn % 64);
    }

    pub(crate) fn is_present(&self, pfn: u64) -> bool {
        pfn < self.pages && self.present[(pfn / 64) as usize] & (1 << (pfn % 64)) != 0
    }

    pub(crate) fn has_data(&self, pfn: u64) -> bool {
        pfn < self.pages && self.data[(pfn / 64) as usize] & (1 << (pfn % 64)) != 0
    }

    pub(crate) fn present_count(&self) -> u64 {
        self.present.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    pub(crate) fn data_count(&self) -> u64 {
        self.data.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(Self::encoded_len(self.pages) as usize);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&self.pages.to_le_bytes());
        for w in self.present.iter().chain(&self.data) {
            out.extend_from_slice(&w.to_le_bytes());
        }
        out
    }

    /// Parses a map that must be over exactly `pages` pages.
    pub(crate) fn decode(bytes: &[u8], pages: u64) -> Result<PageMap, &'static str> {
        if bytes.len() as u64 != Self::encoded_len(pages) {
            return Err("wrong length for the snapshot's memory size");
        }
        if &bytes[..8] != MAGIC {
            return Err("not a page map (bad magic)");
        }
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
        if u32_at(8) != VERSION || u32_at(12) != 0 {
            return Err("unknown page map version or flags");
        }
        if u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes")) != pages {
            return Err("page count differs from the snapshot's memory size");
        }
        let n = words_for(pages);
        let mut words = bytes[HEADER as usize..]
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")));
        let present: Vec<u64> = words.by_ref().take(n).collect();
        let data: Vec<u64> = words.collect();
        if tail_bits(&present, pages) != 0 || tail_bits(&data, pages) != 0 {
            return Err("bits set past the last page");
        }
        if present.iter().zip(&data).any(|(p, d)| d & !p != 0) {
            return Err("data pages that are not present");
        }
        Ok(PageMap {
            pages,
            present,
            data,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_checks() {
        let mut m = PageMap::empty(100);
        m.set_present(3);
        m.set_data(3);
        m.set_present(99);
        let bytes = m.encode();
        assert_eq!(PageMap::decode(&bytes, 100).unwrap(), m);
        assert!(PageMap::decode(&bytes, 101).is_err());
        assert!(PageMap::decode(&bytes[..bytes.len() - 1], 100).is_err());
        let mut bad = bytes.clone();
        bad[24 + 16 + 8] = 0x80; // data word 0: page 7 has data, not present
        assert!(PageMap::decode(&bad, 100).is_err());
        let mut bad = bytes.clone();
        bad[24 + 15] = 0x80; // present word 1: page 127, past the end
        assert!(PageMap::decode(&bad, 100).is_err());
        let full = PageMap::all_present(100);
        assert_eq!(full.present_count(), 100);
        assert!(full.is_present(99) && !full.is_present(100));
    }
}
