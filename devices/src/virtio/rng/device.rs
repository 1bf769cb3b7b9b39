//! The virtio-rng device.

use std::fs::File;
use std::io::Read;

use log::{debug, warn};
use virtio_queue::{DescriptorChain, Queue};
use vm_memory::{Bytes, GuestMemoryBackend};
use vmm_sys_util::eventfd::EventFd;

use super::{RngError, ENTROPY_SOURCE, MAX_CHAIN_BYTES, QUEUE_SIZE};
use crate::virtio::chain::{self, Table};
use crate::virtio::single_queue::SingleQueue;
use crate::virtio::{
    ActivateError, GuestMemoryMmap, Interrupt, VirtioDevice, VirtioDeviceState, TYPE_RNG,
    VIRTIO_F_VERSION_1,
};

/// What the device holds between DRIVER_OK and reset.
/// A virtio-rng device backed by /dev/urandom (opened once).
pub struct Rng {
    source: File,
    pub(super) q: SingleQueue,
    /// Bounce buffer between the entropy source and guest memory.
    buf: Vec<u8>,
}

impl Rng {
    pub fn new() -> Result<Self, RngError> {
        Ok(Self {
            source: File::open(ENTROPY_SOURCE).map_err(RngError::Open)?,
            q: SingleQueue::new().map_err(RngError::EventFd)?,
            buf: Vec::new(),
        })
    }

    /// Fills available chains, at most [`MAX_CHAINS_PER_DISPATCH`] per call (with more
    /// left, the queue's eventfd is written again so the event loop comes back), then
    /// raises INT_VRING if any completed. Returns how many chains went to the used ring.
    ///
    /// Does nothing before activation, on a queue the driver left unready, or once the
    /// queue is broken. A broken queue sets DEVICE_NEEDS_RESET, raises INT_CONFIG and
    /// returns [`RngError::QueueBroken`].
    ///
    /// [`MAX_CHAINS_PER_DISPATCH`]: crate::virtio::MAX_CHAINS_PER_DISPATCH
    pub fn process_queue(&mut self) -> Result<usize, RngError> {
        let source = &mut self.source;
        let buf = &mut self.buf;
        self.q
            .serve("virtio-rng", |chain, table, mem| {
                fill_chain(chain, table, mem, source, buf)
            })
            .map_err(RngError::QueueBroken)
    }
}

/// Fills a chain's buffers, up to MAX_CHAIN_BYTES; returns the bytes written. A chain
/// that is cut short, has an indirect descriptor (VIRTIO_F_INDIRECT_DESC is never
/// offered), a device-readable descriptor or a buffer outside guest RAM gets nothing.
fn fill_chain(
    chain: DescriptorChain<&GuestMemoryMmap>,
    table: Table,
    mem: &GuestMemoryMmap,
    source: &mut File,
    buf: &mut Vec<u8>,
) -> u32 {
    let head = chain.head_index();
    let descs = match chain::descriptors(&chain, table) {
        Ok(descs) => descs,
        Err(e) => {
            debug!("virtio-rng: chain {head} refused: {e}");
            return 0;
        }
    };
    let bad = descs.iter().any(|d| {
        !d.is_write_only() || !GuestMemoryBackend::check_range(mem, d.addr(), d.len() as usize)
    });
    if bad {
        debug!("virtio-rng: chain {head} has a readable or out-of-RAM buffer");
        return 0;
    }
    let mut written = 0u32;
    for d in &descs {
        let n = d.len().min(MAX_CHAIN_BYTES - written) as usize;
        if n == 0 {
            continue;
        }
        if buf.len() < n {
            buf.resize(n, 0);
        }
        let chunk = &mut buf[..n];
        if let Err(e) = source.read_exact(chunk) {
            warn!("virtio-rng: cannot read {ENTROPY_SOURCE}: {e}");
            break;
        }
        if mem.write_slice(chunk, d.addr()).is_err() {
            break;
        }
        written += n as u32;
    }
    written
}

impl VirtioDevice for Rng {
    fn device_type(&self) -> u32 {
        TYPE_RNG
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1
    }

    /// virtio-rng has no config space.
    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
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
    use super::*;
    use crate::virtio::test_ring::Ring;
    use crate::virtio::{INT_CONFIG, INT_VRING};
    use virtio_bindings::bindings::virtio_ring::{
        VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
    };
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::QueueT;
    use vm_memory::GuestAddress;

    const RAM: u64 = 0x4_0000;
    const BUF: u64 = 0x8000;
    const W: u16 = VRING_DESC_F_WRITE as u16;
    const N: u16 = VRING_DESC_F_NEXT as u16;

    fn desc(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
        RawDescriptor::from(Descriptor::new(addr, len, flags, next))
    }

    fn setup(mem: &GuestMemoryMmap) -> (Rng, MockSplitQueue<'_, GuestMemoryMmap>) {
        let vq = MockSplitQueue::new(mem, QUEUE_SIZE);
        let mut rng = Rng::new().unwrap();
        let q: Queue = vq.create_queue().unwrap();
        rng.activate(mem.clone(), VIRTIO_F_VERSION_1, vec![q])
            .unwrap();
        (rng, vq)
    }

    /// Offers `raw` (table slots from 0), serves it, returns the used length.
    fn run(rng: &mut Rng, vq: &MockSplitQueue<'_, GuestMemoryMmap>, raw: &[RawDescriptor]) -> u32 {
        let before = vq.used().idx().load();
        vq.add_desc_chains(raw, 0).unwrap();
        assert_eq!(rng.process_queue().unwrap(), 1);
        let e = vq.used().ring().ref_at(usize::from(before)).unwrap().load();
        assert_eq!(e.id(), 0);
        e.len()
    }

    fn read(mem: &GuestMemoryMmap, at: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        mem.read_slice(&mut v, GuestAddress(at)).unwrap();
        v
    }

    fn guest_memory() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM as usize)]).unwrap()
    }

    #[test]
    fn device_description() {
        let rng = Rng::new().unwrap();
        assert_eq!(rng.device_type(), TYPE_RNG);
        assert_eq!(rng.queue_max_sizes(), &[256]);
        assert_eq!(rng.avail_features(), VIRTIO_F_VERSION_1);
        let mut b = [0xffu8; 4];
        rng.read_config(0, &mut b);
        assert_eq!(b, [0; 4]);
        assert!(!rng.is_activated());
    }

    #[test]
    fn activate_needs_one_queue() {
        let mem = guest_memory();
        let mut rng = Rng::new().unwrap();
        let qs = vec![Queue::new(16).unwrap(), Queue::new(16).unwrap()];
        assert!(matches!(
            rng.activate(mem.clone(), 0, qs),
            Err(ActivateError::QueueCount {
                expected: 1,
                got: 2
            })
        ));
        assert!(!rng.is_activated());
        assert_eq!(rng.process_queue().unwrap(), 0);
    }

    #[test]
    fn fills_buffers_with_fresh_bytes() {
        let mem = guest_memory();
        let (mut rng, vq) = setup(&mem);
        let chain = [desc(BUF, 100, W | N, 1), desc(BUF + 0x1000, 200, W, 0)];
        assert_eq!(run(&mut rng, &vq, &chain), 300);
        let first = [read(&mem, BUF, 100), read(&mem, BUF + 0x1000, 200)].concat();
        assert_ne!(first, vec![0u8; 300]);
        assert_eq!(rng.interrupt().status(), INT_VRING);

        assert_eq!(run(&mut rng, &vq, &chain), 300);
        let second = [read(&mem, BUF, 100), read(&mem, BUF + 0x1000, 200)].concat();
        assert_ne!(first, second);
    }

    #[test]
    fn fill_is_bounded_per_chain() {
        let mem = guest_memory();
        let (mut rng, vq) = setup(&mem);
        let len = 0x2_0000u32; // 128 KiB
        assert_eq!(run(&mut rng, &vq, &[desc(BUF, len, W, 0)]), MAX_CHAIN_BYTES);
        let tail = read(&mem, BUF + u64::from(MAX_CHAIN_BYTES), 4096);
        assert_eq!(tail, vec![0u8; 4096], "nothing written past the limit");
        // Over several descriptors too.
        let chain = [
            desc(BUF, 0xc000, W | N, 1),
            desc(BUF + 0xc000, 0xc000, W | N, 2),
            desc(BUF + 0x18000, 16, W, 0),
        ];
        assert_eq!(run(&mut rng, &vq, &chain), MAX_CHAIN_BYTES);
    }

    #[test]
    fn malformed_chains_get_nothing() {
        let mem = guest_memory();
        let (mut rng, vq) = setup(&mem);
        let cases: [&[RawDescriptor]; 6] = [
            // Device-readable buffer.
            &[desc(BUF, 64, 0, 0)],
            // One readable among writable ones.
            &[
                desc(BUF, 64, W | N, 1),
                desc(BUF + 64, 64, N, 2),
                desc(BUF + 128, 64, W, 0),
            ],
            // Outside guest RAM, and straddling its end.
            &[desc(BUF, 64, W | N, 1), desc(0x100_0000, 64, W, 0)],
            &[desc(RAM - 32, 64, W, 0)],
            // A loop, and a `next` beyond the table.
            &[desc(BUF, 64, W | N, 1), desc(BUF + 64, 64, W | N, 0)],
            &[desc(BUF, 64, W | N, 999)],
        ];
        for (i, chain) in cases.iter().enumerate() {
            assert_eq!(run(&mut rng, &vq, chain), 0, "case {i}");
            assert_eq!(read(&mem, BUF, 192), vec![0u8; 192], "case {i} wrote");
        }
        assert!(!rng.needs_reset());
        assert_eq!(run(&mut rng, &vq, &[desc(BUF, 64, W, 0)]), 64);
    }

    #[test]
    fn broken_queue_needs_reset() {
        let mem = guest_memory();
        let (mut rng, vq) = setup(&mem);
        vq.avail().idx().store(QUEUE_SIZE + 1);
        assert!(matches!(rng.process_queue(), Err(RngError::QueueBroken(_))));
        assert!(rng.needs_reset());
        assert_eq!(rng.interrupt().status(), INT_CONFIG);
        assert_eq!(rng.process_queue().unwrap(), 0);
        rng.reset();
        assert!(!rng.needs_reset() && !rng.is_activated());
    }

    /// VIRTIO_F_INDIRECT_DESC is never offered: a chain with an indirect descriptor
    /// gets nothing, however good the table behind it.
    #[test]
    fn indirect_chains_get_nothing() {
        let mem = guest_memory();
        let (mut rng, vq) = setup(&mem);
        let table = BUF + 0x1_0000;
        mem.write_obj(desc(BUF, 64, W, 0), GuestAddress(table))
            .unwrap();
        let indirect = VRING_DESC_F_INDIRECT as u16;
        assert_eq!(run(&mut rng, &vq, &[desc(table, 16, indirect, 0)]), 0);
        // Behind a direct descriptor too.
        let mixed = [desc(BUF + 64, 64, W | N, 1), desc(table, 16, indirect, 0)];
        assert_eq!(run(&mut rng, &vq, &mixed), 0);
        assert_eq!(
            read(&mem, BUF, 128),
            vec![0u8; 128],
            "a refused chain was filled"
        );
        assert!(!rng.needs_reset());
        assert_eq!(run(&mut rng, &vq, &[desc(BUF, 64, W, 0)]), 64);
    }

    /// One dispatch fills at most the budget and re-kicks the queue with work left.
    #[test]
    fn dispatch_is_bounded_and_rekicks_with_work_left() {
        let mem = guest_memory();
        // More than 128 outstanding entries: the Ring helper, not MockSplitQueue.
        let ring = Ring::at(0, QUEUE_SIZE);
        let mut rng = Rng::new().unwrap();
        rng.activate(mem.clone(), VIRTIO_F_VERSION_1, vec![ring.queue()])
            .unwrap();
        let pending = 200;
        for _ in 0..pending {
            ring.offer(&mem, &[desc(BUF, 16, W, 0)], 0);
        }
        let kick = rng.queue_events()[0].try_clone().unwrap();
        crate::virtio::test_ring::assert_bounded_dispatches(pending, &kick, || {
            rng.process_queue().unwrap()
        });
        assert_eq!(ring.used(&mem).len(), pending);
    }
}
