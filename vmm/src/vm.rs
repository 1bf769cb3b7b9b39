//! A running VM: KVM VM, guest RAM, devices, the event loop and vCPU threads.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use devices::virtio::block::{Block, BlockConfig, LayeredDisk};
use devices::virtio::mmio::MmioTransport;
use devices::virtio::rng::Rng;
use devices::virtio::vsock::Vsock;
use devices::virtio::{GuestMemoryMmap, VirtioDevice};
use event_manager::SubscriberOps;
use kvm_bindings::{kvm_pit_config, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::VmFd;

use crate::arch::{boot, cpuid, kernel, regs, state};
use crate::config::{ConfigError, VmConfig};
use crate::event_loop::{EventLoop, Manager};
use crate::kvm::{self, HostCaps, KvmError};
use crate::mailbox::Mailbox;
use crate::memory::{self, GuestRam, MemoryError};
use crate::run_state::{pause_all, resume_all, InvalidState, PauseFailed, VmOp, VmRunState};
use crate::vcpu::{ExitSignal, Vcpu, VcpuContext, VcpuError};
use crate::vm_devices::{Attach, AttachError, DeviceHandles, VirtioDev, VirtioHandle};

pub use crate::vcpu::ExitReason;
pub use kernel::EntryKind;

/// Where KVM puts the TSS it needs for real-mode emulation: the top of the
/// 32-bit space, below the BIOS area, outside RAM.
const KVM_TSS_ADDRESS: usize = 0xfffb_d000;

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("Invalid VM configuration")]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Kvm(#[from] KvmError),
    #[error("This host's KVM runs at most {0} vCPUs")]
    HostVcpus(usize),
    #[error("KVM refused to {0}")]
    KvmOp(&'static str, #[source] kvm_ioctls::Error),
    #[error("Cannot set up guest memory")]
    Memory(#[from] MemoryError),
    #[error("Cannot load the kernel")]
    Kernel(#[from] kernel::KernelError),
    #[error("Cannot write the boot structures")]
    Boot(#[from] boot::BootError),
    #[error("Cannot set up vCPU registers")]
    Regs(#[from] regs::RegsError),
    #[error("Cannot attach a device")]
    Attach(#[from] AttachError),
    #[error("Cannot open disk {0}")]
    Disk(
        std::path::PathBuf,
        #[source] devices::virtio::block::BlockError,
    ),
    #[error("Cannot open disk {0}")]
    LayeredDisk(
        std::path::PathBuf,
        #[source] devices::virtio::block::LayeredError,
    ),
    #[error("Cannot read KVM state")]
    State(#[from] state::StateError),
    #[error("Cannot set up the vsock device")]
    Vsock(#[source] devices::virtio::vsock::VsockError),
    #[error("Cannot set up the rng device")]
    Rng(#[source] devices::virtio::rng::RngError),
    #[error("Cannot start the device event loop")]
    EventLoop(#[source] std::io::Error),
    #[error("vCPU thread")]
    Vcpu(#[from] VcpuError),
    #[error(transparent)]
    InvalidState(#[from] InvalidState),
}

/// A booted VM. Dropping it stops every thread it started and frees its memory.
pub struct Vm {
    // Field order is drop order: threads first, then what they use, the VM
    // fd before the memory it maps.
    pub(crate) vcpus: Vec<Vcpu>,
    pub(crate) event_loop: EventLoop,
    pub(crate) mailbox: Option<Mailbox>,
    pub(crate) devices: DeviceHandles,
    pub(crate) exit: Arc<ExitSignal>,
    pub(crate) entry: EntryKind,
    pub(crate) has_pit: bool,
    /// MSRs a snapshot saves (KVM's list).
    pub(crate) msrs: Arc<Vec<u32>>,
    /// Instance id, parent snapshot and fork-layer leases.
    pub(crate) lineage: crate::lineage::Lineage,
    /// How long the last snapshot (or fork) kept the vCPUs paused.
    pub(crate) last_pause: Duration,
    /// Where the host last put the VM (`Exited` comes from `exit` instead).
    pub(crate) run: VmRunState,
    pub(crate) vm: VmFd,
    pub(crate) ram: GuestRam,
    pub(crate) config: VmConfig,
}

impl Vm {
    /// Validates `config`, builds the VM and starts its vCPUs.
    pub fn start(config: VmConfig) -> Result<Vm, VmError> {
        let mut vm = Self::create(config)?;
        vm.resume()?;
        Ok(vm)
    }

    /// Builds the VM with its vCPU threads parked before their first
    /// instruction; [`Vm::resume`] starts them.
    pub fn create(config: VmConfig) -> Result<Vm, VmError> {
        config.validate()?;
        let (kvm, caps, vm) = kvm_vm(config.vcpus)?;
        let ram = memory::create(config.mem_mib << 20)?;
        memory::register(&vm, &ram.mem, true)?;
        let kernel = kernel::load(&ram.mem, &config.kernel)?;
        boot::write_boot_tables(&ram.mem)?;

        let exit = Arc::new(ExitSignal::default());
        let mut at = Attach::new(&vm, &ram.mem, new_manager()?, exit.clone());
        let serial = at.attach_serial(config.serial.clone())?;
        if config.console_input {
            at.em
                .add_subscriber(Arc::new(Mutex::new(crate::event_loop::StdinToSerial {
                    serial: serial.clone(),
                })));
        }
        let i8042 = at.attach_i8042()?;
        let virtio = attach_virtio_devices(&mut at, &config)?;
        let devices = DeviceHandles {
            serial,
            i8042,
            virtio,
        };
        let mailbox = match kernel.kind {
            EntryKind::Direct => Some(at.attach_mailbox(config.vcpus)?),
            EntryKind::Linux => None,
        };

        let mut cmdline = config.cmdline.trim().to_string();
        for d in &at.cmdline_devices {
            if !cmdline.is_empty() {
                cmdline.push(' ');
            }
            cmdline.push_str(d);
        }
        boot::write_cmdline(&ram.mem, &cmdline)?;
        boot::write_zero_page(&ram.mem, ram.size, cmdline.len())?;
        if kernel.kind == EntryKind::Linux {
            crate::arch::mptable::write(&ram.mem, config.vcpus)?;
        }
        if kernel.kind == EntryKind::Linux {
            crate::arch::mptable::write(&ram.mem, config.vcpus)?;
        }

        let supported = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(|e| VmError::KvmOp("report supported CPUID", e))?;
        let mut fds = Vec::with_capacity(usize::from(config.vcpus));
        for i in 0..config.vcpus {
            let fd = vm
                .create_vcpu(u64::from(i))
                .map_err(|e| VmError::KvmOp("create a vCPU", e))?;
            let mut c = supported.clone();
            cpuid::for_vcpu(&mut c, i, config.vcpus);
            fd.set_cpuid2(&c)
                .map_err(|e| VmError::KvmOp("set CPUID", e))?;
            regs::setup_vcpu(&fd, i, kernel.entry, kernel.kind)?;
            fds.push(fd);
        }
        // Start tracking changes from the first instruction on.
        memory::reset_dirty(&vm, &ram.mem)?;
        let (event_loop, vcpus) = start_threads(at, fds, &exit)?;
        Ok(Vm {
            vcpus,
            event_loop,
            mailbox,
            devices,
            exit,
            entry: kernel.kind,
            has_pit: caps.pit2,
            msrs: Arc::new(state::msr_list(&kvm)?),
            lineage: crate::lineage::Lineage::new(
                config
                    .instance_id
                    .unwrap_or_else(crate::lineage::new_instance_id),
            ),
            last_pause: Duration::ZERO,
            run: VmRunState::Created,
            vm,
            ram,
            config,
        })
    }

    /// Where the VM is in its life: created, running, paused, exited or failed.
    pub fn state(&self) -> VmRunState {
        if let VmRunState::Failed(_) = self.run {
            return self.run.clone();
        }
        match self.exit.get() {
            Some(r) => VmRunState::Exited(r),
            None => self.run.clone(),
        }
    }

    /// Runs every vCPU of a created or paused VM.
    pub fn resume(&mut self) -> Result<(), VmError> {
        let next = self.state().after(VmOp::Resume)?;
        match resume_all(&mut self.vcpus) {
            Ok(()) => {
                self.run = next;
                Ok(())
            }
            Err(e) => {
                self.run = VmRunState::Failed(format!("a vCPU did not resume: {e}"));
                Err(e.into())
            }
        }
    }

    /// Takes every vCPU out of guest code and parks it; returns once all are
    /// parked. All or nothing: if one vCPU does not park, the others run
    /// again and the VM stays running.
    pub fn pause(&mut self) -> Result<(), VmError> {
        let next = self.state().after(VmOp::Pause)?;
        match pause_all(&mut self.vcpus) {
            Ok(()) => {
                self.run = next;
                Ok(())
            }
            Err(PauseFailed { error, undone }) => {
                if !undone {
                    self.run =
                        VmRunState::Failed(format!("a failed pause could not be undone: {error}"));
                }
                Err(error.into())
            }
        }
    }

    /// Waits for the VM to stop, at most `timeout` (forever with `None`).
    pub fn wait(&self, timeout: Option<Duration>) -> Option<ExitReason> {
        self.exit.wait(timeout)
    }

    /// Why the VM stopped, if it has.
    pub fn exit_reason(&self) -> Option<ExitReason> {
        self.exit.get()
    }

    /// The VM's exit signal, to wait for its end (or request it with
    /// `ExitReason::Stopped`) from another thread without holding the `Vm`.
    pub fn exit_signal(&self) -> Arc<ExitSignal> {
        self.exit.clone()
    }

    /// Whether the VM is parked by [`Vm::pause`] (see [`Vm::state`]).
    pub fn is_paused(&self) -> bool {
        self.state() == VmRunState::Paused
    }

    /// Stops the VM (if still running) and every thread it started.
    pub fn stop(mut self) -> ExitReason {
        self.exit.set(ExitReason::Stopped);
        self.shutdown();
        self.exit.get().unwrap_or(ExitReason::Stopped)
    }

    fn shutdown(&mut self) {
        for v in &mut self.vcpus {
            v.stop();
        }
        self.event_loop.stop();
    }

    /// The test guest's mailbox (for kernels with the direct entry).
    pub fn mailbox(&self) -> Option<&Mailbox> {
        self.mailbox.as_ref()
    }

    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.ram.mem
    }

    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    pub fn entry_kind(&self) -> EntryKind {
        self.entry
    }

    /// How long the last snapshot or fork kept this VM's vCPUs paused.
    pub fn last_pause(&self) -> Duration {
        self.last_pause
    }

    /// This VM's instance id (random unless the caller gave one; each fork
    /// child gets its own).
    pub fn instance_id(&self) -> u64 {
        self.lineage.instance_id()
    }

    /// Where this VM comes from and what its next layer builds on.
    pub fn lineage(&self) -> &crate::lineage::Lineage {
        &self.lineage
    }

    /// Where this VM's vsock device listens, if it has one.
    pub fn vsock_uds(&self) -> Option<&std::path::Path> {
        self.config.vsock.as_ref().map(|v| v.uds_path.as_path())
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.exit.set(ExitReason::Stopped);
        self.shutdown();
    }
}

/// Opens KVM and creates a VM with its in-kernel irqchip (and PIT if the host has one).
pub(crate) fn kvm_vm(vcpus: u8) -> Result<(kvm_ioctls::Kvm, HostCaps, VmFd), VmError> {
    let (kvm, caps) = kvm::open()?;
    if usize::from(vcpus) > caps.max_vcpus {
        return Err(VmError::HostVcpus(caps.max_vcpus));
    }
    let vm = kvm
        .create_vm()
        .map_err(|e| VmError::KvmOp("create a VM", e))?;
    vm.set_tss_address(KVM_TSS_ADDRESS)
        .map_err(|e| VmError::KvmOp("set the TSS address", e))?;
    vm.create_irq_chip()
        .map_err(|e| VmError::KvmOp("create the in-kernel irqchip", e))?;
    if caps.pit2 {
        let pit = kvm_pit_config {
            flags: kvm_bindings::KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        vm.create_pit2(pit)
            .map_err(|e| VmError::KvmOp("create the in-kernel PIT", e))?;
    } else {
        log::warn!("host KVM has no in-kernel PIT (KVM_CAP_PIT2): the guest runs without one");
    }
    Ok((kvm, caps, vm))
}

pub(crate) fn new_manager() -> Result<Manager, VmError> {
    Manager::new().map_err(|e| VmError::EventLoop(std::io::Error::other(format!("{e:?}"))))
}

/// Starts the event loop and one parked thread per vCPU.
pub(crate) fn start_threads(
    at: Attach<'_>,
    fds: Vec<kvm_ioctls::VcpuFd>,
    exit: &Arc<ExitSignal>,
) -> Result<(EventLoop, Vec<Vcpu>), VmError> {
    let Attach { pio, mmio, em, .. } = at;
    let event_loop = EventLoop::start(em).map_err(VmError::EventLoop)?;
    let (pio, mmio) = (Arc::new(pio), Arc::new(mmio));
    let mut vcpus = Vec::with_capacity(fds.len());
    for (i, fd) in fds.into_iter().enumerate() {
        let ctx = VcpuContext {
            pio: pio.clone(),
            mmio: mmio.clone(),
            exit: exit.clone(),
        };
        vcpus.push(Vcpu::spawn(i as u8, fd, ctx)?);
    }
    Ok((event_loop, vcpus))
}

pub(crate) fn fresh(
    mem: &GuestMemoryMmap,
    dev: Arc<Mutex<dyn VirtioDevice>>,
) -> Result<MmioTransport, AttachError> {
    Ok(MmioTransport::new(mem.clone(), dev))
}

fn attach_virtio_devices(
    at: &mut Attach<'_>,
    config: &VmConfig,
) -> Result<Vec<VirtioHandle>, VmError> {
    let mut out = Vec::new();
    for d in &config.disks {
        // A writable disk is a layered disk whose top is the user's file: guest
        // writes land in it, and snapshots copy only its data.
        let blk = if d.read_only {
            Block::new(BlockConfig {
                path: d.path.clone(),
                read_only: true,
                id: d.id.clone(),
            })
            .map_err(|e| VmError::Disk(d.path.clone(), e))?
        } else {
            let disk = LayeredDisk::open_file(&d.path)
                .map_err(|e| VmError::LayeredDisk(d.path.clone(), e))?;
            Block::with_layered(Arc::new(disk), false, &d.id)
                .map_err(|e| VmError::Disk(d.path.clone(), e))?
        };
        let dev = Arc::new(Mutex::new(blk));
        let transport = at.attach_virtio("virtio-blk", dev.clone(), fresh)?;
        out.push(VirtioHandle {
            transport,
            dev: VirtioDev::Block(dev),
        });
    }
    if let Some(v) = &config.vsock {
        let dev = Vsock::new(v.guest_cid, v.uds_path.clone()).map_err(VmError::Vsock)?;
        let dev = Arc::new(Mutex::new(dev));
        let transport = at.attach_virtio("virtio-vsock", dev.clone(), fresh)?;
        out.push(VirtioHandle {
            transport,
            dev: VirtioDev::Vsock(dev),
        });
    }
    if config.rng {
        let dev = Arc::new(Mutex::new(Rng::new().map_err(VmError::Rng)?));
        let transport = at.attach_virtio("virtio-rng", dev.clone(), fresh)?;
        out.push(VirtioHandle {
            transport,
            dev: VirtioDev::Rng(dev),
        });
    }
    Ok(out)
}
