//! The x86_64 guest physical layout: the one place guest addresses come from.
//!
//! ```text
//! 0x0000_0500  boot GDT            (BOOT_GDT)
//! 0x0000_0530  boot IDT            (BOOT_IDT)
//! 0x0000_5000  test guest mailbox  (MAILBOX_GPA, one page)
//! 0x0000_7000  zero page / boot_params (ZERO_PAGE)
//! 0x0000_8ff0  boot stack top      (BOOT_STACK)
//! 0x0000_9000  PML4, 0xa000 PDPT, 0xb000 PD: identity map of the first 1 GiB
//! 0x0002_0000  kernel command line (CMDLINE, CMDLINE_MAX bytes)
//! 0x0009_fc00  MP table            (MPTABLE_START)
//! 0x0010_0000  kernel / test guest load address (HIMEM_START)
//! 0x0100_0000  test guest scratch memory, up to the end of RAM (TESTGUEST_SCRATCH)
//! 0xc000_0000  MMIO gap start (RAM resumes at 4 GiB)
//! 0xd000_0000  virtio-mmio devices, VIRTIO_MMIO_SIZE each
//! 0xd100_0000  serial (8250) MMIO alias
//! 0xd100_1000  test guest mailbox doorbell device
//! 0xfec0_0000  IOAPIC
//! 0xfee0_0000  LAPIC
//! 0x1_0000_0000 RAM above the gap
//! ```

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
pub const PAGE_SIZE: u64 = 4 * KIB;

/// Smallest and largest guest RAM the VMM accepts.
pub const MIN_MEM_MIB: u64 = 128;
pub const MAX_MEM_MIB: u64 = 8192;
/// Largest vCPU count.
pub const MAX_VCPUS: u8 = 4;

// Boot structures in low memory.
pub const BOOT_GDT: u64 = 0x500;
pub const BOOT_IDT: u64 = 0x530;
pub const MAILBOX_GPA: u64 = 0x5000;
pub const ZERO_PAGE: u64 = 0x7000;
pub const BOOT_STACK: u64 = 0x8ff0;
pub const PML4: u64 = 0x9000;
pub const PDPT: u64 = 0xa000;
pub const PD: u64 = 0xb000;
pub const CMDLINE: u64 = 0x20000;
pub const CMDLINE_MAX: u64 = 0x10000;
/// Start of the extended BIOS data area, where the MP table goes.
pub const MPTABLE_START: u64 = 0x9fc00;
/// End of conventional low memory (the rest of the first MiB is the legacy hole).
pub const LOWMEM_END: u64 = 0x9fc00;
/// Where the kernel (or the test guest) is loaded.
pub const HIMEM_START: u64 = 0x10_0000;
/// Free guest RAM the test guest never uses for itself: host/guest buffers.
pub const TESTGUEST_SCRATCH: u64 = 16 * MIB;

// The 32-bit MMIO gap below 4 GiB.
pub const MMIO_GAP_START: u64 = 3 * GIB;
pub const MMIO_GAP_END: u64 = 4 * GIB;

/// virtio-mmio device windows: device `i` is at `VIRTIO_MMIO_BASE + i * VIRTIO_MMIO_SIZE`.
pub const VIRTIO_MMIO_BASE: u64 = 0xd000_0000;
pub const VIRTIO_MMIO_SIZE: u64 = 0x1000;
pub const VIRTIO_MMIO_MAX: u32 = 12;

/// The 8250 serial port, also reachable at the usual port 0x3f8.
pub const SERIAL_MMIO: u64 = 0xd100_0000;
pub const SERIAL_MMIO_SIZE: u64 = 0x1000;
pub const SERIAL_PORT: u16 = 0x3f8;
pub const SERIAL_PORT_SIZE: u16 = 8;
/// The i8042 controller's ports (0x60 data, 0x64 command; 0xfe on 0x64 resets).
pub const I8042_PORT: u16 = 0x60;
pub const I8042_PORT_SIZE: u16 = 5;

/// The test guest's mailbox doorbell device (see [`crate::mailbox`]).
pub const MAILBOX_MMIO: u64 = 0xd100_1000;
pub const MAILBOX_MMIO_SIZE: u64 = 0x1000;

pub const IOAPIC_START: u64 = 0xfec0_0000;
pub const LAPIC_START: u64 = 0xfee0_0000;

// Interrupt lines (IOAPIC pins = GSIs).
pub const I8042_GSI: u32 = 1;
pub const SERIAL_GSI: u32 = 4;
/// virtio-mmio device `i` raises GSI `VIRTIO_GSI_BASE + i`.
pub const VIRTIO_GSI_BASE: u32 = 5;
/// The mailbox raises GSI `MAILBOX_GSI_BASE + cpu` for vCPU `cpu`.
pub const MAILBOX_GSI_BASE: u32 = 20;
/// Pins of the in-kernel IOAPIC.
pub const IOAPIC_PINS: u32 = 24;

/// Guest RAM regions for `mem_bytes` of RAM: below the MMIO gap, and the rest above 4 GiB.
pub fn ram_regions(mem_bytes: u64) -> ([(u64, u64); 2], usize) {
    if mem_bytes <= MMIO_GAP_START {
        ([(0, mem_bytes), (0, 0)], 1)
    } else {
        (
            [
                (0, MMIO_GAP_START),
                (MMIO_GAP_END, mem_bytes - MMIO_GAP_START),
            ],
            2,
        )
    }
}

// The layout's invariants, checked at build time for the VMM and the guest alike.
const _: () = {
    assert!(VIRTIO_MMIO_BASE >= MMIO_GAP_START);
    assert!(virtio_mmio_addr(VIRTIO_MMIO_MAX) <= SERIAL_MMIO);
    assert!(SERIAL_MMIO + SERIAL_MMIO_SIZE <= MAILBOX_MMIO);
    assert!(MAILBOX_MMIO + MAILBOX_MMIO_SIZE <= IOAPIC_START);
    assert!(VIRTIO_GSI_BASE + VIRTIO_MMIO_MAX <= MAILBOX_GSI_BASE);
    assert!(MAILBOX_GSI_BASE + MAX_VCPUS as u32 <= IOAPIC_PINS);
    assert!(MAILBOX_GPA + PAGE_SIZE <= ZERO_PAGE);
    assert!(ZERO_PAGE + PAGE_SIZE <= BOOT_STACK);
    assert!(CMDLINE + CMDLINE_MAX <= MPTABLE_START);
    assert!(HIMEM_START < TESTGUEST_SCRATCH);
    assert!(MAX_MEM_MIB * MIB <= MMIO_GAP_START + (64 * GIB - MMIO_GAP_END));
};

/// MMIO window base of virtio device `i`.
pub const fn virtio_mmio_addr(i: u32) -> u64 {
    VIRTIO_MMIO_BASE + i as u64 * VIRTIO_MMIO_SIZE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_split_at_the_gap() {
        let (r, n) = ram_regions(512 * MIB);
        assert_eq!(n, 1);
        assert_eq!(r[0], (0, 512 * MIB));
        let (r, n) = ram_regions(8 * GIB);
        assert_eq!(n, 2);
        assert_eq!(r[0], (0, 3 * GIB));
        assert_eq!(r[1], (4 * GIB, 5 * GIB));
    }
}
