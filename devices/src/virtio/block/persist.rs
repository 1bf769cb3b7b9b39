//! Saving and restoring a [`Block`] device.
//!
//! The disk itself (path, read-only, id, and for a [`LayeredDisk`](super::LayeredDisk)
//! its layers) is the VMM's to rebuild; the queue is the transport's
//! ([`MmioTransportState`](crate::virtio::mmio::MmioTransportState)). What the device keeps
//! is whether it was active, with which features, whether it was broken, and the disk
//! size and mode the guest saw, checked against the disk it is restored onto.

use serde::{Deserialize, Serialize};

use super::device::Block;
use crate::state::{check_version, StateError};
use crate::virtio::{VirtioDevice, VirtioDeviceState};

/// Version of [`BlockState`] this build writes and reads.
pub const BLOCK_STATE_VERSION: u16 = 1;

const WHAT: &str = "virtio-blk";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    pub version: u16,
    pub virtio: VirtioDeviceState,
    /// Disk size in bytes as the guest saw it.
    pub capacity_bytes: u64,
    pub read_only: bool,
}

impl Block {
    /// The device's state; call it between event-loop dispatches (no request is then
    /// half served).
    pub fn save_state(&self) -> BlockState {
        BlockState {
            version: BLOCK_STATE_VERSION,
            virtio: VirtioDeviceState {
                activated: self.is_activated(),
                acked_features: self.q.active.as_ref().map_or(0, |a| a.acked_features),
                needs_reset: self.q.needs_reset,
            },
            capacity_bytes: self.capacity_bytes,
            read_only: self.read_only,
        }
    }

    /// Brings a freshly built device (any constructor) to `state`, before
    /// `MmioTransport::restore` re-activates it with the saved queue. The disk must have
    /// the saved size and mode.
    pub fn restore_state(&mut self, state: &BlockState) -> Result<(), StateError> {
        check_version(WHAT, state.version, BLOCK_STATE_VERSION)?;
        if self.is_activated() {
            return Err(StateError::mismatch(WHAT, "the device is already active"));
        }
        if state.capacity_bytes != self.capacity_bytes {
            return Err(StateError::mismatch(
                WHAT,
                format!(
                    "the guest saw {} bytes, the disk has {}",
                    state.capacity_bytes, self.capacity_bytes
                ),
            ));
        }
        if state.read_only != self.read_only {
            return Err(StateError::mismatch(
                WHAT,
                format!(
                    "the guest saw read-only {}, the disk is read-only {}",
                    state.read_only, self.read_only
                ),
            ));
        }
        state.virtio.validate(WHAT, self.avail_features)?;
        self.q.needs_reset = state.virtio.needs_reset;
        self.q.restored = Some(state.virtio);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use virtio_bindings::bindings::virtio_blk::*;
    use vm_memory::{Bytes, GuestAddress};

    use super::super::test_utils::*;
    use super::*;
    use crate::bus::lock;
    use crate::state::{copy_guest_memory, postcard_round_trip};
    use crate::virtio::mmio::MmioTransport;
    use crate::virtio::test_ring::Ring;
    use crate::virtio::GuestMemoryMmap;

    const QSIZE: u16 = 16;

    fn ring() -> Ring {
        Ring::at(0, QSIZE)
    }

    /// A block device driven by the guest through a transport, over the mock queue.
    fn running(img: &TempImage, mem: &GuestMemoryMmap) -> (Arc<Mutex<Block>>, MmioTransport) {
        let blk = Arc::new(Mutex::new(new_block(img, false, "")));
        let mut t = MmioTransport::new(mem.clone(), blk.clone());
        let features = lock(&blk).avail_features();
        t.drive_to_driver_ok(features, &[ring().transport_queue()]);
        (blk, t)
    }

    /// Offers a one-sector write of `fill` to `sector`, from table slot `slot`.
    fn offer_write(mem: &GuestMemoryMmap, slot: u16, sector: u64, fill: u8) {
        let at = |i: u64| 0x1_0000 + u64::from(slot) * 0x400 + i;
        header(mem, at(0), VIRTIO_BLK_T_OUT, sector);
        mem.write_slice(&[fill; 512], GuestAddress(at(0x100)))
            .unwrap();
        let descs = [
            D(at(0), 16, false),
            D(at(0x100), 512, false),
            D(at(0x10), 1, true),
        ];
        ring().offer(mem, &chain(&descs, slot), slot);
    }

    fn used_idx(mem: &GuestMemoryMmap) -> usize {
        ring().used(mem).len()
    }

    #[test]
    fn state_round_trips_and_checks_the_disk() {
        let img = TempImage::new(&[0u8; 8192]);
        let mem = guest_memory();
        let (blk, _t) = running(&img, &mem);
        let saved = lock(&blk).save_state();
        assert_eq!(saved.capacity_bytes, 8192);
        assert!(saved.virtio.activated);
        let state = postcard_round_trip(&saved);
        assert_eq!(state, saved);

        let mut fresh = new_block(&img, false, "");
        fresh.restore_state(&state).unwrap();
        assert_eq!(fresh.restored_state(), Some(state.virtio));
        assert!(!fresh.is_activated());

        let mut s = state.clone();
        s.version = 2;
        assert!(matches!(
            new_block(&img, false, "").restore_state(&s),
            Err(StateError::Version { found: 2, .. })
        ));
        let bigger = TempImage::new(&[0u8; 16384]);
        let err = new_block(&bigger, false, "").restore_state(&state);
        assert!(err.unwrap_err().to_string().contains("8192 bytes"));
        assert!(new_block(&img, true, "").restore_state(&state).is_err());
        let mut s = state.clone();
        s.virtio.acked_features |= 1 << 60;
        assert!(new_block(&img, false, "").restore_state(&s).is_err());
        let mut s = state.clone();
        s.virtio.activated = false;
        assert!(new_block(&img, false, "").restore_state(&s).is_err());
        // An inactive device's state restores as inactive.
        let idle = new_block(&img, false, "").save_state();
        assert_eq!(idle.virtio, VirtioDeviceState::default());
        let mut b = new_block(&img, false, "");
        b.restore_state(&postcard_round_trip(&idle)).unwrap();
        assert!(!b.is_activated());
    }

    #[test]
    fn restored_device_serves_from_where_it_was() {
        let img = TempImage::new(&[0u8; 64 * 512]);
        let mem = guest_memory();
        let (blk, t) = running(&img, &mem);
        offer_write(&mem, 0, 1, 0xa1);
        offer_write(&mem, 3, 2, 0xa2);
        assert_eq!(lock(&blk).process_queue().unwrap(), 2);
        // Offered but not yet served when the snapshot is taken.
        offer_write(&mem, 6, 3, 0xa3);

        let blk_state = postcard_round_trip(&lock(&blk).save_state());
        let t_state = postcard_round_trip(&t.save_state());
        assert_eq!(t_state.queues[0].next_avail, 2);
        assert_eq!(t_state.queues[0].next_used, 2);

        let mem2 = copy_guest_memory(&mem);
        let mut b2 = new_block(&img, false, "");
        b2.restore_state(&blk_state).unwrap();
        let b2 = Arc::new(Mutex::new(b2));
        let _t2 = MmioTransport::restore(mem2.clone(), b2.clone(), &t_state).unwrap();
        assert!(lock(&b2).is_activated());

        // Exactly the pending request is served, on the new memory.
        assert_eq!(lock(&b2).process_queue().unwrap(), 1);
        assert_eq!(used_idx(&mem2), 3);
        assert_eq!(used_idx(&mem), 2, "the old memory is untouched");
        assert_eq!(ring().used(&mem2)[2], (6, 1));
        assert_eq!(lock(&b2).process_queue().unwrap(), 0);

        // And the next one after it.
        offer_write(&mem2, 9, 4, 0xa4);
        assert_eq!(lock(&b2).process_queue().unwrap(), 1);
        assert_eq!(used_idx(&mem2), 4);
        let disk = std::fs::read(&img.0).unwrap();
        for (sector, fill) in [(1, 0xa1), (2, 0xa2), (3, 0xa3), (4, 0xa4)] {
            assert!(disk[sector * 512..(sector + 1) * 512]
                .iter()
                .all(|&b| b == fill));
        }
        assert!(disk[5 * 512..].iter().all(|&b| b == 0));
    }

    #[test]
    fn broken_device_stays_broken_after_restore() {
        let img = TempImage::new(&[0u8; 4096]);
        let mem = guest_memory();
        let (blk, t) = running(&img, &mem);
        mem.write_obj(QSIZE + 1, GuestAddress(ring().avail + 2))
            .unwrap();
        assert!(lock(&blk).process_queue().is_err());
        let state = postcard_round_trip(&lock(&blk).save_state());
        assert!(state.virtio.needs_reset);
        let mut b2 = new_block(&img, false, "");
        b2.restore_state(&state).unwrap();
        let b2 = Arc::new(Mutex::new(b2));
        let _t2 =
            MmioTransport::restore(copy_guest_memory(&mem), b2.clone(), &t.save_state()).unwrap();
        assert!(lock(&b2).needs_reset());
        assert_eq!(lock(&b2).process_queue().unwrap(), 0);
    }
}
