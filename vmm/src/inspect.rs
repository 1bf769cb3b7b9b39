//! What each vCPU of a VM is doing, for a watchdog that must tell a guest
//! that spins (its vCPUs enter `KVM_RUN` again and again) from a vCPU that
//! never runs (parked, or stuck in `KVM_RUN` without returning on a kick), and
//! say where the guest is (instruction pointer, interrupt flag, pending
//! events, the LAPIC's highest pending and in-service vectors and its timer).
//!
//! [`Vm::inspect_vcpus`] reads the counters of every vCPU thread without
//! stopping it; for the registers it pauses the VM (all or nothing, as
//! [`Vm::pause`]), reads each vCPU and resumes it. A vCPU that does not park
//! is reported with its counters only, and that itself is the evidence.

use serde::{Deserialize, Serialize};

use crate::arch::state::VcpuState;
use crate::run_state::VmRunState;
use crate::vcpu::VcpuStatsView;
use crate::Vm;

/// `IA32_TSC` and `IA32_TSC_DEADLINE`: the only MSRs an inspection reads.
const INSPECT_MSRS: [u32; 2] = [0x10, 0x6e0];

/// One vCPU as [`Vm::inspect_vcpus`] found it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuReport {
    pub index: u8,
    /// The thread is inside `KVM_RUN` now.
    pub in_kvm_run: bool,
    /// Times the thread entered `KVM_RUN`.
    pub kvm_run_entries: u64,
    /// The last exit it handled (`mmio-read`, `interrupted`, ...).
    pub last_exit: String,
    /// Since the thread last came back from `KVM_RUN`.
    pub since_last_return_ms: u64,
    /// The exit handled before the vCPU last parked (its access was
    /// completed by the parking `KVM_RUN`, see `vcpu`).
    pub parked_after: String,
    /// Further exits served while parking.
    pub park_exits: u64,
    /// The registers, if the vCPU parked for the inspection (or was parked).
    pub regs: Option<VcpuRegs>,
    /// Why there are no registers.
    pub note: Option<String>,
}

/// The part of a vCPU's state that says where it is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuRegs {
    pub rip: u64,
    pub rsp: u64,
    pub rflags: u64,
    pub cr0: u64,
    pub cr3: u64,
    pub cr4: u64,
    /// The privilege level (CS's DPL).
    pub cpl: u8,
    /// `KVM_MP_STATE_*`: 0 runnable, 1 uninitialized, 2 init received, 3 halted, 4 SIPI received.
    pub mp_state: u32,
    pub interrupt_injected: bool,
    pub interrupt_shadow: u8,
    pub nmi_pending: bool,
    pub nmi_injected: bool,
    pub exception_injected: bool,
    /// Highest vector pending in the LAPIC's IRR, and in service (ISR).
    pub lapic_irr: Option<u8>,
    pub lapic_isr: Option<u8>,
    /// LAPIC timer: LVT entry, initial and current count.
    pub lapic_lvtt: u32,
    pub lapic_tmict: u32,
    pub lapic_tmcct: u32,
    pub tsc: Option<u64>,
    pub tsc_deadline: Option<u64>,
}

fn lapic_reg(regs: &[std::os::raw::c_char], off: usize) -> u32 {
    let b = |i: usize| regs.get(off + i).map_or(0, |&c| c as u8);
    u32::from_le_bytes([b(0), b(1), b(2), b(3)])
}

/// Highest set vector of the 256-bit register whose eight 32-bit words start
/// at `base`, 16 bytes apart (the LAPIC's IRR and ISR layout).
fn highest_vector(regs: &[std::os::raw::c_char], base: usize) -> Option<u8> {
    (0..8usize).rev().find_map(|w| {
        let word = lapic_reg(regs, base + w * 0x10);
        (word != 0).then(|| (w * 32 + 31 - word.leading_zeros() as usize) as u8)
    })
}

impl VcpuRegs {
    fn of(s: &VcpuState) -> Self {
        let msr = |i: u32| s.msrs.iter().find(|m| m.index == i).map(|m| m.data);
        let l = &s.lapic.regs[..];
        Self {
            rip: s.regs.rip,
            rsp: s.regs.rsp,
            rflags: s.regs.rflags,
            cr0: s.sregs.cr0,
            cr3: s.sregs.cr3,
            cr4: s.sregs.cr4,
            cpl: s.sregs.cs.dpl,
            mp_state: s.mp_state.mp_state,
            interrupt_injected: s.events.interrupt.injected != 0,
            interrupt_shadow: s.events.interrupt.shadow,
            nmi_pending: s.events.nmi.pending != 0,
            nmi_injected: s.events.nmi.injected != 0,
            exception_injected: s.events.exception.injected != 0,
            lapic_irr: highest_vector(l, 0x200),
            lapic_isr: highest_vector(l, 0x100),
            lapic_lvtt: lapic_reg(l, 0x320),
            lapic_tmict: lapic_reg(l, 0x380),
            lapic_tmcct: lapic_reg(l, 0x390),
            tsc: msr(INSPECT_MSRS[0]),
            tsc_deadline: msr(INSPECT_MSRS[1]),
        }
    }
}

impl std::fmt::Display for VcpuReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "vcpu{} in_kvm_run={} entries={} last_exit={} since_return={}ms parked_after={} park_exits={}",
            self.index,
            self.in_kvm_run,
            self.kvm_run_entries,
            self.last_exit,
            self.since_last_return_ms,
            self.parked_after,
            self.park_exits
        )?;
        if let Some(r) = &self.regs {
            let vec = |v: Option<u8>| v.map_or("-".to_string(), |v| format!("{v:#x}"));
            write!(
                f,
                " rip={:#x} rsp={:#x} rflags={:#x} if={} cpl={} cr3={:#x} mp_state={} \
                 irq_injected={} shadow={} nmi_pending={} exc_injected={} irr={} isr={} \
                 lvtt={:#x} tmict={} tmcct={} tsc={} tsc_deadline={}",
                r.rip,
                r.rsp,
                r.rflags,
                (r.rflags >> 9) & 1,
                r.cpl,
                r.cr3,
                r.mp_state,
                r.interrupt_injected,
                r.interrupt_shadow,
                r.nmi_pending,
                r.exception_injected,
                vec(r.lapic_irr),
                vec(r.lapic_isr),
                r.lapic_lvtt,
                r.lapic_tmict,
                r.lapic_tmcct,
                r.tsc.map_or("-".into(), |v| v.to_string()),
                r.tsc_deadline.map_or("-".into(), |v| v.to_string()),
            )?;
        }
        if let Some(n) = &self.note {
            write!(f, " note=\"{n}\"")?;
        }
        Ok(())
    }
}

fn report(index: u8, s: VcpuStatsView) -> VcpuReport {
    VcpuReport {
        index,
        in_kvm_run: s.in_kvm_run,
        kvm_run_entries: s.entries,
        last_exit: s.last_exit.name().to_string(),
        since_last_return_ms: u64::try_from(s.since_last_return.as_millis()).unwrap_or(u64::MAX),
        parked_after: s.parked_after.name().to_string(),
        park_exits: s.park_exits,
        regs: None,
        note: None,
    }
}

impl Vm {
    /// Every vCPU's counters and, when the VM is not running or can be paused
    /// for a moment, its registers. A running VM is paused and resumed (its
    /// state stays `Running`); one that cannot be paused is left as
    /// [`Vm::pause`] leaves it, and the reports say which vCPU did not park.
    pub fn inspect_vcpus(&mut self) -> Vec<VcpuReport> {
        let mut out: Vec<VcpuReport> = self
            .vcpus
            .iter()
            .map(|v| report(v.index(), v.stats()))
            .collect();
        let state = self.state();
        let paused_here = match state {
            VmRunState::Running => match self.pause() {
                Ok(()) => true,
                Err(e) => {
                    let why = format!("could not pause for the registers: {e}");
                    for r in &mut out {
                        r.note = Some(why.clone());
                    }
                    return out;
                }
            },
            VmRunState::Created | VmRunState::Paused => false,
            other => {
                for r in &mut out {
                    r.note = Some(format!("no registers: {other}"));
                }
                return out;
            }
        };
        let msrs = std::sync::Arc::new(INSPECT_MSRS.to_vec());
        for (v, r) in self.vcpus.iter_mut().zip(&mut out) {
            match v.save_state(msrs.clone()) {
                Ok(s) => r.regs = Some(VcpuRegs::of(&s)),
                Err(e) => r.note = Some(format!("cannot read its state: {e}")),
            }
        }
        if paused_here {
            if let Err(e) = self.resume() {
                for r in &mut out {
                    r.note = Some(format!("the resume after the inspection failed: {e}"));
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lapic_vectors_are_read_from_their_words() {
        let mut regs = [0 as std::os::raw::c_char; 1024];
        assert_eq!(highest_vector(&regs, 0x200), None);
        // Vector 0x31 = word 1, bit 17; vector 0xec = word 7, bit 12.
        regs[0x210 + 2] = 0x02;
        assert_eq!(highest_vector(&regs, 0x200), Some(0x31));
        regs[0x270 + 1] = 0x10;
        assert_eq!(highest_vector(&regs, 0x200), Some(0xec));
        regs[0x380] = 0x34;
        regs[0x381] = 0x12;
        assert_eq!(lapic_reg(&regs, 0x380), 0x1234);
    }
}
