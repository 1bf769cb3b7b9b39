//! Loading the guest kernel: an ELF64 x86_64 image (an uncompressed Linux
//! `vmlinux`, or Sprout's test guest, which carries a "Sprout" ELF note and
//! uses the direct multi-vCPU entry).

use devices::virtio::GuestMemoryMmap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use linux_loader::loader::{elf::Elf, KernelLoader};
use vm_memory::GuestAddress;

use crate::layout;
use guest_abi::mailbox;

/// Bounds on what we read from a kernel's headers before trusting it.
const MAX_PHDRS: u16 = 128;
const MAX_NOTE_BYTES: u64 = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("Cannot open kernel {0}")]
    Open(PathBuf, #[source] std::io::Error),
    #[error("Cannot read kernel {0}")]
    Read(PathBuf, #[source] std::io::Error),
    #[error("{0} is not a kernel Sprout can boot: not an ELF64 x86_64 executable (an uncompressed vmlinux or the test guest)")]
    NotElf(PathBuf),
    #[error("{0} is a Sprout test guest of protocol version {1}; this VMM speaks version {v}", v = mailbox::PROTOCOL_VERSION)]
    NoteVersion(PathBuf, u32),
    #[error("Cannot load kernel {0} (corrupt, or it does not fit in guest RAM)")]
    Load(PathBuf, #[source] linux_loader::loader::Error),
}

/// How the kernel wants to be entered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum EntryKind {
    /// The Linux 64-bit boot protocol: vCPU 0 starts at the entry, the others
    /// wait for INIT/SIPI from the guest.
    Linux,
    /// Sprout's direct entry: every vCPU starts at the entry in long mode with
    /// RDI = its index and RSI = the zero page.
    Direct,
}

#[derive(Clone, Copy, Debug)]
pub struct LoadedKernel {
    pub entry: u64,
    pub end: u64,
    pub kind: EntryKind,
}

/// Loads the ELF kernel at `path` into guest memory.
pub fn load(mem: &GuestMemoryMmap, path: &Path) -> Result<LoadedKernel, KernelError> {
    let mut f = File::open(path).map_err(|e| KernelError::Open(path.to_owned(), e))?;
    let kind = match entry_kind(&mut f) {
        Ok(Some(None)) => EntryKind::Linux,
        Ok(Some(Some(mailbox::PROTOCOL_VERSION))) => EntryKind::Direct,
        Ok(Some(Some(v))) => return Err(KernelError::NoteVersion(path.to_owned(), v)),
        Ok(None) => return Err(KernelError::NotElf(path.to_owned())),
        Err(e) => return Err(KernelError::Read(path.to_owned(), e)),
    };
    let r = Elf::load(mem, None, &mut f, Some(GuestAddress(layout::HIMEM_START)))
        .map_err(|e| KernelError::Load(path.to_owned(), e))?;
    Ok(LoadedKernel {
        entry: r.kernel_load.0,
        end: r.kernel_end,
        kind,
    })
}

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}
fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or_default())
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or_default())
}

/// Checks the ELF header; `None` if this is not an ELF64 x86_64 executable,
/// else the protocol version of its Sprout note, if it has one.
fn entry_kind<F: Read + Seek>(f: &mut F) -> std::io::Result<Option<Option<u32>>> {
    let mut eh = [0u8; 64];
    f.seek(SeekFrom::Start(0))?;
    if f.read(&mut eh)? < 64 {
        return Ok(None);
    }
    // Magic, ELFCLASS64, little endian, ET_EXEC, EM_X86_64.
    if &eh[0..4] != b"\x7fELF" || eh[4] != 2 || eh[5] != 1 || u16_at(&eh, 16) != 2 {
        return Ok(None);
    }
    if u16_at(&eh, 18) != 62 {
        return Ok(None);
    }
    let phoff = u64_at(&eh, 32);
    let phentsize = u16_at(&eh, 54);
    let phnum = u16_at(&eh, 56);
    if phentsize != 56 || phnum == 0 || phnum > MAX_PHDRS {
        return Ok(None);
    }
    let mut ph = vec![0u8; 56 * phnum as usize];
    f.seek(SeekFrom::Start(phoff))?;
    f.read_exact(&mut ph)?;
    for p in ph.chunks_exact(56) {
        if u32_at(p, 0) != 4 {
            continue; // not PT_NOTE
        }
        let (off, size) = (u64_at(p, 8), u64_at(p, 32).min(MAX_NOTE_BYTES));
        let mut notes = vec![0u8; size as usize];
        f.seek(SeekFrom::Start(off))?;
        f.read_exact(&mut notes)?;
        if let Some(v) = mailbox::find_note(&notes) {
            return Ok(Some(Some(v)));
        }
    }
    Ok(Some(None))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(name: &[u8], ty: u32, desc: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&(name.len() as u32).to_le_bytes());
        v.extend_from_slice(&(desc.len() as u32).to_le_bytes());
        v.extend_from_slice(&ty.to_le_bytes());
        v.extend_from_slice(name);
        while v.len() % 4 != 0 {
            v.push(0);
        }
        v.extend_from_slice(desc);
        while v.len() % 4 != 0 {
            v.push(0);
        }
        v
    }

    #[test]
    fn finds_the_sprout_note_among_others() {
        let mut n = note(b"Xen\0", 18, &[0; 4]);
        assert_eq!(mailbox::find_note(&n), None);
        n.extend(note(
            mailbox::NOTE_NAME,
            mailbox::NOTE_TYPE,
            &1u32.to_le_bytes(),
        ));
        assert_eq!(mailbox::find_note(&n), Some(1));
    }

    #[test]
    fn hostile_notes_do_not_panic() {
        let mut n = note(mailbox::NOTE_NAME, mailbox::NOTE_TYPE, &[1, 0, 0, 0]);
        n[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(mailbox::find_note(&n), None);
        n[0..4].copy_from_slice(&7u32.to_le_bytes());
        n[4..8].copy_from_slice(&0xffff_fff0u32.to_le_bytes());
        assert_eq!(mailbox::find_note(&n), None);
        n[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(mailbox::find_note(&n), None);
        assert_eq!(mailbox::find_note(&[1, 2, 3]), None);
    }

    #[test]
    fn non_elf_is_refused() {
        let mut c = std::io::Cursor::new(b"#!/bin/sh\necho not a kernel\n".repeat(10));
        assert_eq!(entry_kind(&mut c).unwrap(), None);
        let mut c = std::io::Cursor::new(Vec::<u8>::new());
        assert_eq!(entry_kind(&mut c).unwrap(), None);
    }
}
