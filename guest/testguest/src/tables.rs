//! Page tables, GDTs, TSSs and the IDT, built at compile time at a fixed address.
//!
//! `SPROUT_FIXED` is linked at [`FIXED_BASE`] (link.ld asserts it), so every address
//! inside it is a constant and the whole structure is filled by `const fn`: the
//! supervisor code only loads it (CR3, `lgdt`, `ltr`, `lidt`), no fill loops.
//!
//! Paging: 0..16 GiB identity-mapped with 2 MiB pages, user-accessible and
//! writable (RAM above 4 GiB, the MMIO gap and the APICs included), plus a
//! supervisor-only alias of the top GiB below 4 GiB at `0xffff_ffff_c000_0000`,
//! so supervisor code reaches the LAPIC and the mailbox with one sign-extended
//! 32-bit absolute operand ([`high`]).

use core::mem::offset_of;
use guest_abi::layout::{GIB, HIMEM_START, MAX_VCPUS};

/// Where link.ld places the supervisor code (`.text.sprout_boot`).
pub const BOOT_BASE: u64 = HIMEM_START;
/// Where link.ld places [`Fixed`].
pub const FIXED_BASE: u64 = 0x10_2000;
/// GiB identity-mapped.
const MAPPED_GIB: usize = 16;
const CPUS: usize = MAX_VCPUS as usize;

// Offsets of the supervisor entry points inside `.text.sprout_boot` (boot.rs
// places each with `.org`).
pub const OFF_USER_ENTRY: u64 = 0x50;
pub const OFF_IRQ: u64 = 0x80;
pub const OFF_SPURIOUS: u64 = 0xa0;
pub const OFF_SYSCALL: u64 = 0xc0;
pub const OFF_FAULT: u64 = 0x100;
/// 256 exception/unexpected-vector stubs, [`STUB_SIZE`] bytes apart.
pub const OFF_STUBS: u64 = 0x800;
pub const STUB_SIZE: u64 = 16;

/// Vector of every device interrupt (virtio and mailbox GSIs).
pub const IRQ_VECTOR: u8 = 0x30;
/// The only system call: `int3` (a DPL3 gate). This machine's hypervisor delivers
/// `int3` from user mode but answers `int n` with #UD.
pub const SYSCALL_VECTOR: u8 = 3;
/// LAPIC spurious-interrupt vector.
pub const SPURIOUS_VECTOR: u8 = 0xff;

// GDT selectors.
pub const KCODE_SEL: u64 = 0x10;
pub const UDATA_SEL: u64 = 0x20 | 3;
pub const UCODE_SEL: u64 = 0x28 | 3;
pub const TSS_SEL: u16 = 0x30;

/// Offset of the user-mode iret frame in a [`CpuPage`]; the TSS's RSP0 is just
/// above it, so an interrupt from user mode pushes its frame exactly there.
pub const FRAME_OFF: usize = 0xf98;
/// `CpuPage::wake`: the byte at RSP0, `[rsp+40]` on entry from user mode.
pub const RSP0_OFF: usize = FRAME_OFF + 40;

/// One vCPU's GDT, TSS, kernel stack and wake flag.
#[repr(C, align(4096))]
pub struct CpuPage {
    gdt: [u64; 8],
    _pad: [u16; 3],
    gdt_limit: u16,
    gdt_base: u64,
    tss: [u32; 26],
    /// Kernel stack (interrupt frames grow down from RSP0 into it).
    _stack: [u8; FRAME_OFF - 0xb8],
    /// iret frame to user mode, consumed once at boot, then the top of the stack.
    frame: [u64; 5],
    /// Set by the device-interrupt handler, tested and cleared by the idle call.
    wake: u64,
}

#[repr(C, align(16))]
pub struct Misc {
    _pad: [u16; 3],
    idt_limit: u16,
    idt_base: u64,
    /// Memory operand for `ltr`.
    tss_sel: u16,
}

/// Everything the supervisor loads, at [`FIXED_BASE`].
#[repr(C, align(4096))]
pub struct Fixed {
    pml4: [u64; 512],
    pdpt: [u64; 512],
    pdpt_high: [u64; 512],
    pd: [[u64; 512]; MAPPED_GIB],
    idt: [u64; 512],
    cpus: [CpuPage; CPUS],
    misc: Misc,
}

const _: () = assert!(offset_of!(CpuPage, gdt_limit) == 0x46);
const _: () = assert!(offset_of!(CpuPage, tss) == 0x50);
const _: () = assert!(offset_of!(CpuPage, frame) == FRAME_OFF);
const _: () = assert!(offset_of!(CpuPage, wake) == RSP0_OFF && RSP0_OFF % 16 == 0);
const _: () = assert!(core::mem::size_of::<CpuPage>() == 4096);
const _: () = assert!(CPUS == 4, "build() lists one CpuPage per vCPU");
const _: () = assert!(OFF_STUBS + 256 * STUB_SIZE <= FIXED_BASE - BOOT_BASE);

pub const PML4_ADDR: u64 = FIXED_BASE + offset_of!(Fixed, pml4) as u64;
const PDPT_ADDR: u64 = FIXED_BASE + offset_of!(Fixed, pdpt) as u64;
const PDPT_HIGH_ADDR: u64 = FIXED_BASE + offset_of!(Fixed, pdpt_high) as u64;
const PD_ADDR: u64 = FIXED_BASE + offset_of!(Fixed, pd) as u64;
const IDT_ADDR: u64 = FIXED_BASE + offset_of!(Fixed, idt) as u64;
const CPUS_ADDR: u64 = FIXED_BASE + offset_of!(Fixed, cpus) as u64;
const MISC_ADDR: u64 = FIXED_BASE + offset_of!(Fixed, misc) as u64;
/// vCPU 0's GDTR; vCPU `c`'s is `c << 12` further.
pub const GDTR0_ADDR: u64 = CPUS_ADDR + offset_of!(CpuPage, gdt_limit) as u64;
/// vCPU 0's iret frame; vCPU `c`'s is `c << 12` further.
pub const FRAME0_ADDR: u64 = CPUS_ADDR + FRAME_OFF as u64;
pub const IDTR_ADDR: u64 = MISC_ADDR + offset_of!(Misc, idt_limit) as u64;
pub const TSS_SEL_ADDR: u64 = MISC_ADDR + offset_of!(Misc, tss_sel) as u64;

/// The supervisor-only alias of physical `addr` (in 3..4 GiB), as the sign-extended
/// 32-bit displacement an absolute memory operand carries.
pub const fn high(addr: u64) -> i64 {
    assert!(addr >= 3 * GIB && addr < 4 * GIB);
    addr as i64 - (1 << 32)
}

// Entry bits. Accessed/dirty are preset so the CPU never writes them back.
const P: u64 = 1;
const RW: u64 = 1 << 1;
const US: u64 = 1 << 2;
const A: u64 = 1 << 5;
const D: u64 = 1 << 6;
const PS: u64 = 1 << 7;

const fn gate(handler: u64, dpl: u64) -> (u64, u64) {
    let lo = (handler & 0xffff)
        | (KCODE_SEL << 16)
        | ((0x8e | (dpl << 5)) << 40)
        | (((handler >> 16) & 0xffff) << 48);
    (lo, handler >> 32)
}

const fn cpu_page(cpu: usize) -> CpuPage {
    let page = CPUS_ADDR + (cpu as u64) * 4096;
    let tss = page + offset_of!(CpuPage, tss) as u64;
    let rsp0 = page + RSP0_OFF as u64;
    let mut t = [0u32; 26];
    t[1] = rsp0 as u32;
    t[2] = (rsp0 >> 32) as u32;
    // I/O bitmap offset past the limit: user-mode port I/O always faults.
    t[25] = 104 << 16;
    CpuPage {
        gdt: [
            0,
            0,
            0x00af_9b00_0000_ffff, // 0x10: kernel code, 64-bit
            0x00cf_9300_0000_ffff, // 0x18: kernel data
            0x00cf_f300_0000_ffff, // 0x20: user data
            0x00af_fb00_0000_ffff, // 0x28: user code, 64-bit
            // 0x30: 64-bit TSS, available, limit 103.
            103 | ((tss & 0xff_ffff) << 16) | (0x89 << 40) | (((tss >> 24) & 0xff) << 56),
            tss >> 32,
        ],
        _pad: [0; 3],
        gdt_limit: 8 * 8 - 1,
        gdt_base: page,
        tss: t,
        _stack: [0; FRAME_OFF - 0xb8],
        frame: [
            BOOT_BASE + OFF_USER_ENTRY,
            UCODE_SEL,
            0x202, // IF
            0,     // user_entry sets its own stack
            UDATA_SEL,
        ],
        wake: 0,
    }
}

const fn build() -> Fixed {
    let mut pml4 = [0u64; 512];
    pml4[0] = PDPT_ADDR | P | RW | US | A;
    pml4[511] = PDPT_HIGH_ADDR | P | RW | A;
    let mut pdpt = [0u64; 512];
    let mut pd = [[0u64; 512]; MAPPED_GIB];
    let mut g = 0;
    while g < MAPPED_GIB {
        pdpt[g] = (PD_ADDR + g as u64 * 4096) | P | RW | US | A;
        let mut i = 0;
        while i < 512 {
            pd[g][i] = ((g as u64) << 30) | ((i as u64) << 21) | P | RW | US | A | D | PS;
            i += 1;
        }
        g += 1;
    }
    let mut pdpt_high = [0u64; 512];
    // 0xffff_ffff_c000_0000 -> the same PD as 3..4 GiB.
    pdpt_high[511] = (PD_ADDR + 3 * 4096) | P | RW | A;

    let mut idt = [0u64; 512];
    let mut v = 0;
    while v < 256 {
        let (handler, dpl) = match v as u8 {
            IRQ_VECTOR => (BOOT_BASE + OFF_IRQ, 0),
            SYSCALL_VECTOR => (BOOT_BASE + OFF_SYSCALL, 3),
            SPURIOUS_VECTOR => (BOOT_BASE + OFF_SPURIOUS, 0),
            _ => (BOOT_BASE + OFF_STUBS + v as u64 * STUB_SIZE, 0),
        };
        let (lo, hi) = gate(handler, dpl);
        idt[2 * v] = lo;
        idt[2 * v + 1] = hi;
        v += 1;
    }

    Fixed {
        pml4,
        pdpt,
        pdpt_high,
        pd,
        idt,
        cpus: [cpu_page(0), cpu_page(1), cpu_page(2), cpu_page(3)],
        misc: Misc {
            _pad: [0; 3],
            idt_limit: 256 * 16 - 1,
            idt_base: IDT_ADDR,
            tss_sel: TSS_SEL,
        },
    }
}

/// Never referenced by Rust code: the CPU reaches it through CR3, GDTR, IDTR and the
/// TSS (and writes the TSS busy bit), so it lives in a writable section.
#[no_mangle]
#[link_section = ".data.sprout_fixed"]
static mut SPROUT_FIXED: Fixed = build();
