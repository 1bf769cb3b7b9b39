//! Saving and restoring a [`Vsock`] device: its CID, features and a pending
//! transport-reset event; never its connections (see the module docs of `vsock`).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::device::Vsock;
use super::VsockError;
use crate::state::{check_version, versions, Persist, StateError};
use crate::virtio::{VirtioDevice, VirtioDeviceState};

const WHAT: &str = "virtio-vsock";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockState {
    pub version: u16,
    pub guest_cid: u64,
    pub virtio: VirtioDeviceState,
    /// A transport-reset event was waiting for an event-queue buffer.
    pub reset_event_pending: bool,
}

impl Persist for Vsock {
    type State = VsockState;
    /// Where the restored device's host side listens.
    type RestoreArgs = PathBuf;

    /// The device's state; call it between event-loop dispatches. Connections are not
    /// part of it: what they had buffered is lost with them.
    fn save(&self) -> VsockState {
        VsockState {
            version: versions::VSOCK,
            guest_cid: self.guest_cid(),
            virtio: VirtioDeviceState {
                activated: self.is_activated(),
                acked_features: self.acked_features,
                needs_reset: self.needs_reset,
            },
            reset_event_pending: self.reset_event_pending,
        }
    }

    /// A new device in `state`, with no connections, listening on `uds_path` (which
    /// must not exist, as for [`Vsock::new`]), for the transport's restore to
    /// re-activate with the saved queues. Call [`Vsock::send_transport_reset`] once the
    /// VM runs so that the guest drops the connections it had.
    fn restore(uds_path: PathBuf, state: &VsockState) -> Result<Self, StateError> {
        check_version(WHAT, state.version, versions::VSOCK)?;
        let mut dev = Self::new(state.guest_cid, uds_path).map_err(|e| match e {
            VsockError::InvalidCid(cid) => {
                StateError::invalid(WHAT, format!("guest CID {cid} is out of range"))
            }
            e => StateError::rebuild(WHAT, e),
        })?;
        state.virtio.validate(WHAT, dev.avail_features())?;
        if state.reset_event_pending && !state.virtio.activated {
            return Err(StateError::invalid(
                WHAT,
                "an inactive device has a pending event",
            ));
        }
        dev.needs_reset = state.virtio.needs_reset;
        dev.reset_event_pending = state.reset_event_pending;
        dev.restored = Some(state.virtio);
        Ok(dev)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use virtio_bindings::bindings::virtio_ring::VRING_DESC_F_WRITE;
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};
    use vm_memory::{Bytes, GuestAddress};
    use vmm_sys_util::tempdir::TempDir;

    use super::super::device::{EVQ, RXQ, TXQ};
    use super::super::packet::*;
    use super::super::HOST_CID;
    use super::*;
    use crate::bus::lock;
    use crate::state::{copy_guest_memory, postcard_round_trip};
    use crate::virtio::mmio::{MmioRestoreArgs, MmioTransport};
    use crate::virtio::test_ring::Ring;
    use crate::virtio::{GuestMemoryMmap, VIRTIO_F_VERSION_1};

    const CID: u64 = 77;
    const QSIZE: u16 = 16;
    const BUFS: u64 = 0x4_0000;

    fn queue(q: usize) -> Ring {
        Ring::at(q as u64 * 0x1000, QSIZE)
    }

    /// Buffer address of table slot `slot` of queue `q`.
    fn buf(q: usize, slot: u16) -> u64 {
        BUFS + q as u64 * 0x1_0000 + u64::from(slot) * 0x100
    }

    /// Posts a device-writable buffer in slot `slot` of queue `q` (rx or event).
    fn post(mem: &GuestMemoryMmap, q: usize, slot: u16, len: u32) {
        let d = Descriptor::new(buf(q, slot), len, VRING_DESC_F_WRITE as u16, 0);
        queue(q).offer(mem, &[RawDescriptor::from(d)], slot);
    }

    /// Sends a connection request from guest port `port` to host port 1234 (nothing
    /// listens there, so the device answers RST), header in slots `slot`, `slot + 1`.
    fn request(mem: &GuestMemoryMmap, slot: u16, port: u32) {
        let hdr = Header {
            src_cid: CID,
            dst_cid: HOST_CID,
            src_port: port,
            dst_port: 1234,
            type_: TYPE_STREAM,
            op: OP_REQUEST,
            buf_alloc: 4096,
            ..Header::default()
        };
        let a = buf(TXQ, slot);
        mem.write_slice(&hdr.to_bytes(), GuestAddress(a)).unwrap();
        let d = Descriptor::new(a, HDR_SIZE as u32, 0, 0);
        queue(TXQ).offer(mem, &[RawDescriptor::from(d)], slot);
    }

    fn used(mem: &GuestMemoryMmap, q: usize) -> Vec<(u32, u32)> {
        queue(q).used(mem)
    }

    /// (op, guest port) of the rx packet in `slot`.
    fn rx_packet(mem: &GuestMemoryMmap, slot: u16) -> (u16, u32) {
        let mut b = [0u8; HDR_SIZE];
        mem.read_slice(&mut b, GuestAddress(buf(RXQ, slot)))
            .unwrap();
        let h = Header::from_bytes(&b);
        (h.op, h.dst_port)
    }

    #[test]
    fn state_round_trips_and_is_checked() {
        let dir = TempDir::new().unwrap();
        let path = |n: &str| dir.as_path().join(n);
        let dev = Vsock::new(CID, path("a.sock")).unwrap();
        let idle = dev.save();
        assert_eq!(idle.guest_cid, CID);
        assert_eq!(postcard_round_trip(&idle), idle);
        let mut r = Vsock::restore(path("b.sock"), &postcard_round_trip(&idle)).unwrap();
        assert_eq!(r.guest_cid(), CID);
        assert!(!r.is_activated());
        // Told of a restore before its guest set it up: no event waits, and
        // its next snapshot restores.
        r.send_transport_reset();
        let again = r.save();
        assert!(!again.reset_event_pending);
        Vsock::restore(path("b2.sock"), &again).unwrap();

        let active = VsockState {
            version: versions::VSOCK,
            guest_cid: CID,
            virtio: VirtioDeviceState {
                activated: true,
                acked_features: VIRTIO_F_VERSION_1,
                needs_reset: false,
            },
            reset_event_pending: true,
        };
        let r = Vsock::restore(path("c.sock"), &postcard_round_trip(&active)).unwrap();
        assert!(r.save().reset_event_pending);
        assert_eq!(r.restored_state(), Some(active.virtio));

        let bad = |name: &str, edit: fn(&mut VsockState)| {
            let mut s = active.clone();
            edit(&mut s);
            Vsock::restore(path(name), &s).err().unwrap()
        };
        let e = bad("d.sock", |s| s.version = 3);
        assert!(matches!(e, StateError::Version { .. }));
        assert!(matches!(
            bad("e.sock", |s| s.guest_cid = 2),
            StateError::Invalid { .. }
        ));
        bad("f.sock", |s| s.virtio.acked_features = 1);
        bad("g.sock", |s| {
            s.virtio = VirtioDeviceState::default();
        });
        // The socket path must be new, as for `Vsock::new`.
        assert!(matches!(
            Vsock::restore(path("a.sock"), &active),
            Err(StateError::Rebuild { .. })
        ));
    }

    /// A guest request is served before the snapshot, one is pending at it: after the
    /// restore only the pending one is served, and the transport reset reaches the guest
    /// through the restored event queue.
    #[test]
    fn restored_device_serves_from_where_it_was_and_delivers_the_reset() {
        let dir = TempDir::new().unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let dev = Arc::new(Mutex::new(
            Vsock::new(CID, dir.as_path().join("a.sock")).unwrap(),
        ));
        let mut t = MmioTransport::new(mem.clone(), dev.clone());
        let rings: Vec<_> = (0..3).map(|q| queue(q).transport_queue()).collect();
        t.drive_to_driver_ok(VIRTIO_F_VERSION_1, &rings);
        for slot in 0..4 {
            post(&mem, RXQ, slot, 256);
        }
        post(&mem, EVQ, 0, 8);
        request(&mem, 0, 1000);
        lock(&dev).pump();
        assert_eq!(used(&mem, TXQ), [(0, 0)]);
        assert_eq!(used(&mem, RXQ), [(0, HDR_SIZE as u32)]);
        assert_eq!(rx_packet(&mem, 0), (OP_RST, 1000));
        request(&mem, 1, 1001);

        let state = postcard_round_trip(&lock(&dev).save());
        let t_state = postcard_round_trip(&t.save());
        assert_eq!(t_state.queues[TXQ].next_avail, 1);
        assert_eq!(t_state.queues[RXQ].next_avail, 1);
        let mem2 = copy_guest_memory(&mem);
        let dev2 = Arc::new(Mutex::new(
            Vsock::restore(dir.as_path().join("b.sock"), &state).unwrap(),
        ));
        let _t2 = MmioTransport::restore(
            MmioRestoreArgs {
                mem: mem2.clone(),
                device: dev2.clone(),
            },
            &t_state,
        )
        .unwrap();

        lock(&dev2).send_transport_reset();
        let evs = used(&mem2, EVQ);
        assert_eq!(evs, [(0, 4)]);
        let mut id = [0xffu8; 4];
        mem2.read_slice(&mut id, GuestAddress(buf(EVQ, 0))).unwrap();
        assert_eq!(u32::from_le_bytes(id), EVENT_TRANSPORT_RESET);

        lock(&dev2).pump();
        assert_eq!(used(&mem2, TXQ), [(0, 0), (1, 0)]);
        assert_eq!(
            used(&mem2, RXQ),
            [(0, HDR_SIZE as u32), (1, HDR_SIZE as u32)]
        );
        assert_eq!(rx_packet(&mem2, 1), (OP_RST, 1001));
        assert_eq!(used(&mem, EVQ), [], "the old memory is untouched");
    }
}
