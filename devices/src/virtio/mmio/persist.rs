//! Saving a virtio-mmio transport and restoring it, with its device re-activated.
//!
//! The transport's own queue copies stop moving at DRIVER_OK: the device advances its
//! copies. So `save_state` takes each queue of an activated device from the device
//! ([`VirtioDevice::active_queues`]), with its live `next_avail`/`next_used`, and
//! `restore` hands those same queues (indices kept) to the device on the new guest
//! memory. Requests the device had not taken yet are still in the avail ring (guest
//! memory) and get served after the restore; requests it had completed are in the used
//! ring and are not served again.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueT};

use super::status::{DEVICE_NEEDS_RESET, DRIVER_OK, FAILED, FEATURES_OK};
use super::{MmioTransport, STATUS_SEQUENCE};
use crate::bus::lock;
use crate::state::{check_version, versions, Persist, StateError};
use crate::virtio::{GuestMemoryMmap, VirtioDevice, INT_CONFIG, INT_VRING, VIRTIO_F_VERSION_1};

const WHAT: &str = "virtio-mmio transport";

/// One split virtqueue as the driver set it up, with the device's ring positions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VirtqueueState {
    /// QueueNumMax: must equal the restoring device's maximum for this queue.
    pub max_size: u16,
    pub size: u16,
    pub ready: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
    /// Next avail ring entry the device takes.
    pub next_avail: u16,
    /// Next used ring entry the device fills.
    pub next_used: u16,
    /// VIRTIO_F_RING_EVENT_IDX in use.
    pub event_idx: bool,
}

impl VirtqueueState {
    fn of(q: &Queue) -> Self {
        let s = q.state();
        Self {
            max_size: s.max_size,
            size: s.size,
            ready: s.ready,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx: s.event_idx_enabled,
        }
    }

    /// The queue, checked against the device's maximum `max` (size a power of two up to
    /// it, ring addresses aligned).
    fn to_queue(&self, index: usize, max: u16) -> Result<Queue, StateError> {
        let bad = |reason: String| StateError::invalid(WHAT, format!("queue {index}: {reason}"));
        if self.max_size != max {
            return Err(StateError::mismatch(
                WHAT,
                format!(
                    "queue {index} had {} entries at most, the device has {max}",
                    self.max_size
                ),
            ));
        }
        let mut q = Queue::new(max).map_err(|e| bad(e.to_string()))?;
        q.try_set_size(self.size).map_err(|_| {
            bad(format!(
                "size {} is not a power of two up to {max}",
                self.size
            ))
        })?;
        q.try_set_desc_table_address(vm_memory::GuestAddress(self.desc_table))
            .and_then(|()| q.try_set_avail_ring_address(vm_memory::GuestAddress(self.avail_ring)))
            .and_then(|()| q.try_set_used_ring_address(vm_memory::GuestAddress(self.used_ring)))
            .map_err(|e| bad(e.to_string()))?;
        q.set_ready(self.ready);
        q.set_next_avail(self.next_avail);
        q.set_next_used(self.next_used);
        q.set_event_idx(self.event_idx);
        Ok(q)
    }
}

/// Everything the driver sees of a virtio-mmio transport, and whether its device was
/// running.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MmioTransportState {
    pub version: u16,
    /// The device's virtio id (`TYPE_*`): restoring onto another kind is refused.
    pub device_type: u32,
    /// Device status as the driver set it, plus FAILED or a failed activation's
    /// DEVICE_NEEDS_RESET.
    pub status: u32,
    pub device_features_sel: u32,
    pub driver_features_sel: u32,
    /// Driver features (as written so far; negotiated once FEATURES_OK is set).
    pub acked_features: u64,
    pub queue_sel: u32,
    /// One per device queue.
    pub queues: Vec<VirtqueueState>,
    /// InterruptStatus (`INT_VRING`, `INT_CONFIG`).
    pub interrupt_status: u32,
    pub config_generation: u32,
    /// The device was serving its queues: restore re-activates it.
    pub device_activated: bool,
}

/// What restoring a [`MmioTransport`] needs besides its state.
pub struct MmioRestoreArgs {
    /// The (restored) guest memory.
    pub mem: GuestMemoryMmap,
    /// The device behind the transport, fresh or restored from its own state.
    pub device: Arc<Mutex<dyn VirtioDevice>>,
}

impl Persist for MmioTransport {
    type State = MmioTransportState;
    type RestoreArgs = MmioRestoreArgs;

    /// The transport's state, queue positions included. Call it between event-loop
    /// dispatches and without holding the device's lock (this takes it).
    fn save(&self) -> MmioTransportState {
        let dev = lock(&self.device);
        let activated = dev.is_activated();
        let live = dev.active_queues();
        let queues = self
            .queues
            .iter()
            .enumerate()
            .map(|(i, q)| match live.get(i) {
                Some(l) if activated => VirtqueueState::of(l),
                _ => VirtqueueState::of(q),
            })
            .collect();
        MmioTransportState {
            version: versions::MMIO_TRANSPORT,
            device_type: dev.device_type(),
            status: self.status,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            acked_features: self.acked_features,
            queue_sel: self.queue_sel,
            queues,
            interrupt_status: dev.interrupt().status(),
            config_generation: self.config_generation,
            device_activated: activated,
        }
    }

    /// A transport in `state` in front of `device` (fresh, or restored from its own
    /// state), on guest memory `mem`. If the device was activated it is activated again
    /// with the saved queues, ring positions kept, so it goes on serving from where it
    /// was. Every value is checked first: an impossible state is an error and leaves
    /// the device untouched.
    fn restore(args: MmioRestoreArgs, state: &MmioTransportState) -> Result<Self, StateError> {
        let MmioRestoreArgs { mem, device } = args;
        check_version(WHAT, state.version, versions::MMIO_TRANSPORT)?;
        let build_queues = |dev: &dyn VirtioDevice| {
            state
                .queues
                .iter()
                .zip(dev.queue_max_sizes())
                .enumerate()
                .map(|(i, (q, &max))| q.to_queue(i, max))
                .collect::<Result<Vec<_>, _>>()
        };
        let (queues, device_queues, irq_status) = {
            let dev = lock(&device);
            check_against_device(&*dev, state)?;
            let queues = build_queues(&*dev)?;
            if state.device_activated {
                for (i, q) in queues.iter().enumerate() {
                    if q.ready() && !q.is_valid(&mem) {
                        return Err(StateError::invalid(
                            WHAT,
                            format!("queue {i} rings are outside guest memory"),
                        ));
                    }
                }
            }
            (
                queues,
                build_queues(&*dev)?,
                dev.interrupt().shared_status(),
            )
        };
        let transport = Self {
            mem,
            device,
            irq_status,
            queues,
            status: state.status,
            device_features_sel: state.device_features_sel,
            driver_features_sel: state.driver_features_sel,
            acked_features: state.acked_features,
            queue_sel: state.queue_sel,
            config_generation: state.config_generation,
        };
        {
            let mut dev = lock(&transport.device);
            if state.device_activated {
                dev.activate(transport.mem.clone(), state.acked_features, device_queues)
                    .map_err(|source| StateError::Activate { what: WHAT, source })?;
            }
            if let Err(e) = dev.interrupt().restore_status(state.interrupt_status) {
                log::warn!("virtio-mmio: cannot raise the restored interrupt: {e}");
            }
        }
        Ok(transport)
    }
}

/// Checks a state's transport-level values against each other and the device.
fn check_against_device(dev: &dyn VirtioDevice, s: &MmioTransportState) -> Result<(), StateError> {
    let invalid = |reason: String| Err(StateError::invalid(WHAT, reason));
    let mismatch = |reason: String| Err(StateError::mismatch(WHAT, reason));
    if s.device_type != dev.device_type() {
        return mismatch(format!(
            "saved for device type {}, restoring onto type {}",
            s.device_type,
            dev.device_type()
        ));
    }
    let count = dev.queue_max_sizes().len();
    if s.queues.len() != count {
        return mismatch(format!(
            "{} queues saved, the device has {count}",
            s.queues.len()
        ));
    }
    let driver_bits = s.status & !(FAILED | DEVICE_NEEDS_RESET);
    if !STATUS_SEQUENCE.contains(&driver_bits)
        || (s.status & DEVICE_NEEDS_RESET != 0 && s.status & DRIVER_OK == 0)
    {
        return invalid(format!("status {:#x} is impossible", s.status));
    }
    if s.device_activated && (s.status & DRIVER_OK == 0 || s.status & DEVICE_NEEDS_RESET != 0) {
        return invalid(format!("device is active in status {:#x}", s.status));
    }
    if s.status & FEATURES_OK != 0 {
        let offered = dev.avail_features();
        let unoffered = s.acked_features & !offered;
        if unoffered != 0 {
            return mismatch(format!("acked features {unoffered:#x} are not offered"));
        }
        if offered & VIRTIO_F_VERSION_1 != 0 && s.acked_features & VIRTIO_F_VERSION_1 == 0 {
            return invalid("features were accepted without VERSION_1".into());
        }
    }
    if s.interrupt_status & !(INT_VRING | INT_CONFIG) != 0 {
        return invalid(format!(
            "interrupt status {:#x} has unknown bits",
            s.interrupt_status
        ));
    }
    if dev.is_activated() {
        return mismatch("the device is already active".into());
    }
    if let Some(d) = dev.restored_state() {
        if d.activated != s.device_activated {
            return mismatch(format!(
                "device state says active {}, transport state says {}",
                d.activated, s.device_activated
            ));
        }
        if d.activated && d.acked_features != s.acked_features {
            return mismatch(format!(
                "device acked {:#x}, transport acked {:#x}",
                d.acked_features, s.acked_features
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
