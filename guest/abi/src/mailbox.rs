//! The test guest's command mailbox.
//!
//! Guest RAM at [`crate::layout::MAILBOX_GPA`] holds one [`Slot`] per vCPU
//! (`SLOT_SIZE` bytes apart). To run a command on vCPU `c` the host:
//! 1. writes `cmd` and `args` into slot `c`, then `seq` (incremented, release order);
//! 2. raises GSI `MAILBOX_GSI_BASE + c` (the guest halts when idle and wakes on it).
//!
//! The guest's vCPU `c` sees `seq != done_seq`, runs the command, writes `rets`
//! and `status`, then `done_seq = seq`, and finally writes `c` to the doorbell
//! register [`REG_DONE`] of the mailbox device at `MAILBOX_MMIO`, which tells the
//! host without polling. Every vCPU writes its index to [`REG_READY`] once it serves
//! its slot; a fatal guest error is reported through [`REG_PANIC`].
//!
//! Only vCPU 0 drives devices (blk, vsock, rng); every vCPU answers the memory commands.
//! A device command (`CMD_BLK_*`, `CMD_VSOCK_SEND`, `CMD_RNG_READ`, `CMD_FLOOD`) sent
//! to another vCPU answers [`STATUS_NO_DEVICE`]; `CMD_PROBE` answers on every vCPU.
//! Everything the guest writes is untrusted by the host.
//!
//! The test guest's ELF carries a note ([`NOTE_NAME`], [`NOTE_TYPE`], a 4-byte
//! descriptor holding [`PROTOCOL_VERSION`]) in a `PT_NOTE` segment: a VMM that finds
//! it ([`find_note`]) starts every vCPU at the ELF entry point in long mode.

/// Bytes between two slots.
pub const SLOT_SIZE: u64 = 256;

/// One vCPU's slot. Offsets are part of the ABI.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Slot {
    /// Host: bumped to post a command.
    pub seq: u32,
    /// Host: a `CMD_*` value.
    pub cmd: u32,
    /// Host: arguments, meaning per command.
    pub args: [u64; 4],
    /// Guest: equals `seq` once the command is done.
    pub done_seq: u32,
    /// Guest: a `STATUS_*` value.
    pub status: u32,
    /// Guest: results, meaning per command.
    pub rets: [u64; 4],
    /// Guest: the counter `CMD_COUNT` advances (kept across commands).
    pub counter: u64,
}

pub const OFF_SEQ: u64 = 0;
pub const OFF_CMD: u64 = 4;
pub const OFF_ARGS: u64 = 8;
pub const OFF_DONE_SEQ: u64 = 40;
pub const OFF_STATUS: u64 = 44;
pub const OFF_RETS: u64 = 48;
pub const OFF_COUNTER: u64 = 80;

const _: () = assert!(core::mem::size_of::<Slot>() as u64 <= SLOT_SIZE);
const _: () = assert!(core::mem::offset_of!(Slot, done_seq) as u64 == OFF_DONE_SEQ);
const _: () = assert!(core::mem::offset_of!(Slot, rets) as u64 == OFF_RETS);
const _: () = assert!(core::mem::offset_of!(Slot, counter) as u64 == OFF_COUNTER);

// Doorbell device registers (32-bit writes at MAILBOX_MMIO + offset).
/// Guest writes its vCPU index: the command in its slot is done.
pub const REG_DONE: u64 = 0x0;
/// Guest writes a panic code: it hit a fatal error (see `PANIC_*`); vCPU then halts forever.
pub const REG_PANIC: u64 = 0x4;
/// Guest writes its vCPU index once it serves its slot.
pub const REG_READY: u64 = 0x8;
/// Guest writes the faulting RIP just before `REG_PANIC` when it can.
pub const REG_PANIC_RIP: u64 = 0xc;

/// Panic codes below 32 are CPU exception vectors taken in user mode; 32..=255 are
/// interrupt vectors the guest does not expect. [`PANIC_USER`] is a panic of the
/// guest's own code (its message went to the serial console first).
pub const PANIC_USER: u32 = 0x100;

// Commands. `args`/`rets` as listed; buffers are guest physical addresses at or
// above `layout::TESTGUEST_SCRATCH`.
/// args[0] = value. rets[0] = value, rets[1] = vCPU index.
pub const CMD_ECHO: u32 = 1;
/// args = [gpa, pages, seed]: write `pattern_word(seed, addr)` at every 8-byte word.
/// rets[0] = checksum of what was written.
pub const CMD_FILL: u32 = 2;
/// args = [gpa, pages]: rets[0] = checksum of the words there.
pub const CMD_CHECKSUM: u32 = 3;
/// args[0] = iterations: add 1 to `Slot::counter` that many times in a loop. rets[0] = counter.
pub const CMD_COUNT: u32 = 4;
/// rets[0] = usable RAM bytes in the e820 map, rets[1] = end of the highest usable
/// range, rets[2] = 1 if the last page of RAM was written and read back.
pub const CMD_MEMINFO: u32 = 5;
/// args = [dev, sector, gpa, sectors]: read `sectors` 512-byte sectors into gpa.
pub const CMD_BLK_READ: u32 = 6;
/// args = [dev, sector, gpa, sectors]: write from gpa.
pub const CMD_BLK_WRITE: u32 = 7;
/// args[0] = dev.
pub const CMD_BLK_FLUSH: u32 = 8;
/// args = [dev, gpa]: the 20-byte device id lands at gpa.
pub const CMD_BLK_ID: u32 = 9;
/// args = [port, gpa, len]: connect to host CID 2 `port`, send `len` bytes from gpa,
/// wait for the reply (up to 4096 bytes, until the host sends and shuts down or
/// the first data), store it at gpa. rets[0] = reply length.
pub const CMD_VSOCK_SEND: u32 = 10;
/// Reset the machine through the i8042 controller. No reply.
pub const CMD_RESET: u32 = 11;
/// args = [gpa, len]: print len bytes to the serial console.
pub const CMD_PRINT: u32 = 12;
/// rets[0] = virtio-blk devices found, rets[1] = 1 if vsock found, rets[2] = 1 if rng found,
/// rets[3] = the guest CID the vsock device reports.
pub const CMD_PROBE: u32 = 13;
/// args = [gpa, len]: fill with bytes from virtio-rng (len <= 4096).
pub const CMD_RNG_READ: u32 = 14;
/// Hostile flood, for tests of the host's control under a guest that never lets a
/// device queue rest. args = [targets, blk dev, gpa, sectors]: `targets` is a mask of
/// [`FLOOD_BLK`] (read `sectors` sectors, 1..=2048, into gpa from sector 0 of blk
/// `dev`) and [`FLOOD_RNG`] (fill [`FLOOD_RNG_BYTES`] bytes at gpa + sectors * 512).
/// vCPU 0 answers STATUS_OK (rets[0] = the targets flooded) and then, in user mode,
/// forever: keeps every entry of each target's queue posted (the same descriptors
/// again and again, the avail index bumped as soon as the device returns one, never
/// more than a queue's worth ahead), writes QueueNotify on every pass whatever the
/// device's NO_NOTIFY flag says, never idles and never acknowledges an interrupt.
/// `Slot::counter` of vCPU 0 counts the chains the devices returned, and the two
/// words at [`flood_counts_gpa`] count them per device (blk, rng), so the host can see
/// each queue served. vCPU 0 serves no command after this; the others do.
pub const CMD_FLOOD: u32 = 15;
/// args = [gpa, len]: send the `len` bytes at gpa (a frame after its 12-byte
/// virtio-net header) on virtio-net's transmit queue. rets[0] = the used length.
pub const CMD_NET_SEND: u32 = 16;
/// args = [gpa, cap]: post a `cap`-byte receive buffer at gpa on virtio-net and
/// wait for a frame. rets[0] = its length, header included.
pub const CMD_NET_RECV: u32 = 17;
/// args = [leaf, subleaf]: rets = the CPUID instruction's eax, ebx, ecx,
/// edx on this vCPU.
pub const CMD_CPUID: u32 = 18;
/// `CMD_FLOOD` target: virtio-blk reads.
pub const FLOOD_BLK: u64 = 1;
/// `CMD_FLOOD` target: virtio-rng reads.
pub const FLOOD_RNG: u64 = 2;
/// Bytes per virtio-rng request of `CMD_FLOOD`.
pub const FLOOD_RNG_BYTES: u64 = 256;
/// Bytes `CMD_FLOOD` uses from its gpa: blk data, rng data, the two counters.
pub const fn flood_bytes(sectors: u64) -> u64 {
    sectors * 512 + FLOOD_RNG_BYTES + 16
}
/// Where `CMD_FLOOD` keeps its per-device counters (two u64: blk chains, rng chains).
pub const fn flood_counts_gpa(gpa: u64, sectors: u64) -> u64 {
    gpa + sectors * 512 + FLOOD_RNG_BYTES
}

pub const STATUS_OK: u32 = 0;
pub const STATUS_BAD_CMD: u32 = 1;
pub const STATUS_NO_DEVICE: u32 = 2;
pub const STATUS_IO_ERROR: u32 = 3;
pub const STATUS_BAD_ARG: u32 = 4;
pub const STATUS_REFUSED: u32 = 5;

/// The test guest always listens on this vsock port and echoes what it receives.
pub const VSOCK_ECHO_PORT: u32 = 1234;

/// Name of the ELF note that marks the test guest (NUL included, as in the ELF file).
pub const NOTE_NAME: &[u8] = b"Sprout\0";
/// Type of that note ("SPRT").
pub const NOTE_TYPE: u32 = 0x5350_5254;
/// Its descriptor: a little-endian u32, the version of this protocol.
pub const PROTOCOL_VERSION: u32 = 1;

/// Looks for the Sprout note in the bytes of one `PT_NOTE` segment (its `p_filesz`
/// bytes from `p_offset`) and returns the protocol version it carries.
///
/// Notes are `namesz: u32, descsz: u32, type: u32`, then the name and the descriptor,
/// each padded to 4 bytes (ELF64 files in practice use 4-byte note alignment).
pub fn find_note(mut segment: &[u8]) -> Option<u32> {
    fn u32_at(b: &[u8], at: usize) -> Option<u32> {
        Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
    }
    const fn pad4(n: usize) -> usize {
        (n + 3) & !3
    }
    while segment.len() >= 12 {
        let namesz = u32_at(segment, 0)? as usize;
        let descsz = u32_at(segment, 4)? as usize;
        let ty = u32_at(segment, 8)?;
        let name = segment.get(12..12 + namesz)?;
        let desc_at = 12 + pad4(namesz);
        let desc = segment.get(desc_at..desc_at + descsz)?;
        if ty == NOTE_TYPE && name == NOTE_NAME && descsz == 4 {
            return u32_at(desc, 0);
        }
        segment = segment.get(desc_at + pad4(descsz)..)?;
    }
    None
}

/// The word `CMD_FILL` writes at guest physical address `addr` (a splitmix64 step).
pub const fn pattern_word(seed: u64, addr: u64) -> u64 {
    let mut z = seed ^ addr.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Folds one word into a running checksum (start from 0), in address order.
pub const fn checksum_step(acc: u64, word: u64) -> u64 {
    (acc.rotate_left(7) ^ word).wrapping_mul(0x100_0000_01b3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_differs_by_seed_and_address() {
        assert_ne!(pattern_word(1, 0x1000), pattern_word(2, 0x1000));
        assert_ne!(pattern_word(1, 0x1000), pattern_word(1, 0x1008));
        assert_ne!(checksum_step(0, 1), checksum_step(0, 2));
    }

    #[test]
    fn finds_the_note_after_others() {
        let mut seg = [0u8; 64];
        // A "Xen" note with a 3-byte descriptor, then ours.
        seg[0..4].copy_from_slice(&4u32.to_le_bytes());
        seg[4..8].copy_from_slice(&3u32.to_le_bytes());
        seg[8..12].copy_from_slice(&18u32.to_le_bytes());
        seg[12..16].copy_from_slice(b"Xen\0");
        seg[20..24].copy_from_slice(&7u32.to_le_bytes());
        seg[24..28].copy_from_slice(&4u32.to_le_bytes());
        seg[28..32].copy_from_slice(&NOTE_TYPE.to_le_bytes());
        seg[32..39].copy_from_slice(NOTE_NAME);
        seg[40..44].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        assert_eq!(find_note(&seg[..44]), Some(PROTOCOL_VERSION));
        assert_eq!(find_note(&seg[..20]), None);
        assert_eq!(find_note(&seg[..42]), None);
    }
}
