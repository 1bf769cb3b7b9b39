//! Background processes from the host: start, attach (replay and follow), stdin, list.
//!
//! Signals go through [`Client::kill`], which reaches background processes too.

use std::time::Duration;

use tokio::time::Instant;

use super::{agent_error, clip, unexpected, Client, ClientError, Conn};
use crate::protocol::{
    Attach, Attached, Bytes, Exec, ExecStarted, Exit, Message, ProcInfo, ProcList, ProcStdin,
    StreamKind, MAX_CHUNK, MAX_PROC_COMMAND,
};

/// One event of a background process, as [`ProcStream::next_event`] hands it out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProcEvent {
    Output {
        seq: u64,
        stream: StreamKind,
        data: Vec<u8>,
    },
    /// Events `first_seq..=last_seq` were dropped by the agent's ring before this
    /// reader got them; `bytes` is the output they held, when the agent knows.
    Gap {
        first_seq: u64,
        last_seq: u64,
        bytes: Option<u64>,
    },
    /// The last event.
    Exit { seq: u64, exit: Exit },
}

impl ProcEvent {
    /// The event's sequence number (a gap's last one), for resuming after it.
    pub fn seq(&self) -> u64 {
        match self {
            ProcEvent::Output { seq, .. } | ProcEvent::Exit { seq, .. } => *seq,
            ProcEvent::Gap { last_seq, .. } => *last_seq,
        }
    }
}

/// What [`ProcStream::collect`] gathered.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcCollected {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// Events the agent's ring had dropped, summed over the gaps met.
    pub missed_events: u64,
    /// Output bytes those held, where the agent said; `None` if it could not say for
    /// some gap.
    pub missed_bytes: Option<u64>,
    /// The client's own cap cut stdout or stderr.
    pub truncated: bool,
    /// The exit, if the stream reached it (a stream asked to start past the exit ends
    /// without it).
    pub exit: Option<(u64, Exit)>,
    /// Sequence number of the last event received (0 if none).
    pub last_seq: u64,
}

/// The events of one background process on a connection of its own. Dropping it ends
/// the attach; the process is unaffected.
pub struct ProcStream {
    /// The agent's answer to the attach, before any event.
    pub attached: Attached,
    conn: Conn,
    request_id: u64,
    last_seq: u64,
    finished: bool,
}

impl ProcStream {
    /// The next event (replayed or live), or `None` once the stream has ended (after the
    /// exit). Waits as long as the process is silent; cancel-safe, so it may be wrapped
    /// in a timeout. Every event is checked: numbers only go up, chunks are 1 to
    /// [`MAX_CHUNK`] bytes, nothing follows the exit.
    pub async fn next_event(&mut self) -> Result<Option<ProcEvent>, ClientError> {
        if self.finished {
            return Ok(None);
        }
        let frame = self
            .conn
            .reader
            .next()
            .await?
            .ok_or(ClientError::Disconnected)?;
        let bad = |what: String| ClientError::Unexpected {
            expected: "an event of the attached process",
            got: what,
        };
        if frame.request_id != self.request_id {
            self.finished = true;
            return Err(bad(format!(
                "{} for request {}",
                frame.msg.name(),
                frame.request_id
            )));
        }
        let ev = match frame.msg {
            Message::ProcOutput(o) => ProcEvent::Output {
                seq: o.seq,
                stream: o.stream,
                data: o.data.into_vec(),
            },
            Message::Gap(g) => ProcEvent::Gap {
                first_seq: g.first_seq,
                last_seq: g.last_seq,
                bytes: g.bytes,
            },
            Message::ProcExit(e) => ProcEvent::Exit {
                seq: e.seq,
                exit: e.exit,
            },
            Message::Done(_) => {
                self.finished = true;
                return Ok(None);
            }
            m => {
                self.finished = true;
                return Err(unexpected("ProcOutput, Gap, ProcExit or Done", m));
            }
        };
        let ok = match &ev {
            ProcEvent::Output { seq, data, .. } => {
                *seq > self.last_seq && !data.is_empty() && data.len() <= MAX_CHUNK
            }
            ProcEvent::Gap {
                first_seq,
                last_seq,
                ..
            } => *first_seq > self.last_seq && last_seq >= first_seq,
            ProcEvent::Exit { seq, .. } => *seq > self.last_seq,
        };
        if !ok {
            self.finished = true;
            return Err(bad(format!("{ev:?} after event {}", self.last_seq)));
        }
        self.last_seq = ev.seq();
        Ok(Some(ev))
    }

    /// Reads every event to the end of the stream, keeping at most `max_per_stream`
    /// bytes of each output stream (the rest is dropped and `truncated` set).
    pub async fn collect(mut self, max_per_stream: usize) -> Result<ProcCollected, ClientError> {
        let mut out = ProcCollected {
            missed_bytes: Some(0),
            ..ProcCollected::default()
        };
        let keep = |buf: &mut Vec<u8>, data: &[u8], cut: &mut bool| {
            let room = max_per_stream.saturating_sub(buf.len());
            *cut |= data.len() > room;
            buf.extend_from_slice(&data[..data.len().min(room)]);
        };
        while let Some(ev) = self.next_event().await? {
            out.last_seq = ev.seq();
            match ev {
                ProcEvent::Output {
                    stream: StreamKind::Stdout,
                    data,
                    ..
                } => keep(&mut out.stdout, &data, &mut out.truncated),
                ProcEvent::Output {
                    stream: StreamKind::Stderr,
                    data,
                    ..
                } => keep(&mut out.stderr, &data, &mut out.truncated),
                ProcEvent::Gap {
                    first_seq,
                    last_seq,
                    bytes,
                } => {
                    out.missed_events += last_seq - first_seq + 1;
                    out.missed_bytes = out.missed_bytes.zip(bytes).map(|(a, b)| a + b);
                }
                ProcEvent::Exit { seq, exit } => out.exit = Some((seq, exit)),
            }
        }
        Ok(out)
    }
}

impl Client {
    /// Starts `req` as a background process (`background` is set): it runs on whatever
    /// happens to this client's connections. Returns its exec id and pid at once.
    pub async fn exec_background(&self, mut req: Exec) -> Result<ExecStarted, ClientError> {
        req.background = true;
        match self.unary(req.into()).await? {
            Message::ExecStarted(s) => Ok(s),
            m => Err(unexpected("ExecStarted", m)),
        }
    }

    /// Attaches to background process `exec_id` on a new connection: the kept events
    /// after `after_seq` (all kept if `None`), then live ones to the exit.
    pub async fn attach(
        &self,
        exec_id: u64,
        after_seq: Option<u64>,
    ) -> Result<ProcStream, ClientError> {
        let limit = self.config().request_timeout;
        let mut conn = self.connect().await?;
        let id = conn.send(&Attach { exec_id, after_seq }.into()).await?;
        let attached = match conn.recv(id, limit).await? {
            Message::Attached(a) if a.exec_id == exec_id => a,
            Message::Attached(a) => {
                return Err(ClientError::Unexpected {
                    expected: "Attached for the process asked for",
                    got: format!("Attached for process {}", a.exec_id),
                })
            }
            m => return Err(unexpected("Attached", m)),
        };
        Ok(ProcStream {
            attached,
            conn,
            request_id: id,
            last_seq: after_seq.unwrap_or(0),
            finished: false,
        })
    }

    /// Writes `data` to the stdin of background process `exec_id` (started with
    /// [`StdinMode::Stream`](crate::protocol::StdinMode::Stream)), waiting while it
    /// does not read; fails with [`ClientError::Timeout`] if it takes nothing for
    /// [`request_timeout`](super::ClientConfig::request_timeout).
    pub async fn proc_stdin(&self, exec_id: u64, data: &[u8]) -> Result<(), ClientError> {
        let stall_limit = self.config().request_timeout;
        for chunk in data.chunks(MAX_CHUNK) {
            let mut at = 0;
            let mut progress = Instant::now();
            while at < chunk.len() {
                let took = self.stdin_request(exec_id, &chunk[at..], false).await?;
                if took == 0 {
                    if progress.elapsed() >= stall_limit {
                        return Err(ClientError::Timeout(stall_limit));
                    }
                    // The agent waited (STDIN_WAIT) already; a short pause more.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                } else {
                    progress = Instant::now();
                }
                at += took;
            }
        }
        Ok(())
    }

    /// Closes the stdin of background process `exec_id` (it reads end of file).
    pub async fn proc_stdin_close(&self, exec_id: u64) -> Result<(), ClientError> {
        self.stdin_request(exec_id, &[], true).await.map(|_| ())
    }

    /// One `ProcStdin`; the bytes the process took (never more than sent).
    async fn stdin_request(
        &self,
        exec_id: u64,
        data: &[u8],
        close: bool,
    ) -> Result<usize, ClientError> {
        let req = ProcStdin {
            exec_id,
            data: Bytes::from(data.to_vec()),
            close,
        };
        match self.unary(req.into()).await? {
            Message::Written(w) if w.bytes <= data.len() as u64 => Ok(w.bytes as usize),
            Message::Written(w) => Err(ClientError::Overrun {
                asked: data.len() as u64,
                got: w.bytes,
            }),
            m => Err(unexpected("Written", m)),
        }
    }

    /// The background processes the agent keeps, at most
    /// [`max_procs`](super::ClientConfig::max_procs) of them, commands clipped to
    /// [`MAX_PROC_COMMAND`] bytes.
    pub async fn proc_list(&self) -> Result<Vec<ProcInfo>, ClientError> {
        let limit = self.config().request_timeout;
        let max = self.config().max_procs;
        self.with_conn(async |c: &mut Conn| {
            let id = c.send(&ProcList {}.into()).await?;
            let mut all = Vec::new();
            loop {
                let batch = match c.recv(id, limit).await? {
                    Message::Procs(p) => p,
                    Message::ErrorMsg(e) => return Err(agent_error(e)),
                    m => return Err(unexpected("Procs", m)),
                };
                if batch.procs.is_empty() && batch.more {
                    return Err(ClientError::Unexpected {
                        expected: "a non-empty Procs batch",
                        got: "an empty one with more to come".into(),
                    });
                }
                if all.len() + batch.procs.len() > max {
                    return Err(ClientError::TooLarge {
                        what: "The process listing",
                        limit: max as u64,
                    });
                }
                all.extend(batch.procs.into_iter().map(|mut p| {
                    p.command = clip(p.command, MAX_PROC_COMMAND);
                    p
                }));
                if !batch.more {
                    return Ok(all);
                }
            }
        })
        .await
    }
}
