//! The `ioctl` requests each thread kind of a jailed worker may make, by
//! exact request number (arg 1 of `ioctl`), not by the request's type byte:
//! a thread may issue only the KVM and userfaultfd requests the VMM really
//! issues from it (found in `vmm/src` and the `kvm-ioctls` methods it calls,
//! then confirmed by running every worker path under these filters, see
//! `worker/tests/jail.rs`).
//!
//! The numbers are computed as `linux/ioctl.h` does, from the sizes of the
//! `kvm-bindings` structures the requests carry, so a request with the right
//! type and number but another argument size is refused too.

use std::mem::size_of;

use kvm_bindings as kb;

const KVMIO: u64 = 0xAE;
const UFFDIO: u64 = 0xAA;

const fn ioc(dir: u64, ty: u64, nr: u64, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | (ty << 8) | nr
}
const fn io(ty: u64, nr: u64) -> u64 {
    ioc(0, ty, nr, 0)
}
const fn iow(ty: u64, nr: u64, size: usize) -> u64 {
    ioc(1, ty, nr, size)
}
const fn ior(ty: u64, nr: u64, size: usize) -> u64 {
    ioc(2, ty, nr, size)
}
const fn iowr(ty: u64, nr: u64, size: usize) -> u64 {
    ioc(3, ty, nr, size)
}

// /dev/kvm (system) requests.
pub const KVM_GET_API_VERSION: u64 = io(KVMIO, 0x00);
pub const KVM_CREATE_VM: u64 = io(KVMIO, 0x01);
pub const KVM_GET_MSR_INDEX_LIST: u64 = iowr(KVMIO, 0x02, size_of::<kb::kvm_msr_list>());
pub const KVM_CHECK_EXTENSION: u64 = io(KVMIO, 0x03);
pub const KVM_GET_VCPU_MMAP_SIZE: u64 = io(KVMIO, 0x04);
pub const KVM_GET_SUPPORTED_CPUID: u64 = iowr(KVMIO, 0x05, size_of::<kb::kvm_cpuid2>());
// VM requests.
pub const KVM_CREATE_VCPU: u64 = io(KVMIO, 0x41);
pub const KVM_GET_DIRTY_LOG: u64 = iow(KVMIO, 0x42, size_of::<kb::kvm_dirty_log>());
pub const KVM_SET_USER_MEMORY_REGION: u64 =
    iow(KVMIO, 0x46, size_of::<kb::kvm_userspace_memory_region>());
pub const KVM_SET_TSS_ADDR: u64 = io(KVMIO, 0x47);
/// Not used by the VMM: the test of a refused request of KVM's type.
pub const KVM_SET_IDENTITY_MAP_ADDR: u64 = iow(KVMIO, 0x48, size_of::<u64>());
pub const KVM_CREATE_IRQCHIP: u64 = io(KVMIO, 0x60);
pub const KVM_GET_IRQCHIP: u64 = iowr(KVMIO, 0x62, size_of::<kb::kvm_irqchip>());
pub const KVM_SET_IRQCHIP: u64 = ior(KVMIO, 0x63, size_of::<kb::kvm_irqchip>());
pub const KVM_IRQFD: u64 = iow(KVMIO, 0x76, size_of::<kb::kvm_irqfd>());
pub const KVM_CREATE_PIT2: u64 = iow(KVMIO, 0x77, size_of::<kb::kvm_pit_config>());
pub const KVM_IOEVENTFD: u64 = iow(KVMIO, 0x79, size_of::<kb::kvm_ioeventfd>());
pub const KVM_SET_CLOCK: u64 = iow(KVMIO, 0x7b, size_of::<kb::kvm_clock_data>());
pub const KVM_GET_CLOCK: u64 = ior(KVMIO, 0x7c, size_of::<kb::kvm_clock_data>());
pub const KVM_GET_PIT2: u64 = ior(KVMIO, 0x9f, size_of::<kb::kvm_pit_state2>());
pub const KVM_SET_PIT2: u64 = iow(KVMIO, 0xa0, size_of::<kb::kvm_pit_state2>());
// vCPU requests.
pub const KVM_RUN: u64 = io(KVMIO, 0x80);
pub const KVM_GET_REGS: u64 = ior(KVMIO, 0x81, size_of::<kb::kvm_regs>());
pub const KVM_SET_REGS: u64 = iow(KVMIO, 0x82, size_of::<kb::kvm_regs>());
pub const KVM_GET_SREGS: u64 = ior(KVMIO, 0x83, size_of::<kb::kvm_sregs>());
pub const KVM_SET_SREGS: u64 = iow(KVMIO, 0x84, size_of::<kb::kvm_sregs>());
pub const KVM_GET_MSRS: u64 = iowr(KVMIO, 0x88, size_of::<kb::kvm_msrs>());
pub const KVM_SET_MSRS: u64 = iow(KVMIO, 0x89, size_of::<kb::kvm_msrs>());
pub const KVM_SET_FPU: u64 = iow(KVMIO, 0x8d, size_of::<kb::kvm_fpu>());
pub const KVM_GET_LAPIC: u64 = ior(KVMIO, 0x8e, size_of::<kb::kvm_lapic_state>());
pub const KVM_SET_LAPIC: u64 = iow(KVMIO, 0x8f, size_of::<kb::kvm_lapic_state>());
pub const KVM_SET_CPUID2: u64 = iow(KVMIO, 0x90, size_of::<kb::kvm_cpuid2>());
pub const KVM_GET_CPUID2: u64 = iowr(KVMIO, 0x91, size_of::<kb::kvm_cpuid2>());
pub const KVM_GET_MP_STATE: u64 = ior(KVMIO, 0x98, size_of::<kb::kvm_mp_state>());
pub const KVM_SET_MP_STATE: u64 = iow(KVMIO, 0x99, size_of::<kb::kvm_mp_state>());
pub const KVM_GET_VCPU_EVENTS: u64 = ior(KVMIO, 0x9f, size_of::<kb::kvm_vcpu_events>());
pub const KVM_SET_VCPU_EVENTS: u64 = iow(KVMIO, 0xa0, size_of::<kb::kvm_vcpu_events>());
pub const KVM_GET_DEBUGREGS: u64 = ior(KVMIO, 0xa1, size_of::<kb::kvm_debugregs>());
pub const KVM_SET_DEBUGREGS: u64 = iow(KVMIO, 0xa2, size_of::<kb::kvm_debugregs>());
pub const KVM_GET_XSAVE: u64 = ior(KVMIO, 0xa4, size_of::<kb::kvm_xsave>());
pub const KVM_SET_XSAVE: u64 = iow(KVMIO, 0xa5, size_of::<kb::kvm_xsave>());
pub const KVM_GET_XCRS: u64 = ior(KVMIO, 0xa6, size_of::<kb::kvm_xcrs>());
pub const KVM_SET_XCRS: u64 = iow(KVMIO, 0xa7, size_of::<kb::kvm_xcrs>());

// userfaultfd requests (`linux/userfaultfd.h`).
/// On a `/dev/userfaultfd` descriptor: a new userfaultfd.
pub const USERFAULTFD_IOC_NEW: u64 = io(UFFDIO, 0x00);
pub const UFFDIO_REGISTER: u64 = iowr(UFFDIO, 0x00, 32);
pub const UFFDIO_UNREGISTER: u64 = ior(UFFDIO, 0x01, 16);
pub const UFFDIO_WAKE: u64 = ior(UFFDIO, 0x02, 16);
pub const UFFDIO_COPY: u64 = iowr(UFFDIO, 0x03, 40);
pub const UFFDIO_ZEROPAGE: u64 = iowr(UFFDIO, 0x04, 32);
pub const UFFDIO_API: u64 = iowr(UFFDIO, 0x3f, 24);

// Others.
pub const FIONBIO: u64 = 0x5421;
pub const FIOCLEX: u64 = 0x5451;
/// Snapshots map a file's extents to copy only its data.
pub const FS_IOC_FIEMAP: u64 = 0xc020_660b;

// /dev/net/tun requests (`linux/if_tun.h`, type 'T').
const TUNIO: u64 = b'T' as u64;
/// Attaches to the sandbox's TAP (made by the jail, owned by its uid).
pub const TUNSETIFF: u64 = iow(TUNIO, 202, size_of::<libc::c_int>());
pub const TUNSETPERSIST: u64 = iow(TUNIO, 203, size_of::<libc::c_int>());
pub const TUNSETOWNER: u64 = iow(TUNIO, 204, size_of::<libc::c_int>());
pub const TUNSETGROUP: u64 = iow(TUNIO, 206, size_of::<libc::c_int>());
/// The offloads the guest's driver took, set as the net device activates
/// (on the vCPU thread whose MMIO write activated it, or on the owner in a
/// restore).
pub const TUNSETOFFLOAD: u64 = iow(TUNIO, 208, size_of::<libc::c_uint>());
pub const TUNSETVNETHDRSZ: u64 = iow(TUNIO, 216, size_of::<libc::c_int>());

/// `sprout-vcpuN`: KVM_RUN; the registers it reads when an exit fails
/// (`vmm::vcpu`); the state it reads for a snapshot while parked
/// (`vmm::arch::state::save_vcpu`). Restores and boots set vCPU state on
/// the owner thread, before the vCPU threads start.
pub const VCPU: &[u64] = &[
    KVM_RUN,
    KVM_GET_REGS,
    KVM_GET_SREGS,
    KVM_GET_MSRS,
    KVM_GET_CPUID2,
    KVM_GET_XSAVE,
    KVM_GET_XCRS,
    KVM_GET_LAPIC,
    KVM_GET_VCPU_EVENTS,
    KVM_GET_MP_STATE,
    KVM_GET_DEBUGREGS,
    TUNSETOFFLOAD,
];

/// `sprout-uffd`: answers faults (COPY, ZEROPAGE, WAKE) and, as it ends,
/// unregisters guest RAM (`snapshot::uffd::server`, `close`).
pub const UFFD: &[u64] = &[UFFDIO_COPY, UFFDIO_ZEROPAGE, UFFDIO_WAKE, UFFDIO_UNREGISTER];

/// `sprout-ctl`, `sprout-conn`, `sprout-exitwatch` and `sprout-events`:
/// non-blocking and close-on-exec sockets (accepted vsock connections).
pub const SOCKETS: &[u64] = &[FIONBIO, FIOCLEX];

/// The owner's own requests: KVM's system calls (`vmm::kvm`, `VmShell`),
/// making the VM, its memory, irqchip, PIT, irqfds and ioeventfds
/// (`vmm::builder`, `memory`, `vm_devices`), dirty logs (diff snapshots),
/// the VM-wide state saved and restored (`vmm::arch::state`), the vCPU
/// state set on a boot (`vmm::arch::regs`) and a restore (before its
/// threads start), a userfaultfd made, registered and prefetched
/// (`snapshot::uffd`), and FIEMAP on snapshot files. Its filter is this and
/// every kind above ([`owner`]): its threads start under it.
const OWNER_OWN: &[u64] = &[
    KVM_GET_API_VERSION,
    KVM_CREATE_VM,
    KVM_GET_MSR_INDEX_LIST,
    KVM_CHECK_EXTENSION,
    KVM_GET_VCPU_MMAP_SIZE,
    KVM_GET_SUPPORTED_CPUID,
    KVM_CREATE_VCPU,
    KVM_GET_DIRTY_LOG,
    KVM_SET_USER_MEMORY_REGION,
    KVM_SET_TSS_ADDR,
    KVM_CREATE_IRQCHIP,
    KVM_GET_IRQCHIP,
    KVM_SET_IRQCHIP,
    KVM_IRQFD,
    KVM_CREATE_PIT2,
    KVM_IOEVENTFD,
    KVM_SET_CLOCK,
    KVM_GET_CLOCK,
    KVM_GET_PIT2,
    KVM_SET_PIT2,
    KVM_SET_REGS,
    KVM_SET_SREGS,
    KVM_SET_MSRS,
    KVM_SET_FPU,
    KVM_SET_LAPIC,
    KVM_SET_CPUID2,
    KVM_SET_MP_STATE,
    KVM_SET_VCPU_EVENTS,
    KVM_SET_DEBUGREGS,
    KVM_SET_XSAVE,
    KVM_SET_XCRS,
    USERFAULTFD_IOC_NEW,
    UFFDIO_API,
    UFFDIO_REGISTER,
    FS_IOC_FIEMAP,
    // A boot's or restore's virtio-net device opens the TAP by name.
    TUNSETIFF,
    TUNSETVNETHDRSZ,
];

/// The owner's requests: its own and those of every thread kind it starts.
pub fn owner() -> Vec<u64> {
    let mut v: Vec<u64> = [OWNER_OWN, VCPU, UFFD, SOCKETS].concat();
    v.sort_unstable();
    v.dedup();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The numbers `linux/kvm.h` gives (x86_64), and those of
    /// `userfaultfd-sys`: the sizes above are the kernel's.
    #[test]
    fn the_request_numbers_are_the_kernels() {
        for (got, want) in [
            (KVM_GET_SUPPORTED_CPUID, 0xc008_ae05),
            (KVM_SET_USER_MEMORY_REGION, 0x4020_ae46),
            (KVM_GET_IRQCHIP, 0xc208_ae62),
            (KVM_CREATE_PIT2, 0x4040_ae77),
            (KVM_GET_PIT2, 0x8070_ae9f),
            (KVM_RUN, 0xae80),
            (KVM_GET_REGS, 0x8090_ae81),
            (KVM_SET_SREGS, 0x4138_ae84),
            (KVM_GET_MSRS, 0xc008_ae88),
            (KVM_SET_FPU, 0x41a0_ae8d),
            (KVM_GET_LAPIC, 0x8400_ae8e),
            (KVM_GET_VCPU_EVENTS, 0x8040_ae9f),
            (KVM_SET_VCPU_EVENTS, 0x4040_aea0),
            (KVM_GET_XSAVE, 0x9000_aea4),
            (KVM_SET_XCRS, 0x4188_aea7),
            (UFFDIO_API, 0xc018_aa3f),
            (UFFDIO_REGISTER, 0xc020_aa00),
            (UFFDIO_UNREGISTER, 0x8010_aa01),
            (UFFDIO_WAKE, 0x8010_aa02),
            (UFFDIO_COPY, 0xc028_aa03),
            (UFFDIO_ZEROPAGE, 0xc020_aa04),
            (TUNSETIFF, 0x4004_54ca),
            (TUNSETPERSIST, 0x4004_54cb),
            (TUNSETOWNER, 0x4004_54cc),
            (TUNSETGROUP, 0x4004_54ce),
            (TUNSETOFFLOAD, 0x4004_54d0),
            (TUNSETVNETHDRSZ, 0x4004_54d8),
        ] {
            assert_eq!(got, want, "{got:#x} != {want:#x}");
        }
    }

    #[test]
    fn each_kind_gets_only_its_own() {
        let owner = owner();
        for r in [VCPU, UFFD, SOCKETS].concat() {
            assert!(owner.contains(&r), "{r:#x} not in the owner's list");
        }
        // A vCPU thread makes no VM, memory or vCPU-state changes; the uffd
        // thread makes no new userfaultfd and registers nothing.
        for r in [KVM_CREATE_VCPU, KVM_SET_USER_MEMORY_REGION, KVM_SET_REGS] {
            assert!(!VCPU.contains(&r), "{r:#x}");
        }
        for r in [USERFAULTFD_IOC_NEW, UFFDIO_API, UFFDIO_REGISTER] {
            assert!(!UFFD.contains(&r), "{r:#x}");
        }
        assert!(!owner.contains(&KVM_SET_IDENTITY_MAP_ADDR));
    }
}
