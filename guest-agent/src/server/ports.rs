//! `PortConnect`: a connection to a TCP port on the guest's loopback, whose
//! bytes the agent's connection then carries both ways (how `sproutd`
//! exposes a guest port, whatever the guest's network).

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use log::debug;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::protocol::{ErrorCode, ErrorMsg};

/// How long a connect to a guest port may take (loopback: only a full
/// listen backlog makes it slow).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A TCP connection to `port` on 127.0.0.1, else on ::1 (a server bound to
/// one of them only, as `python3 -m http.server --bind ::1` is).
pub(super) async fn connect(port: u16) -> Result<TcpStream, ErrorMsg> {
    if port == 0 {
        return Err(ErrorMsg::new(ErrorCode::BadRequest, "port 0 is not a port"));
    }
    let mut errors = Vec::new();
    for ip in [Ipv4Addr::LOCALHOST.into(), Ipv6Addr::LOCALHOST.into()] {
        let addr = SocketAddr::new(ip, port);
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Ok(Err(e)) => errors.push(e),
            Err(_) => errors.push(io::ErrorKind::TimedOut.into()),
        }
    }
    Err(refusal(port, &errors))
}

/// Why no loopback address of `port` took a connection (`errors`: 127.0.0.1's,
/// then ::1's). A guest without IPv6 fails ::1 with "address family not
/// supported": 127.0.0.1's refusal is the answer then.
fn refusal(port: u16, errors: &[io::Error]) -> ErrorMsg {
    let refused = |e: &&io::Error| e.kind() == io::ErrorKind::ConnectionRefused;
    let (code, e) = match errors.iter().find(refused) {
        Some(e) => (ErrorCode::Refused, e),
        None => match errors.first() {
            Some(e) => (ErrorCode::Io, e),
            None => return ErrorMsg::new(ErrorCode::Io, format!("port {port}: no address")),
        },
    };
    ErrorMsg::new(
        code,
        format!("Nothing in the sandbox accepts connections on port {port} ({e})"),
    )
}

/// Carries bytes between the agent's connection (`r`, whose `rest` was
/// already read, and `w`) and `tcp` until both directions have ended; the
/// end of one direction is passed on as a half-close.
pub(super) async fn splice<R, W>(mut r: R, mut w: W, rest: Vec<u8>, tcp: TcpStream, port: u16)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (mut tr, mut tw) = tcp.into_split();
    let up = async {
        tw.write_all(&rest).await?;
        let n = tokio::io::copy(&mut r, &mut tw).await?;
        tw.shutdown().await?;
        Ok::<_, io::Error>(n + rest.len() as u64)
    };
    let down = async {
        let n = tokio::io::copy(&mut tr, &mut w).await?;
        w.shutdown().await?;
        Ok::<_, io::Error>(n)
    };
    let (up, down) = tokio::join!(up, down);
    debug!("port {port}: in {up:?} bytes, out {down:?}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_on_either_address_is_a_refusal() {
        let refused = || io::Error::from(io::ErrorKind::ConnectionRefused);
        let no_v6 = || io::Error::from_raw_os_error(libc::EAFNOSUPPORT);
        let m = refusal(8000, &[refused(), no_v6()]);
        assert_eq!(m.code, ErrorCode::Refused, "{}", m.message);
        assert!(m.message.contains("8000"), "{}", m.message);
        assert_eq!(refusal(1, &[no_v6(), refused()]).code, ErrorCode::Refused);
        let m = refusal(1, &[io::ErrorKind::TimedOut.into(), no_v6()]);
        assert_eq!(m.code, ErrorCode::Io);
    }
}
