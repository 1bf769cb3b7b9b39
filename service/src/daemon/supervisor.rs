//! Worker processes for sandboxes: starting one and booting its VM, waiting
//! for the guest's agent, stopping it, and re-adopting the live ones a
//! previous `sproutd` left when this one starts.
//!
//! Each sandbox has a directory `<data dir>/vms/<id>/` with its worker's
//! control socket (`control.sock`), its vsock socket (`vsock.sock`), its
//! private writable disk (`disk.ext4`) and its console (`console.log`).
//! Workers are detached (their own session): they outlive `sproutd`.
//! Everything here that talks to a worker blocks; callers run it on
//! tokio's blocking pool.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sprout_worker::protocol::{BootSpec, Description, GuestKind, Request, Response, WorkerState};
use sprout_worker::{Client, WorkerCommand, WorkerProcess};
use uuid::Uuid;

use super::error::chain;
use super::images::TEST_GUEST_IMAGE;
use super::registry::{Sandbox, State};
use crate::linux::{self, LinuxRun};

/// How long a new sandbox's agent has to answer unless `SPROUT_BOOT_TIMEOUT`
/// (seconds) says otherwise: a boot in the emulated lab takes 10-60 s.
const BOOT_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a worker has to exit after `Stop`.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);
/// How much of a console's end a failure reason quotes.
const CONSOLE_TAIL: u64 = 2048;

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// This host cannot run the sandbox's guest, or its files are missing.
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    Failed(String),
}

/// A sandbox's worker, once its VM runs.
pub struct Booted {
    pub worker: WorkerProcess,
    pub vsock: Option<PathBuf>,
    pub guest: GuestKind,
}

pub struct Supervisor {
    cmd: WorkerCommand,
    vms_dir: PathBuf,
}

impl Supervisor {
    pub fn new(cmd: WorkerCommand, data_dir: &Path) -> Self {
        Self {
            cmd,
            vms_dir: data_dir.join("vms"),
        }
    }

    pub fn vm_dir(&self, id: Uuid) -> PathBuf {
        self.vms_dir.join(id.to_string())
    }

    /// Starts a worker for `s` and boots its VM from `image_path` (for Linux
    /// guests; the test guest needs none). Returns once the VM runs, before
    /// its guest has booted.
    pub fn boot(&self, s: &Sandbox, image_path: Option<&Path>) -> Result<Booted, BootError> {
        let dir = self.vm_dir(s.id);
        std::fs::create_dir_all(&dir)
            .map_err(|e| BootError::Failed(format!("Cannot create {}: {e}", dir.display())))?;
        let (spec, guest) = if s.image == TEST_GUEST_IMAGE {
            let mut cfg = vmm::VmConfig::new(testguest_build::TESTGUEST_PATH);
            cfg.vcpus = s.cpus;
            cfg.mem_mib = u64::from(s.memory_mb);
            cfg.validate()
                .map_err(|e| BootError::Failed(format!("Invalid VM configuration: {e}")))?;
            (cfg.spec(), GuestKind::TestGuest)
        } else {
            let run = LinuxRun {
                image: image_path.map(|p| p.to_string_lossy().into_owned()),
                disk: Some(dir.join("disk.ext4")),
                vsock_uds: Some(dir.join("vsock.sock")),
                cpus: s.cpus,
                memory_mib: u64::from(s.memory_mb),
                ..LinuxRun::new()
            };
            let cfg = linux::vm_config(&run, &dir).map_err(|e| match e {
                linux::LinuxError::Probe(_)
                | linux::LinuxError::NoKernel(_)
                | linux::LinuxError::NoImage { .. }
                | linux::LinuxError::NoTemplate(_) => BootError::Unsupported(chain(&e)),
                e => BootError::Failed(chain(&e)),
            })?;
            (cfg.spec(), GuestKind::Linux)
        };
        let sock = dir.join("control.sock");
        let console = dir.join("console.log");
        let mut worker = self
            .cmd
            .spawn(&sock, None, Some(&console))
            .map_err(|e| BootError::Failed(format!("Cannot start a worker: {}", chain(&e))))?;
        let boot = Request::Boot(BootSpec {
            spec,
            instance_id: None,
        });
        let booted = match worker.client.call(&boot) {
            Ok(Response::Ok) => worker.client.describe(),
            Ok(_) => Err(sprout_worker::ClientError::Unexpected("boot", "answer")),
            Err(e) => Err(e),
        };
        match booted {
            Ok(d) => Ok(Booted {
                vsock: d.vsock_uds,
                worker,
                guest,
            }),
            Err(e) => {
                let _ = worker.client.stop();
                let _ = worker.child.kill();
                let _ = worker.wait();
                Err(BootError::Failed(format!(
                    "The worker could not boot the VM: {}{}",
                    chain(&e),
                    console_tail(&console)
                )))
            }
        }
    }

    /// Waits until the agent of the sandbox behind `worker_socket` answers a
    /// ping, failing early if its worker ends.
    pub async fn wait_agent(
        &self,
        agent: &guest_agent::client::Client,
        id: Uuid,
        worker_socket: &Path,
    ) -> Result<Duration, BootError> {
        let limit = std::env::var("SPROUT_BOOT_TIMEOUT")
            .ok()
            .and_then(|s| s.parse().ok())
            .map_or(BOOT_TIMEOUT, Duration::from_secs);
        let t = Instant::now();
        let mut last_check = Instant::now();
        loop {
            let e = match agent.ping().await {
                Ok(_) => return Ok(t.elapsed()),
                Err(e) => e,
            };
            if t.elapsed() > limit {
                return Err(BootError::Failed(format!(
                    "The agent did not answer within {limit:?} (last error: {}){}",
                    chain(&e),
                    console_tail(&self.vm_dir(id).join("console.log"))
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
                        console_tail(&self.vm_dir(id).join("console.log"))
                    )));
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops the sandbox's worker (if any still answers) and waits for it to
    /// exit, then removes the sandbox's directory.
    pub fn stop(&self, s: &Sandbox, child: Option<WorkerProcess>) -> Result<(), String> {
        let sock = s.worker_socket.clone();
        if let Some(sock) = &sock {
            if let Ok(mut c) = Client::connect(sock) {
                if let Err(e) = c.stop() {
                    tracing::warn!(vm = %s.id, "stop: {}", chain(&e));
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
                let _ = w.cleanup();
            }
            None => {
                // An adopted worker is not our child: wait until its socket
                // no longer answers.
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
            }
        }
        let dir = self.vm_dir(s.id);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(format!("Cannot remove {}: {e}", dir.display())),
        }
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
                Some(format!("The sandbox's worker is gone ({e})")),
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

/// Describes the worker on `sock`.
pub fn describe(sock: &Path) -> Result<Description, String> {
    let mut c = Client::connect(sock).map_err(|e| chain(&e))?;
    c.describe().map_err(|e| chain(&e))
}

/// The last [`CONSOLE_TAIL`] bytes of a console file, as a suffix of a
/// failure reason (empty if there is none).
fn console_tail(path: &Path) -> String {
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
        format!("; console ends:\n{text}")
    }
}
