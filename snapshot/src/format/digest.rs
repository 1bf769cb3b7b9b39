//! Checksums of snapshot files: a 128-bit xxh3 over a file's non-zero 4 KiB
//! chunks, each preceded by its index, then the file size.
//!
//! Zero chunks are skipped, so the cost is in proportion to the data present
//! and a sparse file is read only where it has data (`SEEK_DATA`/`SEEK_HOLE`).
//! A byte flipped anywhere still changes the digest: in a data chunk it changes
//! that chunk's bytes; in a hole it makes a new non-zero chunk appear in the
//! stream. How the filesystem happens to lay out extents does not matter.

use std::cell::RefCell;
use std::fmt;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use rustix::fs::SeekFrom;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use xxhash_rust::xxh3::Xxh3Default;

use crate::PAGE_SIZE;

const CHUNK: u64 = PAGE_SIZE as u64;
/// How much of a data extent is read per `pread`.
const READ_BUF: usize = 256 << 10;

static ZERO_PAGE: [u8; PAGE_SIZE] = [0; PAGE_SIZE];

/// A 128-bit checksum, written as 32 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Checksum(pub u128);

impl fmt::Display for Checksum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for Checksum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl Checksum {
    /// Parses exactly 32 lowercase hex digits.
    pub fn from_hex(s: &str) -> Option<Checksum> {
        parse_hex128(s).map(Checksum)
    }
}

impl Serialize for Checksum {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Checksum {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Checksum::from_hex(&s)
            .ok_or_else(|| serde::de::Error::custom("expected 32 lowercase hex digits"))
    }
}

/// Parses exactly 32 lowercase hex digits into a `u128`.
pub(crate) fn parse_hex128(s: &str) -> Option<u128> {
    if s.len() != 32 || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    u128::from_str_radix(s, 16).ok()
}

/// True if every byte of `b` is zero (memcmp against a zero page: fast in
/// debug builds too).
pub(crate) fn is_zero(b: &[u8]) -> bool {
    b.chunks(PAGE_SIZE).all(|c| c == &ZERO_PAGE[..c.len()])
}

/// The streaming form of the file digest: feed non-zero chunks in increasing
/// index order, then [`SparseHasher::finish`] with the file size.
pub(crate) struct SparseHasher {
    h: Xxh3Default,
    chunks: u64,
}

impl SparseHasher {
    pub(crate) fn new() -> SparseHasher {
        SparseHasher {
            h: Xxh3Default::new(),
            chunks: 0,
        }
    }

    /// Adds chunk `index`; the caller has checked it is not all zero.
    pub(crate) fn chunk(&mut self, index: u64, bytes: &[u8]) {
        self.h.update(&index.to_le_bytes());
        self.h.update(bytes);
        self.chunks += 1;
    }

    pub(crate) fn finish(mut self, size: u64) -> Checksum {
        self.h.update(&size.to_le_bytes());
        Checksum(self.h.digest128())
    }
}

/// The digest of a file held in memory (same value as [`scan_file`] gives).
pub(crate) fn digest_bytes(bytes: &[u8]) -> Checksum {
    let mut h = SparseHasher::new();
    for (i, c) in bytes.chunks(PAGE_SIZE).enumerate() {
        if !is_zero(c) {
            h.chunk(i as u64, c);
        }
    }
    h.finish(bytes.len() as u64)
}

/// The data extents of `file` within `[0, size)`, as `(start, end)` pairs in
/// increasing order: from FIEMAP (one call per 256 extents), else from
/// `SEEK_DATA`/`SEEK_HOLE`; a filesystem with neither yields one extent.
pub(crate) fn data_extents(file: &File, size: u64) -> io::Result<Vec<(u64, u64)>> {
    if let Some(ext) = crate::layers::fiemap_extents(file, size)? {
        return Ok(ext);
    }
    seek_extents(file, size)
}

/// [`data_extents`] by `SEEK_DATA`/`SEEK_HOLE`.
pub(crate) fn seek_extents(file: &File, size: u64) -> io::Result<Vec<(u64, u64)>> {
    let mut out = Vec::new();
    let mut pos = 0u64;
    while pos < size {
        let start = match rustix::fs::seek(file, SeekFrom::Data(pos)) {
            Ok(s) => s,
            Err(rustix::io::Errno::NXIO) => break,
            Err(rustix::io::Errno::INVAL) if pos == 0 => return Ok(vec![(0, size)]),
            Err(e) => return Err(e.into()),
        };
        if start >= size {
            break;
        }
        let end = rustix::fs::seek(file, SeekFrom::Hole(start))?.min(size);
        if end <= start {
            // A filesystem that disagrees with itself: take the rest as data.
            out.push((start, size));
            break;
        }
        out.push((start, end));
        pos = end;
    }
    Ok(out)
}

/// What [`scan_file`] found.
pub(crate) struct FileScan {
    pub checksum: Checksum,
    /// Non-zero chunks seen.
    pub data_chunks: u64,
    /// The first non-zero chunk that `expect` refused, if any.
    pub unexpected_chunk: Option<u64>,
}

/// Digests the first `size` bytes of `file`, reading only its data extents.
/// `expect(index)` is asked about every non-zero chunk (to check it against a
/// page map); the scan goes on either way.
///
/// (`pread` into a reused buffer: measured faster here than hashing through
/// a mapping, whose page faults cost more than the copy.)
pub(crate) fn scan_file(
    file: &File,
    size: u64,
    mut expect: impl FnMut(u64) -> bool,
) -> io::Result<FileScan> {
    thread_local! {
        static BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    }
    let mut hasher = SparseHasher::new();
    let mut unexpected_chunk = None;
    let extents = data_extents(file, size)?;
    BUF.with(|buf| {
        let mut buf = buf.borrow_mut();
        if buf.len() < READ_BUF {
            buf.resize(READ_BUF, 0);
        }
        // First byte not yet digested (extents are rounded out to whole chunks).
        let mut done = 0u64;
        for (start, end) in extents {
            let mut pos = (start / CHUNK * CHUNK).max(done);
            let end = end.div_ceil(CHUNK).saturating_mul(CHUNK).min(size);
            while pos < end {
                let n = ((end - pos) as usize).min(READ_BUF);
                file.read_exact_at(&mut buf[..n], pos)?;
                for (i, c) in buf[..n].chunks(PAGE_SIZE).enumerate() {
                    if is_zero(c) {
                        continue;
                    }
                    let index = pos / CHUNK + i as u64;
                    if !expect(index) && unexpected_chunk.is_none() {
                        unexpected_chunk = Some(index);
                    }
                    hasher.chunk(index, c);
                }
                pos += n as u64;
            }
            done = done.max(end);
        }
        Ok::<(), io::Error>(())
    })?;
    let data_chunks = hasher.chunks;
    Ok(FileScan {
        checksum: hasher.finish(size),
        data_chunks,
        unexpected_chunk,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn sparse_file(pages: &[(u64, u8)], len: u64) -> File {
        let mut f = tempfile::tempfile().unwrap();
        f.set_len(len).unwrap();
        for &(pfn, byte) in pages {
            f.write_all_at(&[byte; PAGE_SIZE], pfn * CHUNK).unwrap();
        }
        f.flush().unwrap();
        f
    }

    #[test]
    fn file_and_bytes_digests_agree() {
        let len = 64 * CHUNK + 100;
        let f = sparse_file(&[(0, 1), (7, 2), (8, 3), (40, 4)], len);
        let mut bytes = vec![0u8; len as usize];
        f.read_exact_at(&mut bytes, 0).unwrap();
        let scan = scan_file(&f, len, |_| true).unwrap();
        assert_eq!(scan.checksum, digest_bytes(&bytes));
        assert_eq!(scan.data_chunks, 4);
    }

    #[test]
    fn a_byte_in_a_hole_or_in_data_changes_the_digest() {
        let len = 32 * CHUNK;
        let f = sparse_file(&[(3, 9)], len);
        let before = scan_file(&f, len, |_| true).unwrap().checksum;
        f.write_all_at(&[1], 20 * CHUNK + 5).unwrap();
        let hole = scan_file(&f, len, |i| i == 3).unwrap();
        assert_ne!(hole.checksum, before);
        assert_eq!(hole.unexpected_chunk, Some(20));
        f.write_all_at(&[0], 20 * CHUNK + 5).unwrap();
        assert_eq!(scan_file(&f, len, |_| true).unwrap().checksum, before);
        f.write_all_at(&[8], 3 * CHUNK + 4095).unwrap();
        assert_ne!(scan_file(&f, len, |_| true).unwrap().checksum, before);
    }

    #[test]
    fn extents_cover_only_data() {
        let len = 1024 * CHUNK;
        let f = sparse_file(&[(100, 1), (900, 1)], len);
        for ext in [
            data_extents(&f, len).unwrap(),
            seek_extents(&f, len).unwrap(),
        ] {
            let covered: u64 = ext.iter().map(|(s, e)| e - s).sum();
            assert!(covered < len / 4, "extents {ext:?}");
            for at in [100 * CHUNK, 900 * CHUNK] {
                assert!(
                    ext.iter().any(|&(s, e)| s <= at && at < e),
                    "{at} in {ext:?}"
                );
            }
        }
    }

    #[test]
    fn checksum_hex_round_trip() {
        let c = Checksum(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
        assert_eq!(Checksum::from_hex(&c.to_string()), Some(c));
        assert_eq!(Checksum::from_hex("0123"), None);
        assert_eq!(Checksum::from_hex(&"A".repeat(32)), None);
    }
}
