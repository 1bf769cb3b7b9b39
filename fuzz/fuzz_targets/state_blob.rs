//! The VM state blob (a snapshot's `state.bin`) decoder on arbitrary bytes: a
//! snapshot directory is not trusted, it may have been edited or come from elsewhere.
//!
//! Nothing may panic; the version is read first; whatever decodes re-encodes to the
//! same bytes (`VmState::decode` accepts only the exact encoding this build writes:
//! no trailing bytes, no overlong varints, KVM structures of their exact size), or
//! for a version 2 blob to those bytes as this version writes them (its version
//! byte, then an empty image list after them), and those decode again.

#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::{StateBlobError, VmState, STATE_VERSION};

fuzz_target!(|data: &[u8]| {
    let version = VmState::version_of(data);
    match VmState::decode(data) {
        Ok(st) => {
            let version = version.expect("version read");
            assert_eq!(st.version, STATE_VERSION);
            let again = st.encode().expect("a decoded state re-encodes");
            if version == STATE_VERSION {
                assert!(
                    again == data,
                    "the state does not re-encode to the same bytes"
                );
            } else {
                assert_eq!(version, 2);
                assert!(st.images.is_empty());
                let upgraded = [&[STATE_VERSION as u8], &data[1..], &[0]].concat();
                assert!(again == upgraded, "a version 2 state does not upgrade");
            }
            let back = VmState::decode(&again).expect("a re-encoded state decodes");
            assert!(back.encode().expect("re-encode") == again);
        }
        Err(StateBlobError::Version { found }) => {
            assert_eq!(version.expect("version read"), found);
            assert_ne!(found, STATE_VERSION);
        }
        Err(StateBlobError::Decode(_) | StateBlobError::ImageOfNoImage(_)) => {}
        Err(e @ StateBlobError::Encode(_)) => panic!("decode failed with {e:?}"),
    }
});
