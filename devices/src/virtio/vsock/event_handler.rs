//! The device's side of the event loop: queue notifications, the listener, host
//! streams, the deadline timer and self-kicks, each followed by a pump of the queues
//! and the watch-list changes the muxer asked for.

use std::os::fd::{AsRawFd, RawFd};
use std::time::Instant;

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use log::{debug, error, warn};

use super::device::{Vsock, EVQ, RXQ, TXQ};
use super::muxer::PollOp;
use crate::virtio::VirtioDevice;

const TOKEN_RXQ: u32 = RXQ as u32;
const TOKEN_TXQ: u32 = TXQ as u32;
const TOKEN_EVQ: u32 = EVQ as u32;
const TOKEN_LISTENER: u32 = 3;
const TOKEN_KICK: u32 = 4;
const TOKEN_TIMER: u32 = 5;
const TOKEN_STREAM: u32 = 6;

/// Rounds of applying watch-list changes per event (a failed registration resets its
/// connection, which queues one more change).
const SYNC_ROUNDS: usize = 4;

impl Vsock {
    /// Applies the muxer's watch-list changes and (re)arms the deadline timer.
    fn sync(&mut self, ops: &mut EventOps) {
        for _ in 0..SYNC_ROUNDS {
            let changes = self.muxer.take_poll_ops();
            if changes.is_empty() {
                break;
            }
            let mut failed = false;
            for change in changes {
                match change {
                    PollOp::Add(fd, set) => {
                        if let Err(e) = ops.add(Events::with_data_raw(fd, TOKEN_STREAM, set)) {
                            error!("vsock: cannot watch a host stream: {e}");
                            self.muxer.kill_fd(fd);
                            failed = true;
                        }
                    }
                    PollOp::Modify(fd, set) => {
                        if let Err(e) = ops.modify(Events::with_data_raw(fd, TOKEN_STREAM, set)) {
                            error!("vsock: cannot watch a host stream: {e}");
                            self.muxer.kill_fd(fd);
                            failed = true;
                        }
                    }
                    PollOp::Remove(fd, stream) => {
                        // Fails harmlessly if the fd was not being watched.
                        if let Err(e) = ops.remove(Events::empty_raw(fd)) {
                            debug!("vsock: unwatching fd {fd}: {e}");
                        }
                        drop(stream);
                    }
                }
            }
            if failed {
                self.pump();
            }
        }
        if !self.timer_armed && self.muxer.has_deadlines() {
            match self.timer.reset(self.tick, Some(self.tick)) {
                Ok(()) => self.timer_armed = true,
                Err(e) => warn!("vsock: cannot arm the timer: {e}"),
            }
        }
    }

    fn on_timer(&mut self) {
        // Readable, so this does not block.
        let _ = self.timer.wait();
        self.check_reset_ack();
        self.muxer.tick(Instant::now());
        if !self.muxer.has_deadlines() {
            // Disarming here cannot strand a later event of this fd in the current
            // batch: epoll reports each fd once per wait.
            let _ = self.timer.clear();
            self.timer_armed = false;
        }
    }
}

impl MutEventSubscriber for Vsock {
    fn init(&mut self, ops: &mut EventOps) {
        let add = |ops: &mut EventOps, fd: RawFd, token: u32| {
            if let Err(e) = ops.add(Events::with_data_raw(fd, token, EventSet::IN)) {
                error!("vsock: cannot watch fd {fd}: {e}");
            }
        };
        let queue_fds: Vec<RawFd> = self.queue_events().iter().map(AsRawFd::as_raw_fd).collect();
        for (i, fd) in queue_fds.into_iter().enumerate() {
            add(ops, fd, i as u32);
        }
        add(ops, self.muxer.listener().as_raw_fd(), TOKEN_LISTENER);
        add(ops, self.kick.as_raw_fd(), TOKEN_KICK);
        add(ops, self.timer.as_raw_fd(), TOKEN_TIMER);
        self.pump();
        self.sync(ops);
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        match events.data() {
            t @ (TOKEN_RXQ | TOKEN_TXQ | TOKEN_EVQ) => {
                let _ = self.queue_events()[t as usize].read();
            }
            TOKEN_LISTENER => self.muxer.accept(),
            TOKEN_KICK => {
                let _ = self.kick.read();
            }
            TOKEN_TIMER => self.on_timer(),
            TOKEN_STREAM => self.muxer.handle_fd(events.fd(), events.event_set()),
            t => warn!("vsock: event with unknown token {t}"),
        }
        self.pump();
        self.sync(ops);
    }
}
