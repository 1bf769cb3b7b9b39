//! vsock stream connections: state, credit accounting and each connection's
//! receive ring (the echo server's data waiting to go back).

use crate::mem::Once;

pub const MAX_CONNS: usize = 128;
/// Receive buffer per connection, advertised as `buf_alloc` (a power of two).
pub const CONN_BUF: u32 = 16 * 1024;

#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Zero: an all-zero table is all free.
    Free = 0,
    /// We sent REQUEST and wait for RESPONSE.
    Connecting,
    Connected,
    /// We sent SHUTDOWN and wait for the peer's RST (or SHUTDOWN).
    Closing,
}

#[derive(Clone, Copy, Debug)]
pub struct Conn {
    pub state: State,
    /// Ours (`CMD_VSOCK_SEND`) rather than accepted by the echo server.
    pub client: bool,
    pub local_port: u32,
    pub peer_port: u32,
    pub peer_buf_alloc: u32,
    pub peer_fwd_cnt: u32,
    /// Payload bytes sent.
    pub tx_cnt: u32,
    /// Payload bytes received (into the ring).
    pub rx_cnt: u32,
    /// Payload bytes consumed from the ring: our credit to the peer.
    pub fwd_cnt: u32,
    /// SHUTDOWN flags the peer sent.
    pub peer_shutdown: u32,
}

impl Conn {
    pub const fn new(state: State, client: bool, local_port: u32, peer_port: u32) -> Self {
        Self {
            state,
            client,
            local_port,
            peer_port,
            peer_buf_alloc: 0,
            peer_fwd_cnt: 0,
            tx_cnt: 0,
            rx_cnt: 0,
            fwd_cnt: 0,
            peer_shutdown: 0,
        }
    }

    /// Payload bytes the peer can take now.
    pub fn peer_credit(&self) -> u32 {
        let in_flight = self.tx_cnt.wrapping_sub(self.peer_fwd_cnt);
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// Bytes in the ring.
    pub fn buffered(&self) -> u32 {
        self.rx_cnt.wrapping_sub(self.fwd_cnt)
    }
}

pub struct Table {
    pub conns: [Conn; MAX_CONNS],
    rings: [[u8; CONN_BUF as usize]; MAX_CONNS],
}

static TABLE: Once<Table> = Once::zeroed();

impl Table {
    pub fn take() -> Option<&'static mut Table> {
        TABLE.take()
    }

    pub fn find(&self, local_port: u32, peer_port: u32) -> Option<usize> {
        self.conns.iter().position(|c| {
            c.state != State::Free && c.local_port == local_port && c.peer_port == peer_port
        })
    }

    pub fn port_in_use(&self, local_port: u32) -> bool {
        self.conns
            .iter()
            .any(|c| c.state != State::Free && c.local_port == local_port)
    }

    pub fn free_slot(&self) -> Option<usize> {
        self.conns.iter().position(|c| c.state == State::Free)
    }

    pub fn closing_slot(&self) -> Option<usize> {
        self.conns.iter().position(|c| c.state == State::Closing)
    }

    pub fn free(&mut self, i: usize) {
        self.conns[i].state = State::Free;
    }

    pub fn free_all(&mut self) {
        for c in &mut self.conns {
            c.state = State::Free;
        }
    }

    /// Appends `data` to connection `i`'s ring; false if it does not fit.
    pub fn push(&mut self, i: usize, data: &[u8]) -> bool {
        let c = &mut self.conns[i];
        if data.len() > (CONN_BUF - c.buffered()) as usize {
            return false;
        }
        let ring = &mut self.rings[i];
        let at = (c.rx_cnt % CONN_BUF) as usize;
        let first = data.len().min(ring.len() - at);
        ring[at..at + first].copy_from_slice(&data[..first]);
        ring[..data.len() - first].copy_from_slice(&data[first..]);
        c.rx_cnt = c.rx_cnt.wrapping_add(data.len() as u32);
        true
    }

    /// Moves up to `out.len()` bytes out of connection `i`'s ring.
    pub fn pop(&mut self, i: usize, out: &mut [u8]) -> usize {
        let c = &mut self.conns[i];
        let n = out.len().min(c.buffered() as usize);
        let ring = &self.rings[i];
        let at = (c.fwd_cnt % CONN_BUF) as usize;
        let first = n.min(ring.len() - at);
        out[..first].copy_from_slice(&ring[at..at + first]);
        out[first..n].copy_from_slice(&ring[..n - first]);
        c.fwd_cnt = c.fwd_cnt.wrapping_add(n as u32);
        n
    }

    /// Drops what connection `i` holds (its peer will not read it).
    pub fn discard(&mut self, i: usize) {
        let c = &mut self.conns[i];
        c.fwd_cnt = c.rx_cnt;
    }
}
