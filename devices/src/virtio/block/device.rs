//! The virtio-blk device: features, config space, activation and the request queue.

use std::path::PathBuf;
use std::sync::Arc;

use virtio_bindings::bindings::virtio_blk::{
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX,
};
use virtio_queue::Queue;
use vmm_sys_util::eventfd::EventFd;

use super::backend::{DiskBackend, FileDisk, ImageIdentity};
use super::layered::LayeredDisk;
use super::request::{self, DiskInfo};
use super::{BlockError, ID_BYTES, QUEUE_SIZE, SECTOR_SIZE, SEG_MAX, SIZE_MAX};
use crate::virtio::single_queue::SingleQueue;
use crate::virtio::{
    ActivateError, GuestMemoryMmap, Interrupt, VirtioDevice, VirtioDeviceState, TYPE_BLOCK,
    VIRTIO_F_VERSION_1,
};

/// Config space: capacity (u64 sectors) at 0, size_max (u32) at 8, seg_max (u32) at 12.
const CONFIG_LEN: usize = 16;

/// How to build a [`Block`] from a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockConfig {
    /// Disk image (or block device); its size must be a multiple of 512 bytes.
    pub path: PathBuf,
    /// Open the image read-only and offer VIRTIO_BLK_F_RO.
    pub read_only: bool,
    /// Answer to GET_ID (the guest's serial number), at most 20 bytes.
    pub id: String,
}

/// What the device holds between DRIVER_OK and reset.
/// A virtio-blk device over a [`DiskBackend`].
pub struct Block {
    disk: Box<dyn DiskBackend>,
    /// The same backend when it is a [`LayeredDisk`], for the VMM to reach at snapshots.
    layered: Option<Arc<LayeredDisk>>,
    /// For a read-only image file: which version of it this device serves.
    image: Option<ImageIdentity>,
    pub(super) read_only: bool,
    id: [u8; ID_BYTES],
    pub(super) capacity_bytes: u64,
    pub(super) avail_features: u64,
    config: [u8; CONFIG_LEN],
    pub(super) q: SingleQueue,
    /// Bounce buffer between the disk and guest memory, reused across requests.
    buf: Vec<u8>,
}

impl Block {
    /// Opens the image at `cfg.path` (read-only if asked) as a [`FileDisk`].
    /// A read-only image is identified as it is opened
    /// ([`Block::image_identity`]).
    pub fn new(cfg: BlockConfig) -> Result<Self, BlockError> {
        let disk = FileDisk::open(&cfg.path, cfg.read_only)?;
        let image = cfg.read_only.then(|| disk.identity()).transpose()?;
        Self::with_file(disk, image, cfg.read_only, &cfg.id)
    }

    /// A device over an image file already opened, and identified by
    /// `image` ([`FileDisk::identity`] of that same file) when read-only.
    pub fn with_file(
        disk: FileDisk,
        image: Option<ImageIdentity>,
        read_only: bool,
        id: &str,
    ) -> Result<Self, BlockError> {
        let mut dev = Self::with_backend(Box::new(disk), read_only, id)?;
        dev.image = image;
        Ok(dev)
    }

    /// A device over any backend (e.g. a copy-on-write layer for a forked VM).
    pub fn with_backend(
        disk: Box<dyn DiskBackend>,
        read_only: bool,
        id: &str,
    ) -> Result<Self, BlockError> {
        let capacity_bytes = disk.size_bytes();
        if !capacity_bytes.is_multiple_of(SECTOR_SIZE) {
            return Err(BlockError::BackendUnaligned(capacity_bytes));
        }
        if id.len() > ID_BYTES {
            return Err(BlockError::IdTooLong(id.len()));
        }
        let mut id_bytes = [0u8; ID_BYTES];
        id_bytes[..id.len()].copy_from_slice(id.as_bytes());

        let mut avail_features = VIRTIO_F_VERSION_1
            | 1 << VIRTIO_BLK_F_FLUSH
            | 1 << VIRTIO_BLK_F_SEG_MAX
            | 1 << VIRTIO_BLK_F_SIZE_MAX;
        if read_only {
            avail_features |= 1 << VIRTIO_BLK_F_RO;
        }
        let mut config = [0u8; CONFIG_LEN];
        config[0..8].copy_from_slice(&(capacity_bytes / SECTOR_SIZE).to_le_bytes());
        config[8..12].copy_from_slice(&SIZE_MAX.to_le_bytes());
        config[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());

        Ok(Self {
            disk,
            layered: None,
            image: None,
            read_only,
            id: id_bytes,
            capacity_bytes,
            avail_features,
            config,
            q: SingleQueue::new().map_err(BlockError::EventFd)?,
            buf: Vec::new(),
        })
    }

    /// A device over a layered copy-on-write disk that the VMM also holds (to write
    /// its layers at snapshots); [`Block::layered_disk`] gives it back.
    pub fn with_layered(
        disk: Arc<LayeredDisk>,
        read_only: bool,
        id: &str,
    ) -> Result<Self, BlockError> {
        let mut dev = Self::with_backend(Box::new(disk.clone()), read_only, id)?;
        dev.layered = Some(disk);
        Ok(dev)
    }

    /// The layered disk behind this device, if it was built with [`Block::with_layered`].
    pub fn layered_disk(&self) -> Option<&Arc<LayeredDisk>> {
        self.layered.as_ref()
    }

    /// Which version of its image this device serves, when it was opened
    /// read-only from an image file ([`Block::new`]): what a snapshot records
    /// and a restore checks the image against.
    pub fn image_identity(&self) -> Option<ImageIdentity> {
        self.image
    }

    /// Disk size in 512-byte sectors.
    pub fn capacity_sectors(&self) -> u64 {
        self.capacity_bytes / SECTOR_SIZE
    }

    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// Features the driver acknowledged, once activated.
    pub fn acked_features(&self) -> Option<u64> {
        self.q.active.as_ref().map(|a| a.acked_features)
    }

    /// Serves available requests, at most [`MAX_CHAINS_PER_DISPATCH`] per call (with
    /// more left, the queue's eventfd is written again so the event loop comes back),
    /// then raises INT_VRING if any completed. Returns how many chains went to the
    /// used ring.
    ///
    /// Does nothing before activation, on a queue the driver left unready, or once the
    /// queue is broken. A broken queue (avail index ahead by more than the queue size,
    /// a head index outside the table, a used ring that cannot be written) sets
    /// DEVICE_NEEDS_RESET, raises INT_CONFIG and returns [`BlockError::QueueBroken`].
    ///
    /// [`MAX_CHAINS_PER_DISPATCH`]: crate::virtio::MAX_CHAINS_PER_DISPATCH
    pub fn process_queue(&mut self) -> Result<usize, BlockError> {
        let info = DiskInfo {
            read_only: self.read_only,
            capacity_bytes: self.capacity_bytes,
            id: &self.id,
        };
        let disk = self.disk.as_mut();
        let buf = &mut self.buf;
        self.q
            .serve("virtio-blk", |chain, table, mem| {
                request::serve(chain, table, mem, disk, &info, buf)
            })
            .map_err(BlockError::QueueBroken)
    }

    pub(super) fn queue_event(&self, idx: usize) -> Option<&EventFd> {
        self.q.queue_evts.get(idx)
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        TYPE_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn avail_features(&self) -> u64 {
        self.avail_features
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let Ok(start) = usize::try_from(offset) else {
            return;
        };
        if let Some(src) = self.config.get(start..) {
            let n = src.len().min(data.len());
            data[..n].copy_from_slice(&src[..n]);
        }
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        acked_features: u64,
        queues: Vec<Queue>,
    ) -> Result<(), ActivateError> {
        self.q.activate(mem, acked_features, queues)
    }

    fn reset(&mut self) {
        self.q.reset();
    }

    fn queue_events(&self) -> &[EventFd] {
        &self.q.queue_evts
    }

    fn interrupt(&self) -> &Interrupt {
        &self.q.interrupt
    }

    fn needs_reset(&self) -> bool {
        self.q.needs_reset
    }

    fn is_activated(&self) -> bool {
        self.q.active.is_some()
    }

    fn active_queues(&self) -> &[Queue] {
        self.q.active_queues()
    }

    fn restored_state(&self) -> Option<VirtioDeviceState> {
        self.q.restored
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_utils::*;
    use super::*;
    use crate::virtio::{INT_CONFIG, INT_VRING};
    use virtio_bindings::bindings::virtio_blk::*;
    use virtio_queue::QueueT;
    use vm_memory::{Bytes, GuestAddress};

    const CAP_SECTORS: u64 = 64;

    fn image() -> (TempImage, Vec<u8>) {
        let data: Vec<u8> = (0..CAP_SECTORS * 512).map(|i| (i % 251) as u8).collect();
        (TempImage::new(&data), data)
    }

    #[test]
    fn new_reports_bad_config() {
        let (img, _) = image();
        let cfg = |path: PathBuf, id: &str| BlockConfig {
            path,
            read_only: false,
            id: id.into(),
        };
        let err = Block::new(cfg(img.0.clone(), "123456789012345678901"))
            .err()
            .unwrap();
        assert!(matches!(err, BlockError::IdTooLong(21)));
        let missing = img.0.with_extension("missing");
        assert!(matches!(
            Block::new(cfg(missing, "x")),
            Err(BlockError::NotFound(_))
        ));
        let odd = TempImage::new(&[0; 1000]);
        assert!(matches!(
            Block::new(cfg(odd.0.clone(), "x")),
            Err(BlockError::Unaligned { size: 1000, .. })
        ));
        assert!(Block::new(cfg(img.0.clone(), "12345678901234567890")).is_ok());
    }

    #[test]
    fn features_and_config_space() {
        let (img, _) = image();
        let b = new_block(&img, false, "disk0");
        assert_eq!(b.device_type(), TYPE_BLOCK);
        assert_eq!(b.queue_max_sizes(), &[256]);
        let f = b.avail_features();
        assert_ne!(f & VIRTIO_F_VERSION_1, 0);
        assert_ne!(f & 1 << VIRTIO_BLK_F_FLUSH, 0);
        assert_ne!(f & 1 << VIRTIO_BLK_F_SEG_MAX, 0);
        assert_eq!(f & 1 << VIRTIO_BLK_F_RO, 0);
        assert_eq!(b.capacity_sectors(), CAP_SECTORS);

        let mut cap = [0u8; 8];
        b.read_config(0, &mut cap);
        assert_eq!(u64::from_le_bytes(cap), CAP_SECTORS);
        let mut w = [0u8; 4];
        b.read_config(12, &mut w);
        assert_eq!(u32::from_le_bytes(w), 254);
        b.read_config(8, &mut w);
        assert_eq!(u32::from_le_bytes(w), 4096);
        let mut tail = [0xffu8; 8];
        b.read_config(12, &mut tail);
        assert_eq!(tail, [254, 0, 0, 0, 0, 0, 0, 0]);
        b.read_config(u64::MAX, &mut tail);
        assert_eq!(tail, [0; 8]);

        let ro = new_block(&img, true, "");
        assert!(ro.read_only());
        assert_ne!(ro.avail_features() & 1 << VIRTIO_BLK_F_RO, 0);
    }

    #[test]
    fn activate_needs_one_queue_and_reset_deactivates() {
        let (img, _) = image();
        let mem = guest_memory();
        let mut b = new_block(&img, false, "");
        assert!(matches!(
            b.activate(mem.clone(), 0, vec![]),
            Err(ActivateError::QueueCount {
                expected: 1,
                got: 0
            })
        ));
        assert!(!b.is_activated());
        assert_eq!(b.process_queue().unwrap(), 0);
        let vq = MockQueue::new(&mem, QUEUE_SIZE);
        activate(&mut b, &mem, &vq);
        assert!(b.is_activated());
        assert_eq!(b.acked_features(), Some(b.avail_features()));
        b.reset();
        assert!(!b.is_activated());
        assert_eq!(b.acked_features(), None);
    }

    #[test]
    fn read_round_trip() {
        let (img, data) = image();
        let mem = guest_memory();
        let vq = MockQueue::new(&mem, QUEUE_SIZE);
        let mut b = new_block(&img, false, "");
        activate(&mut b, &mem, &vq);
        header(&mem, HDR, VIRTIO_BLK_T_IN, 3);
        let descs = [
            D(HDR, 16, false),
            D(DATA, 512, true),
            D(DATA + 0x1000, 1024, true),
            D(STATUS, 1, true),
        ];
        assert_eq!(run(&mut b, &vq, &descs), (0, 1537));
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK);
        let mut got = vec![0u8; 512];
        mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
        assert_eq!(got, data[3 * 512..4 * 512]);
        let mut got = vec![0u8; 1024];
        mem.read_slice(&mut got, GuestAddress(DATA + 0x1000))
            .unwrap();
        assert_eq!(got, data[4 * 512..6 * 512]);
        // The driver was told.
        assert_eq!(b.interrupt().status(), INT_VRING);
        assert_eq!(b.interrupt().eventfd().read().unwrap(), 1);
    }

    #[test]
    fn write_then_read_back() {
        let (img, mut data) = image();
        let mem = guest_memory();
        let vq = MockQueue::new(&mem, QUEUE_SIZE);
        let mut b = new_block(&img, false, "");
        activate(&mut b, &mem, &vq);
        let payload: Vec<u8> = (0..1024u32).map(|i| (i * 7 % 256) as u8).collect();
        mem.write_slice(&payload, GuestAddress(DATA)).unwrap();
        header(&mem, HDR, VIRTIO_BLK_T_OUT, CAP_SECTORS - 2);
        let descs = [
            D(HDR, 16, false),
            D(DATA, 512, false),
            D(DATA + 512, 512, false),
            D(STATUS, 1, true),
        ];
        assert_eq!(run(&mut b, &vq, &descs), (0, 1));
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK);

        header(&mem, HDR, VIRTIO_BLK_T_FLUSH, 0);
        assert_eq!(
            run(&mut b, &vq, &[D(HDR, 16, false), D(STATUS, 1, true)]),
            (0, 1)
        );
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK);

        data[(CAP_SECTORS as usize - 2) * 512..].copy_from_slice(&payload);
        assert_eq!(std::fs::read(&img.0).unwrap(), data);

        header(&mem, HDR, VIRTIO_BLK_T_IN, CAP_SECTORS - 2);
        let descs = [
            D(HDR, 16, false),
            D(DATA + 0x2000, 1024, true),
            D(STATUS, 1, true),
        ];
        assert_eq!(run(&mut b, &vq, &descs), (0, 1025));
        let mut got = vec![0u8; 1024];
        mem.read_slice(&mut got, GuestAddress(DATA + 0x2000))
            .unwrap();
        assert_eq!(got, payload);
    }

    #[test]
    fn get_id_and_unsupported_types() {
        let (img, _) = image();
        let mem = guest_memory();
        let vq = MockQueue::new(&mem, QUEUE_SIZE);
        let mut b = new_block(&img, false, "sprout-disk");
        activate(&mut b, &mem, &vq);
        mem.write_slice(&[0xff; 32], GuestAddress(DATA)).unwrap();
        header(&mem, HDR, VIRTIO_BLK_T_GET_ID, 0);
        let descs = [D(HDR, 16, false), D(DATA, 32, true), D(STATUS, 1, true)];
        assert_eq!(run(&mut b, &vq, &descs), (0, 21));
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK);
        let mut got = [0u8; 32];
        mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
        assert_eq!(&got[..11], b"sprout-disk");
        assert_eq!(got[11..20], [0; 9]);
        assert_eq!(got[20..], [0xff; 12]);

        // A short buffer gets what fits.
        mem.write_slice(&[0xff; 8], GuestAddress(DATA)).unwrap();
        let descs = [D(HDR, 16, false), D(DATA, 4, true), D(STATUS, 1, true)];
        assert_eq!(run(&mut b, &vq, &descs), (0, 5));
        mem.read_slice(&mut got[..8], GuestAddress(DATA)).unwrap();
        assert_eq!(&got[..8], b"spro\xff\xff\xff\xff");

        for kind in [VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_WRITE_ZEROES, 2, 0xdead] {
            header(&mem, HDR, kind, 0);
            let descs = [D(HDR, 16, false), D(DATA, 512, false), D(STATUS, 1, true)];
            assert_eq!(run(&mut b, &vq, &descs), (0, 1));
            assert_eq!(status(&mem), VIRTIO_BLK_S_UNSUPP);
        }
    }

    #[test]
    fn read_only_disk_refuses_writes() {
        let (img, data) = image();
        let mem = guest_memory();
        let vq = MockQueue::new(&mem, QUEUE_SIZE);
        let mut b = new_block(&img, true, "");
        activate(&mut b, &mem, &vq);
        mem.write_slice(&[0xaa; 512], GuestAddress(DATA)).unwrap();
        header(&mem, HDR, VIRTIO_BLK_T_OUT, 0);
        let descs = [D(HDR, 16, false), D(DATA, 512, false), D(STATUS, 1, true)];
        assert_eq!(run(&mut b, &vq, &descs), (0, 1));
        assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR);
        // Flush is harmless, reads work.
        header(&mem, HDR, VIRTIO_BLK_T_FLUSH, 0);
        assert_eq!(
            run(&mut b, &vq, &[D(HDR, 16, false), D(STATUS, 1, true)]),
            (0, 1)
        );
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK);
        header(&mem, HDR, VIRTIO_BLK_T_IN, 0);
        let descs = [D(HDR, 16, false), D(DATA, 512, true), D(STATUS, 1, true)];
        assert_eq!(run(&mut b, &vq, &descs), (0, 513));
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK);
        assert_eq!(std::fs::read(&img.0).unwrap(), data);
    }

    #[test]
    fn out_of_range_and_odd_lengths_fail() {
        let (img, data) = image();
        let mem = guest_memory();
        let vq = MockQueue::new(&mem, QUEUE_SIZE);
        let mut b = new_block(&img, false, "");
        activate(&mut b, &mem, &vq);
        let cases: [(u32, u64, u32); 7] = [
            (VIRTIO_BLK_T_IN, CAP_SECTORS, 512),
            (VIRTIO_BLK_T_IN, CAP_SECTORS - 1, 1024),
            (VIRTIO_BLK_T_OUT, CAP_SECTORS, 512),
            (VIRTIO_BLK_T_IN, u64::MAX, 512),
            (VIRTIO_BLK_T_OUT, u64::MAX / 512, 512),
            (VIRTIO_BLK_T_IN, 0, 100),
            (VIRTIO_BLK_T_OUT, 0, 513),
        ];
        for (kind, sector, len) in cases {
            header(&mem, HDR, kind, sector);
            let descs = [
                D(HDR, 16, false),
                D(DATA, len, kind == VIRTIO_BLK_T_IN),
                D(STATUS, 1, true),
            ];
            assert_eq!(run(&mut b, &vq, &descs), (0, 1), "{kind} {sector} {len}");
            assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR, "{kind} {sector} {len}");
        }
        // The last sector itself is fine.
        header(&mem, HDR, VIRTIO_BLK_T_IN, CAP_SECTORS - 1);
        let descs = [D(HDR, 16, false), D(DATA, 512, true), D(STATUS, 1, true)];
        assert_eq!(run(&mut b, &vq, &descs), (0, 513));
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK);
        assert_eq!(std::fs::read(&img.0).unwrap(), data);
        assert!(!b.needs_reset());
    }

    #[test]
    fn oversized_request_fails() {
        let (img, _) = image();
        let mem = guest_memory();
        let vq = MockQueue::new(&mem, QUEUE_SIZE);
        let mut b = new_block(&img, false, "");
        activate(&mut b, &mem, &vq);
        header(&mem, HDR, VIRTIO_BLK_T_IN, 0);
        // 1 MiB + 512 over three descriptors (the RAM check would fail too, but the
        // size check comes first and must not overflow).
        let descs = [
            D(HDR, 16, false),
            D(DATA, 1 << 19, true),
            D(DATA, 1 << 19, true),
            D(DATA, 512, true),
            D(STATUS, 1, true),
        ];
        assert_eq!(run(&mut b, &vq, &descs), (0, 1));
        assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR);
        let descs = [
            D(HDR, 16, false),
            D(DATA, u32::MAX, true),
            D(DATA, u32::MAX, true),
            D(STATUS, 1, true),
        ];
        assert_eq!(
            run(&mut b, &vq, &descs),
            (0, 0),
            "a 4 GiB chain is cut short"
        );
    }

    #[test]
    fn broken_avail_index_needs_reset() {
        let (img, _) = image();
        let mem = guest_memory();
        let vq = MockQueue::new(&mem, QUEUE_SIZE);
        let mut b = new_block(&img, false, "");
        activate(&mut b, &mem, &vq);
        vq.avail().idx().store(QUEUE_SIZE + 1);
        assert!(matches!(b.process_queue(), Err(BlockError::QueueBroken(_))));
        assert!(b.needs_reset());
        assert_eq!(b.interrupt().status(), INT_CONFIG);
        // Nothing more is served until a reset.
        assert_eq!(b.process_queue().unwrap(), 0);
        b.reset();
        assert!(!b.needs_reset());
        assert_eq!(b.interrupt().status(), 0);
    }

    #[test]
    fn head_index_outside_table_needs_reset() {
        let (img, _) = image();
        let mem = guest_memory();
        let vq = MockQueue::new(&mem, 16);
        let mut b = new_block(&img, false, "");
        activate(&mut b, &mem, &vq);
        vq.avail().ring().ref_at(0).unwrap().store(200);
        vq.avail().idx().store(1);
        assert!(matches!(b.process_queue(), Err(BlockError::QueueBroken(_))));
        assert!(b.needs_reset());
    }

    #[test]
    fn unready_queue_is_left_alone() {
        let (img, _) = image();
        let mem = guest_memory();
        let vq = MockQueue::new(&mem, QUEUE_SIZE);
        let mut b = new_block(&img, false, "");
        let mut q: Queue = vq.create_queue().unwrap();
        q.set_ready(false);
        b.activate(mem.clone(), 0, vec![q]).unwrap();
        vq.avail().idx().store(1);
        assert_eq!(b.process_queue().unwrap(), 0);
        assert!(!b.needs_reset());
    }
}
