//! The CLI side of a VM's control socket: `sprout vm ctl|pause|resume|
//! snapshot|fork|exec --api-sock` speak the worker protocol
//! ([`sprout_worker::protocol`]) to the process that holds the VM, whether
//! that is `sprout vm run --api-sock` or a detached `sprout-worker`.
//!
//! `sprout vm fork` forks across processes: it starts one ready worker per
//! child (this binary, as `sprout worker`), has the parent write a fork layer,
//! restores it in every child in parallel, and — for a Linux guest — gives
//! each child's agent its new identity before printing the child's socket.
//! Children are detached: they outlive `sprout` and their parent.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sprout_worker::protocol::{Backend, Description, GuestKind, RestoreSpec};
use sprout_worker::{Client, ClientError, WorkerCommand, WorkerProcess};
use vmm::vcpu::ExitSignal;

use crate::agent;

/// Most children one `fork` makes.
pub const MAX_FORK: usize = 64;
/// How long a VM that is starting in the background has to serve its socket.
pub const SOCKET_WAIT: Duration = Duration::from_secs(5);
const MAILBOX_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a forked child's agent has to take its new identity.
const REFRESH_TIMEOUT: Duration = Duration::from_secs(180);

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("Cannot connect to {0}")]
    Connect(PathBuf, #[source] std::io::Error),
    #[error(transparent)]
    Worker(#[from] ClientError),
    #[error("{0}")]
    Usage(String),
    #[error("This VM has no vsock device")]
    NoVsock,
    #[error("Cannot start a worker for a child")]
    Spawn(#[from] sprout_worker::spawn::SpawnError),
    #[error("Child {0} could not be re-identified")]
    Refresh(PathBuf, #[source] agent::AgentError),
    #[error("Cannot start the async runtime")]
    Runtime(#[source] std::io::Error),
}

/// Connects to a VM's control socket, waiting a moment for one that is
/// still starting (`sprout vm run ... & sprout vm ctl ...`).
pub fn connect(sock: &Path) -> Result<Client, ControlError> {
    if !sock.exists() {
        // A VM started in the background binds its socket within moments.
        let t = Instant::now();
        while !sock.exists() && t.elapsed() < SOCKET_WAIT {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    Client::connect_wait(sock, Duration::from_millis(500))
        .or_else(|_| Client::connect(sock))
        .map_err(|e| match e {
            ClientError::Connect(_, io) => ControlError::Connect(sock.to_owned(), io),
            other => ControlError::Worker(other),
        })
}

fn usage(s: impl Into<String>) -> ControlError {
    ControlError::Usage(s.into())
}

fn num(s: &str) -> Result<u64, ControlError> {
    let v = match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    };
    v.map_err(|_| usage(format!("{s:?} is not a number")))
}

/// One `sprout vm ctl` command; what to print.
pub fn command(sock: &Path, words: &[String]) -> Result<String, ControlError> {
    let (cmd, args) = words.split_first().ok_or_else(|| usage("empty command"))?;
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let no_args = || -> Result<(), ControlError> {
        if args.is_empty() {
            Ok(())
        } else {
            Err(usage(format!("{cmd} takes no arguments")))
        }
    };
    match cmd.as_str() {
        "status" => {
            no_args()?;
            Ok(connect(sock)?.describe()?.state.to_string())
        }
        "describe" => {
            no_args()?;
            Ok(describe_text(&connect(sock)?.describe()?))
        }
        "metrics" => {
            no_args()?;
            let m = connect(sock)?.metrics()?;
            Ok(format!(
                "rss_kib {} pss_kib {} private_dirty_kib {} vcpu_time_us {} last_pause_us {}",
                m.rss_kib, m.pss_kib, m.private_dirty_kib, m.vcpu_time_us, m.last_pause_us
            ))
        }
        "vcpus" => {
            no_args()?;
            Ok(connect(sock)?
                .vcpus()?
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join("\n"))
        }
        "pause" => {
            no_args()?;
            connect(sock)?.pause()?;
            Ok(String::new())
        }
        "resume" => {
            no_args()?;
            connect(sock)?.resume()?;
            Ok(String::new())
        }
        "stop" => {
            no_args()?;
            connect(sock)?.stop()?;
            Ok(String::new())
        }
        "snapshot" => {
            let (dir, diff) = match args.as_slice() {
                [dir] | [dir, "full"] => (*dir, false),
                [dir, "diff"] => (*dir, true),
                _ => return Err(usage("usage: snapshot DIR [full|diff]")),
            };
            // The VM's process has its own working directory.
            let dir = std::path::absolute(dir).unwrap_or_else(|_| PathBuf::from(dir));
            connect(sock)?.snapshot(&dir, diff)?;
            Ok(dir.display().to_string())
        }
        "mailbox" => {
            if args.len() != 6 {
                return Err(usage("usage: mailbox CPU CMD A0 A1 A2 A3"));
            }
            let cpu = u8::try_from(num(args[0])?).map_err(|_| usage("CPU out of range"))?;
            let c = u32::try_from(num(args[1])?).map_err(|_| usage("CMD out of range"))?;
            let a = [num(args[2])?, num(args[3])?, num(args[4])?, num(args[5])?];
            let (status, r) = connect(sock)?.mailbox(cpu, c, a, MAILBOX_TIMEOUT)?;
            Ok(format!(
                "{status} {:#x} {:#x} {:#x} {:#x}",
                r[0], r[1], r[2], r[3]
            ))
        }
        "vsock" => {
            no_args()?;
            Ok(vsock_uds(sock)?.display().to_string())
        }
        "fork" => {
            let n: usize = match args.as_slice() {
                [n] => n
                    .parse()
                    .map_err(|_| usage(format!("{n:?} is not a count")))?,
                _ => return Err(usage("usage: fork N")),
            };
            let kids = fork(sock, n)?;
            Ok(kids
                .iter()
                .map(|k| k.display().to_string())
                .collect::<Vec<_>>()
                .join("\n"))
        }
        other => Err(usage(format!(
            "unknown command {other:?} (status, describe, metrics, vcpus, pause, resume, \
             stop, snapshot, fork, mailbox, vsock)"
        ))),
    }
}

fn describe_text(d: &Description) -> String {
    let mut s = format!(
        "state {}\npid {}\nsocket {}",
        d.state,
        d.pid,
        d.socket.display()
    );
    if let Some(sh) = d.shape {
        s.push_str(&format!("\nvcpus {}\nmemory_mib {}", sh.vcpus, sh.mem_mib));
    }
    if let Some(id) = d.instance_id {
        s.push_str(&format!("\ninstance_id {id:016x}"));
    }
    if let Some(g) = d.guest {
        s.push_str(&format!("\nguest {g:?}"));
    }
    if let Some(v) = &d.vsock_uds {
        s.push_str(&format!("\nvsock {}", v.display()));
    }
    if let Some(p) = &d.lineage.parent {
        s.push_str(&format!(
            "\nparent {} (depth {})",
            p.display(),
            d.lineage.depth
        ));
    }
    for l in &d.lineage.fork_layers {
        s.push_str(&format!("\nfork_layer {}", l.display()));
    }
    s
}

/// The vsock socket of the VM behind `sock`.
pub fn vsock_uds(sock: &Path) -> Result<PathBuf, ControlError> {
    connect(sock)?
        .describe()?
        .vsock_uds
        .ok_or(ControlError::NoVsock)
}

/// How `sprout` runs a worker: a `sprout-worker` beside it, else itself as
/// `sprout worker`.
pub fn worker_command() -> std::io::Result<WorkerCommand> {
    let me = std::env::current_exe()?;
    let sibling = me.with_file_name("sprout-worker");
    if sibling.is_file() {
        return Ok(WorkerCommand::new(sibling));
    }
    WorkerCommand::current_exe(&["worker"])
}

/// Forks the VM behind `sock` into `n` child worker processes; their
/// control sockets, beside the parent's.
pub fn fork(sock: &Path, n: usize) -> Result<Vec<PathBuf>, ControlError> {
    if !(1..=MAX_FORK).contains(&n) {
        return Err(usage(format!(
            "fork count {n} is out of range: use 1 to {MAX_FORK}"
        )));
    }
    let t = Instant::now();
    let mut parent = connect(sock)?;
    let d = parent.describe()?;
    let shape = d.shape.filter(|_| d.instance_id.is_some()).ok_or_else(|| {
        usage(format!(
            "The worker on {} holds no VM ({})",
            sock.display(),
            d.state
        ))
    })?;
    let dir = std::path::absolute(sock)
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_else(std::env::temp_dir);
    let stem = sock
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("vm")
        .to_string();
    // Layers whose last user was killed are removed before adding one.
    if let Err(e) = vmm::lease::sweep(&dir) {
        log::warn!("cannot sweep unused fork layers in {}: {e}", dir.display());
    }
    let cmd = worker_command().map_err(|e| {
        ControlError::Spawn(sprout_worker::spawn::SpawnError::Exec("sprout".into(), e))
    })?;
    // Ready workers first, one per child, each named for the child it
    // becomes: process start and memory slots are paid before the parent
    // pauses.
    let ids: Vec<u64> = (0..n).map(|_| vmm::new_instance_id()).collect();
    let socks: Vec<PathBuf> = ids
        .iter()
        .map(|id| dir.join(format!("{stem}-{id:016x}.sock")))
        .collect();
    let kids = cmd.spawn_ready(&socks, shape, None)?;
    log::info!(
        "fork({n}): {n} ready workers in {} us",
        t.elapsed().as_micros()
    );
    let layer = parent.write_fork_layer(&dir)?;
    log::info!(
        "fork({n}): layer written in {} us (parent paused {} us)",
        t.elapsed().as_micros(),
        layer.pause_us
    );
    let has_vsock = d.vsock_uds.is_some();
    // Each child with its id, and why its restore failed if it did.
    let results: Vec<(WorkerProcess, u64, Option<ClientError>)> = std::thread::scope(|s| {
        let hs: Vec<_> = kids
            .into_iter()
            .zip(ids)
            .map(|(mut k, id)| {
                let (layer, dir, stem) = (&layer.dir, &dir, &stem);
                s.spawn(move || {
                    let spec = RestoreSpec {
                        dir: layer.clone(),
                        backend: Backend::Mmap,
                        vsock_uds: has_vsock.then(|| dir.join(format!("{stem}-{id:016x}.vsock"))),
                        instance_id: Some(id),
                        prefetch: false,
                        net: None,
                    };
                    let r = k.client.restore_fork_layer(spec).err();
                    (k, id, r)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("fork child thread"))
            .collect()
    });
    let mut ok = Vec::new();
    let mut first_err = None;
    for (mut k, id, e) in results {
        match e {
            None => ok.push((k, id)),
            Some(e) => {
                let _ = k.client.stop();
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        stop_all(ok.into_iter().map(|(k, _)| k));
        return Err(e.into());
    }
    log::info!(
        "fork({n}): children running {} us after the request",
        t.elapsed().as_micros()
    );
    if d.guest == Some(GuestKind::Linux) && has_vsock {
        if let Err(e) = refresh(&mut ok) {
            stop_all(ok.into_iter().map(|(k, _)| k));
            return Err(e);
        }
        log::info!(
            "fork({n}): children re-identified {} us after the request",
            t.elapsed().as_micros()
        );
    }
    Ok(ok.into_iter().map(|(k, _)| k.socket).collect())
}

fn stop_all(kids: impl Iterator<Item = WorkerProcess>) {
    for mut k in kids {
        let _ = k.client.stop();
    }
}

/// Sends every Linux child its new identity, all at once: a child still
/// sharing its parent's random state and host name must not be used.
fn refresh(kids: &mut [(WorkerProcess, u64)]) -> Result<(), ControlError> {
    let mut targets = Vec::new();
    for (k, id) in kids.iter_mut() {
        let uds = k
            .client
            .describe()?
            .vsock_uds
            .ok_or(ControlError::NoVsock)?;
        targets.push((uds, *id, k.socket.clone()));
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ControlError::Runtime)?;
    rt.block_on(async {
        let mut set = tokio::task::JoinSet::new();
        for (uds, id, sock) in targets {
            set.spawn(async move {
                let client = agent::client(&uds);
                // The worker owns the VM: nothing ends it from here.
                let exit = ExitSignal::default();
                let refresh = agent::Refresh {
                    instance_id: id,
                    hostname: None,
                    machine_id: None,
                };
                agent::wait_ready(&client, &exit, REFRESH_TIMEOUT, Some(&refresh))
                    .await
                    .map(|_| ())
                    .map_err(|e| ControlError::Refresh(sock, e))
            });
        }
        let mut first = Ok(());
        while let Some(r) = set.join_next().await {
            if let Ok(Err(e)) = r {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    })
}
