//! What the VMM hands over in `struct boot_params` (the Linux zero page): the e820
//! map and the command line, with its `virtio_mmio.device=` entries.

use guest_abi::layout::{CMDLINE_MAX, GIB, TESTGUEST_SCRATCH};

const E820_ENTRIES: u64 = 0x1e8;
const CMD_LINE_PTR: u64 = 0x228;
const E820_TABLE: u64 = 0x2d0;
const E820_MAX: usize = 128;
const E820_RAM: u32 = 1;
/// What the test guest's page tables map.
const MAPPED_END: u64 = 16 * GIB;
const MAX_RANGES: usize = 32;

/// Usable RAM (merged, sorted) and the command line.
pub struct BootInfo {
    ram: [(u64, u64); MAX_RANGES],
    nram: usize,
    cmdline: &'static [u8],
}

/// A `virtio_mmio.device=<size>@<addr>:<gsi>` entry.
#[derive(Clone, Copy, Debug)]
pub struct VirtioDev {
    pub addr: u64,
    pub gsi: u32,
}

fn read<T: Copy>(addr: u64) -> T {
    // SAFETY: `addr` is inside the zero page or the command line the VMM wrote
    // before boot, identity-mapped and never written again.
    unsafe { (addr as *const T).read_unaligned() }
}

impl BootInfo {
    pub fn read(zero_page: u64) -> Self {
        let mut info = Self {
            ram: [(0, 0); MAX_RANGES],
            nram: 0,
            cmdline: &[],
        };
        let n = (read::<u8>(zero_page + E820_ENTRIES) as usize).min(E820_MAX);
        for i in 0..n {
            let e = zero_page + E820_TABLE + 20 * i as u64;
            let (addr, size, ty) = (read::<u64>(e), read::<u64>(e + 8), read::<u32>(e + 16));
            if ty == E820_RAM && size > 0 {
                info.add_ram(addr, addr.saturating_add(size));
            }
        }
        let p = read::<u32>(zero_page + CMD_LINE_PTR) as u64;
        if p != 0 {
            let len = (0..CMDLINE_MAX)
                .find(|&i| read::<u8>(p + i) == 0)
                .unwrap_or(CMDLINE_MAX);
            // SAFETY: `len` bytes from `p` were just read one by one; the command
            // line is never written after boot.
            info.cmdline = unsafe { core::slice::from_raw_parts(p as *const u8, len as usize) };
        }
        info
    }

    /// Inserts `[start, end)` keeping the ranges sorted and merged.
    fn add_ram(&mut self, mut start: u64, mut end: u64) {
        let mut out = [(0, 0); MAX_RANGES];
        let mut n = 0;
        let mut placed = false;
        for &(s, e) in &self.ram[..self.nram] {
            if e < start || s > end {
                if s > end && !placed {
                    out[n] = (start, end);
                    n += 1;
                    placed = true;
                }
                if n < MAX_RANGES {
                    out[n] = (s, e);
                    n += 1;
                }
            } else {
                start = start.min(s);
                end = end.max(e);
            }
        }
        if !placed && n < MAX_RANGES {
            out[n] = (start, end);
            n += 1;
        }
        self.ram = out;
        self.nram = n;
    }

    pub fn ram(&self) -> &[(u64, u64)] {
        &self.ram[..self.nram]
    }

    /// Bytes of usable RAM.
    pub fn usable_bytes(&self) -> u64 {
        self.ram().iter().map(|&(s, e)| e - s).sum()
    }

    /// End of the highest usable range.
    pub fn ram_end(&self) -> u64 {
        self.ram().last().map_or(0, |r| r.1)
    }

    /// Whether `[gpa, gpa + len)` is usable RAM the host may lend the guest: at or
    /// above the scratch area (never the guest's own image) and mapped.
    pub fn buffer_ok(&self, gpa: u64, len: u64) -> bool {
        let Some(end) = gpa.checked_add(len) else {
            return false;
        };
        gpa >= TESTGUEST_SCRATCH
            && end <= MAPPED_END
            && self.ram().iter().any(|&(s, e)| s <= gpa && end <= e)
    }

    /// Whether the command line holds `word` as a whole word.
    pub fn has_word(&self, word: &[u8]) -> bool {
        self.words().any(|w| w == word)
    }

    fn words(&self) -> impl Iterator<Item = &'static [u8]> {
        self.cmdline
            .split(|&b| b == b' ' || b == b'\t' || b == b'\n')
            .filter(|w| !w.is_empty())
    }

    /// The virtio-mmio devices, in command-line order.
    pub fn virtio_devices(&self) -> impl Iterator<Item = VirtioDev> {
        self.words()
            .filter_map(|w| w.strip_prefix(b"virtio_mmio.device="))
            .filter_map(parse_virtio)
    }
}

/// `<size>@<addr>:<gsi>[:<id>]`, numbers as Linux's memparse reads them.
fn parse_virtio(s: &[u8]) -> Option<VirtioDev> {
    let at = s.iter().position(|&b| b == b'@')?;
    let (size, rest) = (&s[..at], &s[at + 1..]);
    memparse(size)?;
    let colon = rest.iter().position(|&b| b == b':')?;
    let addr = memparse(&rest[..colon])?;
    let gsi = rest[colon + 1..].split(|&b| b == b':').next()?;
    let gsi = u32::try_from(number(gsi)?).ok()?;
    Some(VirtioDev { addr, gsi })
}

/// A number with an optional K/M/G suffix.
fn memparse(s: &[u8]) -> Option<u64> {
    let (digits, shift) = match s.last()? {
        b'K' | b'k' => (&s[..s.len() - 1], 10),
        b'M' | b'm' => (&s[..s.len() - 1], 20),
        b'G' | b'g' => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    number(digits)?.checked_mul(1 << shift)
}

/// Decimal, or hexadecimal with `0x`.
fn number(s: &[u8]) -> Option<u64> {
    let (digits, radix) = match s {
        [b'0', b'x' | b'X', rest @ ..] => (rest, 16),
        _ => (s, 10),
    };
    if digits.is_empty() {
        return None;
    }
    let mut v: u64 = 0;
    for &b in digits {
        let d = (b as char).to_digit(radix)?;
        v = v.checked_mul(radix as u64)?.checked_add(d as u64)?;
    }
    Some(v)
}
