//! [`Client::open_port`]: a byte stream to a TCP port on the guest's loopback,
//! carried by an agent connection of its own.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::UnixStream;

use super::{unexpected, Client, ClientError, Conn};
use crate::protocol::{Message, PortConnect};

/// A guest TCP connection, through the agent: read and write it as the
/// connection itself. Shutting down its write side ends the guest side's
/// input (a half-close); dropping it closes the guest connection.
pub struct PortStream {
    /// Bytes of the guest's that arrived with the agent's answer.
    early: Vec<u8>,
    at: usize,
    stream: UnixStream,
}

impl Client {
    /// Opens a connection to `port` on the guest's loopback. Refused with
    /// the agent's `Refused` when nothing listens there, and `UnknownKind`
    /// from an agent that predates ports.
    pub async fn open_port(&self, port: u16) -> Result<PortStream, ClientError> {
        let mut conn: Conn = self.connect().await?;
        let id = conn.send(&PortConnect { port }.into()).await?;
        match conn.recv(id, self.inner.config.request_timeout).await? {
            Message::Done(_) => {}
            m => return Err(unexpected("Done", m)),
        }
        let Conn { reader, writer, .. } = conn;
        let (r, early) = reader.into_parts();
        let stream = r
            .reunite(writer)
            .map_err(|_| ClientError::Misuse("a connection's halves did not match"))?;
        Ok(PortStream {
            early,
            at: 0,
            stream,
        })
    }
}

impl AsyncRead for PortStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = &mut *self;
        if me.at < me.early.len() {
            let n = buf.remaining().min(me.early.len() - me.at);
            buf.put_slice(&me.early[me.at..me.at + n]);
            me.at += n;
            if me.at == me.early.len() {
                me.early = Vec::new();
                me.at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut me.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for PortStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
