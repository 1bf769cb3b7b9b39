//! Booting a VM from its config: [`Vm::start`] and [`Vm::create`].

use std::sync::{Arc, Mutex};

use devices::legacy::{Serial, I8042};
use devices::virtio::block::{Block, BlockConfig, LayerFiles, LayeredDisk};
use devices::virtio::net::{Net, Tap};
use devices::virtio::rng::Rng;
use devices::virtio::vsock::Vsock;
use vmm_sys_util::eventfd::EventFd;

use crate::arch::kernel::{self, EntryKind};
use crate::arch::{boot, cpuid, regs};
use crate::builder::{DeviceSource, Parts, VirtioSlot, VmBase};
use crate::config::VmConfig;
use crate::lineage::{new_instance_id, Lineage};
use crate::memory;
use crate::shell::VmShell;
use crate::vm::{Vm, VmError};
use crate::vm_devices::{AttachError, VirtioDev};

impl Vm {
    /// Validates `config`, builds the VM and starts its vCPUs.
    pub fn start(config: VmConfig) -> Result<Vm, VmError> {
        Self::start_in(config, None)
    }

    /// [`Vm::start`] in `shell`, a VM built ahead of time (a ready worker's):
    /// its KVM VM, vCPUs and memory slots are used instead of new ones. A
    /// shell of another shape than `config` is dropped and not used.
    pub fn start_in(config: VmConfig, shell: Option<VmShell>) -> Result<Vm, VmError> {
        let mut vm = Self::create_in(config, shell)?;
        vm.resume()?;
        Ok(vm)
    }

    /// Builds the VM with its vCPU threads parked before their first
    /// instruction; [`Vm::resume`] starts them.
    pub fn create(config: VmConfig) -> Result<Vm, VmError> {
        Self::create_in(config, None)
    }

    /// [`Vm::create`] in `shell` (see [`Vm::start_in`]).
    pub fn create_in(config: VmConfig, shell: Option<VmShell>) -> Result<Vm, VmError> {
        config.validate()?;
        let mut phases = Phases::new();
        let shell = shell.filter(|s| {
            let fits = s.vcpus() == config.vcpus && s.mem_bytes() == config.mem_mib << 20;
            if !fits {
                log::debug!(
                    "a shell of {} vCPUs and {} bytes is not used for a VM of {} vCPUs and {} MiB",
                    s.vcpus(),
                    s.mem_bytes(),
                    config.vcpus,
                    config.mem_mib
                );
            }
            fits
        });
        let mut base = VmBase::new(config.vcpus, shell)?;
        let supported = cpuid::supported(base.kvm(), base.caps())
            .map_err(|e| VmError::KvmOp("report supported CPUID", e))?;
        let has_pit = base.caps().pit2;
        phases.mark("kvm");
        let ram = match base.take_reservation() {
            Some(range) => memory::create_in(config.mem_mib << 20, range)?,
            None => memory::create(config.mem_mib << 20)?,
        };
        let mut b = base.set_memory(ram)?;
        phases.mark("memory");
        let kernel = kernel::load(b.memory(), &config.kernel)?;
        boot::write_boot_tables(b.memory())?;
        phases.mark("kernel");

        let mut src = BootDevices {
            config: &config,
            entry: kernel.kind,
        };
        let (devices, mailbox) = b.attach_devices(&mut src)?;
        phases.mark("devices");

        let mut cmdline = config.cmdline.trim().to_string();
        for d in b.cmdline_devices() {
            if !cmdline.is_empty() {
                cmdline.push(' ');
            }
            cmdline.push_str(d);
        }
        boot::write_cmdline(b.memory(), &cmdline)?;
        boot::write_zero_page(b.memory(), b.ram_size(), cmdline.len())?;
        if kernel.kind == EntryKind::Linux {
            crate::arch::mptable::write(b.memory(), config.vcpus)?;
        }

        let n = config.vcpus;
        b.add_vcpus(|fd, i, preset| -> Result<(), VmError> {
            let mut c = supported.clone();
            cpuid::for_vcpu(&mut c, i, n);
            // A shell's vCPU has this very table already.
            if preset.is_none_or(|p| p.given != c.as_slice()) {
                fd.set_cpuid2(&c)
                    .map_err(|e| VmError::KvmOp("set CPUID", e))?;
            }
            regs::setup_vcpu(fd, i, kernel.entry, kernel.kind)?;
            Ok(())
        })?;
        phases.mark("vcpus");
        let lineage = Lineage::new(config.instance_id.unwrap_or_else(new_instance_id));
        let vm = b.finish(Parts {
            devices,
            mailbox,
            entry: kernel.kind,
            has_pit,
            lineage,
            config,
        })?;
        phases.mark("threads");
        // tests/lab/bench-boot.sh reads this line (a slow boot says where).
        log::debug!("vm created: {phases}");
        Ok(vm)
    }
}

/// Wall time per step of [`Vm::create`], for the log.
struct Phases {
    last: std::time::Instant,
    start: std::time::Instant,
    /// Minor page faults of the process so far: in the emulated lab each
    /// costs tens of microseconds, so they say where a slow step went.
    last_faults: u64,
    done: Vec<(&'static str, std::time::Duration, u64)>,
}

/// This process's minor page faults so far (0 if the kernel will not say).
pub fn minor_faults() -> u64 {
    // SAFETY: an all-zero rusage is a valid value of this plain C struct.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes one rusage into the valid, owned `u`.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0;
    }
    u64::try_from(u.ru_minflt).unwrap_or(0)
}

impl Phases {
    fn new() -> Self {
        let now = std::time::Instant::now();
        Self {
            last: now,
            start: now,
            last_faults: Self::faults(),
            done: Vec::new(),
        }
    }

    /// The process's minor faults when the debug log will show them.
    fn faults() -> u64 {
        if log::log_enabled!(log::Level::Debug) {
            minor_faults()
        } else {
            0
        }
    }

    fn mark(&mut self, what: &'static str) {
        let now = std::time::Instant::now();
        let faults = Self::faults();
        self.done.push((
            what,
            now - self.last,
            faults.saturating_sub(self.last_faults),
        ));
        self.last = now;
        self.last_faults = faults;
    }
}

impl std::fmt::Display for Phases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "total_us={}", (self.last - self.start).as_micros())?;
        for (what, d, _) in &self.done {
            write!(f, " {what}_us={}", d.as_micros())?;
        }
        for (what, _, n) in &self.done {
            write!(f, " {what}_faults={n}")?;
        }
        Ok(())
    }
}

/// New devices, as the config asks.
struct BootDevices<'a> {
    config: &'a VmConfig,
    entry: EntryKind,
}

impl DeviceSource for BootDevices<'_> {
    type Error = VmError;

    fn serial(&mut self, irq_evt: EventFd) -> Result<Serial, AttachError> {
        Ok(Serial::new(irq_evt, self.config.serial.clone()))
    }

    fn console_input(&self) -> bool {
        self.config.console_input
    }

    fn i8042(&mut self, reset_evt: EventFd) -> Result<I8042, AttachError> {
        Ok(I8042::new(reset_evt))
    }

    fn virtio(&mut self) -> Result<Vec<VirtioSlot>, VmError> {
        let config = self.config;
        let mut out = Vec::new();
        for d in &config.disks {
            // A writable disk is a layered disk whose top is the user's file: guest
            // writes land in it, and snapshots copy only its data. With a base,
            // the top holds only what was written and the rest reads from it.
            let blk = if d.read_only {
                Block::new(BlockConfig {
                    path: d.path.clone(),
                    read_only: true,
                    id: d.id.clone(),
                })
                .map_err(|e| VmError::Disk(d.path.clone(), e))?
            } else {
                let base = d.base.iter().map(LayerFiles::raw).collect();
                let disk = LayeredDisk::open_file_over(base, &d.path)
                    .map_err(|e| VmError::LayeredDisk(d.path.clone(), e))?;
                Block::with_layered(Arc::new(disk), false, &d.id)
                    .map_err(|e| VmError::Disk(d.path.clone(), e))?
            };
            out.push(fresh(
                "virtio-blk",
                VirtioDev::Block(Arc::new(Mutex::new(blk))),
            ));
        }
        if let Some(v) = &config.vsock {
            let mut dev = Vsock::new(v.guest_cid, v.uds_path.clone()).map_err(VmError::Vsock)?;
            dev.set_max_connections(config.vsock_max_connections);
            out.push(fresh(
                "virtio-vsock",
                VirtioDev::Vsock(Arc::new(Mutex::new(dev))),
            ));
        }
        if config.rng {
            let dev = Rng::new().map_err(VmError::Rng)?;
            out.push(fresh(
                "virtio-rng",
                VirtioDev::Rng(Arc::new(Mutex::new(dev))),
            ));
        }
        if let Some(n) = &config.net {
            let tap = Tap::open(&n.tap)
                .map_err(|e| VmError::Net(devices::virtio::net::NetError::Tap(n.tap.clone(), e)))?;
            let dev = Net::new(tap, n.mac).map_err(VmError::Net)?;
            out.push(fresh(
                "virtio-net",
                VirtioDev::Net(Arc::new(Mutex::new(dev))),
            ));
        }
        Ok(out)
    }

    fn entry(&self) -> EntryKind {
        self.entry
    }
}

fn fresh(what: &'static str, dev: VirtioDev) -> VirtioSlot {
    VirtioSlot {
        what,
        dev,
        transport: None,
    }
}
