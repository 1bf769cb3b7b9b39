//! The device event loop: one thread running an `event_manager::EventManager`
//! that serves every device's queue, backend and timer events.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use event_manager::{EventManager, EventOps, Events, MutEventSubscriber, SubscriberOps};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::vcpu::{ExitReason, ExitSignal};

pub type Subscriber = Arc<Mutex<dyn MutEventSubscriber + Send>>;
pub type Manager = EventManager<Subscriber>;

/// Ends the loop when its eventfd is written.
struct Stopper {
    evt: EventFd,
    stop: Arc<AtomicBool>,
}

impl MutEventSubscriber for Stopper {
    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        let _ = self.evt.read();
        self.stop.store(true, Ordering::SeqCst);
    }
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(&self.evt, EventSet::IN)) {
            log::error!("event loop: cannot watch the stop event: {e:?}");
        }
    }
}

/// Turns a device's "reset requested" eventfd (the i8042's) into a VM exit.
pub struct ResetWatcher {
    pub evt: EventFd,
    pub exit: Arc<ExitSignal>,
}

impl MutEventSubscriber for ResetWatcher {
    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        let _ = self.evt.read();
        self.exit.set(ExitReason::Reset);
    }
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(&self.evt, EventSet::IN)) {
            log::error!("event loop: cannot watch the reset event: {e:?}");
        }
    }
}

/// Parks the event-loop thread inside its own dispatch until released, so no
/// device runs while the VM's state is captured. Parks are numbered: a park
/// that comes after its pause gave up is released at once (the pause sent its
/// release then), and late answers are told apart from current ones.
struct Parker {
    evt: EventFd,
    requests: Receiver<u64>,
    release: Receiver<u64>,
    parked: Sender<u64>,
}

impl MutEventSubscriber for Parker {
    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        let _ = self.evt.read();
        // Requests may have coalesced in the eventfd: serve the latest.
        let Some(seq) = self.requests.try_iter().last() else {
            return;
        };
        if self.parked.send(seq).is_ok() {
            // Blocks this thread (and so every device) until this park's
            // release (or a later one), or until the loop stops (the
            // release sender is dropped).
            while let Ok(r) = self.release.recv() {
                if r >= seq {
                    break;
                }
            }
        }
    }
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(&self.evt, EventSet::IN)) {
            log::error!("event loop: cannot watch the park event: {e:?}");
        }
    }
}

/// Feeds the VMM's standard input to the guest's serial port (console input).
/// Stops watching at end of file or on a read error.
pub struct StdinToSerial {
    pub serial: Arc<Mutex<devices::legacy::Serial>>,
}

impl MutEventSubscriber for StdinToSerial {
    fn process(&mut self, events: Events, ops: &mut EventOps) {
        use std::io::Read;
        let mut buf = [0u8; 64];
        match std::io::stdin().lock().read(&mut buf) {
            Ok(n) if n > 0 => {
                // The UART holds 64 bytes; what does not fit is dropped, as a
                // real UART drops bytes its guest does not read.
                devices::bus::lock(&self.serial).enqueue_input(&buf[..n]);
            }
            _ => {
                let _ = ops.remove(events);
            }
        }
    }
    fn init(&mut self, ops: &mut EventOps) {
        let stdin = std::io::stdin();
        if let Err(e) = ops.add(Events::new(&stdin, EventSet::IN)) {
            log::warn!("console: cannot watch standard input: {e:?}");
        }
    }
}

pub struct EventLoop {
    stop_evt: EventFd,
    park_evt: EventFd,
    park_requests: Sender<u64>,
    /// `None` once stopping: the parker's `recv` then fails at once.
    release: Option<Sender<u64>>,
    parked_ack: Receiver<u64>,
    /// Number of the last park asked for.
    park_seq: u64,
    parked: bool,
    /// How long [`EventLoop::pause`] waits for the loop to park.
    park_timeout: Duration,
    thread: Option<JoinHandle<()>>,
}

#[derive(Debug, thiserror::Error)]
#[error("The device event loop did not park within {0:?}")]
pub struct ParkTimeout(Duration);

impl EventLoop {
    /// Runs `em` on a new thread until [`EventLoop::stop`].
    pub fn start(mut em: Manager) -> io::Result<Self> {
        let stop_evt = EventFd::new(EFD_NONBLOCK)?;
        let stop = Arc::new(AtomicBool::new(false));
        em.add_subscriber(Arc::new(Mutex::new(Stopper {
            evt: stop_evt.try_clone()?,
            stop: stop.clone(),
        })));
        let park_evt = EventFd::new(EFD_NONBLOCK)?;
        let (release, release_rx) = mpsc::channel();
        let (parked_tx, parked_ack) = mpsc::channel();
        let (park_requests, requests) = mpsc::channel();
        em.add_subscriber(Arc::new(Mutex::new(Parker {
            evt: park_evt.try_clone()?,
            requests,
            release: release_rx,
            parked: parked_tx,
        })));
        let thread = std::thread::Builder::new()
            .name("sprout-events".into())
            .spawn(move || {
                crate::thread_hook::thread_started(crate::thread_hook::ThreadKind::Events);
                while !stop.load(Ordering::SeqCst) {
                    if let Err(e) = em.run() {
                        log::error!("event loop: {e:?}");
                        break;
                    }
                }
            })?;
        Ok(Self {
            stop_evt,
            park_evt,
            park_requests,
            release: Some(release),
            parked_ack,
            park_seq: 0,
            parked: false,
            park_timeout: Duration::from_secs(5),
            thread: Some(thread),
        })
    }

    /// Returns once the event-loop thread is parked: no device event runs
    /// until [`EventLoop::resume`]. If it does not park in time, the park is
    /// released in advance, so one that comes later does not freeze the
    /// devices.
    pub fn pause(&mut self) -> Result<(), ParkTimeout> {
        if self.parked || self.thread.is_none() {
            return Ok(());
        }
        let t = self.park_timeout;
        self.park_seq += 1;
        let seq = self.park_seq;
        let _ = self.park_requests.send(seq);
        let _ = self.park_evt.write(1);
        let deadline = Instant::now() + t;
        loop {
            match self
                .parked_ack
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                // A park that came too late for an earlier pause (released already).
                Ok(n) if n < seq => continue,
                Ok(_) => {
                    self.parked = true;
                    return Ok(());
                }
                Err(_) => {
                    self.send_release();
                    return Err(ParkTimeout(t));
                }
            }
        }
    }

    fn send_release(&self) {
        if let Some(r) = &self.release {
            let _ = r.send(self.park_seq);
        }
    }

    pub fn resume(&mut self) {
        if self.parked {
            self.send_release();
            self.parked = false;
        }
    }

    /// Asks the loop to end without waiting ([`EventLoop::join_until`]
    /// collects it). Also closes the park release: a park that came too late
    /// for a timed-out [`EventLoop::pause`] then never blocks the thread.
    pub fn request_stop(&mut self) {
        self.resume();
        self.release = None;
        if self.thread.is_some() {
            let _ = self.stop_evt.write(1);
        }
    }

    /// Joins the loop thread if it ends by `deadline`; otherwise detaches it
    /// (a device dispatch that never returns) and returns false.
    pub fn join_until(&mut self, deadline: Instant) -> bool {
        let Some(t) = self.thread.take() else {
            return true;
        };
        while !t.is_finished() {
            if Instant::now() >= deadline {
                log::error!("the device event loop did not exit in time: abandoning it");
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = t.join();
        true
    }

    /// Ends the loop and joins it, giving up after five seconds.
    pub fn stop(&mut self) -> bool {
        self.request_stop();
        self.join_until(Instant::now() + Duration::from_secs(5))
    }
}

impl Drop for EventLoop {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Holds the loop inside its dispatch until `gate` says go.
    struct Blocker {
        evt: EventFd,
        gate: Receiver<()>,
    }

    impl MutEventSubscriber for Blocker {
        fn process(&mut self, _events: Events, _ops: &mut EventOps) {
            let _ = self.evt.read();
            let _ = self.gate.recv();
        }
        fn init(&mut self, ops: &mut EventOps) {
            ops.add(Events::new(&self.evt, EventSet::IN)).unwrap();
        }
    }

    struct Counter {
        evt: EventFd,
        hits: Arc<AtomicUsize>,
    }

    impl MutEventSubscriber for Counter {
        fn process(&mut self, _events: Events, _ops: &mut EventOps) {
            let _ = self.evt.read();
            self.hits.fetch_add(1, Ordering::SeqCst);
        }
        fn init(&mut self, ops: &mut EventOps) {
            ops.add(Events::new(&self.evt, EventSet::IN)).unwrap();
        }
    }

    fn hits_reach(hits: &AtomicUsize, n: usize, within: Duration) -> bool {
        let end = Instant::now() + within;
        while Instant::now() < end {
            if hits.load(Ordering::SeqCst) >= n {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    }

    /// A park that comes after its pause timed out must not freeze every
    /// device; a later pause and resume still work.
    #[test]
    fn a_park_after_a_timed_out_pause_does_not_block_the_loop() {
        let mut em = Manager::new().unwrap();
        let block = EventFd::new(EFD_NONBLOCK).unwrap();
        let (gate, gate_rx) = mpsc::channel();
        em.add_subscriber(Arc::new(Mutex::new(Blocker {
            evt: block.try_clone().unwrap(),
            gate: gate_rx,
        })));
        let count = EventFd::new(EFD_NONBLOCK).unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        em.add_subscriber(Arc::new(Mutex::new(Counter {
            evt: count.try_clone().unwrap(),
            hits: hits.clone(),
        })));
        let mut el = EventLoop::start(em).unwrap();
        el.park_timeout = Duration::from_millis(100);
        block.write(1).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(el.pause().is_err(), "parked while a dispatch held the loop");
        gate.send(()).unwrap();
        count.write(1).unwrap();
        assert!(
            hits_reach(&hits, 1, Duration::from_secs(2)),
            "the late park froze the loop"
        );
        el.park_timeout = Duration::from_secs(5);
        el.pause().unwrap();
        count.write(1).unwrap();
        assert!(
            !hits_reach(&hits, 2, Duration::from_millis(100)),
            "ran while parked"
        );
        el.resume();
        assert!(hits_reach(&hits, 2, Duration::from_secs(2)), "not resumed");
        assert!(el.stop());
    }
}
