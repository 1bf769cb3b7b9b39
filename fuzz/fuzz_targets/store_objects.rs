//! What the snapshot store's object store gives back, on arbitrary bytes:
//! the store is not trusted (another node, or whoever can write the
//! bucket, wrote it).
//!
//! Byte 0 bit 0 clear: a packed file's header (the next 8 bytes the file's
//! length the entry claims, the rest the object's first bytes); set: an
//! archive record (`archive.json`) as an unarchive imports it.
//!
//! Nothing may panic; a header that parses lists extents in order, within
//! the file, and ends within the bytes; a record that holds together
//! imports as a chain that ends in its rest snapshot, every snapshot the
//! sandbox's tenant's or sproutd's own, under the snapshots directory.

#![no_main]

use libfuzzer_sys::fuzz_target;
use service::daemon::store_fuzzing::{archive_rows, pack_header};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode & 1 == 0 {
        if rest.len() < 8 {
            return;
        }
        let size = u64::from_le_bytes(rest[..8].try_into().unwrap());
        let b = &rest[8..];
        if let Ok(Some((ext, end))) = pack_header(b, size) {
            assert!(end <= b.len());
            assert_eq!(end, 24 + 16 * ext.len());
            let mut at = 0;
            for (o, l) in ext {
                assert!(o >= at && l > 0 && o + l <= size);
                at = o + l;
            }
        }
    } else if let Some(n) = archive_rows(rest) {
        assert!(n >= 1);
    }
});
