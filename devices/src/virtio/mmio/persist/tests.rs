//! Transport save/restore against the recording dummy device of the transport tests.

use std::sync::{Arc, Mutex};

use vm_memory::GuestAddress;

use super::super::tests::{
    dummy, rd, setup, setup_queue, to_features_ok, wr, Dummy, Record, ALL_OK, FEATURE_LOW,
};
use super::super::*;
use super::*;
use crate::state::postcard_round_trip;
use crate::virtio::VirtioDeviceState;

fn fresh() -> (Arc<Mutex<Dummy>>, Arc<Mutex<Record>>) {
    let record = Arc::new(Mutex::new(Record::default()));
    (Arc::new(Mutex::new(dummy(record.clone()))), record)
}

fn mem() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap()
}

/// A transport whose dummy device the driver activated with queue 0 at 0x1000.
fn active() -> (MmioTransport, Arc<Mutex<Dummy>>) {
    let (mut t, dev, _) = setup();
    to_features_ok(&mut t);
    setup_queue(&mut t, 0, 8, 0x1000);
    wr(&mut t, REG_STATUS, ALL_OK);
    assert!(dev.lock().unwrap().activated);
    (t, dev)
}

#[test]
fn mid_handshake_state_round_trips_and_the_driver_carries_on() {
    let (mut t, _, _) = setup();
    to_features_ok(&mut t);
    setup_queue(&mut t, 0, 8, 0x1000);
    wr(&mut t, REG_QUEUE_SEL, 1);
    wr(&mut t, REG_DEVICE_FEATURES_SEL, 1);
    let saved = t.save();
    assert!(!saved.device_activated);
    assert_eq!(saved.status, ACKNOWLEDGE | DRIVER | FEATURES_OK);
    assert_eq!(saved.queue_sel, 1);
    assert_eq!(saved.queues.len(), 2);
    assert!(saved.queues[0].ready && !saved.queues[1].ready);

    let state = postcard_round_trip(&saved);
    assert_eq!(state, saved);
    let (dev, record) = fresh();
    let mut r = MmioTransport::restore(
        MmioRestoreArgs {
            mem: mem(),
            device: dev.clone(),
        },
        &state,
    )
    .unwrap();
    assert_eq!(r.save(), saved);
    assert!(!dev.lock().unwrap().activated);
    assert_eq!(rd(&mut r, REG_STATUS), ACKNOWLEDGE | DRIVER | FEATURES_OK);
    assert_eq!(rd(&mut r, REG_QUEUE_NUM_MAX), 8, "queue 1 still selected");

    wr(&mut r, REG_STATUS, ALL_OK);
    let rec = record.lock().unwrap();
    assert_eq!(rec.activations.len(), 1);
    assert_eq!(rec.activations[0].0, VIRTIO_F_VERSION_1 | FEATURE_LOW);
    assert_eq!(rec.activations[0].1[0].desc_table, 0x1000);
}

#[test]
fn active_device_is_reactivated_with_live_queue_positions() {
    let (t, dev) = active();
    {
        // The device moved on; the transport's copy did not.
        let mut d = dev.lock().unwrap();
        d.queues[0].set_next_avail(5);
        d.queues[0].set_next_used(4);
        d.interrupt.trigger(INT_VRING).unwrap();
    }
    let saved = postcard_round_trip(&t.save());
    assert!(saved.device_activated);
    assert_eq!(
        (saved.queues[0].next_avail, saved.queues[0].next_used),
        (5, 4)
    );
    assert_eq!(saved.interrupt_status, INT_VRING);

    let (dev2, record2) = fresh();
    dev2.lock().unwrap().restored = Some(VirtioDeviceState {
        activated: true,
        acked_features: VIRTIO_F_VERSION_1 | FEATURE_LOW,
        needs_reset: false,
    });
    let mut r = MmioTransport::restore(
        MmioRestoreArgs {
            mem: mem(),
            device: dev2.clone(),
        },
        &saved,
    )
    .unwrap();
    {
        let rec = record2.lock().unwrap();
        assert_eq!(rec.activations.len(), 1);
        let q = &rec.activations[0].1[0];
        assert_eq!((q.next_avail, q.next_used, q.size), (5, 4, 8));
        assert_eq!(
            (q.desc_table, q.avail_ring, q.used_ring),
            (0x1000, 0x2000, 0x3000)
        );
        assert!(q.ready);
    }
    // The restored interrupt is visible and raised again.
    assert_eq!(rd(&mut r, REG_INTERRUPT_STATUS), INT_VRING);
    assert_eq!(dev2.lock().unwrap().interrupt.eventfd().read().unwrap(), 1);
    assert_eq!(r.save(), saved);
    // Queue registers stay frozen, and a reset still works.
    wr(&mut r, REG_QUEUE_SEL, 0);
    wr(&mut r, REG_QUEUE_NUM, 4);
    assert_eq!(r.save().queues[0].size, 8);
    wr(&mut r, REG_STATUS, 0);
    assert!(!dev2.lock().unwrap().activated);
}

#[test]
fn failed_activation_state_round_trips() {
    let (mut t, dev, _) = setup();
    to_features_ok(&mut t);
    setup_queue(&mut t, 0, 16, 0xf000);
    wr(&mut t, REG_STATUS, ALL_OK);
    assert!(!dev.lock().unwrap().activated);
    let saved = postcard_round_trip(&t.save());
    assert_eq!(saved.status, ALL_OK | DEVICE_NEEDS_RESET);
    assert_eq!(saved.interrupt_status, INT_CONFIG);
    let (dev2, record2) = fresh();
    let mut r = MmioTransport::restore(
        MmioRestoreArgs {
            mem: mem(),
            device: dev2,
        },
        &saved,
    )
    .unwrap();
    assert_eq!(rd(&mut r, REG_STATUS), ALL_OK | DEVICE_NEEDS_RESET);
    assert!(record2.lock().unwrap().activations.is_empty());
}

/// Restoring each broken variant of a good state fails and leaves the device alone.
#[test]
fn bad_states_are_refused() {
    let (t, _) = active();
    let good = t.save();
    type Edit = fn(&mut MmioTransportState);
    let cases: &[(&str, Edit)] = &[
        ("version", |s| s.version = 99),
        ("device type", |s| s.device_type = 7),
        ("queue count", |s| {
            s.queues.pop();
        }),
        ("max size", |s| s.queues[0].max_size = 32),
        ("size above max", |s| s.queues[0].size = 32),
        ("size not a power of two", |s| s.queues[0].size = 6),
        ("size zero", |s| s.queues[0].size = 0),
        ("unaligned desc table", |s| s.queues[0].desc_table = 0x1001),
        ("unaligned used ring", |s| s.queues[0].used_ring = 0x3002),
        ("ring outside memory", |s| s.queues[0].used_ring = 0xfff0),
        ("ring address wraps", |s| {
            s.queues[0].avail_ring = u64::MAX - 1
        }),
        ("status bit unknown", |s| s.status |= 0x10),
        ("status out of order", |s| {
            s.status = ACKNOWLEDGE | DRIVER_OK
        }),
        ("needs reset without driver ok", |s| {
            s.status = ACKNOWLEDGE | DRIVER | DEVICE_NEEDS_RESET;
            s.device_activated = false;
        }),
        ("active without driver ok", |s| {
            s.status = ACKNOWLEDGE | DRIVER | FEATURES_OK
        }),
        ("active after failed activation", |s| {
            s.status |= DEVICE_NEEDS_RESET
        }),
        ("unoffered feature", |s| s.acked_features |= 1 << 5),
        ("no version 1", |s| s.acked_features = FEATURE_LOW),
        ("interrupt bits", |s| s.interrupt_status = 4),
    ];
    for (name, edit) in cases {
        let mut s = postcard_round_trip(&good);
        edit(&mut s);
        let (dev, record) = fresh();
        let err = MmioTransport::restore(
            MmioRestoreArgs {
                mem: mem(),
                device: dev.clone(),
            },
            &s,
        )
        .err();
        let err = err.unwrap_or_else(|| panic!("{name}: restored"));
        assert!(!err.to_string().is_empty());
        assert!(
            record.lock().unwrap().activations.is_empty(),
            "{name}: activated"
        );
        assert_eq!(dev.lock().unwrap().interrupt.status(), 0, "{name}");
    }
    // A ring outside memory is fine for a queue the device is not using.
    let mut s = good.clone();
    s.queues[1].used_ring = 0xfff0;
    assert!(MmioTransport::restore(
        MmioRestoreArgs {
            mem: mem(),
            device: fresh().0
        },
        &s
    )
    .is_ok());
}

#[test]
fn device_and_transport_states_must_agree() {
    let (t, _) = active();
    let saved = t.save();
    let restored = |activated, acked_features| {
        let (dev, record) = fresh();
        dev.lock().unwrap().restored = Some(VirtioDeviceState {
            activated,
            acked_features,
            needs_reset: false,
        });
        let r = MmioTransport::restore(
            MmioRestoreArgs {
                mem: mem(),
                device: dev,
            },
            &saved,
        );
        (r.err().map(|e| e.to_string()), record)
    };
    let (err, record) = restored(false, 0);
    assert!(err.unwrap().contains("does not match"));
    assert!(record.lock().unwrap().activations.is_empty());
    let (err, _) = restored(true, VIRTIO_F_VERSION_1);
    assert!(err.unwrap().contains("acked"));
    assert!(restored(true, saved.acked_features).0.is_none());

    // A device that is already running is refused.
    let (dev, _) = fresh();
    dev.lock().unwrap().activated = true;
    assert!(MmioTransport::restore(
        MmioRestoreArgs {
            mem: mem(),
            device: dev
        },
        &saved
    )
    .is_err());

    // A device that fails to start makes the restore fail.
    let (dev, _) = fresh();
    dev.lock().unwrap().fail_activate = true;
    let err = MmioTransport::restore(
        MmioRestoreArgs {
            mem: mem(),
            device: dev,
        },
        &saved,
    )
    .err()
    .unwrap();
    assert!(matches!(err, StateError::Activate { .. }), "{err}");
}
