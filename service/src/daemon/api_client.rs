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

/// A request body read as it is sent (a file's bytes, of any size).
pub struct Upload {
    pub reader: Box<dyn Read + Send>,
    /// Exactly this many bytes are sent (`Content-Length`): a reader that
    /// ends sooner fails the request.
    pub len: u64,
    pub content_type: String,
}

/// An answer whose head has been read; its body is still on the wire.
pub struct Answer {
    pub status: u16,
    status_line: String,
    /// The header lines as sent.
    raw_headers: Vec<String>,
    chunked: bool,
    reader: BufReader<TcpStream>,
    /// A clone of the connection, to cut it once the answer is read (a
    /// writer the server stopped reading from must not hang).
    conn: TcpStream,
    writer: Option<std::thread::JoinHandle<Result<(), BodyError>>>,
}

/// Why a request body was not sent whole.
enum BodyError {
    /// Its reader failed, or ended before its length: the request is bad
    /// whatever the server answered.
    Source(std::io::Error),
    /// The connection failed (a server may answer early and close).
    Sink(std::io::Error),
}

impl From<BodyError> for ApiClientError {
    fn from(e: BodyError) -> Self {
        match e {
            BodyError::Source(e) | BodyError::Sink(e) => e.into(),
        }
    }
}

fn send_body(mut u: Upload, w: &mut impl Write) -> Result<(), BodyError> {
    let mut buf = vec![0u8; 256 * 1024];
    let mut left = u.len;
    while left > 0 {
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = match u.reader.read(&mut buf[..want]) {
            Ok(0) => {
                return Err(BodyError::Source(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!(
                        "the body ended after {} of its {} bytes",
                        u.len - left,
                        u.len
                    ),
                )))
            }
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(BodyError::Source(e)),
        };
        w.write_all(&buf[..n]).map_err(BodyError::Sink)?;
        left -= n as u64;
    }
    w.flush().map_err(BodyError::Sink)
}

impl Answer {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.raw_headers.iter().find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }

    /// Copies the body to `out` as it arrives, flushing after each piece.
    /// A chunked body cut short is an error (a transfer that failed part
    /// way), as is a request body that could not be sent whole.
    pub fn copy_to(mut self, out: &mut dyn Write) -> Result<(), ApiClientError> {
        let body = copy_body(&mut self.reader, self.chunked, out);
        let _ = self.conn.shutdown(std::net::Shutdown::Both);
        let wrote = self.writer.take().map(|h| {
            h.join()
                .unwrap_or_else(|_| Err(BodyError::Source(std::io::ErrorKind::Other.into())))
        });
        match (body, wrote) {
            (_, Some(Err(BodyError::Source(e)))) => Err(e.into()),
            // A server may answer (a 413, a 404) before it has read the
            // whole request body, and then close: the answer is what counts.
            (Ok(()), _) => Ok(()),
            (Err(_), Some(Err(e))) => Err(e.into()),
            (Err(e), _) => Err(e),
        }
    }
}

/// Sends `req`, copies the answer's body (after its status line and headers
/// if asked) to `out` as it arrives, and returns the answer's status.
pub fn request(req: &Request<'_>, out: &mut dyn Write) -> Result<u16, ApiClientError> {
    let upload = req.body.map(|b| Upload {
        reader: Box::new(std::io::Cursor::new(b.to_vec())),
        len: b.len() as u64,
        content_type: "application/json".into(),
    });
    let a = open(req, upload)?;
    if req.include {
        let _ = out.write_all(&a.head_text());
    }
    let status = a.status;
    a.copy_to(out)?;
    Ok(status)
}

/// Sends `req` (its body from `upload` when given, else `req.body`) and
/// reads the answer's head.
pub fn open(req: &Request<'_>, upload: Option<Upload>) -> Result<Answer, ApiClientError> {
    let Request {
        addr,
        method,
        path,
        body,
        headers,
        include: _,
        timeout,
    } = *req;
    for h in headers {
        if !h.contains(':') || h.contains('\r') || h.contains('\n') {
            return Err(ApiClientError::BadHeader(h.clone()));
        }
    }
    let upload = upload.or_else(|| {
        body.map(|b| Upload {
            reader: Box::new(std::io::Cursor::new(b.to_vec())),
            len: b.len() as u64,
            content_type: "application/json".into(),
        })
    });
    let mut s = TcpStream::connect(addr).map_err(|e| ApiClientError::Connect(addr.into(), e))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for h in headers {
        head.push_str(h);
        head.push_str("\r\n");
    }
    if let Some(u) = &upload {
        if u.content_type.contains(['\r', '\n']) {
            return Err(ApiClientError::BadHeader(u.content_type.clone()));
        }
        head.push_str(&format!(
            "Content-Type: {}\r\nContent-Length: {}\r\n",
            u.content_type, u.len
        ));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes())?;
    // The body is written beside the read: a server may answer (a 413)
    // before it has read it all, and then close.
    let writer = match upload {
        Some(u) => {
            let mut w = s.try_clone()?;
            Some(std::thread::spawn(move || {
                let r = send_body(u, &mut w);
                if matches!(r, Err(BodyError::Source(_))) {
                    // The server must not wait for the rest.
                    let _ = w.shutdown(std::net::Shutdown::Write);
                }
                r
            }))
        }
        None => None,
    };
    let conn = s.try_clone()?;
    let mut reader = BufReader::new(s);
    match read_head(&mut reader) {
        Ok(h) => Ok(Answer {
            status: h.status,
            status_line: h.status_line,
            raw_headers: h.raw,
            chunked: h.chunked,
            reader,
            conn,
            writer,
        }),
        Err(e) => {
            let _ = conn.shutdown(std::net::Shutdown::Both);
            match writer.map(|h| h.join()) {
                Some(Ok(Err(w))) => Err(w.into()),
                _ => Err(e),
            }
        }
    }
}

impl Answer {
    /// The status line and headers as `sprout api --include` prints them.
    fn head_text(&self) -> Vec<u8> {
        let mut t = self.status_line.clone();
        t.push('\n');
        for l in &self.raw_headers {
            t.push_str(l);
            t.push('\n');
        }
        t.push('\n');
        t.into_bytes()
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

/// What [`read_head`] reads: the status line, the header lines as sent,
/// and whether the body is chunked.
struct Head {
    status: u16,
    status_line: String,
    raw: Vec<String>,
    chunked: bool,
}

/// Reads an answer's status line and headers.
fn read_head(r: &mut impl BufRead) -> Result<Head, ApiClientError> {
    let status_line = line(r)?;
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| ApiClientError::BadAnswer("no status line".into()))?;
    let mut chunked = false;
    let mut raw = Vec::new();
    loop {
        let l = line(r)?;
        if l.is_empty() {
            break;
        }
        if raw.len() >= 256 {
            return Err(ApiClientError::BadAnswer("too many headers".into()));
        }
        let low = l.to_ascii_lowercase();
        if low.starts_with("transfer-encoding:") && low.contains("chunked") {
            chunked = true;
        }
        raw.push(l);
    }
    Ok(Head {
        status,
        status_line,
        raw,
        chunked,
    })
}

/// Copies a body (plain, or chunked) to `out`, flushing after each piece.
fn copy_body(
    r: &mut impl BufRead,
    chunked: bool,
    out: &mut dyn Write,
) -> Result<(), ApiClientError> {
    let mut buf = vec![0u8; 64 * 1024];
    if !chunked {
        loop {
            let n = r.read(&mut buf)?;
            if n == 0 {
                return Ok(());
            }
            out.write_all(&buf[..n])?;
            out.flush()?;
        }
    }
    let bad = || ApiClientError::BadAnswer("the body was cut short".into());
    loop {
        let size = line(r).map_err(|_| bad())?;
        let size = size.split(';').next().unwrap_or("").trim();
        let mut left = usize::from_str_radix(size, 16).map_err(|_| bad())?;
        if left == 0 {
            return Ok(());
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
        if !line(r).map_err(|_| bad())?.is_empty() {
            return Err(bad());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(raw: &[u8]) -> Result<(u16, Vec<u8>), ApiClientError> {
        let mut out = Vec::new();
        let mut r = raw;
        let h = read_head(&mut r)?;
        copy_body(&mut r, h.chunked, &mut out)?;
        Ok((h.status, out))
    }

    /// A server on loopback that reads a request with a body and answers
    /// with the body's length and first byte.
    fn server(answer_early: bool) -> (String, std::thread::JoinHandle<u64>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let h = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut len = 0u64;
            loop {
                let l = line(&mut r).unwrap();
                if l.is_empty() {
                    break;
                }
                if let Some(v) = l.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap();
                }
            }
            let mut w = s;
            if answer_early {
                w.write_all(b"HTTP/1.1 413 Too Big\r\ncontent-length: 0\r\n\r\n")
                    .unwrap();
                // As an HTTP server does: the answer goes out whole, then the
                // rest of the body is read and dropped until the client goes
                // (closing with unread bytes would reset the connection, and
                // the client could lose the answer).
                let _ = w.shutdown(std::net::Shutdown::Write);
                let _ = std::io::copy(&mut r, &mut std::io::sink());
                return 0;
            }
            let got = std::io::copy(&mut r.take(len), &mut std::io::sink()).unwrap();
            let body = format!("{got}");
            write!(
                w,
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nX-Got: {got}\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            got
        });
        (addr, h)
    }

    fn req(addr: &str) -> Request<'_> {
        Request {
            addr,
            method: "PUT",
            path: "/f",
            body: None,
            headers: &[],
            include: false,
            timeout: Duration::from_secs(30),
        }
    }

    #[test]
    fn an_upload_is_streamed_whole_and_an_early_answer_ends_it() {
        let (addr, h) = server(false);
        let len = 5 << 20;
        let up = Upload {
            reader: Box::new(std::io::repeat(7).take(len)),
            len,
            content_type: "application/octet-stream".into(),
        };
        let a = open(&req(&addr), Some(up)).unwrap();
        assert_eq!((a.status, a.header("x-got")), (200, Some("5242880")));
        let mut out = Vec::new();
        a.copy_to(&mut out).unwrap();
        assert_eq!(out, b"5242880");
        assert_eq!(h.join().unwrap(), len);

        // A reader shorter than its length fails the request.
        let (addr, _h) = server(false);
        let up = Upload {
            reader: Box::new(std::io::repeat(7).take(10)),
            len: 20,
            content_type: "application/octet-stream".into(),
        };
        let r = open(&req(&addr), Some(up)).and_then(|a| a.copy_to(&mut std::io::sink()));
        assert!(r.is_err());

        // A server that answers before reading the body: its answer, at once.
        let (addr, h) = server(true);
        let up = Upload {
            reader: Box::new(std::io::repeat(7).take(1 << 30)),
            len: 1 << 30,
            content_type: "application/octet-stream".into(),
        };
        let a = open(&req(&addr), Some(up)).unwrap();
        assert_eq!(a.status, 413);
        a.copy_to(&mut std::io::sink()).unwrap();
        h.join().unwrap();
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
        let mut r = &b"HTTP/1.1 200 OK\r\nX-Truncated: true\r\n\r\nab"[..];
        let h = read_head(&mut r).unwrap();
        assert_eq!(h.raw, ["X-Truncated: true"]);
        assert_eq!(h.status_line, "HTTP/1.1 200 OK");
    }
}
