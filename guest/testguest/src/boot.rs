//! The supervisor (CPL0) part of the test guest: all of it is here.
//!
//! Supervisor instructions are emulated one by one on hosts without hardware
//! virtualization (~1 µs each) and any exception taken at CPL0 is fatal there, so
//! this code is a handful of instructions that cannot fault. Everything else runs
//! in user mode (`crate::user_main`).
//!
//! * `_start` (every vCPU, RDI = vCPU index, RSI = boot_params; IF = 0): load the
//!   const-built tables (tables.rs), enable the LAPIC and mask LINT0 (so the 8259
//!   never injects vectors), then `iretq` to user mode through the vCPU's prebuilt
//!   iret frame, which also becomes the top of its kernel stack. 10 instructions.
//! * Device interrupt (vector 0x30): set the vCPU's wake flag, EOI. 3 instructions.
//! * The system call is `int3` (vector 3; `int n` raises #UD on this machine's
//!   hypervisor). EAX = 0, idle: if the wake flag is set, clear it and return;
//!   else `sti; hlt` (the STI shadow makes a pending interrupt end the HLT) and
//!   return. 6 instructions, or 8 plus the interrupt's 3 when it halts.
//!   EAX = 1: reset through the i8042 controller.
//! * CPU exceptions and unexpected vectors: report RIP and vector to the mailbox
//!   device (which ends the VM) and halt.
//!
//! The wake flag is the byte at RSP0, which is `[rsp+40]` in a handler entered from
//! user mode (five 8-byte frame words). An interrupt that ends the idle HLT arrives
//! at CPL0 and writes the same displacement to unused stack padding instead, which
//! is harmless: the idle call returns anyway and user code looks again.

use crate::tables::*;
use guest_abi::layout::{LAPIC_START, MAILBOX_MMIO, MAX_VCPUS};
use guest_abi::mailbox::{NOTE_NAME, NOTE_TYPE, PROTOCOL_VERSION, REG_PANIC, REG_PANIC_RIP};

/// Bytes of user stack per vCPU (a power of two: `user_entry` shifts by it).
const USER_STACK_SHIFT: u32 = 16;

#[repr(C, align(4096))]
struct UserStack([u8; 1 << USER_STACK_SHIFT]);

/// Per-vCPU user stacks, in .bss.
static mut USER_STACKS: [UserStack; MAX_VCPUS as usize] =
    [const { UserStack([0; 1 << USER_STACK_SHIFT]) }; MAX_VCPUS as usize];

const fn note_name_is_sprout() -> bool {
    let want = b"Sprout\0";
    if NOTE_NAME.len() != want.len() {
        return false;
    }
    let mut i = 0;
    while i < want.len() {
        if NOTE_NAME[i] != want[i] {
            return false;
        }
        i += 1;
    }
    true
}
const _: () = assert!(note_name_is_sprout(), "the note below spells the name out");

core::arch::global_asm!(
    r#"
    .pushsection .text.sprout_boot, "ax"
    .globl _start
_start:
    mov eax, {pml4}
    mov cr3, rax
    shl edi, 12
    lgdt [rdi + {gdtr0}]
    lidt [{idtr}]
    ltr word ptr [{tss_sel}]
    mov dword ptr [{lapic_svr}], 0x1ff
    mov dword ptr [{lapic_lvt0}], 0x10000
    lea rsp, [rdi + {frame0}]
    iretq

    // CPL3 from here to the next .org: runs natively.
    .org {off_user_entry}
sprout_user_entry:
    shr edi, 12
    lea rsp, [rip + {stacks}]
    lea eax, [rdi + 1]
    shl rax, {stack_shift}
    add rsp, rax
    jmp {user_main}

    .org {off_irq}
sprout_irq:
    mov byte ptr [rsp + 40], 1
    mov dword ptr [{lapic_eoi}], 0
    iretq

    .org {off_spurious}
sprout_spurious:
    iretq

    .org {off_syscall}
sprout_syscall:
    test eax, eax
    jnz 2f
    cmp byte ptr [rsp + 40], 0
    jne 1f
    sti
    hlt
1:
    mov byte ptr [rsp + 40], 0
    iretq
2:
    mov al, 0xfe
    out 0x64, al
3:
    cli
    hlt
    jmp 3b

    .org {off_fault}
    // [rsp] = vector (pushed by the stub), then the CPU's frame.
sprout_fault_err:
    mov rdx, [rsp + 16]
    jmp 1f
sprout_fault_noerr:
    mov rdx, [rsp + 8]
1:
    mov dword ptr [{panic_rip}], edx
    pop rax
    mov dword ptr [{panic}], eax
2:
    cli
    hlt
    jmp 2b

    // One stub per vector at a fixed place (tables.rs points the IDT at them):
    // push imm32 vector; jmp to the handler for frames with or without an error code.
    .set sprout_vec, 0
    .rept 256
    .org {off_stubs} + sprout_vec * {stub_size}
    .byte 0x68
    .long sprout_vec
    .if sprout_vec == 8 || (sprout_vec >= 10 && sprout_vec <= 14) || sprout_vec == 17 || sprout_vec == 21 || sprout_vec == 29 || sprout_vec == 30
    jmp sprout_fault_err
    .else
    jmp sprout_fault_noerr
    .endif
    .set sprout_vec, sprout_vec + 1
    .endr
    .popsection

    // The note a VMM recognises this kernel by (guest_abi::mailbox::find_note).
    .pushsection .note.sprout, "a", @note
    .balign 4
    .long {namesz}
    .long 4
    .long {note_type}
    .asciz "Sprout"
    .balign 4
    .long {version}
    .balign 4
    .popsection
    "#,
    pml4 = const PML4_ADDR,
    gdtr0 = const GDTR0_ADDR,
    idtr = const IDTR_ADDR,
    tss_sel = const TSS_SEL_ADDR,
    frame0 = const FRAME0_ADDR,
    lapic_svr = const high(LAPIC_START + 0xf0),
    lapic_lvt0 = const high(LAPIC_START + 0x350),
    lapic_eoi = const high(LAPIC_START + 0xb0),
    panic_rip = const high(MAILBOX_MMIO + REG_PANIC_RIP),
    panic = const high(MAILBOX_MMIO + REG_PANIC),
    off_user_entry = const OFF_USER_ENTRY,
    off_irq = const OFF_IRQ,
    off_spurious = const OFF_SPURIOUS,
    off_syscall = const OFF_SYSCALL,
    off_fault = const OFF_FAULT,
    off_stubs = const OFF_STUBS,
    stub_size = const STUB_SIZE,
    stacks = sym USER_STACKS,
    stack_shift = const USER_STACK_SHIFT,
    user_main = sym crate::user_main,
    namesz = const NOTE_NAME.len(),
    note_type = const NOTE_TYPE,
    version = const PROTOCOL_VERSION,
);

/// Waits for an interrupt unless one arrived since the last call.
pub fn idle() {
    // SAFETY: the idle system call preserves every register and the flags (the
    // kernel side touches only its own stack and the wake flag) and uses no user
    // stack. It may stand for memory changes by devices, so no `nomem`.
    unsafe { core::arch::asm!("int3", in("eax") 0u32, options(nostack)) }
}

/// Resets the machine (the VMM ends the VM).
pub fn reset() -> ! {
    // SAFETY: the reset system call never returns.
    unsafe { core::arch::asm!("int3", in("eax") 1u32, options(noreturn, nostack)) }
}
