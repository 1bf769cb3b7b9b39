//! The first line a host process sends on `uds_path`: `CONNECT <port>\n`.

use std::io::{ErrorKind, Read};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use super::MAX_CONNECT_LINE;

/// A host stream that has not finished its `CONNECT` line yet.
#[derive(Debug)]
pub struct Handshake {
    pub stream: UnixStream,
    line: Vec<u8>,
    pub deadline: Instant,
    /// The port asked for, while the connection waits for the guest to finish
    /// a transport reset.
    pub held: Option<u32>,
}

/// Where a handshake stands after reading what the host sent so far.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// More bytes are needed.
    Wait,
    /// A complete, valid line asking for this guest port.
    Connect(u32),
    /// A bad or overlong line, EOF or an error: close the stream.
    Fail,
}

impl Handshake {
    pub fn new(stream: UnixStream, deadline: Instant) -> Self {
        Self {
            stream,
            line: Vec::with_capacity(MAX_CONNECT_LINE),
            deadline,
            held: None,
        }
    }

    /// Reads what is available, one byte at a time so that nothing past the newline
    /// (the start of the connection's data) is consumed.
    pub fn poll(&mut self) -> Step {
        let mut b = [0u8; 1];
        loop {
            match self.stream.read(&mut b) {
                Ok(0) => return Step::Fail,
                Ok(_) if b[0] == b'\n' => {
                    return parse_connect_line(&self.line).map_or(Step::Fail, Step::Connect)
                }
                Ok(_) => {
                    self.line.push(b[0]);
                    // Room must be left for the newline.
                    if self.line.len() >= MAX_CONNECT_LINE {
                        return Step::Fail;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Step::Wait,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return Step::Fail,
            }
        }
    }
}

/// Parses `CONNECT <port>` (without the newline; a trailing `\r` is allowed): one space,
/// then a decimal `u32`.
pub fn parse_connect_line(line: &[u8]) -> Option<u32> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let digits = line.strip_prefix(b"CONNECT ")?;
    if digits.is_empty() || digits.len() > 10 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn parses_connect_lines() {
        assert_eq!(parse_connect_line(b"CONNECT 1234"), Some(1234));
        assert_eq!(parse_connect_line(b"CONNECT 0\r"), Some(0));
        assert_eq!(parse_connect_line(b"CONNECT 4294967295"), Some(u32::MAX));
        for bad in [
            &b"CONNECT 4294967296"[..],
            b"CONNECT",
            b"CONNECT ",
            b"CONNECT  1",
            b"CONNECT -1",
            b"CONNECT 1x",
            b"connect 1",
            b"CONNECT 00000000001",
            b"",
        ] {
            assert_eq!(parse_connect_line(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn reads_up_to_the_newline_only() {
        let (mut host, dev) = UnixStream::pair().unwrap();
        dev.set_nonblocking(true).unwrap();
        let mut h = Handshake::new(dev, Instant::now());
        assert_eq!(h.poll(), Step::Wait);
        host.write_all(b"CONN").unwrap();
        assert_eq!(h.poll(), Step::Wait);
        host.write_all(b"ECT 52\ndata").unwrap();
        assert_eq!(h.poll(), Step::Connect(52));
        let mut rest = [0u8; 4];
        h.stream.read_exact(&mut rest).unwrap();
        assert_eq!(&rest, b"data");
    }

    #[test]
    fn fails_on_overlong_bad_or_closed() {
        let (mut host, dev) = UnixStream::pair().unwrap();
        dev.set_nonblocking(true).unwrap();
        let mut h = Handshake::new(dev, Instant::now());
        host.write_all(&[b'1'; MAX_CONNECT_LINE]).unwrap();
        assert_eq!(h.poll(), Step::Fail);

        let (mut host, dev) = UnixStream::pair().unwrap();
        dev.set_nonblocking(true).unwrap();
        let mut h = Handshake::new(dev, Instant::now());
        host.write_all(b"HELLO\n").unwrap();
        assert_eq!(h.poll(), Step::Fail);

        let (host, dev) = UnixStream::pair().unwrap();
        dev.set_nonblocking(true).unwrap();
        let mut h = Handshake::new(dev, Instant::now());
        drop(host);
        assert_eq!(h.poll(), Step::Fail);
    }
}
