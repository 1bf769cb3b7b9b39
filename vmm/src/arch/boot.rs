//! Boot structures in guest memory: the boot GDT, the identity page tables for
//! the first GiB, the command line and the zero page (Linux `boot_params`) with
//! its e820 map. Both the Linux 64-bit boot protocol and the test guest start
//! from these.

use devices::virtio::GuestMemoryMmap;
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use vm_memory::{Bytes, GuestAddress};

use crate::layout;

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("Cannot write boot structures into guest memory")]
    Write(#[source] vm_memory::GuestMemoryError),
    #[error("Kernel command line is {0} bytes, the limit is {max}", max = layout::CMDLINE_MAX - 1)]
    CmdlineTooLong(usize),
    #[error("Kernel command line must be printable ASCII")]
    CmdlineChars,
}

/// The boot GDT: null, null, 64-bit code (0x10), data (0x18), TSS (0x20),
/// the selectors of the Linux boot protocol.
pub const BOOT_GDT: [u64; 5] = [
    0,
    0,
    gdt_entry(0xa09b, 0, 0xfffff),
    gdt_entry(0xc093, 0, 0xfffff),
    gdt_entry(0x808b, 0, 0xfffff),
];
pub const CODE_SEL: u16 = 0x10;
pub const DATA_SEL: u16 = 0x18;
pub const TSS_SEL: u16 = 0x20;

/// A GDT descriptor from flags (access byte and the flags nibble), base and limit.
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << (56 - 24))
        | ((flags as u64 & 0xf0ff) << 40)
        | ((limit as u64 & 0x000f_0000) << (48 - 16))
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
}

/// Writes the GDT, an empty IDT and the page tables.
pub fn write_boot_tables(mem: &GuestMemoryMmap) -> Result<(), BootError> {
    for (i, e) in BOOT_GDT.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(layout::BOOT_GDT + i as u64 * 8))
            .map_err(BootError::Write)?;
    }
    mem.write_obj(0u64, GuestAddress(layout::BOOT_IDT))
        .map_err(BootError::Write)?;
    // PML4[0] -> PDPT, PDPT[0] -> PD, PD maps the first GiB with 2 MiB pages.
    mem.write_obj(layout::PDPT | 0x03, GuestAddress(layout::PML4))
        .map_err(BootError::Write)?;
    mem.write_obj(layout::PD | 0x03, GuestAddress(layout::PDPT))
        .map_err(BootError::Write)?;
    let mut pd = [0u8; 4096];
    for (i, chunk) in pd.chunks_exact_mut(8).enumerate() {
        let entry = ((i as u64) << 21) | 0x83; // present, writable, 2 MiB page
        chunk.copy_from_slice(&entry.to_le_bytes());
    }
    mem.write_slice(&pd, GuestAddress(layout::PD))
        .map_err(BootError::Write)?;
    Ok(())
}

/// Checks and writes the NUL-terminated command line at `layout::CMDLINE`.
pub fn write_cmdline(mem: &GuestMemoryMmap, cmdline: &str) -> Result<(), BootError> {
    if cmdline.len() as u64 >= layout::CMDLINE_MAX {
        return Err(BootError::CmdlineTooLong(cmdline.len()));
    }
    if !cmdline.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(BootError::CmdlineChars);
    }
    mem.write_slice(cmdline.as_bytes(), GuestAddress(layout::CMDLINE))
        .map_err(BootError::Write)?;
    mem.write_obj(0u8, GuestAddress(layout::CMDLINE + cmdline.len() as u64))
        .map_err(BootError::Write)
}

/// The usable RAM ranges the guest is told about (e820 type 1).
pub fn e820_ram(mem_size: u64) -> Vec<(u64, u64)> {
    let (regions, n) = layout::ram_regions(mem_size);
    let mut out = vec![(0, layout::LOWMEM_END)];
    for &(base, len) in &regions[..n] {
        if base == 0 {
            out.push((layout::HIMEM_START, len - layout::HIMEM_START));
        } else {
            out.push((base, len));
        }
    }
    out
}

/// Writes the zero page: e820 map and the setup header fields a 64-bit Linux
/// kernel reads (the test guest reads the same ones).
pub fn write_zero_page(
    mem: &GuestMemoryMmap,
    mem_size: u64,
    cmdline_len: usize,
) -> Result<(), BootError> {
    let mut params = boot_params::default();
    params.hdr.boot_flag = 0xaa55;
    params.hdr.header = 0x5372_6448; // "HdrS"
    params.hdr.type_of_loader = 0xff;
    params.hdr.kernel_alignment = 0x0100_0000;
    params.hdr.cmd_line_ptr = layout::CMDLINE as u32;
    params.hdr.cmdline_size = cmdline_len as u32;
    let ram = e820_ram(mem_size);
    for (i, &(addr, size)) in ram.iter().enumerate() {
        params.e820_table[i] = boot_e820_entry {
            addr,
            size,
            r#type: 1,
        };
    }
    params.e820_entries = ram.len() as u8;
    mem.write_obj(params, GuestAddress(layout::ZERO_PAGE))
        .map_err(BootError::Write)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_entries_match_the_boot_protocol() {
        assert_eq!(BOOT_GDT[2], 0x00af_9b00_0000_ffff);
        assert_eq!(BOOT_GDT[3], 0x00cf_9300_0000_ffff);
        assert!(layout::BOOT_GDT + BOOT_GDT.len() as u64 * 8 <= layout::BOOT_IDT);
    }

    #[test]
    fn e820_skips_the_legacy_hole_and_the_gap() {
        let r = e820_ram(512 << 20);
        assert_eq!(r, vec![(0, 0x9fc00), (0x10_0000, (512 << 20) - 0x10_0000)]);
        let r = e820_ram(6 << 30);
        assert_eq!(r[2], (4 << 30, 3 << 30));
    }

    #[test]
    fn cmdline_is_checked() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        write_cmdline(&mem, "console=ttyS0").unwrap();
        let mut b = [0u8; 14];
        mem.read_slice(&mut b, GuestAddress(layout::CMDLINE))
            .unwrap();
        assert_eq!(&b, b"console=ttyS0\0");
        assert!(matches!(
            write_cmdline(&mem, "a\nb"),
            Err(BootError::CmdlineChars)
        ));
        let long = "x".repeat(layout::CMDLINE_MAX as usize);
        assert!(matches!(
            write_cmdline(&mem, &long),
            Err(BootError::CmdlineTooLong(_))
        ));
    }
}
