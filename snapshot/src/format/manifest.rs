//! `manifest.json`: what a snapshot holds, and the checksum of every file.
//!
//! The manifest is pretty-printed JSON whose last field is
//! `manifestChecksum`: the digest of the file's exact bytes with those 32 hex
//! digits replaced by `0`s. Any byte flipped anywhere in the file is caught.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::digest::{digest_bytes, parse_hex128, Checksum};
use super::SnapshotError;

/// The on-disk format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// A snapshot's identity: 128 random bits, written as 32 hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct SnapshotId(pub u128);

impl SnapshotId {
    /// A fresh random id (`getrandom`).
    pub fn random() -> SnapshotId {
        SnapshotId(random_u128())
    }
}

pub(crate) fn random_u128() -> u128 {
    let mut b = [0u8; 16];
    // getrandom(2) on the urandom pool does not fail for 16 bytes once the
    // pool is initialised; fall back to time and pid if it ever does.
    if rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()) != Ok(16) {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        return t ^ (u128::from(std::process::id()) << 64);
    }
    u128::from_le_bytes(b)
}

impl fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl Serialize for SnapshotId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for SnapshotId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_hex128(&s)
            .map(SnapshotId)
            .ok_or_else(|| serde::de::Error::custom("expected 32 lowercase hex digits"))
    }
}

/// The VM shape a snapshot was taken of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Shape {
    pub vcpus: u8,
    /// Size of the RAM offset space; a multiple of [`crate::PAGE_SIZE`].
    pub mem_bytes: u64,
}

/// Which kernel the snapshot's guest booted: a restore refuses another one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KernelIdentity {
    /// Where the kernel was when the snapshot was taken (informational).
    pub path: PathBuf,
    pub size: u64,
    /// [`Checksum`] of the kernel file's contents.
    pub checksum: Checksum,
}

/// The snapshot a diff snapshot builds on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ParentRef {
    pub id: SnapshotId,
    /// The parent's directory; a relative path is relative to this snapshot's
    /// own directory.
    pub path: PathBuf,
}

/// One file of the snapshot directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FileEntry {
    /// Plain file name inside the snapshot directory.
    pub name: String,
    pub size: u64,
    pub checksum: Checksum,
}

/// Whether a memory layer holds every page or only changed ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum MemoryLayerKind {
    /// Every page of RAM: non-zero pages as data, zero pages as holes.
    Full,
    /// Only the pages in its page map's present bitmap.
    Diff,
}

/// A memory layer: a sparse data file `memBytes` long with pages at their
/// natural offsets, and a page map (present and data bitmaps).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MemoryLayerEntry {
    pub kind: MemoryLayerKind,
    /// Pages this layer decides (all of them for a full layer).
    pub pages_present: u64,
    /// Present pages with non-zero contents (the rest of the present pages
    /// are zero).
    pub data_pages: u64,
    pub data: FileEntry,
    pub page_map: FileEntry,
}

/// A disk layer: files the devices crate wrote, opaque here.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DiskLayerEntry {
    pub name: String,
    pub files: Vec<FileEntry>,
}

/// The parsed `manifest.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Manifest {
    pub format_version: u32,
    pub id: SnapshotId,
    pub created_unix_ms: u64,
    pub shape: Shape,
    pub kernel: KernelIdentity,
    pub parent: Option<ParentRef>,
    /// The VMM's state blob (`state.bin`).
    pub state: FileEntry,
    /// Base-first.
    pub memory_layers: Vec<MemoryLayerEntry>,
    pub disk_layers: Vec<DiskLayerEntry>,
    /// Other files the VMM or devices added.
    pub files: Vec<FileEntry>,
    pub manifest_checksum: Checksum,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct VersionProbe {
    format_version: Option<u64>,
}

/// Where the checksum's 32 hex digits sit: the file ends with
/// `"<32 hex digits>"\n}\n`.
const TAIL: &[u8] = b"\"\n}\n";
const HEX: usize = 32;

/// The exact bytes of `manifest.json` for `m` (its `manifest_checksum` is
/// ignored and filled in), and that checksum.
pub(crate) fn encode(m: &Manifest) -> (Vec<u8>, Checksum) {
    let mut m = m.clone();
    m.manifest_checksum = Checksum(0);
    let mut bytes = serde_json::to_vec_pretty(&m).expect("a manifest always serializes");
    bytes.push(b'\n');
    let sum = digest_bytes(&bytes);
    let at = bytes.len() - TAIL.len() - HEX;
    bytes[at..at + HEX].copy_from_slice(sum.to_string().as_bytes());
    (bytes, sum)
}

/// Writes into `bytes` (a `manifest.json` with its checksum in place) the
/// checksum [`decode`] expects; false if `bytes` has no place for one. Lets a
/// fuzzer reach the field parsing behind the checksum.
pub(crate) fn seal(bytes: &mut [u8]) -> bool {
    if bytes.len() < TAIL.len() + HEX + 1 || !bytes.ends_with(TAIL) {
        return false;
    }
    let at = bytes.len() - TAIL.len() - HEX;
    bytes[at..at + HEX].fill(b'0');
    let sum = digest_bytes(bytes);
    bytes[at..at + HEX].copy_from_slice(sum.to_string().as_bytes());
    true
}

/// Parses and checks `manifest.json`: the checksum, then the fields, in one
/// parse. A manifest that fails either is probed for its format version
/// first, so a snapshot from another version says so (the errors are those
/// of checking the version first; only a good manifest skips the probe, a
/// second parse whose code a new restoring process would otherwise also run
/// for the first time: part of the ~9 ms this step took cold in the lab).
pub(crate) fn decode(bytes: &[u8], path: &Path) -> Result<Manifest, SnapshotError> {
    let malformed = |source| SnapshotError::Malformed {
        path: path.to_path_buf(),
        source,
    };
    let checksum_mismatch = || SnapshotError::ChecksumMismatch {
        path: path.to_path_buf(),
    };
    let Some(stored) = sealed_checksum(bytes) else {
        check_version(bytes, path)?;
        return Err(checksum_mismatch());
    };
    let m: Manifest = match serde_json::from_slice(bytes) {
        Ok(m) => m,
        Err(e) => {
            check_version(bytes, path)?;
            return Err(malformed(e));
        }
    };
    if m.format_version != FORMAT_VERSION {
        return Err(version_error(u64::from(m.format_version), path));
    }
    if m.manifest_checksum != stored {
        return Err(checksum_mismatch());
    }
    Ok(m)
}

/// The checksum `bytes` ends with, if it is that of `bytes` with it zeroed.
fn sealed_checksum(bytes: &[u8]) -> Option<Checksum> {
    if bytes.len() < TAIL.len() + HEX + 1 || !bytes.ends_with(TAIL) {
        return None;
    }
    let at = bytes.len() - TAIL.len() - HEX;
    let stored = std::str::from_utf8(&bytes[at..at + HEX])
        .ok()
        .and_then(Checksum::from_hex)?;
    let mut zeroed = bytes.to_vec();
    zeroed[at..at + HEX].fill(b'0');
    (digest_bytes(&zeroed) == stored).then_some(stored)
}

/// Whether `bytes` is JSON naming this build's format version.
fn check_version(bytes: &[u8], path: &Path) -> Result<(), SnapshotError> {
    let probe: VersionProbe =
        serde_json::from_slice(bytes).map_err(|source| SnapshotError::Malformed {
            path: path.to_path_buf(),
            source,
        })?;
    match probe.format_version {
        None => Err(SnapshotError::Invalid {
            path: path.to_path_buf(),
            reason: "no formatVersion".into(),
        }),
        Some(found) if found != u64::from(FORMAT_VERSION) => Err(version_error(found, path)),
        Some(_) => Ok(()),
    }
}

fn version_error(found: u64, path: &Path) -> SnapshotError {
    SnapshotError::Version {
        path: path.to_path_buf(),
        found,
        supported: FORMAT_VERSION,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> Manifest {
        let file = |name: &str| FileEntry {
            name: name.into(),
            size: 4096,
            checksum: Checksum(7),
        };
        Manifest {
            format_version: FORMAT_VERSION,
            id: SnapshotId::random(),
            created_unix_ms: 1,
            shape: Shape {
                vcpus: 1,
                mem_bytes: 1 << 20,
            },
            kernel: KernelIdentity {
                path: "/boot/vmlinux".into(),
                size: 10,
                checksum: Checksum(3),
            },
            parent: None,
            state: file("state.bin"),
            memory_layers: vec![MemoryLayerEntry {
                kind: MemoryLayerKind::Full,
                pages_present: 256,
                data_pages: 1,
                data: file("mem"),
                page_map: file("mem.map"),
            }],
            disk_layers: vec![],
            files: vec![],
            manifest_checksum: Checksum(0),
        }
    }

    #[test]
    fn round_trip_and_every_byte_is_covered() {
        let m = sample();
        let (bytes, _) = encode(&m);
        let back = decode(&bytes, Path::new("manifest.json")).unwrap();
        assert_eq!(back.id, m.id);
        assert_ne!(back.manifest_checksum, Checksum(0));
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x01;
            assert!(
                decode(&bad, Path::new("manifest.json")).is_err(),
                "flip at byte {i} ({:?}) not caught",
                bytes[i] as char
            );
        }
    }

    #[test]
    fn seal_writes_the_checksum_decode_expects() {
        let (bytes, _) = encode(&sample());
        let mut resealed = bytes.clone();
        assert!(seal(&mut resealed));
        assert_eq!(resealed, bytes);
        assert!(!seal(&mut b"{}".to_vec()));
    }

    #[test]
    fn other_version_is_named() {
        let mut m = sample();
        m.format_version = 2;
        let err = decode(&encode(&m).0, Path::new("x/manifest.json")).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("version 2") && msg.contains('1'),
            "message: {msg}"
        );
    }

    /// Only a good manifest skips the version probe: whatever else is wrong
    /// with another version's manifest, the error names the version.
    #[test]
    fn other_version_is_named_before_other_faults() {
        let path = Path::new("manifest.json");
        let mut m = sample();
        m.format_version = 2;
        let (good, _) = encode(&m);
        let text = String::from_utf8(good.clone()).unwrap();
        // Its checksum broken; a field this version does not know (sealed).
        let mut unsealed = good.clone();
        let at = unsealed.len() - TAIL.len() - 1;
        unsealed[at] = if unsealed[at] == b'0' { b'1' } else { b'0' };
        let mut unknown = text.replacen("{", "{\n  \"newField\": 1,", 1).into_bytes();
        assert!(seal(&mut unknown));
        for bytes in [good, unsealed, unknown] {
            let err = decode(&bytes, path).unwrap_err();
            assert!(
                matches!(err, SnapshotError::Version { found: 2, .. }),
                "{err}"
            );
        }
        // No version at all; not JSON; this version with a bad checksum or an
        // unknown field.
        let no_version = text.replacen("\"formatVersion\": 2,", "", 1);
        let mut no_version = no_version.into_bytes();
        assert!(seal(&mut no_version));
        assert!(matches!(
            decode(&no_version, path),
            Err(SnapshotError::Invalid { .. })
        ));
        assert!(matches!(
            decode(b"not json\"\n}\n", path),
            Err(SnapshotError::Malformed { .. })
        ));
        let (good, _) = encode(&sample());
        let mut unsealed = good.clone();
        let at = unsealed.len() - TAIL.len() - 1;
        unsealed[at] = if unsealed[at] == b'0' { b'1' } else { b'0' };
        assert!(matches!(
            decode(&unsealed, path),
            Err(SnapshotError::ChecksumMismatch { .. })
        ));
        let mut unknown = String::from_utf8(good)
            .unwrap()
            .replacen("{", "{\n  \"newField\": 1,", 1)
            .into_bytes();
        assert!(seal(&mut unknown));
        assert!(matches!(
            decode(&unknown, path),
            Err(SnapshotError::Malformed { .. })
        ));
    }
}
