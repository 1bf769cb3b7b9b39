//! A VM: KVM VM, guest RAM, devices, the event loop and vCPU threads, and
//! what the host does with it once built (run, pause, wait, stop). It is built
//! by [`crate::builder`], for a boot ([`Vm::create`]) or a restore.

use std::sync::Arc;
use std::time::Duration;

use devices::virtio::GuestMemoryMmap;
use kvm_ioctls::VmFd;

use crate::arch::{boot, kernel, regs, state};
use crate::config::{ConfigError, VmConfig};
use crate::event_loop::EventLoop;
use crate::kvm::KvmError;
use crate::mailbox::Mailbox;
use crate::memory::{KeptRam, MemoryError};
use crate::run_state::{pause_all, resume_all, InvalidState, PauseFailed, VmOp, VmRunState};
use crate::vcpu::{ExitSignal, Vcpu, VcpuError};
use crate::vm_devices::{AttachError, DeviceHandles};

pub use crate::vcpu::ExitReason;
pub use kernel::EntryKind;

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("Invalid VM configuration")]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Kvm(#[from] KvmError),
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
    #[error("Cannot set up the network device")]
    Net(#[source] devices::virtio::net::NetError),
    #[error("Cannot start the device event loop")]
    EventLoop(#[source] std::io::Error),
    #[error("vCPU thread")]
    Vcpu(#[from] VcpuError),
    #[error(transparent)]
    InvalidState(#[from] InvalidState),
}

impl VmError {
    /// A stable snake_case name of the failure, for protocols.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Config(_) | Self::Kernel(_) | Self::Disk(..) | Self::LayeredDisk(..) => {
                "bad_request"
            }
            Self::InvalidState(_) => "invalid_state",
            Self::Kvm(_) | Self::KvmOp(..) | Self::Regs(_) | Self::State(_) => "kvm",
            Self::Memory(_) | Self::Vsock(_) | Self::Rng(_) | Self::Net(_) => "io",
            Self::Boot(_) | Self::Attach(_) | Self::EventLoop(_) | Self::Vcpu(_) => "internal",
        }
    }
}

/// How long stopping a VM waits, in all, for its threads to end.
pub const STOP_DEADLINE: Duration = Duration::from_secs(3);

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
    /// Bytes the last snapshot copied out while paused and wrote after the
    /// VM ran again (0: it was written while paused).
    pub(crate) last_staged: u64,
    /// Where the host last put the VM (`Exited` comes from `exit` instead).
    pub(crate) run: VmRunState,
    pub(crate) vm: VmFd,
    pub(crate) ram: KeptRam,
    pub(crate) config: VmConfig,
}

impl Vm {
    /// Where the VM is in its life: created, running, paused, exited or failed.
    pub fn state(&self) -> VmRunState {
        if let VmRunState::Failed(_) = self.run {
            return self.run.clone();
        }
        match self.exit_reason() {
            Some(r) => VmRunState::Exited(r),
            None => self.run.clone(),
        }
    }

    /// `r`, or what lies behind it when the guest failed because a layer
    /// file under restored RAM was truncated: a host thread touching such a
    /// page takes SIGBUS (`snapshot::fault`), but a vCPU's access shows up
    /// as a vCPU failure or a guest fault, which this names for what it is.
    fn explained(&self, r: ExitReason) -> ExitReason {
        let guest_failed = matches!(
            r,
            ExitReason::VcpuFailed { .. }
                | ExitReason::TripleFault { .. }
                | ExitReason::GuestPanic { .. }
        );
        if !guest_failed {
            return r;
        }
        match self.ram.backing.changed_layer() {
            Some(path) => ExitReason::LayerChanged {
                path,
                then: Box::new(r),
            },
            None => r,
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
        self.exit.wait(timeout).map(|r| self.explained(r))
    }

    /// Why the VM stopped, if it has.
    pub fn exit_reason(&self) -> Option<ExitReason> {
        self.exit.get().map(|r| self.explained(r))
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

    /// Stops the VM (if still running) and every thread it started, within
    /// [`STOP_DEADLINE`] even when a thread is stuck: see [`ExitReason::Abandoned`].
    pub fn stop(mut self) -> ExitReason {
        self.exit.set(ExitReason::Stopped);
        self.shutdown();
        self.exit_reason().unwrap_or(ExitReason::Stopped)
    }

    /// Asks every vCPU and the event loop to end before waiting on any, then
    /// joins them against one deadline. Threads still running then (stuck in
    /// a device handler, or never answering) are detached: the VM is torn
    /// down anyway, its guest memory stays mapped for them, and the exit
    /// reason says so.
    fn shutdown(&mut self) {
        for v in &mut self.vcpus {
            v.request_exit();
        }
        self.event_loop.request_stop();
        let deadline = std::time::Instant::now() + STOP_DEADLINE;
        let mut stuck: Vec<String> = Vec::new();
        for v in &mut self.vcpus {
            if !v.join_until(deadline) {
                stuck.push(format!("vCPU {}", v.index()));
            }
        }
        if !self.event_loop.join_until(deadline) {
            stuck.push("the event loop".into());
        }
        if !stuck.is_empty() {
            let threads = stuck.join(", ");
            log::error!("VM teardown abandons threads that did not exit: {threads}");
            self.ram.leak();
            self.exit.overwrite(ExitReason::Abandoned { threads });
        }
    }

    /// The serial device, for tests that hold its lock to wedge a vCPU.
    #[cfg(feature = "test-hooks")]
    pub fn serial_device(&self) -> Arc<std::sync::Mutex<devices::legacy::Serial>> {
        self.devices.serial.clone()
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

    /// Bytes of dirty pages and disk clusters the last snapshot copied out
    /// while the VM was paused, to write and fsync them after it ran again
    /// (see [`crate::STAGE_LIMIT`]); 0 when it was written while
    /// paused.
    pub fn last_staged_bytes(&self) -> u64 {
        self.last_staged
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

    /// Drops the leases this VM let go of when its last layer began a new
    /// chain (see [`crate::lineage`]): the fork layers nobody else holds
    /// are removed now. Whoever wrote the layer calls it once its caller
    /// has the answer ([`Vm::fork`] while its children start, a worker
    /// after replying); else they go at the next snapshot or with the VM.
    pub fn release_retired_layers(&mut self) {
        drop(self.lineage.take_retired());
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
