//! Per-vCPU register state at boot: MSRs, FPU, general and segment registers
//! for 64-bit entry, and the LAPIC's local interrupt pins.

use kvm_bindings::{kvm_fpu, kvm_mp_state, kvm_msr_entry, kvm_regs, kvm_segment, Msrs};
use kvm_ioctls::VcpuFd;

use super::boot::{BOOT_GDT, CODE_SEL, DATA_SEL, TSS_SEL};
use super::kernel::EntryKind;
use crate::layout;

#[derive(Debug, thiserror::Error)]
pub enum RegsError {
    #[error("KVM refused {what} for vCPU {vcpu}")]
    Kvm {
        what: &'static str,
        vcpu: u8,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("KVM set {set} of {want} boot MSRs for vCPU {vcpu}")]
    Msrs { vcpu: u8, set: usize, want: usize },
}

const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;

const CR0_PE: u64 = 1 << 0;
const CR0_MP: u64 = 1 << 1;
const CR0_ET: u64 = 1 << 4;
const CR0_NE: u64 = 1 << 5;
const CR0_WP: u64 = 1 << 16;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

fn kvm(what: &'static str, vcpu: u8) -> impl FnOnce(kvm_ioctls::Error) -> RegsError {
    move |source| RegsError::Kvm { what, vcpu, source }
}

/// Sets every register a freshly created vCPU `index` needs to start `kind` at `entry`.
pub fn setup_vcpu(fd: &VcpuFd, index: u8, entry: u64, kind: EntryKind) -> Result<(), RegsError> {
    setup_msrs(fd, index)?;
    setup_fpu(fd, index)?;
    setup_lint(fd, index)?;
    if index == 0 || kind == EntryKind::Direct {
        setup_long_mode(fd, index, entry)?;
        if index != 0 {
            // Direct entry: this AP starts running now instead of waiting for SIPI.
            fd.set_mp_state(kvm_mp_state {
                mp_state: kvm_bindings::KVM_MP_STATE_RUNNABLE,
            })
            .map_err(kvm("MP state", index))?;
        }
    }
    Ok(())
}

fn setup_msrs(fd: &VcpuFd, index: u8) -> Result<(), RegsError> {
    let entries = [
        (MSR_IA32_SYSENTER_CS, 0),
        (MSR_IA32_SYSENTER_ESP, 0),
        (MSR_IA32_SYSENTER_EIP, 0),
        (MSR_STAR, 0),
        (MSR_CSTAR, 0),
        (MSR_KERNEL_GS_BASE, 0),
        (MSR_SYSCALL_MASK, 0),
        (MSR_LSTAR, 0),
        // Fast string operations on.
        (MSR_IA32_MISC_ENABLE, 1),
        // MTRRs on, default type write-back.
        (MSR_MTRR_DEF_TYPE, (1 << 11) | 6),
    ]
    .map(|(index, data)| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    });
    let msrs = Msrs::from_entries(&entries).map_err(|_| RegsError::Msrs {
        vcpu: index,
        set: 0,
        want: entries.len(),
    })?;
    let set = fd.set_msrs(&msrs).map_err(kvm("MSRs", index))?;
    if set != entries.len() {
        return Err(RegsError::Msrs {
            vcpu: index,
            set,
            want: entries.len(),
        });
    }
    Ok(())
}

fn setup_fpu(fd: &VcpuFd, index: u8) -> Result<(), RegsError> {
    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    fd.set_fpu(&fpu).map_err(kvm("FPU", index))
}

/// LINT0 as ExtINT (the legacy PIC path), LINT1 as NMI: what a PC firmware leaves.
fn setup_lint(fd: &VcpuFd, index: u8) -> Result<(), RegsError> {
    let mut lapic = fd.get_lapic().map_err(kvm("LAPIC read", index))?;
    for (reg, mode) in [(APIC_LVT0, APIC_MODE_EXTINT), (APIC_LVT1, APIC_MODE_NMI)] {
        let mut b = [0u8; 4];
        for (i, x) in b.iter_mut().enumerate() {
            *x = lapic.regs[reg + i] as u8;
        }
        let v = u32::from_le_bytes(b);
        let v = (v & !0x700) | (mode << 8);
        for (i, x) in v.to_le_bytes().iter().enumerate() {
            lapic.regs[reg + i] = *x as _;
        }
    }
    fd.set_lapic(&lapic).map_err(kvm("LAPIC", index))
}

fn segment(selector: u16) -> kvm_segment {
    let e = BOOT_GDT[usize::from(selector >> 3)];
    let limit = ((e & 0xffff) | ((e >> 32) & 0xf_0000)) as u32;
    let g = ((e >> 55) & 1) as u8;
    kvm_segment {
        base: 0,
        limit: if g == 1 { (limit << 12) | 0xfff } else { limit },
        selector,
        type_: ((e >> 40) & 0xf) as u8,
        present: ((e >> 47) & 1) as u8,
        dpl: ((e >> 45) & 3) as u8,
        db: ((e >> 54) & 1) as u8,
        s: ((e >> 44) & 1) as u8,
        l: ((e >> 53) & 1) as u8,
        g,
        avl: ((e >> 52) & 1) as u8,
        unusable: 0,
        padding: 0,
    }
}

/// 64-bit long mode with the boot GDT and page tables; RSI = zero page,
/// RDI = vCPU index.
fn setup_long_mode(fd: &VcpuFd, index: u8, entry: u64) -> Result<(), RegsError> {
    let mut sregs = fd
        .get_sregs()
        .map_err(kvm("segment registers read", index))?;
    sregs.gdt.base = layout::BOOT_GDT;
    sregs.gdt.limit = (BOOT_GDT.len() * 8 - 1) as u16;
    sregs.idt.base = layout::BOOT_IDT;
    sregs.idt.limit = 7;
    sregs.cs = segment(CODE_SEL);
    let data = segment(DATA_SEL);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = segment(TSS_SEL);
    sregs.cr3 = layout::PML4;
    sregs.cr4 = CR4_PAE;
    sregs.cr0 = CR0_PE | CR0_MP | CR0_ET | CR0_NE | CR0_WP | CR0_PG;
    sregs.efer = EFER_LME | EFER_LMA;
    fd.set_sregs(&sregs)
        .map_err(kvm("segment registers", index))?;
    let regs = kvm_regs {
        rflags: 0x2,
        rip: entry,
        rsp: layout::BOOT_STACK,
        rbp: layout::BOOT_STACK,
        rsi: layout::ZERO_PAGE,
        rdi: u64::from(index),
        ..Default::default()
    };
    fd.set_regs(&regs).map_err(kvm("registers", index))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_decode_from_the_gdt() {
        let cs = segment(CODE_SEL);
        assert_eq!((cs.l, cs.db, cs.type_, cs.s, cs.present), (1, 0, 0xb, 1, 1));
        assert_eq!(cs.limit, 0xffff_ffff);
        let ds = segment(DATA_SEL);
        assert_eq!((ds.l, ds.db, ds.type_), (0, 1, 3));
        let tr = segment(TSS_SEL);
        assert_eq!((tr.s, tr.type_), (0, 0xb));
    }
}
