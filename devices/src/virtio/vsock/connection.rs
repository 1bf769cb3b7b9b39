//! One stream connection: its host Unix stream, credit accounting both ways, the guest
//! bytes the host stream could not take yet, and the shutdown state.
//!
//! Credit (virtio 1.2, 5.10.6.3): every packet to the guest carries `buf_alloc` (always
//! [`CONN_BUF_SIZE`]) and `fwd_cnt` (guest bytes written to the host stream so far).
//! Guest bytes the host stream cannot take yet wait in `tx_buf`, which never exceeds
//! `buf_alloc`: a guest sending past its credit gets the connection reset. The other way,
//! the device reads from the host stream only as much as the guest's own credit allows.

use std::collections::VecDeque;
use std::io::{self, ErrorKind, Read, Write};
use std::net::Shutdown;
use std::num::Wrapping;
use std::os::unix::net::UnixStream;
use std::time::Instant;

use event_manager::EventSet;

use super::packet::{
    Header, OP_CREDIT_REQUEST, OP_CREDIT_UPDATE, OP_REQUEST, OP_RESPONSE, OP_RST, OP_RW,
    OP_SHUTDOWN, SHUTDOWN_RCV, SHUTDOWN_SEND, TYPE_STREAM,
};
use super::{CONN_BUF_SIZE, HOST_CID};

/// Once the host has forwarded this many guest bytes the guest has not heard of, the
/// device sends a credit update.
pub const CREDIT_UPDATE_THRESHOLD: u32 = CONN_BUF_SIZE / 4;

#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("Guest sent op {0} the connection does not expect")]
    UnexpectedOp(u16),
    #[error("Guest sent data after shutting down its send side")]
    SendAfterShutdown,
    #[error("Guest sent {0} bytes past the credit it was given")]
    CreditExceeded(usize),
    #[error("Cannot write to the host stream")]
    HostWrite(#[source] io::Error),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Host-initiated: the guest has not answered the request yet.
    Connecting,
    Established,
}

/// What [`Connection::next_rx`] produced.
#[derive(Debug, PartialEq, Eq)]
pub enum RxItem {
    /// A packet whose data (if any) is at the start of the scratch buffer.
    Packet(Header, usize),
    /// Nothing to send now.
    Nothing,
    /// The host stream failed or is gone: reset the connection.
    Kill,
}

/// Packets owed to the guest.
#[derive(Debug, Default)]
struct Pending {
    request: bool,
    response: bool,
    credit_update: bool,
    /// The host stream is (or may be) readable.
    rw: bool,
}

#[derive(Debug)]
pub struct Connection {
    pub stream: UnixStream,
    /// Port on the host side (CID 2).
    pub local_port: u32,
    /// Port on the guest side.
    pub peer_port: u32,
    guest_cid: u64,
    state: State,
    pending: Pending,
    /// The `OK <port>\n` reply, or what the host stream has not taken of it yet.
    reply: Vec<u8>,
    /// Guest bytes the host stream has not taken yet; at most `CONN_BUF_SIZE`.
    tx_buf: VecDeque<u8>,
    /// Guest bytes written to the host stream.
    fwd_cnt: Wrapping<u32>,
    /// `fwd_cnt` as last told to the guest.
    fwd_cnt_sent: Wrapping<u32>,
    /// Host bytes sent to the guest.
    rx_cnt: Wrapping<u32>,
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,
    /// A credit request was sent and the guest has given no credit since.
    credit_requested: bool,
    /// The guest will send no more: shut the host stream's write side once flushed.
    guest_done: bool,
    write_shut: bool,
    /// No more host bytes go to the guest (host EOF, or the guest will not receive).
    host_done: bool,
    /// The host stream hung up (closed both ways).
    hup: bool,
    /// When the connection is reset if still around (unanswered request, or lingering
    /// to flush after both sides shut down).
    pub deadline: Option<Instant>,
    /// In the muxer's queue of connections with packets for the guest.
    pub in_rxq: bool,
    /// Events the fd is registered for in the event loop (`None`: not registered).
    pub registered: Option<EventSet>,
}

impl Connection {
    fn new(stream: UnixStream, guest_cid: u64, local_port: u32, peer_port: u32) -> Self {
        Self {
            stream,
            local_port,
            peer_port,
            guest_cid,
            state: State::Established,
            pending: Pending::default(),
            reply: Vec::new(),
            tx_buf: VecDeque::new(),
            fwd_cnt: Wrapping(0),
            fwd_cnt_sent: Wrapping(0),
            rx_cnt: Wrapping(0),
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            credit_requested: false,
            guest_done: false,
            write_shut: false,
            host_done: false,
            hup: false,
            deadline: None,
            in_rxq: false,
            registered: None,
        }
    }

    /// A host stream asked for guest port `peer_port`: a request to send, an answer to
    /// wait for until `deadline`.
    pub fn host_initiated(
        stream: UnixStream,
        guest_cid: u64,
        local_port: u32,
        peer_port: u32,
        deadline: Instant,
    ) -> Self {
        let mut c = Self::new(stream, guest_cid, local_port, peer_port);
        c.state = State::Connecting;
        c.pending.request = true;
        c.deadline = Some(deadline);
        c
    }

    /// The guest's request (`req`) was connected to a host stream: a response to send.
    pub fn guest_initiated(stream: UnixStream, guest_cid: u64, req: &Header) -> Self {
        let mut c = Self::new(stream, guest_cid, req.dst_port, req.src_port);
        c.pending.response = true;
        c.update_peer_credit(req.buf_alloc, req.fwd_cnt);
        c
    }

    #[cfg(test)]
    pub fn state(&self) -> State {
        self.state
    }

    /// The request to the guest has not been sent yet.
    pub fn request_pending(&self) -> bool {
        self.pending.request
    }

    /// Records the credit fields of a guest packet.
    pub fn update_peer_credit(&mut self, buf_alloc: u32, fwd_cnt: u32) {
        self.peer_buf_alloc = buf_alloc;
        self.peer_fwd_cnt = Wrapping(fwd_cnt);
        if self.peer_credit() > 0 {
            self.credit_requested = false;
        }
    }

    /// How many more bytes the guest can take. A nonsensical `fwd_cnt` (ahead of what
    /// was sent) yields no credit.
    pub fn peer_credit(&self) -> u32 {
        let in_flight = (self.rx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// Guest bytes waiting for the host stream.
    #[cfg(test)]
    pub fn buffered(&self) -> usize {
        self.tx_buf.len()
    }

    fn flushed(&self) -> bool {
        self.reply.is_empty() && self.tx_buf.is_empty()
    }

    /// Both directions are closed and every guest byte reached the host stream.
    pub fn is_finished(&self) -> bool {
        self.guest_done && self.host_done && self.flushed()
    }

    /// The guest accepted the host's request.
    pub fn on_response(&mut self) -> Result<(), ConnError> {
        if self.state != State::Connecting || self.pending.request {
            return Err(ConnError::UnexpectedOp(OP_RESPONSE));
        }
        self.state = State::Established;
        self.deadline = None;
        self.reply = format!("OK {}\n", self.local_port).into_bytes();
        self.flush()
    }

    /// Guest data for the host stream: written now, or buffered within the credit.
    pub fn on_rw(&mut self, mut data: &[u8]) -> Result<(), ConnError> {
        if self.state != State::Established {
            return Err(ConnError::UnexpectedOp(OP_RW));
        }
        if self.guest_done {
            return Err(ConnError::SendAfterShutdown);
        }
        if self.flushed() {
            while !data.is_empty() {
                match self.stream.write(data) {
                    Ok(0) => return Err(ConnError::HostWrite(ErrorKind::WriteZero.into())),
                    Ok(n) => {
                        data = &data[n..];
                        self.fwd_cnt += n as u32;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(ConnError::HostWrite(e)),
                }
            }
        }
        if !data.is_empty() {
            if self.tx_buf.len() + data.len() > CONN_BUF_SIZE as usize {
                let over = self.tx_buf.len() + data.len() - CONN_BUF_SIZE as usize;
                return Err(ConnError::CreditExceeded(over));
            }
            self.tx_buf.extend(data);
        }
        self.check_credit_update();
        Ok(())
    }

    /// The guest asked for our credit.
    pub fn on_credit_request(&mut self) {
        if self.state == State::Established {
            self.pending.credit_update = true;
        }
    }

    /// The guest shut down direction(s). `linger` is when to give up flushing guest
    /// bytes to the host stream once both directions are closed.
    pub fn on_shutdown(&mut self, flags: u32, linger: Instant) -> Result<(), ConnError> {
        if self.state != State::Established {
            return Err(ConnError::UnexpectedOp(OP_SHUTDOWN));
        }
        if flags & SHUTDOWN_RCV != 0 && !self.host_done {
            self.host_done = true;
            self.pending.rw = false;
            // The host's further writes fail; nothing more is read.
            let _ = self.stream.shutdown(Shutdown::Read);
        }
        if flags & SHUTDOWN_SEND != 0 {
            self.guest_done = true;
        }
        self.flush()?;
        if self.guest_done && self.host_done && !self.flushed() {
            self.deadline = Some(linger);
        }
        Ok(())
    }

    /// The host stream's fd is ready for `set`.
    pub fn on_event(&mut self, set: EventSet) -> Result<(), ConnError> {
        let wanted = self.wanted_events();
        let failed = set.intersects(EventSet::HANG_UP | EventSet::ERROR);
        if set.contains(EventSet::HANG_UP) {
            self.hup = true;
        }
        if (set.contains(EventSet::IN) || failed) && wanted.contains(EventSet::IN) {
            self.pending.rw = true;
        }
        if (set.contains(EventSet::OUT) || failed) && wanted.contains(EventSet::OUT) {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes what the host stream takes of the reply and the buffered guest bytes.
    pub fn flush(&mut self) -> Result<(), ConnError> {
        while !self.reply.is_empty() {
            match write_some(&mut self.stream, &self.reply)? {
                0 => return Ok(()),
                n => drop(self.reply.drain(..n)),
            }
        }
        while !self.tx_buf.is_empty() {
            let (front, _) = self.tx_buf.as_slices();
            match write_some(&mut self.stream, front)? {
                0 => break,
                n => {
                    self.tx_buf.drain(..n);
                    self.fwd_cnt += n as u32;
                }
            }
        }
        if self.tx_buf.is_empty() && self.guest_done && !self.write_shut {
            self.write_shut = true;
            let _ = self.stream.shutdown(Shutdown::Write);
        }
        self.check_credit_update();
        Ok(())
    }

    fn check_credit_update(&mut self) {
        if self.state == State::Established
            && !self.guest_done
            && (self.fwd_cnt - self.fwd_cnt_sent).0 >= CREDIT_UPDATE_THRESHOLD
        {
            self.pending.credit_update = true;
        }
    }

    /// The connection owes the guest a packet.
    pub fn has_pending_rx(&self) -> bool {
        self.pending.request
            || self.pending.response
            || self.pending.credit_update
            || (self.pending.rw && self.state == State::Established && !self.host_done)
    }

    /// What to watch the host stream for: writable while guest bytes wait, readable
    /// while the guest can take more and no read is already pending.
    pub fn wanted_events(&self) -> EventSet {
        let mut set = EventSet::empty();
        if !self.flushed() {
            set |= EventSet::OUT;
        }
        if self.state == State::Established
            && !self.host_done
            && !self.pending.rw
            && self.peer_credit() > 0
        {
            set |= EventSet::IN;
        }
        set
    }

    /// A packet header from this connection; every one carries our credit.
    fn header(&mut self, op: u16, len: usize, flags: u32) -> Header {
        self.fwd_cnt_sent = self.fwd_cnt;
        self.pending.credit_update = false;
        Header {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: self.local_port,
            dst_port: self.peer_port,
            len: len as u32,
            type_: TYPE_STREAM,
            op,
            flags,
            buf_alloc: CONN_BUF_SIZE,
            fwd_cnt: self.fwd_cnt.0,
        }
    }

    /// The RST that ends this connection.
    pub fn rst(&self) -> Header {
        Header {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: self.local_port,
            dst_port: self.peer_port,
            type_: TYPE_STREAM,
            op: OP_RST,
            ..Header::default()
        }
    }

    /// The next packet for the guest, into an rx buffer with room for `data_cap` data
    /// bytes. Host data is read into `scratch`, never more than the guest's credit.
    /// `linger` is as for [`Connection::on_shutdown`].
    pub fn next_rx(&mut self, data_cap: usize, scratch: &mut [u8], linger: Instant) -> RxItem {
        if self.pending.request {
            self.pending.request = false;
            return RxItem::Packet(self.header(OP_REQUEST, 0, 0), 0);
        }
        if self.pending.response {
            self.pending.response = false;
            return RxItem::Packet(self.header(OP_RESPONSE, 0, 0), 0);
        }
        if self.pending.credit_update {
            return RxItem::Packet(self.header(OP_CREDIT_UPDATE, 0, 0), 0);
        }
        if !self.pending.rw || self.state != State::Established || self.host_done {
            self.pending.rw = false;
            return RxItem::Nothing;
        }
        let credit = self.peer_credit() as usize;
        if credit == 0 {
            self.pending.rw = false;
            if self.credit_requested {
                return RxItem::Nothing;
            }
            self.credit_requested = true;
            return RxItem::Packet(self.header(OP_CREDIT_REQUEST, 0, 0), 0);
        }
        let n = credit.min(data_cap).min(scratch.len());
        if n == 0 {
            // The rx buffer has no room for data; try again with the next one.
            return RxItem::Nothing;
        }
        loop {
            match self.stream.read(&mut scratch[..n]) {
                Ok(0) => {
                    self.host_done = true;
                    self.pending.rw = false;
                    if self.hup || self.is_finished() {
                        return RxItem::Kill;
                    }
                    if self.guest_done {
                        self.deadline = Some(linger);
                    }
                    return RxItem::Packet(self.header(OP_SHUTDOWN, 0, SHUTDOWN_SEND), 0);
                }
                Ok(k) => {
                    self.rx_cnt += k as u32;
                    return RxItem::Packet(self.header(OP_RW, k, 0), k);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    self.pending.rw = false;
                    return RxItem::Nothing;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return RxItem::Kill,
            }
        }
    }
}

/// Writes what `stream` takes of `buf`: 0 when it would block.
fn write_some(stream: &mut UnixStream, buf: &[u8]) -> Result<usize, ConnError> {
    loop {
        match stream.write(buf) {
            Ok(0) => return Err(ConnError::HostWrite(ErrorKind::WriteZero.into())),
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(0),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(ConnError::HostWrite(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CID: u64 = 3;

    fn request(buf_alloc: u32) -> Header {
        Header {
            src_cid: CID,
            dst_cid: HOST_CID,
            src_port: 700,
            dst_port: 80,
            type_: TYPE_STREAM,
            op: OP_REQUEST,
            buf_alloc,
            ..Header::default()
        }
    }

    /// A guest-initiated connection and the host end of its stream.
    fn pair(buf_alloc: u32) -> (Connection, UnixStream) {
        let (host, dev) = UnixStream::pair().unwrap();
        dev.set_nonblocking(true).unwrap();
        host.set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        let mut c = Connection::guest_initiated(dev, CID, &request(buf_alloc));
        let mut scratch = [0u8; 16];
        let RxItem::Packet(h, 0) = c.next_rx(4096, &mut scratch, Instant::now()) else {
            panic!("no response");
        };
        assert_eq!(h.op, OP_RESPONSE);
        assert_eq!((h.src_port, h.dst_port, h.dst_cid), (80, 700, CID));
        (c, host)
    }

    #[test]
    fn never_sends_past_guest_credit() {
        let (mut c, mut host) = pair(10);
        host.write_all(&[7u8; 100]).unwrap();
        assert!(c.wanted_events().contains(EventSet::IN));
        c.on_event(EventSet::IN).unwrap();
        assert!(!c.wanted_events().contains(EventSet::IN));
        let mut scratch = vec![0u8; 4096];
        let now = Instant::now();
        assert!(
            matches!(c.next_rx(4096, &mut scratch, now), RxItem::Packet(h, 10) if h.op == OP_RW)
        );
        // Out of credit: one credit request, then nothing, and the fd is not watched.
        assert!(
            matches!(c.next_rx(4096, &mut scratch, now), RxItem::Packet(h, 0) if h.op == OP_CREDIT_REQUEST)
        );
        assert_eq!(c.next_rx(4096, &mut scratch, now), RxItem::Nothing);
        assert!(c.wanted_events().is_empty());
        assert!(!c.has_pending_rx());
        // The guest consumed 4 bytes: 4 more may go, within a smaller rx buffer too.
        c.update_peer_credit(10, 4);
        assert!(c.wanted_events().contains(EventSet::IN));
        c.on_event(EventSet::IN).unwrap();
        assert!(matches!(
            c.next_rx(3, &mut scratch, now),
            RxItem::Packet(_, 3)
        ));
        assert!(matches!(
            c.next_rx(4096, &mut scratch, now),
            RxItem::Packet(_, 1)
        ));
        // A guest claiming to have consumed more than it got gets nothing.
        c.update_peer_credit(10, 1000);
        assert_eq!(c.peer_credit(), 0);
    }

    #[test]
    fn buffers_within_credit_then_resets() {
        let (mut c, mut host) = pair(4096);
        let chunk = vec![1u8; 64 * 1024];
        let mut sent = 0usize;
        let err = loop {
            match c.on_rw(&chunk) {
                Ok(()) => sent += chunk.len(),
                Err(e) => break e,
            }
            assert!(c.buffered() <= CONN_BUF_SIZE as usize);
            assert!(sent < 64 * 1024 * 1024, "host stream never filled");
        };
        assert!(matches!(err, ConnError::CreditExceeded(_)));
        assert!(c.buffered() > 0);
        assert!(c.wanted_events().contains(EventSet::OUT));
        // The host drains: buffered bytes follow, fwd_cnt grows, a credit update is owed.
        let mut got = 0usize;
        let mut buf = vec![0u8; 64 * 1024];
        while got < sent {
            got += host.read(&mut buf).unwrap();
            c.on_event(EventSet::OUT).unwrap();
        }
        assert_eq!(c.buffered(), 0);
        assert!(c.has_pending_rx());
        let mut scratch = [0u8; 16];
        let RxItem::Packet(h, 0) = c.next_rx(4096, &mut scratch, Instant::now()) else {
            panic!("no credit update");
        };
        assert_eq!(h.op, OP_CREDIT_UPDATE);
        assert_eq!(h.fwd_cnt, sent as u32);
        assert_eq!(h.buf_alloc, CONN_BUF_SIZE);
    }

    #[test]
    fn shutdown_both_ways() {
        let (mut c, mut host) = pair(4096);
        let now = Instant::now();
        // Guest stops sending: the host reads EOF after the data.
        c.on_rw(b"bye").unwrap();
        c.on_shutdown(SHUTDOWN_SEND, now).unwrap();
        assert!(matches!(c.on_rw(b"x"), Err(ConnError::SendAfterShutdown)));
        let mut s = String::new();
        host.read_to_string(&mut s).unwrap();
        assert_eq!(s, "bye");
        assert!(!c.is_finished());
        // The host can still send; then its EOF finishes the connection.
        host.write_all(b"late").unwrap();
        host.shutdown(Shutdown::Write).unwrap();
        c.on_event(EventSet::IN).unwrap();
        let mut scratch = [0u8; 64];
        assert!(matches!(
            c.next_rx(4096, &mut scratch, now),
            RxItem::Packet(_, 4)
        ));
        assert_eq!(&scratch[..4], b"late");
        assert_eq!(c.next_rx(4096, &mut scratch, now), RxItem::Kill);
        assert!(c.is_finished());
    }

    #[test]
    fn host_eof_sends_shutdown_and_hangup_resets() {
        let (mut c, host) = pair(4096);
        host.shutdown(Shutdown::Write).unwrap();
        c.on_event(EventSet::IN).unwrap();
        let mut scratch = [0u8; 64];
        let RxItem::Packet(h, 0) = c.next_rx(4096, &mut scratch, Instant::now()) else {
            panic!("no shutdown");
        };
        assert_eq!((h.op, h.flags), (OP_SHUTDOWN, SHUTDOWN_SEND));
        assert!(!c.wanted_events().contains(EventSet::IN));
        c.on_shutdown(SHUTDOWN_SEND | SHUTDOWN_RCV, Instant::now())
            .unwrap();
        assert!(c.is_finished());

        let (mut c, host) = pair(4096);
        drop(host);
        c.on_event(EventSet::IN | EventSet::HANG_UP).unwrap();
        assert_eq!(c.next_rx(4096, &mut scratch, Instant::now()), RxItem::Kill);
    }

    #[test]
    fn lingers_until_flushed() {
        let (mut c, mut host) = pair(4096);
        let chunk = vec![3u8; 32 * 1024];
        let mut sent = 0;
        while c.buffered() == 0 {
            c.on_rw(&chunk).unwrap();
            sent += chunk.len();
        }
        let linger = Instant::now() + std::time::Duration::from_secs(1);
        c.on_shutdown(SHUTDOWN_RCV | SHUTDOWN_SEND, linger).unwrap();
        assert!(!c.is_finished());
        assert_eq!(c.deadline, Some(linger));
        assert_eq!(c.wanted_events(), EventSet::OUT);
        let mut buf = vec![0u8; 1 << 16];
        let mut got = 0;
        while !c.is_finished() {
            got += host.read(&mut buf).unwrap();
            c.on_event(EventSet::OUT).unwrap();
        }
        loop {
            match host.read(&mut buf).unwrap() {
                0 => break,
                n => got += n,
            }
        }
        assert_eq!(got, sent);
    }

    #[test]
    fn host_initiated_waits_for_response() {
        let (mut host, dev) = UnixStream::pair().unwrap();
        dev.set_nonblocking(true).unwrap();
        let mut c = Connection::host_initiated(dev, CID, 1 << 30, 5000, Instant::now());
        assert!(matches!(c.on_response(), Err(ConnError::UnexpectedOp(_))));
        let mut scratch = [0u8; 16];
        let RxItem::Packet(h, 0) = c.next_rx(4096, &mut scratch, Instant::now()) else {
            panic!("no request");
        };
        assert_eq!(h.op, OP_REQUEST);
        assert_eq!(
            (h.src_cid, h.dst_cid, h.src_port, h.dst_port),
            (2, CID, 1 << 30, 5000)
        );
        assert!(matches!(c.on_rw(b"x"), Err(ConnError::UnexpectedOp(OP_RW))));
        c.update_peer_credit(100, 0);
        c.on_response().unwrap();
        assert_eq!(c.state(), State::Established);
        assert!(c.deadline.is_none());
        let mut line = [0u8; 14];
        host.read_exact(&mut line).unwrap();
        assert_eq!(&line, format!("OK {}\n", 1u32 << 30).as_bytes());
        assert!(matches!(c.on_response(), Err(ConnError::UnexpectedOp(_))));
    }
}
