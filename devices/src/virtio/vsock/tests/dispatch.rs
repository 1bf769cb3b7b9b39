//! A guest that keeps a queue busy gets a bounded share of each dispatch, and
//! descriptor chains are walked only as far as the negotiated features allow.

use super::*;
use crate::virtio::MAX_CHAINS_PER_DISPATCH;
use virtio_bindings::bindings::virtio_ring::VRING_DESC_F_INDIRECT;

/// More bad buffers than one dispatch takes, but at most 128 chains on a queue (the
/// limit for `MockSplitQueue`'s 256-entry rings, whose used ring overlaps avail
/// entries 128-255).
const FLOOD: usize = 100;
const _: () = assert!(FLOOD > MAX_CHAINS_PER_DISPATCH && FLOOD <= 128);

/// Runs one pump with the self-kick drained first; whether it kicked itself again
/// (the kick is left for the event loop).
fn pump_once(h: &H) -> bool {
    let mut dev = lock(&h.dev);
    let _ = dev.kick.read();
    dev.pump();
    let kicked = dev.kick.read().is_ok();
    if kicked {
        dev.wake();
    }
    kicked
}

#[test]
fn rx_dispatch_is_bounded_and_rekicks_with_work_left() {
    let mut h = H::with(Limits::default(), TICK, 0);
    let bad = h.g.alloc(64);
    for _ in 0..FLOOD {
        h.g.push(RXQ, &[(bad, 64, false)]);
    }
    // A refused request: its RST waits in the muxer while bad rx buffers are skipped.
    h.send(pkt(OP_REQUEST, 1004, 4444), &[]);
    assert!(pump_once(&h), "no re-kick with rx work left");
    assert_eq!(h.g.used(RXQ).len(), MAX_CHAINS_PER_DISPATCH);
    // The event loop comes back for the rest.
    h.run_idle();
    assert_eq!(h.g.used(RXQ).len(), FLOOD - MAX_CHAINS_PER_DISPATCH);
    assert!(!lock(&h.dev).needs_reset());
}

#[test]
fn event_dispatch_is_bounded_and_rekicks_with_work_left() {
    let mut h = H::with(Limits::default(), TICK, 0);
    // No event buffer yet: the reset event waits.
    lock(&h.dev).send_transport_reset();
    let bad = h.g.alloc(8);
    for _ in 0..FLOOD {
        h.g.push(EVQ, &[(bad, 8, false)]);
    }
    assert!(pump_once(&h), "no re-kick with event work left");
    assert_eq!(h.g.used(EVQ).len(), MAX_CHAINS_PER_DISPATCH);
    h.run_idle();
    assert_eq!(h.g.used(EVQ).len(), FLOOD - MAX_CHAINS_PER_DISPATCH);
    // A good buffer still gets the event.
    h.add_event_buffer();
    h.settle();
    assert_eq!(
        h.events,
        vec![(4, EVENT_TRANSPORT_RESET.to_le_bytes().to_vec())]
    );
}

/// VIRTIO_F_INDIRECT_DESC is never offered: a tx chain through an indirect table is a
/// bad packet (not followed, so a guest cannot hand over 65,535 descriptors in one).
#[test]
fn indirect_tx_chains_are_refused() {
    let mut h = H::with(Limits::default(), TICK, 8);
    assert_eq!(
        lock(&h.dev).avail_features() & crate::virtio::VIRTIO_F_INDIRECT_DESC,
        0,
        "INDIRECT_DESC offered"
    );
    // A refused request (answered with an RST when it is read), behind an indirect
    // descriptor.
    let mut hdr = pkt(OP_REQUEST, 1004, 4444);
    hdr.len = 0;
    let a = h.g.alloc(HDR_SIZE as u64);
    h.g.mem
        .write_slice(&hdr.to_bytes(), GuestAddress(a))
        .unwrap();
    let table = h.g.alloc(16);
    let inner = RawDescriptor::from(Descriptor::new(a, HDR_SIZE as u32, 0, 0));
    h.g.mem.write_obj(inner, GuestAddress(table)).unwrap();
    let outer = RawDescriptor::from(Descriptor::new(table, 16, VRING_DESC_F_INDIRECT as u16, 0));
    let slot = h.g.next_desc[TXQ];
    h.g.push_raw(TXQ, &[outer], slot);
    h.g.next_desc[TXQ] += 1;
    h.notify(TXQ);
    h.expect_quiet();
    assert_eq!(h.g.used(TXQ), vec![(slot, 0)]);
    assert!(!lock(&h.dev).needs_reset());
    // The same request sent directly is answered.
    h.send(hdr, &[]);
    h.expect_op(OP_RST);
}
