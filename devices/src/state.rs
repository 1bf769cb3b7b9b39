//! Saved device state: the one convention every device follows ([`Persist`]), the
//! versions of every state ([`versions`]), and the error a restore fails with.
//!
//! Each device keeps a `Serialize`/`Deserialize` state struct beside it, with a
//! `version` field first. A state is produced between two event-loop dispatches (vCPUs
//! paused, event loop parked) and restored into a fresh device. Everything in a state
//! file is untrusted: restoring a state with a wrong version or values the device could
//! never have had fails with a [`StateError`], never a panic.

use serde::de::DeserializeOwned;
use serde::Serialize;

/// Every saved state's version, in one place. A device state's version is checked
/// when it is restored; [`VM`](versions::VM) is the version of the VMM's whole-VM
/// state blob, which embeds every device state below along with the KVM state and
/// the machine spec.
///
/// Change a state's shape (a field added, removed, retyped or reordered, an enum
/// variant added) and you bump its version here *and* `VM`, then re-bless the golden
/// snapshot state (`SPROUT_BLESS=1 cargo test -p sprout-tests --test state_blob`).
pub mod versions {
    /// [`SerialState`](crate::legacy::serial::SerialState).
    pub const SERIAL: u16 = 1;
    /// [`I8042State`](crate::legacy::i8042::I8042State).
    pub const I8042: u16 = 1;
    /// [`MmioTransportState`](crate::virtio::mmio::MmioTransportState).
    pub const MMIO_TRANSPORT: u16 = 1;
    /// [`BlockState`](crate::virtio::block::BlockState).
    pub const BLOCK: u16 = 1;
    /// [`VsockState`](crate::virtio::vsock::VsockState).
    pub const VSOCK: u16 = 1;
    /// [`RngState`](crate::virtio::rng::RngState).
    pub const RNG: u16 = 1;
    /// [`NetState`](crate::virtio::net::NetState).
    pub const NET: u16 = 1;
    /// The VMM's `VmState` blob (a snapshot's `state.bin`). 3: the images of
    /// read-only disks (the VMM still reads 2).
    pub const VM: u32 = 3;
}

/// How a device is saved and restored.
///
/// `save` runs between two event-loop dispatches (nothing half served). `restore`
/// builds a new device in the saved state from what the VMM chooses again at restore
/// time (`RestoreArgs`: an interrupt eventfd, where output goes, the disk, a socket
/// path), checking the state's version and every value first.
pub trait Persist: Sized {
    type State: Serialize + DeserializeOwned;
    /// What a restore needs besides the state.
    type RestoreArgs;

    fn save(&self) -> Self::State;

    fn restore(args: Self::RestoreArgs, state: &Self::State) -> Result<Self, StateError>;
}

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
    #[error("Cannot rebuild the {what} device")]
    Rebuild {
        what: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
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

    pub(crate) fn rebuild(
        what: &'static str,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self::Rebuild {
            what,
            source: Box::new(source),
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
