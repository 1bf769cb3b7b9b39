//! virtio-blk: a disk image served through one request queue.
//!
//! - [`Block`] is the device ([`VirtioDevice`](super::VirtioDevice) and
//!   `event_manager::MutEventSubscriber`);
//! - [`DiskBackend`] is where sectors live, [`FileDisk`] the plain-file one (a layered
//!   copy-on-write backend for forks can implement the same trait);
//! - [`LayeredDisk`] is the copy-on-write one: read-only layers under a private
//!   writable top, frozen into new layers at snapshots (see `layered`);
//! - `request` parses and serves one descriptor chain, treating every guest value as
//!   hostile;
//! - `persist` saves and restores the device ([`BlockState`]). Requests are served
//!   whole within one event-loop dispatch, so between dispatches no request is half
//!   done: the ones the device has not taken are still in the avail ring.
//!
//! Limits: one queue of at most [`QUEUE_SIZE`] entries; at most [`MAX_REQUEST_DATA`]
//! bytes of data per request, which a driver honouring the advertised `seg_max`
//! ([`SEG_MAX`]) and `size_max` ([`SIZE_MAX`]) never exceeds.

mod backend;
mod device;
mod event_handler;
pub mod layered;
mod persist;
mod request;

use std::io;
use std::path::PathBuf;

pub use backend::{DiskBackend, FileDisk, ImageIdentity, IDENTITY_HEAD_BYTES};
pub use device::{Block, BlockConfig};
pub use layered::{
    decode_layer_map, encode_layer_map, LayerFiles, LayerKind, LayerStats, LayeredDisk,
    LayeredError, MapError, StagedLayer, CLUSTER_SIZE,
};
pub use persist::{BlockDisk, BlockRestoreArgs, BlockState};

/// Sector size of the virtio-blk protocol.
pub const SECTOR_SIZE: u64 = 512;
/// Maximum size of the request queue.
pub const QUEUE_SIZE: u16 = 256;
/// Most data segments in one request (advertised as `seg_max`): the queue minus the
/// header and status descriptors.
pub const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;
/// Largest data segment (advertised as `size_max`).
pub const SIZE_MAX: u32 = 4096;
/// Most data bytes in one request; larger requests fail with IOERR. `SEG_MAX * SIZE_MAX`
/// (1016 KiB) fits.
pub const MAX_REQUEST_DATA: u32 = 1 << 20;
/// Length of the GET_ID answer.
pub const ID_BYTES: usize = 20;

#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("Disk image {} does not exist", .0.display())]
    NotFound(PathBuf),
    #[error("Cannot open disk image {}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("Cannot get the size of disk image {}", path.display())]
    Size {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("Cannot read disk image {} to identify it", path.display())]
    Identity {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("Disk image {} is {size} bytes, not a multiple of 512", path.display())]
    Unaligned { path: PathBuf, size: u64 },
    #[error("Disk backend is {0} bytes, not a multiple of 512")]
    BackendUnaligned(u64),
    #[error("Disk id is {0} bytes, at most 20 are allowed")]
    IdTooLong(usize),
    #[error("Cannot create an eventfd")]
    EventFd(#[source] io::Error),
    #[error("Request queue is broken, the device needs a reset")]
    QueueBroken(#[source] virtio_queue::Error),
}

#[cfg(test)]
mod test_utils {
    //! A guest-side harness: guest RAM, a mock queue, and a temporary disk image.

    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use crate::virtio::GuestMemoryMmap;
    use virtio_bindings::bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::Queue;
    use vm_memory::{Bytes, GuestAddress};

    use super::{Block, BlockConfig};
    use crate::virtio::VirtioDevice;

    /// Guest RAM size: everything at or above this is outside.
    pub const RAM: u64 = 0x4_0000;
    pub const OUTSIDE: u64 = 0x100_0000;
    /// Where tests put request headers, status bytes and data (the rings sit below 0x2000).
    pub const HDR: u64 = 0x4000;
    pub const STATUS: u64 = 0x4100;
    pub const DATA: u64 = 0x8000;

    /// virtio-queue's mock rings. With 256 entries its used ring overlaps avail entries
    /// 128-255: a test that offers more than 128 chains uses `test_ring::Ring`.
    pub type MockQueue<'a> = MockSplitQueue<'a, GuestMemoryMmap>;

    pub fn new_block(img: &TempImage, read_only: bool, id: &str) -> Block {
        Block::new(BlockConfig {
            path: img.0.clone(),
            read_only,
            id: id.into(),
        })
        .unwrap()
    }

    /// Activates `b` on the mock queue with every offered feature.
    pub fn activate(b: &mut Block, mem: &GuestMemoryMmap, vq: &MockQueue<'_>) {
        let q: Queue = vq.create_queue().unwrap();
        b.activate(mem.clone(), b.avail_features(), vec![q])
            .unwrap();
    }

    /// Offers one chain (table slots from 0), serves the queue, and returns the new used
    /// entry (head id, length).
    pub fn run(b: &mut Block, vq: &MockQueue<'_>, descs: &[D]) -> (u32, u32) {
        run_raw(b, vq, &chain(descs, 0))
    }

    pub fn run_raw(b: &mut Block, vq: &MockQueue<'_>, raw: &[RawDescriptor]) -> (u32, u32) {
        let before = vq.used().idx().load();
        vq.add_desc_chains(raw, 0).unwrap();
        assert_eq!(b.process_queue().unwrap(), 1);
        assert_eq!(vq.used().idx().load(), before.wrapping_add(1));
        let e = vq.used().ring().ref_at(usize::from(before)).unwrap().load();
        (e.id(), e.len())
    }

    pub fn status(mem: &GuestMemoryMmap) -> u32 {
        u32::from(mem.read_obj::<u8>(GuestAddress(STATUS)).unwrap())
    }

    pub fn guest_memory() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM as usize)]).unwrap()
    }

    /// A file under the temp dir, removed on drop.
    pub struct TempImage(pub PathBuf);

    impl TempImage {
        pub fn new(contents: &[u8]) -> Self {
            static N: AtomicUsize = AtomicUsize::new(0);
            let n = N.fetch_add(1, Ordering::Relaxed);
            let path = std::env::temp_dir()
                .join(format!("sprout-blk-test-{}-{n}.img", std::process::id()));
            std::fs::write(&path, contents).unwrap();
            Self(path)
        }
    }

    impl Drop for TempImage {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// One descriptor of a chain: address, length, device-writable.
    #[derive(Clone, Copy)]
    pub struct D(pub u64, pub u32, pub bool);

    /// Descriptors for table slots `start..`, linked in order; the last one has no NEXT.
    pub fn chain(descs: &[D], start: u16) -> Vec<RawDescriptor> {
        descs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let last = i + 1 == descs.len();
                let mut flags = if d.2 { VRING_DESC_F_WRITE as u16 } else { 0 };
                if !last {
                    flags |= VRING_DESC_F_NEXT as u16;
                }
                let next = if last { 0 } else { start + i as u16 + 1 };
                RawDescriptor::from(Descriptor::new(d.0, d.1, flags, next))
            })
            .collect()
    }

    /// A 16-byte virtio-blk request header.
    pub fn header(mem: &GuestMemoryMmap, at: u64, kind: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[..4].copy_from_slice(&kind.to_le_bytes());
        h[8..].copy_from_slice(&sector.to_le_bytes());
        mem.write_slice(&h, GuestAddress(at)).unwrap();
    }
}
