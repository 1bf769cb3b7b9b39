//! The virtio-mmio transport's registers, driven by a hostile guest driver: a sequence
//! of reads and writes of any offset, width and value in front of a virtio-rng device,
//! with the device serving its queue in between, over guest RAM filled from the input
//! (so the queue the driver sets up may point at anything).
//!
//! Input: byte 0 is the number of operations, then 8 bytes per operation
//! (`[op, offset lo, offset hi, width, value u32 LE]`, width picking 4, 1, 2, 8, 3
//! or 0 bytes), then guest RAM from address 0. `op % 4`: 0 read, 1 write, 2 the
//! device serves its queue (as the event loop does after a notify), 3 a 4-byte write
//! of a register from [`REGS`] (the offset's low byte picks it), so that fuzzing
//! finds the driver's path through the status sequence quickly.
//!
//! Nothing may panic, and after every operation the transport's state is consistent:
//! its status is a prefix of the virtio status sequence (plus FAILED and
//! DEVICE_NEEDS_RESET), the device is active exactly when the driver set DRIVER_OK
//! and activation did not fail, acknowledged features were offered, and the constant
//! registers read their constants. At the end the transport and device are saved and
//! restored in front of a fresh device, and save again to the same state.

#![no_main]

use std::sync::{Arc, Mutex};

use devices::state::Persist;
use devices::virtio::mmio::{
    status, MmioRestoreArgs, MmioTransport, MMIO_MAGIC_VALUE, MMIO_VERSION,
};
use devices::virtio::rng::Rng;
use devices::virtio::VirtioDevice;
use devices::BusDevice;
use libfuzzer_sys::fuzz_target;
use sprout_fuzz::{fill_data, guest_memory, take, take_u8};

const RAM: u64 = 0x1_0000;

/// The registers a driver writes (virtio 1.2, 4.2.2), two read-only ones and the
/// start of config space.
const REGS: [u64; 18] = [
    0x014, 0x020, 0x024, 0x030, 0x038, 0x044, 0x050, 0x064, 0x070, 0x080, 0x084, 0x090, 0x094,
    0x0a0, 0x0a4, 0x010, 0x0fc, 0x100,
];

/// The status values a driver passes through, in order.
const SEQUENCE: [u32; 5] = [
    0,
    status::ACKNOWLEDGE,
    status::ACKNOWLEDGE | status::DRIVER,
    status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
    status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK,
];

fn read(t: &mut MmioTransport, offset: u64, width: usize) -> u64 {
    let mut buf = [0xa5u8; 8];
    t.read(offset, &mut buf[..width]);
    let mut v = [0u8; 8];
    v[..width].copy_from_slice(&buf[..width]);
    u64::from_le_bytes(v)
}

fn check(t: &mut MmioTransport, rng: &Arc<Mutex<Rng>>) {
    let s = t.driver_status();
    let base = s & !(status::FAILED | status::DEVICE_NEEDS_RESET);
    assert!(SEQUENCE.contains(&base), "status {s:#x}");
    let (activated, offered, needs_reset) = {
        let d = rng.lock().unwrap();
        (d.is_activated(), d.avail_features(), d.needs_reset())
    };
    if activated {
        assert!(s & status::DRIVER_OK != 0, "active in status {s:#x}");
    } else {
        // DRIVER_OK without an active device only after a failed activation.
        assert!(
            s & status::DRIVER_OK == 0 || s & status::DEVICE_NEEDS_RESET != 0,
            "DRIVER_OK but inactive in status {s:#x}"
        );
    }
    if s & status::FEATURES_OK != 0 {
        assert_eq!(t.acked_features() & !offered, 0);
    }
    assert_eq!(read(t, 0x000, 4), u64::from(MMIO_MAGIC_VALUE));
    assert_eq!(read(t, 0x004, 4), u64::from(MMIO_VERSION));
    let shown = read(t, 0x070, 4) as u32;
    let device_reset = if needs_reset {
        status::DEVICE_NEEDS_RESET
    } else {
        0
    };
    assert_eq!(shown, s | device_reset);
    // Registers are 4 bytes wide: other widths read as zero.
    assert_eq!(read(t, 0x070, 2), 0);
}

fuzz_target!(|data: &[u8]| {
    let mut input = data;
    let ops = take_u8(&mut input);
    let mut program = take(&mut input, usize::from(ops) * 8);
    let mem = guest_memory(RAM as usize);
    fill_data(&mem, 0, RAM, input);

    let rng = Arc::new(Mutex::new(Rng::new().expect("rng")));
    let mut t = MmioTransport::new(mem.clone(), rng.clone());
    check(&mut t, &rng);
    while !program.is_empty() {
        let op = take(&mut program, 8);
        let mut b = [0u8; 8];
        b[..op.len()].copy_from_slice(op);
        let offset = u64::from(u16::from_le_bytes([b[1], b[2]])) & 0x1ff;
        let width = [4, 1, 2, 8, 3, 0][usize::from(b[3]) % 6];
        let value = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let bytes = (u64::from(value) | u64::from(value) << 32).to_le_bytes();
        match b[0] % 4 {
            0 => {
                read(&mut t, offset, width);
            }
            1 => t.write(offset, &bytes[..width]),
            2 => {
                let _ = rng.lock().unwrap().process_queue();
            }
            _ => {
                let reg = REGS[usize::from(b[1]) % REGS.len()];
                t.write(reg, &value.to_le_bytes());
            }
        }
        check(&mut t, &rng);
    }

    // A snapshot can be taken at any point the guest can reach, and restores.
    let saved = t.save();
    let dev_saved = rng.lock().unwrap().save();
    drop(t);
    let fresh = Arc::new(Mutex::new(
        Rng::restore((), &dev_saved).expect("the device's own state restores"),
    ));
    let restored = MmioTransport::restore(
        MmioRestoreArgs {
            mem,
            device: fresh.clone(),
        },
        &saved,
    )
    .expect("a saved transport restores");
    let mut restored = restored;
    check(&mut restored, &fresh);
    assert_eq!(restored.save(), saved);
    assert_eq!(fresh.lock().unwrap().save(), dev_saved);
});
