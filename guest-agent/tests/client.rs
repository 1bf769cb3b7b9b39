//! The host client: reconnecting after the agent side resets, the vsock handshake path,
//! timeouts, and an agent that refuses hostile frames.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{cmd, rss_kib, Agent};
use guest_agent::client::{Client, ClientConfig, ClientError, Endpoint};
use guest_agent::protocol::{
    self, kind, ErrorCode, Header, Identity, Message, Ping, HEADER_LEN, MAX_PAYLOAD,
};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixListener;

#[tokio::test]
async fn a_reset_agent_fails_one_call_and_the_next_reconnects() {
    let mut agent = Agent::start();
    let client = agent.client();
    // Fill the pool with several idle connections.
    let pings: Vec<_> = (0..4).map(|_| client.ping()).collect();
    for p in pings {
        p.await.unwrap();
    }
    agent.kill();
    let e = client.ping().await.unwrap_err();
    assert!(
        matches!(e, ClientError::Connect { .. } | ClientError::Disconnected),
        "unclear error: {e:?}"
    );
    agent.restart();
    let pong = client.ping().await.unwrap();
    assert_eq!(pong.protocol, protocol::VERSION);
    assert!(!pong.identity_allowed);

    // A connection dropped in the middle of a request is a clear error too.
    let mut s = client.exec(cmd("sleep", &["100"])).await.unwrap();
    agent.kill();
    let e = s.next_event().await.unwrap_err();
    assert!(matches!(e, ClientError::Disconnected), "{e:?}");
    agent.restart();
    let out = client
        .exec_output(cmd("echo", &["back"]), None, 100)
        .await
        .unwrap();
    assert_eq!(out.stdout, b"back\n");
}

/// A stand-in for the vsock device's host socket: answers `CONNECT <port>\n` with
/// `OK <n>\n` and then relays bytes to the agent's own socket.
async fn fake_vsock_device(path: PathBuf, agent_sock: PathBuf, port: u32) {
    let l = UnixListener::bind(&path).unwrap();
    loop {
        let (mut host, _) = l.accept().await.unwrap();
        let agent_sock = agent_sock.clone();
        tokio::spawn(async move {
            let mut line = Vec::new();
            loop {
                let mut b = [0u8; 1];
                if tokio::io::AsyncReadExt::read(&mut host, &mut b)
                    .await
                    .unwrap_or(0)
                    == 0
                {
                    return;
                }
                if b[0] == b'\n' {
                    break;
                }
                line.push(b[0]);
            }
            if line != format!("CONNECT {port}").into_bytes() {
                return; // refused: the stream closes
            }
            let mut guest = tokio::net::UnixStream::connect(&agent_sock).await.unwrap();
            host.write_all(b"OK 1073741824\n").await.unwrap();
            let _ = tokio::io::copy_bidirectional(&mut host, &mut guest).await;
        });
    }
}

#[tokio::test]
async fn works_through_the_vsock_handshake() {
    let agent = Agent::start();
    let dev = agent.dir.path().join("vsock.sock");
    tokio::spawn(fake_vsock_device(dev.clone(), agent.sock.clone(), 1024));
    while !dev.exists() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let ep = Endpoint::Vsock {
        uds_path: dev.clone(),
        port: 1024,
    };
    let client = Client::new(ep, ClientConfig::default());
    client.ping().await.unwrap();
    client.write_bytes("f", b"via vsock").await.unwrap();
    assert_eq!(client.read_to_vec("f", 100).await.unwrap(), b"via vsock");
    let out = client
        .exec_output(cmd("cat", &["f"]), None, 100)
        .await
        .unwrap();
    assert_eq!(out.stdout, b"via vsock");

    let wrong = Client::new(
        Endpoint::Vsock {
            uds_path: dev,
            port: 7,
        },
        ClientConfig::default(),
    );
    let e = wrong.ping().await.unwrap_err();
    assert!(matches!(e, ClientError::Handshake { port: 7, .. }), "{e:?}");
}

#[tokio::test]
async fn connect_and_request_timeouts() {
    let t = tempfile::tempdir().unwrap();
    // A listener that accepts and never answers.
    let path = t.path().join("silent.sock");
    let l = UnixListener::bind(&path).unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let (s, _) = l.accept().await.unwrap();
            held.push(s);
        }
    });
    let cfg = ClientConfig {
        connect_timeout: Duration::from_millis(300),
        request_timeout: Duration::from_millis(300),
        ..ClientConfig::default()
    };
    let start = Instant::now();
    let e = Client::new(Endpoint::Unix(path.clone()), cfg.clone())
        .ping()
        .await
        .unwrap_err();
    assert!(matches!(e, ClientError::Timeout(_)), "{e:?}");
    // The vsock handshake never answered: a connect timeout.
    let ep = Endpoint::Vsock {
        uds_path: path,
        port: 1024,
    };
    let e = Client::new(ep, cfg).ping().await.unwrap_err();
    assert!(matches!(e, ClientError::ConnectTimeout(_)), "{e:?}");
    assert!(start.elapsed() < Duration::from_secs(3));
    // Nothing there at all.
    let e = Client::new(
        Endpoint::Unix(t.path().join("none")),
        ClientConfig::default(),
    )
    .ping()
    .await
    .unwrap_err();
    assert!(matches!(e, ClientError::Connect { .. }), "{e:?}");
}

#[tokio::test]
async fn identity_refresh_is_refused_without_the_flag() {
    // Never run with --allow-identity here: it would set this machine's clock.
    let agent = Agent::start();
    let req = Identity {
        instance_id: "vm-1".into(),
        unix_time_ns: 0,
        entropy: vec![0; 64].into(),
        hostname: None,
    };
    let e = agent.client().identity_refresh(req).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Forbidden), "{e}");
}

fn raw_frame(kind: u16, id: u64, payload: &[u8]) -> Vec<u8> {
    let mut v = Header {
        kind,
        request_id: id,
        len: payload.len() as u32,
    }
    .to_bytes()
    .to_vec();
    v.extend_from_slice(payload);
    v
}

fn read_answer(s: &mut UnixStream) -> Option<protocol::Frame> {
    let mut buf = Vec::new();
    let mut b = [0u8; 4096];
    loop {
        if let Ok(Some((f, _))) = protocol::decode(&buf) {
            return Some(f);
        }
        match s.read(&mut b) {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&b[..n]),
        }
    }
}

#[test]
fn the_agent_refuses_hostile_frames_and_keeps_serving() {
    let agent = Agent::start();
    let connect = || {
        let s = UnixStream::connect(&agent.sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s
    };
    let rss_before = rss_kib(&agent.pid().to_string());

    // Another protocol version: one clear error, then the connection closes.
    let mut s = connect();
    let mut f = protocol::encode(1, &Ping {}.into()).unwrap();
    f[4..6].copy_from_slice(&9u16.to_le_bytes());
    s.write_all(&f).unwrap();
    let ans = read_answer(&mut s).unwrap();
    let Message::ErrorMsg(e) = ans.msg else {
        panic!("{:?}", ans.msg)
    };
    assert_eq!(e.code, ErrorCode::UnsupportedVersion);
    assert!(e.message.contains("version 9"), "{}", e.message);
    assert!(read_answer(&mut s).is_none());

    // A 4 GiB length claim: the connection is closed, nothing is allocated.
    for claim in [u32::MAX, MAX_PAYLOAD + 1] {
        let mut s = connect();
        let mut h = Header {
            kind: kind::WriteData,
            request_id: 1,
            len: 0,
        }
        .to_bytes();
        h[16..20].copy_from_slice(&claim.to_le_bytes());
        s.write_all(&h).unwrap();
        // The agent may close on the header alone, before these bytes arrive.
        let _ = s.write_all(&[0u8; 4096]);
        assert!(read_answer(&mut s).is_none());
    }

    // Garbage magic: closed.
    let mut s = connect();
    s.write_all(&[0xAB; HEADER_LEN]).unwrap();
    assert!(read_answer(&mut s).is_none());

    // An unknown kind and a malformed payload: error answers, and the connection goes on.
    let mut s = connect();
    s.write_all(&raw_frame(0x7777, 5, &[1, 2, 3])).unwrap();
    let a = read_answer(&mut s).unwrap();
    assert_eq!(a.request_id, 5);
    assert!(matches!(a.msg, Message::ErrorMsg(ref e) if e.code == ErrorCode::UnknownKind));
    s.write_all(&raw_frame(kind::Stat, 6, &[0xff, 0xff, 0xff, 0xff, 0x0f]))
        .unwrap();
    let a = read_answer(&mut s).unwrap();
    assert!(matches!(a.msg, Message::ErrorMsg(ref e) if e.code == ErrorCode::BadRequest));
    // An answer kind sent as a request.
    s.write_all(&protocol::encode(7, &protocol::Done {}.into()).unwrap())
        .unwrap();
    let a = read_answer(&mut s).unwrap();
    assert!(matches!(a.msg, Message::ErrorMsg(ref e) if e.code == ErrorCode::BadRequest));
    s.write_all(&protocol::encode(8, &Ping {}.into()).unwrap())
        .unwrap();
    assert!(matches!(read_answer(&mut s).unwrap().msg, Message::Pong(_)));

    // A frame cut short by a closed connection: nothing breaks.
    let mut s = connect();
    let f = protocol::encode(9, &protocol::List { path: "x".into() }.into()).unwrap();
    s.write_all(&f[..f.len() - 1]).unwrap();
    drop(s);

    let rss_after = rss_kib(&agent.pid().to_string());
    assert!(
        rss_after < rss_before + 8 * 1024,
        "agent RSS {rss_before} -> {rss_after} KiB"
    );
    let mut s = connect();
    s.write_all(&protocol::encode(10, &Ping {}.into()).unwrap())
        .unwrap();
    assert!(matches!(read_answer(&mut s).unwrap().msg, Message::Pong(_)));
}
