//! Transport tests against a recording dummy device.

use super::*;
use crate::virtio::{ActivateError, Interrupt, VirtioDeviceState, INT_VRING};
use vm_memory::GuestAddress;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

pub(super) const FEATURE_HIGH: u64 = 1 << 40;
pub(super) const FEATURE_LOW: u64 = 1 << 3;

#[derive(Default)]
pub(super) struct Record {
    pub activations: Vec<(u64, Vec<virtio_queue::QueueState>)>,
    pub resets: usize,
}

pub(super) struct Dummy {
    pub record: Arc<Mutex<Record>>,
    pub evts: Vec<EventFd>,
    pub interrupt: Interrupt,
    pub config: [u8; 8],
    pub fail_activate: bool,
    pub needs_reset: bool,
    pub activated: bool,
    pub queues: Vec<Queue>,
    pub restored: Option<VirtioDeviceState>,
}

impl VirtioDevice for Dummy {
    fn device_type(&self) -> u32 {
        42
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[16, 8]
    }
    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | FEATURE_HIGH | FEATURE_LOW
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            *b = *self.config.get(offset as usize + i).unwrap_or(&0);
        }
    }
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        for (i, b) in data.iter().enumerate() {
            if let Some(c) = self.config.get_mut(offset as usize + i) {
                *c = *b;
            }
        }
    }
    fn activate(
        &mut self,
        _mem: GuestMemoryMmap,
        acked: u64,
        queues: Vec<Queue>,
    ) -> Result<(), ActivateError> {
        if self.fail_activate {
            return Err(ActivateError::QueueCount {
                expected: 3,
                got: queues.len(),
            });
        }
        let states = queues.iter().map(|q| q.state()).collect();
        self.record
            .lock()
            .unwrap()
            .activations
            .push((acked, states));
        self.activated = true;
        self.queues = queues;
        Ok(())
    }
    fn reset(&mut self) {
        self.record.lock().unwrap().resets += 1;
        self.activated = false;
        self.queues.clear();
    }
    fn queue_events(&self) -> &[EventFd] {
        &self.evts
    }
    fn interrupt(&self) -> &Interrupt {
        &self.interrupt
    }
    fn needs_reset(&self) -> bool {
        self.needs_reset
    }
    fn is_activated(&self) -> bool {
        self.activated
    }
    fn active_queues(&self) -> &[Queue] {
        &self.queues
    }
    fn restored_state(&self) -> Option<VirtioDeviceState> {
        self.restored
    }
}

pub(super) fn dummy(record: Arc<Mutex<Record>>) -> Dummy {
    Dummy {
        record,
        evts: vec![
            EventFd::new(EFD_NONBLOCK).unwrap(),
            EventFd::new(EFD_NONBLOCK).unwrap(),
        ],
        interrupt: Interrupt::new().unwrap(),
        config: [1, 2, 3, 4, 5, 6, 7, 8],
        fail_activate: false,
        needs_reset: false,
        activated: false,
        queues: Vec::new(),
        restored: None,
    }
}

pub(super) fn setup() -> (MmioTransport, Arc<Mutex<Dummy>>, Arc<Mutex<Record>>) {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
    let record = Arc::new(Mutex::new(Record::default()));
    let dev = Arc::new(Mutex::new(dummy(record.clone())));
    let t = MmioTransport::new(mem, dev.clone());
    (t, dev, record)
}

pub(super) fn rd(t: &mut MmioTransport, off: u64) -> u32 {
    let mut b = [0u8; 4];
    t.read(off, &mut b);
    u32::from_le_bytes(b)
}

pub(super) fn wr(t: &mut MmioTransport, off: u64, v: u32) {
    t.write(off, &v.to_le_bytes());
}

pub(super) fn ack_features(t: &mut MmioTransport, features: u64) {
    wr(t, REG_DRIVER_FEATURES_SEL, 0);
    wr(t, REG_DRIVER_FEATURES, features as u32);
    wr(t, REG_DRIVER_FEATURES_SEL, 1);
    wr(t, REG_DRIVER_FEATURES, (features >> 32) as u32);
}

/// Sets up queue `sel` with `size` entries at `base` (desc, then avail, then used).
pub(super) fn setup_queue(t: &mut MmioTransport, sel: u32, size: u32, base: u32) {
    wr(t, REG_QUEUE_SEL, sel);
    wr(t, REG_QUEUE_NUM, size);
    wr(t, REG_QUEUE_DESC_LOW, base);
    wr(t, REG_QUEUE_DESC_HIGH, 0);
    wr(t, REG_QUEUE_DRIVER_LOW, base + 0x1000);
    wr(t, REG_QUEUE_DRIVER_HIGH, 0);
    wr(t, REG_QUEUE_DEVICE_LOW, base + 0x2000);
    wr(t, REG_QUEUE_DEVICE_HIGH, 0);
    wr(t, REG_QUEUE_READY, 1);
}

pub(super) fn to_features_ok(t: &mut MmioTransport) {
    wr(t, REG_STATUS, ACKNOWLEDGE);
    wr(t, REG_STATUS, ACKNOWLEDGE | DRIVER);
    ack_features(t, VIRTIO_F_VERSION_1 | FEATURE_LOW);
    wr(t, REG_STATUS, ACKNOWLEDGE | DRIVER | FEATURES_OK);
    assert_eq!(rd(t, REG_STATUS), ACKNOWLEDGE | DRIVER | FEATURES_OK);
}

pub(super) const ALL_OK: u32 = ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK;

#[test]
fn identification_registers() {
    let (mut t, _, _) = setup();
    assert_eq!(rd(&mut t, REG_MAGIC), 0x7472_6976);
    assert_eq!(rd(&mut t, REG_VERSION), 2);
    assert_eq!(rd(&mut t, REG_DEVICE_ID), 42);
    assert_eq!(rd(&mut t, REG_VENDOR_ID), 0);
    assert_eq!(rd(&mut t, REG_CONFIG_GENERATION), 0);
    assert_eq!(rd(&mut t, REG_STATUS), 0);
    // Write-only and unknown registers read as zero.
    assert_eq!(rd(&mut t, REG_QUEUE_NOTIFY), 0);
    assert_eq!(rd(&mut t, 0x0c0), 0);
    for reg in [
        REG_SHM_LEN_LOW,
        REG_SHM_LEN_HIGH,
        REG_SHM_BASE_LOW,
        REG_SHM_BASE_HIGH,
    ] {
        assert_eq!(rd(&mut t, reg), u32::MAX);
    }
}

#[test]
fn full_handshake_activates_with_queues() {
    let (mut t, dev, record) = setup();
    wr(&mut t, REG_STATUS, 0);
    wr(&mut t, REG_STATUS, ACKNOWLEDGE);
    wr(&mut t, REG_STATUS, ACKNOWLEDGE | DRIVER);
    wr(&mut t, REG_DEVICE_FEATURES_SEL, 0);
    assert_eq!(rd(&mut t, REG_DEVICE_FEATURES), FEATURE_LOW as u32);
    wr(&mut t, REG_DEVICE_FEATURES_SEL, 1);
    assert_eq!(
        rd(&mut t, REG_DEVICE_FEATURES),
        ((VIRTIO_F_VERSION_1 | FEATURE_HIGH) >> 32) as u32
    );
    wr(&mut t, REG_DEVICE_FEATURES_SEL, 2);
    assert_eq!(rd(&mut t, REG_DEVICE_FEATURES), 0);
    ack_features(&mut t, VIRTIO_F_VERSION_1 | FEATURE_HIGH);
    wr(&mut t, REG_STATUS, ACKNOWLEDGE | DRIVER | FEATURES_OK);
    assert_eq!(rd(&mut t, REG_STATUS), ACKNOWLEDGE | DRIVER | FEATURES_OK);

    wr(&mut t, REG_QUEUE_SEL, 0);
    assert_eq!(rd(&mut t, REG_QUEUE_NUM_MAX), 16);
    assert_eq!(rd(&mut t, REG_QUEUE_READY), 0);
    setup_queue(&mut t, 0, 8, 0x1000);
    assert_eq!(rd(&mut t, REG_QUEUE_READY), 1);
    wr(&mut t, REG_QUEUE_SEL, 1);
    assert_eq!(rd(&mut t, REG_QUEUE_NUM_MAX), 8);
    // Queue 1 is left unused (not ready).

    wr(&mut t, REG_STATUS, ALL_OK);
    assert_eq!(rd(&mut t, REG_STATUS), ALL_OK);
    assert!(dev.lock().unwrap().activated);
    {
        let rec = record.lock().unwrap();
        assert_eq!(rec.activations.len(), 1);
        let (acked, states) = &rec.activations[0];
        assert_eq!(*acked, VIRTIO_F_VERSION_1 | FEATURE_HIGH);
        assert_eq!(states.len(), 2);
        assert!(states[0].ready);
        assert_eq!(states[0].size, 8);
        assert_eq!(states[0].desc_table, 0x1000);
        assert_eq!(states[0].avail_ring, 0x2000);
        assert_eq!(states[0].used_ring, 0x3000);
        assert!(!states[1].ready);
    }
    assert_eq!(t.acked_features(), VIRTIO_F_VERSION_1 | FEATURE_HIGH);

    // Queue registers are frozen after DRIVER_OK.
    wr(&mut t, REG_QUEUE_SEL, 0);
    wr(&mut t, REG_QUEUE_READY, 0);
    wr(&mut t, REG_QUEUE_NUM, 4);
    assert_eq!(rd(&mut t, REG_QUEUE_READY), 1);
    assert_eq!(t.queues[0].size(), 8);
    // So are features.
    ack_features(&mut t, VIRTIO_F_VERSION_1);
    assert_eq!(t.acked_features(), VIRTIO_F_VERSION_1 | FEATURE_HIGH);
    // Rewriting the same status is harmless and does not activate twice.
    wr(&mut t, REG_STATUS, ALL_OK);
    assert_eq!(record.lock().unwrap().activations.len(), 1);

    // Notify writes the queue's eventfd; a bad index is ignored.
    wr(&mut t, REG_QUEUE_NOTIFY, 1);
    wr(&mut t, REG_QUEUE_NOTIFY, 2);
    wr(&mut t, REG_QUEUE_NOTIFY, u32::MAX);
    assert_eq!(dev.lock().unwrap().evts[1].read().unwrap(), 1);
    assert!(dev.lock().unwrap().evts[0].read().is_err());

    // Interrupt status and ack go through the device's Interrupt.
    dev.lock().unwrap().interrupt.trigger(INT_VRING).unwrap();
    assert_eq!(rd(&mut t, REG_INTERRUPT_STATUS), INT_VRING);
    wr(&mut t, REG_INTERRUPT_ACK, INT_VRING);
    assert_eq!(rd(&mut t, REG_INTERRUPT_STATUS), 0);

    // Reset brings everything back and resets the device.
    wr(&mut t, REG_STATUS, 0);
    assert_eq!(rd(&mut t, REG_STATUS), 0);
    // (The driver's initial reset was the first.)
    assert_eq!(record.lock().unwrap().resets, 2);
    assert!(!dev.lock().unwrap().activated);
    assert_eq!(t.acked_features(), 0);
    wr(&mut t, REG_QUEUE_SEL, 0);
    assert_eq!(rd(&mut t, REG_QUEUE_READY), 0);
    assert_eq!(t.queues[0].size(), 16);

    // And the device can be brought up again.
    to_features_ok(&mut t);
    setup_queue(&mut t, 0, 16, 0x4000);
    wr(&mut t, REG_STATUS, ALL_OK);
    assert_eq!(rd(&mut t, REG_STATUS), ALL_OK);
    assert_eq!(record.lock().unwrap().activations.len(), 2);
}

#[test]
fn out_of_order_status_writes_are_refused() {
    let (mut t, dev, record) = setup();
    // DRIVER before ACKNOWLEDGE.
    wr(&mut t, REG_STATUS, DRIVER);
    assert_eq!(rd(&mut t, REG_STATUS), 0);
    // DRIVER_OK straight away.
    wr(&mut t, REG_STATUS, DRIVER_OK);
    assert_eq!(rd(&mut t, REG_STATUS), 0);
    // FEATURES_OK without DRIVER.
    wr(&mut t, REG_STATUS, ACKNOWLEDGE);
    wr(&mut t, REG_STATUS, ACKNOWLEDGE | FEATURES_OK);
    assert_eq!(rd(&mut t, REG_STATUS), ACKNOWLEDGE);
    // Clearing a bit is refused too.
    wr(&mut t, REG_STATUS, ACKNOWLEDGE | DRIVER);
    wr(&mut t, REG_STATUS, ACKNOWLEDGE);
    assert_eq!(rd(&mut t, REG_STATUS), ACKNOWLEDGE | DRIVER);
    // DRIVER_OK before FEATURES_OK, with a gap in the bits.
    wr(&mut t, REG_STATUS, ACKNOWLEDGE | DRIVER | DRIVER_OK);
    assert_eq!(rd(&mut t, REG_STATUS), ACKNOWLEDGE | DRIVER);
    // The driver cannot set DEVICE_NEEDS_RESET.
    wr(
        &mut t,
        REG_STATUS,
        ACKNOWLEDGE | DRIVER | DEVICE_NEEDS_RESET,
    );
    assert_eq!(rd(&mut t, REG_STATUS), ACKNOWLEDGE | DRIVER);
    assert!(record.lock().unwrap().activations.is_empty());
    assert!(!dev.lock().unwrap().activated);

    // Several next bits at once keep the order: ACK|DRIVER|FEATURES_OK|DRIVER_OK.
    ack_features(&mut t, VIRTIO_F_VERSION_1);
    setup_queue(&mut t, 0, 16, 0x1000);
    wr(&mut t, REG_STATUS, ALL_OK);
    assert_eq!(rd(&mut t, REG_STATUS), ALL_OK);
    assert_eq!(record.lock().unwrap().activations.len(), 1);
}

#[test]
fn features_ok_checks_acked_features() {
    let (mut t, _, _) = setup();
    wr(&mut t, REG_STATUS, ACKNOWLEDGE);
    // Features written before DRIVER are ignored.
    ack_features(&mut t, VIRTIO_F_VERSION_1);
    assert_eq!(t.acked_features(), 0);
    wr(&mut t, REG_STATUS, ACKNOWLEDGE | DRIVER);
    // Unoffered bit 5.
    ack_features(&mut t, VIRTIO_F_VERSION_1 | 1 << 5);
    wr(&mut t, REG_STATUS, ACKNOWLEDGE | DRIVER | FEATURES_OK);
    assert_eq!(rd(&mut t, REG_STATUS), ACKNOWLEDGE | DRIVER);
    // VERSION_1 missing.
    ack_features(&mut t, FEATURE_LOW);
    wr(&mut t, REG_STATUS, ACKNOWLEDGE | DRIVER | FEATURES_OK);
    assert_eq!(rd(&mut t, REG_STATUS), ACKNOWLEDGE | DRIVER);
    // Bad selector writes are ignored.
    wr(&mut t, REG_DRIVER_FEATURES_SEL, 7);
    wr(&mut t, REG_DRIVER_FEATURES, 0xffff_ffff);
    assert_eq!(t.acked_features(), FEATURE_LOW);
    ack_features(&mut t, VIRTIO_F_VERSION_1 | FEATURE_LOW);
    wr(&mut t, REG_STATUS, ACKNOWLEDGE | DRIVER | FEATURES_OK);
    assert_eq!(rd(&mut t, REG_STATUS), ACKNOWLEDGE | DRIVER | FEATURES_OK);
    // Not writable any more.
    ack_features(&mut t, VIRTIO_F_VERSION_1);
    assert_eq!(t.acked_features(), VIRTIO_F_VERSION_1 | FEATURE_LOW);
}

#[test]
fn failed_status_sticks_until_reset() {
    let (mut t, _, record) = setup();
    to_features_ok(&mut t);
    wr(
        &mut t,
        REG_STATUS,
        ACKNOWLEDGE | DRIVER | FEATURES_OK | FAILED,
    );
    assert_eq!(
        rd(&mut t, REG_STATUS),
        ACKNOWLEDGE | DRIVER | FEATURES_OK | FAILED
    );
    setup_queue(&mut t, 0, 16, 0x1000);
    assert_eq!(rd(&mut t, REG_QUEUE_READY), 0);
    wr(&mut t, REG_STATUS, ALL_OK);
    assert!(record.lock().unwrap().activations.is_empty());
    wr(&mut t, REG_STATUS, 0);
    assert_eq!(rd(&mut t, REG_STATUS), 0);
}

#[test]
fn invalid_queue_at_driver_ok_needs_reset() {
    let (mut t, dev, record) = setup();
    to_features_ok(&mut t);
    // Rings beyond the 64 KiB of guest RAM.
    setup_queue(&mut t, 0, 16, 0xf000);
    wr(&mut t, REG_STATUS, ALL_OK);
    assert_eq!(rd(&mut t, REG_STATUS), ALL_OK | DEVICE_NEEDS_RESET);
    assert!(record.lock().unwrap().activations.is_empty());
    assert_eq!(rd(&mut t, REG_INTERRUPT_STATUS), INT_CONFIG);
    assert_eq!(dev.lock().unwrap().interrupt.eventfd().read().unwrap(), 1);
    // Nothing moves until a reset.
    wr(&mut t, REG_STATUS, ALL_OK | FAILED);
    assert_eq!(rd(&mut t, REG_STATUS) & FAILED, FAILED);
    wr(&mut t, REG_STATUS, 0);
    assert_eq!(rd(&mut t, REG_STATUS), 0);
    assert_eq!(rd(&mut t, REG_INTERRUPT_STATUS), 0);
}

#[test]
fn activation_error_needs_reset() {
    let (mut t, dev, _) = setup();
    dev.lock().unwrap().fail_activate = true;
    to_features_ok(&mut t);
    setup_queue(&mut t, 0, 16, 0x1000);
    wr(&mut t, REG_STATUS, ALL_OK);
    assert_eq!(rd(&mut t, REG_STATUS), ALL_OK | DEVICE_NEEDS_RESET);
    assert_eq!(rd(&mut t, REG_INTERRUPT_STATUS), INT_CONFIG);
}

#[test]
fn device_needs_reset_shows_in_status() {
    let (mut t, dev, _) = setup();
    to_features_ok(&mut t);
    dev.lock().unwrap().needs_reset = true;
    assert_eq!(
        rd(&mut t, REG_STATUS),
        ACKNOWLEDGE | DRIVER | FEATURES_OK | DEVICE_NEEDS_RESET
    );
    // A driver echoing the bit back still makes progress.
    setup_queue(&mut t, 0, 16, 0x1000);
    wr(&mut t, REG_STATUS, ALL_OK | DEVICE_NEEDS_RESET);
    assert_eq!(t.driver_status(), ALL_OK);
}

#[test]
fn bad_queue_selector_and_values() {
    let (mut t, _, _) = setup();
    to_features_ok(&mut t);
    wr(&mut t, REG_QUEUE_SEL, 2);
    assert_eq!(rd(&mut t, REG_QUEUE_NUM_MAX), 0);
    assert_eq!(rd(&mut t, REG_QUEUE_READY), 0);
    setup_queue(&mut t, 2, 16, 0x1000);
    assert_eq!(rd(&mut t, REG_QUEUE_READY), 0);
    wr(&mut t, REG_QUEUE_SEL, u32::MAX);
    wr(&mut t, REG_QUEUE_READY, 1);
    assert_eq!(rd(&mut t, REG_QUEUE_READY), 0);

    wr(&mut t, REG_QUEUE_SEL, 0);
    // Too large, not a power of two, zero, and truncating to 16: all refused.
    for size in [32, 12, 0, 0x1_0010] {
        wr(&mut t, REG_QUEUE_NUM, size);
        assert_eq!(t.queues[0].size(), 16);
    }
    wr(&mut t, REG_QUEUE_NUM, 4);
    assert_eq!(t.queues[0].size(), 4);
    // Misaligned ring addresses are refused.
    wr(&mut t, REG_QUEUE_DESC_LOW, 0x1001);
    wr(&mut t, REG_QUEUE_DEVICE_LOW, 0x3002);
    assert_eq!(t.queues[0].desc_table(), 0);
    assert_eq!(t.queues[0].used_ring(), 0);
    // Only 1 makes a queue ready.
    wr(&mut t, REG_QUEUE_READY, 2);
    assert_eq!(rd(&mut t, REG_QUEUE_READY), 0);
}

#[test]
fn non_word_register_accesses_are_ignored() {
    let (mut t, _, _) = setup();
    let mut b2 = [0xffu8; 2];
    t.read(REG_MAGIC, &mut b2);
    assert_eq!(b2, [0, 0]);
    let mut b8 = [0xffu8; 8];
    t.read(REG_MAGIC, &mut b8);
    assert_eq!(b8, [0; 8]);
    let mut b4 = [0xffu8; 4];
    t.read(REG_MAGIC + 2, &mut b4);
    assert_eq!(b4, [0; 4]);
    let mut b1 = [0xffu8; 1];
    t.read(REG_STATUS, &mut b1);
    assert_eq!(b1, [0]);

    t.write(REG_STATUS, &[ACKNOWLEDGE as u8]);
    t.write(REG_STATUS, &[ACKNOWLEDGE as u8, 0]);
    t.write(REG_STATUS, &u64::from(ACKNOWLEDGE).to_le_bytes());
    assert_eq!(rd(&mut t, REG_STATUS), 0);
    t.write(REG_STATUS + 1, &ACKNOWLEDGE.to_le_bytes());
    assert_eq!(rd(&mut t, REG_STATUS), 0);
    wr(&mut t, REG_STATUS, ACKNOWLEDGE);
    assert_eq!(rd(&mut t, REG_STATUS), ACKNOWLEDGE);
    // Writes to read-only registers change nothing.
    wr(&mut t, REG_MAGIC, 0);
    assert_eq!(rd(&mut t, REG_MAGIC), MMIO_MAGIC_VALUE);
}

#[test]
fn config_space_accesses() {
    let (mut t, _, _) = setup();
    let mut b1 = [0u8; 1];
    t.read(0x100 + 2, &mut b1);
    assert_eq!(b1, [3]);
    let mut b2 = [0u8; 2];
    t.read(0x100 + 6, &mut b2);
    assert_eq!(b2, [7, 8]);
    assert_eq!(rd(&mut t, 0x100), u32::from_le_bytes([1, 2, 3, 4]));
    let mut b8 = [0u8; 8];
    t.read(0x100, &mut b8);
    assert_eq!(b8, [1, 2, 3, 4, 5, 6, 7, 8]);
    // Past the end reads as zero.
    t.read(0x100 + 6, &mut b8);
    assert_eq!(b8, [7, 8, 0, 0, 0, 0, 0, 0]);
    // Odd sizes are ignored.
    let mut b3 = [0xffu8; 3];
    t.read(0x100, &mut b3);
    assert_eq!(b3, [0; 3]);
    t.write(0x100, &[9, 9, 9]);
    t.read(0x100, &mut b1);
    assert_eq!(b1, [1]);
    t.write(0x100 + 1, &[0xaa, 0xbb]);
    t.read(0x100, &mut b8);
    assert_eq!(b8, [1, 0xaa, 0xbb, 4, 5, 6, 7, 8]);
    // Offsets that would overflow are harmless.
    t.read(u64::MAX - 3, &mut [0u8; 4]);
    t.write(u64::MAX - 3, &[0u8; 4]);
}

impl MmioTransport {
    /// Test helper for device tests: what a driver does up to DRIVER_OK, accepting
    /// `features` and setting up queue `i` as `queues[i]` = (size, desc, avail, used).
    pub(crate) fn drive_to_driver_ok(&mut self, features: u64, queues: &[(u16, u64, u64, u64)]) {
        wr(self, REG_STATUS, 0);
        wr(self, REG_STATUS, ACKNOWLEDGE);
        wr(self, REG_STATUS, ACKNOWLEDGE | DRIVER);
        ack_features(self, features);
        wr(self, REG_STATUS, ACKNOWLEDGE | DRIVER | FEATURES_OK);
        for (i, &(size, desc, avail, used)) in queues.iter().enumerate() {
            wr(self, REG_QUEUE_SEL, i as u32);
            wr(self, REG_QUEUE_NUM, u32::from(size));
            for (low, addr) in [
                (REG_QUEUE_DESC_LOW, desc),
                (REG_QUEUE_DRIVER_LOW, avail),
                (REG_QUEUE_DEVICE_LOW, used),
            ] {
                wr(self, low, addr as u32);
                wr(self, low + 4, (addr >> 32) as u32);
            }
            wr(self, REG_QUEUE_READY, 1);
        }
        wr(self, REG_STATUS, ALL_OK);
        assert_eq!(rd(self, REG_STATUS), ALL_OK, "device activated");
    }
}

/// A dispatch holds the device lock for as long as it serves the queue: the driver's
/// interrupt handler (read InterruptStatus, write InterruptACK) must not wait for it.
#[test]
fn interrupt_status_and_ack_do_not_take_the_device_lock() {
    let (mut t, dev, _) = setup();
    lock(&dev).interrupt.trigger(INT_VRING).unwrap();
    let held = lock(&dev);
    let (tx, rx) = std::sync::mpsc::channel();
    let vcpu = std::thread::spawn(move || {
        let status = rd(&mut t, REG_INTERRUPT_STATUS);
        wr(&mut t, REG_INTERRUPT_ACK, status);
        let _ = tx.send(status);
        t
    });
    let got = rx.recv_timeout(std::time::Duration::from_secs(2));
    drop(held);
    let t = vcpu.join().unwrap();
    assert_eq!(
        got,
        Ok(INT_VRING),
        "the MMIO access waited for the device lock"
    );
    assert_eq!(lock(&dev).interrupt.status(), 0);
    drop(t);
}
