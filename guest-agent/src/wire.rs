//! Frames on tokio byte streams: a cancel-safe reader and a writer, used by the agent and
//! the host client alike.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::protocol::{self, Frame, Header, Message, ProtocolError, HEADER_LEN};

/// Extra bytes read past the frame being assembled, to batch small frames per syscall.
const READ_AHEAD: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("Connection failed")]
    Io(#[source] io::Error),
    #[error("Connection closed in the middle of a frame")]
    Truncated,
    /// The stream's framing is broken (bad magic, other version, oversized length): the
    /// connection cannot go on.
    #[error("Protocol violation")]
    Protocol(#[source] ProtocolError),
    /// One well-framed frame could not be decoded (unknown kind, malformed payload); it
    /// was skipped and the stream is still in step.
    #[error("Bad frame for request {request_id}")]
    BadFrame {
        request_id: u64,
        #[source]
        source: ProtocolError,
    },
}

impl From<io::Error> for WireError {
    fn from(e: io::Error) -> Self {
        WireError::Io(e)
    }
}

impl From<ProtocolError> for WireError {
    fn from(e: ProtocolError) -> Self {
        WireError::Protocol(e)
    }
}

/// Reads frames from `R`. Its buffer never holds more than one maximal frame plus
/// [`READ_AHEAD`] bytes: every length is checked (by [`protocol::decode`]) before the
/// bytes it announces are awaited.
pub struct FrameReader<R> {
    inner: R,
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            buf: Vec::new(),
            start: 0,
            end: 0,
        }
    }

    /// Bytes received but not yet returned as frames.
    pub fn buffered(&self) -> usize {
        self.end - self.start
    }

    pub fn get_ref(&self) -> &R {
        &self.inner
    }

    pub fn into_inner(self) -> R {
        self.inner
    }

    /// The stream and the bytes already read from it past the last frame returned
    /// (for a connection that stops carrying frames, as after `PortConnect`).
    pub fn into_parts(self) -> (R, Vec<u8>) {
        let rest = self.buf[self.start..self.end].to_vec();
        (self.inner, rest)
    }

    /// The next frame, or `None` at a clean end of stream (between frames).
    ///
    /// Cancel-safe: dropping the future loses no bytes, the next call goes on where the
    /// last one stopped.
    pub async fn next(&mut self) -> Result<Option<Frame>, WireError> {
        loop {
            let have = &self.buf[self.start..self.end];
            let need = match protocol::decode(have) {
                Ok(Some((frame, used))) => {
                    self.start += used;
                    return Ok(Some(frame));
                }
                Ok(None) => match have.first_chunk::<HEADER_LEN>() {
                    // decode() checked this header, so len is bounded.
                    Some(raw) => HEADER_LEN + Header::parse(raw)?.len as usize,
                    None => HEADER_LEN,
                },
                Err(
                    source @ (ProtocolError::UnknownKind(_)
                    | ProtocolError::Payload { .. }
                    | ProtocolError::TrailingBytes { .. }),
                ) => {
                    // A complete, well-framed frame: skip it and report it.
                    let raw = have
                        .first_chunk::<HEADER_LEN>()
                        .ok_or(WireError::Truncated)?;
                    let hdr = Header::parse(raw)?;
                    self.start += HEADER_LEN + hdr.len as usize;
                    return Err(WireError::BadFrame {
                        request_id: hdr.request_id,
                        source,
                    });
                }
                Err(e) => return Err(WireError::Protocol(e)),
            };
            self.fill(need).await?;
        }
    }

    /// Reads at least one more byte, making room for `need` bytes from `start`.
    async fn fill(&mut self, need: usize) -> Result<(), WireError> {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let want = need.max(self.end + READ_AHEAD);
        if self.buf.len() < want {
            self.buf.resize(want, 0);
        }
        let n = self.inner.read(&mut self.buf[self.end..want]).await?;
        if n == 0 {
            return Err(if self.end == 0 {
                WireError::Io(io::ErrorKind::UnexpectedEof.into())
            } else {
                WireError::Truncated
            });
        }
        self.end += n;
        Ok(())
    }

    /// Like [`next`](Self::next), but a clean end of stream is `Ok(None)` rather than an
    /// error only when no byte of a next frame has arrived.
    pub async fn next_or_eof(&mut self) -> Result<Option<Frame>, WireError> {
        match self.next().await {
            Err(WireError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(None),
            other => other,
        }
    }
}

/// Writes one frame.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    request_id: u64,
    msg: &Message,
) -> Result<(), WireError> {
    let bytes = protocol::encode(request_id, msg)?;
    w.write_all(&bytes).await?;
    w.flush().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{kind, Bytes, Ping, ReadData, MAX_PAYLOAD};

    #[tokio::test]
    async fn reads_frames_split_anyhow_and_stops_cleanly() {
        let mut stream = Vec::new();
        for i in 0..50u64 {
            let msg: Message = ReadData {
                data: Bytes::from(vec![i as u8; (i as usize) * 997]),
            }
            .into();
            stream.extend(protocol::encode(i, &msg).unwrap());
        }
        let (mut a, b) = tokio::io::duplex(333);
        let writer = tokio::spawn(async move {
            for piece in stream.chunks(101) {
                a.write_all(piece).await.unwrap();
            }
        });
        let mut r = FrameReader::new(b);
        for i in 0..50u64 {
            let f = r.next_or_eof().await.unwrap().unwrap();
            assert_eq!(f.request_id, i);
            assert_eq!(f.msg.kind(), kind::ReadData);
        }
        writer.await.unwrap();
        assert!(r.next_or_eof().await.unwrap().is_none());
    }

    #[tokio::test]
    async fn eof_inside_a_frame_is_truncation() {
        let bytes = protocol::encode(1, &Ping {}.into()).unwrap();
        let mut r = FrameReader::new(&bytes[..HEADER_LEN - 1]);
        assert!(matches!(r.next().await, Err(WireError::Truncated)));
    }

    #[tokio::test]
    async fn huge_length_claim_is_refused_without_reading_on() {
        let mut raw = protocol::encode(1, &Ping {}.into()).unwrap();
        raw[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        let mut r = FrameReader::new(&raw[..]);
        assert!(matches!(
            r.next().await,
            Err(WireError::Protocol(ProtocolError::TooLarge { .. }))
        ));
        assert!(r.buf.len() <= HEADER_LEN + READ_AHEAD + MAX_PAYLOAD as usize);
    }

    #[tokio::test]
    async fn bad_frames_are_skipped() {
        let hdr = Header {
            kind: 0x7eee,
            request_id: 5,
            len: 3,
        };
        let mut raw = hdr.to_bytes().to_vec();
        raw.extend_from_slice(&[1, 2, 3]);
        raw.extend(protocol::encode(6, &Ping {}.into()).unwrap());
        let mut r = FrameReader::new(&raw[..]);
        assert!(matches!(
            r.next().await,
            Err(WireError::BadFrame {
                request_id: 5,
                source: ProtocolError::UnknownKind(0x7eee)
            })
        ));
        assert_eq!(r.next().await.unwrap().unwrap().request_id, 6);
    }
}
