//! The connection table: routes guest packets to host streams, host streams' events to
//! packets for the guest, and accepts host connections on `uds_path`.
//!
//! The muxer never blocks and never touches the event loop itself: it queues
//! [`PollOp`]s (register, change, unregister-then-close) that the event handler applies.
//! A stream is always closed through a [`PollOp::Remove`], so the event loop never holds a
//! stale fd.

use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::io::ErrorKind;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use event_manager::EventSet;
use log::{debug, warn};
use socket2::{Domain, SockAddr, Socket, Type};

use super::connection::{Connection, RxItem};
use super::handshake::{Handshake, Step};
use super::packet::{
    Header, OP_CREDIT_REQUEST, OP_CREDIT_UPDATE, OP_REQUEST, OP_RESPONSE, OP_RST, OP_RW,
    OP_SHUTDOWN, TYPE_STREAM,
};
use super::{CONNECT_TIMEOUT, DEFAULT_MAX_CONNECTIONS, HOST_CID};

/// A connection's key: (host-side port, guest-side port).
pub type ConnKey = (u32, u32);

/// Most RST packets waiting for rx buffers; more are dropped (the guest times out).
pub const MAX_PENDING_RSTS: usize = 1024;
/// Most host connections accepted per listener event.
const ACCEPT_BATCH: usize = 64;
/// Host ports handed to host-initiated connections are at least this.
const FIRST_LOCAL_PORT: u32 = 1 << 30;

/// Where a new muxer's host ports start: a random point in
/// `[FIRST_LOCAL_PORT, 2 * FIRST_LOCAL_PORT)`. A restored VM's guest may
/// still hold sockets of connections its snapshot had (a socket the guest
/// closed waits for its peer for seconds, and a transport reset does not
/// remove it): a new connection from the same host port would meet that
/// socket and be refused with a RST (seen in the emulated lab: the first
/// execs after a restore refused now and then). Starting elsewhere in 2^30
/// ports each time makes a collision negligible; the state format stays.
fn first_port() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    // std's RandomState: random keys per thread (from the kernel's
    // getrandom once), a fresh key for each one made.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    FIRST_LOCAL_PORT + (h.finish() as u32 & (FIRST_LOCAL_PORT - 1))
}

/// A change the event loop must make to its watch list.
#[derive(Debug)]
pub enum PollOp {
    Add(RawFd, EventSet),
    Modify(RawFd, EventSet),
    /// Stop watching the fd, then drop (close) the stream if given.
    Remove(RawFd, Option<UnixStream>),
}

/// Bounds and timeouts; tests shrink them.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_conns: usize,
    /// For a host stream's `CONNECT` line and for the guest's answer.
    pub connect_timeout: Duration,
    /// For flushing guest bytes to the host stream once both sides shut down.
    pub linger_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_conns: DEFAULT_MAX_CONNECTIONS,
            connect_timeout: CONNECT_TIMEOUT,
            linger_timeout: CONNECT_TIMEOUT,
        }
    }
}

#[derive(Debug)]
pub struct Muxer {
    guest_cid: u64,
    uds_path: PathBuf,
    listener: UnixListener,
    pub limits: Limits,
    conns: HashMap<ConnKey, Connection>,
    handshakes: HashMap<RawFd, Handshake>,
    /// Connection fds, for routing events.
    fds: HashMap<RawFd, ConnKey>,
    /// Live connections per host-side port.
    local_ports: HashMap<u32, usize>,
    next_port: u32,
    /// Connections with packets for the guest, each at most once.
    rxq: VecDeque<ConnKey>,
    /// RSTs for connections that are gone (or never were).
    rsts: VecDeque<Header>,
    poll_ops: Vec<PollOp>,
    /// Something may have a deadline: the timer should run.
    deadline_hint: bool,
    /// Host connects wait (as held handshakes) until the guest has handled a
    /// transport reset: a connection made before the guest's driver resets
    /// its sockets would be dropped by it without a word to the host.
    hold: bool,
}

impl Muxer {
    pub fn new(guest_cid: u64, uds_path: PathBuf, listener: UnixListener) -> Self {
        Self {
            guest_cid,
            uds_path,
            listener,
            limits: Limits::default(),
            conns: HashMap::new(),
            handshakes: HashMap::new(),
            fds: HashMap::new(),
            local_ports: HashMap::new(),
            next_port: first_port(),
            rxq: VecDeque::new(),
            rsts: VecDeque::new(),
            poll_ops: Vec::new(),
            deadline_hint: false,
            hold: false,
        }
    }

    /// Makes host connects wait until [`release`](Self::release).
    pub fn hold(&mut self) {
        self.hold = true;
    }

    /// Lets held and later host connects through to the guest.
    pub fn release(&mut self) {
        self.hold = false;
        let held: Vec<(RawFd, u32)> = self
            .handshakes
            .iter()
            .filter_map(|(fd, h)| h.held.map(|port| (*fd, port)))
            .collect();
        for (fd, port) in held {
            self.poll_ops.push(PollOp::Modify(fd, EventSet::IN));
            self.host_connect(fd, port);
        }
    }

    pub fn listener(&self) -> &UnixListener {
        &self.listener
    }

    /// Live connections, including host streams still sending their `CONNECT` line.
    pub fn live(&self) -> usize {
        self.conns.len() + self.handshakes.len()
    }

    /// The watch-list changes queued since the last call.
    pub fn take_poll_ops(&mut self) -> Vec<PollOp> {
        std::mem::take(&mut self.poll_ops)
    }

    /// Something has a deadline (cleared by [`Muxer::tick`] when nothing does).
    pub fn has_deadlines(&self) -> bool {
        self.deadline_hint
    }

    /// Accepts pending host connections; beyond the limit they are closed at once.
    pub fn accept(&mut self) {
        for _ in 0..ACCEPT_BATCH {
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    warn!("vsock: cannot accept a host connection: {e}");
                    return;
                }
            };
            if self.live() >= self.limits.max_conns {
                warn!("vsock: too many connections, refusing a host connection");
                continue;
            }
            if let Err(e) = stream.set_nonblocking(true) {
                warn!("vsock: cannot make a host stream non-blocking: {e}");
                continue;
            }
            let fd = stream.as_raw_fd();
            let deadline = Instant::now() + self.limits.connect_timeout;
            self.handshakes.insert(fd, Handshake::new(stream, deadline));
            self.poll_ops.push(PollOp::Add(fd, EventSet::IN));
            self.deadline_hint = true;
        }
    }

    /// The stream with this fd is ready for `set`.
    pub fn handle_fd(&mut self, fd: RawFd, set: EventSet) {
        if let Some(h) = self.handshakes.get_mut(&fd) {
            if h.held.is_some() {
                // Watched for nothing while held: only a hang-up or an error
                // is reported, and the host gave up.
                self.drop_handshake(fd);
                return;
            }
            match h.poll() {
                Step::Wait => {}
                Step::Fail => {
                    debug!("vsock: bad connect line from a host stream");
                    self.drop_handshake(fd);
                }
                Step::Connect(port) if self.hold => {
                    h.held = Some(port);
                    self.poll_ops.push(PollOp::Modify(fd, EventSet::empty()));
                }
                Step::Connect(port) => self.host_connect(fd, port),
            }
            return;
        }
        let Some(&key) = self.fds.get(&fd) else {
            return;
        };
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        match conn.on_event(set) {
            Ok(()) => self.after(key),
            Err(e) => {
                debug!("vsock: connection {key:?}: {e}");
                self.kill(key, true);
            }
        }
    }

    /// Resets whatever owns `fd` (its registration failed).
    pub fn kill_fd(&mut self, fd: RawFd) {
        if self.handshakes.contains_key(&fd) {
            self.drop_handshake(fd);
        } else if let Some(&key) = self.fds.get(&fd) {
            self.kill(key, true);
        }
    }

    fn drop_handshake(&mut self, fd: RawFd) {
        if let Some(h) = self.handshakes.remove(&fd) {
            self.poll_ops.push(PollOp::Remove(fd, Some(h.stream)));
        }
    }

    /// A host stream asked for guest port `port`.
    fn host_connect(&mut self, fd: RawFd, port: u32) {
        let Some(h) = self.handshakes.remove(&fd) else {
            return;
        };
        let Some(local) = self.alloc_port() else {
            warn!("vsock: no free host port");
            self.poll_ops.push(PollOp::Remove(fd, Some(h.stream)));
            return;
        };
        let deadline = Instant::now() + self.limits.connect_timeout;
        let mut conn = Connection::host_initiated(h.stream, self.guest_cid, local, port, deadline);
        // Still registered as the handshake was.
        conn.registered = Some(EventSet::IN);
        self.insert(conn);
    }

    /// A host port no live connection uses.
    fn alloc_port(&mut self) -> Option<u32> {
        for _ in 0..=self.limits.max_conns {
            let port = self.next_port;
            self.next_port = match self.next_port.checked_add(1) {
                Some(p) if p != u32::MAX => p,
                _ => FIRST_LOCAL_PORT,
            };
            if !self.local_ports.contains_key(&port) {
                return Some(port);
            }
        }
        None
    }

    fn insert(&mut self, conn: Connection) {
        let key = (conn.local_port, conn.peer_port);
        *self.local_ports.entry(conn.local_port).or_default() += 1;
        self.fds.insert(conn.stream.as_raw_fd(), key);
        self.conns.insert(key, conn);
        self.after(key);
    }

    /// Brings a connection's fd registration and rx queueing up to date, and forgets
    /// it (with an RST) once both sides have closed.
    fn after(&mut self, key: ConnKey) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        if conn.is_finished() {
            self.kill(key, true);
            return;
        }
        let fd = conn.stream.as_raw_fd();
        let want = conn.wanted_events();
        match conn.registered {
            None if !want.is_empty() => self.poll_ops.push(PollOp::Add(fd, want)),
            Some(_) if want.is_empty() => self.poll_ops.push(PollOp::Remove(fd, None)),
            Some(have) if have != want => self.poll_ops.push(PollOp::Modify(fd, want)),
            _ => {}
        }
        conn.registered = (!want.is_empty()).then_some(want);
        if conn.has_pending_rx() && !conn.in_rxq {
            conn.in_rxq = true;
            self.rxq.push_back(key);
        }
        if conn.deadline.is_some() {
            self.deadline_hint = true;
        }
    }

    /// Forgets a connection and closes its stream, queueing an RST for the guest if
    /// `rst` (and the guest knows of the connection).
    fn kill(&mut self, key: ConnKey, rst: bool) {
        let Some(conn) = self.conns.remove(&key) else {
            return;
        };
        if rst && !conn.request_pending() {
            self.push_rst(conn.rst());
        }
        if conn.in_rxq {
            self.rxq.retain(|k| *k != key);
        }
        let fd = conn.stream.as_raw_fd();
        self.fds.remove(&fd);
        if let Some(n) = self.local_ports.get_mut(&conn.local_port) {
            *n -= 1;
            if *n == 0 {
                self.local_ports.remove(&conn.local_port);
            }
        }
        self.poll_ops.push(PollOp::Remove(fd, Some(conn.stream)));
    }

    fn push_rst(&mut self, hdr: Header) {
        if self.rsts.len() < MAX_PENDING_RSTS {
            self.rsts.push_back(hdr);
        } else {
            debug!("vsock: too many pending RSTs, dropping one");
        }
    }

    /// Answers a bad guest packet whose header could be read: reset its connection.
    pub fn reject(&mut self, hdr: &Header) {
        if hdr.src_cid != self.guest_cid {
            return;
        }
        let key = (hdr.dst_port, hdr.src_port);
        if self.conns.contains_key(&key) {
            self.kill(key, true);
        } else if hdr.op != OP_RST {
            self.push_rst(hdr.rst_reply());
        }
    }

    /// A packet the guest sent.
    pub fn handle_tx(&mut self, hdr: &Header, data: &[u8]) {
        if hdr.src_cid != self.guest_cid {
            debug!("vsock: dropping a packet from CID {}", hdr.src_cid);
            return;
        }
        if hdr.dst_cid != HOST_CID || hdr.type_ != TYPE_STREAM {
            self.reject(hdr);
            return;
        }
        let key = (hdr.dst_port, hdr.src_port);
        let linger = Instant::now() + self.limits.linger_timeout;
        let Some(conn) = self.conns.get_mut(&key) else {
            match hdr.op {
                OP_REQUEST => self.guest_connect(hdr),
                OP_RST => {}
                _ => self.push_rst(hdr.rst_reply()),
            }
            return;
        };
        conn.update_peer_credit(hdr.buf_alloc, hdr.fwd_cnt);
        let result = match hdr.op {
            OP_RESPONSE => conn.on_response(),
            OP_RW => conn.on_rw(data),
            OP_CREDIT_UPDATE => Ok(()),
            OP_CREDIT_REQUEST => {
                conn.on_credit_request();
                Ok(())
            }
            OP_SHUTDOWN => conn.on_shutdown(hdr.flags, linger),
            OP_RST => {
                self.kill(key, false);
                return;
            }
            op => Err(super::connection::ConnError::UnexpectedOp(op)),
        };
        match result {
            Ok(()) => self.after(key),
            Err(e) => {
                debug!("vsock: connection {key:?}: {e}");
                self.kill(key, true);
            }
        }
    }

    /// The guest asked for host port `hdr.dst_port`: connect to `<uds_path>_<port>`.
    fn guest_connect(&mut self, hdr: &Header) {
        if self.live() >= self.limits.max_conns {
            warn!("vsock: too many connections, refusing a guest request");
            self.push_rst(hdr.rst_reply());
            return;
        }
        let mut path = OsString::from(self.uds_path.as_os_str());
        path.push(format!("_{}", hdr.dst_port));
        match connect(Path::new(&path)) {
            Ok(stream) => self.insert(Connection::guest_initiated(stream, self.guest_cid, hdr)),
            Err(e) => {
                debug!(
                    "vsock: cannot connect to {}: {e}",
                    Path::new(&path).display()
                );
                self.push_rst(hdr.rst_reply());
            }
        }
    }

    /// Packets wait for the guest.
    pub fn has_rx(&self) -> bool {
        !self.rsts.is_empty() || !self.rxq.is_empty()
    }

    /// The next packet for the guest, for an rx buffer with room for `data_cap` data
    /// bytes (read into `scratch`); `None` when nothing can be sent now.
    pub fn next_rx(&mut self, data_cap: usize, scratch: &mut [u8]) -> Option<(Header, usize)> {
        let linger = Instant::now() + self.limits.linger_timeout;
        let mut deferred = Vec::new();
        let out = loop {
            if let Some(hdr) = self.rsts.pop_front() {
                break Some((hdr, 0));
            }
            let Some(key) = self.rxq.pop_front() else {
                break None;
            };
            let Some(conn) = self.conns.get_mut(&key) else {
                continue;
            };
            conn.in_rxq = false;
            match conn.next_rx(data_cap, scratch, linger) {
                RxItem::Packet(hdr, len) => {
                    self.after(key);
                    break Some((hdr, len));
                }
                RxItem::Nothing => deferred.push(key),
                RxItem::Kill => self.kill(key, true),
            }
        };
        for key in deferred {
            self.after(key);
        }
        out
    }

    /// Resets what is past its deadline: silent host streams, unanswered requests, and
    /// connections that could not flush in time.
    pub fn tick(&mut self, now: Instant) {
        let late: Vec<RawFd> = self
            .handshakes
            .iter()
            .filter(|(_, h)| h.deadline <= now)
            .map(|(fd, _)| *fd)
            .collect();
        for fd in late {
            self.drop_handshake(fd);
        }
        let late: Vec<ConnKey> = self
            .conns
            .iter()
            .filter(|(_, c)| c.deadline.is_some_and(|d| d <= now))
            .map(|(k, _)| *k)
            .collect();
        for key in late {
            debug!("vsock: connection {key:?} timed out");
            self.kill(key, true);
        }
        self.deadline_hint =
            !self.handshakes.is_empty() || self.conns.values().any(|c| c.deadline.is_some());
    }

    /// Forgets every connection (device reset, transport reset): no RSTs are sent.
    pub fn clear(&mut self) {
        let keys: Vec<ConnKey> = self.conns.keys().copied().collect();
        for key in keys {
            self.kill(key, false);
        }
        let fds: Vec<RawFd> = self.handshakes.keys().copied().collect();
        for fd in fds {
            self.drop_handshake(fd);
        }
        self.rsts.clear();
        self.rxq.clear();
        self.hold = false;
    }

    #[cfg(test)]
    pub fn conn_count(&self) -> usize {
        self.conns.len()
    }
}

/// Connects to a Unix stream socket without blocking: a listener whose backlog is full
/// refuses rather than stalls the event loop.
fn connect(path: &Path) -> std::io::Result<UnixStream> {
    let sock = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    sock.set_nonblocking(true)?;
    sock.connect(&SockAddr::unix(path)?)?;
    Ok(UnixStream::from(std::os::fd::OwnedFd::from(sock)))
}

#[cfg(test)]
mod tests {

    #[test]
    fn each_muxer_starts_its_host_ports_somewhere_else() {
        let starts: std::collections::BTreeSet<u32> =
            (0..64).map(|_| super::first_port()).collect();
        assert!(starts.len() >= 60, "{starts:?}");
        assert!(starts
            .iter()
            .all(|p| (super::FIRST_LOCAL_PORT..2 * super::FIRST_LOCAL_PORT).contains(p)));
    }

    use super::*;
    use crate::virtio::vsock::packet::{SHUTDOWN_RCV, SHUTDOWN_SEND};
    use std::io::{Read, Write};
    use vmm_sys_util::tempdir::TempDir;

    const CID: u64 = 3;

    fn muxer(dir: &TempDir) -> Muxer {
        let path = dir.as_path().join("v.sock");
        let l = UnixListener::bind(&path).unwrap();
        l.set_nonblocking(true).unwrap();
        Muxer::new(CID, path, l)
    }

    fn guest(op: u16, src_port: u32, dst_port: u32) -> Header {
        Header {
            src_cid: CID,
            dst_cid: HOST_CID,
            src_port,
            dst_port,
            type_: TYPE_STREAM,
            op,
            buf_alloc: 1 << 16,
            ..Header::default()
        }
    }

    fn next(m: &mut Muxer) -> Option<(Header, Vec<u8>)> {
        let mut scratch = vec![0u8; 4096];
        m.next_rx(4096, &mut scratch)
            .map(|(h, n)| (h, scratch[..n].to_vec()))
    }

    #[test]
    fn guest_connect_relay_and_close() {
        let dir = TempDir::new().unwrap();
        let mut m = muxer(&dir);
        let l = UnixListener::bind(dir.as_path().join("v.sock_99")).unwrap();
        m.handle_tx(&guest(OP_REQUEST, 1234, 99), &[]);
        let (h, _) = next(&mut m).unwrap();
        assert_eq!((h.op, h.src_port, h.dst_port), (OP_RESPONSE, 99, 1234));
        let (mut host, _) = l.accept().unwrap();
        m.handle_tx(&guest(OP_RW, 1234, 99), b"ping");
        let mut b = [0u8; 4];
        host.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"ping");
        host.write_all(b"pong").unwrap();
        let fd = m.fds.keys().copied().next().unwrap();
        m.handle_fd(fd, EventSet::IN);
        let (h, d) = next(&mut m).unwrap();
        assert_eq!((h.op, d.as_slice()), (OP_RW, &b"pong"[..]));
        assert!(next(&mut m).is_none());
        // Guest closes: the host sees EOF, the guest gets its RST, the fd goes.
        m.take_poll_ops();
        let mut s = guest(OP_SHUTDOWN, 1234, 99);
        s.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
        m.handle_tx(&s, &[]);
        assert_eq!(m.conn_count(), 0);
        let (h, _) = next(&mut m).unwrap();
        assert_eq!(h.op, OP_RST);
        let ops = m.take_poll_ops();
        assert!(matches!(ops.as_slice(), [PollOp::Remove(f, Some(_))] if *f == fd));
        drop(ops);
        assert_eq!(host.read(&mut b).unwrap(), 0);
    }

    #[test]
    fn refuses_beyond_the_limit_and_unknown_connections() {
        let dir = TempDir::new().unwrap();
        let mut m = muxer(&dir);
        m.limits.max_conns = 1;
        let _l = UnixListener::bind(dir.as_path().join("v.sock_1")).unwrap();
        m.handle_tx(&guest(OP_REQUEST, 10, 1), &[]);
        m.handle_tx(&guest(OP_REQUEST, 11, 1), &[]);
        assert_eq!(m.conn_count(), 1);
        let mut got: Vec<(u16, u32)> = std::iter::from_fn(|| next(&mut m))
            .map(|(h, _)| (h.op, h.dst_port))
            .collect();
        got.sort();
        assert_eq!(got, vec![(OP_RESPONSE, 10), (OP_RST, 11)]);
        // Host connections past the limit are closed at once.
        let mut host = UnixStream::connect(dir.as_path().join("v.sock")).unwrap();
        m.accept();
        assert_eq!(m.live(), 1);
        let mut b = [0u8; 1];
        assert_eq!(host.read(&mut b).unwrap(), 0);
        // Data for a connection that does not exist: RST; an RST for one: nothing.
        m.handle_tx(&guest(OP_RW, 50, 60), &[]);
        assert_eq!(next(&mut m).unwrap().0.op, OP_RST);
        m.handle_tx(&guest(OP_RST, 50, 60), &[]);
        assert!(next(&mut m).is_none());
    }

    #[test]
    fn host_connect_allocates_unique_ports_and_times_out() {
        let dir = TempDir::new().unwrap();
        let mut m = muxer(&dir);
        m.limits.connect_timeout = Duration::from_millis(1);
        let mut hosts = Vec::new();
        for _ in 0..3 {
            let mut s = UnixStream::connect(dir.as_path().join("v.sock")).unwrap();
            s.write_all(b"CONNECT 7\n").unwrap();
            hosts.push(s);
        }
        m.accept();
        for fd in m.handshakes.keys().copied().collect::<Vec<_>>() {
            m.handle_fd(fd, EventSet::IN);
        }
        let mut ports = Vec::new();
        while let Some((h, _)) = next(&mut m) {
            assert_eq!((h.op, h.dst_port, h.dst_cid), (OP_REQUEST, 7, CID));
            ports.push(h.src_port);
        }
        ports.sort();
        ports.dedup();
        assert_eq!(ports.len(), 3);
        assert!(m.has_deadlines());
        std::thread::sleep(Duration::from_millis(5));
        m.tick(Instant::now());
        assert_eq!(m.conn_count(), 0);
        assert!(!m.has_deadlines());
        // The guest had been asked, so it is told.
        let rsts = std::iter::from_fn(|| next(&mut m)).count();
        assert_eq!(rsts, 3);
        drop(m.take_poll_ops());
        let mut b = [0u8; 1];
        for mut h in hosts {
            assert_eq!(h.read(&mut b).unwrap(), 0);
        }
    }
}
