//! Capturing and restoring the architectural state of vCPUs and of the VM
//! (in-kernel irqchip, PIT, KVM clock) for snapshots.

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state,
    kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
    CpuId, Msrs, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("KVM refused to {what} vCPU {vcpu}")]
    Vcpu {
        what: &'static str,
        vcpu: u8,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("KVM refused to {0}")]
    Vm(&'static str, #[source] kvm_ioctls::Error),
    #[error("vCPU {0} is running: pause it first")]
    Running(u8),
    #[error("Saved state of vCPU {vcpu} has {n} {what}, more than KVM takes")]
    TooMany {
        vcpu: u8,
        n: usize,
        what: &'static str,
    },
    #[error("KVM took {set} of {want} MSRs of vCPU {vcpu} (first refused: {index:#x})")]
    Msrs {
        vcpu: u8,
        set: usize,
        want: usize,
        index: u32,
    },
}

/// Everything KVM holds for one vCPU.
#[derive(Serialize, Deserialize)]
pub struct VcpuState {
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub msrs: Vec<kvm_msr_entry>,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub xsave: kvm_xsave,
    pub xcrs: kvm_xcrs,
    pub lapic: kvm_lapic_state,
    pub events: kvm_vcpu_events,
    pub mp_state: kvm_mp_state,
    pub debugregs: kvm_debugregs,
}

/// The VM-wide KVM state.
#[derive(Clone, Serialize, Deserialize)]
pub struct VmArchState {
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
    pub pit: Option<kvm_pit_state2>,
    pub clock: kvm_clock_data,
}

/// Most CPUID entries and MSRs we keep per vCPU (KVM's own limits are lower).
const MAX_CPUID: usize = kvm_bindings::KVM_MAX_CPUID_ENTRIES;
const MAX_MSRS: usize = kvm_bindings::KVM_MAX_MSR_ENTRIES;

/// The MSRs worth saving: KVM's list of every MSR it lets us read and write.
pub fn msr_list(kvm: &Kvm) -> Result<Vec<u32>, StateError> {
    let l = kvm
        .get_msr_index_list()
        .map_err(|e| StateError::Vm("list MSRs", e))?;
    Ok(l.as_slice().to_vec())
}

fn vcpu_err(what: &'static str, vcpu: u8) -> impl FnOnce(kvm_ioctls::Error) -> StateError {
    move |source| StateError::Vcpu { what, vcpu, source }
}

/// Reads `indices`, dropping those KVM will not read (it stops at the first).
fn read_msrs(fd: &VcpuFd, vcpu: u8, indices: &[u32]) -> Result<Vec<kvm_msr_entry>, StateError> {
    let mut out = Vec::with_capacity(indices.len());
    for chunk in indices.chunks(MAX_MSRS) {
        let mut rest: Vec<u32> = chunk.to_vec();
        while !rest.is_empty() {
            let entries: Vec<_> = rest
                .iter()
                .map(|&index| kvm_msr_entry {
                    index,
                    ..Default::default()
                })
                .collect();
            let mut msrs = Msrs::from_entries(&entries).map_err(|_| StateError::TooMany {
                vcpu,
                n: entries.len(),
                what: "MSRs",
            })?;
            let n = fd
                .get_msrs(&mut msrs)
                .map_err(vcpu_err("read MSRs of", vcpu))?;
            out.extend_from_slice(&msrs.as_slice()[..n]);
            // Entry n (if any) is unreadable: skip it and go on after it.
            rest.drain(..(n + 1).min(rest.len()));
        }
    }
    Ok(out)
}

/// Captures vCPU `vcpu`'s state. The vCPU must not be running.
pub fn save_vcpu(fd: &VcpuFd, vcpu: u8, msr_indices: &[u32]) -> Result<VcpuState, StateError> {
    Ok(VcpuState {
        cpuid: fd
            .get_cpuid2(MAX_CPUID)
            .map_err(vcpu_err("read CPUID of", vcpu))?
            .as_slice()
            .to_vec(),
        msrs: read_msrs(fd, vcpu, msr_indices)?,
        regs: fd.get_regs().map_err(vcpu_err("read registers of", vcpu))?,
        sregs: fd
            .get_sregs()
            .map_err(vcpu_err("read segment registers of", vcpu))?,
        xsave: fd.get_xsave().map_err(vcpu_err("read XSAVE of", vcpu))?,
        xcrs: fd.get_xcrs().map_err(vcpu_err("read XCRs of", vcpu))?,
        lapic: fd
            .get_lapic()
            .map_err(vcpu_err("read the LAPIC of", vcpu))?,
        events: fd
            .get_vcpu_events()
            .map_err(vcpu_err("read events of", vcpu))?,
        mp_state: fd
            .get_mp_state()
            .map_err(vcpu_err("read MP state of", vcpu))?,
        debugregs: fd
            .get_debug_regs()
            .map_err(vcpu_err("read debug registers of", vcpu))?,
    })
}

/// Loads `s` into a freshly created vCPU (order matters: CPUID first, the
/// LAPIC after the APIC base in sregs, MSRs such as TSC-deadline after the
/// LAPIC, pending events last).
pub fn restore_vcpu(
    fd: &VcpuFd,
    vcpu: u8,
    s: &VcpuState,
    preset: Option<&super::cpuid::Preset>,
) -> Result<(), StateError> {
    // A shell's vCPU that has the boot CPUID of this host needs no other
    // when the snapshot's is that one (as running, see
    // `cpuid::same_after_restore`): KVM brings the few bits it derives
    // from the registers up to date as they are restored below.
    if preset.is_some_and(|p| super::cpuid::same_after_restore(&p.effective, &s.cpuid)) {
        log::debug!("vCPU {vcpu}: the shell's CPUID is the snapshot's");
    } else {
        let cpuid = CpuId::from_entries(&s.cpuid).map_err(|_| StateError::TooMany {
            vcpu,
            n: s.cpuid.len(),
            what: "CPUID entries",
        })?;
        fd.set_cpuid2(&cpuid)
            .map_err(vcpu_err("set CPUID of", vcpu))?;
    }
    fd.set_sregs(&s.sregs)
        .map_err(vcpu_err("set segment registers of", vcpu))?;
    fd.set_regs(&s.regs)
        .map_err(vcpu_err("set registers of", vcpu))?;
    // SAFETY: `s.xsave` is a plain kvm_xsave of the legacy 4 KiB size, which is
    // what KVM_SET_XSAVE reads; the kernel validates its contents.
    unsafe { fd.set_xsave(&s.xsave) }.map_err(vcpu_err("set XSAVE of", vcpu))?;
    fd.set_xcrs(&s.xcrs)
        .map_err(vcpu_err("set XCRs of", vcpu))?;
    fd.set_debug_regs(&s.debugregs)
        .map_err(vcpu_err("set debug registers of", vcpu))?;
    fd.set_lapic(&s.lapic)
        .map_err(vcpu_err("set the LAPIC of", vcpu))?;
    for chunk in s.msrs.chunks(MAX_MSRS) {
        let msrs = Msrs::from_entries(chunk).map_err(|_| StateError::TooMany {
            vcpu,
            n: chunk.len(),
            what: "MSRs",
        })?;
        let set = fd.set_msrs(&msrs).map_err(vcpu_err("set MSRs of", vcpu))?;
        if set != chunk.len() {
            return Err(StateError::Msrs {
                vcpu,
                set,
                want: chunk.len(),
                index: chunk[set].index,
            });
        }
    }
    fd.set_vcpu_events(&s.events)
        .map_err(vcpu_err("set events of", vcpu))?;
    fd.set_mp_state(s.mp_state)
        .map_err(vcpu_err("set MP state of", vcpu))?;
    Ok(())
}

fn irqchip(vm: &VmFd, chip_id: u32) -> Result<kvm_irqchip, StateError> {
    let mut c = kvm_irqchip {
        chip_id,
        ..Default::default()
    };
    vm.get_irqchip(&mut c)
        .map_err(|e| StateError::Vm("read the irqchip", e))?;
    Ok(c)
}

/// Captures the VM-wide state. Every vCPU must be paused.
pub fn save_vm(vm: &VmFd, has_pit: bool) -> Result<VmArchState, StateError> {
    Ok(VmArchState {
        pic_master: irqchip(vm, KVM_IRQCHIP_PIC_MASTER)?,
        pic_slave: irqchip(vm, KVM_IRQCHIP_PIC_SLAVE)?,
        ioapic: irqchip(vm, KVM_IRQCHIP_IOAPIC)?,
        pit: if has_pit {
            Some(
                vm.get_pit2()
                    .map_err(|e| StateError::Vm("read the PIT", e))?,
            )
        } else {
            None
        },
        clock: vm
            .get_clock()
            .map_err(|e| StateError::Vm("read the KVM clock", e))?,
    })
}

/// Loads the VM-wide state into a VM created with an irqchip (and a PIT if
/// the state has one), before its vCPUs run.
pub fn restore_vm(vm: &VmFd, s: &VmArchState) -> Result<(), StateError> {
    for c in [&s.pic_master, &s.pic_slave, &s.ioapic] {
        vm.set_irqchip(c)
            .map_err(|e| StateError::Vm("set the irqchip", e))?;
    }
    if let Some(p) = &s.pit {
        vm.set_pit2(p)
            .map_err(|e| StateError::Vm("set the PIT", e))?;
    }
    // Guest time continues from the snapshot's instant; only the value is
    // restored (the TSC-stable and realtime flags describe the old host).
    let clock = kvm_clock_data {
        clock: s.clock.clock,
        ..Default::default()
    };
    vm.set_clock(&clock)
        .map_err(|e| StateError::Vm("set the KVM clock", e))
}
