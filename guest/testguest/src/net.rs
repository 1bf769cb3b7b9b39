//! virtio-net: one frame at a time each way, for the host's tests of its
//! device (queue 0 receives, queue 1 transmits; no offloads).

use crate::virtio::{Transport, Virtq, DESC_WRITE, QMAX};
use guest_abi::mailbox::STATUS_OK;

pub struct Net {
    t: Transport,
    rx: Virtq,
    tx: Virtq,
}

impl Net {
    pub fn new(t: Transport) -> Option<Self> {
        t.negotiate(0)?;
        let rx = t.queue(0, QMAX as u16)?;
        let tx = t.queue(1, QMAX as u16)?;
        t.driver_ok();
        Some(Self { t, rx, tx })
    }

    /// Sends the frame (header first) of `len` bytes at `gpa`; the used length.
    pub fn send(&mut self, gpa: u64, len: u32) -> (u32, u32) {
        self.tx.set_desc(0, gpa, len, 0, 0);
        self.tx.submit(0);
        self.tx.kick();
        let (_, n) = self.tx.wait_used(&self.t);
        (STATUS_OK, n)
    }

    /// Posts `cap` bytes at `gpa` for one frame and waits for it; its length.
    pub fn recv(&mut self, gpa: u64, cap: u32) -> (u32, u32) {
        self.rx.set_desc(0, gpa, cap, DESC_WRITE, 0);
        self.rx.submit(0);
        self.rx.kick();
        let (_, n) = self.rx.wait_used(&self.t);
        (STATUS_OK, n)
    }
}
