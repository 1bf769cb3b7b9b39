//! The Intel MultiProcessor table (MP specification 1.4) for Linux guests: how
//! Linux finds the vCPUs, the IOAPIC and which IOAPIC pin each interrupt uses
//! when there is no ACPI.
//!
//! Linux scans the last KiB of base memory for the floating pointer, so the
//! table sits at [`layout::MPTABLE_START`] (639 KiB), outside the e820 RAM map.
//! It describes: one processor entry per vCPU (LAPIC id = vCPU index, vCPU 0
//! the bootstrap processor), one ISA bus, the IOAPIC (id = vCPU count, at
//! [`layout::IOAPIC_START`]), one interrupt entry per IOAPIC pin mapping ISA IRQ
//! `n` to pin `n` (the identity routing of KVM's in-kernel irqchip: the serial
//! on GSI 4, virtio-mmio device `i` on GSI `VIRTIO_GSI_BASE + i`), and the
//! LAPICs' LINT0 (ExtINT) and LINT1 (NMI).

use devices::virtio::GuestMemoryMmap;
use vm_memory::{Bytes, GuestAddress};

use super::boot::BootError;
use crate::layout;

const FLOATING_LEN: usize = 16;
const HEADER_LEN: usize = 44;
const PROCESSOR_LEN: usize = 20;
const ENTRY_LEN: usize = 8;

const SPEC_REV: u8 = 4;
const LAPIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const ISA_BUS: u8 = 0;

const ENTRY_PROCESSOR: u8 = 0;
const ENTRY_BUS: u8 = 1;
const ENTRY_IOAPIC: u8 = 2;
const ENTRY_IO_INTERRUPT: u8 = 3;
const ENTRY_LOCAL_INTERRUPT: u8 = 4;

const CPU_ENABLED: u8 = 1;
const CPU_BSP: u8 = 2;
const IOAPIC_ENABLED: u8 = 1;

const INT_VECTORED: u8 = 0;
const INT_NMI: u8 = 1;
const INT_EXTINT: u8 = 3;
/// Polarity and trigger "conforming to the bus": edge, active high on ISA.
const FLAGS_CONFORMING: u16 = 0;
const ALL_LAPICS: u8 = 0xff;

/// Bytes the whole table takes for `vcpus` processors.
pub const fn table_len(vcpus: u8) -> usize {
    FLOATING_LEN
        + HEADER_LEN
        + PROCESSOR_LEN * vcpus as usize
        + ENTRY_LEN * (2 + layout::IOAPIC_PINS as usize + 2)
}

// The largest table fits between MPTABLE_START and the end of base memory.
const _: () = assert!(layout::MPTABLE_START + table_len(layout::MAX_VCPUS) as u64 <= 0xa_0000);

fn checksum(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .fold(0u8, |s, b| s.wrapping_add(*b))
        .wrapping_neg()
}

/// The table for `vcpus` vCPUs as it is placed at `base`: floating pointer,
/// then the configuration table.
pub fn build(vcpus: u8, base: u64) -> Vec<u8> {
    let ioapic_id = vcpus;
    let mut entries: Vec<u8> = Vec::with_capacity(table_len(vcpus));
    let mut count: u16 = 0;

    for cpu in 0..vcpus {
        entries.extend_from_slice(&[
            ENTRY_PROCESSOR,
            cpu,
            LAPIC_VERSION,
            CPU_ENABLED | if cpu == 0 { CPU_BSP } else { 0 },
        ]);
        // CPU signature and feature flags (informational), reserved.
        entries.extend_from_slice(&[0; 16]);
        count += 1;
    }
    entries.extend_from_slice(&[ENTRY_BUS, ISA_BUS]);
    entries.extend_from_slice(b"ISA   ");
    count += 1;
    entries.extend_from_slice(&[ENTRY_IOAPIC, ioapic_id, IOAPIC_VERSION, IOAPIC_ENABLED]);
    entries.extend_from_slice(&(layout::IOAPIC_START as u32).to_le_bytes());
    count += 1;
    for pin in 0..layout::IOAPIC_PINS as u8 {
        entries.extend_from_slice(&[ENTRY_IO_INTERRUPT, INT_VECTORED]);
        entries.extend_from_slice(&FLAGS_CONFORMING.to_le_bytes());
        entries.extend_from_slice(&[ISA_BUS, pin, ioapic_id, pin]);
        count += 1;
    }
    for (kind, lint) in [(INT_EXTINT, 0u8), (INT_NMI, 1)] {
        entries.extend_from_slice(&[ENTRY_LOCAL_INTERRUPT, kind]);
        entries.extend_from_slice(&FLAGS_CONFORMING.to_le_bytes());
        entries.extend_from_slice(&[ISA_BUS, 0, ALL_LAPICS, lint]);
        count += 1;
    }

    let table_len = (HEADER_LEN + entries.len()) as u16;
    let mut header = Vec::with_capacity(HEADER_LEN);
    header.extend_from_slice(b"PCMP");
    header.extend_from_slice(&table_len.to_le_bytes());
    header.push(SPEC_REV);
    header.push(0); // checksum, below
    header.extend_from_slice(b"SPROUT  "); // OEM id, 8 bytes
    header.extend_from_slice(b"SPROUT VM   "); // product id, 12 bytes
    header.extend_from_slice(&0u32.to_le_bytes()); // OEM table pointer
    header.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    header.extend_from_slice(&count.to_le_bytes());
    header.extend_from_slice(&(layout::LAPIC_START as u32).to_le_bytes());
    header.extend_from_slice(&[0, 0, 0, 0]); // extended table length, checksum, reserved
    debug_assert_eq!(header.len(), HEADER_LEN);
    let mut config = header;
    config.extend_from_slice(&entries);
    config[7] = checksum(&config);

    let mut out = Vec::with_capacity(FLOATING_LEN + config.len());
    out.extend_from_slice(b"_MP_");
    out.extend_from_slice(&((base + FLOATING_LEN as u64) as u32).to_le_bytes());
    out.push(1); // length in 16-byte units
    out.push(SPEC_REV);
    out.push(0); // checksum, below
    out.extend_from_slice(&[0; 5]); // features: a configuration table follows, no IMCR
    out[10] = checksum(&out);
    out.extend_from_slice(&config);
    out
}

/// Writes the MP table for `vcpus` vCPUs at [`layout::MPTABLE_START`].
pub fn write(mem: &GuestMemoryMmap, vcpus: u8) -> Result<(), BootError> {
    let table = build(vcpus, layout::MPTABLE_START);
    mem.write_slice(&table, GuestAddress(layout::MPTABLE_START))
        .map_err(BootError::Write)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |s, x| s.wrapping_add(*x))
    }

    /// What the table says, read back the way Linux's mpparse reads it.
    struct Parsed {
        cpus: Vec<u8>,
        bsp: Vec<u8>,
        ioapic: u8,
        /// (source bus IRQ, IOAPIC pin)
        irqs: Vec<(u8, u8)>,
    }

    fn parse(t: &[u8], base: u64) -> Parsed {
        assert_eq!(&t[0..4], b"_MP_");
        assert_eq!(sum(&t[..16]), 0, "floating pointer checksum");
        let ptr = u32::from_le_bytes(t[4..8].try_into().unwrap()) as u64;
        let cfg = &t[(ptr - base) as usize..];
        assert_eq!(&cfg[0..4], b"PCMP");
        let len = u16::from_le_bytes([cfg[4], cfg[5]]) as usize;
        assert_eq!(sum(&cfg[..len]), 0, "configuration table checksum");
        let count = u16::from_le_bytes([cfg[34], cfg[35]]);
        assert_eq!(
            u32::from_le_bytes(cfg[36..40].try_into().unwrap()) as u64,
            layout::LAPIC_START
        );
        let (mut cpus, mut bsp, mut ioapic, mut irqs) = (vec![], vec![], 0xff, vec![]);
        let mut at = HEADER_LEN;
        for _ in 0..count {
            match cfg[at] {
                ENTRY_PROCESSOR => {
                    cpus.push(cfg[at + 1]);
                    if cfg[at + 3] & CPU_BSP != 0 {
                        bsp.push(cfg[at + 1]);
                    }
                    at += PROCESSOR_LEN;
                }
                ENTRY_IOAPIC => {
                    ioapic = cfg[at + 1];
                    let addr = u32::from_le_bytes(cfg[at + 4..at + 8].try_into().unwrap());
                    assert_eq!(addr as u64, layout::IOAPIC_START);
                    at += ENTRY_LEN;
                }
                ENTRY_IO_INTERRUPT => {
                    assert_eq!(cfg[at + 6], ioapic, "interrupt routed to our IOAPIC");
                    irqs.push((cfg[at + 5], cfg[at + 7]));
                    at += ENTRY_LEN;
                }
                ENTRY_BUS | ENTRY_LOCAL_INTERRUPT => at += ENTRY_LEN,
                t => panic!("unknown entry type {t}"),
            }
        }
        assert_eq!(at, len, "entries fill the table exactly");
        Parsed {
            cpus,
            bsp,
            ioapic,
            irqs,
        }
    }

    #[test]
    fn table_describes_every_vcpu_and_pin() {
        for vcpus in 1..=layout::MAX_VCPUS {
            let t = build(vcpus, layout::MPTABLE_START);
            assert_eq!(t.len(), table_len(vcpus));
            let Parsed {
                cpus,
                bsp,
                ioapic,
                irqs,
            } = parse(&t, layout::MPTABLE_START);
            assert_eq!(cpus, (0..vcpus).collect::<Vec<_>>());
            assert_eq!(bsp, vec![0]);
            assert_eq!(ioapic, vcpus, "IOAPIC id after the LAPIC ids");
            assert_eq!(irqs.len(), layout::IOAPIC_PINS as usize);
            assert!(irqs.iter().all(|(irq, pin)| irq == pin));
            // The serial and every virtio-mmio GSI have their pin.
            assert!(irqs.contains(&(layout::SERIAL_GSI as u8, layout::SERIAL_GSI as u8)));
            let last = (layout::VIRTIO_GSI_BASE + layout::VIRTIO_MMIO_MAX - 1) as u8;
            assert!(irqs.contains(&(last, last)));
        }
    }

    #[test]
    fn written_where_linux_scans() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        write(&mem, 2).unwrap();
        let mut t = vec![0u8; table_len(2)];
        mem.read_slice(&mut t, GuestAddress(layout::MPTABLE_START))
            .unwrap();
        // Linux looks for the floating pointer on a 16-byte boundary in 639-640 KiB.
        assert_eq!(layout::MPTABLE_START, 639 * 1024);
        assert_eq!(layout::MPTABLE_START % 16, 0);
        assert_eq!(parse(&t, layout::MPTABLE_START).cpus, vec![0, 1]);
        // Outside the RAM Linux is told it may use.
        assert!(super::super::boot::e820_ram(256 << 20)
            .iter()
            .all(|&(a, l)| layout::MPTABLE_START >= a + l || layout::MPTABLE_START < a));
    }

    #[test]
    fn memory_too_small_is_an_error() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x1000)]).unwrap();
        assert!(matches!(write(&mem, 1), Err(BootError::Write(_))));
    }
}
