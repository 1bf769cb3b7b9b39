//! The VM state blob: a snapshot's `state.bin`, in postcard.
//!
//! It holds the machine spec, KVM's VM and vCPU state and every device's state.
//! Its version ([`STATE_VERSION`], kept with every device state's version in
//! [`devices::state::versions`]) comes first and is read on its own, so a blob
//! from another version is reported as such rather than as corrupt. The golden
//! test (`tests/tests/state_blob.rs`) fails when a type in here changes shape
//! without a version bump.

use devices::legacy::i8042::I8042State;
use devices::legacy::serial::SerialState;
use devices::state::versions;
use devices::virtio::block::BlockState;
use devices::virtio::mmio::MmioTransportState;
use devices::virtio::rng::RngState;
use devices::virtio::vsock::VsockState;
use serde::{Deserialize, Serialize};

use crate::arch::kernel::EntryKind;
use crate::arch::state::{VcpuState, VmArchState};
use crate::config::VmSpec;

/// Version of the [`VmState`] blob; bump it on any change to a state type.
pub const STATE_VERSION: u32 = versions::VM;

#[derive(Debug, thiserror::Error)]
pub enum StateBlobError {
    #[error("Cannot encode the VM state")]
    Encode(#[source] postcard::Error),
    #[error("The VM state is unreadable (corrupt or from another Sprout)")]
    Decode(#[source] postcard::Error),
    #[error("The VM state is version {found}; this Sprout reads version {STATE_VERSION}")]
    Version { found: u32 },
}

/// Everything a snapshot saves of a VM besides its memory and disks.
#[derive(Serialize, Deserialize)]
pub struct VmState {
    /// [`STATE_VERSION`] when written: first, so it can be read alone.
    pub version: u32,
    pub spec: VmSpec,
    pub entry: EntryKind,
    pub arch: VmArchState,
    pub vcpus: Vec<VcpuState>,
    pub serial: SerialState,
    pub i8042: I8042State,
    /// In virtio-mmio slot order.
    pub virtio: Vec<VirtioSlot>,
    /// The test guest's mailbox: which vCPUs had said they were ready.
    pub mailbox_ready: u8,
}

/// One virtio-mmio slot: its transport and the device behind it.
#[derive(Serialize, Deserialize)]
pub struct VirtioSlot {
    pub transport: MmioTransportState,
    pub dev: DevState,
}

#[derive(Serialize, Deserialize)]
pub enum DevState {
    /// `disk` indexes `spec.disks`.
    Block {
        disk: usize,
        state: BlockState,
    },
    Vsock(VsockState),
    Rng(RngState),
}

impl DevState {
    /// The device's kind, as the VMM names it.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Block { .. } => "virtio-blk",
            Self::Vsock(_) => "virtio-vsock",
            Self::Rng(_) => "virtio-rng",
        }
    }
}

/// The name of disk `disk`'s layer in a snapshot (its files are
/// `<name>.data` and `<name>.map`).
pub(crate) fn disk_layer_name(disk: usize) -> String {
    format!("disk{disk}")
}

impl VmState {
    /// The blob's version, read without decoding the rest.
    pub fn version_of(bytes: &[u8]) -> Result<u32, StateBlobError> {
        postcard::take_from_bytes::<u32>(bytes)
            .map(|(v, _)| v)
            .map_err(StateBlobError::Decode)
    }

    /// Decodes a blob of this build's version.
    pub fn decode(bytes: &[u8]) -> Result<VmState, StateBlobError> {
        let found = Self::version_of(bytes)?;
        if found != STATE_VERSION {
            return Err(StateBlobError::Version { found });
        }
        postcard::from_bytes(bytes).map_err(StateBlobError::Decode)
    }

    pub fn encode(&self) -> Result<Vec<u8>, StateBlobError> {
        postcard::to_allocvec(self).map_err(StateBlobError::Encode)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_is_read_first_and_checked() {
        let mut blob = postcard::to_allocvec(&(STATE_VERSION + 1)).unwrap();
        blob.extend_from_slice(&[0xff; 8]);
        assert_eq!(VmState::version_of(&blob).unwrap(), STATE_VERSION + 1);
        let e = VmState::decode(&blob).err().unwrap();
        assert!(matches!(e, StateBlobError::Version { found } if found == STATE_VERSION + 1));
        assert!(matches!(
            VmState::decode(&[]).err().unwrap(),
            StateBlobError::Decode(_)
        ));
        let mut blob = postcard::to_allocvec(&STATE_VERSION).unwrap();
        blob.push(0xff);
        assert!(matches!(
            VmState::decode(&blob).err().unwrap(),
            StateBlobError::Decode(_)
        ));
    }
}
