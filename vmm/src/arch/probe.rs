//! Can this host's KVM run a Linux guest? Measured, not guessed.
//!
//! Some hosts expose `/dev/kvm` from a hypervisor that runs guest user mode
//! natively but only emulates guest supervisor mode, and some supervisor
//! instructions and exceptions it cannot emulate at all (see `../shared/HOST.md`:
//! a stock Linux dies there at `cmpxchg16b`, at XSAVE set-up, and on any
//! exception taken in ring 0). On such a host a Linux guest would crawl for
//! seconds and then stop with `KVM_EXIT_INTERNAL_ERROR`.
//!
//! [`check_linux_guests`] finds out with a throwaway VM: one vCPU set up exactly
//! as the Linux boot path sets up vCPU 0 (same CPUID, MSRs, FPU, long mode and
//! boot tables) runs seven instructions in ring 0 that every Linux boot depends
//! on: a `lock cmpxchg16b` (SLUB's double-word cmpxchg) and an `int3` caught by
//! its IDT (text patching, `BUG()`), whose handler reports the cmpxchg result
//! on an I/O port. Real KVM (hardware virtualization) gives that port write;
//! anything else (an internal error, a triple fault, a wrong value) is the
//! answer "no". It costs about one small VM creation (about 10 ms on this
//! project's software KVM, where each memory-slot registration alone takes
//! 5-6 ms; about 1 ms on hardware virtualization) and its result is cached
//! for the life of the process.

use std::sync::OnceLock;

use devices::virtio::GuestMemoryMmap;
use kvm_bindings::{kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::VcpuExit;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use super::boot::{self, CODE_SEL};
use super::kernel::EntryKind;
use super::{cpuid, regs};
use crate::{kvm, layout};

/// Where KVM puts the TSS it needs for real-mode emulation (as in `vm.rs`).
const KVM_TSS_ADDRESS: usize = 0xfffb_d000;
/// The probe code (the page after the boot page tables), its `int3` handler
/// and its 16-byte-aligned data word.
const CODE: u64 = layout::PD + layout::PAGE_SIZE;
const HANDLER: u64 = CODE + 0x100;
const DATA: u64 = CODE + 0x200;
/// The port the handler reports on (no device of ours, never served in-kernel).
const PORT: u16 = 0xf4;
/// What `cmpxchg16b` stores and the handler reports.
const MAGIC: u8 = 0x5a;
/// `#BP` is vector 3: the IDT needs entries 0-3 (16 bytes each in long mode).
const IDT_ENTRIES: u64 = 4;
/// The probe's guest RAM: the boot tables and the code page (KVM's cost of
/// registering memory grows with its size on some hosts: keep it small).
const PROBE_RAM: u64 = CODE + layout::PAGE_SIZE;

#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProbeError {
    #[error(
        "This host's KVM cannot run Linux guests: {0}. Its /dev/kvm does not execute guest \
         kernel (ring 0) code the way hardware virtualization does, so a Linux guest would stall \
         and die. Sprout runs Linux guests on hosts with hardware virtualization (Intel VT-x or \
         AMD-V, on bare metal or a cloud VM with nested virtualization). On this machine, run \
         Linux guests inside the emulated lab: tests/lab/build.sh, then tests/lab/run.sh SCRIPT \
         (see docs/guest.md); the test guest (--kernel testguest) runs here directly"
    )]
    Unsupported(String),
    #[error("Cannot probe KVM ({0})")]
    Setup(String),
}

/// Whether this host's KVM can run a Linux guest; probed once per process.
pub fn check_linux_guests() -> Result<(), ProbeError> {
    static ANSWER: OnceLock<Result<(), ProbeError>> = OnceLock::new();
    ANSWER.get_or_init(probe).clone()
}

// The probe's layout: code after the boot page tables, a 16-byte aligned
// operand for cmpxchg16b, an IDT clear of the boot GDT and the page tables.
const _: () = {
    assert!(CODE >= layout::PD + layout::PAGE_SIZE);
    assert!(DATA & 15 == 0);
    assert!(DATA + 16 <= PROBE_RAM);
    assert!(layout::BOOT_IDT >= layout::BOOT_GDT + boot::BOOT_GDT.len() as u64 * 8);
    assert!(layout::BOOT_IDT + IDT_ENTRIES * 16 <= layout::ZERO_PAGE);
};

fn setup<E: std::fmt::Display>(what: &'static str) -> impl FnOnce(E) -> ProbeError {
    move |e| ProbeError::Setup(format!("{what}: {e}"))
}

/// The probe's machine code at [`CODE`] and [`HANDLER`].
fn code() -> (Vec<u8>, Vec<u8>) {
    let data = (DATA as u32).to_le_bytes();
    let mut main = vec![
        0x31, 0xc0, // xor eax, eax      \ RDX:RAX = 0 = the data word, so
        0x31, 0xd2, // xor edx, edx      / cmpxchg16b stores RCX:RBX
        0xbb, MAGIC, 0, 0, 0, // mov ebx, MAGIC
        0x31, 0xc9, // xor ecx, ecx
        0xf0, 0x48, 0x0f, 0xc7, 0x0c, 0x25, // lock cmpxchg16b [DATA]
    ];
    main.extend_from_slice(&data);
    main.push(0xcc); // int3
    main.extend_from_slice(&[0xeb, 0xfe]); // jmp $ (not reached)
    let mut handler = vec![0x8a, 0x04, 0x25]; // mov al, [DATA]
    handler.extend_from_slice(&data);
    handler.extend_from_slice(&[0xe6, PORT as u8]); // out PORT, al
    handler.extend_from_slice(&[0xf4, 0xeb, 0xfd]); // 1: hlt; jmp 1b
    (main, handler)
}

/// A 64-bit interrupt gate (present, ring 0) to `handler`.
fn idt_gate(handler: u64) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[0..2].copy_from_slice(&(handler as u16).to_le_bytes());
    g[2..4].copy_from_slice(&CODE_SEL.to_le_bytes());
    g[5] = 0x8e;
    g[6..8].copy_from_slice(&((handler >> 16) as u16).to_le_bytes());
    g[8..12].copy_from_slice(&((handler >> 32) as u32).to_le_bytes());
    g
}

fn write_guest(mem: &GuestMemoryMmap) -> Result<(), vm_memory::GuestMemoryError> {
    let (main, handler) = code();
    mem.write_slice(&main, GuestAddress(CODE))?;
    mem.write_slice(&handler, GuestAddress(HANDLER))?;
    mem.write_slice(&[0u8; 16], GuestAddress(DATA))?;
    for v in 0..IDT_ENTRIES {
        let gate = if v == 3 { idt_gate(HANDLER) } else { [0; 16] };
        mem.write_slice(&gate, GuestAddress(layout::BOOT_IDT + v * 16))?;
    }
    Ok(())
}

fn probe() -> Result<(), ProbeError> {
    let t = std::time::Instant::now();
    let (kvm, _caps) = kvm::open().map_err(setup("opening KVM"))?;
    // Declared before the VM so that it is unmapped after the VM fd closes.
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), PROBE_RAM as usize)])
        .map_err(setup("probe memory"))?;
    boot::write_boot_tables(&mem).map_err(setup("boot tables"))?;
    write_guest(&mem).map_err(setup("probe code"))?;

    let vm = kvm.create_vm().map_err(setup("KVM_CREATE_VM"))?;
    vm.set_tss_address(KVM_TSS_ADDRESS)
        .map_err(setup("KVM_SET_TSS_ADDR"))?;
    vm.create_irq_chip().map_err(setup("KVM_CREATE_IRQCHIP"))?;
    let ram = mem
        .iter()
        .next()
        .ok_or_else(|| ProbeError::Setup("probe memory has no region".into()))?;
    let region = kvm_userspace_memory_region {
        slot: 0,
        guest_phys_addr: ram.start_addr().0,
        memory_size: ram.len(),
        userspace_addr: ram.as_ptr() as u64,
        flags: 0,
    };
    // SAFETY: `mem` is one live anonymous mapping of PROBE_RAM bytes at
    // guest address 0; it is declared before `vm`, so it is unmapped only
    // after the VM fd (and the vCPU fd, declared later still) are closed.
    unsafe { vm.set_user_memory_region(region) }.map_err(setup("KVM_SET_USER_MEMORY_REGION"))?;
    let mut cpu = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(setup("KVM_GET_SUPPORTED_CPUID"))?;
    cpuid::for_vcpu(&mut cpu, 0, 1);
    let mut vcpu = vm.create_vcpu(0).map_err(setup("KVM_CREATE_VCPU"))?;
    vcpu.set_cpuid2(&cpu).map_err(setup("KVM_SET_CPUID2"))?;
    regs::setup_vcpu(&vcpu, 0, CODE, EntryKind::Linux).map_err(setup("vCPU registers"))?;
    let mut sregs = vcpu.get_sregs().map_err(setup("KVM_GET_SREGS"))?;
    sregs.idt.limit = (IDT_ENTRIES * 16 - 1) as u16;
    vcpu.set_sregs(&sregs).map_err(setup("KVM_SET_SREGS"))?;

    let exit = match vcpu.run() {
        Ok(VcpuExit::IoOut(PORT, [MAGIC])) => None,
        Ok(VcpuExit::IoOut(port, data)) => Some(format!(
            "ring-0 test code reported {data:02x?} on port {port:#x} instead of [{MAGIC:02x}] \
             on {PORT:#x} (cmpxchg16b or the int3 handler went wrong)"
        )),
        Ok(VcpuExit::InternalError) => Some("KVM_EXIT_INTERNAL_ERROR".into()),
        Ok(VcpuExit::Shutdown) => Some("a triple fault".into()),
        Ok(VcpuExit::FailEntry(reason, _)) => Some(format!(
            "KVM could not enter the long-mode test vCPU (hardware entry failure {reason:#x})"
        )),
        Ok(other) => Some(format!("an unexpected exit ({other:?})")),
        Err(e) => Some(format!("KVM_RUN failing ({e})")),
    };
    let verdict = match exit {
        None => Ok(()),
        Some(what) => {
            let rip = vcpu.get_regs().map(|r| r.rip).unwrap_or(0);
            let (main, _) = code();
            let at = match rip {
                r if r == CODE + 11 => "at cmpxchg16b",
                r if r == CODE + 21 => "at int3",
                r if (HANDLER..DATA).contains(&r) => "in the int3 handler",
                r if (CODE..CODE + main.len() as u64).contains(&r) => "in the test code",
                _ => "outside the test code",
            };
            Err(format!(
                "ring-0 test code (lock cmpxchg16b, then int3 caught by the guest's IDT) ended in \
                 {what} {at} (rip {rip:#x})"
            ))
        }
    };
    log::debug!(
        "KVM probe: {} in {:?}",
        if verdict.is_ok() {
            "Linux guests supported"
        } else {
            "Linux guests not supported"
        },
        t.elapsed()
    );
    verdict.map_err(ProbeError::Unsupported)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_code_fits_and_the_data_is_aligned() {
        let (main, handler) = code();
        assert!(CODE + main.len() as u64 <= HANDLER);
        assert!(HANDLER + handler.len() as u64 <= DATA);
        // The cmpxchg16b encoding: lock, REX.W, 0F C7 /1 with a SIB absolute address.
        assert_eq!(&main[11..17], &[0xf0, 0x48, 0x0f, 0xc7, 0x0c, 0x25]);
        assert_eq!(main[17..21], (DATA as u32).to_le_bytes());
        assert_eq!(main[21], 0xcc);
    }

    #[test]
    fn gate_points_at_the_handler() {
        let g = idt_gate(0x1234_5678_9abc_def0);
        assert_eq!(u16::from_le_bytes([g[0], g[1]]), 0xdef0);
        assert_eq!(u16::from_le_bytes([g[6], g[7]]), 0x9abc);
        assert_eq!(
            u32::from_le_bytes(g[8..12].try_into().unwrap()),
            0x1234_5678
        );
        assert_eq!(u16::from_le_bytes([g[2], g[3]]), CODE_SEL);
        assert_eq!(g[5], 0x8e, "present, DPL 0, 64-bit interrupt gate");
    }

    /// The verdict must match what the CPU flags say: a host whose /proc/cpuinfo
    /// shows hardware virtualization (vmx or svm; true inside the lab too) runs
    /// Linux guests, and a /dev/kvm without it (this project's machines: a
    /// software KVM) cannot. Also bounded in time: the probe sits on the
    /// start path of every Linux VM.
    #[test]
    fn verdict_matches_the_cpu_and_is_fast() {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap();
        let hw = cpuinfo
            .lines()
            .filter(|l| l.starts_with("flags"))
            .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"));
        let t = std::time::Instant::now();
        let v = probe();
        let took = t.elapsed();
        match (&v, hw) {
            (Ok(()), true) => {}
            (Err(ProbeError::Unsupported(why)), false) => {
                let msg = v.clone().unwrap_err().to_string();
                assert!(msg.contains("tests/lab/run.sh"), "{msg}");
                eprintln!("probe says no after {took:?}: {why}");
            }
            (Err(ProbeError::Setup(e)), _) => panic!("probe could not run: {e}"),
            _ => panic!("probe verdict {v:?}, but hardware virtualization in cpuinfo: {hw}"),
        }
        // About 10 ms here (most of it this host's KVM_SET_USER_MEMORY_REGION),
        // about 1 ms on hardware; the bound leaves room for a loaded machine.
        assert!(
            took < std::time::Duration::from_millis(200),
            "probe took {took:?}"
        );
        // Cached: the same answer, then for free.
        assert_eq!(check_linux_guests(), v);
        let t = std::time::Instant::now();
        assert_eq!(check_linux_guests(), v);
        assert!(t.elapsed() < std::time::Duration::from_millis(1));
    }
}
