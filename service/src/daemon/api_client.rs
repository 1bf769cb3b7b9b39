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

/// One request of [`request`].
pub struct Request<'a> {
    /// `HOST:PORT`.
    pub addr: &'a str,
    pub method: &'a str,
    pub path: &'a str,
    /// A JSON body.
    pub body: Option<&'a [u8]>,
    /// More headers, `NAME: VALUE`.
    pub headers: &'a [String],
    /// Copy the answer's status line and headers to `out` before its body.
    pub include: bool,
    /// Bounds each read and write.
    pub timeout: Duration,
}

/// Sends `req`, copies the answer's body (after its status line and headers
/// if asked) to `out` as it arrives, and returns the answer's status.
pub fn request(req: &Request<'_>, out: &mut dyn Write) -> Result<u16, ApiClientError> {
    let Request {
        addr,
        method,
        path,
        body,
        headers,
        include,
        timeout,
    } = *req;
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
    // The body is written beside the read: a server may answer (a 413)
    // before it has read it all, and then close.
    let writer = match body {
        Some(b) => {
            let mut w = s.try_clone()?;
            let b = b.to_vec();
            Some(std::thread::spawn(move || w.write_all(&b)))
        }
        None => None,
    };
    let answer = read_answer(&mut BufReader::new(s), include, out);
    let wrote = writer.map(|h| {
        h.join()
            .unwrap_or_else(|_| Err(std::io::ErrorKind::Other.into()))
    });
    match (answer, wrote) {
        (Ok(status), _) => Ok(status),
        (Err(_), Some(Err(e))) => Err(e.into()),
        (Err(e), _) => Err(e),
    }
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
fn read_answer(
    r: &mut impl BufRead,
    include: bool,
    out: &mut dyn Write,
) -> Result<u16, ApiClientError> {
    let first = line(r)?;
    if include {
        writeln!(out, "{first}")?;
    }
    let status = first
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| ApiClientError::BadAnswer("no status line".into()))?;
    let mut chunked = false;
    loop {
        let l = line(r)?;
        if include {
            writeln!(out, "{l}")?;
        }
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
        let status = read_answer(&mut &raw[..], false, &mut out)?;
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
        let mut out = Vec::new();
        let raw = b"HTTP/1.1 200 OK\r\nx-truncated: true\r\n\r\nab";
        read_answer(&mut &raw[..], true, &mut out).unwrap();
        assert_eq!(out, b"HTTP/1.1 200 OK\nx-truncated: true\n\nab");
    }
}
