//! virtio-net against a real TAP interface: frames the driver queues come
//! out of the interface (seen by a packet socket on it), frames sent on the
//! interface land in the driver's buffers, and hostile chains are refused
//! without stopping either queue.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use virtio_bindings::bindings::virtio_net::{VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4};
use virtio_bindings::bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor, RawDescriptor};
use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::virtio::test_ring::Ring;
use crate::virtio::{GuestMemoryMmap, VirtioDevice, MAX_CHAINS_PER_DISPATCH, VIRTIO_F_VERSION_1};

const RAM: u64 = 0x20_0000;
const W: u16 = VRING_DESC_F_WRITE as u16;
const N: u16 = VRING_DESC_F_NEXT as u16;
/// An EtherType for local experiments (IEEE 802): only the test's frames
/// carry it, whatever else the host sends on the interface.
const ETHERTYPE: u16 = 0x88b5;
const MAC: [u8; 6] = [0x06, 0x00, 0xac, 0x10, 0x00, 0x02];
const PEER: [u8; 6] = [0x06, 0x00, 0xac, 0x10, 0x00, 0x01];

fn desc(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
    RawDescriptor::from(Descriptor::new(addr, len, flags, next))
}

/// A TAP of its own (up, no IPv6 chatter) and a packet socket on it.
struct Wire {
    tap: Option<Tap>,
    sock: OwnedFd,
    ifindex: i32,
}

impl Wire {
    fn new() -> Wire {
        static N: AtomicU32 = AtomicU32::new(0);
        assert!(
            std::path::Path::new("/dev/net/tun").exists(),
            "/dev/net/tun is missing: virtio-net's tests need the tun driver"
        );
        let name = format!(
            "spt{}n{}",
            std::process::id() % 100_000,
            N.fetch_add(1, Ordering::Relaxed)
        );
        let tap = Tap::open(&name).unwrap_or_else(|e| panic!("open TAP {name} (root?): {e}"));
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6"), "1");
        let up = std::process::Command::new("ip")
            .args(["link", "set", &name, "up"])
            .status()
            .expect("run ip");
        assert!(up.success(), "ip link set {name} up");
        let cname = std::ffi::CString::new(name.clone()).unwrap();
        // SAFETY: a NUL-terminated name, read for the call.
        let ifindex = unsafe { libc::if_nametoindex(cname.as_ptr()) } as i32;
        assert!(ifindex > 0, "no index for {name}");
        let proto = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket creation; the fd is owned below.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(proto)) };
        assert!(
            fd >= 0,
            "packet socket: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: `fd` is a new socket no one else owns.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_ll is plain data; all zero is a valid start.
        let mut sa: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sa.sll_family = libc::AF_PACKET as u16;
        sa.sll_protocol = proto;
        sa.sll_ifindex = ifindex;
        // SAFETY: `sa` is a sockaddr_ll of the size given, alive for the call.
        let r = unsafe {
            libc::bind(
                sock.as_raw_fd(),
                (&sa as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(r, 0, "bind: {}", std::io::Error::last_os_error());
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 200_000,
        };
        // SAFETY: SO_RCVTIMEO reads one timeval, `tv`, alive for the call.
        unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as u32,
            )
        };
        Wire {
            tap: Some(tap),
            sock,
            ifindex,
        }
    }

    /// Sends `frame` out of the interface (so the TAP reads it).
    fn send(&self, frame: &[u8]) {
        // SAFETY: sockaddr_ll is plain data; all zero is a valid start.
        let mut sa: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sa.sll_family = libc::AF_PACKET as u16;
        sa.sll_ifindex = self.ifindex;
        sa.sll_halen = 6;
        sa.sll_addr[..6].copy_from_slice(&frame[..6]);
        // SAFETY: `frame` and `sa` are valid for reads of the lengths given.
        let n = unsafe {
            libc::sendto(
                self.sock.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&sa as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(
            n,
            frame.len() as isize,
            "{}",
            std::io::Error::last_os_error()
        );
    }

    /// The next frame of the test's EtherType seen on the interface, if
    /// one comes within `limit`.
    fn recv(&self, limit: Duration) -> Option<Vec<u8>> {
        let start = Instant::now();
        let mut buf = vec![0u8; 70_000];
        while start.elapsed() < limit {
            // SAFETY: `buf` is valid for writes of its length.
            let n =
                unsafe { libc::recv(self.sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n >= 14 && buf[12..14] == ETHERTYPE.to_be_bytes() {
                return Some(buf[..n as usize].to_vec());
            }
        }
        None
    }
}

fn frame(dst: [u8; 6], src: [u8; 6], payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&ETHERTYPE.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

struct Setup {
    wire: Wire,
    net: Net,
    mem: GuestMemoryMmap,
    rx: Ring,
    tx: Ring,
}

fn setup(features: u64) -> Setup {
    let mut wire = Wire::new();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM as usize)]).unwrap();
    let rx = Ring::at(0x1000, QUEUE_SIZE);
    let tx = Ring::at(0x9000, QUEUE_SIZE);
    let mut net = Net::new(wire.tap.take().unwrap(), MAC).unwrap();
    net.activate(mem.clone(), features, vec![rx.queue(), tx.queue()])
        .unwrap();
    Setup {
        wire,
        net,
        mem,
        rx,
        tx,
    }
}

/// Pumps until `done` holds (the host delivers frames asynchronously).
fn pump_until(s: &mut Setup, what: &str, mut done: impl FnMut(&Setup) -> bool) {
    let start = Instant::now();
    loop {
        s.net.pump();
        if done(s) {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn config_space_is_the_mac_and_offloads_are_offered() {
    let s = setup(VIRTIO_F_VERSION_1);
    let mut cfg = [0xffu8; 8];
    s.net.read_config(0, &mut cfg);
    assert_eq!(&cfg[..6], &MAC);
    assert_eq!(&cfg[6..], &[0, 0]);
    let mut one = [0u8; 1];
    s.net.read_config(5, &mut one);
    assert_eq!(one[0], MAC[5]);
    s.net.read_config(u64::MAX, &mut one);
    assert_eq!(one[0], 0);
    let f = s.net.avail_features();
    assert_ne!(f & VIRTIO_F_VERSION_1, 0);
    assert_ne!(f & (1 << VIRTIO_NET_F_GUEST_TSO4), 0);
    assert!(
        Net::new(
            Tap::open(&format!("spt{}m", std::process::id() % 100_000)).unwrap(),
            [1, 0, 0, 0, 0, 1]
        )
        .is_err(),
        "a multicast MAC"
    );
    assert!(Tap::open("no spaces").is_err());
    assert!(Tap::open("sixteen-chars-xx").is_err());
}

#[test]
fn a_queued_frame_leaves_through_the_tap() {
    let mut s = setup(VIRTIO_F_VERSION_1);
    let f = frame(PEER, MAC, b"sprout says hello over the tap");
    // The header in one descriptor, the frame in the next.
    s.mem
        .write_slice(&[0u8; HDR_SIZE], GuestAddress(0x10_0000))
        .unwrap();
    s.mem.write_slice(&f, GuestAddress(0x10_1000)).unwrap();
    s.tx.offer(
        &s.mem,
        &[
            desc(0x10_0000, HDR_SIZE as u32, N, 1),
            desc(0x10_1000, f.len() as u32, 0, 0),
        ],
        0,
    );
    s.net.pump();
    assert_eq!(s.tx.used(&s.mem), vec![(0, 0)]);
    let seen = s
        .wire
        .recv(Duration::from_secs(5))
        .expect("the frame on the wire");
    assert_eq!(seen, f);
    let st = s.net.stats();
    assert_eq!((st.tx_frames, st.tx_bytes), (1, f.len() as u64));
}

#[test]
fn a_frame_on_the_wire_lands_in_the_drivers_buffer_with_its_header() {
    let mut s =
        setup(VIRTIO_F_VERSION_1 | (1 << VIRTIO_NET_F_GUEST_CSUM) | (1 << VIRTIO_NET_F_GUEST_TSO4));
    // No buffer yet: the frame waits for one, and is not lost.
    let f = frame(MAC, PEER, b"from the host side");
    s.wire.send(&f);
    pump_until(&mut s, "the frame read from the TAP", |s| {
        s.net.rx_pending()
    });
    // Buffers of 1514 bytes: room for a frame, not for a 64 KiB one. Each
    // frame the host sent (ours, and any the kernel sends on a new link)
    // takes one.
    for i in 0..8u16 {
        s.rx.offer(
            &s.mem,
            &[desc(
                0x11_0000 + u64::from(i) * 0x1000,
                1514 + HDR_SIZE as u32,
                W,
                0,
            )],
            i,
        );
    }
    let mut got = None;
    pump_until(&mut s, "our frame delivered", |s| {
        got = s.rx.used(&s.mem).into_iter().find_map(|(head, len)| {
            let at = 0x11_0000 + u64::from(head) * 0x1000;
            let mut b = vec![0u8; len as usize];
            s.mem.read_slice(&mut b, GuestAddress(at)).unwrap();
            (len as usize > HDR_SIZE + 14
                && b[HDR_SIZE + 12..HDR_SIZE + 14] == ETHERTYPE.to_be_bytes())
            .then_some(b)
        });
        got.is_some()
    });
    let b = got.unwrap();
    assert_eq!(&b[HDR_SIZE..], &f[..]);
    assert_eq!(u16::from_le_bytes([b[10], b[11]]), 1, "num_buffers");
    assert!(s.net.stats().rx_frames >= 1);
}

#[test]
fn hostile_transmit_chains_are_refused_and_the_queue_goes_on() {
    let mut s = setup(VIRTIO_F_VERSION_1);
    let good = frame(PEER, MAC, b"still works");
    let mut pkt = vec![0u8; HDR_SIZE];
    pkt.extend_from_slice(&good);
    s.mem.write_slice(&pkt, GuestAddress(0x10_0000)).unwrap();
    let len = pkt.len() as u32;
    // (slot, chain): `next` indices are the table's.
    let chains: Vec<(u16, Vec<RawDescriptor>)> = vec![
        // Device-writable.
        (0, vec![desc(0x10_0000, len, W, 0)]),
        // Shorter than the header.
        (1, vec![desc(0x10_0000, 4, 0, 0)]),
        // Over the largest frame.
        (
            2,
            vec![desc(0x10_0000, 40_000, N, 3), desc(0x10_0000, 40_000, 0, 0)],
        ),
        // Outside guest RAM.
        (4, vec![desc(RAM - 8, 64, 0, 0)]),
        // A loop: each descriptor's next is the other.
        (
            5,
            vec![desc(0x10_0000, 16, N, 6), desc(0x10_0000, 16, N, 5)],
        ),
        // Then a good one.
        (7, vec![desc(0x10_0000, len, 0, 0)]),
    ];
    for (slot, c) in &chains {
        s.tx.offer(&s.mem, c, *slot);
    }
    s.net.pump();
    let used = s.tx.used(&s.mem);
    assert_eq!(used.len(), chains.len(), "every chain given back: {used:?}");
    assert!(used.iter().all(|&(_, len)| len == 0));
    let st = s.net.stats();
    assert_eq!(st.tx_bad_chains, 5, "{st:?}");
    assert_eq!(st.tx_frames, 1, "{st:?}");
    assert_eq!(s.wire.recv(Duration::from_secs(5)), Some(good));
    assert!(!s.net.needs_reset());
}

#[test]
fn a_transmit_flood_is_served_a_bounded_batch_per_dispatch() {
    let mut s = setup(VIRTIO_F_VERSION_1);
    let f = frame(PEER, MAC, b"flood");
    let mut pkt = vec![0u8; HDR_SIZE];
    pkt.extend_from_slice(&f);
    s.mem.write_slice(&pkt, GuestAddress(0x10_0000)).unwrap();
    let n = 200u16;
    for i in 0..n {
        s.tx.offer(&s.mem, &[desc(0x10_0000, pkt.len() as u32, 0, 0)], i);
    }
    let _ = s.net.kick_event().read();
    s.net.pump();
    assert_eq!(s.tx.used(&s.mem).len(), MAX_CHAINS_PER_DISPATCH);
    assert_eq!(
        s.net.kick_event().read().unwrap(),
        1,
        "the device kicked itself"
    );
    let mut rounds = 1;
    while s.tx.used(&s.mem).len() < usize::from(n) {
        s.net.pump();
        rounds += 1;
        assert!(rounds <= 4, "done in ceil(200 / 64) dispatches");
    }
    let st = s.net.stats();
    assert_eq!(st.tx_frames + st.tx_dropped, u64::from(n), "{st:?}");
}

#[test]
fn hostile_receive_chains_are_refused_and_small_ones_keep_their_buffer() {
    let mut s = setup(VIRTIO_F_VERSION_1);
    let f = frame(MAC, PEER, &[7u8; 1000]);
    s.wire.send(&f);
    pump_until(&mut s, "the frame read from the TAP", |s| {
        s.net.rx_pending()
    });
    // A device-readable buffer: refused, given back empty; the frame waits.
    s.rx.offer(&s.mem, &[desc(0x11_0000, 2000, 0, 0)], 0);
    s.net.pump();
    assert_eq!(s.rx.used(&s.mem), vec![(0, 0)]);
    assert!(s.net.rx_pending(), "the frame waits for a good buffer");
    assert_eq!(s.net.stats().rx_bad_chains, 1);
    // Then a good one takes it.
    s.rx.offer(&s.mem, &[desc(0x12_0000, 2000, W, 0)], 1);
    s.net.pump();
    let used = s.rx.used(&s.mem);
    assert_eq!(used.len(), 2, "{used:?}");
    let (head, len) = used[1];
    assert_eq!(head, 1);
    assert_eq!(len as usize, HDR_SIZE + f.len());
    let mut b = vec![0u8; f.len()];
    s.mem
        .read_slice(&mut b, GuestAddress(0x12_0000 + HDR_SIZE as u64))
        .unwrap();
    assert_eq!(b, f);
    // A frame bigger than the only buffer is dropped, and the buffer stays
    // the driver's (not used).
    let big = frame(MAC, PEER, &[9u8; 1400]);
    s.rx.offer(&s.mem, &[desc(0x13_0000, 200, W, 0)], 2);
    let dropped = s.net.stats().rx_dropped;
    s.wire.send(&big);
    pump_until(&mut s, "the big frame dropped", |s| {
        s.net.stats().rx_dropped > dropped
    });
    assert_eq!(s.rx.used(&s.mem).len(), 2, "the small buffer was not used");
    assert!(!s.net.needs_reset());
}

#[test]
fn a_reset_drops_the_queues_and_a_waiting_frame() {
    let mut s = setup(VIRTIO_F_VERSION_1);
    s.wire.send(&frame(MAC, PEER, b"before the reset"));
    pump_until(&mut s, "the frame read from the TAP", |s| {
        s.net.rx_pending()
    });
    s.net.reset();
    assert!(!s.net.is_activated());
    assert!(!s.net.rx_pending());
    assert!(s.net.active_queues().is_empty());
    // Activates again with the two queues, and refuses any other count.
    let (rx, tx) = (s.rx.queue(), s.tx.queue());
    assert!(s
        .net
        .activate(s.mem.clone(), VIRTIO_F_VERSION_1, vec![s.rx.queue()])
        .is_err());
    s.net
        .activate(s.mem.clone(), VIRTIO_F_VERSION_1, vec![rx, tx])
        .unwrap();
    assert_eq!(s.net.active_queues().len(), 2);
}

#[test]
fn the_event_loop_carries_frames_both_ways_and_idles_while_a_frame_waits() {
    use event_manager::{EventManager, SubscriberOps};
    use std::sync::{Arc, Mutex};

    let Setup {
        wire,
        net,
        mem,
        rx,
        tx,
    } = setup(VIRTIO_F_VERSION_1);
    let net = Arc::new(Mutex::new(net));
    let mut em = EventManager::<Arc<Mutex<Net>>>::new().unwrap();
    em.add_subscriber(net.clone());
    let run_until =
        |em: &mut EventManager<Arc<Mutex<Net>>>, what: &str, done: &dyn Fn() -> bool| {
            let start = Instant::now();
            while !done() {
                assert!(start.elapsed() < Duration::from_secs(10), "{what}");
                em.run_with_timeout(50).unwrap();
            }
        };
    // Two frames from the host with no buffer to go to: the first is read
    // and waits, then the TAP (still readable: the second is in it) is left
    // alone, so the loop idles instead of spinning on it.
    let f = frame(MAC, PEER, b"waits for a buffer");
    let f2 = frame(MAC, PEER, b"second");
    wire.send(&f);
    wire.send(&f2);
    run_until(&mut em, "the frame read", &|| {
        net.lock().unwrap().rx_pending()
    });
    let mut events = 0;
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(300) {
        events += em.run_with_timeout(50).unwrap();
    }
    assert!(events <= 2, "{events} events while idle");
    // The driver posts a buffer and notifies: the frame lands in it.
    rx.offer(&mem, &[desc(0x11_0000, 2000, W, 0)], 0);
    net.lock().unwrap().queue_events()[0].write(1).unwrap();
    run_until(&mut em, "the frame delivered", &|| rx.used(&mem).len() == 1);
    let mut b = vec![0u8; f.len()];
    mem.read_slice(&mut b, GuestAddress(0x11_0000 + HDR_SIZE as u64))
        .unwrap();
    assert_eq!(b, f);
    // The TAP is watched again: the second frame needs no pump by hand.
    rx.offer(&mem, &[desc(0x12_0000, 2000, W, 0)], 1);
    net.lock().unwrap().queue_events()[0].write(1).unwrap();
    run_until(&mut em, "the second frame delivered", &|| {
        rx.used(&mem).len() == 2
    });
    let mut b = vec![0u8; f2.len()];
    mem.read_slice(&mut b, GuestAddress(0x12_0000 + HDR_SIZE as u64))
        .unwrap();
    assert_eq!(b, f2);
    let f3 = frame(MAC, PEER, b"third");
    rx.offer(&mem, &[desc(0x14_0000, 2000, W, 0)], 2);
    wire.send(&f3);
    run_until(&mut em, "the third frame delivered", &|| {
        rx.used(&mem).len() == 3
    });
    // And the driver's transmit notify sends.
    let out = frame(PEER, MAC, b"out through the loop");
    let mut pkt = vec![0u8; HDR_SIZE];
    pkt.extend_from_slice(&out);
    mem.write_slice(&pkt, GuestAddress(0x13_0000)).unwrap();
    tx.offer(&mem, &[desc(0x13_0000, pkt.len() as u32, 0, 0)], 0);
    net.lock().unwrap().queue_events()[1].write(1).unwrap();
    run_until(&mut em, "the frame sent", &|| tx.used(&mem).len() == 1);
    assert_eq!(wire.recv(Duration::from_secs(5)), Some(out));
}

#[test]
fn state_round_trips_is_checked_and_a_restored_device_serves_on_its_own_tap() {
    use crate::bus::lock;
    use crate::state::{copy_guest_memory, postcard_round_trip, versions, Persist, StateError};
    use crate::virtio::mmio::{MmioRestoreArgs, MmioTransport};
    use crate::virtio::VirtioDeviceState;
    use std::sync::{Arc, Mutex};

    // An idle device: nothing but its MAC.
    let mut w = Wire::new();
    let idle = Net::new(w.tap.take().unwrap(), MAC).unwrap().save();
    assert_eq!(idle.virtio, VirtioDeviceState::default());
    assert_eq!(idle.mac, MAC);
    let args = |w: &mut Wire, mac| NetRestoreArgs {
        tap: w.tap.take().unwrap(),
        mac,
    };
    let mut w2 = Wire::new();
    let n = Net::restore(args(&mut w2, None), &postcard_round_trip(&idle)).unwrap();
    assert!(!n.is_activated());
    let bad = |edit: fn(&mut NetState)| {
        let mut s = NetState {
            version: versions::NET,
            virtio: VirtioDeviceState {
                activated: true,
                acked_features: VIRTIO_F_VERSION_1,
                needs_reset: false,
            },
            mac: MAC,
        };
        edit(&mut s);
        let mut w = Wire::new();
        Net::restore(args(&mut w, None), &s).err().unwrap()
    };
    assert!(matches!(bad(|s| s.version = 0), StateError::Version { .. }));
    bad(|s| s.virtio.acked_features |= 1 << 60);
    bad(|s| s.virtio.activated = false);
    bad(|s| s.mac = [0xff; 6]);

    // A running device, saved and restored on another TAP with another MAC.
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM as usize)]).unwrap();
    let (rx, tx) = (Ring::at(0x1000, QUEUE_SIZE), Ring::at(0x9000, QUEUE_SIZE));
    let mut w = Wire::new();
    let net = Arc::new(Mutex::new(Net::new(w.tap.take().unwrap(), MAC).unwrap()));
    let mut t = MmioTransport::new(mem.clone(), net.clone());
    t.drive_to_driver_ok(
        VIRTIO_F_VERSION_1 | (1 << VIRTIO_NET_F_GUEST_CSUM),
        &[rx.transport_queue(), tx.transport_queue()],
    );
    let send = |mem: &GuestMemoryMmap, slot: u16, text: &[u8]| {
        let f = frame(PEER, MAC, text);
        let mut pkt = vec![0u8; HDR_SIZE];
        pkt.extend_from_slice(&f);
        let at = 0x10_0000 + u64::from(slot) * 0x1000;
        mem.write_slice(&pkt, GuestAddress(at)).unwrap();
        tx.offer(mem, &[desc(at, pkt.len() as u32, 0, 0)], slot);
        f
    };
    let f = send(&mem, 0, b"before the snapshot");
    lock(&net).pump();
    assert_eq!(w.recv(Duration::from_secs(5)), Some(f));
    let state = postcard_round_trip(&lock(&net).save());
    assert_eq!(
        state.virtio.acked_features,
        VIRTIO_F_VERSION_1 | (1 << VIRTIO_NET_F_GUEST_CSUM)
    );
    let t_state = postcard_round_trip(&t.save());
    let mem2 = copy_guest_memory(&mem);
    let child_mac = [0x06, 0, 0xac, 0x10, 0, 0x09];
    let mut w3 = Wire::new();
    let net2 = Arc::new(Mutex::new(
        Net::restore(args(&mut w3, Some(child_mac)), &state).unwrap(),
    ));
    let _t2 = MmioTransport::restore(
        MmioRestoreArgs {
            mem: mem2.clone(),
            device: net2.clone(),
        },
        &t_state,
    )
    .unwrap();
    assert!(lock(&net2).is_activated());
    let mut cfg = [0u8; 6];
    lock(&net2).read_config(0, &mut cfg);
    assert_eq!(cfg, child_mac);
    let f2 = send(&mem2, 1, b"after the restore");
    lock(&net2).pump();
    assert_eq!(w3.recv(Duration::from_secs(5)), Some(f2));
    assert_eq!(tx.used(&mem2), vec![(0, 0), (1, 0)]);
    assert_eq!(
        w.recv(Duration::from_millis(300)),
        None,
        "not on the parent's TAP"
    );
}
