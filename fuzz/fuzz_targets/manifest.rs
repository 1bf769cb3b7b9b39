//! The snapshot manifest (`manifest.json`) parser on arbitrary bytes: a snapshot
//! directory is not trusted.
//!
//! Byte 0 bit 0 set: the harness first writes the checksum the parser expects into
//! the input (where the parser looks for it), so that fuzzing reaches the version
//! and field checks behind the checksum; clear: the bytes as they are.
//!
//! Nothing may panic; a manifest that parses re-encodes (as the writer writes it) to
//! bytes that parse to the same manifest.

#![no_main]

use libfuzzer_sys::fuzz_target;
use snapshot::format::fuzzing::{decode_manifest, encode_manifest, seal_manifest};
use snapshot::format::FORMAT_VERSION;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut bytes = rest.to_vec();
    if mode & 1 != 0 && !seal_manifest(&mut bytes) {
        return;
    }
    let Ok(m) = decode_manifest(&bytes) else {
        return;
    };
    assert_eq!(m.format_version, FORMAT_VERSION);
    let again = encode_manifest(&m);
    let back = decode_manifest(&again).expect("a re-encoded manifest parses");
    // The writer recomputes the checksum; everything else is kept.
    let mut expect = m.clone();
    expect.manifest_checksum = back.manifest_checksum;
    assert_eq!(back, expect);
    assert_eq!(encode_manifest(&back), again);
});
