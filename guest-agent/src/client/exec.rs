//! Exec from the host: a streaming session on a connection of its own.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::Mutex;
use tokio::time::{timeout_at, Instant};

use super::{unexpected, Client, ClientError};
use crate::protocol::{
    Bytes, Exec, Exit, Message, StdinClose, StdinData, StdinMode, StreamKind, MAX_CHUNK,
};
use crate::wire::{write_frame, FrameReader};

/// One event of a running exec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExecEvent {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    /// The last event.
    Exit(Exit),
}

/// A finished exec's output, collected.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExecOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// The exit event; its `*_truncated` flags are also set when the client's own cap
    /// cut a stream.
    pub exit: Exit,
}

/// A running exec. Dropping it before the exit closes the connection, and the agent
/// kills the exec's process group.
pub struct ExecSession {
    pub exec_id: u64,
    pub pid: u32,
    request_id: u64,
    reader: FrameReader<OwnedReadHalf>,
    /// Shared with the stdin writer: the socket closes when both are dropped.
    _writer: Arc<Mutex<OwnedWriteHalf>>,
    stdin: Option<ExecStdin>,
    /// The client deadline, and how long after the start it was.
    deadline: Option<(Instant, Duration)>,
    finished: bool,
}

/// The stdin of an exec started with [`StdinMode::Stream`]. Call
/// [`close`](Self::close) when done; dropping it unclosed closes stdin in the
/// background (inside a tokio runtime).
pub struct ExecStdin {
    request_id: u64,
    writer: Arc<Mutex<OwnedWriteHalf>>,
    closed: bool,
}

impl ExecStdin {
    /// Sends `data` (in frames of at most [`MAX_CHUNK`] bytes). Waits while the process
    /// does not read.
    pub async fn write(&mut self, data: &[u8]) -> Result<(), ClientError> {
        let mut w = self.writer.lock().await;
        for chunk in data.chunks(MAX_CHUNK) {
            let msg = StdinData {
                data: Bytes::from(chunk.to_vec()),
            };
            write_frame(&mut *w, self.request_id, &msg.into()).await?;
        }
        Ok(())
    }

    /// Closes the process's stdin (it reads end of file).
    pub async fn close(mut self) -> Result<(), ClientError> {
        self.closed = true;
        let mut w = self.writer.lock().await;
        write_frame(&mut *w, self.request_id, &StdinClose {}.into()).await?;
        Ok(())
    }
}

impl Drop for ExecStdin {
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        let (writer, id) = (self.writer.clone(), self.request_id);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let mut w = writer.lock().await;
                let _ = write_frame(&mut *w, id, &StdinClose {}.into()).await;
            });
        }
    }
}

impl ExecSession {
    /// The stdin writer, once, for an exec started with [`StdinMode::Stream`].
    pub fn take_stdin(&mut self) -> Option<ExecStdin> {
        self.stdin.take()
    }

    /// The next event, or `None` after the exit.
    pub async fn next_event(&mut self) -> Result<Option<ExecEvent>, ClientError> {
        if self.finished {
            return Ok(None);
        }
        let frame = match self.deadline {
            Some((at, after)) => timeout_at(at, self.reader.next())
                .await
                .map_err(|_| ClientError::Timeout(after))??,
            None => self.reader.next().await?,
        };
        let frame = frame.ok_or(ClientError::Disconnected)?;
        if frame.request_id != self.request_id {
            return Err(ClientError::Unexpected {
                expected: "an event of this exec",
                got: format!("{} for request {}", frame.msg.name(), frame.request_id),
            });
        }
        match frame.msg {
            Message::Output(o) => Ok(Some(match o.stream {
                StreamKind::Stdout => ExecEvent::Stdout(o.data.into_vec()),
                StreamKind::Stderr => ExecEvent::Stderr(o.data.into_vec()),
            })),
            Message::Exit(e) => {
                self.finished = true;
                Ok(Some(ExecEvent::Exit(e)))
            }
            m => {
                self.finished = true;
                Err(unexpected("Output or Exit", m))
            }
        }
    }

    /// Reads every event to the exit, keeping at most `max_per_stream` bytes of each
    /// stream (the rest is dropped and marked truncated).
    pub async fn collect(mut self, max_per_stream: usize) -> Result<ExecOutput, ClientError> {
        let mut out = ExecOutput::default();
        let (mut cut_out, mut cut_err) = (false, false);
        let keep = |buf: &mut Vec<u8>, data: Vec<u8>, cut: &mut bool| {
            let room = max_per_stream.saturating_sub(buf.len());
            if data.len() > room {
                *cut = true;
            }
            buf.extend_from_slice(&data[..data.len().min(room)]);
        };
        while let Some(ev) = self.next_event().await? {
            match ev {
                ExecEvent::Stdout(d) => keep(&mut out.stdout, d, &mut cut_out),
                ExecEvent::Stderr(d) => keep(&mut out.stderr, d, &mut cut_err),
                ExecEvent::Exit(e) => out.exit = e,
            }
        }
        out.exit.stdout_truncated |= cut_out;
        out.exit.stderr_truncated |= cut_err;
        Ok(out)
    }
}

impl Client {
    /// Starts `req` on a new connection and returns once the agent has spawned it. A
    /// foreground exec only: one with `background` set is refused with
    /// [`ClientError::Misuse`] (see [`Client::exec_background`]).
    pub async fn exec(&self, req: Exec) -> Result<ExecSession, ClientError> {
        if req.background {
            return Err(ClientError::Misuse(
                "Client::exec runs a foreground exec: use exec_background for a background one",
            ));
        }
        let cfg = self.config();
        let streaming = matches!(req.stdin, StdinMode::Stream);
        let deadline = req.timeout_ms.map(|ms| {
            let after = Duration::from_millis(ms) + cfg.request_timeout;
            (Instant::now() + after, after)
        });
        let mut conn = self.connect().await?;
        let id = conn.send(&req.into()).await?;
        let (exec_id, pid) = match conn.recv(id, cfg.request_timeout).await? {
            Message::ExecStarted(s) => (s.exec_id, s.pid),
            m => return Err(unexpected("ExecStarted", m)),
        };
        let writer = Arc::new(Mutex::new(conn.writer));
        let stdin = streaming.then(|| ExecStdin {
            request_id: id,
            writer: writer.clone(),
            closed: false,
        });
        Ok(ExecSession {
            exec_id,
            pid,
            request_id: id,
            reader: conn.reader,
            _writer: writer,
            stdin,
            deadline,
            finished: false,
        })
    }

    /// Runs `req` to its end, feeding it `stdin` (streamed, so any size) if given, and
    /// keeping at most `max_per_stream` bytes of each output stream.
    pub async fn exec_output(
        &self,
        mut req: Exec,
        stdin: Option<Vec<u8>>,
        max_per_stream: usize,
    ) -> Result<ExecOutput, ClientError> {
        if stdin.is_some() {
            req.stdin = StdinMode::Stream;
        }
        let mut session = self.exec(req).await?;
        let feeder = match (stdin, session.take_stdin()) {
            (Some(data), Some(mut w)) => Some(tokio::spawn(async move {
                // The process may stop reading early: its exit tells, not this.
                if w.write(&data).await.is_ok() {
                    let _ = w.close().await;
                }
            })),
            _ => None,
        };
        let out = session.collect(max_per_stream).await;
        if let Some(f) = feeder {
            f.abort();
        }
        out
    }
}
