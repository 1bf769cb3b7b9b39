//! virtio-net in a VM under real KVM: the test guest's driver sends a frame
//! that comes out of the VM's TAP interface on this host, takes a frame
//! sent on that interface, and after a snapshot and a restore onto another
//! TAP (with another MAC) does the same there; a fork's children each
//! have their own TAP and MAC.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::time::{Duration, Instant};

use guest_abi::layout::TESTGUEST_SCRATCH;
use guest_abi::mailbox as mb;
use sprout_tests::{boot, call, config, TempDir};
use vm_memory::{Bytes, GuestAddress};
use vmm::config::NetConfig;
use vmm::{ForkOptions, MemoryBackend, RestoreOptions, SnapshotKind, Vm};

/// An EtherType for local experiments: only this test's frames carry it.
const ETHERTYPE: u16 = 0x88b5;
const HDR: usize = 12;
const MAC: [u8; 6] = [0x06, 0x00, 0xac, 0x10, 0x00, 0x02];
const CHILD_MAC: [u8; 6] = [0x06, 0x00, 0xac, 0x10, 0x00, 0x03];
const PEER: [u8; 6] = [0x06, 0x00, 0xac, 0x10, 0x00, 0x01];

/// A persistent TAP (the VMM attaches to it by name), up, without IPv6
/// chatter, with a packet socket on it; deleted on drop.
struct Wire {
    name: String,
    sock: OwnedFd,
    ifindex: i32,
}

fn ip(args: &[&str]) {
    let st = Command::new("ip").args(args).status().expect("run ip");
    assert!(st.success(), "ip {args:?}");
}

impl Wire {
    fn new(tag: &str) -> Wire {
        assert!(
            std::path::Path::new("/dev/net/tun").exists(),
            "/dev/net/tun is missing: virtio-net's tests need the tun driver"
        );
        let name = format!("spv{}{tag}", std::process::id() % 100_000);
        ip(&["tuntap", "add", "dev", &name, "mode", "tap", "vnet_hdr"]);
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6"), "1");
        ip(&["link", "set", &name, "up"]);
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
            name,
            sock,
            ifindex,
        }
    }

    fn net(&self, mac: [u8; 6]) -> NetConfig {
        NetConfig {
            tap: self.name.clone(),
            mac,
        }
    }

    /// Sends `frame` out of the interface: into the VM.
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

    /// The next frame of the test's EtherType coming out of the VM, if one
    /// comes within `limit`.
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

impl Drop for Wire {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.name])
            .status();
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

/// The guest sends `f` (after a zero header) from its scratch memory.
fn guest_sends(vm: &Vm, f: &[u8]) {
    let mut pkt = vec![0u8; HDR];
    pkt.extend_from_slice(f);
    vm.memory()
        .write_slice(&pkt, GuestAddress(TESTGUEST_SCRATCH))
        .unwrap();
    call(
        vm,
        0,
        mb::CMD_NET_SEND,
        [TESTGUEST_SCRATCH, pkt.len() as u64, 0, 0],
    );
}

/// The guest takes one frame into a 2 KiB buffer; what it got, header first.
fn guest_receives(vm: &Vm) -> Vec<u8> {
    let at = TESTGUEST_SCRATCH + 0x10_000;
    let len = call(vm, 0, mb::CMD_NET_RECV, [at, 2048, 0, 0]).rets[0];
    let mut b = vec![0u8; len as usize];
    vm.memory().read_slice(&mut b, GuestAddress(at)).unwrap();
    b
}

#[test]
fn frames_cross_the_tap_both_ways_and_a_restore_gets_its_own_tap_and_mac() {
    let dir = TempDir::new("net");
    let wire = Wire::new("a");
    let (mut cfg, console) = config(1, 128);
    cfg.net = Some(wire.net(MAC));
    let mut vm = boot(cfg, &console);

    let out = frame(PEER, MAC, b"from the guest");
    guest_sends(&vm, &out);
    assert_eq!(wire.recv(Duration::from_secs(10)), Some(out));

    let inbound = frame(MAC, PEER, b"to the guest");
    wire.send(&inbound);
    let got = guest_receives(&vm);
    assert_eq!(got.len(), HDR + inbound.len(), "{got:?}");
    assert_eq!(u16::from_le_bytes([got[10], got[11]]), 1, "num_buffers");
    assert_eq!(&got[HDR..], &inbound[..]);

    let snap = dir.path().join("snap");
    vm.snapshot(&snap, SnapshotKind::Full).unwrap();
    let opts = || {
        let mut o = RestoreOptions::new(MemoryBackend::Mmap);
        o.scratch_dir = dir.path().to_path_buf();
        o
    };
    // Without a TAP of its own, the restore is refused.
    let e = Vm::restore(&snap, opts()).err().expect("refused");
    assert!(e.to_string().contains("network device"), "{e}");
    let wire2 = Wire::new("b");
    let mut o = opts();
    o.net = Some(wire2.net(CHILD_MAC));
    let r = Vm::restore(&snap, o).unwrap();
    assert_eq!(r.config().net, Some(wire2.net(CHILD_MAC)));

    let again = frame(PEER, CHILD_MAC, b"from the restored guest");
    guest_sends(&r, &again);
    assert_eq!(wire2.recv(Duration::from_secs(10)), Some(again));
    assert_eq!(
        wire.recv(Duration::from_millis(300)),
        None,
        "not on the first TAP"
    );
    let inbound2 = frame(CHILD_MAC, PEER, b"to the restored guest");
    wire2.send(&inbound2);
    assert_eq!(&guest_receives(&r)[HDR..], &inbound2[..]);
    // The original still has its own wire.
    let more = frame(PEER, MAC, b"the original again");
    guest_sends(&vm, &more);
    assert_eq!(wire.recv(Duration::from_secs(10)), Some(more));
}

/// Fork 3 of a VM with a network device: without a TAP per child the fork
/// is refused; with them, each child has its own MAC, and its frames come
/// out of its own TAP only (and one sent there reaches it), while the
/// parent keeps its wire.
#[test]
fn a_forks_children_each_get_their_own_tap_and_mac() {
    let dir = TempDir::new("netfork");
    let wire = Wire::new("p");
    let (mut cfg, console) = config(1, 128);
    cfg.net = Some(wire.net(MAC));
    let mut vm = boot(cfg, &console);
    let mut opts = ForkOptions::new(dir.path());
    let e = vm.fork(3, &opts, None).err().expect("refused");
    assert!(e.to_string().contains("one TAP per child"), "{e}");
    let wires: Vec<Wire> = ["c0", "c1", "c2"].into_iter().map(Wire::new).collect();
    let macs: Vec<[u8; 6]> = (0..3u8).map(|i| [0x06, 0, 0xac, 0x10, 1, i]).collect();
    opts.nets = wires.iter().zip(&macs).map(|(w, m)| w.net(*m)).collect();
    let kids = vm.fork(3, &opts, None).unwrap();
    let mut seen = vec![MAC];
    for (i, kid) in kids.iter().enumerate() {
        let net = kid.config().net.clone().unwrap();
        assert_eq!(net, wires[i].net(macs[i]));
        assert!(!seen.contains(&net.mac), "child {i}: a MAC seen before");
        seen.push(net.mac);
        let out = frame(PEER, macs[i], format!("from child {i}").as_bytes());
        guest_sends(kid, &out);
        assert_eq!(
            wires[i].recv(Duration::from_secs(10)),
            Some(out),
            "child {i}"
        );
        let inbound = frame(macs[i], PEER, format!("to child {i}").as_bytes());
        wires[i].send(&inbound);
        assert_eq!(&guest_receives(kid)[HDR..], &inbound[..], "child {i}");
    }
    for (i, w) in wires.iter().enumerate() {
        assert_eq!(
            w.recv(Duration::from_millis(200)),
            None,
            "wire {i}: a stray frame"
        );
    }
    assert_eq!(
        wire.recv(Duration::from_millis(200)),
        None,
        "the parent's wire"
    );
    let more = frame(PEER, MAC, b"the parent again");
    guest_sends(&vm, &more);
    assert_eq!(wire.recv(Duration::from_secs(10)), Some(more));
}
