//! Credit both ways, malformed chains and headers, rx starvation, limits, resets.

use super::*;

#[test]
fn never_sends_past_guest_credit() {
    let mut h = H::new();
    let l = h.listen(8000);
    let mut req = pkt(OP_REQUEST, 900, 8000);
    req.buf_alloc = 100;
    h.send(req, &[]);
    h.expect_op(OP_RESPONSE);
    let (mut s, _) = l.accept().unwrap();
    s.write_all(&[5u8; 1000]).unwrap();

    let mut got = 0usize;
    let mut fwd = 0u32;
    for round in 1..=3 {
        h.settle();
        let mut credit_requested = false;
        while let Some((p, d)) = h.rx.pop_front() {
            match p.op {
                OP_RW => got += d.len(),
                OP_CREDIT_REQUEST => credit_requested = true,
                op => panic!("unexpected op {op}"),
            }
        }
        assert_eq!(got, 100 * round, "device exceeded the guest's credit");
        assert!(credit_requested);
        // The guest consumed everything: it says so.
        fwd += 100;
        let mut up = pkt(OP_CREDIT_UPDATE, 900, 8000);
        up.buf_alloc = 100;
        up.fwd_cnt = fwd;
        h.send(up, &[]);
    }
    // A credit request is answered with our credit.
    h.settle();
    h.rx.clear();
    let mut cr = pkt(OP_CREDIT_REQUEST, 900, 8000);
    cr.buf_alloc = 100;
    cr.fwd_cnt = 400;
    h.send(cr, &[]);
    let (p, _) = h.expect_op(OP_CREDIT_UPDATE);
    assert_eq!((p.buf_alloc, p.fwd_cnt), (CONN_BUF_SIZE, 0));
}

#[test]
fn credit_updates_let_a_polite_guest_stream() {
    let mut h = H::new();
    let l = h.listen(8001);
    let mut s = h.guest_established(&l, 901, 8001);
    s.set_nonblocking(true).unwrap();
    let total = 3 * CONN_BUF_SIZE as usize;
    let (mut sent, mut received) = (0usize, 0usize);
    let mut peer_fwd = 0u32;
    let mut updates = 0;
    let mut buf = vec![0u8; 1 << 16];
    let end = Instant::now() + Duration::from_secs(20);
    while received < total {
        assert!(
            Instant::now() < end,
            "stalled: sent {sent}, received {received}"
        );
        let credit = CONN_BUF_SIZE as usize - (sent - peer_fwd as usize);
        let n = credit.min(1 << 15).min(total - sent);
        if n > 0 {
            h.send(pkt(OP_RW, 901, 8001), &vec![9u8; n]);
            sent += n;
        }
        h.settle();
        for (p, _) in h.rx.drain(..) {
            assert_eq!(p.op, OP_CREDIT_UPDATE);
            assert!(p.fwd_cnt >= peer_fwd && p.fwd_cnt as usize <= sent);
            peer_fwd = p.fwd_cnt;
            updates += 1;
        }
        // The host reads in small bites, behind the guest.
        if let Ok(k) = s.read(&mut buf[..1 << 15]) {
            received += k;
        }
    }
    assert!(updates >= 3, "only {updates} credit updates");
    assert_eq!(sent, total);
}

#[test]
fn guest_past_credit_gets_reset() {
    let mut h = H::new();
    let l = h.listen(8002);
    let mut s = h.guest_established(&l, 902, 8002);
    // The host never reads; the guest ignores credit.
    let chunk = vec![1u8; 1 << 16];
    let mut sent = 0usize;
    let rst = loop {
        h.send(pkt(OP_RW, 902, 8002), &chunk);
        sent += chunk.len();
        h.settle();
        // Credit updates may come as the host stream takes bytes; then the RST.
        if let Some((p, _)) = h.rx.drain(..).find(|(p, _)| p.op != OP_CREDIT_UPDATE) {
            break p;
        }
        assert!(sent < 64 << 20, "never reset");
    };
    assert_eq!((rst.op, rst.dst_port), (OP_RST, 902));
    assert!(sent > CONN_BUF_SIZE as usize);
    assert_eq!(h.conns(), 0);
    s.set_nonblocking(true).unwrap();
    let mut total = 0;
    let mut b = vec![0u8; 1 << 16];
    loop {
        match s.read(&mut b) {
            Ok(0) => break,
            Ok(n) => total += n,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(total < sent);
}

#[test]
fn hostile_packets_and_chains() {
    let mut h = H::new();
    let l = h.listen(9000);
    let mut s = h.guest_established(&l, 1000, 9000);
    let mem = h.g.mem;
    let hdr_at = |h: &mut H, hdr: Header| {
        let a = h.g.alloc(HDR_SIZE as u64);
        mem.write_slice(&hdr.to_bytes(), GuestAddress(a)).unwrap();
        a
    };

    // Short header; header outside RAM; a writable buffer; a head-only chain whose len
    // claims data; a descriptor looping to itself: none is answered.
    let a = hdr_at(&mut h, pkt(OP_RW, 1, 2));
    h.g.push(TXQ, &[(a, 20, false)]);
    h.g.push(TXQ, &[(MEM_SIZE - 8, HDR_SIZE as u32, false)]);
    h.g.push(TXQ, &[(a, HDR_SIZE as u32, true)]);
    let mut claims = pkt(OP_REQUEST, 5, 6);
    claims.len = 10;
    let a = hdr_at(&mut h, claims);
    h.g.push(TXQ, &[(a, HDR_SIZE as u32, false)]);
    let b = h.g.alloc(16);
    let start = h.g.next_desc[TXQ];
    let looped = [
        RawDescriptor::from(Descriptor::new(
            a,
            HDR_SIZE as u32,
            VRING_DESC_F_NEXT as u16,
            start + 1,
        )),
        RawDescriptor::from(Descriptor::new(b, 16, VRING_DESC_F_NEXT as u16, start + 1)),
    ];
    h.g.push_raw(TXQ, &looped, start);
    h.g.next_desc[TXQ] += 2;
    h.notify(TXQ);
    h.settle();
    // The head-only REQUEST and the loop are refused with RSTs for ports 5/6; nothing else.
    assert!(h.rx.iter().all(|(p, _)| p.op == OP_RST && p.dst_port == 5));
    h.rx.clear();
    assert_eq!(h.g.used(TXQ).len(), 1 + 5);

    // Huge len, wrong type, wrong destination CID: RST.
    let mut huge = pkt(OP_RW, 1000, 9000);
    huge.len = u32::MAX;
    let a = hdr_at(&mut h, huge);
    h.g.push(TXQ, &[(a, HDR_SIZE as u32, false), (BUF_BASE, 64, false)]);
    h.notify(TXQ);
    h.expect_op(OP_RST);
    assert_closed(&mut s);
    let mut seq = pkt(OP_REQUEST, 1001, 9000);
    seq.type_ = 2;
    h.send(seq, &[]);
    h.expect_op(OP_RST);
    let mut other = pkt(OP_REQUEST, 1002, 9000);
    other.dst_cid = 7;
    h.send(other, &[]);
    let (p, _) = h.expect_rx();
    assert_eq!(
        (p.op, p.src_cid, p.dst_cid, p.dst_port),
        (OP_RST, 7, CID, 1002)
    );
    assert_eq!(h.conns(), 0);

    // Wrong source CID: dropped without an answer; the real connection is untouched.
    let mut s = h.guest_established(&l, 1003, 9000);
    let mut spoof = pkt(OP_RST, 1003, 9000);
    spoof.src_cid = 99;
    h.send(spoof, &[]);
    spoof.op = OP_RW;
    h.send(spoof, b"x");
    h.expect_quiet();
    assert_eq!(h.conns(), 1);
    // An unknown op resets the connection.
    h.send(pkt(77, 1003, 9000), &[]);
    h.expect_op(OP_RST);
    assert_closed(&mut s);

    assert!(!lock(&h.dev).needs_reset());
}

#[test]
fn bad_rx_buffers_are_skipped() {
    let mut h = H::with(Limits::default(), TICK, 0);
    let bad = h.g.alloc(64);
    h.g.push(RXQ, &[(bad, 20, true)]);
    h.g.push(RXQ, &[(bad, 64, false)]);
    h.g.push(RXQ, &[(MEM_SIZE + 0x1000, 64, true)]);
    h.g.push(RXQ, &[(bad, 10, true), (MEM_SIZE - 8, 64, true)]);
    let good = h.g.alloc(RX_BUF.into());
    let head = h.g.push(RXQ, &[(good, RX_BUF, true)]);
    h.notify(RXQ);
    h.run_idle();
    assert!(h.g.used(RXQ).is_empty());
    // A refused request makes an RST: it skips the bad buffers.
    h.send(pkt(OP_REQUEST, 1004, 4444), &[]);
    h.run_idle();
    let used = h.g.used(RXQ);
    assert_eq!(used.len(), 5);
    assert!(used[..4].iter().all(|(_, len)| *len == 0));
    assert_eq!(used[4], (head, HDR_SIZE as u32));
    let mut raw = [0u8; HDR_SIZE];
    h.g.mem.read_slice(&mut raw, GuestAddress(good)).unwrap();
    assert_eq!(Header::from_bytes(&raw).op, OP_RST);
    assert!(!lock(&h.dev).needs_reset());
}

#[test]
fn waits_for_rx_buffers() {
    let mut h = H::with(Limits::default(), TICK, 0);
    // A refused request and a host connection wait for rx buffers.
    h.send(pkt(OP_REQUEST, 2999, 1), &[]);
    let _s = h.host(55);
    h.settle();
    assert!(h.rx.is_empty());
    assert_eq!(h.g.used(TXQ).len(), 1);
    h.add_rx(4);
    let mut ops = vec![h.expect_rx().0.op, h.expect_rx().0.op];
    ops.sort();
    assert_eq!(ops, vec![OP_REQUEST, OP_RST]);
}

#[test]
fn transport_reset_event_drops_connections() {
    let mut h = H::new();
    let (mut s, _) = h.host_established(77);
    // No event buffer yet: the event waits for one.
    lock(&h.dev).send_transport_reset();
    h.settle();
    assert_closed(&mut s);
    assert_eq!(h.conns(), 0);
    assert!(h.events.is_empty());
    h.add_event_buffer();
    h.settle();
    assert_eq!(
        h.events,
        vec![(4, EVENT_TRANSPORT_RESET.to_le_bytes().to_vec())]
    );
    // With a buffer already there, it is delivered at once.
    h.add_event_buffer();
    h.settle();
    lock(&h.dev).send_transport_reset();
    h.settle();
    assert_eq!(h.events.len(), 2);
    // A host connect waits until the guest has handled the event, which it
    // shows by posting a new event buffer: before that, the guest would drop
    // the connection in its reset without telling the host.
    let mut s = h.host(78);
    h.expect_quiet();
    h.add_event_buffer();
    let (req, _) = h.expect_op(OP_REQUEST);
    assert_eq!(req.dst_port, 78);
    h.send(pkt(OP_RESPONSE, 78, req.src_port), &[]);
    h.settle();
    assert_eq!(read_line(&mut s), format!("OK {}", req.src_port));
    // The device still works afterwards.
    h.host_established(79);
}

#[test]
fn a_guest_that_never_handles_the_reset_delays_host_connects_only_so_long() {
    // The guest takes the event and never posts another buffer, or never
    // posts one at all: either way host connects go through after the limit.
    for has_buffer in [true, false] {
        never_handled(has_buffer);
    }
}

fn never_handled(has_buffer: bool) {
    let mut h = H::new();
    if has_buffer {
        h.add_event_buffer();
        h.settle();
    }
    // Before the reset: the limit runs from it.
    let t = std::time::Instant::now();
    lock(&h.dev).send_transport_reset();
    h.settle();
    assert_eq!(h.events.len(), usize::from(has_buffer));
    // The host client retries, as the agent client does, until it is let in.
    let (req, mut s) = loop {
        let mut s = h.host(80);
        let got = loop {
            h.settle();
            if let Some(i) = h.rx.iter().position(|p| p.0.op == OP_REQUEST) {
                break Some(h.rx.remove(i).unwrap().0);
            }
            if is_closed(&mut s) {
                break None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        if let Some(r) = got {
            break (r, s);
        }
        assert!(
            t.elapsed() < super::super::device::RESET_ACK_TIMEOUT * 3,
            "never let through"
        );
    };
    assert!(t.elapsed() >= super::super::device::RESET_ACK_TIMEOUT);
    h.send(pkt(OP_RESPONSE, 80, req.src_port), &[]);
    h.settle();
    assert_eq!(read_line(&mut s), format!("OK {}", req.src_port));
}

#[test]
fn connection_limit_and_device_reset() {
    let limits = Limits {
        max_conns: 2,
        ..Limits::default()
    };
    let mut h = H::with(limits, TICK, 32);
    let l = h.listen(9200);
    let (mut a, _) = h.host_established(1);
    let mut b = h.guest_established(&l, 10, 9200);
    let mut c = h.host(2);
    h.send(pkt(OP_REQUEST, 11, 9200), &[]);
    let (rst, _) = h.expect_op(OP_RST);
    assert_eq!(rst.dst_port, 11);
    assert_closed(&mut c);
    h.expect_quiet();
    assert_eq!(h.conns(), 2);

    lock(&h.dev).reset();
    h.settle();
    assert_closed(&mut a);
    assert_closed(&mut b);
    assert_eq!(h.conns(), 0);
}
