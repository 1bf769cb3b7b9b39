//! The VM state blob (a snapshot's `state.bin`) decoder on arbitrary bytes: a
//! snapshot directory is not trusted, it may have been edited or come from elsewhere.
//!
//! Nothing may panic; the version is read first; whatever decodes re-encodes to the
//! same bytes (`VmState::decode` accepts only the exact encoding this build writes:
//! no trailing bytes, no overlong varints, KVM structures of their exact size), and
//! those decode again.

#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::{StateBlobError, VmState, STATE_VERSION};

fuzz_target!(|data: &[u8]| {
    let version = VmState::version_of(data);
    match VmState::decode(data) {
        Ok(st) => {
            assert_eq!(version.expect("version read"), STATE_VERSION);
            assert_eq!(st.version, STATE_VERSION);
            let again = st.encode().expect("a decoded state re-encodes");
            assert!(
                again == data,
                "the state does not re-encode to the same bytes"
            );
            let back = VmState::decode(&again).expect("a re-encoded state decodes");
            assert!(back.encode().expect("re-encode") == again);
        }
        Err(StateBlobError::Version { found }) => {
            assert_eq!(version.expect("version read"), found);
            assert_ne!(found, STATE_VERSION);
        }
        Err(StateBlobError::Decode(_)) => {}
        Err(e @ StateBlobError::Encode(_)) => panic!("decode failed with {e:?}"),
    }
});
