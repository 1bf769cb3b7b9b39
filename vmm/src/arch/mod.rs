//! x86_64: CPUID, registers, MSRs and LAPIC set-up for each vCPU, and the boot
//! structures (GDT, page tables, zero page) the kernel starts with.

pub mod boot;
pub mod cpuid;
pub mod kernel;
pub mod mptable;
pub mod probe;
pub mod regs;
pub mod state;
