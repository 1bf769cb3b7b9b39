//! CPUID: KVM's supported set, made consistent per vCPU (APIC ids, topology,
//! the hypervisor bit).

use kvm_bindings::{kvm_cpuid_entry2, CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::Kvm;

use crate::kvm::HostCaps;

/// What a booted VM's vCPUs get on this host, before [`for_vcpu`] makes it
/// each one's: KVM's supported set with the host's extra features.
pub fn supported(kvm: &Kvm, caps: HostCaps) -> Result<CpuId, kvm_ioctls::Error> {
    let mut c = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)?;
    add_host_features(&mut c, caps);
    Ok(c)
}

/// The CPUID table a shell set on a vCPU it made ahead of time.
#[derive(Clone, Debug)]
pub struct Preset {
    /// The table given to `KVM_SET_CPUID2`: a boot giving the same needs
    /// to set none.
    pub given: Vec<kvm_cpuid_entry2>,
    /// The table `KVM_GET_CPUID2` read back: KVM may have filled in more
    /// (PVM does). A restore whose snapshot has this one, as running (see
    /// [`same_after_restore`]), needs to set none.
    pub effective: Vec<kvm_cpuid_entry2>,
}

/// Leaf 1 ECX bit 27: OSXSAVE, KVM's copy of CR4.OSXSAVE.
const ECX_OSXSAVE: u32 = 1 << 27;
/// Leaf 1 EDX bit 9: APIC, KVM's copy of the APIC base MSR's enable bit.
const EDX_APIC: u32 = 1 << 9;
/// Leaf 7 subleaf 0 ECX bit 4: OSPKE, KVM's copy of CR4.PKE.
const ECX_OSPKE: u32 = 1 << 4;

/// Whether CPUID entries `a` and `b` set on a vCPU give its guest the same
/// CPUID once its registers are restored. KVM rewrites a few bits of the
/// table from the vCPU's state whenever that state changes
/// (`kvm_update_cpuid_runtime`: OSXSAVE and OSPKE from CR4, APIC from the
/// APIC base MSR, leaf 0xd's XSAVE area sizes from XCR0 and XSS), so a
/// table read from a running vCPU differs from the one set at its boot in
/// exactly those; every other field, and the entries' number and order,
/// must be equal.
pub fn same_after_restore(a: &[kvm_cpuid_entry2], b: &[kvm_cpuid_entry2]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| masked(x) == masked(y))
}

fn masked(e: &kvm_cpuid_entry2) -> kvm_cpuid_entry2 {
    let mut e = *e;
    match (e.function, e.index) {
        (0x1, _) => {
            e.ecx &= !ECX_OSXSAVE;
            e.edx &= !EDX_APIC;
        }
        (0x7, 0) => e.ecx &= !ECX_OSPKE,
        (0xd, 0 | 1) => e.ebx = 0,
        _ => {}
    }
    e
}

/// Leaf 1 ECX bit 31: running under a hypervisor.
const ECX_HYPERVISOR: u32 = 1 << 31;
/// Leaf 1 ECX bit 24: the LAPIC timer has TSC-deadline mode.
const ECX_TSC_DEADLINE: u32 = 1 << 24;

/// Adds what the host KVM offers but `KVM_GET_SUPPORTED_CPUID` does not
/// report: the TSC-deadline timer (`KVM_CAP_TSC_DEADLINE_TIMER`, emulated by
/// the in-kernel LAPIC). Without it Linux calibrates its LAPIC timer against
/// the PIT and checks the PIT's interrupt through the IOAPIC at boot: ticks of
/// a 100 Hz timer waited for, 0.3-0.5 s of every boot in the lab
/// (docs/benchmarks.md). With it Linux uses neither the PIT nor a
/// calibration. The deadline itself (MSR 0x6e0) is in KVM's MSR list, so
/// snapshots keep it.
pub fn add_host_features(cpuid: &mut CpuId, caps: HostCaps) {
    if !caps.tsc_deadline {
        return;
    }
    for e in cpuid.as_mut_slice() {
        if e.function == 0x1 {
            e.ecx |= ECX_TSC_DEADLINE;
        }
    }
}
/// Leaf 1 EDX bit 28: HTT (the logical-processor count in EBX is valid).
const EDX_HTT: u32 = 1 << 28;

/// Adjusts the supported CPUID for vCPU `index` of `count`.
pub fn for_vcpu(cpuid: &mut CpuId, index: u8, count: u8) {
    complete_topology_leaves(cpuid);
    for e in cpuid.as_mut_slice() {
        match e.function {
            0x1 => {
                // EBX[31:24] initial APIC id, [23:16] logical processors, [15:8] CLFLUSH line size (in 8 bytes).
                e.ebx = (u32::from(index) << 24) | (u32::from(count) << 16) | (8 << 8);
                e.ecx |= ECX_HYPERVISOR;
                if count > 1 {
                    e.edx |= EDX_HTT;
                } else {
                    e.edx &= !EDX_HTT;
                }
            }
            0x4 => {
                // Deterministic cache parameters: EAX[31:26] = cores per package - 1.
                e.eax = (e.eax & 0x03ff_ffff) | ((u32::from(count).saturating_sub(1)) << 26);
            }
            0xb | 0x1f => {
                // Extended topology: one thread per core, `count` cores. EDX = x2APIC id.
                e.edx = u32::from(index);
                match e.index {
                    0 => {
                        e.eax = 0;
                        e.ebx = 1;
                        e.ecx = 1 << 8; // level 0: SMT
                    }
                    1 => {
                        e.eax = 8u32.min(u32::BITS - u32::from(count).leading_zeros());
                        e.ebx = u32::from(count);
                        e.ecx = (2 << 8) | 1; // level 1: core
                    }
                    _ => {
                        e.eax = 0;
                        e.ebx = 0;
                        e.ecx = e.index & 0xff;
                    }
                }
            }
            0x8000_0001 => {
                // AMD: CmpLegacy (ECX bit 1) only with more than one core.
                if count > 1 {
                    e.ecx |= 1 << 1;
                } else {
                    e.ecx &= !(1 << 1);
                }
            }
            0x8000_0008 => {
                // ECX[7:0] = cores - 1.
                e.ecx = (e.ecx & !0xff) | u32::from(count.saturating_sub(1));
            }
            _ => {}
        }
    }
}

/// KVM reports leaf 0xb (and 0x1f) with subleaf 0 only ("no topology"):
/// without subleaf 1 Linux finds no core level and puts every vCPU in a
/// package of its own. Make sure subleaves 0-2 exist (2 ends the list);
/// `for_vcpu` fills them in.
fn complete_topology_leaves(cpuid: &mut CpuId) {
    let max_basic = cpuid
        .as_slice()
        .iter()
        .find(|e| e.function == 0)
        .map_or(0, |e| e.eax);
    for leaf in [0xb, 0x1f] {
        let present = cpuid.as_slice().iter().any(|e| e.function == leaf);
        if leaf > max_basic || (leaf == 0x1f && !present) {
            continue;
        }
        for sub in 0..3 {
            let have = cpuid
                .as_slice()
                .iter()
                .any(|e| e.function == leaf && e.index == sub);
            if !have {
                // A full FAM (KVM_MAX_CPUID_ENTRIES) cannot grow: then Linux
                // simply sees a flat topology.
                let _ = cpuid.push(kvm_bindings::kvm_cpuid_entry2 {
                    function: leaf,
                    index: sub,
                    flags: kvm_bindings::KVM_CPUID_FLAG_SIGNIFCANT_INDEX,
                    ..Default::default()
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    #[test]
    fn tables_differing_only_in_runtime_bits_are_the_same_after_restore() {
        let boot = [
            kvm_cpuid_entry2 {
                function: 1,
                ecx: 0x0020_0001,
                edx: EDX_APIC | 1,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 7,
                flags: kvm_bindings::KVM_CPUID_FLAG_SIGNIFCANT_INDEX,
                ecx: 0x10_0000,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 0xd,
                flags: kvm_bindings::KVM_CPUID_FLAG_SIGNIFCANT_INDEX,
                eax: 7,
                ebx: 576,
                ecx: 2696,
                ..Default::default()
            },
        ];
        // Read from a running guest: CR4.OSXSAVE and .PKE set, XCR0 grown.
        let mut running = boot;
        running[0].ecx |= ECX_OSXSAVE;
        running[1].ecx |= ECX_OSPKE;
        running[2].ebx = 832;
        assert!(same_after_restore(&boot, &running));
        assert!(same_after_restore(&running, &boot));

        // Anything else differs.
        let mut other = running;
        other[0].ecx |= 1 << 5;
        assert!(!same_after_restore(&boot, &other));
        let mut other = running;
        other[2].ecx = 1000;
        assert!(!same_after_restore(&boot, &other));
        let mut other = running;
        other[1].eax = 1;
        assert!(!same_after_restore(&boot, &other));
        let mut other = running;
        other[2].index = 2;
        assert!(!same_after_restore(&boot, &other));
        assert!(!same_after_restore(&boot, &running[..2]));
        let swapped = [running[1], running[0], running[2]];
        assert!(!same_after_restore(&boot, &swapped));
    }

    #[test]
    fn topology_leaf_gets_its_core_level() {
        // What KVM reports: leaf 0xb, subleaf 0, all zero.
        let mut c = CpuId::from_entries(&[
            kvm_cpuid_entry2 {
                function: 0,
                eax: 0xd,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 0xb,
                flags: kvm_bindings::KVM_CPUID_FLAG_SIGNIFCANT_INDEX,
                ..Default::default()
            },
        ])
        .unwrap();
        for_vcpu(&mut c, 1, 2);
        let sub = |i: u32| {
            *c.as_slice()
                .iter()
                .find(|e| e.function == 0xb && e.index == i)
                .unwrap()
        };
        assert_eq!(
            (sub(0).ebx, (sub(0).ecx >> 8) & 0xff),
            (1, 1),
            "SMT level: 1 thread"
        );
        assert_eq!(
            (sub(1).ebx, (sub(1).ecx >> 8) & 0xff),
            (2, 2),
            "core level: 2 cores"
        );
        assert!(sub(1).eax >= 1, "APIC id bits for 2 cores");
        assert_eq!((sub(2).ecx >> 8) & 0xff, 0, "end of the list");
        assert!([0, 1, 2].iter().all(|&i| sub(i).edx == 1), "x2APIC id");
        assert!(
            !c.as_slice().iter().any(|e| e.function == 0x1f),
            "0x1f not invented"
        );
    }

    #[test]
    fn apic_id_and_count_per_vcpu() {
        let mut c = CpuId::from_entries(&[
            kvm_cpuid_entry2 {
                function: 1,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 0xb,
                index: 1,
                ..Default::default()
            },
        ])
        .unwrap();
        for_vcpu(&mut c, 3, 4);
        let s = c.as_slice();
        assert_eq!(s[0].ebx >> 24, 3);
        assert_eq!((s[0].ebx >> 16) & 0xff, 4);
        assert_ne!(s[0].ecx & ECX_HYPERVISOR, 0);
        assert_eq!(s[1].edx, 3);
        assert_eq!(s[1].ebx, 4);
    }

    #[test]
    fn tsc_deadline_only_when_the_host_has_it() {
        let leaf1 = |caps: HostCaps| {
            let mut c = CpuId::from_entries(&[kvm_cpuid_entry2 {
                function: 1,
                ecx: 1,
                ..Default::default()
            }])
            .unwrap();
            add_host_features(&mut c, caps);
            c.as_slice()[0].ecx
        };
        let caps = |tsc_deadline| HostCaps {
            pit2: true,
            max_vcpus: 8,
            tsc_deadline,
        };
        assert_eq!(leaf1(caps(true)), 1 | ECX_TSC_DEADLINE);
        assert_eq!(leaf1(caps(false)), 1);
    }
}
