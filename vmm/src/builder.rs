//! Building a [`Vm`]: the steps a boot ([`Vm::create`]) and a restore share,
//! written once.
//!
//! 1. [`VmBase::new`]: a new KVM VM, or a pre-built [`VmShell`] (its VM,
//!    vCPUs and memory slots made ahead of time).
//! 2. [`VmBase::set_memory`]: guest RAM, registered with KVM unless the
//!    shell's slots already cover it.
//! 3. [`VmBuilder::attach_devices`]: serial, i8042, the virtio devices and the
//!    mailbox, always in that order (so a restored VM finds every device on the
//!    bus address and interrupt line it had), each device fresh or restored as
//!    its [`DeviceSource`] says.
//! 4. [`VmBuilder::add_vcpus`]: one vCPU per index (the shell's, or new), set up
//!    by the caller (boot registers, or restored state).
//! 5. [`VmBuilder::finish`]: start tracking dirty pages, start the event loop
//!    and the vCPU threads (parked), and assemble the `Vm` in `Created`.
//!
//! Data flows one way: this module knows the VM, its devices and shells, never
//! snapshots or forks.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use devices::legacy::{Serial, I8042};
use devices::virtio::mmio::MmioTransport;
use devices::virtio::{GuestMemoryMmap, VirtioDevice};
use event_manager::SubscriberOps;
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use snapshot::Reservation;
use vmm_sys_util::eventfd::EventFd;

use crate::arch::kernel::EntryKind;
use crate::arch::state;
use crate::config::VmConfig;
use crate::event_loop::{EventLoop, Manager, StdinToSerial};
use crate::kvm::{self, HostCaps};
use crate::lineage::Lineage;
use crate::mailbox::Mailbox;
use crate::memory::{self, GuestRam};
use crate::run_state::VmRunState;
use crate::shell::VmShell;
use crate::vcpu::{ExitSignal, Vcpu, VcpuContext};
use crate::vm::{Vm, VmError};
use crate::vm_devices::{Attach, AttachError, DeviceHandles, VirtioDev, VirtioHandle, Wiring};

/// How the devices of the VM being built are made: new (boot) or from their
/// saved state (restore).
pub(crate) trait DeviceSource {
    type Error: From<AttachError>;

    /// The serial port, raising `irq_evt`.
    fn serial(&mut self, irq_evt: EventFd) -> Result<Serial, AttachError>;
    /// Feed the VMM's standard input to the serial port.
    fn console_input(&self) -> bool;
    /// The i8042, writing `reset_evt` on a guest reset.
    fn i8042(&mut self, reset_evt: EventFd) -> Result<I8042, AttachError>;
    /// The virtio devices in slot order; each [`VirtioSlot`] says how its
    /// transport is made.
    fn virtio(&mut self) -> Result<Vec<VirtioSlot>, Self::Error>;
    /// How the kernel is entered (the direct entry has a mailbox).
    fn entry(&self) -> EntryKind;
}

/// A virtio device to attach, and how to make its transport.
pub(crate) struct VirtioSlot {
    pub what: &'static str,
    pub dev: VirtioDev,
    /// Fresh when `None`; else restores the transport in front of the device.
    pub transport: Option<TransportMaker>,
}

pub(crate) type TransportMaker = Box<
    dyn FnOnce(GuestMemoryMmap, Arc<Mutex<dyn VirtioDevice>>) -> Result<MmioTransport, AttachError>,
>;

/// Step 1 of a VM being built: its KVM VM, before it has memory.
pub(crate) struct VmBase {
    vcpus: u8,
    /// vCPUs a shell made ahead of time, taken in index order, each with
    /// the CPUID table it was given.
    pre_vcpus: VecDeque<(VcpuFd, crate::arch::cpuid::Preset)>,
    caps: HostCaps,
    msrs: Vec<u32>,
    /// A shell's reserved range, for the restore to map its memory into.
    reservation: Option<Reservation>,
    /// The shell's memory slots already cover the reservation.
    preregistered: bool,
    kvm: Kvm,
    vm: VmFd,
}

/// A VM being built, with its memory; [`VmBuilder::finish`] makes it a [`Vm`].
pub(crate) struct VmBuilder {
    // Field order is drop order, as in `Vm`: the VM fd before the memory.
    fds: Vec<VcpuFd>,
    wiring: Wiring,
    exit: Arc<ExitSignal>,
    base: VmBase,
    ram: GuestRam,
}

/// What only the caller knows of the VM it built.
pub(crate) struct Parts {
    pub devices: DeviceHandles,
    pub mailbox: Option<Mailbox>,
    pub entry: EntryKind,
    pub has_pit: bool,
    pub lineage: Lineage,
    pub config: VmConfig,
}

impl VmBase {
    /// Step 1: a new KVM VM for `vcpus` vCPUs, or the one of `shell`.
    pub fn new(vcpus: u8, shell: Option<VmShell>) -> Result<Self, VmError> {
        Ok(match shell {
            Some(s) => VmBase {
                vcpus,
                pre_vcpus: s.vcpu_fds.into(),
                caps: s.caps,
                msrs: s.msrs,
                reservation: Some(s.reservation),
                preregistered: true,
                kvm: s._kvm,
                vm: s.vm,
            },
            None => {
                let (kvm, caps, vm) = kvm::create_vm(vcpus)?;
                VmBase {
                    vcpus,
                    pre_vcpus: VecDeque::new(),
                    caps,
                    msrs: state::msr_list(&kvm)?,
                    reservation: None,
                    preregistered: false,
                    kvm,
                    vm,
                }
            }
        })
    }

    pub fn caps(&self) -> HostCaps {
        self.caps
    }

    pub fn kvm(&self) -> &Kvm {
        &self.kvm
    }

    /// The shell's reserved memory range (once), for guest RAM to be mapped into.
    pub fn take_reservation(&mut self) -> Option<Reservation> {
        self.reservation.take()
    }

    /// Step 2: guest RAM, registered with KVM unless a shell's slots cover it.
    pub fn set_memory(self, ram: GuestRam) -> Result<VmBuilder, VmError> {
        if !self.preregistered {
            memory::register(&self.vm, &ram.mem, true)?;
        }
        let exit = Arc::new(ExitSignal::default());
        Ok(VmBuilder {
            fds: Vec::with_capacity(usize::from(self.vcpus)),
            wiring: Wiring::new(new_manager()?, exit.clone()),
            exit,
            base: self,
            ram,
        })
    }
}

impl VmBuilder {
    pub fn vm_fd(&self) -> &VmFd {
        &self.base.vm
    }

    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.ram.mem
    }

    pub fn ram_size(&self) -> u64 {
        self.ram.size
    }

    /// Step 3: every device, in the one order boot and restore share.
    pub fn attach_devices<S: DeviceSource>(
        &mut self,
        src: &mut S,
    ) -> Result<(DeviceHandles, Option<Mailbox>), S::Error> {
        let mem = &self.ram.mem;
        let mut at = Attach {
            vm: &self.base.vm,
            mem,
            w: &mut self.wiring,
        };
        let serial = at.attach_serial_with(|evt| src.serial(evt))?;
        if src.console_input() {
            at.w.em.add_subscriber(Arc::new(Mutex::new(StdinToSerial {
                serial: serial.clone(),
            })));
        }
        let i8042 = at.attach_i8042_with(|evt| src.i8042(evt))?;
        let mut virtio = Vec::new();
        for slot in src.virtio()? {
            let make = |m: &GuestMemoryMmap, d: Arc<Mutex<dyn VirtioDevice>>| match slot.transport {
                Some(t) => t(m.clone(), d),
                None => Ok(MmioTransport::new(m.clone(), d)),
            };
            let transport = match &slot.dev {
                VirtioDev::Block(d) => at.attach_virtio(slot.what, d.clone(), make)?,
                VirtioDev::Vsock(d) => at.attach_virtio(slot.what, d.clone(), make)?,
                VirtioDev::Rng(d) => at.attach_virtio(slot.what, d.clone(), make)?,
                VirtioDev::Net(d) => at.attach_virtio(slot.what, d.clone(), make)?,
            };
            virtio.push(VirtioHandle {
                transport,
                dev: slot.dev,
            });
        }
        let mailbox = match src.entry() {
            EntryKind::Direct => Some(at.attach_mailbox(self.base.vcpus)?),
            EntryKind::Linux => None,
        };
        let devices = DeviceHandles {
            serial,
            i8042,
            virtio,
        };
        Ok((devices, mailbox))
    }

    /// The `virtio_mmio.device=` entries of the attached devices.
    pub fn cmdline_devices(&self) -> &[String] {
        &self.wiring.cmdline_devices
    }

    /// Step 4: every vCPU (the shell's, or new), each set up by `setup`.
    pub fn add_vcpus<E: From<VmError>>(
        &mut self,
        mut setup: impl FnMut(&VcpuFd, u8, Option<&crate::arch::cpuid::Preset>) -> Result<(), E>,
    ) -> Result<(), E> {
        for i in 0..self.base.vcpus {
            let (fd, preset) = match self.base.pre_vcpus.pop_front() {
                Some((fd, c)) => (fd, Some(c)),
                None => (
                    self.base
                        .vm
                        .create_vcpu(u64::from(i))
                        .map_err(|e| VmError::KvmOp("create a vCPU", e))?,
                    None,
                ),
            };
            setup(&fd, i, preset.as_ref())?;
            self.fds.push(fd);
        }
        Ok(())
    }

    /// Step 5: starts the threads (vCPUs parked) and assembles the `Vm`.
    pub fn finish(self, parts: Parts) -> Result<Vm, VmError> {
        let VmBuilder {
            fds,
            wiring,
            exit,
            base,
            ram,
        } = self;
        let VmBase { msrs, vm, .. } = base;
        // Start tracking changes from the first instruction on.
        memory::forget_vmm_writes(&ram.mem);
        let (event_loop, vcpus) = start_threads(wiring, fds, &exit)?;
        Ok(Vm {
            vcpus,
            event_loop,
            mailbox: parts.mailbox,
            devices: parts.devices,
            exit,
            entry: parts.entry,
            has_pit: parts.has_pit,
            msrs: Arc::new(msrs),
            lineage: parts.lineage,
            last_pause: Duration::ZERO,
            last_staged: 0,
            run: VmRunState::Created,
            vm,
            ram: memory::KeptRam::new(ram),
            config: parts.config,
        })
    }
}

fn new_manager() -> Result<Manager, VmError> {
    Manager::new().map_err(|e| VmError::EventLoop(std::io::Error::other(format!("{e:?}"))))
}

/// Starts the event loop and one parked thread per vCPU.
fn start_threads(
    wiring: Wiring,
    fds: Vec<VcpuFd>,
    exit: &Arc<ExitSignal>,
) -> Result<(EventLoop, Vec<Vcpu>), VmError> {
    let Wiring { pio, mmio, em, .. } = wiring;
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
