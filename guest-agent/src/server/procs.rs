//! Background processes: the table the agent keeps them in, and the requests that read
//! their events (`Attach`), feed their stdin (`ProcStdin`) and list them (`ProcList`).
//!
//! A background process is started by `Exec` with `background: true` (see `exec`); from
//! then on it belongs to the agent, not to a connection. Its output goes into its
//! [`Ring`], which any number of attachers read at their own pace: a slow or vanished
//! attacher never holds the process up (it misses what the ring dropped, and is told).
//! Running processes count toward `--max-execs`; finished ones are kept, up to
//! `--max-finished`, the earliest finished evicted first.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, WriteHalf};
use tokio::process::ChildStdin;
use tokio::sync::watch;
use tokio::time::timeout;

use super::ring::{Batch, EventKind, Ring};
use super::{reply_error, Reader, Shared};
use crate::protocol::{
    Attach, Attached, Bytes, Done, ErrorCode, ErrorMsg, Exit, Gap, Message, ProcExit, ProcInfo,
    ProcOutput, ProcStdin, Procs, StreamKind, Written, MAX_CHUNK, MAX_PROC_COMMAND,
};
use crate::wire::{write_frame, WireError};

/// Longest wait for a background process to take a `ProcStdin` chunk; what it has not
/// taken by then is reported as not written.
pub const STDIN_WAIT: Duration = Duration::from_secs(5);
/// Processes per `Procs` frame.
pub const PROC_BATCH: usize = 64;
/// Output bytes an attacher takes from the ring at once (under its lock) before writing.
const ATTACH_BATCH: usize = 256 * 1024;

/// One background process.
pub struct Proc {
    pub exec_id: u64,
    pub pid: u32,
    command: String,
    started_unix_ms: u64,
    ring: Mutex<Ring>,
    /// The ring's next sequence number, for attachers waiting on new events.
    seq: watch::Sender<u64>,
    stdin: tokio::sync::Mutex<Option<ChildStdin>>,
    stdin_open: std::sync::atomic::AtomicBool,
}

impl Proc {
    fn ring(&self) -> MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn push_output(&self, stream: StreamKind, data: &[u8]) {
        let next = {
            let mut r = self.ring();
            r.push_output(stream, data);
            r.next_seq()
        };
        self.seq.send_replace(next);
    }

    pub fn push_exit(&self, exit: Exit) {
        let next = {
            let mut r = self.ring();
            r.push_exit(exit);
            r.next_seq()
        };
        self.seq.send_replace(next);
    }

    fn info(&self) -> ProcInfo {
        let r = self.ring();
        let (dropped_events, dropped_bytes) = r.dropped();
        ProcInfo {
            exec_id: self.exec_id,
            pid: self.pid,
            command: self.command.clone(),
            running: r.exit().is_none(),
            exit: r.exit().cloned(),
            started_unix_ms: self.started_unix_ms,
            stdin_open: self.stdin_open.load(std::sync::atomic::Ordering::Relaxed),
            first_seq: r.first_seq(),
            next_seq: r.next_seq(),
            dropped_events,
            dropped_bytes,
        }
    }

    /// Closes its stdin (the process has exited, or the host asked).
    pub async fn close_stdin(&self) {
        self.stdin_open
            .store(false, std::sync::atomic::Ordering::Relaxed);
        self.stdin.lock().await.take();
    }
}

/// `command` and `argv` joined by spaces, cut at [`MAX_PROC_COMMAND`] bytes.
fn command_line(command: &str, argv: &[String]) -> String {
    let mut s = String::from(command);
    for a in argv {
        if s.len() > MAX_PROC_COMMAND {
            break;
        }
        s.push(' ');
        s.push_str(a);
    }
    if s.len() > MAX_PROC_COMMAND {
        let mut end = MAX_PROC_COMMAND - '…'.len_utf8();
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
    s
}

#[derive(Default)]
struct Table {
    procs: BTreeMap<u64, Arc<Proc>>,
    /// Finished processes, earliest finished first.
    finished: VecDeque<u64>,
}

/// The background processes the agent keeps.
pub struct ProcTable {
    inner: Mutex<Table>,
    max_finished: usize,
    ring_bytes: usize,
}

impl ProcTable {
    pub fn new(max_finished: usize, ring_bytes: usize) -> Self {
        Self {
            inner: Mutex::new(Table::default()),
            max_finished,
            ring_bytes,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps a new running process.
    pub fn insert(
        &self,
        exec_id: u64,
        pid: u32,
        command: &str,
        argv: &[String],
        stdin: Option<ChildStdin>,
    ) -> Arc<Proc> {
        let started_unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let proc = Arc::new(Proc {
            exec_id,
            pid,
            command: command_line(command, argv),
            started_unix_ms,
            ring: Mutex::new(Ring::new(self.ring_bytes)),
            seq: watch::Sender::new(1),
            stdin_open: stdin.is_some().into(),
            stdin: tokio::sync::Mutex::new(stdin),
        });
        self.lock().procs.insert(exec_id, proc.clone());
        proc
    }

    /// Marks `exec_id` finished and evicts the earliest finished past the limit.
    pub fn finished(&self, exec_id: u64) {
        let mut t = self.lock();
        t.finished.push_back(exec_id);
        while t.finished.len() > self.max_finished {
            if let Some(old) = t.finished.pop_front() {
                t.procs.remove(&old);
            }
        }
    }

    pub fn get(&self, exec_id: u64) -> Result<Arc<Proc>, ErrorMsg> {
        self.lock().procs.get(&exec_id).cloned().ok_or_else(|| {
            ErrorMsg::new(
                ErrorCode::NoSuchExec,
                format!("No background process has id {exec_id} (never started, or evicted)"),
            )
        })
    }

    fn all(&self) -> Vec<Arc<Proc>> {
        self.lock().procs.values().cloned().collect()
    }
}

/// `ProcList`: every kept process, in order of exec id, in batches.
pub(super) async fn list<W: AsyncWrite + Unpin>(
    sh: &Shared,
    w: &mut W,
    id: u64,
) -> Result<(), WireError> {
    let infos: Vec<ProcInfo> = sh.procs.all().iter().map(|p| p.info()).collect();
    let mut batches = infos.chunks(PROC_BATCH).peekable();
    if batches.peek().is_none() {
        let last = Procs {
            procs: Vec::new(),
            more: false,
        };
        return write_frame(w, id, &last.into()).await;
    }
    while let Some(b) = batches.next() {
        let msg = Procs {
            procs: b.to_vec(),
            more: batches.peek().is_some(),
        };
        write_frame(w, id, &msg.into()).await?;
    }
    Ok(())
}

/// `ProcStdin`: writes what the process takes within [`STDIN_WAIT`], then closes if
/// asked and everything went in.
pub(super) async fn stdin<W: AsyncWrite + Unpin>(
    sh: &Shared,
    w: &mut W,
    id: u64,
    req: ProcStdin,
) -> Result<(), WireError> {
    let answer: Message = match write_stdin(sh, req).await {
        Ok(bytes) => Written { bytes }.into(),
        Err(e) => e.into(),
    };
    write_frame(w, id, &answer).await
}

async fn write_stdin(sh: &Shared, req: ProcStdin) -> Result<u64, ErrorMsg> {
    if req.data.len() > MAX_CHUNK {
        return Err(ErrorMsg::new(
            ErrorCode::TooLarge,
            format!("Stdin chunks are at most {MAX_CHUNK} bytes"),
        ));
    }
    let proc = sh.procs.get(req.exec_id)?;
    let closed = || {
        ErrorMsg::new(
            ErrorCode::StdinClosed,
            format!(
                "The stdin of process {} is closed (or was not a stream)",
                req.exec_id
            ),
        )
    };
    let mut guard = proc.stdin.lock().await;
    let Some(pipe) = guard.as_mut() else {
        // Closing a stdin that is closed already (the process read what it
        // was sent and ended before the close came) is done, not an error.
        if req.data.is_empty() && req.close {
            return Ok(0);
        }
        return Err(closed());
    };
    let mut done = 0usize;
    let wrote = timeout(STDIN_WAIT, async {
        while done < req.data.len() {
            match pipe.write(&req.data[done..]).await {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => done += n,
                Err(e) => return Err(e),
            }
        }
        pipe.flush().await
    })
    .await;
    match wrote {
        Ok(Ok(())) if req.close => {
            guard.take();
            proc.stdin_open
                .store(false, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(Ok(())) | Err(_) => {}
        Ok(Err(_)) => {
            // The process closed its end: so does the agent.
            guard.take();
            proc.stdin_open
                .store(false, std::sync::atomic::Ordering::Relaxed);
            return Err(closed());
        }
    }
    Ok(done as u64)
}

/// `Attach`: `Attached`, the kept events after `after_seq`, live events to the exit,
/// `Done`. The connection carries nothing else meanwhile: any frame, or its end, stops
/// the attach (and nothing else: the process goes on).
pub(super) async fn attach<S>(
    sh: &Shared,
    reader: &Reader<S>,
    w: &mut WriteHalf<S>,
    id: u64,
    req: Attach,
) -> Result<(), WireError>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let proc = match sh.procs.get(req.exec_id) {
        Ok(p) => p,
        Err(e) => return write_frame(w, id, &e.into()).await,
    };
    let mut after = req.after_seq.unwrap_or(0);
    let mut seq_rx = proc.seq.subscribe();
    let attached = {
        let r = proc.ring();
        Attached {
            exec_id: proc.exec_id,
            pid: proc.pid,
            running: r.exit().is_none(),
            first_seq: r.first_seq(),
            next_seq: r.next_seq(),
        }
    };
    if after >= attached.next_seq {
        let why = format!(
            "after_seq {after} is past the newest event of process {} ({})",
            proc.exec_id,
            attached.next_seq - 1
        );
        return reply_error(w, id, ErrorCode::BadRequest, why).await;
    }
    write_frame(w, id, &attached.into()).await?;
    // Output offset of event `after + 1`, when known: a reader from the start knows it.
    let mut known = (after == 0).then_some(0);
    let mut conn = reader.lock().await;
    loop {
        seq_rx.borrow_and_update();
        let Batch { gap, events } = proc.ring().read_after(after, known, ATTACH_BATCH);
        if let Some(g) = gap {
            let msg = Gap {
                first_seq: g.first_seq,
                last_seq: g.last_seq,
                bytes: g.bytes,
            };
            write_frame(w, id, &msg.into()).await?;
            after = g.last_seq;
            known = known.zip(g.bytes).map(|(k, b)| k + b);
        }
        for ev in &events {
            let msg: Message = match &ev.kind {
                EventKind::Output(stream, data) => ProcOutput {
                    seq: ev.seq,
                    stream: *stream,
                    data: Bytes::from(data.to_vec()),
                }
                .into(),
                EventKind::Exit(exit) => ProcExit {
                    seq: ev.seq,
                    exit: exit.clone(),
                }
                .into(),
            };
            write_frame(w, id, &msg).await?;
            after = ev.seq;
            known = Some(ev.end_offset());
            if matches!(ev.kind, EventKind::Exit(_)) {
                return write_frame(w, id, &Done {}.into()).await;
            }
        }
        let past_exit = {
            let r = proc.ring();
            r.exit().is_some() && after + 1 >= r.next_seq()
        };
        if past_exit {
            // Asked only for what follows the exit: nothing.
            return write_frame(w, id, &Done {}.into()).await;
        }
        if !events.is_empty() || gap.is_some() {
            continue;
        }
        tokio::select! {
            // `proc` holds the sender: it never closes under us.
            _ = seq_rx.changed() => {}
            frame = conn.next() => {
                let why = match frame {
                    Ok(Some(f)) => format!("{} during an attach", f.msg.name()),
                    Ok(None) => "end of stream".into(),
                    Err(e) => e.to_string(),
                };
                return Err(WireError::Io(std::io::Error::other(format!(
                    "attach to process {} ended by the host: {why}",
                    proc.exec_id
                ))));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_are_cut_at_the_bound() {
        assert_eq!(command_line("sleep", &["1".into()]), "sleep 1");
        let long = command_line("echo", &["é".repeat(2000)]);
        assert!(long.len() <= MAX_PROC_COMMAND && long.ends_with('…'));
    }

    #[test]
    fn finished_processes_are_evicted_earliest_first() {
        let t = ProcTable::new(2, 1024);
        for id in 1..=4 {
            t.insert(id, 100 + id as u32, "true", &[], None);
        }
        t.finished(3);
        t.finished(1);
        t.finished(4);
        // 3 finished first: it goes; 2 is still running and stays.
        assert!(t.get(3).is_err());
        for id in [1, 2, 4] {
            assert_eq!(t.get(id).unwrap().exec_id, id);
        }
    }
}
