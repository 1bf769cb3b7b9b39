//! Opening `/dev/kvm` and checking what the host KVM offers.

use kvm_bindings::kvm_pit_config;
use kvm_ioctls::{Cap, Kvm, VmFd};

/// Where KVM puts the TSS it needs for real-mode emulation: the top of the
/// 32-bit space, below the BIOS area, outside RAM.
const KVM_TSS_ADDRESS: usize = 0xfffb_d000;

#[derive(Debug, thiserror::Error)]
pub enum KvmError {
    #[error(
        "Cannot open /dev/kvm: Sprout needs KVM (load kvm_intel or kvm_amd, and run as a user with access to /dev/kvm)"
    )]
    Open(#[source] kvm_ioctls::Error),
    #[error("Host KVM API version is {0}, Sprout needs 12")]
    ApiVersion(i32),
    #[error("Host KVM lacks {0}, which Sprout needs")]
    MissingCap(&'static str),
    #[error("This host's KVM runs at most {0} vCPUs")]
    HostVcpus(usize),
    #[error("KVM refused to {0}")]
    Op(&'static str, #[source] kvm_ioctls::Error),
}

/// What the host KVM supports, probed once with `KVM_CHECK_EXTENSION`.
#[derive(Clone, Copy, Debug)]
pub struct HostCaps {
    /// In-kernel PIT (`KVM_CAP_PIT2`): optional, guests that need a PIT lose it.
    pub pit2: bool,
    /// Largest vCPU count KVM accepts (`KVM_CAP_MAX_VCPUS`).
    pub max_vcpus: usize,
    /// The in-kernel LAPIC has the TSC-deadline timer mode
    /// (`KVM_CAP_TSC_DEADLINE_TIMER`), which KVM's supported CPUID leaves out.
    pub tsc_deadline: bool,
}

/// Opens KVM and checks the capabilities the VMM cannot work without.
pub fn open() -> Result<(Kvm, HostCaps), KvmError> {
    let kvm = Kvm::new().map_err(KvmError::Open)?;
    let v = kvm.get_api_version();
    if v != 12 {
        return Err(KvmError::ApiVersion(v));
    }
    for (cap, name) in [
        (Cap::Irqchip, "KVM_CAP_IRQCHIP (in-kernel IOAPIC and LAPIC)"),
        (Cap::Irqfd, "KVM_CAP_IRQFD"),
        (Cap::Ioeventfd, "KVM_CAP_IOEVENTFD"),
        (Cap::UserMemory, "KVM_CAP_USER_MEMORY"),
        (Cap::ImmediateExit, "KVM_CAP_IMMEDIATE_EXIT"),
        (Cap::ExtCpuid, "KVM_CAP_EXT_CPUID"),
        (Cap::SetTssAddr, "KVM_CAP_SET_TSS_ADDR"),
    ] {
        if !kvm.check_extension(cap) {
            return Err(KvmError::MissingCap(name));
        }
    }
    let caps = HostCaps {
        pit2: kvm.check_extension(Cap::Pit2),
        max_vcpus: kvm.get_max_vcpus(),
        tsc_deadline: kvm.check_extension(Cap::TscDeadlineTimer),
    };
    Ok((kvm, caps))
}

/// Opens KVM and creates a VM for `vcpus` vCPUs with its in-kernel irqchip
/// (and PIT if the host has one).
pub fn create_vm(vcpus: u8) -> Result<(Kvm, HostCaps, VmFd), KvmError> {
    let (kvm, caps) = open()?;
    if usize::from(vcpus) > caps.max_vcpus {
        return Err(KvmError::HostVcpus(caps.max_vcpus));
    }
    let vm = kvm
        .create_vm()
        .map_err(|e| KvmError::Op("create a VM", e))?;
    vm.set_tss_address(KVM_TSS_ADDRESS)
        .map_err(|e| KvmError::Op("set the TSS address", e))?;
    vm.create_irq_chip()
        .map_err(|e| KvmError::Op("create the in-kernel irqchip", e))?;
    if caps.pit2 {
        let pit = kvm_pit_config {
            flags: kvm_bindings::KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        vm.create_pit2(pit)
            .map_err(|e| KvmError::Op("create the in-kernel PIT", e))?;
    } else {
        log::warn!("host KVM has no in-kernel PIT (KVM_CAP_PIT2): the guest runs without one");
    }
    Ok((kvm, caps, vm))
}
