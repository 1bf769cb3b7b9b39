//! A disk layer's cluster map file (`disk-N.map` in a snapshot) on arbitrary
//! bytes: a snapshot directory is not trusted, it may have been edited,
//! imported from an object store or unpacked from an archive.
//!
//! The disk size is the one the input's header states when it is a plausible
//! small disk (so the decoder gets past its size check), else a fixed one.
//! Nothing may panic; a map that decodes has runs in order, non-empty, not
//! touching, inside the disk; it re-encodes to a map that decodes to the same
//! runs, and to the very same bytes when the writer picks the input's
//! version (a map has one encoding in each layout).

#![no_main]

use devices::virtio::block::{decode_layer_map, encode_layer_map, CLUSTER_SIZE};
use libfuzzer_sys::fuzz_target;

/// Disks up to 64 MiB: a bitmap of at most 2 KiB.
const MAX_DISK: u64 = 64 << 20;
const FALLBACK_DISK: u64 = 100 * CLUSTER_SIZE + 512;

fuzz_target!(|data: &[u8]| {
    let stated = data
        .get(16..24)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
    let disk = match stated {
        Some(s) if s > 0 && s % 512 == 0 && s <= MAX_DISK => s,
        _ => FALLBACK_DISK,
    };
    let Ok(runs) = decode_layer_map(data, disk) else {
        return;
    };
    let clusters = disk.div_ceil(CLUSTER_SIZE);
    let mut next = 0;
    for &(start, end) in &runs {
        assert!(start >= next && start < end && end <= clusters, "{runs:?}");
        next = end + 1;
    }
    let again = encode_layer_map(&runs, disk);
    assert_eq!(
        decode_layer_map(&again, disk).expect("re-encoded map"),
        runs
    );
    if again[8..12] == data[8..12] {
        assert!(again == data, "a map re-encodes to other bytes");
    }
});
