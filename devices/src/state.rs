//! Saved device state: what every `save_state`/`from_state` pair shares.
//!
//! Each device keeps a `Serialize`/`Deserialize` state struct beside it, with a
//! `version` field first. A state is produced between two event-loop dispatches (vCPUs
//! paused, event loop parked) and restored into a fresh device. Everything in a state
//! file is untrusted: restoring a state with a wrong version or values the device could
//! never have had fails with a [`StateError`], never a panic.

/// Why a saved state cannot be restored.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("{what} state has version {found}, this build reads version {expected}")]
    Version {
        what: &'static str,
        found: u16,
        expected: u16,
    },
    #[error("{what} state is invalid: {reason}")]
    Invalid { what: &'static str, reason: String },
    #[error("{what} state does not match the device: {reason}")]
    Mismatch { what: &'static str, reason: String },
    #[error("Restored {what} device cannot be activated")]
    Activate {
        what: &'static str,
        #[source]
        source: crate::virtio::ActivateError,
    },
}

impl StateError {
    pub(crate) fn invalid(what: &'static str, reason: impl Into<String>) -> Self {
        Self::Invalid {
            what,
            reason: reason.into(),
        }
    }

    pub(crate) fn mismatch(what: &'static str, reason: impl Into<String>) -> Self {
        Self::Mismatch {
            what,
            reason: reason.into(),
        }
    }
}

/// Fails unless a state of `what` has the version this build reads.
pub(crate) fn check_version(
    what: &'static str,
    found: u16,
    expected: u16,
) -> Result<(), StateError> {
    if found == expected {
        Ok(())
    } else {
        Err(StateError::Version {
            what,
            found,
            expected,
        })
    }
}

/// Test helper: a state through postcard and back, as the VMM stores it.
#[cfg(test)]
pub(crate) fn postcard_round_trip<T>(state: &T) -> T
where
    T: serde::Serialize + serde::de::DeserializeOwned,
{
    let bytes = postcard::to_allocvec(state).expect("state serializes");
    postcard::from_bytes(&bytes).expect("state deserializes")
}

/// Test helper: fresh guest memory with the same regions and contents, as a restore
/// (from a memory snapshot) gives the restored devices.
#[cfg(test)]
pub(crate) fn copy_guest_memory(
    mem: &crate::virtio::GuestMemoryMmap,
) -> crate::virtio::GuestMemoryMmap {
    use vm_memory::{Bytes, GuestMemoryBackend, GuestMemoryRegion};
    let ranges: Vec<_> = mem
        .iter()
        .map(|r| (r.start_addr(), r.len() as usize))
        .collect();
    let copy = crate::virtio::GuestMemoryMmap::from_ranges(&ranges).unwrap();
    for &(start, len) in &ranges {
        let mut buf = vec![0u8; len];
        mem.read_slice(&mut buf, start).unwrap();
        copy.write_slice(&buf, start).unwrap();
    }
    copy
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_check_names_both_versions() {
        assert!(check_version("virtio-rng", 1, 1).is_ok());
        let err = check_version("virtio-rng", 7, 1).unwrap_err();
        assert_eq!(
            err.to_string(),
            "virtio-rng state has version 7, this build reads version 1"
        );
    }
}
