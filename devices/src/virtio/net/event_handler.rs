//! The device's side of the event loop: queue notifications, self-kicks and
//! the TAP, each followed by a pump of both queues.
//!
//! The TAP is watched only while the device is active and no frame waits
//! for a receive buffer: a waiting frame would keep the TAP readable and the
//! loop spinning, and the driver's next buffer (a receive-queue notify)
//! brings the device back to it.

use std::os::fd::{AsFd, AsRawFd, RawFd};

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use log::{error, warn};

use super::device::Net;
use crate::virtio::VirtioDevice;

const TOKEN_RXQ: u32 = 0;
const TOKEN_TXQ: u32 = 1;
const TOKEN_KICK: u32 = 2;
const TOKEN_TAP: u32 = 3;

impl Net {
    /// Watches the TAP while the device can take its frames, and not otherwise.
    fn sync_tap(&mut self, ops: &mut EventOps) {
        let want = self.is_activated() && !self.needs_reset() && !self.rx_pending();
        if want == self.tap_watched {
            return;
        }
        let fd = self.tap().as_fd().as_raw_fd();
        let r = if want {
            ops.add(Events::with_data_raw(fd, TOKEN_TAP, EventSet::IN))
        } else {
            ops.remove(Events::empty_raw(fd))
        };
        match r {
            Ok(()) => self.tap_watched = want,
            Err(e) => error!("virtio-net: cannot change the TAP's watch: {e}"),
        }
    }
}

impl MutEventSubscriber for Net {
    fn init(&mut self, ops: &mut EventOps) {
        let add = |ops: &mut EventOps, fd: RawFd, token: u32| {
            if let Err(e) = ops.add(Events::with_data_raw(fd, token, EventSet::IN)) {
                error!("virtio-net: cannot watch fd {fd}: {e}");
            }
        };
        let queue_fds: Vec<RawFd> = self.queue_events().iter().map(AsRawFd::as_raw_fd).collect();
        for (i, fd) in queue_fds.into_iter().enumerate() {
            add(ops, fd, i as u32);
        }
        add(ops, self.kick_event().as_raw_fd(), TOKEN_KICK);
        self.pump();
        self.sync_tap(ops);
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        match events.data() {
            t @ (TOKEN_RXQ | TOKEN_TXQ) => {
                let _ = self.queue_events()[t as usize].read();
            }
            TOKEN_KICK => {
                let _ = self.kick_event().read();
            }
            // Read by the pump.
            TOKEN_TAP => {}
            t => warn!("virtio-net: event with unknown token {t}"),
        }
        self.pump();
        self.sync_tap(ops);
    }
}
