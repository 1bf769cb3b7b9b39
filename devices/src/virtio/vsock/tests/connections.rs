//! Connection set-up both ways, data, shutdown and RST, many at once.

use std::net::Shutdown;

use super::*;

#[test]
fn host_initiated_connection_round_trip() {
    let mut h = H::new();
    let mut s = h.host(1234);
    let (req, _) = h.expect_op(OP_REQUEST);
    assert_eq!(req.dst_port, 1234);
    assert!(req.src_port >= 1 << 30);
    assert_eq!((req.buf_alloc, req.fwd_cnt, req.len), (CONN_BUF_SIZE, 0, 0));
    assert!(lock(&h.dev).interrupt().eventfd().read().unwrap() > 0);
    let local = req.src_port;

    h.send(pkt(OP_RESPONSE, 1234, local), &[]);
    h.settle();
    assert_eq!(read_line(&mut s), format!("OK {local}"));

    s.write_all(b"to the guest").unwrap();
    let (p, d) = h.expect_op(OP_RW);
    assert_eq!((p.src_port, p.dst_port), (local, 1234));
    assert_eq!(d, b"to the guest");

    h.send(pkt(OP_RW, 1234, local), b"to the host");
    h.settle();
    let mut b = [0u8; 11];
    s.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"to the host");

    // The guest closes: the host reads EOF and the guest gets the final RST.
    let mut sd = pkt(OP_SHUTDOWN, 1234, local);
    sd.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
    h.send(sd, &[]);
    let (p, _) = h.expect_op(OP_RST);
    assert_eq!((p.src_port, p.dst_port), (local, 1234));
    assert_closed(&mut s);
    assert_eq!(h.conns(), 0);
}

#[test]
fn guest_refuses_or_ignores_host_connection() {
    let limits = Limits {
        connect_timeout: Duration::from_millis(100),
        ..Limits::default()
    };
    let mut h = H::with(limits, Duration::from_millis(20), 32);
    let mut s = h.host(80);
    let (req, _) = h.expect_op(OP_REQUEST);
    h.send(pkt(OP_RST, 80, req.src_port), &[]);
    h.settle();
    assert_closed(&mut s);

    // No answer: the stream is closed after the timeout and the guest told.
    let mut s = h.host(81);
    let (req, _) = h.expect_op(OP_REQUEST);
    let (rst, _) = h.expect_op(OP_RST);
    assert_eq!((rst.src_port, rst.dst_port), (req.src_port, 81));
    assert_closed(&mut s);

    // A host that never finishes its line is closed too.
    let mut s = UnixStream::connect(&h.path).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(b"CONN").unwrap();
    h.em.run_with_timeout(50).unwrap();
    assert_eq!(lock(&h.dev).muxer.live(), 1);
    let end = Instant::now() + WAIT;
    while lock(&h.dev).muxer.live() > 0 {
        assert!(Instant::now() < end, "silent host stream never closed");
        h.settle();
    }
    h.settle();
    assert_closed(&mut s);
    assert_eq!(h.conns(), 0);
}

#[test]
fn bad_connect_lines_close_the_stream() {
    let mut h = H::new();
    let mut streams: Vec<UnixStream> = [
        &b"HELLO\n"[..],
        b"CONNECT 99999999999\n",
        b"CONNECT abc\n",
        &[b'A'; 40],
    ]
    .iter()
    .map(|line| {
        let mut s = UnixStream::connect(&h.path).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s.write_all(line).unwrap();
        s
    })
    .collect();
    h.settle();
    for s in &mut streams {
        assert_closed(s);
    }
    h.expect_quiet();
}

#[test]
fn guest_initiated_connections() {
    let mut h = H::new();
    // Nothing listens: RST.
    h.send(pkt(OP_REQUEST, 3001, 6000), &[]);
    let (rst, _) = h.expect_op(OP_RST);
    assert_eq!((rst.src_port, rst.dst_port), (6000, 3001));

    let l = h.listen(5000);
    let mut s = h.guest_established(&l, 3000, 5000);
    h.send(pkt(OP_RW, 3000, 5000), b"from guest");
    h.settle();
    let mut b = [0u8; 10];
    s.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"from guest");
    s.write_all(b"from host").unwrap();
    let (p, d) = h.expect_op(OP_RW);
    assert_eq!(
        (p.src_port, p.dst_port, d.as_slice()),
        (5000, 3000, &b"from host"[..])
    );

    // The host half-closes: the guest is told, and can still send.
    s.shutdown(Shutdown::Write).unwrap();
    let (p, _) = h.expect_op(OP_SHUTDOWN);
    assert_eq!(p.flags, SHUTDOWN_SEND);
    h.send(pkt(OP_RW, 3000, 5000), b"last");
    h.settle();
    let mut b = [0u8; 4];
    s.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"last");
    // The guest stops too: both sides closed, so RST and the connection is gone.
    let mut sd = pkt(OP_SHUTDOWN, 3000, 5000);
    sd.flags = SHUTDOWN_SEND;
    h.send(sd, &[]);
    h.expect_op(OP_RST);
    assert_closed(&mut s);
    assert_eq!(h.conns(), 0);

    // A host that closes outright resets the connection.
    let s = h.guest_established(&l, 3002, 5000);
    drop(s);
    let (p, _) = h.expect_op(OP_RST);
    assert_eq!(p.dst_port, 3002);
    // And a guest RST closes the host stream, with no answer.
    let mut s = h.guest_established(&l, 3003, 5000);
    h.send(pkt(OP_RST, 3003, 5000), &[]);
    h.settle();
    assert_closed(&mut s);
    h.expect_quiet();
    assert_eq!(h.conns(), 0);
}

#[test]
fn many_concurrent_connections() {
    let mut h = H::new();
    let l = h.listen(7000);
    let mut hosts: Vec<(UnixStream, u32, u32)> = (0..10)
        .map(|i| {
            let (s, local) = h.host_established(100 + i);
            (s, local, 100 + i)
        })
        .collect();
    for i in 0..10 {
        let s = h.guest_established(&l, 200 + i, 7000);
        hosts.push((s, 7000, 200 + i));
    }
    assert_eq!(h.conns(), 20);
    let locals: std::collections::HashSet<u32> =
        hosts[..10].iter().map(|(_, local, _)| *local).collect();
    assert_eq!(locals.len(), 10);

    for (s, _, gport) in &mut hosts {
        write!(s, "host{gport}").unwrap();
    }
    let mut seen = HashMap::new();
    while seen.len() < 20 {
        let (p, d) = h.expect_op(OP_RW);
        seen.entry(p.dst_port).or_insert_with(Vec::new).extend(d);
    }
    for (_, local, gport) in &hosts {
        assert_eq!(seen[gport], format!("host{gport}").into_bytes());
        h.send(
            pkt(OP_RW, *gport, *local),
            format!("guest{gport}").as_bytes(),
        );
    }
    h.settle();
    for (s, _, gport) in &mut hosts {
        let want = format!("guest{gport}");
        let mut b = vec![0u8; want.len()];
        s.read_exact(&mut b).unwrap();
        assert_eq!(b, want.as_bytes());
    }
}
