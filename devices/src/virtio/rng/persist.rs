//! Saving and restoring an [`Rng`] device (its queue is the transport's to restore).

use serde::{Deserialize, Serialize};

use super::device::Rng;
use crate::state::{check_version, versions, Persist, StateError};
use crate::virtio::{VirtioDevice, VirtioDeviceState};

const WHAT: &str = "virtio-rng";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {
    pub version: u16,
    pub virtio: VirtioDeviceState,
}

impl Persist for Rng {
    type State = RngState;
    /// The entropy source is opened anew.
    type RestoreArgs = ();

    /// The device's state; call it between event-loop dispatches.
    fn save(&self) -> RngState {
        RngState {
            version: versions::RNG,
            virtio: VirtioDeviceState {
                activated: self.is_activated(),
                acked_features: self.q.active.as_ref().map_or(0, |a| a.acked_features),
                needs_reset: self.q.needs_reset,
            },
        }
    }

    /// A new device in `state`, for the transport's restore to re-activate with the
    /// saved queue.
    fn restore((): (), state: &RngState) -> Result<Self, StateError> {
        check_version(WHAT, state.version, versions::RNG)?;
        let mut rng = Self::new().map_err(|e| StateError::rebuild(WHAT, e))?;
        state.virtio.validate(WHAT, rng.avail_features())?;
        rng.q.needs_reset = state.virtio.needs_reset;
        rng.q.restored = Some(state.virtio);
        Ok(rng)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use virtio_bindings::bindings::virtio_ring::VRING_DESC_F_WRITE;
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};
    use vm_memory::GuestAddress;

    use super::*;
    use crate::bus::lock;
    use crate::state::{copy_guest_memory, postcard_round_trip, StateError};
    use crate::virtio::mmio::{MmioRestoreArgs, MmioTransport};
    use crate::virtio::test_ring::Ring;
    use crate::virtio::{GuestMemoryMmap, VIRTIO_F_VERSION_1};

    fn ring() -> Ring {
        Ring::at(0, 16)
    }

    fn offer(mem: &GuestMemoryMmap, slot: u16, len: u32) {
        let addr = 0x8000 + u64::from(slot) * 0x100;
        let desc = Descriptor::new(addr, len, VRING_DESC_F_WRITE as u16, 0);
        ring().offer(mem, &[RawDescriptor::from(desc)], slot);
    }

    fn used(mem: &GuestMemoryMmap) -> Vec<(u32, u32)> {
        ring().used(mem)
    }

    #[test]
    fn state_round_trips_and_is_checked() {
        let idle = Rng::new().unwrap().save();
        assert_eq!(idle.virtio, VirtioDeviceState::default());
        let r = Rng::restore((), &postcard_round_trip(&idle)).unwrap();
        assert!(!r.is_activated());

        let active = RngState {
            version: versions::RNG,
            virtio: VirtioDeviceState {
                activated: true,
                acked_features: VIRTIO_F_VERSION_1,
                needs_reset: true,
            },
        };
        let state = postcard_round_trip(&active);
        assert_eq!(state, active);
        let r = Rng::restore((), &state).unwrap();
        assert!(r.needs_reset());
        assert_eq!(r.restored_state(), Some(active.virtio));

        let bad = |edit: fn(&mut RngState)| {
            let mut s = active.clone();
            edit(&mut s);
            Rng::restore((), &s).err().unwrap()
        };
        let e = bad(|s| s.version = 0);
        assert!(matches!(e, StateError::Version { .. }));
        bad(|s| s.virtio.acked_features |= 1);
        bad(|s| s.virtio.activated = false);
    }

    #[test]
    fn restored_device_serves_from_where_it_was() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let rng = Arc::new(Mutex::new(Rng::new().unwrap()));
        let mut t = MmioTransport::new(mem.clone(), rng.clone());
        t.drive_to_driver_ok(VIRTIO_F_VERSION_1, &[ring().transport_queue()]);
        offer(&mem, 0, 16);
        offer(&mem, 1, 32);
        assert_eq!(lock(&rng).process_queue().unwrap(), 2);
        offer(&mem, 2, 48);

        let rng_state = postcard_round_trip(&lock(&rng).save());
        let t_state = postcard_round_trip(&t.save());
        assert_eq!(rng_state.virtio.acked_features, VIRTIO_F_VERSION_1);
        let mem2 = copy_guest_memory(&mem);
        let rng2 = Arc::new(Mutex::new(Rng::restore((), &rng_state).unwrap()));
        let _t2 = MmioTransport::restore(
            MmioRestoreArgs {
                mem: mem2.clone(),
                device: rng2.clone(),
            },
            &t_state,
        )
        .unwrap();

        assert_eq!(lock(&rng2).process_queue().unwrap(), 1);
        offer(&mem2, 3, 64);
        assert_eq!(lock(&rng2).process_queue().unwrap(), 1);
        assert_eq!(used(&mem2), [(0, 16), (1, 32), (2, 48), (3, 64)]);
        assert_eq!(used(&mem).len(), 2);
    }
}
