//! Saving and restoring a [`Block`] device.
//!
//! The disk itself (path, read-only, id, and for a [`LayeredDisk`](super::LayeredDisk)
//! its layers) is the VMM's to rebuild; the queue is the transport's
//! ([`MmioTransportState`](crate::virtio::mmio::MmioTransportState)). What the device keeps
//! is whether it was active, with which features, whether it was broken, and the disk
//! size and mode the guest saw, checked against the disk it is restored onto.

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::device::{Block, BlockConfig};
use super::{DiskBackend, LayeredDisk};
use crate::state::{check_version, versions, Persist, StateError};
use crate::virtio::{VirtioDevice, VirtioDeviceState};

const WHAT: &str = "virtio-blk";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    pub version: u16,
    pub virtio: VirtioDeviceState,
    /// Disk size in bytes as the guest saw it.
    pub capacity_bytes: u64,
    pub read_only: bool,
}

/// The disk a restored [`Block`] serves.
pub enum BlockDisk {
    /// An image file, opened as [`Block::new`] does.
    Image(PathBuf),
    /// An image file already opened, as [`Block::with_file`] (`image`: its
    /// identity, when read-only).
    File {
        disk: super::FileDisk,
        image: Option<super::ImageIdentity>,
    },
    /// A layered copy-on-write disk the VMM also holds, as [`Block::with_layered`].
    Layered(Arc<LayeredDisk>),
    /// Any other backend, as [`Block::with_backend`].
    Backend(Box<dyn DiskBackend>),
}

/// What restoring a [`Block`] needs besides its state: the disk and how the VMM
/// configured it. The disk must have the size and mode the guest saw.
pub struct BlockRestoreArgs {
    pub disk: BlockDisk,
    pub read_only: bool,
    /// Answer to GET_ID.
    pub id: String,
}

impl Persist for Block {
    type State = BlockState;
    type RestoreArgs = BlockRestoreArgs;

    /// The device's state; call it between event-loop dispatches (no request is then
    /// half served).
    fn save(&self) -> BlockState {
        BlockState {
            version: versions::BLOCK,
            virtio: VirtioDeviceState {
                activated: self.is_activated(),
                acked_features: self.q.active.as_ref().map_or(0, |a| a.acked_features),
                needs_reset: self.q.needs_reset,
            },
            capacity_bytes: self.capacity_bytes,
            read_only: self.read_only,
        }
    }

    /// A device over `args.disk` in `state`, for `MmioTransport`'s restore to
    /// re-activate with the saved queue.
    fn restore(args: BlockRestoreArgs, state: &BlockState) -> Result<Self, StateError> {
        check_version(WHAT, state.version, versions::BLOCK)?;
        let BlockRestoreArgs {
            disk,
            read_only,
            id,
        } = args;
        let built = match disk {
            BlockDisk::Image(path) => Block::new(BlockConfig {
                path,
                read_only,
                id,
            }),
            BlockDisk::File { disk, image } => Block::with_file(disk, image, read_only, &id),
            BlockDisk::Layered(l) => Block::with_layered(l, read_only, &id),
            BlockDisk::Backend(b) => Block::with_backend(b, read_only, &id),
        };
        let mut dev = built.map_err(|e| StateError::rebuild(WHAT, e))?;
        dev.apply(state)?;
        Ok(dev)
    }
}

impl Block {
    /// Brings a freshly built device to `state`, after checking the disk against it.
    fn apply(&mut self, state: &BlockState) -> Result<(), StateError> {
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
    use crate::virtio::mmio::{MmioRestoreArgs, MmioTransport};
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

    /// Restore arguments for `img`, configured `read_only` or not.
    fn args(img: &TempImage, read_only: bool) -> BlockRestoreArgs {
        BlockRestoreArgs {
            disk: BlockDisk::Image(img.0.clone()),
            read_only,
            id: String::new(),
        }
    }

    fn used_idx(mem: &GuestMemoryMmap) -> usize {
        ring().used(mem).len()
    }

    #[test]
    fn state_round_trips_and_checks_the_disk() {
        let img = TempImage::new(&[0u8; 8192]);
        let mem = guest_memory();
        let (blk, _t) = running(&img, &mem);
        let saved = lock(&blk).save();
        assert_eq!(saved.capacity_bytes, 8192);
        assert!(saved.virtio.activated);
        let state = postcard_round_trip(&saved);
        assert_eq!(state, saved);

        let fresh = Block::restore(args(&img, false), &state).unwrap();
        assert_eq!(fresh.restored_state(), Some(state.virtio));
        assert!(!fresh.is_activated());

        let mut s = state.clone();
        s.version = 2;
        assert!(matches!(
            Block::restore(args(&img, false), &s),
            Err(StateError::Version { found: 2, .. })
        ));
        let bigger = TempImage::new(&[0u8; 16384]);
        let err = Block::restore(args(&bigger, false), &state);
        assert!(err.err().unwrap().to_string().contains("8192 bytes"));
        let gone = BlockRestoreArgs {
            disk: BlockDisk::Image(img.0.with_extension("gone")),
            read_only: false,
            id: String::new(),
        };
        assert!(matches!(
            Block::restore(gone, &state).err().unwrap(),
            StateError::Rebuild { .. }
        ));
        assert!(Block::restore(args(&img, true), &state).is_err());
        let mut s = state.clone();
        s.virtio.acked_features |= 1 << 60;
        assert!(Block::restore(args(&img, false), &s).is_err());
        let mut s = state.clone();
        s.virtio.activated = false;
        assert!(Block::restore(args(&img, false), &s).is_err());
        // An inactive device's state restores as inactive.
        let idle = new_block(&img, false, "").save();
        assert_eq!(idle.virtio, VirtioDeviceState::default());
        let b = Block::restore(args(&img, false), &postcard_round_trip(&idle)).unwrap();
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

        let blk_state = postcard_round_trip(&lock(&blk).save());
        let t_state = postcard_round_trip(&t.save());
        assert_eq!(t_state.queues[0].next_avail, 2);
        assert_eq!(t_state.queues[0].next_used, 2);

        let mem2 = copy_guest_memory(&mem);
        let b2 = Block::restore(args(&img, false), &blk_state).unwrap();
        let b2 = Arc::new(Mutex::new(b2));
        let _t2 = MmioTransport::restore(
            MmioRestoreArgs {
                mem: mem2.clone(),
                device: b2.clone(),
            },
            &t_state,
        )
        .unwrap();
        assert!(lock(&b2).is_activated());
        // The guest notified the old process's eventfd (or a bounded dispatch left
        // work for its re-kick): activation kicks the new one, or the pending request
        // would wait for the guest's next notify.
        assert!(
            lock(&b2).queue_events()[0].read().is_ok(),
            "activation did not kick the queue"
        );

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
        let state = postcard_round_trip(&lock(&blk).save());
        assert!(state.virtio.needs_reset);
        let b2 = Block::restore(args(&img, false), &state).unwrap();
        let b2 = Arc::new(Mutex::new(b2));
        let _t2 = MmioTransport::restore(
            MmioRestoreArgs {
                mem: copy_guest_memory(&mem),
                device: b2.clone(),
            },
            &t.save(),
        )
        .unwrap();
        assert!(lock(&b2).needs_reset());
        assert_eq!(lock(&b2).process_queue().unwrap(), 0);
    }
}
