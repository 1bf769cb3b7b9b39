//! The agent: accepts connections (vsock in a VM, a Unix socket as a host process) and
//! serves one request at a time on each.
//!
//! A connection carries a sequence of requests; each runs to its final answer before the
//! next is read. Concurrency comes from connections: the host opens one per exec and
//! keeps a pool for the rest. While an exec runs, its connection carries only its stdin
//! (`StdinData`, `StdinClose`); if the connection closes (or carries anything else) the
//! agent kills the exec's process group. A background exec is the exception: it is
//! answered at once and runs on, owned by the agent (see `procs`).

mod exec;
mod files;
mod net;
mod ports;
mod procs;
mod ring;

use std::io;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;

use log::{debug, error, info, warn};
use tokio::io::{AsyncRead, AsyncWrite, ReadHalf, WriteHalf};
use tokio::net::UnixListener;
use tokio::sync::{Mutex, Semaphore};

use crate::files::Resolver;
use crate::identity;
use crate::main_process::MainProcess;
use crate::protocol::{
    self, ErrorCode, ErrorMsg, Message, Pong, ProtocolError, DEFAULT_MAX_FINISHED,
    DEFAULT_OUTPUT_LIMIT, DEFAULT_RING_BYTES, MAX_PAYLOAD, VERSION,
};
use crate::wire::{write_frame, FrameReader, WireError};

pub use exec::ExecTable;
pub use procs::{ProcTable, PROC_BATCH, STDIN_WAIT};
pub use ring::EVENT_OVERHEAD;

/// How the agent runs.
#[derive(Clone, Debug)]
pub struct Config {
    /// Files root: file requests are confined beneath it; the default exec cwd.
    pub root: PathBuf,
    pub resolver: Resolver,
    /// Per-stream output cap of an exec (requests may only lower it).
    pub output_limit: u64,
    /// Most execs running at once (background ones included); more are refused with
    /// `Busy`.
    pub max_execs: usize,
    /// Bound, in bytes, of each background process's ring of events.
    pub ring_bytes: usize,
    /// Finished background processes kept (for `Attach` and `ProcList`); past it the
    /// earliest finished is forgotten.
    pub max_finished: usize,
    /// Most connections served at once; more are closed on accept.
    pub max_connections: usize,
    /// Accept the requests that change the machine: identity refresh and network
    /// configuration (only the agent started by PID 1 in a VM sets this).
    pub allow_identity: bool,
    /// The resolver configuration `NetConfigure` replaces: `/etc/resolv.conf` but in
    /// tests (an agent run on the host, in a network namespace of its own).
    pub resolv_conf: PathBuf,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            root: PathBuf::from("/workspace"),
            resolver: Resolver::Openat2,
            output_limit: DEFAULT_OUTPUT_LIMIT,
            max_execs: 256,
            ring_bytes: DEFAULT_RING_BYTES,
            max_finished: DEFAULT_MAX_FINISHED,
            max_connections: 1024,
            allow_identity: false,
            resolv_conf: PathBuf::from("/etc/resolv.conf"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("Cannot listen on vsock port {port}")]
    Vsock {
        port: u32,
        #[source]
        source: io::Error,
    },
    #[error("Cannot accept a connection")]
    Accept(#[source] io::Error),
}

struct Shared {
    config: Config,
    execs: ExecTable,
    procs: ProcTable,
    exec_slots: Arc<Semaphore>,
    conn_slots: Arc<Semaphore>,
    /// Held while the machine's identity changes: by the boot's machine-id
    /// check (see [`Server::new`]), then by each refresh, so one never
    /// interleaves with the other.
    identity: Arc<Mutex<()>>,
    /// Set once the boot's machine-id check is known to be over.
    booted_identity: std::sync::atomic::AtomicBool,
}

impl Shared {
    /// Waits for the boot's machine-id check (a moment, once): a command
    /// run right after boot sees the machine's id.
    async fn boot_identity(&self) {
        use std::sync::atomic::Ordering;
        if !self.booted_identity.load(Ordering::Acquire) {
            drop(self.identity.lock().await);
            self.booted_identity.store(true, Ordering::Release);
        }
    }
}

type Reader<S> = Arc<Mutex<FrameReader<ReadHalf<S>>>>;

/// In a VM (an agent that may change the machine), gives a machine booted
/// without an id one of its own, off the path to the first ping's answer;
/// every other request waits for it. Outside a tokio runtime it does nothing.
fn give_machine_id(lock: &Arc<Mutex<()>>) {
    let (Ok(rt), Ok(guard)) = (
        tokio::runtime::Handle::try_current(),
        lock.clone().try_lock_owned(),
    ) else {
        return;
    };
    rt.spawn_blocking(move || {
        let _guard = guard;
        identity::prepare();
        match identity::ensure_machine_id(identity::machine_id_path()) {
            Ok(Some(id)) => info!("new machine id {id}"),
            Ok(None) => {}
            Err(e) => warn!("cannot give the machine an id: {e}"),
        }
        identity::hold_machine_id();
    });
}

/// The agent's request server.
#[derive(Clone)]
pub struct Server {
    shared: Arc<Shared>,
}

impl Server {
    pub fn new(config: Config) -> Self {
        let shared = Shared {
            execs: ExecTable::default(),
            procs: ProcTable::new(config.max_finished, config.ring_bytes),
            exec_slots: Arc::new(Semaphore::new(config.max_execs)),
            conn_slots: Arc::new(Semaphore::new(config.max_connections)),
            identity: Arc::new(Mutex::new(())),
            booted_identity: Default::default(),
            config,
        };
        if shared.config.allow_identity {
            give_machine_id(&shared.identity);
        }
        Self {
            shared: Arc::new(shared),
        }
    }

    pub fn config(&self) -> &Config {
        &self.shared.config
    }

    /// Starts the sandbox's main process (see [`crate::main_process`]) as a
    /// background process; returns its exec id. One that cannot start is
    /// still listed, as finished with status 127 and the reason on its
    /// stderr, so the host sees why.
    pub fn start_main(&self, spec: &MainProcess) -> u64 {
        let req = spec.to_exec();
        match exec::start_background(&self.shared, &req) {
            Ok(started) => {
                info!(
                    "main process {:?} started: exec {}, pid {}",
                    spec.args, started.exec_id, started.pid
                );
                started.exec_id
            }
            Err(e) => {
                let why = format!(
                    "sprout-agent: the main process did not start: {}\n",
                    e.message
                );
                error!("{}", why.trim_end());
                let sh = &self.shared;
                let exec_id = sh.execs.reserve();
                let proc = sh.procs.insert(exec_id, 0, &req.command, &req.argv, None);
                proc.push_output(protocol::StreamKind::Stderr, why.as_bytes());
                sh.procs.finished(exec_id);
                proc.push_exit(protocol::Exit {
                    code: Some(127),
                    ..Default::default()
                });
                exec_id
            }
        }
    }

    /// Serves connections from `listener` until accepting fails.
    pub async fn serve_unix(&self, listener: UnixListener) -> Result<(), ServerError> {
        loop {
            let (stream, _) = listener.accept().await.map_err(ServerError::Accept)?;
            self.spawn_connection(stream);
        }
    }

    /// Listens on AF_VSOCK `port` (any CID) and serves connections from it.
    pub async fn serve_vsock(&self, port: u32) -> Result<(), ServerError> {
        use socket2::{Domain, SockAddr, Socket, Type};
        let err = |source| ServerError::Vsock { port, source };
        let socket = Socket::new(Domain::VSOCK, Type::STREAM.cloexec(), None).map_err(err)?;
        socket
            .bind(&SockAddr::vsock(libc::VMADDR_CID_ANY, port))
            .map_err(err)?;
        socket.listen(128).map_err(err)?;
        info!("listening on vsock port {port}");
        // A blocking accept on a thread of its own hands connections to the runtime
        // (tokio has no vsock listener, and registering a raw descriptor is unsafe).
        let (tx, mut rx) = tokio::sync::mpsc::channel::<socket2::Socket>(16);
        std::thread::Builder::new()
            .name("vsock-accept".into())
            .spawn(move || loop {
                match socket.accept() {
                    Ok((conn, _)) => {
                        if tx.blocking_send(conn).is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        warn!("vsock accept failed: {e}");
                        std::thread::sleep(std::time::Duration::from_millis(50));
                    }
                }
            })
            .map_err(err)?;
        while let Some(conn) = rx.recv().await {
            // A connected stream socket: read, write and shutdown are all the Unix stream
            // type does with its descriptor, and they are the same calls for AF_VSOCK.
            if let Err(e) = conn.set_nonblocking(true) {
                warn!("cannot set up a vsock connection: {e}");
                continue;
            }
            let std = std::os::unix::net::UnixStream::from(OwnedFd::from(conn));
            match tokio::net::UnixStream::from_std(std) {
                Ok(s) => self.spawn_connection(s),
                Err(e) => warn!("cannot register a vsock connection: {e}"),
            }
        }
        Err(ServerError::Accept(io::ErrorKind::BrokenPipe.into()))
    }

    fn spawn_connection<S>(&self, stream: S)
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let Ok(permit) = self.shared.conn_slots.clone().try_acquire_owned() else {
            warn!("too many connections: closing a new one");
            return;
        };
        let server = self.clone();
        tokio::spawn(async move {
            server.serve_connection(stream).await;
            drop(permit);
        });
    }

    /// Serves requests from one connection until it closes or breaks the protocol.
    pub async fn serve_connection<S>(&self, stream: S)
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (r, mut w) = tokio::io::split(stream);
        let reader: Reader<S> = Arc::new(Mutex::new(FrameReader::new(r)));
        loop {
            let next = reader.lock().await.next_or_eof().await;
            let result = match next {
                Ok(None) => return,
                Ok(Some(protocol::Frame {
                    request_id,
                    msg: Message::PortConnect(req),
                })) => match ports::connect(req.port).await {
                    Ok(tcp) => {
                        if write_frame(&mut w, request_id, &protocol::Done {}.into())
                            .await
                            .is_err()
                        {
                            return;
                        }
                        // Nothing else holds the reader between requests.
                        let Ok(reader) = Arc::try_unwrap(reader) else {
                            error!("a port connection's reader is still shared");
                            return;
                        };
                        let (r, rest) = reader.into_inner().into_parts();
                        ports::splice(r, w, rest, tcp, req.port).await;
                        return;
                    }
                    Err(e) => reply_error(&mut w, request_id, e.code, e.message).await,
                },
                Ok(Some(frame)) => self.dispatch(&reader, &mut w, frame).await,
                Err(WireError::BadFrame { request_id, source }) => {
                    let code = match source {
                        ProtocolError::UnknownKind(_) => ErrorCode::UnknownKind,
                        _ => ErrorCode::BadRequest,
                    };
                    reply_error(&mut w, request_id, code, source.to_string()).await
                }
                Err(WireError::Protocol(e @ ProtocolError::UnsupportedVersion { .. })) => {
                    // Say why once (in our version), then close.
                    let _ =
                        reply_error(&mut w, 0, ErrorCode::UnsupportedVersion, e.to_string()).await;
                    return;
                }
                Err(e) => {
                    debug!("connection closed: {e}");
                    return;
                }
            };
            if let Err(e) = result {
                debug!("connection closed: {e}");
                return;
            }
        }
    }

    async fn dispatch<S>(
        &self,
        reader: &Reader<S>,
        w: &mut WriteHalf<S>,
        frame: protocol::Frame,
    ) -> Result<(), WireError>
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let sh = &self.shared;
        let id = frame.request_id;
        // Readiness is answered at once; the rest follows the boot's id.
        if !matches!(frame.msg, Message::Ping(_)) {
            sh.boot_identity().await;
        }
        match frame.msg {
            Message::Ping(_) => {
                let pong = Pong {
                    agent_version: env!("CARGO_PKG_VERSION").into(),
                    protocol: VERSION,
                    max_payload: MAX_PAYLOAD,
                    identity_allowed: sh.config.allow_identity,
                };
                write_frame(w, id, &pong.into()).await
            }
            Message::Exec(req) => exec::run(sh, reader, w, id, req).await,
            Message::Kill(k) => {
                let answer = match sh.execs.kill(k.exec_id, k.signal) {
                    Ok(()) => protocol::Done {}.into(),
                    Err(e) => e.into(),
                };
                write_frame(w, id, &answer).await
            }
            Message::Attach(req) => procs::attach(sh, reader, w, id, req).await,
            Message::ProcStdin(req) => procs::stdin(sh, w, id, req).await,
            Message::ProcList(_) => procs::list(sh, w, id).await,
            Message::List(req) => files::list(&sh.config, w, id, req).await,
            Message::Stat(req) => files::stat(&sh.config, w, id, req).await,
            Message::Read(req) => files::read(&sh.config, w, id, req).await,
            Message::Write(req) => files::write(&sh.config, reader, w, id, req).await,
            Message::Mkdir(req) => files::mkdir(&sh.config, w, id, req).await,
            Message::Remove(req) => files::remove(&sh.config, w, id, req).await,
            Message::Rename(req) => files::rename(&sh.config, w, id, req).await,
            msg @ (Message::Identity(_) | Message::IdentityAs(_)) => {
                if !sh.config.allow_identity {
                    let why =
                        "Identity refresh is disabled: the agent runs without --allow-identity";
                    return reply_error(w, id, ErrorCode::Forbidden, why).await;
                }
                let (req, machine_id) = match msg {
                    Message::IdentityAs(r) => (r.identity, Some(r.machine_id)),
                    Message::Identity(r) => (r, None),
                    _ => unreachable!("matched above"),
                };
                // After the boot's own machine-id check, one refresh at a time.
                let one_at_a_time = sh.identity.lock().await;
                // On this task, not the blocking pool: each step is a quick
                // system call on memory the guest holds (the id file is
                // rewritten in place; only a missing or odd one is replaced
                // by a rename), and the host sends nothing else to a guest it
                // re-identifies. Handing it to a pool thread and back cost
                // ~4 ms of a ~16 ms refresh where guest kernel code is
                // emulated (the lab), on the path to a restore's first exec.
                let answer = match identity::refresh_as(&req, machine_id.as_deref()) {
                    Ok(done) => done.into(),
                    Err(e) => ErrorMsg::new(ErrorCode::BadRequest, e.to_string()).into(),
                };
                drop(one_at_a_time);
                write_frame(w, id, &answer).await
            }
            Message::NetConfigure(req) => {
                if !sh.config.allow_identity {
                    let why =
                        "Network configuration is disabled: the agent runs without --allow-identity";
                    return reply_error(w, id, ErrorCode::Forbidden, why).await;
                }
                let resolv_conf = sh.config.resolv_conf.clone();
                let answer =
                    match tokio::task::spawn_blocking(move || net::configure(&req, &resolv_conf))
                        .await
                    {
                        Ok(Ok(done)) => done.into(),
                        Ok(Err(e)) => e.into(),
                        Err(e) => ErrorMsg::new(ErrorCode::Internal, e.to_string()).into(),
                    };
                write_frame(w, id, &answer).await
            }
            // Stdin for an exec that already ended: dropped.
            Message::StdinData(_) | Message::StdinClose(_) => Ok(()),
            other => {
                let why = format!("{} is not a request the agent serves here", other.name());
                reply_error(w, id, ErrorCode::BadRequest, why).await
            }
        }
    }
}

async fn reply_error<W: AsyncWrite + Unpin>(
    w: &mut W,
    id: u64,
    code: ErrorCode,
    message: impl Into<String>,
) -> Result<(), WireError> {
    write_frame(w, id, &ErrorMsg::new(code, message).into()).await
}
