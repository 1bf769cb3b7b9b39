//! The cluster map file of a disk layer: which clusters the layer's data file holds.
//!
//! Layout (all integers little endian): a header, a body, a checksum.
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 8 | magic `SPRTLMAP` |
//! | 8 | 4 | format version: 3 (runs) or 2 (bitmap); 1 (bitmap) is still read |
//! | 12 | 4 | cluster size, 4096 |
//! | 16 | 8 | disk size in bytes |
//! | 24 | 8 | number of clusters present |
//! | 32 | ... | body |
//! | end − 8 | 8 | checksum of every byte before it: XXH3-64 (version 1: FNV-1a 64) |
//!
//! Body of version 3, the runs of present clusters:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 32 | 8 | number of runs `n` |
//! | 40 | 16 × `n` | each run: first cluster, number of clusters (at least 1); in order, each starting past the cluster after the one before ends |
//!
//! Body of versions 2 and 1: a bitmap of 8 × ⌈clusters / 64⌉ bytes, cluster
//! `i` is bit `i % 64` of word `i / 64`.
//!
//! A layer is written in whichever of the two is shorter, so a map file is
//! never longer than the bitmap of its disk. The bitmap of a 16 GiB disk is
//! 512 KiB, which every restore and fork child read and checksummed for every
//! layer of its chain (12 ms in the emulated lab, most of it for a disk a
//! guest barely wrote); its runs are a few hundred bytes. Version 1's
//! byte-at-a-time FNV-1a took 0.87 ms for that bitmap on the development
//! host (AMD EPYC); XXH3 reads it in tens of microseconds.
//!
//! Opening checks everything before the map is used: a length that fits the
//! disk (checked before reading, so a map is never read beyond the bitmap
//! length of that disk), magic, version, checksum, cluster size, disk size,
//! for a bitmap no bits past the last cluster, for runs their order and
//! bounds, and the present count.

use std::fs::File;
use std::io::{self, Read, Write};
use std::path::Path;

use super::bitmap::{words_for, Bitmap};
use super::CLUSTER_SIZE;

const MAGIC: &[u8; 8] = b"SPRTLMAP";
/// The runs of present clusters; written when shorter than the bitmap.
const VERSION_RUNS: u32 = 3;
/// A bitmap; written when no shorter than the runs.
const VERSION: u32 = 2;
/// The first version: a bitmap checksummed with FNV-1a (still read).
const VERSION_FNV: u32 = 1;
const HEADER_LEN: u64 = 32;
const TRAILER_LEN: u64 = 8;
/// A run: first cluster, number of clusters.
const RUN_LEN: u64 = 16;
/// A runs map without runs: header, run count, checksum.
const RUNS_MIN_LEN: u64 = HEADER_LEN + 8 + TRAILER_LEN;

#[derive(Debug, thiserror::Error)]
pub enum MapError {
    #[error("Cannot read or write the map file")]
    Io(#[source] io::Error),
    #[error("Map file is {found} bytes, a map of this disk is {expected}")]
    Length { found: u64, expected: u64 },
    #[error("Map file is {found} bytes, more than the {max} of this disk's bitmap")]
    TooLong { found: u64, max: u64 },
    #[error("Map file is {found} bytes, not a whole number of runs")]
    RunsLength { found: u64 },
    #[error("Map says it has {stated} runs, its length holds {found}")]
    RunCount { stated: u64, found: u64 },
    #[error(
        "Map run {index} is empty, out of order, touches the run before it or ends past the disk"
    )]
    BadRun { index: u64 },
    #[error("Not a layer map file (bad magic)")]
    Magic,
    #[error("Map format version {0} is not supported")]
    Version(u32),
    #[error("Map cluster size is {0}, only 4096 is supported")]
    ClusterSize(u32),
    #[error("Map is for a disk of {map} bytes, this disk is {disk}")]
    DiskSize { map: u64, disk: u64 },
    #[error("Map checksum does not match its contents")]
    Checksum,
    #[error("Map marks clusters past the end of the disk")]
    StrayBits,
    #[error("Map says {stated} clusters are present, its body has {counted}")]
    Count { stated: u64, counted: u64 },
}

/// Length of the bitmap map file of a disk of `disk_size` bytes: the
/// longest map file of that disk.
pub(super) fn map_len(disk_size: u64) -> u64 {
    let clusters = disk_size.div_ceil(CLUSTER_SIZE);
    HEADER_LEN + 8 * words_for(clusters) as u64 + TRAILER_LEN
}

/// The checksum of a map of format `version`.
fn checksum(version: u32, bytes: &[u8]) -> u64 {
    if version == VERSION_FNV {
        fnv1a(bytes)
    } else {
        xxhash_rust::xxh3::xxh3_64(bytes)
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The map file of `map`, a map of a disk of `disk_size` bytes: its runs
/// if they are shorter than its bitmap, else the bitmap.
pub(super) fn encode(map: &Bitmap, disk_size: u64) -> Vec<u8> {
    // The most runs shorter than the bitmap; collecting stops one past them,
    // so a fragmented map is not listed whole only to be written as bits.
    // (None: even no runs are not shorter, a one-cluster disk.)
    let fit = (map_len(disk_size) - RUNS_MIN_LEN)
        .checked_sub(1)
        .map(|room| room / RUN_LEN);
    let runs = fit.and_then(|fit| {
        let runs: Vec<(u64, u64)> = map.runs().take(fit as usize + 1).collect();
        (runs.len() as u64 <= fit).then_some(runs)
    });
    encode_as(map, disk_size, runs)
}

/// `map` as runs (`runs`: `map`'s) or, without them, as a bitmap.
fn encode_as(map: &Bitmap, disk_size: u64, runs: Option<Vec<(u64, u64)>>) -> Vec<u8> {
    let version = if runs.is_some() {
        VERSION_RUNS
    } else {
        VERSION
    };
    let mut out = Vec::with_capacity(match &runs {
        Some(r) => (RUNS_MIN_LEN + RUN_LEN * r.len() as u64) as usize,
        None => map_len(disk_size) as usize,
    });
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(CLUSTER_SIZE as u32).to_le_bytes());
    out.extend_from_slice(&disk_size.to_le_bytes());
    out.extend_from_slice(&map.count().to_le_bytes());
    match runs {
        Some(runs) => {
            out.extend_from_slice(&(runs.len() as u64).to_le_bytes());
            for (start, end) in runs {
                out.extend_from_slice(&start.to_le_bytes());
                out.extend_from_slice(&(end - start).to_le_bytes());
            }
        }
        None => {
            for w in map.words() {
                out.extend_from_slice(&w.to_le_bytes());
            }
        }
    }
    let sum = checksum(version, &out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// Writes the map of a disk of `disk_size` bytes to a new file at `path` (which must not
/// exist) and syncs it if `sync`; removes the file again if that fails. Returns the bytes
/// written.
pub(super) fn write(
    path: &Path,
    map: &Bitmap,
    disk_size: u64,
    sync: bool,
) -> Result<u64, MapError> {
    let bytes = encode(map, disk_size);
    let mut f = File::options()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(MapError::Io)?;
    let synced = |f: &File| if sync { f.sync_all() } else { Ok(()) };
    if let Err(e) = f.write_all(&bytes).and_then(|()| synced(&f)) {
        let _ = std::fs::remove_file(path);
        return Err(MapError::Io(e));
    }
    Ok(bytes.len() as u64)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Reads and checks the map at `path` of a disk of `disk_size` bytes.
pub(super) fn read(path: &Path, disk_size: u64) -> Result<Bitmap, MapError> {
    let mut f = File::open(path).map_err(MapError::Io)?;
    let max = map_len(disk_size);
    let found = f.metadata().map_err(MapError::Io)?.len();
    if found > max {
        return Err(MapError::TooLong { found, max });
    }
    let mut b = vec![0u8; found as usize];
    f.read_exact(&mut b).map_err(MapError::Io)?;
    decode(&b, disk_size)
}

/// Checks the map file `b` of a disk of `disk_size` bytes and returns its
/// clusters.
pub(super) fn decode(b: &[u8], disk_size: u64) -> Result<Bitmap, MapError> {
    let dense = map_len(disk_size);
    let found = b.len() as u64;
    if found > dense {
        return Err(MapError::TooLong { found, max: dense });
    }
    if found < HEADER_LEN + TRAILER_LEN {
        return Err(MapError::Length {
            found,
            expected: dense,
        });
    }
    if &b[..8] != MAGIC {
        return Err(MapError::Magic);
    }
    // The version picks the body and the checksum; a damaged one fails the
    // checksum, or is unknown.
    let version = u32_at(b, 8);
    match version {
        VERSION | VERSION_FNV if found != dense => {
            return Err(MapError::Length {
                found,
                expected: dense,
            })
        }
        VERSION | VERSION_FNV => {}
        VERSION_RUNS if found < RUNS_MIN_LEN || !(found - RUNS_MIN_LEN).is_multiple_of(RUN_LEN) => {
            return Err(MapError::RunsLength { found })
        }
        VERSION_RUNS => {}
        other => return Err(MapError::Version(other)),
    }
    let body = b.len() - TRAILER_LEN as usize;
    if checksum(version, &b[..body]) != u64_at(b, body) {
        return Err(MapError::Checksum);
    }
    match u32_at(b, 12) {
        c if u64::from(c) == CLUSTER_SIZE => {}
        c => return Err(MapError::ClusterSize(c)),
    }
    let map_size = u64_at(b, 16);
    if map_size != disk_size {
        return Err(MapError::DiskSize {
            map: map_size,
            disk: disk_size,
        });
    }
    let clusters = disk_size.div_ceil(CLUSTER_SIZE);
    let stated = u64_at(b, 24);
    let (map, counted) = if version == VERSION_RUNS {
        decode_runs(&b[HEADER_LEN as usize..body], clusters)?
    } else {
        let words = b[HEADER_LEN as usize..body]
            .chunks_exact(8)
            .map(|c| u64_at(c, 0))
            .collect();
        let map = Bitmap::from_words(words, clusters).ok_or(MapError::StrayBits)?;
        let counted = map.count();
        (map, counted)
    };
    if stated != counted {
        return Err(MapError::Count { stated, counted });
    }
    Ok(map)
}

/// A version 3 body (the run count, then the runs) of a disk of `clusters`
/// clusters: its bitmap and the clusters it marks.
fn decode_runs(body: &[u8], clusters: u64) -> Result<(Bitmap, u64), MapError> {
    let stated = u64_at(body, 0);
    let runs = &body[8..];
    let found = runs.len() as u64 / RUN_LEN;
    if stated != found {
        return Err(MapError::RunCount { stated, found });
    }
    let mut map = Bitmap::new(clusters);
    let (mut next, mut counted) = (0u64, 0u64);
    for (index, r) in (0u64..).zip(runs.chunks_exact(RUN_LEN as usize)) {
        let (start, len) = (u64_at(r, 0), u64_at(r, 8));
        let end = start.checked_add(len).filter(|&e| e <= clusters);
        match end {
            Some(end) if len > 0 && start >= next => {
                map.set_range(start, end);
                counted += len;
                // The next run starts past the gap after this one: runs
                // never touch, so a map has one encoding.
                next = end + 1;
            }
            _ => return Err(MapError::BadRun { index }),
        }
    }
    Ok((map, counted))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DISK: u64 = 100 * CLUSTER_SIZE + 512;

    fn sample() -> Bitmap {
        let mut m = Bitmap::new(DISK.div_ceil(CLUSTER_SIZE));
        for i in [0, 7, 64, 100] {
            m.set(i);
        }
        m
    }

    /// Re-checksums a tampered map, so that the field checks themselves are reached.
    fn reseal(b: &mut [u8]) {
        let body = b.len() - 8;
        let sum = checksum(u32_at(b, 8), &b[..body]);
        b[body..].copy_from_slice(&sum.to_le_bytes());
    }

    #[test]
    fn encode_decode_round_trip() {
        let m = sample();
        let b = encode(&m, DISK);
        assert_eq!(b.len() as u64, map_len(DISK));
        assert_eq!(b.len(), 32 + 2 * 8 + 8);
        assert_eq!(decode(&b, DISK).unwrap(), m);
    }

    #[test]
    fn every_bad_field_is_refused() {
        let good = encode(&sample(), DISK);
        let check = |edit: &dyn Fn(&mut Vec<u8>), reseal_it: bool| {
            let mut b = good.clone();
            edit(&mut b);
            if reseal_it {
                reseal(&mut b);
            }
            decode(&b, DISK).unwrap_err()
        };
        assert!(matches!(
            check(&|b| b.truncate(40), false),
            MapError::Length { .. }
        ));
        assert!(matches!(
            check(&|b| b.push(0), false),
            MapError::TooLong { .. }
        ));
        assert!(matches!(check(&|b| b[0] = b'X', false), MapError::Magic));
        assert!(matches!(check(&|b| b[33] ^= 1, false), MapError::Checksum));
        assert!(matches!(check(&|b| b[8] = 4, true), MapError::Version(4)));
        // A bitmap relabelled runs is not a whole number of runs.
        assert!(matches!(
            check(&|b| b[8] = 3, true),
            MapError::RunsLength { found: 56 }
        ));
        // A version 2 map relabelled 1 fails version 1's checksum.
        assert!(matches!(check(&|b| b[8] = 1, false), MapError::Checksum));
        assert!(matches!(
            check(&|b| b[13] = 0x20, true),
            MapError::ClusterSize(0x2000)
        ));
        assert!(matches!(
            check(&|b| b[17] ^= 1, true),
            MapError::DiskSize { .. }
        ));
        // Cluster 101 does not exist (the disk has 101 clusters: 0..=100).
        assert!(matches!(
            check(&|b| b[32 + 8 + 4] |= 1 << 5, true),
            MapError::StrayBits
        ));
        assert!(matches!(
            check(&|b| b[24] = 9, true),
            MapError::Count {
                stated: 9,
                counted: 4
            }
        ));
        // The same map read for another disk size is refused by length or size.
        assert!(decode(&good, DISK + 512).is_err());
    }

    /// A big disk a guest barely wrote: its runs, a few bytes instead of the
    /// bitmap's 512 KiB.
    const BIG: u64 = 16 << 30;

    fn sparse() -> Bitmap {
        let mut m = Bitmap::new(BIG / CLUSTER_SIZE);
        m.set_range(0, 300);
        m.set_range(4096, 4097);
        m.set_range(1 << 20, (1 << 20) + 64);
        m.set_range((BIG / CLUSTER_SIZE) - 2, BIG / CLUSTER_SIZE);
        m
    }

    #[test]
    fn a_sparse_map_is_written_as_runs_and_reads_back() {
        let m = sparse();
        let b = encode(&m, BIG);
        assert_eq!(u32_at(&b, 8), VERSION_RUNS);
        assert_eq!(b.len(), 32 + 8 + 4 * 16 + 8);
        assert_eq!(u64_at(&b, 24), 300 + 1 + 64 + 2);
        assert_eq!(decode(&b, BIG).unwrap(), m);
        // Empty: no runs at all.
        let empty = Bitmap::new(BIG / CLUSTER_SIZE);
        let b = encode(&empty, BIG);
        assert_eq!(b.len() as u64, RUNS_MIN_LEN);
        assert_eq!(decode(&b, BIG).unwrap(), empty);
        // The same map as a bitmap (as version 2 wrote every map) reads the same.
        let dense = encode_as(&m, BIG, None);
        assert_eq!(dense.len() as u64, map_len(BIG));
        assert_eq!(decode(&dense, BIG).unwrap(), m);
    }

    #[test]
    fn runs_are_written_only_when_strictly_shorter() {
        // Up to 64 clusters the bitmap is 48 bytes, as long as no runs.
        for clusters in [1, 64] {
            let m = Bitmap::new(clusters);
            assert_eq!(u32_at(&encode(&m, clusters * 4096), 8), VERSION);
        }
        // 65 clusters: a 56-byte bitmap; no runs (48 bytes) are shorter, one
        // run (64 bytes) is not.
        let disk = 65 * 4096;
        let mut m = Bitmap::new(65);
        assert_eq!(u32_at(&encode(&m, disk), 8), VERSION_RUNS);
        m.set(3);
        assert_eq!(u32_at(&encode(&m, disk), 8), VERSION);
        assert_eq!(decode(&encode(&m, disk), disk).unwrap(), m);
    }

    #[test]
    fn a_map_with_more_runs_than_fit_its_bitmap_is_written_as_the_bitmap() {
        // Every other cluster: 51 runs of 101 clusters cost more than 2 words.
        let mut m = Bitmap::new(DISK.div_ceil(CLUSTER_SIZE));
        for i in (0..101).step_by(2) {
            m.set(i);
        }
        let b = encode(&m, DISK);
        assert_eq!(u32_at(&b, 8), VERSION);
        assert_eq!(decode(&b, DISK).unwrap(), m);
        // Those runs, written anyway, are longer than any map of this disk.
        let runs = encode_as(&m, DISK, Some(m.runs().collect()));
        assert!(matches!(
            decode(&runs, DISK),
            Err(MapError::TooLong { max: 56, .. })
        ));
    }

    #[test]
    fn every_bad_run_is_refused() {
        let clusters = BIG / CLUSTER_SIZE;
        // Runs (first, count) written as given, sealed with a right count.
        let map_of = |runs: &[(u64, u64)]| {
            let mut b = Vec::new();
            b.extend_from_slice(MAGIC);
            b.extend_from_slice(&VERSION_RUNS.to_le_bytes());
            b.extend_from_slice(&(CLUSTER_SIZE as u32).to_le_bytes());
            b.extend_from_slice(&BIG.to_le_bytes());
            let count = runs.iter().fold(0u64, |a, r| a.wrapping_add(r.1));
            b.extend_from_slice(&count.to_le_bytes());
            b.extend_from_slice(&(runs.len() as u64).to_le_bytes());
            for (s, n) in runs {
                b.extend_from_slice(&s.to_le_bytes());
                b.extend_from_slice(&n.to_le_bytes());
            }
            b.extend_from_slice(&[0; 8]);
            reseal(&mut b);
            b
        };
        let bad = |runs: &[(u64, u64)]| decode(&map_of(runs), BIG).unwrap_err();
        assert!(decode(&map_of(&[(0, 3), (4, 1), (clusters - 1, 1)]), BIG).is_ok());
        for (runs, index) in [
            (&[(0, 0)][..], 0),
            (&[(0, 3), (3, 1)], 1),
            (&[(0, 3), (2, 5)], 1),
            (&[(10, 3), (0, 1)], 1),
            (&[(clusters - 1, 2)], 0),
            (&[(clusters, 1)], 0),
            (&[(1, u64::MAX)], 0),
            (&[(u64::MAX, 1)], 0),
        ] {
            assert!(
                matches!(bad(runs), MapError::BadRun { index: i } if i == index),
                "{runs:?}"
            );
        }
        let good = map_of(&[(0, 3), (8, 2)]);
        let check = |edit: &dyn Fn(&mut Vec<u8>)| {
            let mut b = good.clone();
            edit(&mut b);
            reseal(&mut b);
            decode(&b, BIG).unwrap_err()
        };
        assert!(matches!(
            check(&|b| b[32] = 3),
            MapError::RunCount {
                stated: 3,
                found: 2
            }
        ));
        assert!(matches!(
            check(&|b| b[24] = 4),
            MapError::Count {
                stated: 4,
                counted: 5
            }
        ));
        assert!(matches!(
            check(&|b| b.insert(40, 0)),
            MapError::RunsLength { found: 81 }
        ));
        assert!(matches!(
            check(&|b| b.truncate(40)),
            MapError::RunsLength { found: 40 }
        ));
        // Unsealed: a flipped bit in a run.
        let mut b = good.clone();
        b[41] ^= 1;
        assert!(matches!(decode(&b, BIG), Err(MapError::Checksum)));
    }

    /// Layers written before version 2 (sleeping sandboxes, templates) still
    /// open: a version 1 map, checksummed with FNV-1a, as that code wrote it.
    #[test]
    fn a_version_1_map_still_reads() {
        let m = sample();
        let mut b = encode(&m, DISK);
        b[8..12].copy_from_slice(&VERSION_FNV.to_le_bytes());
        let body = b.len() - 8;
        let sum = fnv1a(&b[..body]);
        b[body..].copy_from_slice(&sum.to_le_bytes());
        // The checksum version 1 wrote for this map (FNV-1a 64 of its 48
        // bytes, computed outside this code).
        assert_eq!(u64_at(&b, body), 0x8bcd_e378_d23c_629b);
        assert_eq!(decode(&b, DISK).unwrap(), m);
        // And a flipped bit in it is caught.
        b[40] ^= 1;
        assert!(matches!(decode(&b, DISK), Err(MapError::Checksum)));
    }
}
