//! Sprout's test guest, built by this crate's build script from guest/testguest
//! (a `no_std` kernel for `x86_64-unknown-none`; see its boot.rs for the entry
//! contract and guest_abi::mailbox for the protocol).

/// Absolute path of the built test guest ELF.
pub const TESTGUEST_PATH: &str = env!("TESTGUEST_PATH");

#[cfg(test)]
mod tests {
    use super::TESTGUEST_PATH;
    use guest_abi::layout::{HIMEM_START, TESTGUEST_SCRATCH};
    use guest_abi::mailbox::{find_note, PROTOCOL_VERSION};

    const PT_LOAD: u32 = 1;
    const PT_NOTE: u32 = 4;
    const PF_X: u32 = 1;

    fn u16_at(b: &[u8], at: usize) -> u16 {
        u16::from_le_bytes(b[at..at + 2].try_into().unwrap())
    }
    fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }
    fn u64_at(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
    }

    #[test]
    fn testguest_is_a_static_x86_64_elf_with_the_sprout_note() {
        let elf = std::fs::read(TESTGUEST_PATH).expect("the test guest was built");
        assert_eq!(&elf[..4], b"\x7fELF");
        assert_eq!(elf[4], 2, "ELF64");
        assert_eq!(elf[5], 1, "little-endian");
        assert_eq!(u16_at(&elf, 16), 2, "ET_EXEC (static, not PIE)");
        assert_eq!(u16_at(&elf, 18), 62, "EM_X86_64");
        let entry = u64_at(&elf, 24);
        let phoff = u64_at(&elf, 32) as usize;
        let (phentsize, phnum) = (u16_at(&elf, 54) as usize, u16_at(&elf, 56) as usize);

        let (mut loads, mut note, mut entry_ok) = (0, None, false);
        for i in 0..phnum {
            let ph = &elf[phoff + i * phentsize..][..phentsize];
            let (ty, flags) = (u32_at(ph, 0), u32_at(ph, 4));
            let (off, vaddr, paddr) = (u64_at(ph, 8) as usize, u64_at(ph, 16), u64_at(ph, 24));
            let (filesz, memsz) = (u64_at(ph, 32), u64_at(ph, 40));
            match ty {
                PT_LOAD => {
                    loads += 1;
                    assert_eq!(paddr, vaddr, "identity-mapped segment");
                    assert!(filesz <= memsz);
                    assert!(vaddr >= HIMEM_START, "segment at {vaddr:#x} below 1 MiB");
                    assert!(
                        vaddr + memsz <= TESTGUEST_SCRATCH,
                        "segment at {vaddr:#x} ends past 16 MiB"
                    );
                    entry_ok |= flags & PF_X != 0 && (vaddr..vaddr + filesz).contains(&entry);
                }
                PT_NOTE => note = note.or(find_note(&elf[off..off + filesz as usize])),
                _ => {}
            }
        }
        assert!(loads > 0);
        assert_eq!(entry, HIMEM_START, "entry point");
        assert!(entry_ok, "the entry point is in an executable segment");
        assert_eq!(note, Some(PROTOCOL_VERSION), "the Sprout note");
    }
}
