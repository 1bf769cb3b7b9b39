//! Everything about a VM that does not depend on what runs in it, made ahead
//! of time: the KVM VM with its irqchip and PIT, its vCPUs (with this host's
//! boot CPUID set), and guest memory slots registered over a reserved (still
//! empty) range of host memory.
//!
//! Registering a memory slot is the slowest step of building a VM on this
//! host's KVM (about 5–6 ms, whatever the size); a restore or fork into a
//! shell maps the snapshot over the reserved range instead, and KVM follows
//! the new mapping. A [`ShellPool`] keeps shells of one shape ready.

use std::sync::Mutex;

use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use snapshot::Reservation;

use crate::arch::state;
use crate::kvm::create_vm;
use crate::kvm::HostCaps;
use crate::layout;
use crate::memory;
use crate::vm::VmError;

/// A pre-built VM of a given shape, waiting for a snapshot to run.
pub struct VmShell {
    pub(crate) _kvm: Kvm,
    pub(crate) caps: HostCaps,
    /// Its vCPUs in index order, each with the CPUID set on it: the one a
    /// boot gives it.
    pub(crate) vcpu_fds: Vec<(VcpuFd, crate::arch::cpuid::Preset)>,
    pub(crate) msrs: Vec<u32>,
    pub(crate) vm: VmFd,
    pub(crate) reservation: Reservation,
    pub(crate) vcpus: u8,
    pub(crate) mem_bytes: u64,
}

impl VmShell {
    /// Builds a shell for `vcpus` vCPUs and `mem_mib` MiB of RAM.
    pub fn new(vcpus: u8, mem_mib: u64) -> Result<VmShell, VmError> {
        if vcpus == 0 || vcpus > layout::MAX_VCPUS {
            return Err(crate::config::ConfigError::Vcpus(vcpus).into());
        }
        if !(layout::MIN_MEM_MIB..=layout::MAX_MEM_MIB).contains(&mem_mib) {
            return Err(crate::config::ConfigError::Memory(mem_mib).into());
        }
        let mem_bytes = mem_mib << 20;
        let (kvm, caps, vm) = create_vm(vcpus)?;
        let reservation = Reservation::new(mem_bytes as usize)
            .map_err(|e| VmError::Memory(memory::MemoryError::Reserve(mem_bytes, e)))?;
        memory::register_range(&vm, reservation.as_ptr(), mem_bytes, true)?;
        let mut vcpu_fds = Vec::with_capacity(usize::from(vcpus));
        let supported = crate::arch::cpuid::supported(&kvm, caps)
            .map_err(|e| VmError::KvmOp("report supported CPUID", e))?;
        for i in 0..vcpus {
            let fd = vm
                .create_vcpu(u64::from(i))
                .map_err(|e| VmError::KvmOp("create a vCPU", e))?;
            // The boot CPUID, set now: setting a vCPU's CPUID is one of the
            // slowest steps of a restore on this host's KVM (~70 us), and a
            // boot, or a restore of a snapshot taken on this host, needs no
            // other (see `cpuid::same_after_restore`).
            let mut c = supported.clone();
            crate::arch::cpuid::for_vcpu(&mut c, i, vcpus);
            fd.set_cpuid2(&c)
                .map_err(|e| VmError::KvmOp("set CPUID", e))?;
            // What KVM made of it: some hosts' KVM fill in features of
            // their own (PVM adds the host's).
            let effective = fd
                .get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
                .map_err(|e| VmError::KvmOp("read CPUID", e))?;
            let preset = crate::arch::cpuid::Preset {
                given: c.as_slice().to_vec(),
                effective: effective.as_slice().to_vec(),
            };
            vcpu_fds.push((fd, preset));
        }
        let msrs = state::msr_list(&kvm)?;
        Ok(VmShell {
            _kvm: kvm,
            caps,
            vcpu_fds,
            msrs,
            vm,
            reservation,
            vcpus,
            mem_bytes,
        })
    }

    pub fn vcpus(&self) -> u8 {
        self.vcpus
    }

    pub fn mem_bytes(&self) -> u64 {
        self.mem_bytes
    }
}

/// Shells of one shape, made ahead of time.
pub struct ShellPool {
    vcpus: u8,
    mem_mib: u64,
    ready: Mutex<Vec<VmShell>>,
}

impl ShellPool {
    /// An empty pool for shells of this shape; [`ShellPool::fill`] adds some.
    pub fn new(vcpus: u8, mem_mib: u64) -> Self {
        Self {
            vcpus,
            mem_mib,
            ready: Mutex::new(Vec::new()),
        }
    }

    /// Builds shells until `n` are ready.
    pub fn fill(&self, n: usize) -> Result<(), VmError> {
        while self.len() < n {
            let s = VmShell::new(self.vcpus, self.mem_mib)?;
            devices::bus::lock(&self.ready).push(s);
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        devices::bus::lock(&self.ready).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A ready shell, or a new one if none is left.
    pub fn take(&self) -> Result<VmShell, VmError> {
        match devices::bus::lock(&self.ready).pop() {
            Some(s) => Ok(s),
            None => VmShell::new(self.vcpus, self.mem_mib),
        }
    }

    pub fn shape(&self) -> (u8, u64) {
        (self.vcpus, self.mem_mib)
    }
}
