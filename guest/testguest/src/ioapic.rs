//! IOAPIC routing, programmed from user mode (its registers are plain MMIO to
//! the in-kernel IOAPIC, so this costs the same exits at CPL3 as at CPL0 and keeps
//! the command-line parsing out of supervisor code).

use crate::bootparams::BootInfo;
use crate::mem::Regs;
use crate::tables::IRQ_VECTOR;
use guest_abi::layout::{IOAPIC_PINS, IOAPIC_START, MAILBOX_GSI_BASE, MAX_VCPUS};

const IOREGSEL: u64 = 0x00;
const IOWIN: u64 = 0x10;

fn write(reg: u32, v: u32) {
    let r = Regs(IOAPIC_START);
    r.write(IOREGSEL, reg);
    r.write(IOWIN, v);
}

/// Pin `pin` -> [`IRQ_VECTOR`] on the vCPU with APIC ID `apic_id`: fixed delivery,
/// physical destination, edge-triggered, active high, unmasked.
fn route(pin: u32, apic_id: u32) {
    if pin >= IOAPIC_PINS {
        return;
    }
    write(0x11 + 2 * pin, apic_id << 24);
    write(0x10 + 2 * pin, IRQ_VECTOR as u32);
}

/// Each vCPU's mailbox line to that vCPU; every virtio device's line to vCPU 0.
pub fn route_all(info: &BootInfo) {
    for c in 0..MAX_VCPUS as u32 {
        route(MAILBOX_GSI_BASE + c, c);
    }
    for d in info.virtio_devices() {
        route(d.gsi, 0);
    }
}
