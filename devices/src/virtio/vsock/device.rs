//! The virtio-vsock device: config space, the three queues, and moving packets between
//! the queues and the [`Muxer`].

use std::num::Wrapping;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use log::{debug, warn};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::timerfd::TimerFd;

use super::muxer::Muxer;
use super::packet::{self, WritableChain, EVENT_TRANSPORT_RESET, HDR_SIZE};
use super::{VsockError, MAX_PKT_DATA, QUEUE_SIZE};
use crate::virtio::chain::Table;
use crate::virtio::multi_queue::{self, Active};
use crate::virtio::{
    ActivateError, GuestMemoryMmap, Interrupt, VirtioDevice, VirtioDeviceState, INT_VRING,
    MAX_CHAINS_PER_DISPATCH, TYPE_VSOCK, VIRTIO_F_VERSION_1,
};

pub(super) const RXQ: usize = 0;
pub(super) const TXQ: usize = 1;
pub(super) const EVQ: usize = 2;
const QUEUE_SIZES: [u16; 3] = [QUEUE_SIZE; 3];
/// Most tx chains handled per event-loop turn; the device kicks itself for the rest.
const TX_BATCH: usize = QUEUE_SIZE as usize;
/// Period of the timer that enforces connection deadlines, while any exist.
const TICK: Duration = Duration::from_millis(250);
/// Longest wait for the guest to handle a transport reset before host
/// connects go through anyway.
pub const RESET_ACK_TIMEOUT: Duration = Duration::from_secs(5);

/// A virtio-vsock device (id 19) whose host side is the Unix socket `uds_path`.
///
/// Register it with the event manager (it is an `event_manager::MutEventSubscriber`):
/// its `init` watches the queue eventfds, the listener and two internal fds.
pub struct Vsock {
    guest_cid: u64,
    uds_path: PathBuf,
    pub(super) muxer: Muxer,
    queue_evts: Vec<EventFd>,
    interrupt: Interrupt,
    /// Wakes the event loop for work queued outside it (reset, activation, more tx).
    pub(super) kick: EventFd,
    pub(super) timer: TimerFd,
    pub(super) timer_armed: bool,
    pub(super) tick: Duration,
    active: Option<Active>,
    pub(super) acked_features: u64,
    pub(super) needs_reset: bool,
    pub(super) reset_event_pending: bool,
    /// While host connects are held after a transport reset: when to stop
    /// waiting for the guest, and (once the event is delivered) the event
    /// queue's avail index then: a guest posts a new event buffer once it has
    /// handled the event.
    reset_ack: Option<(Option<Wrapping<u16>>, Instant)>,
    /// Set by `Persist::restore` until the transport re-activates the device.
    pub(super) restored: Option<VirtioDeviceState>,
    scratch: Vec<u8>,
}

impl Vsock {
    /// A device for guest CID `guest_cid` (3 to 2^32 - 2) listening on `uds_path`,
    /// which must not exist yet. Dropping the device removes the socket file.
    pub fn new(guest_cid: u64, uds_path: PathBuf) -> Result<Self, VsockError> {
        if !(3..u64::from(u32::MAX)).contains(&guest_cid) {
            return Err(VsockError::InvalidCid(guest_cid));
        }
        let evt = || EventFd::new(EFD_NONBLOCK).map_err(VsockError::EventFd);
        let queue_evts = vec![evt()?, evt()?, evt()?];
        let kick = evt()?;
        let interrupt = Interrupt::new().map_err(VsockError::EventFd)?;
        let timer = TimerFd::new().map_err(|e| VsockError::Timer(e.into()))?;
        if uds_path.symlink_metadata().is_ok() {
            return Err(VsockError::PathExists(uds_path));
        }
        let listener = match UnixListener::bind(&uds_path) {
            Ok(l) => l,
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                return Err(VsockError::PathExists(uds_path))
            }
            Err(source) => {
                return Err(VsockError::Bind {
                    path: uds_path,
                    source,
                })
            }
        };
        if let Err(source) = listener.set_nonblocking(true) {
            let _ = std::fs::remove_file(&uds_path);
            return Err(VsockError::Bind {
                path: uds_path,
                source,
            });
        }
        Ok(Self {
            guest_cid,
            muxer: Muxer::new(guest_cid, uds_path.clone(), listener),
            uds_path,
            queue_evts,
            interrupt,
            kick,
            timer,
            timer_armed: false,
            tick: TICK,
            active: None,
            acked_features: 0,
            needs_reset: false,
            reset_event_pending: false,
            reset_ack: None,
            restored: None,
            scratch: vec![0; MAX_PKT_DATA as usize],
        })
    }

    pub fn guest_cid(&self) -> u64 {
        self.guest_cid
    }

    pub fn uds_path(&self) -> &Path {
        &self.uds_path
    }

    /// Sets the connection budget (see [`super::DEFAULT_MAX_CONNECTIONS`]),
    /// kept within `1..=`[`super::MAX_CONNECTIONS`].
    pub fn set_max_connections(&mut self, n: usize) {
        self.muxer.limits.max_conns = n.clamp(1, super::MAX_CONNECTIONS);
    }

    /// Features the driver acknowledged at activation.
    pub fn acked_features(&self) -> u64 {
        self.acked_features
    }

    /// Tells the guest its transport was reset (VIRTIO_VSOCK_EVENT_TRANSPORT_RESET, e.g.
    /// after a snapshot restore) and drops every connection, closing their host streams.
    /// The event waits for an event-queue buffer if there is none yet.
    /// Host connects wait until the guest has handled the event (at most
    /// [`RESET_ACK_TIMEOUT`]), so that none is made before the guest's reset and
    /// silently dropped by it.
    /// A device the guest has not set up yet (restored from a snapshot taken
    /// before its driver did) has no connections and no event queue: nothing
    /// waits, the driver starts fresh when it activates the device. (A pending
    /// event on an inactive device would make its next snapshot one that no
    /// restore accepts.)
    pub fn send_transport_reset(&mut self) {
        self.muxer.clear();
        if !self.is_activated() {
            return;
        }
        self.muxer.hold();
        self.reset_ack = Some((None, Instant::now() + RESET_ACK_TIMEOUT));
        self.reset_event_pending = true;
        if self.process_evt() {
            self.signal();
        }
        self.wake();
    }

    #[cfg(test)]
    pub(super) fn set_limits(&mut self, limits: super::muxer::Limits, tick: Duration) {
        self.muxer.limits = limits;
        self.tick = tick;
    }

    /// Wakes the event loop so that it applies queued work.
    pub(super) fn wake(&self) {
        if let Err(e) = self.kick.write(1) {
            warn!("vsock: cannot wake the event loop: {e}");
        }
    }

    fn signal(&self) {
        if let Err(e) = self.interrupt.trigger(INT_VRING) {
            warn!("vsock: cannot raise the interrupt: {e}");
        }
    }

    /// Moves packets: guest tx to the muxer, muxer to guest rx, pending events.
    pub(super) fn pump(&mut self) {
        if self.active.is_none() || self.needs_reset {
            return;
        }
        self.check_reset_ack();
        let mut notify = self.process_tx();
        notify |= self.process_rx();
        notify |= self.process_evt();
        if notify {
            self.signal();
        }
    }

    /// Checks that queue `i` can be used: false if it is not set up; a broken one
    /// marks the device as needing a reset.
    fn queue_usable(&mut self, i: usize) -> bool {
        multi_queue::queue_usable(self.active.as_mut(), i, &mut self.needs_reset, "vsock")
    }

    /// Marks `head` of queue `i` used; true if the driver wants an interrupt.
    fn add_used(&mut self, i: usize, head: u16, len: u32) -> bool {
        let a = self.active.as_mut();
        multi_queue::add_used(a, i, (head, len), &mut self.needs_reset, "vsock")
    }

    /// Handles the packets the driver sent; true if an interrupt is due.
    fn process_tx(&mut self) -> bool {
        if !self.queue_usable(TXQ) {
            return false;
        }
        let mut notify = false;
        for _ in 0..TX_BATCH {
            let Some(a) = self.active.as_mut() else {
                break;
            };
            let table = Table::of(&a.queues[TXQ]);
            let Some(chain) = a.queues[TXQ].pop_descriptor_chain(&a.mem) else {
                return notify;
            };
            let head = chain.head_index();
            match packet::read_tx(chain, table) {
                Ok(p) => self.muxer.handle_tx(&p.hdr, &p.data),
                Err(e) => {
                    debug!("vsock: bad tx packet: {e}");
                    if let Some(hdr) = e.header() {
                        self.muxer.reject(hdr);
                    }
                }
            }
            notify |= self.add_used(TXQ, head, 0);
            if self.needs_reset {
                return notify;
            }
        }
        // The batch is done and the driver may have more.
        self.wake();
        notify
    }

    /// Fills the driver's rx buffers with pending packets, at most
    /// [`MAX_CHAINS_PER_DISPATCH`] of them (then the device kicks itself for the rest);
    /// true if an interrupt is due.
    fn process_rx(&mut self) -> bool {
        if !self.muxer.has_rx() || !self.queue_usable(RXQ) {
            return false;
        }
        let mut notify = false;
        let mut taken = 0;
        while self.muxer.has_rx() && !self.needs_reset {
            if taken == MAX_CHAINS_PER_DISPATCH {
                self.wake();
                break;
            }
            let Some(a) = self.active.as_mut() else {
                break;
            };
            let table = Table::of(&a.queues[RXQ]);
            let Some(chain) = a.queues[RXQ].pop_descriptor_chain(&a.mem) else {
                break;
            };
            taken += 1;
            let head = chain.head_index();
            let buf = match WritableChain::new(chain, table, HDR_SIZE) {
                Ok(b) => b,
                Err(e) => {
                    debug!("vsock: bad rx buffer: {e}");
                    notify |= self.add_used(RXQ, head, 0);
                    continue;
                }
            };
            let Some((hdr, n)) = self.muxer.next_rx(buf.data_capacity(), &mut self.scratch) else {
                a.queues[RXQ].go_to_previous_position();
                break;
            };
            let len = buf
                .write(&a.mem, &[&hdr.to_bytes(), &self.scratch[..n]])
                .unwrap_or_else(|e| {
                    warn!("vsock: cannot write an rx packet: {e}");
                    0
                });
            notify |= self.add_used(RXQ, head, len);
        }
        notify
    }

    /// Releases held host connects once the guest posted a new event buffer
    /// after the reset event (it handled the event), or the wait timed out.
    pub(super) fn check_reset_ack(&mut self) {
        // Set with the muxer's hold, and cleared with it (here, or by a reset).
        let Some((seen, deadline)) = self.reset_ack else {
            return;
        };
        let acked = seen.is_some_and(|seen| {
            self.active.as_ref().is_some_and(|a| {
                a.queues[EVQ]
                    .avail_idx(&a.mem, std::sync::atomic::Ordering::Acquire)
                    .is_ok_and(|idx| idx != seen)
            })
        });
        let late = Instant::now() >= deadline;
        if acked || late {
            if !acked {
                warn!("vsock: the guest did not handle the transport reset in time; letting host connects through");
            }
            self.reset_ack = None;
            self.muxer.release();
        }
    }

    /// Delivers a pending transport-reset event, skipping at most
    /// [`MAX_CHAINS_PER_DISPATCH`] bad buffers (then the device kicks itself for the
    /// rest); true if an interrupt is due.
    fn process_evt(&mut self) -> bool {
        if !self.reset_event_pending || !self.queue_usable(EVQ) {
            return false;
        }
        let mut notify = false;
        let mut taken = 0;
        while self.reset_event_pending && !self.needs_reset {
            if taken == MAX_CHAINS_PER_DISPATCH {
                self.wake();
                break;
            }
            let Some(a) = self.active.as_mut() else {
                break;
            };
            let table = Table::of(&a.queues[EVQ]);
            let Some(chain) = a.queues[EVQ].pop_descriptor_chain(&a.mem) else {
                break;
            };
            taken += 1;
            let head = chain.head_index();
            let id = EVENT_TRANSPORT_RESET.to_le_bytes();
            let len = match WritableChain::new(chain, table, id.len()) {
                Ok(buf) => match buf.write(&a.mem, &[&id]) {
                    Ok(n) => {
                        self.reset_event_pending = false;
                        let seen = a.queues[EVQ]
                            .avail_idx(&a.mem, std::sync::atomic::Ordering::Acquire)
                            .unwrap_or_default();
                        if let Some((at, _)) = &mut self.reset_ack {
                            *at = Some(seen);
                        }
                        n
                    }
                    Err(e) => {
                        warn!("vsock: cannot write an event: {e}");
                        0
                    }
                },
                Err(e) => {
                    debug!("vsock: bad event buffer: {e}");
                    0
                }
            };
            notify |= self.add_used(EVQ, head, len);
        }
        notify
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        TYPE_VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1
    }

    /// `struct virtio_vsock_config { le64 guest_cid; }`.
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let config = self.guest_cid.to_le_bytes();
        for (i, b) in data.iter_mut().enumerate() {
            *b = offset
                .checked_add(i as u64)
                .and_then(|o| usize::try_from(o).ok())
                .and_then(|o| config.get(o).copied())
                .unwrap_or(0);
        }
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        acked_features: u64,
        queues: Vec<Queue>,
    ) -> Result<(), ActivateError> {
        if queues.len() != QUEUE_SIZES.len() {
            return Err(ActivateError::QueueCount {
                expected: QUEUE_SIZES.len(),
                got: queues.len(),
            });
        }
        self.acked_features = acked_features;
        self.active = Some(Active { mem, queues });
        // needs_reset is false here unless a restore brought it back.
        self.restored = None;
        self.wake();
        Ok(())
    }

    fn reset(&mut self) {
        self.active = None;
        self.acked_features = 0;
        self.needs_reset = false;
        self.restored = None;
        self.reset_event_pending = false;
        self.reset_ack = None;
        self.muxer.clear();
        self.wake();
    }

    fn queue_events(&self) -> &[EventFd] {
        &self.queue_evts
    }

    fn interrupt(&self) -> &Interrupt {
        &self.interrupt
    }

    fn needs_reset(&self) -> bool {
        self.needs_reset
    }

    fn is_activated(&self) -> bool {
        self.active.is_some()
    }

    fn active_queues(&self) -> &[Queue] {
        self.active.as_ref().map_or(&[], |a| &a.queues)
    }

    fn restored_state(&self) -> Option<VirtioDeviceState> {
        self.restored
    }
}

impl Drop for Vsock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.uds_path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::tempdir::TempDir;

    #[test]
    fn new_checks_cid_and_path() {
        let dir = TempDir::new().unwrap();
        let path = dir.as_path().join("v.sock");
        for cid in [0, 1, 2, u64::from(u32::MAX), u64::MAX] {
            assert!(matches!(
                Vsock::new(cid, path.clone()),
                Err(VsockError::InvalidCid(c)) if c == cid
            ));
        }
        let dev = Vsock::new(3, path.clone()).unwrap();
        assert!(path.exists());
        assert!(matches!(
            Vsock::new(4, path.clone()),
            Err(VsockError::PathExists(_))
        ));
        assert!(matches!(
            Vsock::new(4, dir.as_path().join("missing/v.sock")),
            Err(VsockError::Bind { .. })
        ));
        drop(dev);
        assert!(!path.exists());
    }

    #[test]
    fn config_features_and_queues() {
        let dir = TempDir::new().unwrap();
        let dev = Vsock::new(0xfedc_ba98, dir.as_path().join("v.sock")).unwrap();
        assert_eq!(dev.device_type(), 19);
        assert_eq!(dev.avail_features(), VIRTIO_F_VERSION_1);
        assert_eq!(dev.queue_max_sizes(), &[256, 256, 256]);
        assert_eq!(dev.queue_events().len(), 3);
        let mut b = [0xffu8; 8];
        dev.read_config(0, &mut b);
        assert_eq!(u64::from_le_bytes(b), 0xfedc_ba98);
        let mut b = [0xffu8; 4];
        dev.read_config(1, &mut b);
        assert_eq!(u32::from_le_bytes(b), 0x00fe_dcba);
        dev.read_config(6, &mut b);
        assert_eq!(b, [0, 0, 0, 0]);
        dev.read_config(u64::MAX, &mut b);
        assert_eq!(b, [0, 0, 0, 0]);
    }

    #[test]
    fn activate_needs_three_queues() {
        let dir = TempDir::new().unwrap();
        let mut dev = Vsock::new(3, dir.as_path().join("v.sock")).unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(vm_memory::GuestAddress(0), 0x1_0000)]).unwrap();
        let q = || Queue::new(QUEUE_SIZE).unwrap();
        assert!(matches!(
            dev.activate(mem.clone(), VIRTIO_F_VERSION_1, vec![q(), q()]),
            Err(ActivateError::QueueCount {
                expected: 3,
                got: 2
            })
        ));
        assert!(!dev.is_activated());
        dev.activate(mem, VIRTIO_F_VERSION_1, vec![q(), q(), q()])
            .unwrap();
        assert!(dev.is_activated());
        // Queues that were never set up are not used, and not an error.
        dev.pump();
        assert!(!dev.needs_reset());
        dev.reset();
        assert!(!dev.is_activated());
    }
}
