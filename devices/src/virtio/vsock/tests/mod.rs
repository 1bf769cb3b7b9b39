//! Device-level tests: a guest driver emulated over mock queues in real guest memory,
//! host processes emulated with real Unix sockets, the device run by a real
//! `EventManager`. This file is the harness; `connections` covers connection set-up,
//! data and teardown, `hostile` credit, malformed input, limits and resets.

mod connections;
mod dispatch;
mod hostile;

use crate::virtio::GuestMemoryMmap;
use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use event_manager::{EventManager, SubscriberOps};
use virtio_bindings::bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use vm_memory::{Address, Bytes, GuestAddress};
use vmm_sys_util::tempdir::TempDir;

use super::device::{EVQ, RXQ, TXQ};
use super::muxer::Limits;
use super::packet::*;
use super::{Vsock, CONN_BUF_SIZE, HOST_CID};
use crate::bus::lock;
use crate::virtio::{VirtioDevice, VIRTIO_F_VERSION_1};

const CID: u64 = 42;
const MEM_SIZE: u64 = 0x200_0000;
const QSIZE: u16 = 256;
const BUF_BASE: u64 = 0x10_0000;
const RX_BUF: u32 = 4096;
const WAIT: Duration = Duration::from_secs(5);
const TICK: Duration = Duration::from_millis(250);

/// The guest driver's side of the three queues, on virtio-queue's mock rings: with
/// QSIZE 256 their used ring overlaps avail entries 128-255, so a test offers at most
/// 128 chains per queue (none does more today; a test that must uses `test_ring::Ring`).
struct Guest {
    mem: &'static GuestMemoryMmap,
    qs: Vec<MockSplitQueue<'static, GuestMemoryMmap>>,
    next_desc: [u16; 3],
    seen: [u16; 3],
    /// Buffer address of each outstanding rx/event chain, by head.
    bufs: [HashMap<u16, u64>; 3],
    next_addr: u64,
}

impl Guest {
    fn alloc(&mut self, len: u64) -> u64 {
        let a = self.next_addr;
        self.next_addr += (len + 63) & !63;
        assert!(self.next_addr <= MEM_SIZE, "test ran out of guest memory");
        a
    }

    /// Adds a chain of (addr, len, device-writable) buffers to queue `q`.
    fn push(&mut self, q: usize, descs: &[(u64, u32, bool)]) -> u16 {
        let n = descs.len() as u16;
        if self.next_desc[q] + n > QSIZE {
            self.next_desc[q] = 0;
        }
        let start = self.next_desc[q];
        let raw: Vec<RawDescriptor> = descs
            .iter()
            .enumerate()
            .map(|(i, &(addr, len, w))| {
                let last = i + 1 == descs.len();
                let mut flags = if w { VRING_DESC_F_WRITE as u16 } else { 0 };
                if !last {
                    flags |= VRING_DESC_F_NEXT as u16;
                }
                let next = if last { 0 } else { start + i as u16 + 1 };
                RawDescriptor::from(Descriptor::new(addr, len, flags, next))
            })
            .collect();
        self.push_raw(q, &raw, start);
        self.next_desc[q] += n;
        start
    }

    fn push_raw(&mut self, q: usize, raw: &[RawDescriptor], start: u16) {
        self.qs[q].add_desc_chains(raw, start).unwrap();
    }

    /// New used entries of queue `q`: (head, len).
    fn used(&mut self, q: usize) -> Vec<(u16, u32)> {
        let base = self.qs[q].used_addr();
        let idx: u16 = self.mem.read_obj(base.unchecked_add(2)).unwrap();
        let mut out = Vec::new();
        while self.seen[q] != idx {
            let e = base.unchecked_add(4 + 8 * u64::from(self.seen[q] % QSIZE));
            let id: u32 = self.mem.read_obj(e).unwrap();
            let len: u32 = self.mem.read_obj(e.unchecked_add(4)).unwrap();
            out.push((id as u16, len));
            self.seen[q] = self.seen[q].wrapping_add(1);
        }
        out
    }
}

/// A device on the event loop, its guest, and its socket directory.
struct H {
    _dir: TempDir,
    path: PathBuf,
    dev: Arc<Mutex<Vsock>>,
    em: EventManager<Arc<Mutex<Vsock>>>,
    g: Guest,
    rx: VecDeque<(Header, Vec<u8>)>,
    events: Vec<(u32, Vec<u8>)>,
}

fn pkt(op: u16, src_port: u32, dst_port: u32) -> Header {
    Header {
        src_cid: CID,
        dst_cid: HOST_CID,
        src_port,
        dst_port,
        type_: TYPE_STREAM,
        op,
        buf_alloc: 1 << 20,
        ..Header::default()
    }
}

impl H {
    fn new() -> Self {
        Self::with(Limits::default(), TICK, 32)
    }

    /// A device with these limits and timer tick, and `rx` buffers posted.
    fn with(limits: Limits, tick: Duration, rx: usize) -> Self {
        let dir = TempDir::new().unwrap();
        let path = dir.as_path().join("vsock.sock");
        let mut dev = Vsock::new(CID, path.clone()).unwrap();
        dev.set_limits(limits, tick);
        let mem: &'static GuestMemoryMmap = Box::leak(Box::new(
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).unwrap(),
        ));
        let qs: Vec<_> = (0..3u64)
            .map(|i| MockSplitQueue::create(mem, GuestAddress(i * 0x1_0000), QSIZE))
            .collect();
        let queues: Vec<Queue> = qs.iter().map(|q| q.create_queue().unwrap()).collect();
        dev.activate(mem.clone(), VIRTIO_F_VERSION_1, queues)
            .unwrap();
        let dev = Arc::new(Mutex::new(dev));
        let mut em = EventManager::new().unwrap();
        em.add_subscriber(dev.clone());
        let g = Guest {
            mem,
            qs,
            next_desc: [0; 3],
            seen: [0; 3],
            bufs: Default::default(),
            next_addr: BUF_BASE,
        };
        let mut h = Self {
            _dir: dir,
            path,
            dev,
            em,
            g,
            rx: VecDeque::new(),
            events: Vec::new(),
        };
        if rx > 0 {
            h.add_rx(rx);
        }
        h
    }

    fn notify(&self, q: usize) {
        lock(&self.dev).queue_events()[q].write(1).unwrap();
    }

    fn add_rx(&mut self, n: usize) {
        for _ in 0..n {
            let a = self.g.alloc(RX_BUF.into());
            let head = self.g.push(RXQ, &[(a, RX_BUF, true)]);
            self.g.bufs[RXQ].insert(head, a);
        }
        self.notify(RXQ);
    }

    fn add_event_buffer(&mut self) {
        let a = self.g.alloc(8);
        let head = self.g.push(EVQ, &[(a, 8, true)]);
        self.g.bufs[EVQ].insert(head, a);
        self.notify(EVQ);
    }

    /// Sends a packet, header and data in two descriptors; `len` is set from `data`.
    fn send(&mut self, mut hdr: Header, data: &[u8]) {
        hdr.len = data.len() as u32;
        let a = self.g.alloc(HDR_SIZE as u64);
        self.g
            .mem
            .write_slice(&hdr.to_bytes(), GuestAddress(a))
            .unwrap();
        let mut descs = vec![(a, HDR_SIZE as u32, false)];
        if !data.is_empty() {
            let d = self.g.alloc(data.len() as u64);
            self.g.mem.write_slice(data, GuestAddress(d)).unwrap();
            descs.push((d, data.len() as u32, false));
        }
        self.g.push(TXQ, &descs);
        self.notify(TXQ);
    }

    /// Runs the event loop until it has been idle for a moment (or a timer keeps it
    /// busy for half a second).
    fn run_idle(&mut self) {
        let end = Instant::now() + Duration::from_millis(500);
        while self.em.run_with_timeout(30).unwrap() > 0 && Instant::now() < end {}
    }

    /// Runs the event loop until idle and takes what reached the guest.
    fn settle(&mut self) {
        self.run_idle();
        self.collect();
    }

    /// Takes used rx and event buffers, reposting rx buffers as a driver would.
    fn collect(&mut self) {
        let used = self.g.used(RXQ);
        let refill = used.len();
        for (head, len) in used {
            let a = self.g.bufs[RXQ].remove(&head).unwrap();
            assert!(len as usize >= HDR_SIZE, "rx packet of {len} bytes");
            let mut raw = [0u8; HDR_SIZE];
            self.g.mem.read_slice(&mut raw, GuestAddress(a)).unwrap();
            let hdr = Header::from_bytes(&raw);
            let mut data = vec![0u8; len as usize - HDR_SIZE];
            self.g
                .mem
                .read_slice(&mut data, GuestAddress(a + HDR_SIZE as u64))
                .unwrap();
            assert_eq!(hdr.len as usize, data.len());
            self.rx.push_back((hdr, data));
        }
        if refill > 0 {
            self.add_rx(refill);
        }
        for (head, len) in self.g.used(EVQ) {
            let a = self.g.bufs[EVQ].remove(&head).unwrap();
            let mut b = vec![0u8; len as usize];
            self.g.mem.read_slice(&mut b, GuestAddress(a)).unwrap();
            self.events.push((len, b));
        }
    }

    /// Runs until the guest has a packet, and takes it.
    fn expect_rx(&mut self) -> (Header, Vec<u8>) {
        let end = Instant::now() + WAIT;
        loop {
            if let Some(p) = self.rx.pop_front() {
                return p;
            }
            assert!(Instant::now() < end, "no packet reached the guest");
            self.em.run_with_timeout(20).unwrap();
            self.collect();
        }
    }

    fn expect_op(&mut self, op: u16) -> (Header, Vec<u8>) {
        let p = self.expect_rx();
        assert_eq!(p.0.op, op, "unexpected packet {:?}", p.0);
        assert_eq!(
            (p.0.src_cid, p.0.dst_cid, p.0.type_),
            (HOST_CID, CID, TYPE_STREAM)
        );
        p
    }

    fn expect_quiet(&mut self) {
        self.settle();
        assert!(self.rx.is_empty(), "unexpected packets {:?}", self.rx);
    }

    fn host(&self, port: u32) -> UnixStream {
        let mut s = UnixStream::connect(&self.path).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        writeln!(s, "CONNECT {port}").unwrap();
        s
    }

    /// A host-initiated connection to guest `port`, accepted: the stream and its
    /// host-side port.
    fn host_established(&mut self, port: u32) -> (UnixStream, u32) {
        let mut s = self.host(port);
        let (req, _) = self.expect_op(OP_REQUEST);
        assert_eq!(req.dst_port, port);
        self.send(pkt(OP_RESPONSE, port, req.src_port), &[]);
        self.settle();
        assert_eq!(read_line(&mut s), format!("OK {}", req.src_port));
        (s, req.src_port)
    }

    /// A guest-initiated connection from guest port `gport` to host port `hport`.
    fn guest_established(&mut self, l: &UnixListener, gport: u32, hport: u32) -> UnixStream {
        self.send(pkt(OP_REQUEST, gport, hport), &[]);
        let (resp, _) = self.expect_op(OP_RESPONSE);
        assert_eq!((resp.src_port, resp.dst_port), (hport, gport));
        let (s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s
    }

    fn listen(&self, port: u32) -> UnixListener {
        UnixListener::bind(format!("{}_{port}", self.path.display())).unwrap()
    }

    fn conns(&self) -> usize {
        lock(&self.dev).muxer.conn_count()
    }
}

fn read_line(s: &mut UnixStream) -> String {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while s.read(&mut b).unwrap() == 1 && b[0] != b'\n' {
        line.push(b[0]);
    }
    String::from_utf8(line).unwrap()
}

/// Whether the device closed `s` (without waiting).
fn is_closed(s: &mut UnixStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut b = [0u8; 16];
    let r = match s.read(&mut b) {
        Ok(0) => true,
        Err(e) if e.kind() == ErrorKind::ConnectionReset => true,
        Err(e) if e.kind() == ErrorKind::WouldBlock => false,
        r => panic!("unexpected bytes or error: {r:?}"),
    };
    s.set_nonblocking(false).unwrap();
    r
}

fn assert_closed(s: &mut UnixStream) {
    let mut b = [0u8; 16];
    match s.read(&mut b) {
        Ok(0) => {}
        Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
        r => panic!("stream still open: {r:?}"),
    }
}
