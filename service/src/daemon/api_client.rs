//! `sprout api`: one request to a `sproutd`, its answer's body copied to a
//! writer as it arrives (so a `text/event-stream` answer shows each event
//! when it happens). A small HTTP/1.1 client over a plain TCP connection
//! (`Connection: close`), for scripts on machines with no curl (the
//! emulated lab has only busybox).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ApiClientError {
    #[error("Cannot reach sproutd at {0}")]
    Connect(String, #[source] std::io::Error),
    #[error("The connection to sproutd failed")]
    Io(#[from] std::io::Error),
    #[error("sproutd's answer is not HTTP: {0}")]
    BadAnswer(String),
    #[error("{0:?} is not a header (NAME: VALUE on one line)")]
    BadHeader(String),
}

/// Longest header line accepted.
const MAX_LINE: usize = 16 * 1024;

/// Sends `method path` to `addr` (`HOST:PORT`) with an optional JSON `body`
/// and more `headers` (`NAME: VALUE`), copies the answer's body to `out` as it arrives and
/// returns the answer's status; `timeout` bounds each read and write.
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    headers: &[String],
    timeout: Duration,
    out: &mut dyn Write,
) -> Result<u16, ApiClientError> {
    for h in headers {
        if !h.contains(':') || h.contains('\r') || h.contains('\n') {
            return Err(ApiClientError::BadHeader(h.clone()));
        }
    }
    let mut s = TcpStream::connect(addr).map_err(|e| ApiClientError::Connect(addr.into(), e))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for h in headers {
        head.push_str(h);
        head.push_str("\r\n");
    }
    if let Some(b) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes())?;
    if let Some(b) = body {
        s.write_all(b)?;
    }
    read_answer(&mut BufReader::new(s), out)
}

fn line(r: &mut impl BufRead) -> Result<String, ApiClientError> {
    let mut l = Vec::new();
    r.by_ref().take(MAX_LINE as u64).read_until(b'\n', &mut l)?;
    if !l.ends_with(b"\n") {
        return Err(ApiClientError::BadAnswer("a line cut short".into()));
    }
    Ok(String::from_utf8_lossy(&l).trim_end().to_owned())
}

/// Reads an answer's head, then copies its body (plain, or chunked) to
/// `out`, flushing after each piece; the status.
fn read_answer(r: &mut impl BufRead, out: &mut dyn Write) -> Result<u16, ApiClientError> {
    let status = line(r)?
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| ApiClientError::BadAnswer("no status line".into()))?;
    let mut chunked = false;
    loop {
        let l = line(r)?;
        if l.is_empty() {
            break;
        }
        let l = l.to_ascii_lowercase();
        if l.starts_with("transfer-encoding:") && l.contains("chunked") {
            chunked = true;
        }
    }
    let mut buf = vec![0u8; 64 * 1024];
    if !chunked {
        loop {
            let n = r.read(&mut buf)?;
            if n == 0 {
                return Ok(status);
            }
            out.write_all(&buf[..n])?;
            out.flush()?;
        }
    }
    let bad = || ApiClientError::BadAnswer("bad chunked body".into());
    loop {
        let size = line(r)?;
        let size = size.split(';').next().unwrap_or("").trim();
        let mut left = usize::from_str_radix(size, 16).map_err(|_| bad())?;
        if left == 0 {
            return Ok(status);
        }
        while left > 0 {
            let n = r.read(&mut buf[..left.min(64 * 1024)])?;
            if n == 0 {
                return Err(bad());
            }
            out.write_all(&buf[..n])?;
            left -= n;
        }
        out.flush()?;
        if !line(r)?.is_empty() {
            return Err(bad());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(raw: &[u8]) -> Result<(u16, Vec<u8>), ApiClientError> {
        let mut out = Vec::new();
        let status = read_answer(&mut &raw[..], &mut out)?;
        Ok((status, out))
    }

    #[test]
    fn answers_are_read_plain_and_chunked() {
        let (status, body) = read(b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\n{}").unwrap();
        assert_eq!((status, body.as_slice()), (201, &b"{}"[..]));
        let (_, body) = read(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!(body, b"abcde");
        assert!(read(b"HTTP/1.1 200 OK\r\n").is_err());
        assert!(read(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n").is_err());
        assert!(read(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab").is_err());
        assert!(read(b"garbage\r\n\r\n").is_err());
    }
}
