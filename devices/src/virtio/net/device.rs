//! The virtio-net device: config space, features, and moving frames between
//! the two queues and the TAP.

use std::io;

use log::{debug, warn};
use virtio_bindings::bindings::virtio_net::{
    VIRTIO_NET_F_CSUM, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_ECN, VIRTIO_NET_F_GUEST_TSO4,
    VIRTIO_NET_F_GUEST_TSO6, VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6, VIRTIO_NET_F_MAC,
};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestMemoryBackend};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::tap::{Tap, TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6, TUN_F_TSO_ECN};
use super::{NetError, HDR_SIZE, MAX_PACKET, QUEUE_SIZE};
use crate::virtio::chain::{self, Table};
use crate::virtio::multi_queue::{self, Active};
use crate::virtio::{
    ActivateError, GuestMemoryMmap, Interrupt, VirtioDevice, VirtioDeviceState, INT_VRING,
    MAX_CHAINS_PER_DISPATCH, TYPE_NET, VIRTIO_F_VERSION_1,
};

const RXQ: usize = 0;
const TXQ: usize = 1;
const QUEUE_SIZES: [u16; 2] = [QUEUE_SIZE; 2];

const fn bit(b: u32) -> u64 {
    1 << b
}

/// What the device offers: its MAC, and the checksum and TCP segmentation
/// offloads the TAP passes through.
const FEATURES: u64 = VIRTIO_F_VERSION_1
    | bit(VIRTIO_NET_F_MAC)
    | bit(VIRTIO_NET_F_CSUM)
    | bit(VIRTIO_NET_F_GUEST_CSUM)
    | bit(VIRTIO_NET_F_GUEST_TSO4)
    | bit(VIRTIO_NET_F_GUEST_TSO6)
    | bit(VIRTIO_NET_F_GUEST_ECN)
    | bit(VIRTIO_NET_F_HOST_TSO4)
    | bit(VIRTIO_NET_F_HOST_TSO6);

/// Counters of what went through (and what was refused).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetStats {
    pub tx_frames: u64,
    pub tx_bytes: u64,
    /// Frames the TAP could not take (its queue full, or an error).
    pub tx_dropped: u64,
    /// Transmit chains that broke the rules (returned with length 0).
    pub tx_bad_chains: u64,
    pub rx_frames: u64,
    pub rx_bytes: u64,
    /// Frames from the TAP no guest buffer could hold.
    pub rx_dropped: u64,
    /// Receive chains that broke the rules (returned with length 0).
    pub rx_bad_chains: u64,
}

/// A virtio-net device whose wire is a TAP interface.
pub struct Net {
    tap: Tap,
    mac: [u8; 6],
    queue_evts: Vec<EventFd>,
    interrupt: Interrupt,
    /// Written when a dispatch leaves work behind (its budget spent), so the
    /// event loop comes back.
    kick: EventFd,
    active: Option<Active>,
    acked_features: u64,
    needs_reset: bool,
    restored: Option<VirtioDeviceState>,
    /// A frame read from the TAP that waits for a receive buffer: its
    /// length (0: none) in `rx_buf`.
    rx_len: usize,
    rx_buf: Vec<u8>,
    tx_buf: Vec<u8>,
    stats: NetStats,
    /// Whether the event loop watches the TAP (see `event_handler`).
    pub(super) tap_watched: bool,
}

impl Net {
    /// A device with MAC `mac` (unicast) on the TAP `tap`.
    pub fn new(tap: Tap, mac: [u8; 6]) -> Result<Self, NetError> {
        if mac[0] & 1 != 0 || mac == [0; 6] {
            return Err(NetError::BadMac(mac));
        }
        let evt = || EventFd::new(EFD_NONBLOCK).map_err(NetError::EventFd);
        Ok(Self {
            tap,
            mac,
            queue_evts: vec![evt()?, evt()?],
            interrupt: Interrupt::new().map_err(NetError::EventFd)?,
            kick: evt()?,
            active: None,
            acked_features: 0,
            needs_reset: false,
            restored: None,
            rx_len: 0,
            rx_buf: vec![0; MAX_PACKET],
            tx_buf: Vec::with_capacity(MAX_PACKET),
            stats: NetStats::default(),
            tap_watched: false,
        })
    }

    pub fn tap(&self) -> &Tap {
        &self.tap
    }

    pub fn mac(&self) -> [u8; 6] {
        self.mac
    }

    pub fn stats(&self) -> NetStats {
        self.stats
    }

    /// Features the driver acknowledged at activation.
    pub fn acked_features(&self) -> u64 {
        self.acked_features
    }

    /// Marks a new device as restored in `virtio`'s state, until the
    /// transport re-activates it.
    pub(super) fn set_restored(&mut self, virtio: VirtioDeviceState) {
        self.needs_reset = virtio.needs_reset;
        self.restored = Some(virtio);
    }

    /// The eventfd a dispatch writes when it leaves work behind.
    pub fn kick_event(&self) -> &EventFd {
        &self.kick
    }

    /// Whether a frame from the TAP waits for a receive buffer (while it
    /// does, the TAP need not be watched: the next buffer the driver posts
    /// brings the device back).
    pub fn rx_pending(&self) -> bool {
        self.rx_len > 0
    }

    /// Moves frames both ways, each queue at most `MAX_CHAINS_PER_DISPATCH`
    /// chains; raises INT_VRING if the driver wants to hear of any.
    pub fn pump(&mut self) {
        if self.active.is_none() || self.needs_reset {
            return;
        }
        let mut notify = self.process_tx();
        notify |= self.process_rx();
        if notify {
            if let Err(e) = self.interrupt.trigger(INT_VRING) {
                warn!("virtio-net: cannot raise the interrupt: {e}");
            }
        }
    }

    fn wake(&self) {
        if let Err(e) = self.kick.write(1) {
            warn!("virtio-net: cannot wake the event loop: {e}");
        }
    }

    /// Whether queue `i` can be used now; a broken one marks the device as
    /// needing a reset.
    fn queue_usable(&mut self, i: usize) -> bool {
        multi_queue::queue_usable(self.active.as_mut(), i, &mut self.needs_reset, "virtio-net")
    }

    /// Marks `head` of queue `i` used; true if the driver wants an interrupt.
    fn add_used(&mut self, i: usize, head: u16, len: u32) -> bool {
        let a = self.active.as_mut();
        multi_queue::add_used(a, i, (head, len), &mut self.needs_reset, "virtio-net")
    }

    /// Sends what the driver queued to the TAP; true if an interrupt is due.
    pub(super) fn process_tx(&mut self) -> bool {
        if !self.queue_usable(TXQ) {
            return false;
        }
        let mut notify = false;
        for _ in 0..MAX_CHAINS_PER_DISPATCH {
            let Some(a) = self.active.as_mut() else {
                return notify;
            };
            let table = Table::of(&a.queues[TXQ]);
            let Some(chain) = a.queues[TXQ].pop_descriptor_chain(&a.mem) else {
                return notify;
            };
            let head = chain.head_index();
            match gather(&chain, table, &a.mem, &mut self.tx_buf) {
                Ok(()) => match self.tap.write_frame(&self.tx_buf) {
                    Ok(_) => {
                        self.stats.tx_frames += 1;
                        self.stats.tx_bytes += (self.tx_buf.len() - HDR_SIZE) as u64;
                    }
                    Err(e) => {
                        if e.kind() != io::ErrorKind::WouldBlock {
                            debug!("virtio-net: the TAP refused a frame: {e}");
                        }
                        self.stats.tx_dropped += 1;
                    }
                },
                Err(why) => {
                    debug!("virtio-net: transmit chain {head} refused: {why}");
                    self.stats.tx_bad_chains += 1;
                }
            }
            notify |= self.add_used(TXQ, head, 0);
            if self.needs_reset {
                return notify;
            }
        }
        // The budget is spent and the driver may have queued more.
        self.wake();
        notify
    }

    /// Hands the TAP's frames to the driver's receive buffers; true if an
    /// interrupt is due. A frame with no buffer to go to waits (see
    /// [`Net::rx_pending`]); one no buffer could hold is dropped.
    pub(super) fn process_rx(&mut self) -> bool {
        let mut notify = false;
        for _ in 0..MAX_CHAINS_PER_DISPATCH {
            if self.rx_len == 0 {
                match self.tap.read_frame(&mut self.rx_buf) {
                    Ok(n) if n >= HDR_SIZE => self.rx_len = n,
                    Ok(n) => {
                        debug!("virtio-net: a {n}-byte read from the TAP is not a frame");
                        self.stats.rx_dropped += 1;
                        continue;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return notify,
                    Err(e) => {
                        warn!("virtio-net: cannot read the TAP: {e}");
                        return notify;
                    }
                }
            }
            if !self.queue_usable(RXQ) {
                return notify;
            }
            let Some(a) = self.active.as_mut() else {
                return notify;
            };
            let table = Table::of(&a.queues[RXQ]);
            let Some(chain) = a.queues[RXQ].pop_descriptor_chain(&a.mem) else {
                // No buffer yet: the frame waits for the driver's next one.
                return notify;
            };
            let head = chain.head_index();
            // One buffer per frame (no mergeable buffers): num_buffers = 1.
            self.rx_buf[10..12].copy_from_slice(&1u16.to_le_bytes());
            let frame = &self.rx_buf[..self.rx_len];
            let len = match scatter(&chain, table, &a.mem, frame) {
                Ok(()) => {
                    self.stats.rx_frames += 1;
                    self.stats.rx_bytes += (frame.len() - HDR_SIZE) as u64;
                    self.rx_len = 0;
                    frame.len() as u32
                }
                Err(Scatter::TooSmall(cap)) => {
                    // The frame goes; the buffer stays the driver's, for the
                    // next frame.
                    debug!(
                        "virtio-net: receive chain {head} holds {cap} bytes, the frame {}: dropped",
                        frame.len()
                    );
                    self.stats.rx_dropped += 1;
                    self.rx_len = 0;
                    a.queues[RXQ].go_to_previous_position();
                    continue;
                }
                Err(Scatter::Bad(why)) => {
                    // The chain is given back empty; the frame waits for the
                    // next one.
                    debug!("virtio-net: receive chain {head} refused: {why}");
                    self.stats.rx_bad_chains += 1;
                    0
                }
            };
            notify |= self.add_used(RXQ, head, len);
            if self.needs_reset {
                return notify;
            }
        }
        self.wake();
        notify
    }
}

/// Why a receive chain took no frame.
enum Scatter {
    /// It holds this many bytes, fewer than the frame.
    TooSmall(u64),
    Bad(String),
}

/// Copies the frame a transmit chain holds into `out`: every descriptor
/// device-readable and in guest RAM, a header and at most [`MAX_PACKET`]
/// bytes in all.
fn gather(
    chain: &virtio_queue::DescriptorChain<&GuestMemoryMmap>,
    table: Table,
    mem: &GuestMemoryMmap,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let descs = chain::descriptors(chain, table).map_err(|e| e.to_string())?;
    let mut total = 0usize;
    for d in &descs {
        if d.is_write_only() {
            return Err("a device-writable descriptor".into());
        }
        total = total.saturating_add(d.len() as usize);
    }
    if !(HDR_SIZE..=MAX_PACKET).contains(&total) {
        return Err(format!(
            "{total} bytes: a frame is {HDR_SIZE} to {MAX_PACKET}"
        ));
    }
    out.clear();
    out.resize(total, 0);
    let mut at = 0usize;
    for d in &descs {
        let n = d.len() as usize;
        mem.read_slice(&mut out[at..at + n], d.addr())
            .map_err(|e| format!("a buffer outside guest RAM: {e}"))?;
        at += n;
    }
    Ok(())
}

/// Copies `frame` into a receive chain: every descriptor device-writable and
/// in guest RAM, and room for the whole frame.
fn scatter(
    chain: &virtio_queue::DescriptorChain<&GuestMemoryMmap>,
    table: Table,
    mem: &GuestMemoryMmap,
    frame: &[u8],
) -> Result<(), Scatter> {
    let descs = chain::descriptors(chain, table).map_err(|e| Scatter::Bad(e.to_string()))?;
    let mut cap = 0u64;
    for d in &descs {
        if !d.is_write_only() {
            return Err(Scatter::Bad("a device-readable descriptor".into()));
        }
        if !GuestMemoryBackend::check_range(mem, d.addr(), d.len() as usize) {
            return Err(Scatter::Bad("a buffer outside guest RAM".into()));
        }
        cap += u64::from(d.len());
    }
    if cap < frame.len() as u64 {
        return Err(Scatter::TooSmall(cap));
    }
    let mut left = frame;
    for d in &descs {
        if left.is_empty() {
            break;
        }
        let n = left.len().min(d.len() as usize);
        mem.write_slice(&left[..n], d.addr())
            .map_err(|e| Scatter::Bad(e.to_string()))?;
        left = &left[n..];
    }
    Ok(())
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        TYPE_NET
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn avail_features(&self) -> u64 {
        FEATURES
    }

    /// The config space: the MAC (6 bytes); what follows reads as zero.
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        for (i, b) in data.iter_mut().enumerate() {
            let at = offset.saturating_add(i as u64);
            if at < 6 {
                *b = self.mac[at as usize];
            }
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
        // The TAP hands on only what the driver took.
        let mut offload = 0;
        for (feature, flag) in [
            (VIRTIO_NET_F_GUEST_CSUM, TUN_F_CSUM),
            (VIRTIO_NET_F_GUEST_TSO4, TUN_F_TSO4),
            (VIRTIO_NET_F_GUEST_TSO6, TUN_F_TSO6),
            (VIRTIO_NET_F_GUEST_ECN, TUN_F_TSO_ECN),
        ] {
            if acked_features & bit(feature) != 0 {
                offload |= flag;
            }
        }
        if offload & TUN_F_CSUM == 0 {
            // Segments need checksum offload: without it, none.
            offload = 0;
        }
        self.tap
            .set_offload(offload)
            .map_err(ActivateError::Backend)?;
        self.restored = None;
        self.acked_features = acked_features;
        self.active = Some(Active { mem, queues });
        // Chains may already wait (after a restore the driver's notify went
        // to another process): look once.
        self.wake();
        Ok(())
    }

    fn reset(&mut self) {
        self.active = None;
        self.acked_features = 0;
        self.needs_reset = false;
        self.restored = None;
        self.rx_len = 0;
        self.interrupt.clear();
        for e in &self.queue_evts {
            let _ = e.read();
        }
        let _ = self.kick.read();
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
