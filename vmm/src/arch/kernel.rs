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
    match load_direct(mem, &f) {
        Ok(Some((entry, end))) => return Ok(LoadedKernel { entry, end, kind }),
        Ok(None) => {}
        Err(e) => return Err(KernelError::Read(path.to_owned(), e)),
    }
    // Anything the direct path does not take (a segment across regions, a
    // header it finds wrong) goes through linux-loader, which loads it or
    // says what is wrong with it.
    let r = Elf::load(mem, None, &mut f, Some(GuestAddress(layout::HIMEM_START)))
        .map_err(|e| KernelError::Load(path.to_owned(), e))?;
    Ok(LoadedKernel {
        entry: r.kernel_load.0,
        end: r.kernel_end,
        kind,
    })
}

/// One `PT_LOAD` segment's bytes: where they are in the kernel file and
/// where they go in host memory.
struct Copy {
    from: u64,
    len: u64,
    to: *mut u8,
}

/// Loads the kernel's segments with `pread` from the kernel file straight
/// into guest RAM's host mapping, instead of reading them through a buffer
/// as linux-loader does: the pages fault in inside the kernel's copy and each
/// byte is copied once. In the lab that is 45-48 ms for the 9.6 MiB vmlinux
/// (2448 page faults, each page zeroed, then written), against 31-37 ms when
/// guest RAM was a memfd the segments were `sendfile`d into (no zeroing) and
/// ~55 ms through linux-loader (docs/benchmarks.md); the guest's boot gained
/// far more from anonymous RAM. Returns the entry and the end of the image,
/// or `None`, having written nothing, where the image or the memory is not
/// the plain case (then linux-loader loads it). The bss is not written: fresh
/// guest RAM is zero, as linux-loader assumes too.
fn load_direct(mem: &GuestMemoryMmap, f: &File) -> std::io::Result<Option<(u64, u64)>> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

    let file_len = f.metadata()?.len();
    let mut eh = [0u8; 64];
    f.read_exact_at(&mut eh, 0)?;
    let entry = u64_at(&eh, 24);
    let (phoff, phentsize, phnum) = (u64_at(&eh, 32), u16_at(&eh, 54), u16_at(&eh, 56));
    if entry < layout::HIMEM_START || phentsize != 56 || phnum == 0 || phnum > MAX_PHDRS {
        return Ok(None);
    }
    let mut ph = vec![0u8; 56 * usize::from(phnum)];
    if phoff
        .checked_add(ph.len() as u64)
        .is_none_or(|e| e > file_len)
    {
        return Ok(None);
    }
    f.read_exact_at(&mut ph, phoff)?;
    let mut copies = Vec::new();
    let mut end = 0u64;
    for p in ph.chunks_exact(56) {
        // PT_LOAD, with bytes in the file (as linux-loader: a segment with
        // none is not loaded and does not move the end).
        let (offset, paddr, filesz, memsz) =
            (u64_at(p, 8), u64_at(p, 24), u64_at(p, 32), u64_at(p, 40));
        if u32_at(p, 0) != 1 || filesz == 0 {
            continue;
        }
        let Some(seg_end) = paddr.checked_add(memsz.max(filesz)) else {
            return Ok(None);
        };
        if offset.checked_add(filesz).is_none_or(|e| e > file_len) {
            return Ok(None);
        }
        let Some(region) = mem.find_region(GuestAddress(paddr)) else {
            return Ok(None);
        };
        let in_region = paddr - region.start_addr().0;
        if in_region
            .checked_add(filesz)
            .is_none_or(|e| e > region.len())
        {
            return Ok(None);
        }
        // SAFETY: in_region + filesz <= region.len(), so the pointer and the
        // `filesz` bytes after it lie inside the region's live mapping.
        let to = unsafe { region.as_ptr().add(in_region as usize) };
        copies.push(Copy {
            from: offset,
            len: filesz,
            to,
        });
        end = end.max(seg_end);
    }
    if copies.is_empty() {
        return Ok(None);
    }
    for c in copies {
        let mut done = 0u64;
        while done < c.len {
            let chunk = (c.len - done).min(1 << 30) as usize;
            // SAFETY: `c.to + done .. + chunk` lies inside guest RAM's
            // mapping (checked against the region above), which nothing else
            // touches before the vCPUs start; the descriptor is open.
            let n = unsafe {
                libc::pread(
                    f.as_raw_fd(),
                    c.to.add(done as usize).cast(),
                    chunk,
                    (c.from + done) as libc::off_t,
                )
            };
            match n {
                n if n < 0 => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    return Err(e);
                }
                0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                n => done += n as u64,
            }
        }
    }
    Ok(Some((entry, end)))
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

    /// An ELF64 x86_64 executable with the given (paddr, filesz, memsz)
    /// PT_LOAD segments, each segment's bytes a pattern of its index.
    fn elf(entry: u64, segs: &[(u64, u64, u64)]) -> Vec<u8> {
        let phoff = 64u64;
        let mut data_off = phoff + 56 * segs.len() as u64;
        let mut v = vec![0u8; data_off as usize];
        v[0..4].copy_from_slice(b"\x7fELF");
        v[4] = 2; // ELFCLASS64
        v[5] = 1; // little endian
        v[6] = 1; // EV_CURRENT
        v[16..18].copy_from_slice(&2u16.to_le_bytes()); // ET_EXEC
        v[18..20].copy_from_slice(&62u16.to_le_bytes()); // EM_X86_64
        v[20..24].copy_from_slice(&1u32.to_le_bytes());
        v[24..32].copy_from_slice(&entry.to_le_bytes());
        v[32..40].copy_from_slice(&phoff.to_le_bytes());
        v[52..54].copy_from_slice(&64u16.to_le_bytes());
        v[54..56].copy_from_slice(&56u16.to_le_bytes());
        v[56..58].copy_from_slice(&(segs.len() as u16).to_le_bytes());
        for (i, &(paddr, filesz, memsz)) in segs.iter().enumerate() {
            let p = 64 + 56 * i;
            v[p..p + 4].copy_from_slice(&1u32.to_le_bytes()); // PT_LOAD
            v[p + 8..p + 16].copy_from_slice(&data_off.to_le_bytes());
            v[p + 16..p + 24].copy_from_slice(&paddr.to_le_bytes());
            v[p + 24..p + 32].copy_from_slice(&paddr.to_le_bytes());
            v[p + 32..p + 40].copy_from_slice(&filesz.to_le_bytes());
            v[p + 40..p + 48].copy_from_slice(&memsz.to_le_bytes());
            v.extend((0..filesz).map(|b| (b as u8) ^ (i as u8 + 1)));
            data_off += filesz;
        }
        v
    }

    fn ram_bytes(mem: &GuestMemoryMmap, at: u64, len: usize) -> Vec<u8> {
        use vm_memory::Bytes;
        let mut b = vec![0u8; len];
        mem.read_slice(&mut b, GuestAddress(at)).unwrap();
        b
    }

    #[test]
    fn segments_read_into_ram_match_linux_loader() {
        let himem = layout::HIMEM_START;
        // Two segments, one not page aligned and with a bss past its bytes.
        let segs = [(himem, 0x3000, 0x3000), (himem + 0x5123, 0x2345, 0x9000)];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k");
        std::fs::write(&path, elf(himem + 0x40, &segs)).unwrap();

        let direct = crate::memory::create(64 << 20).unwrap();
        let f = File::open(&path).unwrap();
        let got = load_direct(&direct.mem, &f).unwrap();
        assert_eq!(got, Some((himem + 0x40, himem + 0x5123 + 0x9000)));

        let through = crate::memory::create(64 << 20).unwrap();
        let r = Elf::load(
            &through.mem,
            None,
            &mut File::open(&path).unwrap(),
            Some(GuestAddress(himem)),
        )
        .unwrap();
        assert_eq!(got, Some((r.kernel_load.0, r.kernel_end)));
        let span = 0x5123 + 0x9000 + 0x1000;
        let a = ram_bytes(&direct.mem, himem - 0x1000, span);
        assert_eq!(a, ram_bytes(&through.mem, himem - 0x1000, span));
        // The bytes are really there (not two equally empty RAMs).
        assert_eq!(&a[0x1000..0x1004], &[1, 0, 3, 2]);
        assert_eq!(a[0x1000 + 0x5123], 2);

        // And `load` takes the direct path for it.
        let again = crate::memory::create(64 << 20).unwrap();
        let k = load(&again.mem, &path).unwrap();
        assert_eq!(
            (k.entry, k.end, k.kind),
            (himem + 0x40, himem + 0x5123 + 0x9000, EntryKind::Linux)
        );
        assert_eq!(ram_bytes(&again.mem, himem - 0x1000, span), a);
    }

    #[test]
    fn a_kernel_the_direct_path_does_not_take_is_refused_or_loaded_as_before() {
        let himem = layout::HIMEM_START;
        let dir = tempfile::tempdir().unwrap();
        let mem = crate::memory::create(64 << 20).unwrap();
        // A segment with more bytes than the file has: nothing written,
        // and linux-loader's error.
        let mut short = elf(himem, &[(himem, 0x3000, 0x3000)]);
        short.truncate(short.len() - 0x100);
        let path = dir.path().join("short");
        std::fs::write(&path, &short).unwrap();
        assert_eq!(
            load_direct(&mem.mem, &File::open(&path).unwrap()).unwrap(),
            None
        );
        assert!(matches!(load(&mem.mem, &path), Err(KernelError::Load(..))));
        // An entry below high memory: linux-loader's refusal.
        let path = dir.path().join("low");
        std::fs::write(&path, elf(0x1000, &[(himem, 0x1000, 0x1000)])).unwrap();
        assert!(matches!(load(&mem.mem, &path), Err(KernelError::Load(..))));
        // A segment past the end of RAM.
        let path = dir.path().join("high");
        std::fs::write(&path, elf(himem, &[(64 << 20, 0x1000, 0x1000)])).unwrap();
        assert_eq!(
            load_direct(&mem.mem, &File::open(&path).unwrap()).unwrap(),
            None
        );
        assert!(matches!(load(&mem.mem, &path), Err(KernelError::Load(..))));
        // A segment whose address wraps.
        let path = dir.path().join("wrap");
        std::fs::write(&path, elf(himem, &[(u64::MAX - 0x10, 0x100, 0x100)])).unwrap();
        assert_eq!(
            load_direct(&mem.mem, &File::open(&path).unwrap()).unwrap(),
            None
        );
        assert!(load(&mem.mem, &path).is_err());
    }

    #[test]
    fn non_elf_is_refused() {
        let mut c = std::io::Cursor::new(b"#!/bin/sh\necho not a kernel\n".repeat(10));
        assert_eq!(entry_kind(&mut c).unwrap(), None);
        let mut c = std::io::Cursor::new(Vec::<u8>::new());
        assert_eq!(entry_kind(&mut c).unwrap(), None);
    }
}
