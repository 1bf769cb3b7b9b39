//! virtio-vsock: an echo server on `VSOCK_ECHO_PORT` for any number of host
//! connections (up to `conn::MAX_CONNS` at once) and the client side of
//! `CMD_VSOCK_SEND`. Driven by [`Vsock::poll`] from vCPU 0's main loop.
//!
//! Queues: rx (0) with `NRX` pre-posted 44 + 4096-byte buffers (one descriptor
//! each, as Linux posts them), tx (1) with header and payload in two descriptors
//! (as Linux sends them), event (2) with one buffer.
//! Credit: every packet carries our `buf_alloc` (the ring size) and `fwd_cnt` (bytes
//! taken out of the ring); we send no more than the peer's advertised space.

mod conn;
pub mod packet;

use crate::boot::idle;
use crate::mem::Once;
use crate::println;
use crate::virtio::{Transport, Virtq, DESC_NEXT, DESC_WRITE};
use conn::{Conn, State, Table, CONN_BUF};
use guest_abi::mailbox::{STATUS_IO_ERROR, STATUS_OK, STATUS_REFUSED, VSOCK_ECHO_PORT};
use packet::*;

/// Largest payload per packet (and per rx buffer).
pub const MAX_PKT: usize = 4096;
const RX_BUF: usize = HDR_LEN + MAX_PKT;
const NRX: usize = 64;
const NTX: usize = 64;
/// Largest reply `CMD_VSOCK_SEND` stores.
pub const MAX_REPLY: u64 = 4096;
const EPHEMERAL_FIRST: u32 = 49152;

#[repr(C, align(4096))]
struct Buffers {
    rx: [[u8; RX_BUF]; NRX],
    tx_data: [[u8; MAX_PKT]; NTX],
    tx_hdr: [[u8; 64]; NTX],
    event: [u8; 8],
}

static BUFFERS: Once<Buffers> = Once::zeroed();

/// An outstanding `CMD_VSOCK_SEND`.
#[derive(Clone, Copy)]
struct Client {
    conn: usize,
    gpa: u64,
    len: u64,
    sent: u64,
}

pub struct Vsock {
    t: Transport,
    rx: Virtq,
    tx: Virtq,
    ev: Virtq,
    bufs: *mut Buffers,
    table: &'static mut Table,
    /// Our CID, from the device's config space.
    pub cid: u64,
    tx_free: [u16; NTX],
    n_free: usize,
    tx_kick: bool,
    client: Option<Client>,
    /// (status, reply length) of a finished `CMD_VSOCK_SEND`.
    result: Option<(u32, u64)>,
    next_port: u32,
}

impl Vsock {
    pub fn new(t: Transport) -> Option<Self> {
        t.negotiate(0)?;
        let mut rx = t.queue(0, 2 * NRX as u16)?;
        let tx = t.queue(1, 2 * NTX as u16)?;
        let mut ev = t.queue(2, 4)?;
        let bufs: *mut Buffers = BUFFERS.take()?;
        let table = Table::take()?;
        let cid = t.config64(0);
        t.driver_ok();
        let ntx = NTX.min(tx.size() as usize / 2);
        let mut tx_free = [0u16; NTX];
        for (i, f) in tx_free.iter_mut().enumerate().take(ntx) {
            *f = i as u16;
        }
        for i in 0..NRX.min(rx.size() as usize) {
            // SAFETY: only the address of rx buffer `i` is taken.
            let addr = unsafe { core::ptr::addr_of!((*bufs).rx[i]) } as u64;
            rx.set_desc(i as u16, addr, RX_BUF as u32, DESC_WRITE, 0);
            rx.submit(i as u16);
        }
        rx.kick();
        // SAFETY: only the address of the event buffer is taken.
        let event = unsafe { core::ptr::addr_of!((*bufs).event) } as u64;
        ev.set_desc(0, event, 8, DESC_WRITE, 0);
        ev.submit(0);
        ev.kick();
        Some(Self {
            t,
            rx,
            tx,
            ev,
            bufs,
            table,
            cid,
            tx_free,
            n_free: ntx,
            tx_kick: false,
            client: None,
            result: None,
            next_port: EPHEMERAL_FIRST,
        })
    }

    /// Handles whatever the device returned and sends what can be sent.
    /// Returns whether there was anything to do.
    pub fn poll(&mut self) -> bool {
        let busy = self.rx.has_used() || self.tx.has_used() || self.ev.has_used();
        if busy {
            self.t.ack_interrupt();
        }
        self.reclaim_tx();
        self.handle_events();
        let mut reposted = false;
        while let Some((id, len)) = self.rx.pop_used() {
            self.handle_rx(id, len);
            self.rx.submit(id);
            reposted = true;
        }
        if reposted {
            self.rx.kick();
        }
        self.flush();
        self.kick_tx();
        busy
    }

    /// Starts `CMD_VSOCK_SEND`: connect to host port `port`, send `len` bytes from
    /// `gpa`. The result comes from [`Vsock::take_result`].
    pub fn start_send(&mut self, port: u32, gpa: u64, len: u64) -> Result<(), u32> {
        let i = self.alloc_conn().ok_or(STATUS_IO_ERROR)?;
        let local = self.ephemeral_port();
        self.table.conns[i] = Conn::new(State::Connecting, true, local, port);
        self.client = Some(Client {
            conn: i,
            gpa,
            len,
            sent: 0,
        });
        self.send_ctrl(i, OP_REQUEST, 0);
        self.kick_tx();
        Ok(())
    }

    /// (status, reply length) once the `CMD_VSOCK_SEND` in flight is over.
    pub fn take_result(&mut self) -> Option<(u32, u64)> {
        self.result.take()
    }

    fn ephemeral_port(&mut self) -> u32 {
        loop {
            let p = self.next_port;
            self.next_port = if p == u32::MAX {
                EPHEMERAL_FIRST
            } else {
                p + 1
            };
            if p != VSOCK_ECHO_PORT && !self.table.port_in_use(p) {
                return p;
            }
        }
    }

    /// A free connection, reclaiming one whose peer never finished closing.
    fn alloc_conn(&mut self) -> Option<usize> {
        if let Some(i) = self.table.free_slot() {
            return Some(i);
        }
        let i = self.table.closing_slot()?;
        self.send_ctrl(i, OP_RST, 0);
        self.table.free(i);
        Some(i)
    }

    fn handle_events(&mut self) {
        while let Some((_, len)) = self.ev.pop_used() {
            // SAFETY: the device wrote the event before returning the buffer.
            let ev = unsafe { core::ptr::addr_of!((*self.bufs).event).read_volatile() };
            if len >= 4 && u32::from_le_bytes(ev[..4].try_into().unwrap()) == EVENT_TRANSPORT_RESET
            {
                self.table.free_all();
                if self.client.take().is_some() {
                    self.result = Some((STATUS_IO_ERROR, 0));
                }
                self.cid = self.t.config64(0);
                println!("vsock: transport reset, cid {}", self.cid);
            }
            self.ev.submit(0);
            self.ev.kick();
        }
    }

    fn handle_rx(&mut self, id: u16, len: u32) {
        let len = len as usize;
        if id as usize >= NRX || len < HDR_LEN {
            return;
        }
        // SAFETY: the device returned rx buffer `id`; it is not reposted until this
        // function returns, so nothing writes it meanwhile.
        let buf: &[u8; RX_BUF] = unsafe { &*core::ptr::addr_of!((*self.bufs).rx[id as usize]) };
        let h = Hdr::parse(buf[..HDR_LEN].try_into().unwrap());
        let plen = h.len as usize;
        if plen > len - HDR_LEN {
            println!("vsock: bad packet (len {} in a {}-byte buffer)", plen, len);
            return;
        }
        let payload = &buf[HDR_LEN..HDR_LEN + plen];
        if h.ty != TYPE_STREAM {
            if h.op != OP_RST {
                self.send_hdr(h.rst_reply());
            }
            return;
        }
        let found = self.table.find(h.dst_port, h.src_port);
        match (found, h.op) {
            (Some(i), OP_REQUEST) => {
                // The peer reuses the address pair of a connection it gave up on.
                self.table.free(i);
                self.end_client(i, STATUS_IO_ERROR);
                self.accept(&h);
            }
            (Some(i), _) => self.on_packet(i, &h, payload),
            (None, OP_REQUEST) => self.accept(&h),
            (None, OP_RST) => {}
            (None, _) => self.send_hdr(h.rst_reply()),
        }
    }

    /// A host connection to the echo port (anything else is refused).
    fn accept(&mut self, h: &Hdr) {
        let slot = if h.dst_port == VSOCK_ECHO_PORT {
            self.alloc_conn()
        } else {
            None
        };
        let Some(i) = slot else {
            self.send_hdr(h.rst_reply());
            return;
        };
        let mut c = Conn::new(State::Connected, false, h.dst_port, h.src_port);
        c.peer_buf_alloc = h.buf_alloc;
        c.peer_fwd_cnt = h.fwd_cnt;
        self.table.conns[i] = c;
        self.send_ctrl(i, OP_RESPONSE, 0);
    }

    fn on_packet(&mut self, i: usize, h: &Hdr, payload: &[u8]) {
        let c = &mut self.table.conns[i];
        c.peer_buf_alloc = h.buf_alloc;
        c.peer_fwd_cnt = h.fwd_cnt;
        match (c.state, h.op) {
            (State::Connecting, OP_RST) => self.close(i, false, STATUS_REFUSED),
            (_, OP_RST) => self.close(i, false, STATUS_OK),
            (State::Closing, OP_SHUTDOWN) => self.close(i, true, STATUS_OK),
            (State::Closing, _) => {}
            (State::Connecting, OP_RESPONSE) => c.state = State::Connected,
            (State::Connected, OP_RW) if c.client => self.client_reply(i, payload),
            (State::Connected, OP_RW) => {
                if c.peer_shutdown & SHUTDOWN_RCV != 0 {
                    c.rx_cnt = c.rx_cnt.wrapping_add(payload.len() as u32);
                    self.table.discard(i);
                } else if !self.table.push(i, payload) {
                    println!("vsock: port {} overran its credit", h.src_port);
                    self.close(i, true, STATUS_IO_ERROR);
                }
            }
            (State::Connected, OP_CREDIT_UPDATE) => {}
            (State::Connected, OP_CREDIT_REQUEST) => self.send_ctrl(i, OP_CREDIT_UPDATE, 0),
            (State::Connected, OP_SHUTDOWN) => {
                c.peer_shutdown |= h.flags & SHUTDOWN_BOTH;
                if c.client || c.peer_shutdown == SHUTDOWN_BOTH {
                    self.close(i, true, STATUS_OK);
                } else if c.peer_shutdown & SHUTDOWN_RCV != 0 {
                    self.table.discard(i);
                }
                // SEND only: `flush` echoes what is left, then shuts down.
            }
            _ => self.close(i, true, STATUS_IO_ERROR),
        }
    }

    /// Frees connection `i` (sending RST first if `rst`); a client connection ends
    /// its command with `status`.
    fn close(&mut self, i: usize, rst: bool, status: u32) {
        if rst {
            self.send_ctrl(i, OP_RST, 0);
        }
        self.table.free(i);
        self.end_client(i, status);
    }

    fn end_client(&mut self, i: usize, status: u32) {
        if self.client.is_some_and(|cl| cl.conn == i) {
            self.client = None;
            self.result = Some((status, 0));
        }
    }

    /// The first data of the reply: store it, end the command, shut down.
    fn client_reply(&mut self, i: usize, payload: &[u8]) {
        let c = &mut self.table.conns[i];
        c.rx_cnt = c.rx_cnt.wrapping_add(payload.len() as u32);
        c.fwd_cnt = c.rx_cnt;
        if let Some(cl) = self.client.filter(|cl| cl.conn == i) {
            self.client = None;
            let n = payload.len().min(MAX_REPLY as usize);
            // SAFETY: the mailbox checked that `gpa..gpa + MAX_REPLY` is host scratch
            // RAM outside this image, lent to this command.
            unsafe { core::ptr::copy_nonoverlapping(payload.as_ptr(), cl.gpa as *mut u8, n) };
            self.result = Some((STATUS_OK, n as u64));
        }
        self.send_ctrl(i, OP_SHUTDOWN, SHUTDOWN_BOTH);
        self.table.conns[i].state = State::Closing;
    }

    /// Sends what credit and tx buffers allow: echoes, the client's request, and
    /// the SHUTDOWN that ends an echo connection whose peer stopped sending.
    fn flush(&mut self) {
        for i in 0..self.table.conns.len() {
            let c = self.table.conns[i];
            if c.state != State::Connected {
                continue;
            }
            if c.client {
                self.flush_client(i);
                continue;
            }
            while self.table.conns[i].buffered() > 0 && self.table.conns[i].peer_credit() > 0 {
                let Some(slot) = self.try_tx_slot() else {
                    return;
                };
                let max = (self.table.conns[i].peer_credit() as usize).min(MAX_PKT);
                // SAFETY: tx buffer `slot` is free (not on the ring).
                let data = unsafe { &mut *core::ptr::addr_of_mut!((*self.bufs).tx_data[slot]) };
                let n = self.table.pop(i, &mut data[..max]);
                self.post_rw(i, slot, n);
            }
            let c = &mut self.table.conns[i];
            if c.peer_shutdown & SHUTDOWN_SEND != 0 && c.buffered() == 0 {
                c.state = State::Closing;
                self.send_ctrl(i, OP_SHUTDOWN, SHUTDOWN_BOTH);
            }
        }
    }

    fn flush_client(&mut self, i: usize) {
        let Some(mut cl) = self.client.filter(|cl| cl.conn == i) else {
            return;
        };
        while cl.sent < cl.len && self.table.conns[i].peer_credit() > 0 {
            let Some(slot) = self.try_tx_slot() else {
                break;
            };
            let n = (cl.len - cl.sent)
                .min(MAX_PKT as u64)
                .min(self.table.conns[i].peer_credit() as u64) as usize;
            // SAFETY: the mailbox checked `gpa..gpa + len` is host scratch RAM lent
            // to this command; tx buffer `slot` is free.
            unsafe {
                let dst = core::ptr::addr_of_mut!((*self.bufs).tx_data[slot]) as *mut u8;
                core::ptr::copy_nonoverlapping((cl.gpa + cl.sent) as *const u8, dst, n);
            }
            cl.sent += n as u64;
            self.post_rw(i, slot, n);
        }
        self.client = Some(cl);
    }

    fn post_rw(&mut self, i: usize, slot: usize, n: usize) {
        let c = &mut self.table.conns[i];
        c.tx_cnt = c.tx_cnt.wrapping_add(n as u32);
        let h = self.conn_hdr(i, OP_RW, 0, n as u32);
        self.post(slot, h);
    }

    fn conn_hdr(&self, i: usize, op: u16, flags: u32, len: u32) -> Hdr {
        let c = &self.table.conns[i];
        Hdr {
            src_cid: self.cid,
            dst_cid: HOST_CID,
            src_port: c.local_port,
            dst_port: c.peer_port,
            len,
            ty: TYPE_STREAM,
            op,
            flags,
            buf_alloc: CONN_BUF,
            fwd_cnt: c.fwd_cnt,
        }
    }

    /// Sends a packet without payload on connection `i`.
    fn send_ctrl(&mut self, i: usize, op: u16, flags: u32) {
        let h = self.conn_hdr(i, op, flags, 0);
        self.send_hdr(h);
    }

    /// Sends a packet without payload, waiting for a tx buffer if need be.
    fn send_hdr(&mut self, h: Hdr) {
        let slot = loop {
            if let Some(s) = self.try_tx_slot() {
                break s;
            }
            self.kick_tx();
            idle();
            if self.tx.has_used() {
                self.t.ack_interrupt();
            }
        };
        self.post(slot, h);
    }

    fn try_tx_slot(&mut self) -> Option<usize> {
        if self.n_free == 0 {
            self.reclaim_tx();
        }
        if self.n_free == 0 {
            return None;
        }
        self.n_free -= 1;
        Some(self.tx_free[self.n_free] as usize)
    }

    fn reclaim_tx(&mut self) {
        while let Some((head, _)) = self.tx.pop_used() {
            self.tx_free[self.n_free] = head / 2;
            self.n_free += 1;
        }
    }

    /// Queues tx buffer `slot` with header `h` (and `h.len` payload bytes).
    fn post(&mut self, slot: usize, h: Hdr) {
        let d = 2 * slot as u16;
        // SAFETY: tx buffer `slot` is ours until the device returns it.
        let (hdr_addr, data_addr) = unsafe {
            let hdr = core::ptr::addr_of_mut!((*self.bufs).tx_hdr[slot]);
            (hdr as *mut [u8; HDR_LEN]).write_volatile(h.bytes());
            (
                hdr as u64,
                core::ptr::addr_of!((*self.bufs).tx_data[slot]) as u64,
            )
        };
        if h.len > 0 {
            self.tx
                .set_desc(d, hdr_addr, HDR_LEN as u32, DESC_NEXT, d + 1);
            self.tx.set_desc(d + 1, data_addr, h.len, 0, 0);
        } else {
            self.tx.set_desc(d, hdr_addr, HDR_LEN as u32, 0, 0);
        }
        self.tx.submit(d);
        self.tx_kick = true;
    }

    fn kick_tx(&mut self) {
        if self.tx_kick {
            self.tx_kick = false;
            self.tx.kick();
        }
    }
}
