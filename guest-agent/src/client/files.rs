//! File requests from the host: listings, chunked reads and writes.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::{list_entry_bytes, unexpected, Client, ClientError, Conn};
use crate::protocol::{
    Bytes, FileInfo, List, Message, Read, Write, WriteData, WriteEnd, WriteMode, MAX_CHUNK,
};

/// How [`Client::write_file`] opens the file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteOptions {
    pub mode: WriteMode,
    /// Permission bits of a created file (default 0o644).
    pub perm: Option<u32>,
}

/// A file being read: chunks as they arrive. Dropping it early closes its connection.
///
/// The agent may send at most the length asked for, in chunks of at most
/// [`MAX_CHUNK`] bytes: a chunk past either bound fails with [`ClientError::Overrun`]
/// (or [`ClientError::Unexpected`] for an oversized chunk) before it is handed out, and
/// the connection is dropped.
pub struct FileReader {
    client: Client,
    conn: Option<Conn>,
    request_id: u64,
    /// Most bytes this read may yield (`u64::MAX` for a read to the end).
    asked: u64,
    received: u64,
    eof: bool,
}

impl FileReader {
    /// The next chunk, or `None` once the agent has sent everything asked for.
    pub async fn next_chunk(&mut self) -> Result<Option<Vec<u8>>, ClientError> {
        let Some(conn) = self.conn.as_mut() else {
            return Ok(None);
        };
        let limit = self.client.config().request_timeout;
        let msg = match conn.recv(self.request_id, limit).await {
            Ok(m) => m,
            Err(e) => {
                self.conn = None;
                self.client.reset_pool();
                return Err(e);
            }
        };
        match msg {
            Message::ReadData(d) => {
                let n = d.data.len() as u64;
                let got = self.received.saturating_add(n);
                // The agent never sends an empty chunk: refusing one bounds the frames
                // of a read by its length, not only its bytes.
                let bad = if n == 0 || n > MAX_CHUNK as u64 {
                    Some(ClientError::Unexpected {
                        expected: "a read chunk of 1 to MAX_CHUNK bytes",
                        got: format!("a chunk of {n} bytes"),
                    })
                } else if got > self.asked {
                    Some(ClientError::Overrun {
                        asked: self.asked,
                        got,
                    })
                } else {
                    None
                };
                if let Some(e) = bad {
                    // The rest of the answer is not read: the connection goes.
                    self.conn = None;
                    self.client.reset_pool();
                    return Err(e);
                }
                self.received = got;
                Ok(Some(d.data.into_vec()))
            }
            Message::ReadEnd(end) => {
                if let Some(conn) = self.conn.take() {
                    self.client.checkin(conn);
                }
                if end.bytes != self.received {
                    return Err(ClientError::Unexpected {
                        expected: "a ReadEnd counting the bytes sent",
                        got: format!("ReadEnd of {} bytes after {}", end.bytes, self.received),
                    });
                }
                self.eof = end.eof;
                Ok(None)
            }
            m => {
                // An error answer ends the request cleanly; anything else does not.
                let clean = matches!(m, Message::ErrorMsg(_));
                if let Some(conn) = self.conn.take().filter(|_| clean) {
                    self.client.checkin(conn);
                }
                Err(unexpected("ReadData or ReadEnd", m))
            }
        }
    }

    /// Bytes received so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// The read ended at the end of the file (known after the last chunk).
    pub fn hit_eof(&self) -> bool {
        self.eof
    }
}

impl Client {
    /// Lists a directory: at most [`max_list_entries`](super::ClientConfig) entries
    /// holding at most [`max_list_bytes`](super::ClientConfig) bytes
    /// ([`list_entry_bytes`] each), else [`ClientError::TooLarge`].
    pub async fn list(&self, path: &str) -> Result<Vec<FileInfo>, ClientError> {
        let limit = self.config().request_timeout;
        let max = self.config().max_list_entries;
        let max_bytes = self.config().max_list_bytes;
        let req: Message = List { path: path.into() }.into();
        self.with_conn(async |c: &mut Conn| {
            let id = c.send(&req).await?;
            let mut all = Vec::new();
            let mut bytes = 0usize;
            loop {
                match c.recv(id, limit).await? {
                    // A batch with more to follow is never empty: refusing one bounds
                    // the frames of a listing by its entries, not only its bytes.
                    Message::Entries(e) if e.more && e.entries.is_empty() => {
                        return Err(ClientError::Unexpected {
                            expected: "a batch of entries",
                            got: "an empty Entries with more to follow".into(),
                        })
                    }
                    Message::Entries(e) => {
                        // Mid-answer: with_conn drops this connection.
                        if all.len().saturating_add(e.entries.len()) > max {
                            return Err(ClientError::TooLarge {
                                what: "the directory listing",
                                limit: max as u64,
                            });
                        }
                        bytes = e
                            .entries
                            .iter()
                            .fold(bytes, |b, i| b.saturating_add(list_entry_bytes(i)));
                        if bytes > max_bytes {
                            return Err(ClientError::TooLarge {
                                what: "the directory listing's size in bytes",
                                limit: max_bytes as u64,
                            });
                        }
                        all.extend(e.entries);
                        if !e.more {
                            return Ok(all);
                        }
                    }
                    m => return Err(unexpected("Entries", m)),
                }
            }
        })
        .await
    }

    /// Starts reading `len` bytes (to the end if `None`) of `path` from `offset`.
    pub async fn read_file(
        &self,
        path: &str,
        offset: u64,
        len: Option<u64>,
    ) -> Result<FileReader, ClientError> {
        let mut conn = self.checkout().await?;
        let req = Read {
            path: path.into(),
            offset,
            len,
        };
        let request_id = match conn.send(&req.into()).await {
            Ok(id) => id,
            Err(e) => {
                self.reset_pool();
                return Err(e);
            }
        };
        Ok(FileReader {
            client: self.clone(),
            conn: Some(conn),
            request_id,
            asked: len.unwrap_or(u64::MAX),
            received: 0,
            eof: false,
        })
    }

    /// Reads all of `path`, refusing files over `max` bytes.
    pub async fn read_to_vec(&self, path: &str, max: usize) -> Result<Vec<u8>, ClientError> {
        let mut r = self
            .read_file(path, 0, Some((max as u64).saturating_add(1)))
            .await?;
        let mut out = Vec::new();
        while let Some(chunk) = r.next_chunk().await? {
            if out.len() + chunk.len() > max {
                return Err(ClientError::TooLarge {
                    what: "the file",
                    limit: max as u64,
                });
            }
            out.extend_from_slice(&chunk);
        }
        Ok(out)
    }

    /// Copies `path` into `out` chunk by chunk; the number of bytes copied. A file
    /// over `max` bytes fails with [`ClientError::TooLarge`], and nothing past `max`
    /// bytes is written to `out`.
    pub async fn download<W: AsyncWrite + Unpin>(
        &self,
        path: &str,
        out: &mut W,
        max: u64,
    ) -> Result<u64, ClientError> {
        let mut r = self.read_file(path, 0, Some(max.saturating_add(1))).await?;
        let mut copied = 0u64;
        while let Some(chunk) = r.next_chunk().await? {
            copied = copied.saturating_add(chunk.len() as u64);
            if copied > max {
                return Err(ClientError::TooLarge {
                    what: "the file",
                    limit: max,
                });
            }
            out.write_all(&chunk).await.map_err(ClientError::Io)?;
        }
        out.flush().await.map_err(ClientError::Io)?;
        Ok(r.received())
    }

    /// Writes everything `data` yields to `path`, in chunks; the number of bytes written.
    pub async fn write_file<R: AsyncRead + Unpin>(
        &self,
        path: &str,
        opts: WriteOptions,
        data: &mut R,
    ) -> Result<u64, ClientError> {
        let limit = self.config().request_timeout;
        let req: Message = Write {
            path: path.into(),
            mode: opts.mode,
            perm: opts.perm,
        }
        .into();
        self.with_conn(async |c: &mut Conn| {
            let id = c.send(&req).await?;
            match c.recv(id, limit).await? {
                Message::Done(_) => {}
                m => return Err(unexpected("Done", m)),
            }
            let mut buf = vec![0u8; MAX_CHUNK];
            loop {
                // On a read error with_conn drops the connection, which ends the write
                // on the agent's side.
                let n = data.read(&mut buf).await.map_err(ClientError::Io)?;
                if n == 0 {
                    break;
                }
                let chunk = WriteData {
                    data: Bytes::from(buf[..n].to_vec()),
                };
                tokio::time::timeout(limit, c.send_as(id, &chunk.into()))
                    .await
                    .map_err(|_| ClientError::Timeout(limit))??;
            }
            c.send_as(id, &WriteEnd {}.into()).await?;
            match c.recv(id, limit).await? {
                Message::Written(w) => Ok(w.bytes),
                m => Err(unexpected("Written", m)),
            }
        })
        .await
    }

    /// Writes `bytes` to `path` (create or truncate).
    pub async fn write_bytes(&self, path: &str, bytes: &[u8]) -> Result<u64, ClientError> {
        let mut r = bytes;
        self.write_file(path, WriteOptions::default(), &mut r).await
    }
}
