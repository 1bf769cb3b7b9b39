//! virtio-rng: the device fills the host's buffer directly.

use crate::virtio::{Transport, Virtq, DESC_WRITE, QMAX};
use guest_abi::mailbox::{STATUS_IO_ERROR, STATUS_OK};

pub struct Rng {
    t: Transport,
    q: Virtq,
}

impl Rng {
    pub fn new(t: Transport) -> Option<Self> {
        t.negotiate(0)?;
        let q = t.queue(0, QMAX as u16)?;
        t.driver_ok();
        Some(Self { t, q })
    }

    /// Sets up the one chain `CMD_FLOOD` posts again and again: `len` bytes at `gpa`.
    pub fn flood_chain(&mut self, gpa: u64, len: u32) {
        self.q.set_desc(0, gpa, len, DESC_WRITE, 0);
    }

    /// One flood pass (see `Virtq::flood_pass`): chains the device returned.
    pub fn flood_pass(&mut self) -> u64 {
        self.q.flood_pass(0)
    }

    /// Fills `len` bytes at `gpa` (the device may return fewer per request).
    pub fn read(&mut self, gpa: u64, len: u32) -> u32 {
        let mut done = 0;
        let mut empty = 0;
        while done < len {
            self.q
                .set_desc(0, gpa + done as u64, len - done, DESC_WRITE, 0);
            self.q.submit(0);
            self.q.kick();
            let (_, n) = self.q.wait_used(&self.t);
            if n == 0 {
                empty += 1;
                if empty == 3 {
                    return STATUS_IO_ERROR;
                }
            }
            done += n.min(len - done);
        }
        STATUS_OK
    }
}
