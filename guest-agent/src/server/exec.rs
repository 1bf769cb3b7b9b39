//! Exec: spawn a process in its own process group, stream its output, report its exit.
//!
//! A foreground exec belongs to its connection: its output goes there, and if the
//! connection closes the process group is killed. A background exec (`background: true`)
//! belongs to the agent: its output goes to its ring (see `procs`), with no
//! backpressure, and no connection's fate touches it.
//!
//! Output: each stream is read in chunks of at most [`OUTPUT_CHUNK`] bytes and sent in
//! the order read. Up to the cap the agent applies backpressure (a host that stops
//! reading stops the process once the pipe fills); past the cap it keeps reading and
//! discards, so the process is never blocked by a full pipe and no memory grows. At most
//! [`FRAME_QUEUE`] frames wait per exec.
//!
//! End: when the process exits, the agent reads what is left in the pipes until they
//! close, giving up [`DRAIN_IDLE`] after the last chunk (or [`DRAIN_MAX`] after the
//! exit) when a background process keeps them open; then it sends `Exit`. Output
//! already in a pipe is never given up on before [`DRAIN_MAX`], however busy the machine
//! (the pipe readers may not have run yet), a chunk read as the drain ends is still
//! sent, and what is in a pipe when the drain gives up is read then and sent (up to
//! [`LEFT_MAX`] a stream): output a process wrote before it exited is never lost, even
//! where its reader never got to run. A reader takes room in the queue before it reads,
//! so stopping it never drops a chunk it held.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use log::debug;
use rustix::process::{kill_process_group, Pid, Signal};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, WriteHalf};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{sleep_until, Instant};

use super::procs::Proc;
use super::{Reader, Shared};
use crate::protocol::{
    Bytes, ErrorCode, ErrorMsg, Exec, ExecStarted, Exit, Message, Output, StdinMode, StreamKind,
};
use crate::wire::{write_frame, WireError};

/// Largest output chunk read and sent at once.
pub const OUTPUT_CHUNK: usize = 64 * 1024;
/// Output frames queued per exec before the pipe readers wait.
pub const FRAME_QUEUE: usize = 8;
/// After the exit, how long to wait for more output before giving up on open pipes.
pub const DRAIN_IDLE: Duration = Duration::from_millis(100);
/// After the exit, the longest wait for the pipes to close.
pub const DRAIN_MAX: Duration = Duration::from_secs(2);
/// Most bytes read a stream from a pipe still open when the drain gives up:
/// what a pipe can hold (64 KiB unless raised, at most 1 MiB by default).
pub const LEFT_MAX: usize = 1 << 20;

/// Running execs by id, for `Kill`.
#[derive(Default)]
pub struct ExecTable {
    next: AtomicU64,
    running: std::sync::Mutex<HashMap<u64, Pid>>,
}

impl ExecTable {
    fn register(&self, pgid: Pid) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        self.lock().insert(id, pgid);
        id
    }

    /// An id for an exec that never ran (a main process that failed to start).
    pub(super) fn reserve(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed) + 1
    }

    fn unregister(&self, id: u64) {
        self.lock().remove(&id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Pid>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends `signal` to the process group of exec `id`.
    pub fn kill(&self, id: u64, signal: i32) -> Result<(), ErrorMsg> {
        let sig = Signal::from_named_raw(signal).ok_or_else(|| {
            ErrorMsg::new(
                ErrorCode::InvalidSignal,
                format!("Signal {signal} is not valid"),
            )
        })?;
        let running = self.lock();
        let pgid = running.get(&id).ok_or_else(|| {
            ErrorMsg::new(
                ErrorCode::NoSuchExec,
                format!("No running exec has id {id}"),
            )
        })?;
        kill_process_group(*pgid, sig)
            .map_err(|e| ErrorMsg::new(ErrorCode::NoSuchExec, format!("Exec {id} is gone: {e}")))
    }
}

/// Removes the exec from the table however its run ends.
struct Registered(Arc<Shared>, u64);

impl Drop for Registered {
    fn drop(&mut self) {
        self.0.execs.unregister(self.1);
    }
}

/// Counts of one output stream, shared with its reader task.
#[derive(Default)]
struct StreamStats {
    total: AtomicU64,
    /// Of `total`, the bytes passed on (at most the output limit).
    sent: AtomicU64,
    truncated: AtomicBool,
}

impl StreamStats {
    /// Counts `n` bytes read; how many of them to pass on under `limit`.
    fn take(&self, n: usize, limit: u64) -> usize {
        self.total.fetch_add(n as u64, Ordering::Relaxed);
        let sent = self.sent.load(Ordering::Relaxed);
        let keep = limit.saturating_sub(sent).min(n as u64) as usize;
        if keep < n {
            self.truncated.store(true, Ordering::Relaxed);
        }
        self.sent.fetch_add(keep as u64, Ordering::Relaxed);
        keep
    }
}

/// What is in `pipe` now, read without waiting (at most [`LEFT_MAX`]
/// bytes), counted in `stats` and cut to what `limit` leaves: for after its
/// reader stopped. Reads only what the pipe says it holds, so it never
/// blocks.
fn read_left(pipe: &OwnedFd, limit: u64, stats: &StreamStats) -> Vec<Vec<u8>> {
    let mut chunks = Vec::new();
    let mut left = LEFT_MAX;
    while left > 0 {
        let ready = match rustix::io::ioctl_fionread(pipe) {
            Ok(n) if n > 0 => (n as usize).min(OUTPUT_CHUNK).min(left),
            _ => break,
        };
        let mut buf = vec![0u8; ready];
        let n = match rustix::io::read(pipe, &mut buf) {
            Ok(n) if n > 0 => n,
            _ => break,
        };
        left -= n;
        let keep = stats.take(n, limit);
        if keep > 0 {
            buf.truncate(keep);
            chunks.push(buf);
        }
    }
    chunks
}

fn bad(why: impl Into<String>) -> ErrorMsg {
    ErrorMsg::new(ErrorCode::BadRequest, why)
}

fn check_text(what: &str, s: &str) -> Result<(), ErrorMsg> {
    if s.contains('\0') {
        return Err(bad(format!("{what} contains a NUL byte")));
    }
    Ok(())
}

/// Builds the command for `req`, or says why it is malformed.
fn command(root: &Path, req: &Exec) -> Result<Command, ErrorMsg> {
    if req.command.is_empty() {
        return Err(bad("The command is empty"));
    }
    check_text("The command", &req.command)?;
    for a in &req.argv {
        check_text("An argument", a)?;
    }
    for (k, v) in &req.env {
        if k.is_empty() || k.contains('=') {
            return Err(bad(format!("Environment variable name {k:?} is invalid")));
        }
        check_text("An environment variable", k)?;
        check_text("An environment value", v)?;
    }
    let mut cmd = if req.shell {
        let mut c = Command::new("/bin/sh");
        c.arg("-c").arg(&req.command);
        c
    } else {
        Command::new(&req.command)
    };
    cmd.args(&req.argv);
    if req.clear_env {
        cmd.env_clear();
    }
    cmd.envs(req.env.iter().map(|(k, v)| (k, v)));
    let cwd = match &req.cwd {
        Some(c) => {
            check_text("The working directory", c)?;
            root.join(c)
        }
        None if root.is_dir() => root.to_path_buf(),
        None => PathBuf::from("/"),
    };
    cmd.current_dir(cwd);
    if let Some(u) = req.user {
        cmd.uid(u.uid).gid(u.gid);
    }
    cmd.process_group(0)
        .stdin(match req.stdin {
            StdinMode::Null => Stdio::null(),
            _ => Stdio::piped(),
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(false);
    Ok(cmd)
}

/// A spawned exec: registered for `Kill`, its stdin being fed or handed over.
struct Spawned {
    child: Child,
    pid: u32,
    pgid: Pid,
    exec_id: u64,
    registered: Registered,
    slot: tokio::sync::OwnedSemaphorePermit,
    start: Instant,
    deadline: Option<Instant>,
    feeder: Option<tokio::task::JoinHandle<()>>,
    stdin_stream: Option<ChildStdin>,
}

/// Takes an exec slot, builds `req`'s command and spawns it.
fn spawn(sh: &Arc<Shared>, req: &Exec) -> Result<Spawned, ErrorMsg> {
    let Ok(slot) = sh.exec_slots.clone().try_acquire_owned() else {
        let why = format!(
            "Too many execs running (at most {}, background ones included)",
            sh.config.max_execs
        );
        return Err(ErrorMsg::new(ErrorCode::Busy, why));
    };
    let mut cmd = command(&sh.config.root, req)?;
    let start = Instant::now();
    let mut child = cmd.spawn().map_err(|e| {
        ErrorMsg::new(
            ErrorCode::SpawnFailed,
            format!("Cannot start {:?}: {e}", req.command),
        )
    })?;
    let pid = child.id().unwrap_or(0);
    // process_group(0): the child leads a group whose id is its pid.
    let Some(pgid) = Pid::from_raw(pid as i32) else {
        return Err(ErrorMsg::new(ErrorCode::Internal, "The child has no pid"));
    };
    let exec_id = sh.execs.register(pgid);
    let registered = Registered(sh.clone(), exec_id);
    debug!(
        "exec {exec_id}: pid {pid} {:?}{}",
        req.command,
        if req.background { " (background)" } else { "" }
    );
    let stdin = child.stdin.take();
    let (stdin_bytes, stdin_stream) = match &req.stdin {
        StdinMode::Bytes(b) => (stdin.map(|s| (s, b.clone())), None),
        StdinMode::Stream => (None, stdin),
        StdinMode::Null => (None, None),
    };
    let feeder = stdin_bytes.map(|(mut s, bytes)| {
        tokio::spawn(async move {
            let _ = s.write_all(&bytes).await;
        })
    });
    Ok(Spawned {
        child,
        pid,
        pgid,
        exec_id,
        registered,
        slot,
        start,
        deadline: req.timeout_ms.map(|ms| start + Duration::from_millis(ms)),
        feeder,
        stdin_stream,
    })
}

/// Starts a background exec: from now on the process is the agent's, its
/// events in its ring (see `procs`). Also how the main process is started.
pub(super) fn start_background(sh: &Arc<Shared>, req: &Exec) -> Result<ExecStarted, ErrorMsg> {
    // The ring bounds a background process's memory: only the request's cap applies.
    let limit = req.output_limit.unwrap_or(u64::MAX);
    let s = spawn(sh, req)?;
    let (exec_id, pid) = (s.exec_id, s.pid);
    let proc = sh
        .procs
        .insert(exec_id, pid, &req.command, &req.argv, s.stdin_stream);
    let sh = sh.clone();
    tokio::spawn(async move {
        let mut sink = Sink::<tokio::io::Sink>::Ring(&proc);
        let exit = follow(
            s.child, s.pgid, s.start, s.deadline, limit, s.feeder, None, &mut sink,
        )
        .await;
        debug!("exec {exec_id} (background): {exit:?}");
        // No longer signalled, no longer counted, no longer fed; then visible.
        drop(s.registered);
        drop(s.slot);
        proc.close_stdin().await;
        sh.procs.finished(exec_id);
        proc.push_exit(exit);
    });
    Ok(ExecStarted { exec_id, pid })
}

/// Runs one exec on this connection: `ExecStarted`, output, `Exit`; or, for a
/// background exec, `ExecStarted` alone, the process then running on its own task.
/// Returns an error when the connection is no longer usable.
pub(super) async fn run<S>(
    sh: &Arc<Shared>,
    reader: &Reader<S>,
    w: &mut WriteHalf<S>,
    id: u64,
    req: Exec,
) -> Result<(), WireError>
where
    S: tokio::io::AsyncRead + AsyncWrite + Send + 'static,
{
    if req.background {
        // The process is the agent's once started: a connection that fails
        // here changes nothing.
        let answer: Message = match start_background(sh, &req) {
            Ok(started) => started.into(),
            Err(e) => e.into(),
        };
        return write_frame(w, id, &answer).await;
    }
    let limit = req
        .output_limit
        .map_or(sh.config.output_limit, |l| l.min(sh.config.output_limit));
    let mut s = match spawn(sh, &req) {
        Ok(s) => s,
        Err(e) => return write_frame(w, id, &e.into()).await,
    };
    let started = ExecStarted {
        exec_id: s.exec_id,
        pid: s.pid,
    };
    if let Err(e) = write_frame(w, id, &started.into()).await {
        let _ = kill_process_group(s.pgid, Signal::KILL);
        let _ = s.child.wait().await;
        return Err(e);
    }
    let watcher = tokio::spawn(watch(reader.clone(), s.stdin_stream, id));
    let mut sink = Sink::Conn { w, id, ok: true };
    let exit = follow(
        s.child,
        s.pgid,
        s.start,
        s.deadline,
        limit,
        s.feeder,
        Some(watcher),
        &mut sink,
    )
    .await;
    debug!("exec {}: {exit:?}", s.exec_id);
    drop(s.registered);
    drop(s.slot);
    match sink {
        Sink::Conn { w, ok: true, .. } => write_frame(w, id, &exit.into()).await,
        _ => Err(WireError::Io(std::io::ErrorKind::ConnectionAborted.into())),
    }
}

/// Where output goes: the exec's connection (with backpressure), or a background
/// process's ring (without: the ring drops its oldest events instead).
enum Sink<'a, W> {
    Conn { w: &'a mut W, id: u64, ok: bool },
    Ring(&'a Proc),
}

impl<W: AsyncWrite + Unpin> Sink<'_, W> {
    /// Delivers a chunk; false if that broke the connection (after which chunks are
    /// dropped).
    async fn put(&mut self, (stream, data): (StreamKind, Vec<u8>)) -> bool {
        match self {
            Sink::Conn { ok: false, .. } => true,
            Sink::Conn { w, id, ok } => {
                let msg = Output {
                    stream,
                    data: Bytes::from(data),
                };
                if write_frame(*w, *id, &msg.into()).await.is_err() {
                    *ok = false;
                    return false;
                }
                true
            }
            Sink::Ring(p) => {
                p.push_output(stream, &data);
                true
            }
        }
    }
}

/// Follows a spawned process to its end: pumps its output into `sink`, enforces the
/// deadline, watches the connection (a foreground exec's `watcher`), drains the pipes;
/// its `Exit`.
#[allow(clippy::too_many_arguments)]
async fn follow<W: AsyncWrite + Unpin>(
    mut child: Child,
    pgid: Pid,
    start: Instant,
    deadline: Option<Instant>,
    limit: u64,
    feeder: Option<JoinHandle<()>>,
    watcher: Option<JoinHandle<()>>,
    sink: &mut Sink<'_, W>,
) -> Exit {
    // The pipes' read ends, duplicated: the drain asks them for unread output.
    let pipes: Vec<(StreamKind, OwnedFd)> = [
        child
            .stdout
            .as_ref()
            .map(|p| (StreamKind::Stdout, p.as_fd().try_clone_to_owned())),
        child
            .stderr
            .as_ref()
            .map(|p| (StreamKind::Stderr, p.as_fd().try_clone_to_owned())),
    ]
    .into_iter()
    .flatten()
    .filter_map(|(k, fd)| Some((k, fd.ok()?)))
    .collect();
    let (tx, mut rx) = mpsc::channel(FRAME_QUEUE);
    let out_stats = Arc::new(StreamStats::default());
    let err_stats = Arc::new(StreamStats::default());
    let pumps = [
        child.stdout.take().map(|p| {
            tokio::spawn(pump(
                p,
                StreamKind::Stdout,
                limit,
                tx.clone(),
                out_stats.clone(),
            ))
        }),
        child.stderr.take().map(|p| {
            tokio::spawn(pump(
                p,
                StreamKind::Stderr,
                limit,
                tx.clone(),
                err_stats.clone(),
            ))
        }),
    ];
    drop(tx);

    let run = supervise(child, pgid, deadline, &mut rx, &pipes, watcher, sink).await;

    for task in pumps.into_iter().flatten().chain(feeder) {
        task.abort();
        let _ = task.await;
    }
    // A pump that was reading as the drain ended has queued what it read.
    while let Ok(chunk) = rx.try_recv() {
        sink.put(chunk).await;
    }
    // Then, if the drain gave up, what is still in a pipe: its reader never
    // ran (a busy machine) or a background process keeps writing. After
    // what was queued, so each stream stays in order. Pipes read to their
    // end (the usual exec) hold nothing more.
    for (kind, pipe) in pipes.iter().filter(|_| run.gave_up) {
        let stats = match kind {
            StreamKind::Stdout => &out_stats,
            _ => &err_stats,
        };
        for data in read_left(pipe, limit, stats) {
            sink.put((*kind, data)).await;
        }
    }
    Exit {
        code: run.status.code(),
        signal: run.status.signal(),
        duration_us: run
            .exited_after
            .saturating_duration_since(start)
            .as_micros() as u64,
        timed_out: run.timed_out,
        stdout_truncated: out_stats.truncated.load(Ordering::Relaxed),
        stderr_truncated: err_stats.truncated.load(Ordering::Relaxed),
        stdout_bytes: out_stats.total.load(Ordering::Relaxed),
        stderr_bytes: err_stats.total.load(Ordering::Relaxed),
    }
}

struct RunEnd {
    status: ExitStatus,
    exited_after: Instant,
    timed_out: bool,
    /// The drain stopped with a pipe still open (not at its end).
    gave_up: bool,
}

/// Forwards output, enforces the timeout, and watches the connection (if any) until the
/// process has exited and its output is drained.
async fn supervise<W: AsyncWrite + Unpin>(
    mut child: Child,
    pgid: Pid,
    deadline: Option<Instant>,
    rx: &mut mpsc::Receiver<(StreamKind, Vec<u8>)>,
    pipes: &[(StreamKind, OwnedFd)],
    mut watcher: Option<JoinHandle<()>>,
    sink: &mut Sink<'_, W>,
) -> RunEnd {
    let far = Instant::now() + Duration::from_secs(86400 * 365);
    // The timer is a task of its own so that it fires even while a slow host holds up
    // an output write.
    let timed_out = Arc::new(AtomicBool::new(false));
    let timer = deadline.map(|at| {
        let flag = timed_out.clone();
        tokio::spawn(async move {
            sleep_until(at).await;
            debug!("exec group {pgid:?} timed out");
            flag.store(true, Ordering::SeqCst);
            let _ = kill_process_group(pgid, Signal::KILL);
        })
    });
    let mut watching = watcher.is_some();
    let mut pumps_done = false;
    let mut exited: Option<(ExitStatus, Instant)> = None;
    let mut drain_until = far;
    let mut drain_max = far;
    let mut gave_up = false;
    loop {
        if exited.is_some() && pumps_done {
            break;
        }
        tokio::select! {
            biased;
            chunk = rx.recv(), if !pumps_done => match chunk {
                Some(chunk) => {
                    if exited.is_some() {
                        drain_until = (Instant::now() + DRAIN_IDLE).min(drain_max);
                    }
                    if !sink.put(chunk).await {
                        let _ = kill_process_group(pgid, Signal::KILL);
                    }
                }
                None => pumps_done = true,
            },
            status = child.wait(), if exited.is_none() => {
                let now = Instant::now();
                if let Some(t) = &timer {
                    t.abort();
                }
                // A wait error leaves nothing to wait for; report it as a kill.
                let status = status.unwrap_or_else(|_| ExitStatus::from_raw(libc::SIGKILL));
                exited = Some((status, now));
                drain_max = now + DRAIN_MAX;
                drain_until = now + DRAIN_IDLE;
            },
            // The watcher only ends when the host is gone (or broke the protocol).
            _ = async { watcher.as_mut().expect("watching").await }, if watching => {
                watching = false;
                if let Sink::Conn { ok, .. } = sink {
                    *ok = false;
                }
                let _ = kill_process_group(pgid, Signal::KILL);
            },
            _ = sleep_until(drain_until), if exited.is_some() => {
                // Output still in a pipe is the process's, not yet read because the
                // readers did not get to run (a busy machine): wait for it. Only open,
                // empty pipes are given up on.
                let now = Instant::now();
                let unread = pipes
                    .iter()
                    .any(|(_, p)| rustix::io::ioctl_fionread(p).is_ok_and(|n| n > 0));
                if !unread || now >= drain_max {
                    gave_up = true;
                    break;
                }
                drain_until = (now + DRAIN_IDLE).min(drain_max);
            },
        }
    }
    if let Some(w) = watcher.filter(|_| watching) {
        w.abort();
        let _ = w.await;
    }
    if let Some(t) = timer {
        t.abort();
        let _ = t.await;
    }
    let (status, exited_after) =
        exited.unwrap_or_else(|| (ExitStatus::from_raw(libc::SIGKILL), Instant::now()));
    RunEnd {
        status,
        exited_after,
        timed_out: timed_out.load(Ordering::SeqCst),
        gave_up,
    }
}

/// Reads one output stream, sending chunks up to `limit` bytes and discarding the rest.
async fn pump(
    mut pipe: impl AsyncRead + Unpin,
    stream: StreamKind,
    limit: u64,
    tx: mpsc::Sender<(StreamKind, Vec<u8>)>,
    stats: Arc<StreamStats>,
) {
    let mut buf = vec![0u8; OUTPUT_CHUNK];
    loop {
        // Room in the queue first, then the read: a reader stopped while it
        // waits holds no output (what it would have read stays in the pipe,
        // for the drain's last read). Past the cap it reads without waiting,
        // and a closed receiver (the exec is over) lets it drain regardless.
        let permit = if stats.sent.load(Ordering::Relaxed) < limit {
            tx.reserve().await.ok()
        } else {
            None
        };
        let n = match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let keep = stats.take(n, limit);
        if let (Some(p), 1..) = (permit, keep) {
            p.send((stream, buf[..keep].to_vec()));
        }
    }
}

/// Reads the connection while the exec runs: stdin frames go to the process; the end of
/// the connection, or any other frame, ends the watch (the host is gone).
async fn watch<S>(reader: Reader<S>, mut stdin: Option<ChildStdin>, id: u64)
where
    S: tokio::io::AsyncRead + Send + 'static,
{
    let mut reader = reader.lock().await;
    loop {
        let frame = match reader.next().await {
            Ok(Some(f)) => f,
            Ok(None) | Err(_) => return,
        };
        match frame.msg {
            Message::StdinData(d) if frame.request_id == id => {
                if let Some(s) = stdin.as_mut() {
                    // The process closed its stdin: drop the rest, as a pipe would.
                    if s.write_all(&d.data).await.is_err() {
                        stdin = None;
                    }
                }
            }
            Message::StdinClose(_) if frame.request_id == id => stdin = None,
            other => {
                debug!("exec connection sent {} while an exec runs", other.name());
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pipe's read end with `bytes` written into it; the write end is
    /// returned too, kept open (a background process holding it).
    fn pipe_with(bytes: &[u8]) -> (OwnedFd, OwnedFd) {
        let (r, w) = std::io::pipe()
            .map(|(r, w)| (OwnedFd::from(r), OwnedFd::from(w)))
            .unwrap();
        assert_eq!(rustix::io::write(&w, bytes).unwrap(), bytes.len());
        (r, w)
    }

    #[test]
    fn what_is_left_in_a_pipe_is_read_without_waiting_for_it_to_close() {
        let data: Vec<u8> = (0..60_000u32).map(|i| (i % 251) as u8).collect();
        let (r, _w) = pipe_with(&data);
        let stats = StreamStats::default();
        let got: Vec<u8> = read_left(&r, u64::MAX, &stats).concat();
        assert_eq!(got, data);
        assert_eq!(stats.total.load(Ordering::Relaxed), 60_000);
        assert!(!stats.truncated.load(Ordering::Relaxed));
        // Empty and still open (the write end lives): nothing, and no wait.
        assert!(read_left(&r, u64::MAX, &stats).is_empty());
    }

    #[test]
    fn what_is_left_counts_toward_the_limit_the_reader_began() {
        let (r, _w) = pipe_with(b"0123456789");
        let stats = StreamStats::default();
        // The pump passed on 4 of a 6-byte limit before it stopped.
        assert_eq!(stats.take(4, 6), 4);
        let got = read_left(&r, 6, &stats).concat();
        assert_eq!(got, b"01");
        assert_eq!(stats.total.load(Ordering::Relaxed), 14);
        assert_eq!(stats.sent.load(Ordering::Relaxed), 6);
        assert!(stats.truncated.load(Ordering::Relaxed));
        assert_eq!(stats.take(5, 6), 0, "past the cap, nothing more is sent");
    }
}
