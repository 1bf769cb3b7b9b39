//! Worker processes for sandboxes: starting one and booting its VM, waiting
//! for the guest's agent, stopping it, and re-adopting the live ones a
//! previous `sproutd` left when this one starts.
//!
//! Each sandbox has a directory `<data dir>/vms/<id>/`, `sproutd`'s own:
//! its worker's control socket (`control.sock`), the guest console
//! (`console.log`) and the worker's stderr (`worker.log`), and `vm/`, the
//! one part its worker may write: its private writable disk (`disk.ext4`)
//! and its vsock socket (`vsock.sock`). A disk made at a boot is a sparse
//! top over the disk template, hard-linked as `disk-base.ext4` (in the
//! sandbox's directory, where the worker cannot change what its disk
//! reads): it holds only what the guest wrote. Workers are detached (their own
//! session): they outlive `sproutd`. Everything here that talks to a worker
//! blocks; callers run it on tokio's blocking pool.
//!
//! **Jailed workers.** Run as root (unless `--no-jail`), `sproutd` starts
//! each worker jailed with a jail root (`sprout_worker::jail`): as nobody,
//! in its own mount namespace, under its seccomp filters, seeing only
//! `/dev/{kvm,userfaultfd,null,urandom}`, its own `/proc/self`, and what
//! its VM needs, exposed at the same paths as on the host: the kernel and
//! any base image read-only, `vm/` read-write (owned by the jail uid). Its
//! control socket is in its jail root, `<data dir>/jails/<jail id>/root`;
//! `control.sock` links to it. `sproutd` follows that link and reads the
//! console and log as root, so they stay out of the directory the worker
//! may write (a worker could otherwise point them anywhere). A delete
//! stops the worker, then removes its jail (found by the link after a
//! restart), then the directory.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use sprout_worker::jail::{Jail, JailError, CONTROL_SOCKET, DEFAULT_GID, DEFAULT_UID};
use sprout_worker::protocol::{
    BootSpec, Description, GuestKind, Request, Response, Shape, WorkerState,
};
use sprout_worker::{Client, WorkerCommand, WorkerProcess};
use uuid::Uuid;
use vmm::config::VmSpec;

use super::error::chain;
use super::images::TEST_GUEST_IMAGE;
use super::pool::{settle, Pool, Ready};
use super::registry::{Runtime, Sandbox, State};
use crate::agent::Probe;
use crate::linux::{self, LinuxRun};

/// How long a new sandbox's agent has to answer unless `SPROUT_BOOT_TIMEOUT`
/// (seconds) says otherwise: a boot in the emulated lab takes 10-60 s.
const BOOT_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a worker has to exit after `Stop`.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);
/// How much of a console's or log's end a failure reason quotes.
const CONSOLE_TAIL: u64 = 2048;

/// In a sandbox's directory: the worker's control socket (a link into its
/// jail when jailed).
pub const CONTROL_SOCK: &str = "control.sock";
/// In a sandbox's directory: the guest console.
pub const CONSOLE_LOG: &str = "console.log";
/// In a sandbox's directory: the worker's stderr.
pub const WORKER_LOG: &str = "worker.log";
/// In a sandbox's directory: the part its worker may write (its disk and
/// vsock socket), exposed read-write into its jail.
pub const VM_SUBDIR: &str = "vm";
/// In a sandbox's directory: the template its writable disk (`vm/disk.ext4`)
/// is a top over, hard-linked, while the disk is one.
pub const DISK_BASE: &str = "disk-base.ext4";
/// In `<data dir>`: the jailed workers' roots.
pub const JAILS_DIR: &str = "jails";

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// This host cannot run the sandbox's guest, or its files are missing.
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    Failed(String),
    /// No worker process could be started for it (nothing about the
    /// snapshot or image it was to run).
    #[error("{0}")]
    Worker(String),
    /// The agent answered, but refused to re-identify its restored guest.
    #[error("{0}")]
    Identity(String),
}

/// A sandbox's worker, once its VM runs.
pub struct Booted {
    pub worker: WorkerProcess,
    pub vsock: Option<PathBuf>,
    pub guest: GuestKind,
}

pub struct Supervisor {
    pub(super) cmd: WorkerCommand,
    vms_dir: PathBuf,
    /// `<data dir>/jails`, where jailed workers' roots are (also looked in
    /// for the jails of workers a previous `sproutd` started).
    jails_dir: PathBuf,
    /// `<data dir>/snapshots` (see [`super::store`]).
    snapshots_dir: PathBuf,
    /// Linux sandboxes' VMs get a network device on their worker's TAP
    /// (see [`super::net`]).
    pub(super) net: bool,
    /// The image versions VMs here booted over (see [`super::pins`]).
    pub(super) pins: super::pins::Pins,
}

impl Supervisor {
    /// Workers are jailed when `jail` and this process runs as root; else
    /// they run as this user, unjailed, and the log says why, once.
    pub fn new(cmd: WorkerCommand, data_dir: &Path, jail: bool) -> Self {
        let jails_dir = data_dir.join(JAILS_DIR);
        let euid = rustix::process::geteuid().as_raw();
        let cmd = if !jail {
            tracing::warn!(
                "--no-jail: workers run unjailed, as uid {euid}, with the host's file system in view"
            );
            cmd
        } else if euid != 0 {
            tracing::warn!(
                "workers run unjailed, as uid {euid}: jailing them (their own mount namespace, \
                 an unprivileged uid, seccomp filters) needs sproutd to run as root"
            );
            cmd
        } else {
            tracing::info!(
                "workers run jailed: uid {DEFAULT_UID}, own mount namespace and root under {}, \
                 seccomp filters",
                jails_dir.display()
            );
            cmd.jailed(DEFAULT_UID, DEFAULT_GID).jail_root(&jails_dir)
        };
        Self {
            cmd,
            vms_dir: data_dir.join("vms"),
            jails_dir,
            snapshots_dir: data_dir.join(super::store::SNAPSHOTS_DIR),
            net: false,
            pins: super::pins::Pins::new(data_dir),
        }
    }

    /// The network device of sandbox `id`'s VM, if sandboxes have one.
    pub(super) fn net_config(&self, id: Uuid) -> Option<vmm::config::NetConfig> {
        self.net.then(|| vmm::config::NetConfig {
            tap: super::net::TAP.to_string(),
            mac: super::net::mac_for(id),
        })
    }

    pub fn snapshots_dir(&self) -> &Path {
        &self.snapshots_dir
    }

    pub fn vm_dir(&self, id: Uuid) -> PathBuf {
        self.vms_dir.join(id.to_string())
    }

    /// Every sandbox's directory.
    pub(super) fn sandbox_dirs(&self) -> impl Iterator<Item = PathBuf> {
        std::fs::read_dir(&self.vms_dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
    }

    /// Whether workers start jailed.
    pub fn jailed(&self) -> bool {
        self.cmd.jail.is_some()
    }

    /// Makes the sandbox's directory and its `vm/` (the jail uid's when
    /// jailed); both as canonical paths, which is where exposed files are
    /// in a jail.
    pub(super) fn make_dirs(&self, id: Uuid) -> Result<(PathBuf, PathBuf), String> {
        let dir = self.vm_dir(id);
        let rw = dir.join(VM_SUBDIR);
        std::fs::create_dir_all(&rw).map_err(|e| format!("Cannot create {}: {e}", rw.display()))?;
        let dir = dir
            .canonicalize()
            .map_err(|e| format!("Cannot resolve {}: {e}", dir.display()))?;
        let rw = dir.join(VM_SUBDIR);
        if let Some(j) = &self.cmd.jail {
            give(&rw, j.uid, j.gid)?;
            rustix::fs::chmod(&rw, rustix::fs::Mode::from_raw_mode(0o700))
                .map_err(|e| format!("Cannot set the mode of {}: {e}", rw.display()))?;
        }
        Ok((dir, rw))
    }

    /// Starts a worker for `s` (or takes a ready one of its shape from
    /// `pool`) and boots its VM from `image_path` (for Linux guests; the
    /// test guest needs none). Returns once the VM runs, before its guest
    /// has booted.
    pub fn boot(
        &self,
        s: &Sandbox,
        image_path: Option<&Path>,
        pool: Option<&Pool>,
    ) -> Result<Booted, BootError> {
        let (dir, rw) = self.make_dirs(s.id).map_err(BootError::Failed)?;
        let vsock = vmm::VsockConfig {
            guest_cid: linux::GUEST_CID,
            uds_path: rw.join("vsock.sock"),
        };
        let (spec, guest) = if s.image == TEST_GUEST_IMAGE {
            let mut cfg = vmm::VmConfig::new(testguest_build::TESTGUEST_PATH);
            cfg.vcpus = s.cpus;
            cfg.mem_mib = u64::from(s.memory_mb);
            // Its guest echoes on vsock port 1234: the host side of a
            // sandbox's vsock socket can be checked without an agent.
            cfg.vsock = Some(vsock);
            cfg.validate()
                .map_err(|e| BootError::Failed(format!("Invalid VM configuration: {e}")))?;
            (cfg.spec(), GuestKind::TestGuest)
        } else {
            let run = LinuxRun {
                image: image_path.map(|p| p.to_string_lossy().into_owned()),
                disk: Some(rw.join("disk.ext4")),
                // Out of the worker's reach: it names what the disk reads.
                disk_base: Some(dir.join(DISK_BASE)),
                vsock_uds: Some(vsock.uds_path),
                cpus: s.cpus,
                memory_mib: u64::from(s.memory_mb),
                cmdline: match s.runtime {
                    Runtime::Container => String::new(),
                    Runtime::Vm => linux::VM_RUNTIME_CMDLINE.into(),
                },
                ..LinuxRun::new()
            };
            let mut cfg = linux::vm_config(&run, &rw).map_err(|e| match e {
                linux::LinuxError::Probe(_)
                | linux::LinuxError::NoKernel(_)
                | linux::LinuxError::NoImage { .. }
                | linux::LinuxError::NoTemplate(_) => BootError::Unsupported(chain(&e)),
                e => BootError::Failed(chain(&e)),
            })?;
            cfg.net = self.net_config(s.id);
            (cfg.spec(), GuestKind::Linux)
        };
        if let Some(j) = &self.cmd.jail {
            // The disks its VM writes are the jail uid's (the copy of the
            // template sproutd just made is root's).
            for d in spec.disks.iter().filter(|d| !d.read_only) {
                give(&d.path, j.uid, j.gid).map_err(BootError::Failed)?;
            }
        }
        let sock = dir.join(CONTROL_SOCK);
        let console = dir.join(CONSOLE_LOG);
        let log = dir.join(WORKER_LOG);
        let tails = || format!("{}{}", console_tail(&console), log_tail(&log));
        let shape = Shape {
            vcpus: s.cpus,
            mem_mib: u64::from(s.memory_mb),
        };
        let spawned = Instant::now();
        // A ready worker boots into its shell (KVM VM, vCPUs and memory
        // slots made); taken only now: nothing above can fail with it.
        let ready = pool.and_then(|p| p.take(shape));
        let (mut worker, ready_dir) = match ready {
            Some(Ready { worker, dir }) => (worker, Some(dir)),
            None => {
                let w = self
                    .cmd
                    .clone()
                    .log_to(&log)
                    .spawn(&sock, None, Some(&console))
                    .map_err(|e| {
                        BootError::Failed(format!(
                            "Cannot start a worker: {}{}{}",
                            chain(&e),
                            if self.jailed() {
                                " (sproutd runs as root and jails its workers, which needs \
                                 mounts and namespaces: where it cannot make them, run it \
                                 with --no-jail)"
                            } else {
                                ""
                            },
                            log_tail(&log)
                        ))
                    })?;
                (w, None)
            }
        };
        let up = spawned.elapsed();
        let spec = match &worker.jail {
            None => Ok(spec),
            Some(j) => expose(j, spec, &rw)
                .map_err(|e| format!("Cannot expose the VM's files to its jail: {}", chain(&e))),
        };
        let booted = spec.and_then(|spec| {
            let boot = Request::Boot(BootSpec {
                spec,
                instance_id: None,
            });
            let r = match worker.client.call(&boot) {
                Ok(Response::Ok) => worker.client.describe(),
                Ok(_) => Err(sprout_worker::ClientError::Unexpected("boot", "answer")),
                Err(e) => Err(e),
            };
            r.map_err(|e| format!("The worker could not boot the VM: {}", chain(&e)))
        });
        // A ready worker's socket, console and log move into the sandbox's
        // directory.
        let booted = settle(booted, &mut worker, ready_dir.as_deref(), &dir);
        match booted {
            Ok(d) => {
                // tests/lab/bench-spawn.sh reads this line.
                tracing::info!(
                    vm = %s.id,
                    "VM started {} us after the worker's spawn: worker up {} us, boot {} us{}",
                    spawned.elapsed().as_micros(),
                    up.as_micros(),
                    (spawned.elapsed() - up).as_micros(),
                    if ready_dir.is_some() { " (a ready worker)" } else { "" }
                );
                if guest == GuestKind::Linux {
                    if let Some(image) = image_path {
                        self.keep_image(s.id, &dir, image);
                    }
                }
                Ok(Booted {
                    vsock: d.vsock_uds,
                    worker,
                    guest,
                })
            }
            Err(e) => {
                let _ = worker.client.stop();
                let _ = worker.child.kill();
                if let Err(w) = worker.wait() {
                    tracing::warn!(vm = %s.id, "after a failed boot: {w}");
                }
                let tails = match &ready_dir {
                    Some(rd) => {
                        let t = self.tails_in(rd);
                        let _ = std::fs::remove_dir_all(rd);
                        t
                    }
                    None => tails(),
                };
                Err(BootError::Failed(format!("{e}{tails}")))
            }
        }
    }

    /// Keeps the version of `image` that sandbox `id`'s VM (in `dir`) just
    /// booted over, and names it in `dir`: a snapshot of it restores over
    /// that version once the image is rebuilt. A failure is logged: it
    /// costs only that.
    fn keep_image(&self, id: Uuid, dir: &Path, image: &Path) {
        let kept = self
            .pins
            .keep(image)
            .and_then(|(_, kept)| super::pins::link_from(dir, &kept));
        if let Err(e) = kept {
            tracing::warn!(
                vm = %id,
                "cannot keep this version of image {}: {e}; its snapshots cannot be restored \
                 once it is rebuilt",
                image.display()
            );
        }
    }

    /// Waits until the agent of the sandbox behind `worker_socket` answers,
    /// failing early if its worker ends: a ping, or with `refresh` the
    /// identity refresh itself (`agent::wait_ready` says why), whose report
    /// it returns.
    pub async fn wait_agent(
        &self,
        agent: &guest_agent::client::Client,
        id: Uuid,
        worker_socket: &Path,
        refresh: Option<&crate::agent::Refresh>,
    ) -> Result<(Duration, Option<guest_agent::protocol::IdentityDone>), BootError> {
        let limit = std::env::var("SPROUT_BOOT_TIMEOUT")
            .ok()
            .and_then(|s| s.parse().ok())
            .map_or(BOOT_TIMEOUT, Duration::from_secs);
        let t = Instant::now();
        let mut last_check = Instant::now();
        loop {
            let e = match crate::agent::probe(agent, refresh).await {
                Ok(done) => return Ok((t.elapsed(), done)),
                Err(Probe::Refused(e)) => {
                    return Err(BootError::Identity(format!(
                        "The guest could not be re-identified: {}",
                        chain(&e)
                    )))
                }
                Err(Probe::Unreachable(e)) => e,
            };
            if t.elapsed() > limit {
                return Err(BootError::Failed(format!(
                    "The agent did not answer within {limit:?} (last error: {}){}",
                    chain(&e),
                    self.tails(id)
                )));
            }
            if last_check.elapsed() > Duration::from_secs(1) {
                last_check = Instant::now();
                let sock = worker_socket.to_owned();
                let alive = tokio::task::spawn_blocking(move || describe(&sock))
                    .await
                    .unwrap_or_else(|e| Err(e.to_string()));
                let gone = match alive {
                    Ok(d) if matches!(d.state, WorkerState::Running | WorkerState::Created) => None,
                    Ok(d) => Some(format!("the worker's VM is {}", d.state)),
                    Err(e) => Some(e),
                };
                if let Some(why) = gone {
                    return Err(BootError::Failed(format!(
                        "The VM ended before its agent answered ({why}){}",
                        self.tails(id)
                    )));
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The end of the sandbox's worker log, as a suffix of a failure
    /// reason (empty if there is none).
    pub fn worker_log_tail(&self, id: Uuid) -> String {
        log_tail(&self.vm_dir(id).join(WORKER_LOG))
    }

    /// The ends of the sandbox's console and worker log, as a suffix of a
    /// failure reason.
    pub(super) fn tails(&self, id: Uuid) -> String {
        self.tails_in(&self.vm_dir(id))
    }

    /// [`tails`](Self::tails) of the console and log in `dir`.
    pub(super) fn tails_in(&self, dir: &Path) -> String {
        format!(
            "{}{}",
            console_tail(&dir.join(CONSOLE_LOG)),
            log_tail(&dir.join(WORKER_LOG))
        )
    }

    /// The jail of the worker whose control socket `sock` links to one, if
    /// that is under `<data dir>/jails` (`<jails>/<jail id>/root` +
    /// [`CONTROL_SOCKET`]): how a jail is found after a restart.
    pub(super) fn jail_of(&self, sock: &Path) -> Option<Jail> {
        let target = std::fs::read_link(sock).ok()?;
        let base = self.jails_dir.canonicalize().ok()?;
        let rest = target.strip_prefix(&base).ok()?;
        let mut comps = rest.components();
        let Some(Component::Normal(id)) = comps.next() else {
            return None;
        };
        let inner = Path::new("root").join(CONTROL_SOCKET.trim_start_matches('/'));
        (comps.as_path() == inner).then(|| Jail::open(base.join(id)))
    }

    /// Removes the jail the control socket (link) `sock` leads into, if any.
    pub fn remove_jail_of(&self, sock: &Path) -> Result<(), String> {
        match self.jail_of(sock) {
            Some(j) => j.remove().map_err(|e| chain(&e)),
            None => Ok(()),
        }
    }

    /// Stops the sandbox's worker (if any still answers) and waits for it to
    /// exit, then removes its jail (if it has one) and the sandbox's
    /// directory.
    pub fn stop(&self, s: &Sandbox, child: Option<WorkerProcess>) -> Result<(), String> {
        self.stop_worker(s, child)?;
        let dir = self.vm_dir(s.id);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(format!("Cannot remove {}: {e}", dir.display())),
        }
    }

    /// Stops the sandbox's worker (if any still answers), waits for it to
    /// exit and removes its jail; the sandbox's directory (its disk, its
    /// logs) stays, for the worker that restores or boots it next.
    pub fn stop_worker(&self, s: &Sandbox, child: Option<WorkerProcess>) -> Result<(), String> {
        let dir = self.vm_dir(s.id);
        // A worker sproutd started but had not recorded yet is on the
        // sandbox's own socket path.
        let sock = s.worker_socket.clone().or_else(|| {
            let p = dir.join(CONTROL_SOCK);
            p.symlink_metadata().is_ok().then_some(p)
        });
        let jail = match &child {
            Some(w) => w.jail.clone(),
            None => sock.as_deref().and_then(|p| self.jail_of(p)),
        };
        // Whether a worker answered: one that does not is gone already
        // (nothing listens on its socket), and its pid may be another's.
        let mut answered = false;
        if let Some(sock) = &sock {
            if let Ok(mut c) = Client::connect(sock) {
                answered = true;
                match c.describe() {
                    // Only the sandbox's own worker is told to stop. (A
                    // child of this sproutd is stopped below whatever pid
                    // it claims: a worker that lies must not escape delete.)
                    Ok(d) if child.is_none() && s.pid.is_some_and(|p| p != d.pid) => {
                        return Err(format!(
                            "Another process (pid {}) answers on the worker's socket {}: not \
                             stopping it",
                            d.pid,
                            sock.display()
                        ))
                    }
                    _ => {
                        if let Err(e) = c.stop() {
                            tracing::warn!(vm = %s.id, "stop: {}", chain(&e));
                        }
                    }
                }
            }
        }
        match child {
            Some(mut w) => {
                let t = Instant::now();
                loop {
                    match w.child.try_wait() {
                        Ok(Some(_)) | Err(_) => break,
                        Ok(None) if t.elapsed() > STOP_TIMEOUT => {
                            tracing::warn!(vm = %s.id, "worker did not exit: killing it");
                            let _ = w.child.kill();
                            let _ = w.child.wait();
                            break;
                        }
                        Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                    }
                }
                // Its jail is removed below, before the directory.
                w.jail = None;
            }
            None => {
                // An adopted worker is not our child: wait until its socket
                // no longer answers, then (a moment) until it has exited.
                if let Some(sock) = &sock {
                    let t = Instant::now();
                    while Client::connect(sock).is_ok() {
                        if t.elapsed() > STOP_TIMEOUT {
                            return Err(format!(
                                "The worker on {} did not exit within {STOP_TIMEOUT:?}",
                                sock.display()
                            ));
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
                if let Some(pid) = s.pid.filter(|_| answered) {
                    let t = Instant::now();
                    while alive(pid) && t.elapsed() < STOP_TIMEOUT {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
            }
        }
        if let Some(j) = jail {
            j.remove().map_err(|e| {
                format!(
                    "Cannot remove the worker's jail {}: {}",
                    j.dir().display(),
                    chain(&e)
                )
            })?;
        }
        Ok(())
    }

    /// What a previous `sproutd` left: the state `s` should now have, and
    /// the failure reason when its worker is gone.
    pub fn adopt(&self, s: &Sandbox) -> (State, Option<String>) {
        let Some(sock) = &s.worker_socket else {
            return (
                State::Failed,
                Some("sproutd stopped before the sandbox's worker started".into()),
            );
        };
        match describe(sock) {
            Err(e) => (
                State::Failed,
                Some(format!(
                    "The sandbox's worker is gone ({e}){}",
                    self.worker_log_tail(s.id)
                )),
            ),
            Ok(d) if s.pid.is_some_and(|p| p != d.pid) => (
                State::Failed,
                Some(format!(
                    "Another process (pid {}) answers on the worker's socket",
                    d.pid
                )),
            ),
            Ok(d) => match d.state {
                WorkerState::Running | WorkerState::Created => (State::Running, None),
                WorkerState::Paused => (State::Paused, None),
                other => (
                    State::Failed,
                    Some(format!("The sandbox's worker holds no live VM ({other})")),
                ),
            },
        }
    }
}

/// Exposes into `jail` what the VM of `spec` needs (see the module docs):
/// `rw`, the sandbox's `vm/`, read-write; the kernel read-only; each disk
/// outside `rw` as the disk is. Returns the spec with every path as the
/// worker sees it: exposed files are at their canonical host paths.
fn expose(jail: &Jail, mut spec: VmSpec, rw: &Path) -> Result<VmSpec, JailError> {
    jail.expose(rw, false)?;
    spec.kernel = jail.expose(&spec.kernel, true)?;
    for d in spec.disks.iter_mut() {
        if !d.path.starts_with(rw) {
            d.path = jail.expose(&d.path, d.read_only)?;
        }
        if let Some(b) = &d.base {
            d.base = Some(jail.expose(b, true)?);
        }
    }
    Ok(spec)
}

/// Gives `path` to the jail's uid and gid.
pub(super) fn give(path: &Path, uid: u32, gid: u32) -> Result<(), String> {
    rustix::fs::chown(
        path,
        Some(rustix::fs::Uid::from_raw(uid)),
        Some(rustix::fs::Gid::from_raw(gid)),
    )
    .map_err(|e| {
        format!(
            "Cannot give {} to the jail's uid {uid}: {e}",
            path.display()
        )
    })
}

/// Whether process `pid` runs (a zombie does not).
pub(super) fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !s.rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

/// Describes the worker on `sock`.
pub fn describe(sock: &Path) -> Result<Description, String> {
    let mut c = Client::connect(sock).map_err(|e| chain(&e))?;
    c.describe().map_err(|e| chain(&e))
}

/// The last [`CONSOLE_TAIL`] bytes of a console file, as a suffix of a
/// failure reason (empty if there is none).
fn console_tail(path: &Path) -> String {
    tail(path, "console ends")
}

/// The end of a worker's log (a refused syscall is said there), likewise.
fn log_tail(path: &Path) -> String {
    tail(path, "worker log ends")
}

fn tail(path: &Path, what: &str) -> String {
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(_) => return String::new(),
    };
    let len = f.metadata().map_or(0, |m| m.len());
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(CONSOLE_TAIL)));
    let mut buf = Vec::new();
    let _ = f.take(CONSOLE_TAIL).read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let text = text.trim();
    if text.is_empty() {
        String::new()
    } else {
        format!("; {what}:\n{text}")
    }
}
