//! [`WorkingSet`]: the pages a restored guest touched first, kept beside the
//! snapshot (`working-set.bin`) so later restores can prefetch them.
//!
//! ```text
//! 0   8   magic "SPRTWSET"
//! 8   4   version (1)          12  4  flags (0)
//! 16  16  snapshot id (u128)   32  8  pages of RAM
//! 40  8   run count n
//! 48      n runs: (first pfn u64, page count u64), sorted, disjoint, apart
//! ..  16  xxh3-128 of all the bytes before it
//! ```
//! All little endian. The file is not in the manifest (it is written after
//! the snapshot is sealed, by a restore): it is replaced atomically
//! (temp file, fsync, rename, fsync directory) and checked on load.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_128;

use crate::format::{random_u128, Snapshot};
use crate::layers::DirtyBitmap;
use crate::PAGE_SIZE;

/// The working set's file name in a snapshot directory.
pub const WORKING_SET_FILE: &str = "working-set.bin";

const MAGIC: &[u8; 8] = b"SPRTWSET";
const VERSION: u32 = 1;
const HEADER: usize = 48;
const TRAILER: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum WorkingSetError {
    #[error("Cannot {op} working set {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("Working set {path} is invalid: {reason}")]
    Invalid { path: PathBuf, reason: &'static str },
    #[error("Working set {path} belongs to another snapshot")]
    OtherSnapshot { path: PathBuf },
    #[error("Working set is for {actual} pages of RAM, the snapshot has {expected}")]
    Pages { actual: u64, expected: u64 },
}

/// A set of pages of the RAM offset space, as sorted disjoint runs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkingSet {
    pages: u64,
    runs: Vec<(u64, u64)>,
}

impl WorkingSet {
    /// The pages in `pfns` (any order, duplicates allowed) that are below
    /// `pages`.
    pub fn from_pfns(pages: u64, pfns: impl IntoIterator<Item = u64>) -> WorkingSet {
        let mut bits = DirtyBitmap::new(pages);
        for p in pfns.into_iter().filter(|&p| p < pages) {
            bits.set(p);
        }
        WorkingSet::from_bitmap(&bits)
    }

    pub fn from_bitmap(bits: &DirtyBitmap) -> WorkingSet {
        WorkingSet {
            pages: bits.pages(),
            runs: bits.runs().collect(),
        }
    }

    /// Pages of the RAM offset space this set is over.
    pub fn mem_pages(&self) -> u64 {
        self.pages
    }

    /// Number of pages in the set.
    pub fn len(&self) -> u64 {
        self.runs.iter().map(|r| r.1).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// `(first pfn, count)` runs, sorted and disjoint.
    pub fn runs(&self) -> &[(u64, u64)] {
        &self.runs
    }

    pub fn contains(&self, pfn: u64) -> bool {
        let i = self.runs.partition_point(|r| r.0 + r.1 <= pfn);
        self.runs.get(i).is_some_and(|r| r.0 <= pfn)
    }

    pub fn pfns(&self) -> impl Iterator<Item = u64> + '_ {
        self.runs.iter().flat_map(|&(s, n)| s..s + n)
    }

    /// Writes the set beside `snapshot` (replacing any earlier one).
    pub fn save(&self, snapshot: &Snapshot) -> Result<(), WorkingSetError> {
        let dir = snapshot.dir();
        let path = dir.join(WORKING_SET_FILE);
        let io = |op, source| WorkingSetError::Io {
            op,
            path: path.clone(),
            source,
        };
        let mut bytes = Vec::with_capacity(HEADER + 16 * self.runs.len() + TRAILER);
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&VERSION.to_le_bytes());
        bytes.extend_from_slice(&0u32.to_le_bytes());
        bytes.extend_from_slice(&snapshot.id().0.to_le_bytes());
        bytes.extend_from_slice(&self.pages.to_le_bytes());
        bytes.extend_from_slice(&(self.runs.len() as u64).to_le_bytes());
        for &(s, n) in &self.runs {
            bytes.extend_from_slice(&s.to_le_bytes());
            bytes.extend_from_slice(&n.to_le_bytes());
        }
        let sum = xxh3_128(&bytes);
        bytes.extend_from_slice(&sum.to_le_bytes());
        let tmp = dir.join(format!(
            ".{WORKING_SET_FILE}.tmp-{:016x}",
            random_u128() as u64
        ));
        let written = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .and_then(|mut f| {
                f.write_all(&bytes)?;
                f.sync_all()
            })
            .and_then(|()| fs::rename(&tmp, &path));
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(io("write", e));
        }
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io("fsync the directory of", e))
    }

    /// Reads the set saved beside `snapshot`, if there is one, and checks it
    /// belongs to that snapshot and is well formed.
    pub fn load(snapshot: &Snapshot) -> Result<Option<WorkingSet>, WorkingSetError> {
        let path = snapshot.dir().join(WORKING_SET_FILE);
        let pages = snapshot.shape().mem_bytes / PAGE_SIZE as u64;
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(WorkingSetError::Io {
                    op: "open",
                    path,
                    source,
                })
            }
        };
        // At most one run per two pages (runs are apart).
        let max = (HEADER + TRAILER) as u64 + 16 * (pages / 2 + 1);
        let mut bytes = Vec::new();
        file.take(max + 1)
            .read_to_end(&mut bytes)
            .map_err(|source| WorkingSetError::Io {
                op: "read",
                path: path.clone(),
                source,
            })?;
        let ws = decode(&bytes, max, &path)?;
        if ws.0 != snapshot.id().0 {
            return Err(WorkingSetError::OtherSnapshot { path });
        }
        if ws.1.pages != pages {
            return Err(WorkingSetError::Pages {
                actual: ws.1.pages,
                expected: pages,
            });
        }
        Ok(Some(ws.1))
    }
}

fn decode(bytes: &[u8], max: u64, path: &Path) -> Result<(u128, WorkingSet), WorkingSetError> {
    let invalid = |reason| WorkingSetError::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    if bytes.len() as u64 > max {
        return Err(invalid("too large for the snapshot's memory"));
    }
    if bytes.len() < HEADER + TRAILER || &bytes[..8] != MAGIC {
        return Err(invalid("not a working set file"));
    }
    let (body, sum) = bytes.split_at(bytes.len() - TRAILER);
    if xxh3_128(body).to_le_bytes() != sum {
        return Err(invalid("checksum mismatch"));
    }
    let u64_at = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().expect("8 bytes"));
    if u64_at(8) != u64::from(VERSION) {
        return Err(invalid("unknown version or flags"));
    }
    let id = u128::from_le_bytes(body[16..32].try_into().expect("16 bytes"));
    let pages = u64_at(32);
    let n = u64_at(40);
    if n.checked_mul(16) != Some((body.len() - HEADER) as u64) {
        return Err(invalid("run count does not match its length"));
    }
    let mut runs = Vec::with_capacity(n as usize);
    let mut end = 0u64;
    for i in 0..n as usize {
        let (s, c) = (u64_at(HEADER + 16 * i), u64_at(HEADER + 16 * i + 8));
        let e = s.checked_add(c).ok_or_else(|| invalid("run overflows"))?;
        if c == 0 || e > pages || (i > 0 && s <= end) {
            return Err(invalid(
                "runs are empty, unsorted, touching or out of range",
            ));
        }
        runs.push((s, c));
        end = e;
    }
    Ok((id, WorkingSet { pages, runs }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_and_contains() {
        let ws = WorkingSet::from_pfns(100, [5, 3, 4, 9, 99, 100, 4]);
        assert_eq!(ws.runs(), &[(3, 3), (9, 1), (99, 1)]);
        assert_eq!(ws.len(), 5);
        assert!(ws.contains(3) && ws.contains(5) && ws.contains(99));
        assert!(!ws.contains(6) && !ws.contains(100) && !ws.contains(0));
        assert_eq!(ws.pfns().collect::<Vec<_>>(), vec![3, 4, 5, 9, 99]);
    }

    #[test]
    fn decode_checks_everything() {
        let p = Path::new("ws");
        let mut body = Vec::new();
        body.extend_from_slice(MAGIC);
        body.extend_from_slice(&1u32.to_le_bytes());
        body.extend_from_slice(&0u32.to_le_bytes());
        body.extend_from_slice(&7u128.to_le_bytes());
        body.extend_from_slice(&100u64.to_le_bytes());
        body.extend_from_slice(&2u64.to_le_bytes());
        for v in [10u64, 2, 20, 5] {
            body.extend_from_slice(&v.to_le_bytes());
        }
        let seal = |b: &[u8]| {
            let mut v = b.to_vec();
            v.extend_from_slice(&xxh3_128(b).to_le_bytes());
            v
        };
        let (id, ws) = decode(&seal(&body), 10_000, p).unwrap();
        assert_eq!((id, ws.runs()), (7, &[(10, 2), (20, 5)][..]));
        let mut sealed = seal(&body);
        sealed[50] ^= 1;
        assert!(decode(&sealed, 10_000, p).is_err());
        let mut overlap = body.clone();
        overlap[64..72].copy_from_slice(&11u64.to_le_bytes());
        assert!(decode(&seal(&overlap), 10_000, p).is_err());
        let mut past = body.clone();
        past[72..80].copy_from_slice(&81u64.to_le_bytes());
        assert!(decode(&seal(&past), 10_000, p).is_err());
        assert!(decode(&seal(&body), 20, p).is_err());
    }
}
