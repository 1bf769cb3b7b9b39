//! Restoring a VM from a snapshot (and its parents): the machine spec, KVM
//! state and device states from its state blob, memory mapped from its layers
//! (copy-on-write, or served by a userfaultfd page server), private tops over
//! its disk layers. The VM itself is built by [`crate::builder`], as a boot's.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use devices::bus::lock;
use devices::legacy::{Serial, SerialRestoreArgs, I8042};
use devices::state::Persist;
use devices::virtio::block::{
    Block, BlockDisk, BlockRestoreArgs, FileDisk, LayerFiles, LayeredDisk,
};
use devices::virtio::mmio::{MmioRestoreArgs, MmioTransport};
use devices::virtio::net::{Net, NetRestoreArgs, Tap};
use devices::virtio::rng::Rng;
use devices::virtio::vsock::Vsock;
use snapshot::format::Snapshot;
use snapshot::layers::LayerStack;
use snapshot::uffd::{UffdOptions, UffdRestore, WorkingSet};
use vmm_sys_util::eventfd::EventFd;

use crate::arch::kernel::EntryKind;
use crate::arch::state;
use crate::builder::{DeviceSource, Parts, VirtioSlot, VmBase};
use crate::config::{VmConfig, VmSpec};
use crate::lease::LeaseError;
use crate::lease::{lease_chain, LayerLease};
use crate::lineage::{new_instance_id, Lineage};
use crate::memory::{self, Backing};
use crate::options::{MemoryBackend, RestoreOptions};
use crate::shell::VmShell;
use crate::vm::{Vm, VmError};
use crate::vm_devices::{AttachError, VirtioDev};
use crate::vm_state::{disk_layer_name, DevState, StateBlobError, VmState};

/// Why a VM was not restored.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("Cannot load the snapshot")]
    Load(#[from] snapshot::format::SnapshotError),
    #[error("Cannot open the snapshot's layers")]
    Layers(#[from] snapshot::layers::LayerError),
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error("The snapshot chain is empty")]
    EmptyChain,
    #[error("The snapshot's VM state is unusable")]
    State(#[from] StateBlobError),
    #[error(
        "The snapshot's manifest is for {manifest_vcpus} vCPUs and {manifest_mem_bytes} bytes, \
         its VM state for {state_vcpus} vCPUs and {state_mem_mib} MiB with {vcpu_states} vCPU states"
    )]
    ShapeMismatch {
        manifest_vcpus: u8,
        manifest_mem_bytes: u64,
        state_vcpus: u8,
        state_mem_mib: u64,
        vcpu_states: usize,
    },
    #[error(
        "The shell is for {shell_vcpus} vCPUs and {shell_mem_bytes} bytes, \
         the snapshot for {snapshot_vcpus} vCPUs and {snapshot_mem_bytes} bytes"
    )]
    ShellMismatch {
        shell_vcpus: u8,
        shell_mem_bytes: u64,
        snapshot_vcpus: u8,
        snapshot_mem_bytes: u64,
    },
    #[error("The snapshot has a PIT and this host's KVM has none")]
    NoPit,
    #[error("Block device {device} names disk {disk}; the snapshot has {disks} disks")]
    NoSuchDisk {
        device: usize,
        disk: usize,
        disks: usize,
    },
    #[error(
        "Disk {disk}'s image {} is not the one the snapshot was taken over (then: {recorded}; \
         now: {found}): it was rebuilt or changed since, and the guest's memory holds the \
         old one's file system state. Restore it over the image it was taken over",
        path.display()
    )]
    ImageChanged {
        disk: usize,
        path: std::path::PathBuf,
        recorded: devices::virtio::block::ImageIdentity,
        found: devices::virtio::block::ImageIdentity,
    },
    #[error("Disk {disk} of the snapshot is no read-only image: its path cannot be given")]
    NotAnImage { disk: usize },
    #[error("Cannot open disk {disk}'s image")]
    Image {
        disk: usize,
        #[source]
        source: devices::virtio::block::BlockError,
    },
    #[error("The snapshot has a vsock device: give the restored VM a vsock socket path")]
    NeedVsockPath,
    #[error("The snapshot has a network device: give the restored VM a TAP and a MAC")]
    NeedNet,
    #[error("Cannot build the VM")]
    Vm(#[from] VmError),
    #[error("Cannot restore the VM's KVM state")]
    Arch(#[from] state::StateError),
    #[error("Cannot restore a device")]
    Device(#[from] devices::state::StateError),
    #[error("Cannot attach a restored device")]
    Attach(#[from] AttachError),
    #[error("Cannot create disk {disk}'s private top")]
    DiskLayer {
        disk: usize,
        #[source]
        source: devices::virtio::block::LayeredError,
    },
    #[error("Disk {disk}'s layer in {dir} lists {files} files, not a data file and a map")]
    DiskLayerFiles {
        disk: usize,
        dir: std::path::PathBuf,
        files: usize,
    },
    #[error("Cannot map restored memory")]
    Mmap(#[from] snapshot::mmap::MmapError),
    #[error("Cannot start the userfaultfd page server")]
    Uffd(#[from] snapshot::uffd::UffdError),
    #[error("Cannot load the working set")]
    WorkingSet(#[from] snapshot::uffd::WorkingSetError),
    #[error("Cannot use restored memory")]
    Memory(#[from] memory::MemoryError),
    #[error("Cannot resynchronise the mailbox")]
    Mailbox(#[from] crate::mailbox::MailboxError),
    #[error("Cannot run the restored VM")]
    Resume(#[source] VmError),
}

impl RestoreError {
    /// A stable snake_case name of the failure, for protocols.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Load(_)
            | Self::Layers(_)
            | Self::EmptyChain
            | Self::State(_)
            | Self::NoSuchDisk { .. }
            | Self::Image { .. }
            | Self::Device(_)
            | Self::Attach(AttachError::Restore(..))
            | Self::WorkingSet(_) => "bad_snapshot",
            Self::Lease(LeaseError::Gone(_)) => "layer_gone",
            Self::ImageChanged { .. } => "image_changed",
            Self::ShapeMismatch { .. } | Self::ShellMismatch { .. } => "shape_mismatch",
            Self::NeedVsockPath | Self::NeedNet | Self::NotAnImage { .. } => "bad_request",
            Self::NoPit | Self::Arch(_) => "kvm",
            Self::Vm(e) | Self::Resume(e) => e.code(),
            Self::Lease(_)
            | Self::DiskLayer { .. }
            | Self::DiskLayerFiles { .. }
            | Self::Mmap(_)
            | Self::Uffd(_)
            | Self::Memory(_) => "io",
            Self::Attach(_) | Self::Mailbox(_) => "internal",
        }
    }
}

impl Vm {
    /// Restores the VM saved in `dir` (and its parents) and runs it.
    pub fn restore(dir: &Path, opts: RestoreOptions) -> Result<Vm, RestoreError> {
        let mut vm = Self::restore_paused(dir, opts)?;
        vm.resume().map_err(RestoreError::Resume)?;
        vm.after_restore();
        Ok(vm)
    }

    /// Tells devices whose host-side state did not survive (vsock
    /// connections) to reset their guest side; call once the VM runs.
    pub fn after_restore(&mut self) {
        for h in &self.devices.virtio {
            if let VirtioDev::Vsock(v) = &h.dev {
                lock(v).send_transport_reset();
            }
        }
    }

    /// Restores the VM saved in `dir` into a pre-built `shell` of the same
    /// shape (see [`crate::ShellPool`]) and runs it: the KVM set-up, memory
    /// slot registration and vCPU creation were paid ahead of time.
    pub fn restore_in(
        shell: VmShell,
        dir: &Path,
        opts: RestoreOptions,
    ) -> Result<Vm, RestoreError> {
        let mut vm = Self::restore_impl(dir, opts, Some(shell))?;
        vm.resume().map_err(RestoreError::Resume)?;
        vm.after_restore();
        Ok(vm)
    }

    /// Restores the VM saved in `dir` with its vCPUs parked; [`Vm::resume`]
    /// then [`Vm::after_restore`] run it.
    pub fn restore_paused(dir: &Path, opts: RestoreOptions) -> Result<Vm, RestoreError> {
        Self::restore_impl(dir, opts, None)
    }

    pub(crate) fn restore_impl(
        dir: &Path,
        opts: RestoreOptions,
        shell: Option<VmShell>,
    ) -> Result<Vm, RestoreError> {
        let t = std::time::Instant::now();
        let (chain, stack) = load_for_restore(dir)?;
        let loaded = t.elapsed();
        let leases = lease_chain(&chain)?;
        log::debug!(
            "restore: chain of {} loaded in {loaded:?}, leased in {:?}",
            chain.len(),
            t.elapsed() - loaded
        );
        Self::restore_loaded(&chain, stack, leases, opts, shell)
    }

    /// Restores from a chain loaded (and verified) once, whose layer stack is
    /// shared by every VM restored from it (a fork's children).
    pub(crate) fn restore_loaded(
        chain: &[Snapshot],
        stack: Arc<LayerStack>,
        leases: Vec<LayerLease>,
        opts: RestoreOptions,
        shell: Option<VmShell>,
    ) -> Result<Vm, RestoreError> {
        let t0 = std::time::Instant::now();
        let phase = |what: &str| log::debug!("restore: {what} at {:?}", t0.elapsed());
        let top = chain.last().ok_or(RestoreError::EmptyChain)?;
        let mut st = VmState::decode(top.state())?;
        for (&disk, path) in &opts.image_paths {
            match st.spec.disks.get_mut(disk) {
                Some(d) if d.read_only => d.path = path.clone(),
                _ => return Err(RestoreError::NotAnImage { disk }),
            }
        }
        let shape = top.shape();
        let mem_bytes = st.spec.mem_mib << 20;
        if shape.vcpus != st.spec.vcpus
            || shape.mem_bytes != mem_bytes
            || st.vcpus.len() != usize::from(st.spec.vcpus)
        {
            return Err(RestoreError::ShapeMismatch {
                manifest_vcpus: shape.vcpus,
                manifest_mem_bytes: shape.mem_bytes,
                state_vcpus: st.spec.vcpus,
                state_mem_mib: st.spec.mem_mib,
                vcpu_states: st.vcpus.len(),
            });
        }
        if let Some(s) = &shell {
            if s.vcpus != st.spec.vcpus || s.mem_bytes != mem_bytes {
                return Err(RestoreError::ShellMismatch {
                    shell_vcpus: s.vcpus,
                    shell_mem_bytes: s.mem_bytes,
                    snapshot_vcpus: st.spec.vcpus,
                    snapshot_mem_bytes: mem_bytes,
                });
            }
        }
        let mut base = VmBase::new(st.spec.vcpus, shell)?;
        if st.arch.pit.is_some() && !base.caps().pit2 {
            return Err(RestoreError::NoPit);
        }
        phase("KVM VM created");

        let reservation = base.take_reservation();
        let backing = match opts.backend {
            MemoryBackend::Mmap => Backing::Mmap(match reservation {
                Some(r) => snapshot::mmap::map_private_in(
                    &stack,
                    mem_bytes,
                    snapshot::mmap::MapOptions::default(),
                    r,
                )?,
                None => snapshot::mmap::map_private(&stack, mem_bytes)?,
            }),
            MemoryBackend::Uffd => {
                let ws = if opts.prefetch {
                    WorkingSet::load(top)?
                } else {
                    None
                };
                let record = if ws.is_none() {
                    opts.record_working_set_for
                } else {
                    None
                };
                let uopts = UffdOptions {
                    prefetch: ws,
                    record_working_set_for: record,
                    populate_in_background: false,
                };
                Backing::Uffd(match reservation {
                    Some(r) => UffdRestore::start_in(stack, mem_bytes, uopts, r)?,
                    None => UffdRestore::start(stack, mem_bytes, uopts)?,
                })
            }
        };
        let mut b = base.set_memory(memory::from_backing(backing)?)?;
        phase("memory mapped and registered");
        state::restore_vm(b.vm_fd(), &st.arch)?;

        let mut src = RestoreDevices {
            st: &st,
            spec: st.spec.clone(),
            chain,
            opts: &opts,
        };
        let (devices, mailbox) = b.attach_devices(&mut src)?;
        let spec = src.spec;
        if let Some(m) = &mailbox {
            m.resync(st.mailbox_ready)?;
        }
        phase("devices restored");
        b.add_vcpus(|fd, i, preset| -> Result<(), RestoreError> {
            state::restore_vcpu(fd, i, &st.vcpus[usize::from(i)], preset)?;
            Ok(())
        })?;
        phase("vCPUs restored");
        let instance_id = opts.instance_id.unwrap_or_else(new_instance_id);
        let vm = b.finish(Parts {
            devices,
            mailbox,
            entry: st.entry,
            has_pit: st.arch.pit.is_some(),
            lineage: Lineage::restored(instance_id, chain, leases),
            config: VmConfig {
                vsock_max_connections: opts.vsock_max_connections,
                ..VmConfig::from_spec(spec, opts.serial)
            },
        })?;
        phase("threads started");
        Ok(vm)
    }
}

/// Loads and verifies `dir`'s chain and opens its layer stack.
pub(crate) fn load_for_restore(
    dir: &Path,
) -> Result<(Vec<Snapshot>, Arc<LayerStack>), RestoreError> {
    let chain = Snapshot::load_chain(dir)?;
    let stack = Arc::new(LayerStack::open(&chain)?);
    Ok((chain, stack))
}

static TOP_SEQ: AtomicU64 = AtomicU64::new(0);

/// Devices restored from a state blob. The spec is updated as they are made
/// (private disk tops, the new vsock socket) to become the VM's config.
struct RestoreDevices<'a> {
    st: &'a VmState,
    spec: VmSpec,
    chain: &'a [Snapshot],
    opts: &'a RestoreOptions,
}

impl DeviceSource for RestoreDevices<'_> {
    type Error = RestoreError;

    fn serial(&mut self, irq_evt: EventFd) -> Result<Serial, AttachError> {
        let args = SerialRestoreArgs {
            irq_evt,
            out: self.opts.serial.clone(),
        };
        Serial::restore(args, &self.st.serial)
            .map_err(|e| AttachError::Restore("serial", Box::new(e)))
    }

    fn console_input(&self) -> bool {
        false
    }

    fn i8042(&mut self, reset_evt: EventFd) -> Result<I8042, AttachError> {
        I8042::restore(reset_evt, &self.st.i8042)
            .map_err(|e| AttachError::Restore("i8042", Box::new(e)))
    }

    fn virtio(&mut self) -> Result<Vec<VirtioSlot>, RestoreError> {
        let mut out = Vec::with_capacity(self.st.virtio.len());
        for slot in &self.st.virtio {
            let (what, dev) = match &slot.dev {
                DevState::Block { disk, state } => {
                    let blk = self.block(out.len(), *disk, state)?;
                    ("virtio-blk", VirtioDev::Block(Arc::new(Mutex::new(blk))))
                }
                DevState::Vsock(s) => {
                    let uds = self
                        .opts
                        .vsock_uds
                        .clone()
                        .ok_or(RestoreError::NeedVsockPath)?;
                    if let Some(v) = self.spec.vsock.as_mut() {
                        v.uds_path = uds.clone();
                    }
                    let mut dev = Vsock::restore(uds, s)?;
                    dev.set_max_connections(self.opts.vsock_max_connections);
                    ("virtio-vsock", VirtioDev::Vsock(Arc::new(Mutex::new(dev))))
                }
                DevState::Rng(s) => {
                    let dev = Rng::restore((), s)?;
                    ("virtio-rng", VirtioDev::Rng(Arc::new(Mutex::new(dev))))
                }
                DevState::Net(s) => {
                    let n = self.opts.net.clone().ok_or(RestoreError::NeedNet)?;
                    let tap = Tap::open(&n.tap).map_err(|e| {
                        VmError::Net(devices::virtio::net::NetError::Tap(n.tap.clone(), e))
                    })?;
                    let dev = Net::restore(
                        NetRestoreArgs {
                            tap,
                            mac: Some(n.mac),
                        },
                        s,
                    )?;
                    self.spec.net = Some(n);
                    ("virtio-net", VirtioDev::Net(Arc::new(Mutex::new(dev))))
                }
            };
            let t = slot.transport.clone();
            out.push(VirtioSlot {
                what,
                dev,
                transport: Some(Box::new(move |mem, device| {
                    MmioTransport::restore(MmioRestoreArgs { mem, device }, &t)
                        .map_err(|e| AttachError::Restore(what, Box::new(e)))
                })),
            });
        }
        Ok(out)
    }

    fn entry(&self) -> EntryKind {
        self.st.entry
    }
}

impl RestoreDevices<'_> {
    /// Disk `index` of the spec: its base image (read-only), or a private top
    /// over its layers in the chain.
    fn block(
        &mut self,
        device: usize,
        index: usize,
        state: &devices::virtio::block::BlockState,
    ) -> Result<Block, RestoreError> {
        let cfg = self
            .spec
            .disks
            .get(index)
            .cloned()
            .ok_or(RestoreError::NoSuchDisk {
                device,
                disk: index,
                disks: self.spec.disks.len(),
            })?;
        let disk = if cfg.read_only {
            // The image opened must be the one the guest saw, whose file
            // system state its memory holds (when the snapshot recorded it).
            let image = |source| RestoreError::Image {
                disk: index,
                source,
            };
            let file = FileDisk::open(&cfg.path, true).map_err(image)?;
            let found = file.identity().map_err(image)?;
            if let Some(recorded) = self.st.image_of(index).filter(|r| *r != found) {
                return Err(RestoreError::ImageChanged {
                    disk: index,
                    path: cfg.path,
                    recorded,
                    found,
                });
            }
            BlockDisk::File {
                disk: file,
                image: Some(found),
            }
        } else {
            let name = disk_layer_name(index);
            // Only the files each verified manifest lists, never names built
            // here: an unlisted file in a snapshot directory is not ours.
            let layers: Vec<LayerFiles> = self
                .chain
                .iter()
                .filter_map(|s| s.disk_layer(&name).map(|d| (s, d)))
                .map(|(s, d)| match d.files.as_slice() {
                    [data, map] => Ok(LayerFiles::mapped(s.file_path(data), s.file_path(map))),
                    other => Err(RestoreError::DiskLayerFiles {
                        disk: index,
                        dir: s.dir().to_owned(),
                        files: other.len(),
                    }),
                })
                .collect::<Result<_, _>>()?;
            let top = self.opts.scratch_dir.join(format!(
                "sprout-disk-{}-{}-{}",
                std::process::id(),
                TOP_SEQ.fetch_add(1, Ordering::Relaxed),
                name
            ));
            let disk =
                LayeredDisk::create(layers, &top, state.capacity_bytes).map_err(|source| {
                    RestoreError::DiskLayer {
                        disk: index,
                        source,
                    }
                })?;
            // The restored VM writes to a private top, not the original file.
            self.spec.disks[index].path = top;
            BlockDisk::Layered(Arc::new(disk))
        };
        let args = BlockRestoreArgs {
            disk,
            read_only: cfg.read_only,
            id: cfg.id.clone(),
        };
        Ok(Block::restore(args, state)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_errors_carry_their_numbers_and_stable_codes() {
        let e = RestoreError::ShapeMismatch {
            manifest_vcpus: 2,
            manifest_mem_bytes: 256 << 20,
            state_vcpus: 1,
            state_mem_mib: 256,
            vcpu_states: 1,
        };
        assert_eq!(e.code(), "shape_mismatch");
        assert_eq!(
            e.to_string(),
            "The snapshot's manifest is for 2 vCPUs and 268435456 bytes, its VM state for 1 \
             vCPUs and 256 MiB with 1 vCPU states"
        );
        let e = RestoreError::NoSuchDisk {
            device: 0,
            disk: 3,
            disks: 1,
        };
        assert_eq!(e.code(), "bad_snapshot");
        assert_eq!(RestoreError::NeedVsockPath.code(), "bad_request");
        let e = RestoreError::State(StateBlobError::Version { found: 9 });
        assert_eq!(e.code(), "bad_snapshot");
    }
}
