//! Starting worker processes, and a pool of ready ones.
//!
//! A worker is started detached: in its own session (it calls `setsid`), with
//! no standard input and its console in a file or nowhere, so it outlives the
//! process that started it. Whoever manages workers keeps a few **ready**
//! per shape: each has its process started, its KVM VM, vCPUs and memory
//! slots made, so neither is on the restore or fork path.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use crate::client::{Client, ClientError};
use crate::jail::{Jail, JailError, CONTROL_SOCKET};
use crate::protocol::{Shape, WorkerState};

/// How long a new worker has to answer its first describe.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("Cannot start the worker program {0}")]
    Exec(PathBuf, #[source] std::io::Error),
    #[error("Worker {0} did not come up")]
    Start(PathBuf, #[source] ClientError),
    #[error("Worker {0} came up {1}, not ready")]
    NotReady(PathBuf, WorkerState),
    #[error("Control socket {0} is in use by another process")]
    InUse(PathBuf),
    #[error("Cannot link control socket {0} to its worker's jail")]
    Link(PathBuf, #[source] std::io::Error),
    #[error(transparent)]
    Jail(#[from] JailError),
}

/// The program that runs a worker: `sprout-worker`, or a binary that becomes
/// one given leading arguments (`sprout worker`).
#[derive(Clone, Debug)]
pub struct WorkerCommand {
    pub program: PathBuf,
    pub prefix: Vec<OsString>,
    /// Start workers jailed (`--jail`): the caller must be root.
    pub jail: Option<crate::jail::JailOptions>,
    /// With `jail`: each worker gets its own jail root under this directory
    /// (`<base>/<id>/root`, see [`Jail`]) and `pivot_root`s into it.
    pub jail_base: Option<PathBuf>,
    /// Where each worker's stderr is appended (its diagnostics: a refused
    /// syscall's message, a failure's reason); `$SPROUT_WORKER_LOG` when
    /// `None`, else nowhere.
    pub log: Option<PathBuf>,
}

/// A started worker process.
pub struct WorkerProcess {
    pub socket: PathBuf,
    pub child: Child,
    /// Connected, and described once as ready.
    pub client: Client,
    /// Its jail root, when started with one: expose the files its requests
    /// name with [`Jail::expose`]; removed by [`wait`](Self::wait).
    pub jail: Option<Jail>,
}

impl WorkerProcess {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the worker to exit, then removes its jail (see
    /// [`cleanup`](Self::cleanup)).
    pub fn wait(&mut self) -> std::io::Result<ExitStatus> {
        let st = self.child.wait()?;
        self.cleanup().map_err(std::io::Error::other)?;
        Ok(st)
    }

    /// Once the worker has exited: removes its jail root and the link at
    /// its socket path. Nothing when it had no jail root.
    pub fn cleanup(&mut self) -> Result<(), JailError> {
        match self.jail.take() {
            Some(j) => remove_jail(&self.socket, &j),
            None => Ok(()),
        }
    }
}

/// Removes `jail` and the link to its control socket at `socket`.
fn remove_jail(socket: &Path, jail: &Jail) -> Result<(), JailError> {
    if std::fs::read_link(socket).is_ok_and(|t| t.starts_with(jail.root())) {
        let _ = std::fs::remove_file(socket);
    }
    jail.remove()
}

/// Puts a link at `socket` to `target`, the control socket in a jail. A
/// stale socket or link there is replaced; a live one is an error.
fn link_socket(socket: &Path, target: &Path) -> Result<(), SpawnError> {
    if socket.symlink_metadata().is_ok() {
        if std::os::unix::net::UnixStream::connect(socket).is_ok() {
            return Err(SpawnError::InUse(socket.to_owned()));
        }
        let _ = std::fs::remove_file(socket);
    }
    std::os::unix::fs::symlink(target, socket).map_err(|e| SpawnError::Link(socket.to_owned(), e))
}

/// A child that did not come up: killed, reaped, its jail removed.
fn discard(socket: &Path, mut child: Child, jail: Option<Jail>) {
    let _ = child.kill();
    let _ = child.wait();
    if let Some(j) = jail {
        if let Err(e) = remove_jail(socket, &j) {
            log::warn!("{}", crate::owner::chain(&e));
        }
    }
}

impl WorkerCommand {
    pub fn new(program: impl Into<PathBuf>) -> Self {
        Self {
            program: program.into(),
            prefix: Vec::new(),
            jail: None,
            jail_base: None,
            log: None,
        }
    }

    /// This binary, becoming a worker with `prefix` (e.g. `["worker"]`).
    pub fn current_exe(prefix: &[&str]) -> std::io::Result<Self> {
        Ok(Self {
            program: std::env::current_exe()?,
            prefix: prefix.iter().map(OsString::from).collect(),
            jail: None,
            jail_base: None,
            log: None,
        })
    }

    /// The same program, its workers jailed as `uid`/`gid`.
    pub fn jailed(mut self, uid: u32, gid: u32) -> Self {
        self.jail = Some(crate::jail::JailOptions {
            uid,
            gid,
            root: None,
        });
        self
    }

    /// Jailed workers each get a jail root under `base` (see [`Jail`]):
    /// they see only what is exposed into it. Needs [`jailed`](Self::jailed).
    pub fn jail_root(mut self, base: impl Into<PathBuf>) -> Self {
        self.jail_base = Some(base.into());
        self
    }

    /// Its workers' stderr appended to `path` (see [`log`](Self::log)).
    pub fn log_to(mut self, path: impl Into<PathBuf>) -> Self {
        self.log = Some(path.into());
        self
    }

    /// Starts a worker on `socket`, ready for a restore of `shape` when given
    /// (else empty, for a boot), with its console appended to `console` (a
    /// host path). Does not wait for it. With a jail base, it also makes the
    /// worker's jail (returned) and links `socket` to the control socket
    /// inside it.
    pub fn start(
        &self,
        socket: &Path,
        shape: Option<Shape>,
        console: Option<&Path>,
    ) -> Result<(Child, Option<Jail>), SpawnError> {
        let mut c = Command::new(&self.program);
        c.args(&self.prefix);
        let jail = match (&self.jail, &self.jail_base) {
            (Some(j), Some(base)) => {
                let id = format!("{:016x}", vmm::new_instance_id());
                let jail = Jail::create(base, &id, j.uid, j.gid)?;
                let inner = Path::new(CONTROL_SOCKET);
                if let Err(e) = link_socket(socket, &jail.host_path(inner)) {
                    let _ = jail.remove();
                    return Err(e);
                }
                c.arg("--socket")
                    .arg(inner)
                    .arg("--jail-root")
                    .arg(jail.root());
                Some(jail)
            }
            _ => {
                c.arg("--socket").arg(socket);
                None
            }
        };
        if let Some(s) = shape {
            c.arg("--vcpus")
                .arg(s.vcpus.to_string())
                .arg("--memory-mib")
                .arg(s.mem_mib.to_string());
        }
        if let Some(p) = console {
            c.arg("--console").arg(p);
        }
        if let Some(j) = &self.jail {
            c.arg("--jail")
                .arg("--jail-uid")
                .arg(j.uid.to_string())
                .arg("--jail-gid")
                .arg(j.gid.to_string());
        }
        // Detached: it must hold none of our pipes open (a caller reading our
        // output to its end would wait for the worker's). Its diagnostics go
        // to its log, or $SPROUT_WORKER_LOG, when set.
        let log = self
            .log
            .clone()
            .map(OsString::from)
            .or_else(|| std::env::var_os("SPROUT_WORKER_LOG"))
            .and_then(|p| {
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .ok()
            })
            .map_or_else(Stdio::null, Stdio::from);
        c.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
        match c.spawn() {
            Ok(child) => Ok((child, jail)),
            Err(e) => {
                if let Some(j) = jail {
                    let _ = remove_jail(socket, &j);
                }
                Err(SpawnError::Exec(self.program.clone(), e))
            }
        }
    }

    /// [`start`](Self::start), then waits until it answers (ready when
    /// `shape` is given).
    pub fn spawn(
        &self,
        socket: &Path,
        shape: Option<Shape>,
        console: Option<&Path>,
    ) -> Result<WorkerProcess, SpawnError> {
        let (child, jail) = self.start(socket, shape, console)?;
        match wait_up(socket, shape.is_some()) {
            Ok(client) => Ok(WorkerProcess {
                socket: socket.to_owned(),
                child,
                client,
                jail,
            }),
            Err(e) => {
                discard(socket, child, jail);
                Err(e)
            }
        }
    }
}

impl WorkerCommand {
    /// Starts one ready worker of `shape` on each of `sockets`, all at once,
    /// and waits until every one is ready. On any failure, the ones started
    /// are stopped.
    pub fn spawn_ready(
        &self,
        sockets: &[PathBuf],
        shape: Shape,
        console: Option<&Path>,
    ) -> Result<Vec<WorkerProcess>, SpawnError> {
        let mut starting = Vec::with_capacity(sockets.len());
        let mut first_err = None;
        for sock in sockets {
            match self.start(sock, Some(shape), console) {
                Ok((child, jail)) => starting.push((sock.clone(), child, jail)),
                Err(e) => {
                    first_err = Some(e);
                    break;
                }
            }
        }
        let mut up = Vec::with_capacity(starting.len());
        for (socket, child, jail) in starting {
            if first_err.is_some() {
                discard(&socket, child, jail);
                continue;
            }
            match wait_up(&socket, true) {
                Ok(client) => up.push(WorkerProcess {
                    socket,
                    child,
                    client,
                    jail,
                }),
                Err(e) => {
                    discard(&socket, child, jail);
                    first_err = Some(e);
                }
            }
        }
        match first_err {
            None => Ok(up),
            Some(e) => {
                for mut w in up {
                    let _ = w.client.stop();
                    let _ = w.wait();
                }
                Err(e)
            }
        }
    }
}

fn wait_up(socket: &Path, ready: bool) -> Result<Client, SpawnError> {
    let mut client = Client::connect_wait(socket, START_TIMEOUT)
        .map_err(|e| SpawnError::Start(socket.to_owned(), e))?;
    // Answered once the shell is built: requests wait behind it.
    let d = client
        .describe()
        .map_err(|e| SpawnError::Start(socket.to_owned(), e))?;
    let want = if ready {
        WorkerState::Ready
    } else {
        WorkerState::Empty
    };
    if d.state != want {
        return Err(SpawnError::NotReady(socket.to_owned(), d.state));
    }
    Ok(client)
}

/// Ready workers of one shape, their sockets in one directory.
pub struct ReadyPool {
    cmd: WorkerCommand,
    dir: PathBuf,
    shape: Shape,
    console: Option<PathBuf>,
    ready: Vec<WorkerProcess>,
    seq: u64,
}

impl ReadyPool {
    pub fn new(cmd: WorkerCommand, dir: impl Into<PathBuf>, shape: Shape) -> Self {
        Self {
            cmd,
            dir: dir.into(),
            shape,
            console: None,
            ready: Vec::new(),
            seq: 0,
        }
    }

    /// Where every worker of the pool appends its console.
    pub fn set_console(&mut self, path: Option<PathBuf>) {
        self.console = path;
    }

    pub fn shape(&self) -> Shape {
        self.shape
    }

    pub fn len(&self) -> usize {
        self.ready.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ready.is_empty()
    }

    /// Starts workers until `n` are ready; they start in parallel.
    pub fn fill(&mut self, n: usize) -> Result<(), SpawnError> {
        let want = n.saturating_sub(self.ready.len());
        let socks: Vec<PathBuf> = (0..want).map(|_| self.next_socket()).collect();
        let ws = self
            .cmd
            .spawn_ready(&socks, self.shape, self.console.as_deref())?;
        self.ready.extend(ws);
        Ok(())
    }

    /// A ready worker, or a new one when none is left.
    pub fn take(&mut self) -> Result<WorkerProcess, SpawnError> {
        match self.ready.pop() {
            Some(w) => Ok(w),
            None => {
                let sock = self.next_socket();
                self.cmd
                    .spawn(&sock, Some(self.shape), self.console.as_deref())
            }
        }
    }

    fn next_socket(&mut self) -> PathBuf {
        self.seq += 1;
        self.dir.join(format!(
            "ready-{}-{:x}-{}.sock",
            std::process::id(),
            vmm::new_instance_id() & 0xffff_ffff,
            self.seq
        ))
    }
}

impl Drop for ReadyPool {
    /// Unused ready workers are stopped (and their jails removed).
    fn drop(&mut self) {
        for mut w in self.ready.drain(..) {
            let _ = w.client.stop();
            let _ = w.wait();
        }
    }
}
