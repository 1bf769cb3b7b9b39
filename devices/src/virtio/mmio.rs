//! The virtio-mmio transport, version 2 ("modern" layout, virtio 1.x).
//!
//! [`MmioTransport`] is a [`BusDevice`] in front of one [`VirtioDevice`]. It holds the
//! driver-visible transport state (status, feature selectors, one [`Queue`] per device
//! queue) and hands copies of the queues to the device when the driver sets DRIVER_OK.
//!
//! Every register value is guest-controlled: out-of-order status writes, bad selectors and
//! odd-sized accesses are ignored (and logged at debug level), never fatal.
//!
//! `persist` saves the transport ([`MmioTransportState`], queue positions taken from the
//! device) and restores it in front of a fresh device, re-activating that device.

use std::sync::{Arc, Mutex};

use log::{debug, warn};
use virtio_queue::{Queue, QueueT};

use super::{GuestMemoryMmap, InterruptStatus, VirtioDevice, INT_CONFIG, VIRTIO_F_VERSION_1};
use crate::bus::{lock, BusDevice};

/// Offset of the QueueNotify register, for registering queue eventfds as KVM ioeventfds.
pub const NOTIFY_REG_OFFSET: u64 = 0x50;

/// "virt" in little endian.
pub const MMIO_MAGIC_VALUE: u32 = 0x7472_6976;
/// The transport version: 2 is the modern (virtio 1.x) register layout.
pub const MMIO_VERSION: u32 = 2;
/// Reported in VendorID.
pub const MMIO_VENDOR_ID: u32 = 0;
/// Offset where device config space starts.
pub const CONFIG_SPACE_OFFSET: u64 = 0x100;

/// Device status bits (virtio 1.2, 2.1).
pub mod status {
    pub const ACKNOWLEDGE: u32 = 0x01;
    pub const DRIVER: u32 = 0x02;
    pub const DRIVER_OK: u32 = 0x04;
    pub const FEATURES_OK: u32 = 0x08;
    pub const DEVICE_NEEDS_RESET: u32 = 0x40;
    pub const FAILED: u32 = 0x80;
}
use status::*;

const REG_MAGIC: u64 = 0x000;
const REG_VERSION: u64 = 0x004;
const REG_DEVICE_ID: u64 = 0x008;
const REG_VENDOR_ID: u64 = 0x00c;
const REG_DEVICE_FEATURES: u64 = 0x010;
const REG_DEVICE_FEATURES_SEL: u64 = 0x014;
const REG_DRIVER_FEATURES: u64 = 0x020;
const REG_DRIVER_FEATURES_SEL: u64 = 0x024;
const REG_QUEUE_SEL: u64 = 0x030;
const REG_QUEUE_NUM_MAX: u64 = 0x034;
const REG_QUEUE_NUM: u64 = 0x038;
const REG_QUEUE_READY: u64 = 0x044;
const REG_QUEUE_NOTIFY: u64 = NOTIFY_REG_OFFSET;
const REG_INTERRUPT_STATUS: u64 = 0x060;
const REG_INTERRUPT_ACK: u64 = 0x064;
const REG_STATUS: u64 = 0x070;
const REG_QUEUE_DESC_LOW: u64 = 0x080;
const REG_QUEUE_DESC_HIGH: u64 = 0x084;
const REG_QUEUE_DRIVER_LOW: u64 = 0x090;
const REG_QUEUE_DRIVER_HIGH: u64 = 0x094;
const REG_QUEUE_DEVICE_LOW: u64 = 0x0a0;
const REG_QUEUE_DEVICE_HIGH: u64 = 0x0a4;
const REG_SHM_LEN_LOW: u64 = 0x0b0;
const REG_SHM_LEN_HIGH: u64 = 0x0b4;
const REG_SHM_BASE_LOW: u64 = 0x0b8;
const REG_SHM_BASE_HIGH: u64 = 0x0bc;
const REG_CONFIG_GENERATION: u64 = 0x0fc;

/// The status values a driver passes through, in order (virtio 1.2, 3.1.1).
const STATUS_SEQUENCE: [u32; 5] = [
    0,
    ACKNOWLEDGE,
    ACKNOWLEDGE | DRIVER,
    ACKNOWLEDGE | DRIVER | FEATURES_OK,
    ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK,
];

/// A virtio-mmio (version 2) transport in front of one device.
pub struct MmioTransport {
    mem: GuestMemoryMmap,
    device: Arc<Mutex<dyn VirtioDevice>>,
    /// The device's interrupt status, read and acknowledged without the device lock
    /// (a dispatch may hold that lock while it serves a queue).
    irq_status: InterruptStatus,
    queues: Vec<Queue>,
    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    acked_features: u64,
    queue_sel: u32,
    config_generation: u32,
}

impl MmioTransport {
    /// A transport in the reset state, with one queue per entry of the device's
    /// `queue_max_sizes()`. A queue whose maximum size is invalid (0, not a power of two,
    /// above 32768) reads as QueueNumMax 0, i.e. unavailable.
    pub fn new(mem: GuestMemoryMmap, device: Arc<Mutex<dyn VirtioDevice>>) -> Self {
        let dev = lock(&device);
        let irq_status = dev.interrupt().shared_status();
        let queues = dev
            .queue_max_sizes()
            .iter()
            .map(|&max| {
                Queue::new(max).unwrap_or_else(|e| {
                    warn!("virtio-mmio: invalid queue max size {max}: {e}");
                    Queue::default()
                })
            })
            .collect();
        drop(dev);
        Self {
            mem,
            device,
            irq_status,
            queues,
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            acked_features: 0,
            queue_sel: 0,
            config_generation: 0,
        }
    }

    /// The device behind this transport.
    pub fn device(&self) -> &Arc<Mutex<dyn VirtioDevice>> {
        &self.device
    }

    /// The status the driver has set (without the device's DEVICE_NEEDS_RESET).
    pub fn driver_status(&self) -> u32 {
        self.status
    }

    /// The features the driver acknowledged (meaningful once FEATURES_OK is set).
    pub fn acked_features(&self) -> u64 {
        self.acked_features
    }

    fn driver_ok(&self) -> bool {
        self.status & DRIVER_OK != 0
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_sel as usize)
    }

    fn read_reg(&self, offset: u64) -> u32 {
        match offset {
            REG_MAGIC => MMIO_MAGIC_VALUE,
            REG_VERSION => MMIO_VERSION,
            REG_DEVICE_ID => lock(&self.device).device_type(),
            REG_VENDOR_ID => MMIO_VENDOR_ID,
            REG_DEVICE_FEATURES => {
                let features = lock(&self.device).avail_features();
                match self.device_features_sel {
                    0 => features as u32,
                    1 => (features >> 32) as u32,
                    _ => 0,
                }
            }
            REG_QUEUE_NUM_MAX => self
                .queues
                .get(self.queue_sel as usize)
                .map_or(0, |q| u32::from(q.max_size())),
            REG_QUEUE_READY => self
                .queues
                .get(self.queue_sel as usize)
                .map_or(0, |q| u32::from(q.ready())),
            REG_INTERRUPT_STATUS => self.irq_status.get(),
            REG_STATUS => {
                let needs_reset = lock(&self.device).needs_reset();
                self.status | if needs_reset { DEVICE_NEEDS_RESET } else { 0 }
            }
            // No shared memory regions: every one reads as length and base -1.
            REG_SHM_LEN_LOW | REG_SHM_LEN_HIGH | REG_SHM_BASE_LOW | REG_SHM_BASE_HIGH => u32::MAX,
            // Config space never changes under the driver's feet in our devices, so
            // this stays at its initial (or restored) value.
            REG_CONFIG_GENERATION => self.config_generation,
            _ => {
                debug!("virtio-mmio: read of unknown or write-only register {offset:#x}");
                0
            }
        }
    }

    fn write_reg(&mut self, offset: u64, v: u32) {
        match offset {
            REG_DEVICE_FEATURES_SEL => self.device_features_sel = v,
            REG_DRIVER_FEATURES_SEL => self.driver_features_sel = v,
            REG_DRIVER_FEATURES => self.write_driver_features(v),
            REG_QUEUE_SEL => self.queue_sel = v,
            REG_QUEUE_NUM
            | REG_QUEUE_READY
            | REG_QUEUE_DESC_LOW
            | REG_QUEUE_DESC_HIGH
            | REG_QUEUE_DRIVER_LOW
            | REG_QUEUE_DRIVER_HIGH
            | REG_QUEUE_DEVICE_LOW
            | REG_QUEUE_DEVICE_HIGH => self.write_queue_reg(offset, v),
            REG_QUEUE_NOTIFY => self.notify(v),
            REG_INTERRUPT_ACK => self.irq_status.ack(v),
            REG_STATUS => self.write_status(v),
            _ => debug!("virtio-mmio: write of unknown or read-only register {offset:#x}"),
        }
    }

    fn write_driver_features(&mut self, v: u32) {
        // Features are negotiated after DRIVER and before FEATURES_OK.
        if self.status != ACKNOWLEDGE | DRIVER {
            debug!(
                "virtio-mmio: DriverFeatures written in status {:#x}",
                self.status
            );
            return;
        }
        match self.driver_features_sel {
            0 => self.acked_features = (self.acked_features & !0xffff_ffff) | u64::from(v),
            1 => self.acked_features = (self.acked_features & 0xffff_ffff) | (u64::from(v) << 32),
            sel => debug!("virtio-mmio: DriverFeatures written with selector {sel}"),
        }
    }

    fn write_queue_reg(&mut self, offset: u64, v: u32) {
        if self.driver_ok() || self.status & FAILED != 0 {
            debug!("virtio-mmio: queue register {offset:#x} written after DRIVER_OK");
            return;
        }
        let sel = self.queue_sel;
        let Some(q) = self.selected_queue() else {
            debug!("virtio-mmio: queue register {offset:#x} written for missing queue {sel}");
            return;
        };
        // The Queue setters validate (size a power of two within max, ring alignment)
        // and leave the queue unchanged on a bad value.
        match offset {
            REG_QUEUE_NUM => match u16::try_from(v) {
                Ok(size) => q.set_size(size),
                Err(_) => debug!("virtio-mmio: queue size {v} too large"),
            },
            REG_QUEUE_READY => q.set_ready(v == 1),
            REG_QUEUE_DESC_LOW => q.set_desc_table_address(Some(v), None),
            REG_QUEUE_DESC_HIGH => q.set_desc_table_address(None, Some(v)),
            REG_QUEUE_DRIVER_LOW => q.set_avail_ring_address(Some(v), None),
            REG_QUEUE_DRIVER_HIGH => q.set_avail_ring_address(None, Some(v)),
            REG_QUEUE_DEVICE_LOW => q.set_used_ring_address(Some(v), None),
            REG_QUEUE_DEVICE_HIGH => q.set_used_ring_address(None, Some(v)),
            _ => {}
        }
    }

    fn notify(&self, v: u32) {
        let dev = lock(&self.device);
        match dev.queue_events().get(v as usize) {
            Some(evt) => {
                if let Err(e) = evt.write(1) {
                    warn!("virtio-mmio: cannot signal queue {v}: {e}");
                }
            }
            None => debug!("virtio-mmio: notify for missing queue {v}"),
        }
    }

    fn write_status(&mut self, v: u32) {
        if v == 0 {
            self.reset();
            return;
        }
        if v & FAILED != 0 {
            // The driver gave up; only a reset brings the device back.
            self.status |= FAILED;
            return;
        }
        if self.status & (FAILED | DEVICE_NEEDS_RESET) != 0 {
            debug!("virtio-mmio: status {v:#x} written to a failed device");
            return;
        }
        // DEVICE_NEEDS_RESET is the device's to set; drivers may echo it back.
        let v = v & !DEVICE_NEEDS_RESET;
        let cur = self.status;
        let (Some(from), Some(to)) = (
            STATUS_SEQUENCE.iter().position(|&s| s == cur),
            STATUS_SEQUENCE.iter().position(|&s| s == v),
        ) else {
            debug!("virtio-mmio: status {v:#x} refused in status {cur:#x}");
            return;
        };
        // Bits are set in order; setting several next ones at once keeps that order.
        if to <= from {
            if to < from {
                debug!("virtio-mmio: status {v:#x} refused in status {cur:#x}");
            }
            return;
        }
        if v & FEATURES_OK != 0 && cur & FEATURES_OK == 0 && !self.features_acceptable() {
            return;
        }
        self.status = v;
        if v & DRIVER_OK != 0 {
            self.activate();
        }
    }

    fn features_acceptable(&self) -> bool {
        let offered = lock(&self.device).avail_features();
        let unoffered = self.acked_features & !offered;
        if unoffered != 0 {
            debug!("virtio-mmio: FEATURES_OK refused, driver acked unoffered {unoffered:#x}");
            return false;
        }
        if offered & VIRTIO_F_VERSION_1 != 0 && self.acked_features & VIRTIO_F_VERSION_1 == 0 {
            debug!("virtio-mmio: FEATURES_OK refused, driver did not ack VERSION_1");
            return false;
        }
        true
    }

    /// DRIVER_OK: validates the ready queues and starts the device. On failure the
    /// device is marked DEVICE_NEEDS_RESET and the driver gets a config interrupt.
    fn activate(&mut self) {
        let mut queues = Vec::with_capacity(self.queues.len());
        for (i, q) in self.queues.iter().enumerate() {
            if q.ready() && !q.is_valid(&self.mem) {
                warn!("virtio-mmio: queue {i} is not valid at DRIVER_OK");
                return self.fail_activation();
            }
            match Queue::try_from(q.state()) {
                Ok(copy) => queues.push(copy),
                Err(e) => {
                    warn!("virtio-mmio: queue {i} cannot be handed to the device: {e}");
                    return self.fail_activation();
                }
            }
        }
        let res = lock(&self.device).activate(self.mem.clone(), self.acked_features, queues);
        if let Err(e) = res {
            warn!("virtio-mmio: device activation failed: {e}");
            self.fail_activation();
        }
    }

    fn fail_activation(&mut self) {
        self.status |= DEVICE_NEEDS_RESET;
        if let Err(e) = lock(&self.device).interrupt().trigger(INT_CONFIG) {
            warn!("virtio-mmio: cannot raise config interrupt: {e}");
        }
    }

    fn reset(&mut self) {
        {
            let mut dev = lock(&self.device);
            dev.reset();
            dev.interrupt().clear();
        }
        for q in &mut self.queues {
            q.reset();
        }
        self.status = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.acked_features = 0;
        self.queue_sel = 0;
    }
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if offset >= CONFIG_SPACE_OFFSET {
            if matches!(data.len(), 1 | 2 | 4 | 8) {
                lock(&self.device).read_config(offset - CONFIG_SPACE_OFFSET, data);
            } else {
                debug!("virtio-mmio: {}-byte config read ignored", data.len());
            }
            return;
        }
        if data.len() != 4 || !offset.is_multiple_of(4) {
            debug!(
                "virtio-mmio: {}-byte read at {offset:#x} ignored",
                data.len()
            );
            return;
        }
        data.copy_from_slice(&self.read_reg(offset).to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= CONFIG_SPACE_OFFSET {
            if matches!(data.len(), 1 | 2 | 4 | 8) {
                lock(&self.device).write_config(offset - CONFIG_SPACE_OFFSET, data);
            } else {
                debug!("virtio-mmio: {}-byte config write ignored", data.len());
            }
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            debug!(
                "virtio-mmio: {}-byte write at {offset:#x} ignored",
                data.len()
            );
            return;
        };
        if !offset.is_multiple_of(4) {
            debug!("virtio-mmio: unaligned write at {offset:#x} ignored");
            return;
        }
        self.write_reg(offset, u32::from_le_bytes(bytes));
    }
}

mod persist;
#[cfg(test)]
mod tests;

pub use persist::{MmioRestoreArgs, MmioTransportState, VirtqueueState};
