//! A small synchronous rtnetlink client: the few requests that join a
//! worker's network namespace to the host (`net.rs`). Messages are built
//! and parsed by `netlink-packet-route`; each request waits for its
//! kernel's answer.
//!
//! Why not `ip -batch`: every attach ran two `ip` processes, 260–670 ms of
//! a start in the emulated lab (docs/benchmarks.md, "What the network
//! costs a start") and a few ms on hardware, where a netlink request is
//! tens of microseconds. A socket is bound to the network namespace of the
//! thread that made it, so [`Rtnl::in_namespace`] makes one on a short-lived
//! thread that joined the worker's namespace; the caller's threads never
//! change namespace.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, BorrowedFd};

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL,
    NLM_F_REQUEST,
};
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{
    InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

/// Bound on the answers read for one request (a hostile or confused peer
/// cannot keep us reading): a request here gets one message and its ACK.
const MAX_ANSWERS: usize = 16;

pub struct Rtnl {
    sock: Socket,
    seq: u32,
}

impl Rtnl {
    /// A route netlink socket in this thread's network namespace.
    pub fn open() -> io::Result<Rtnl> {
        let mut sock = Socket::new(NETLINK_ROUTE)?;
        sock.bind_auto()?;
        sock.connect(&SocketAddr::new(0, 0))?;
        // Errors carry the kernel's extended message where it has one.
        let _ = sock.set_ext_ack(true);
        Ok(Rtnl { sock, seq: 0 })
    }

    /// A socket in the network namespace `ns` (a `/proc/PID/ns/net`),
    /// and that namespace's IPv4 forwarding turned on (it routes between
    /// the TAP and the veth pair): both done by a thread that joins it and
    /// ends.
    pub fn in_namespace(ns: BorrowedFd<'_>) -> io::Result<Rtnl> {
        let fd = ns.as_raw_fd();
        std::thread::scope(|s| {
            s.spawn(move || {
                // SAFETY: `fd` is a namespace descriptor borrowed for the
                // scope of this thread; setns changes only this thread's
                // network namespace, and this thread ends right after.
                if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } != 0 {
                    return Err(io::Error::last_os_error());
                }
                // /proc/sys/net is the namespace of the thread that
                // opens it: this one's now.
                std::fs::write("/proc/sys/net/ipv4/ip_forward", "1\n").map_err(|e| {
                    io::Error::new(e.kind(), format!("cannot turn forwarding on: {e}"))
                })?;
                Rtnl::open()
            })
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("the namespace thread panicked")))
        })
    }

    /// Sends `msg` with `flags` and waits for its ACK; an inner message
    /// answered before the ACK is returned.
    fn request(
        &mut self,
        msg: RouteNetlinkMessage,
        flags: u16,
    ) -> io::Result<Option<RouteNetlinkMessage>> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
        header.sequence_number = seq;
        let mut m = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(msg));
        m.finalize();
        let mut buf = vec![0u8; m.buffer_len()];
        m.serialize(&mut buf);
        self.sock.send(&buf, 0)?;
        let mut answer = None;
        for _ in 0..MAX_ANSWERS {
            let (data, _) = self.sock.recv_from_full()?;
            let mut off = 0;
            while off < data.len() {
                let reply = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&data[off..])
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
                let len = reply.header.length as usize;
                if len == 0 {
                    break;
                }
                off += len.next_multiple_of(4);
                if reply.header.sequence_number != seq {
                    continue;
                }
                match reply.payload {
                    NetlinkPayload::Error(e) => {
                        return match e.code {
                            None => Ok(answer),
                            Some(c) => Err(io::Error::from_raw_os_error(-c.get())),
                        };
                    }
                    NetlinkPayload::InnerMessage(inner) => answer = Some(inner),
                    _ => {}
                }
            }
        }
        Err(io::Error::other("no answer from the kernel's rtnetlink"))
    }

    /// The index of the interface `name`.
    pub fn index(&mut self, name: &str) -> io::Result<u32> {
        let mut m = LinkMessage::default();
        m.attributes.push(LinkAttribute::IfName(name.into()));
        match self.request(RouteNetlinkMessage::GetLink(m), 0)? {
            Some(RouteNetlinkMessage::NewLink(l)) if l.header.index != 0 => Ok(l.header.index),
            _ => Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("no interface {name}"),
            )),
        }
    }

    /// Makes the veth pair `name` (here) and `peer` (in the namespace
    /// `peer_ns`); fails with `AlreadyExists` if `name` is taken.
    pub fn add_veth(&mut self, name: &str, peer: &str, peer_ns: BorrowedFd<'_>) -> io::Result<()> {
        let mut p = LinkMessage::default();
        p.attributes.push(LinkAttribute::IfName(peer.into()));
        p.attributes
            .push(LinkAttribute::NetNsFd(peer_ns.as_raw_fd()));
        let mut m = LinkMessage::default();
        m.attributes.push(LinkAttribute::IfName(name.into()));
        m.attributes.push(LinkAttribute::LinkInfo(vec![
            LinkInfo::Kind(InfoKind::Veth),
            LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(p))),
        ]));
        self.request(RouteNetlinkMessage::NewLink(m), NLM_F_CREATE | NLM_F_EXCL)
            .map(drop)
    }

    /// Deletes the interface `index`.
    pub fn del_link(&mut self, index: u32) -> io::Result<()> {
        let mut m = LinkMessage::default();
        m.header.index = index;
        self.request(RouteNetlinkMessage::DelLink(m), 0).map(drop)
    }

    /// Sets interface `index` up, with `mac` and `alias` if given.
    pub fn set_up(
        &mut self,
        index: u32,
        mac: Option<[u8; 6]>,
        alias: Option<&str>,
    ) -> io::Result<()> {
        let mut m = LinkMessage::default();
        m.header.index = index;
        m.header.flags = LinkFlags::Up;
        m.header.change_mask = LinkFlags::Up;
        if let Some(mac) = mac {
            m.attributes.push(LinkAttribute::Address(mac.to_vec()));
        }
        if let Some(a) = alias {
            m.attributes.push(LinkAttribute::IfAlias(a.into()));
        }
        self.request(RouteNetlinkMessage::SetLink(m), 0).map(drop)
    }

    /// Adds `addr/prefix` to interface `index`.
    pub fn add_addr(&mut self, index: u32, addr: Ipv4Addr, prefix: u8) -> io::Result<()> {
        let mut m = AddressMessage::default();
        m.header.family = AddressFamily::Inet;
        m.header.prefix_len = prefix;
        m.header.index = index;
        m.attributes.push(AddressAttribute::Local(addr.into()));
        m.attributes.push(AddressAttribute::Address(addr.into()));
        self.request(
            RouteNetlinkMessage::NewAddress(m),
            NLM_F_CREATE | NLM_F_EXCL,
        )
        .map(drop)
    }

    /// Adds a route to `dst/prefix` (the default route for prefix 0) via
    /// `gateway` on interface `index`.
    pub fn add_route(
        &mut self,
        dst: Ipv4Addr,
        prefix: u8,
        gateway: Ipv4Addr,
        index: u32,
    ) -> io::Result<()> {
        let mut m = RouteMessage::default();
        m.header.address_family = AddressFamily::Inet;
        m.header.destination_prefix_length = prefix;
        m.header.table = RouteHeader::RT_TABLE_MAIN;
        m.header.protocol = RouteProtocol::Boot;
        m.header.scope = RouteScope::Universe;
        m.header.kind = RouteType::Unicast;
        if prefix > 0 {
            m.attributes
                .push(RouteAttribute::Destination(RouteAddress::Inet(dst)));
        }
        m.attributes
            .push(RouteAttribute::Gateway(RouteAddress::Inet(gateway)));
        m.attributes.push(RouteAttribute::Oif(index));
        self.request(RouteNetlinkMessage::NewRoute(m), NLM_F_CREATE | NLM_F_EXCL)
            .map(drop)
    }
}
