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
use devices::virtio::block::{BlockState, ImageIdentity};
use devices::virtio::mmio::MmioTransportState;
use devices::virtio::net::NetState;
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
    #[error(
        "The VM state is version {found}; this Sprout reads versions {OLDEST_STATE_VERSION} to \
         {STATE_VERSION}"
    )]
    Version { found: u32 },
    #[error("The VM state records the image of disk {0}, which is not a read-only disk of its VM")]
    ImageOfNoImage(usize),
}

/// The oldest blob version this build reads: version 2 is version 3 without
/// [`VmState::images`] (read back as none).
pub const OLDEST_STATE_VERSION: u32 = 2;

/// Which version of a read-only disk's image the guest saw
/// ([`ImageIdentity`]): a restore refuses an image that is not it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskImage {
    /// Indexes `spec.disks`.
    pub disk: usize,
    pub identity: ImageIdentity,
}

/// A read-only disk's image as a snapshot records it
/// ([`VmState::recorded_images`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordedImage {
    /// Indexes the snapshot's disks ([`crate::RestoreOptions::image_paths`]).
    pub disk: usize,
    /// The path its VM read it at.
    pub path: std::path::PathBuf,
    /// Which image it was; none in a version 2 blob.
    pub identity: Option<ImageIdentity>,
}

/// Everything a snapshot saves of a VM besides its memory and disks.
#[derive(Serialize, Deserialize)]
pub struct VmState {
    /// [`STATE_VERSION`] when written: first, so it can be read alone.
    pub version: u32,
    /// Recorded without any disk's base ([`blob_spec`]).
    #[serde(with = "blob_spec")]
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
    /// Every read-only disk's image as the guest saw it (since version 3;
    /// none from an older blob, whose restores check no image). Last, so a
    /// version 2 blob is this encoding without it.
    pub images: Vec<DiskImage>,
}

/// How the blob records a [`VmSpec`]: as it is, but for each disk's base,
/// which is left out (a snapshot's disk layers hold every cluster, so a
/// restore never reads a base) and reads back as none. The blob keeps the
/// shape it had before disks had bases.
mod blob_spec {
    use std::path::PathBuf;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::config::{DiskConfig, NetConfig, VmSpec, VsockConfig};

    #[derive(Serialize, Deserialize)]
    struct Spec {
        kernel: PathBuf,
        cmdline: String,
        vcpus: u8,
        mem_mib: u64,
        disks: Vec<Disk>,
        vsock: Option<VsockConfig>,
        rng: bool,
        net: Option<NetConfig>,
    }

    #[derive(Serialize, Deserialize)]
    struct Disk {
        path: PathBuf,
        read_only: bool,
        id: String,
    }

    pub fn serialize<S: Serializer>(s: &VmSpec, ser: S) -> Result<S::Ok, S::Error> {
        Spec {
            kernel: s.kernel.clone(),
            cmdline: s.cmdline.clone(),
            vcpus: s.vcpus,
            mem_mib: s.mem_mib,
            disks: s
                .disks
                .iter()
                .map(|d| Disk {
                    path: d.path.clone(),
                    read_only: d.read_only,
                    id: d.id.clone(),
                })
                .collect(),
            vsock: s.vsock.clone(),
            rng: s.rng,
            net: s.net.clone(),
        }
        .serialize(ser)
    }

    /// A spec encoded as the blob records it.
    #[cfg(test)]
    pub struct AsBlob<'a>(pub &'a VmSpec);

    #[cfg(test)]
    impl Serialize for AsBlob<'_> {
        fn serialize<S: Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
            serialize(self.0, ser)
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(de: D) -> Result<VmSpec, D::Error> {
        let s = Spec::deserialize(de)?;
        Ok(VmSpec {
            kernel: s.kernel,
            cmdline: s.cmdline,
            vcpus: s.vcpus,
            mem_mib: s.mem_mib,
            disks: s
                .disks
                .into_iter()
                .map(|d| DiskConfig {
                    path: d.path,
                    read_only: d.read_only,
                    id: d.id,
                    base: None,
                })
                .collect(),
            vsock: s.vsock,
            rng: s.rng,
            net: s.net,
        })
    }
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
    Net(NetState),
}

impl DevState {
    /// The device's kind, as the VMM names it.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Block { .. } => "virtio-blk",
            Self::Vsock(_) => "virtio-vsock",
            Self::Rng(_) => "virtio-rng",
            Self::Net(_) => "virtio-net",
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

    /// Decodes a blob of this build's version, exactly as this build writes it,
    /// or of version 2 (read as this version with no [`VmState::images`]).
    ///
    /// Anything else is refused as corrupt: trailing bytes, overlong varints and,
    /// above all, KVM structures of the wrong length, which kvm-bindings' serde
    /// would otherwise zero-fill (when short) or truncate (when long) and hand to
    /// KVM as if they were state. Checked by re-encoding: a real blob re-encodes
    /// byte for byte (see the golden test). So is every recorded image's disk:
    /// a read-only disk of the spec, recorded once.
    pub fn decode(bytes: &[u8]) -> Result<VmState, StateBlobError> {
        let found = Self::version_of(bytes)?;
        let st = match found {
            STATE_VERSION => Self::decode_exact(bytes)?,
            // Both versions are one-byte varints (an overlong one is refused
            // by the re-encoding), and an empty `images` is one zero byte.
            OLDEST_STATE_VERSION if bytes.first() == Some(&(OLDEST_STATE_VERSION as u8)) => {
                let mut b = Vec::with_capacity(bytes.len() + 1);
                b.push(STATE_VERSION as u8);
                b.extend_from_slice(&bytes[1..]);
                b.push(0);
                Self::decode_exact(&b)?
            }
            _ => return Err(StateBlobError::Version { found }),
        };
        for (i, img) in st.images.iter().enumerate() {
            let read_only = st.spec.disks.get(img.disk).is_some_and(|d| d.read_only);
            if !read_only || st.images[..i].iter().any(|o| o.disk == img.disk) {
                return Err(StateBlobError::ImageOfNoImage(img.disk));
            }
        }
        Ok(st)
    }

    fn decode_exact(bytes: &[u8]) -> Result<VmState, StateBlobError> {
        let st: VmState = postcard::from_bytes(bytes).map_err(StateBlobError::Decode)?;
        if st.encode()? != bytes {
            return Err(StateBlobError::Decode(
                postcard::Error::DeserializeBadEncoding,
            ));
        }
        Ok(st)
    }

    /// The read-only disks' images the snapshot or fork layer in `dir`
    /// restores over, from its state blob alone (not verified here: a
    /// restore verifies it, and checks each image it opens against it).
    pub fn recorded_images(dir: &std::path::Path) -> std::io::Result<Vec<RecordedImage>> {
        use std::io::Read;
        let mut bytes = Vec::new();
        std::fs::File::open(dir.join(snapshot::format::STATE_FILE))?
            .take(snapshot::format::MAX_STATE_BYTES)
            .read_to_end(&mut bytes)?;
        let st = Self::decode(&bytes)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        Ok(st
            .spec
            .disks
            .iter()
            .enumerate()
            .filter(|(_, d)| d.read_only)
            .map(|(disk, d)| RecordedImage {
                disk,
                path: d.path.clone(),
                identity: st.image_of(disk),
            })
            .collect())
    }

    /// The image disk `disk` was restored over must be, when one was recorded.
    pub fn image_of(&self, disk: usize) -> Option<ImageIdentity> {
        self.images
            .iter()
            .find(|i| i.disk == disk)
            .map(|i| i.identity)
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

    #[test]
    fn a_disk_base_is_not_recorded_and_reads_back_as_none() {
        let mut spec = crate::VmConfig::new("/vmlinux").spec();
        let disk = |base: Option<&str>| crate::config::DiskConfig {
            path: "/disk.ext4".into(),
            read_only: false,
            id: "disk".into(),
            base: base.map(Into::into),
        };
        spec.disks = vec![disk(Some("/template.ext4"))];
        let with = postcard::to_allocvec(&blob_spec::AsBlob(&spec)).unwrap();
        let mut plain = spec.clone();
        plain.disks = vec![disk(None)];
        assert_eq!(
            with,
            postcard::to_allocvec(&blob_spec::AsBlob(&plain)).unwrap()
        );
        let mut de = postcard::Deserializer::from_bytes(&with);
        assert_eq!(blob_spec::deserialize(&mut de).unwrap(), plain);
    }

    /// Found by the `state_blob` fuzz target: a KVM structure of the wrong
    /// length (kvm-bindings' serde zero-fills a short one and truncates a long
    /// one) and trailing bytes decoded as if the blob were whole.
    #[test]
    fn only_the_exact_encoding_decodes() {
        let golden: &[u8] = include_bytes!("../../tests/golden/state.bin");
        let st = VmState::decode(golden).unwrap();
        let cpu = &st.vcpus[0];
        // Everything before vCPU 0's registers, then the registers (a length
        // varint and the raw struct).
        let head = postcard::to_allocvec(&(
            st.version,
            blob_spec::AsBlob(&st.spec),
            &st.entry,
            &st.arch,
            1u8,
        ))
        .unwrap();
        let head = [
            head,
            postcard::to_allocvec(&(&cpu.cpuid, &cpu.msrs)).unwrap(),
        ]
        .concat();
        let regs = postcard::to_allocvec(&cpu.regs).unwrap();
        assert!(golden.starts_with(&head));
        assert!(golden[head.len()..].starts_with(&regs));
        let raw = &regs[regs.len() - std::mem::size_of_val(&cpu.regs)..];
        let tail = &golden[head.len() + regs.len()..];
        let with_regs = |r: &[u8]| [&head, &postcard::to_allocvec(r).unwrap(), tail].concat();
        assert!(VmState::decode(&with_regs(raw)).is_ok());
        let short = with_regs(&raw[..raw.len() - 8]);
        assert!(matches!(
            VmState::decode(&short).err().unwrap(),
            StateBlobError::Decode(_)
        ));
        let long = with_regs(&[raw, &[0u8; 8]].concat());
        assert!(matches!(
            VmState::decode(&long).err().unwrap(),
            StateBlobError::Decode(_)
        ));
        let trailing = [golden, &[0]].concat();
        assert!(matches!(
            VmState::decode(&trailing).err().unwrap(),
            StateBlobError::Decode(_)
        ));
    }
}
