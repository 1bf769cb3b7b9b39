//! `PortConnect` against the agent run as a host process: the host's
//! loopback stands in for the guest's.

mod common;

use common::{noise, sha256_hex, Agent};
use guest_agent::protocol::ErrorCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Bytes go both ways through the agent, 8 MiB each way at once; the
/// client's half-close reaches the server as end of input, and the
/// server's answer after it still comes back.
#[tokio::test]
async fn bytes_flow_both_ways_and_a_half_close_passes_through() {
    let agent = Agent::start();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let server = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let (mut r, mut w) = s.split();
        let send = async {
            w.write_all(&noise(8 << 20, 2)).await.unwrap();
            w.flush().await.unwrap();
        };
        let mut got = Vec::new();
        let recv = async { r.read_to_end(&mut got).await.unwrap() };
        tokio::join!(send, recv);
        // Only after the client's end of input: a last word.
        s.write_all(format!("got {}", sha256_hex(&got)).as_bytes())
            .await
            .unwrap();
        s.shutdown().await.unwrap();
    });

    let mut p = agent.client().open_port(port).await.unwrap();
    let up = noise(8 << 20, 1);
    let (mut r, mut w) = tokio::io::split(&mut p);
    let send = async {
        w.write_all(&up).await.unwrap();
        w.shutdown().await.unwrap();
    };
    let mut down = Vec::new();
    let recv = async { r.read_to_end(&mut down).await.unwrap() };
    tokio::join!(send, recv);
    server.await.unwrap();
    let (data, last) = down.split_at(8 << 20);
    assert_eq!(sha256_hex(data), sha256_hex(&noise(8 << 20, 2)));
    assert_eq!(
        std::str::from_utf8(last).unwrap(),
        format!("got {}", sha256_hex(&up))
    );
}

/// A server that speaks first (a greeting, as SSH or SMTP do) is heard
/// whole, even when its bytes arrive with the agent's answer.
#[tokio::test]
async fn a_server_that_speaks_first_is_heard() {
    let agent = Agent::start();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        s.write_all(b"220 hello\r\n").await.unwrap();
        let mut b = [0u8; 4];
        s.read_exact(&mut b).await.unwrap();
        s.write_all(&b).await.unwrap();
    });
    let mut p = agent.client().open_port(port).await.unwrap();
    let mut hello = [0u8; 11];
    p.read_exact(&mut hello).await.unwrap();
    assert_eq!(&hello, b"220 hello\r\n");
    p.write_all(b"ping").await.unwrap();
    let mut back = Vec::new();
    p.read_to_end(&mut back).await.unwrap();
    assert_eq!(back, b"ping");
}

/// Nothing listening is `Refused` with the port named, and port 0 is a
/// bad request; the agent keeps serving.
#[tokio::test]
async fn a_closed_port_is_refused_and_the_agent_serves_on() {
    let agent = Agent::start();
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let c = agent.client();
    let e = c.open_port(port).await.err().unwrap();
    assert_eq!(e.code(), Some(ErrorCode::Refused), "{e}");
    assert!(e.to_string().contains(&port.to_string()), "{e}");
    let e = c.open_port(0).await.err().unwrap();
    assert_eq!(e.code(), Some(ErrorCode::BadRequest), "{e}");
    c.ping().await.unwrap();
}
