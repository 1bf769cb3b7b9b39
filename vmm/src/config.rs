//! What a VM is made of, checked before anything is created.

use std::path::PathBuf;

use devices::legacy::SerialOutput;
use serde::{Deserialize, Serialize};

use crate::layout;

/// A virtio-blk disk.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct DiskConfig {
    pub path: PathBuf,
    pub read_only: bool,
    /// Returned to the guest by GET_ID (at most 20 bytes).
    pub id: String,
    /// A writable disk's read-only base, the size of `path`: `path` is then
    /// a top over it that holds only the clusters written to the disk, and
    /// the rest read from the base (so a new disk costs nothing to make).
    /// Boot only: a snapshot's disk layers hold every cluster, so it records
    /// no base, and a restored disk never reads one.
    pub base: Option<PathBuf>,
}

/// The virtio-vsock device and the Unix socket its host side listens on.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct VsockConfig {
    pub guest_cid: u64,
    pub uds_path: PathBuf,
}

#[derive(Clone)]
pub struct VmConfig {
    /// An ELF64 kernel: an uncompressed Linux vmlinux or the test guest.
    pub kernel: PathBuf,
    /// Kernel command line; the VMM appends its virtio-mmio device entries.
    pub cmdline: String,
    pub vcpus: u8,
    pub mem_mib: u64,
    pub disks: Vec<DiskConfig>,
    pub vsock: Option<VsockConfig>,
    pub rng: bool,
    /// A virtio-net device on a TAP interface.
    pub net: Option<NetConfig>,
    pub serial: SerialOutput,
    /// Feed the VMM's standard input to the guest's serial console.
    pub console_input: bool,
    /// The VM's instance id; a random one when `None`.
    pub instance_id: Option<u64>,
    /// The vsock device's connection budget (host fds and buffers per VM);
    /// [`DEFAULT_VSOCK_CONNECTIONS`] unless set, at most
    /// `devices::virtio::vsock::MAX_CONNECTIONS`.
    pub vsock_max_connections: usize,
}

/// The default vsock connection budget of a VM.
pub const DEFAULT_VSOCK_CONNECTIONS: usize = devices::virtio::vsock::DEFAULT_MAX_CONNECTIONS;

/// The part of a [`VmConfig`] that describes the machine (not where its
/// console goes): what a snapshot records.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct VmSpec {
    pub kernel: PathBuf,
    pub cmdline: String,
    pub vcpus: u8,
    pub mem_mib: u64,
    pub disks: Vec<DiskConfig>,
    pub vsock: Option<VsockConfig>,
    pub rng: bool,
    pub net: Option<NetConfig>,
}

/// A virtio-net device: its wire is the TAP interface `tap` (created if
/// missing, which needs CAP_NET_ADMIN), its MAC `mac` (unicast).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct NetConfig {
    pub tap: String,
    pub mac: [u8; 6],
}

impl VmConfig {
    pub fn spec(&self) -> VmSpec {
        VmSpec {
            kernel: self.kernel.clone(),
            cmdline: self.cmdline.clone(),
            vcpus: self.vcpus,
            mem_mib: self.mem_mib,
            disks: self.disks.clone(),
            vsock: self.vsock.clone(),
            rng: self.rng,
            net: self.net.clone(),
        }
    }

    /// A config for `spec` with its console going to `serial`.
    pub fn from_spec(spec: VmSpec, serial: SerialOutput) -> Self {
        Self {
            kernel: spec.kernel,
            cmdline: spec.cmdline,
            vcpus: spec.vcpus,
            mem_mib: spec.mem_mib,
            disks: spec.disks,
            vsock: spec.vsock,
            rng: spec.rng,
            net: spec.net,
            serial,
            console_input: false,
            instance_id: None,
            vsock_max_connections: DEFAULT_VSOCK_CONNECTIONS,
        }
    }

    /// One vCPU, 256 MiB, no devices but the serial console (to stdout).
    pub fn new(kernel: impl Into<PathBuf>) -> Self {
        Self {
            kernel: kernel.into(),
            cmdline: String::new(),
            vcpus: 1,
            mem_mib: 256,
            disks: Vec::new(),
            vsock: None,
            rng: false,
            net: None,
            serial: SerialOutput::Stdout,
            console_input: false,
            instance_id: None,
            vsock_max_connections: DEFAULT_VSOCK_CONNECTIONS,
        }
    }

    pub fn virtio_devices(&self) -> usize {
        self.disks.len()
            + usize::from(self.vsock.is_some())
            + usize::from(self.rng)
            + usize::from(self.net.is_some())
    }

    /// Checks every value before any resource is created.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.vcpus == 0 || self.vcpus > layout::MAX_VCPUS {
            return Err(ConfigError::Vcpus(self.vcpus));
        }
        if !(layout::MIN_MEM_MIB..=layout::MAX_MEM_MIB).contains(&self.mem_mib) {
            return Err(ConfigError::Memory(self.mem_mib));
        }
        if !self.kernel.is_file() {
            return Err(ConfigError::KernelMissing(self.kernel.clone()));
        }
        for d in &self.disks {
            if !d.path.is_file() {
                return Err(ConfigError::DiskMissing(d.path.clone()));
            }
            if d.id.len() > 20 {
                return Err(ConfigError::DiskId(d.id.clone()));
            }
            match &d.base {
                Some(_) if d.read_only => return Err(ConfigError::ReadOnlyBase(d.path.clone())),
                Some(b) if !b.is_file() => return Err(ConfigError::DiskMissing(b.clone())),
                _ => {}
            }
        }
        if self.virtio_devices() > layout::VIRTIO_MMIO_MAX as usize {
            return Err(ConfigError::TooManyDevices(self.virtio_devices()));
        }
        if let Some(v) = &self.vsock {
            if v.guest_cid < 3 || v.guest_cid >= u64::from(u32::MAX) {
                return Err(ConfigError::VsockCid(v.guest_cid));
            }
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("vCPU count {0} is out of range: use 1 to {max}", max = layout::MAX_VCPUS)]
    Vcpus(u8),
    #[error("Memory size {0} MiB is out of range: use {min} to {max} MiB", min = layout::MIN_MEM_MIB, max = layout::MAX_MEM_MIB)]
    Memory(u64),
    #[error("Kernel {0} does not exist or is not a file")]
    KernelMissing(PathBuf),
    #[error("Disk image {0} does not exist or is not a file")]
    DiskMissing(PathBuf),
    #[error("Disk id {0:?} is longer than 20 bytes")]
    DiskId(String),
    #[error("Disk {0} is read-only and has a base: only a writable disk is a top over a base")]
    ReadOnlyBase(PathBuf),
    #[error("{0} virtio devices asked for, the limit is {max}", max = layout::VIRTIO_MMIO_MAX)]
    TooManyDevices(usize),
    #[error("vsock guest CID {0} is out of range: use 3 to 4294967294")]
    VsockCid(u64),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_values_are_refused_with_the_reason() {
        let exe = std::env::current_exe().unwrap();
        let ok = VmConfig::new(&exe);
        assert_eq!(ok.validate(), Ok(()));
        for (v, m) in [
            (0, 256),
            (9, 256),
            (1, 0),
            (1, 100_000),
            (1, 127),
            (1, 8193),
        ] {
            let mut c = ok.clone();
            c.vcpus = v;
            c.mem_mib = m;
            assert!(c.validate().is_err(), "{v} vCPUs, {m} MiB");
        }
        let mut c = ok.clone();
        c.kernel = "/nonexistent/vmlinux".into();
        assert_eq!(
            c.validate(),
            Err(ConfigError::KernelMissing("/nonexistent/vmlinux".into()))
        );
        let mut c = ok.clone();
        c.vsock = Some(VsockConfig {
            guest_cid: 2,
            uds_path: "/tmp/x".into(),
        });
        assert_eq!(c.validate(), Err(ConfigError::VsockCid(2)));
        assert!(ConfigError::Memory(0).to_string().contains("128 to 8192"));
    }
}
