//! Ready workers: for each shape sandboxes are restored in (a template's, a
//! fork's, a wake's), `sproutd` keeps `--ready-workers` worker processes
//! started, jailed and holding a `VmShell` (KVM VM, vCPUs, memory slots),
//! so that process start and slot registration are not on the restore path.
//!
//! A ready worker lives in `<data dir>/ready/<id>/` (its control socket, or
//! the link to it in its jail; its console and log) until a restore takes
//! it: once its VM is restored the three move into the sandbox's directory
//! (the worker keeps its open console and log, and its listening socket,
//! through the renames). A taken worker is replaced in the background.
//! Ready workers a previous `sproutd` left (after a `kill -9`) are stopped
//! at start, and a graceful stop stops them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use sprout_worker::protocol::{Shape, WorkerState};
use sprout_worker::WorkerProcess;

use super::error::chain;
use super::lock;
use super::supervisor::{Supervisor, CONSOLE_LOG, CONTROL_SOCK, WORKER_LOG};

/// In `<data dir>`: the ready workers' directories.
pub const READY_DIR: &str = "ready";
/// Most shapes kept ready at once (the least recently used goes first).
const MAX_SHAPES: usize = 8;

/// A started ready worker and its directory.
pub struct Ready {
    pub worker: WorkerProcess,
    pub dir: PathBuf,
}

#[derive(Default)]
struct Shapes {
    ready: HashMap<(u8, u64), Vec<Ready>>,
    /// Shapes by last use, oldest first.
    used: Vec<(u8, u64)>,
    /// Shapes a refill is under way for.
    filling: Vec<(u8, u64)>,
}

pub struct Pool {
    per_shape: usize,
    dir: PathBuf,
    shapes: Mutex<Shapes>,
}

fn key(s: Shape) -> (u8, u64) {
    (s.vcpus, s.mem_mib)
}

impl Pool {
    pub fn new(data_dir: &Path, per_shape: usize) -> Self {
        Self {
            per_shape,
            dir: data_dir.join(READY_DIR),
            shapes: Mutex::default(),
        }
    }

    pub fn per_shape(&self) -> usize {
        self.per_shape
    }

    /// A ready worker of `shape` that still runs, if one is there.
    pub fn take(&self, shape: Shape) -> Option<Ready> {
        let mut s = lock(&self.shapes);
        let k = key(shape);
        s.used.retain(|u| *u != k);
        s.used.push(k);
        let list = s.ready.get_mut(&k)?;
        while let Some(mut r) = list.pop() {
            if matches!(r.worker.child.try_wait(), Ok(None)) {
                return Some(r);
            }
            tracing::warn!(dir = %r.dir.display(), "a ready worker had exited: discarded");
            let _ = r.worker.wait();
            let _ = std::fs::remove_dir_all(&r.dir);
        }
        None
    }

    /// Starts ready workers of `shape` until there are `--ready-workers`
    /// (blocking; one refill per shape at a time). Shapes past the most
    /// kept lose their workers, least recently used first.
    pub fn refill(&self, sup: &Supervisor, shape: Shape) {
        let k = key(shape);
        let (want, evicted) = {
            let mut s = lock(&self.shapes);
            if self.per_shape == 0 || s.filling.contains(&k) {
                return;
            }
            if !s.used.contains(&k) {
                s.used.push(k);
            }
            let mut evicted = Vec::new();
            while s.used.len() > MAX_SHAPES {
                let old = s.used.remove(0);
                evicted.extend(s.ready.remove(&old).unwrap_or_default());
            }
            let have = s.ready.get(&k).map_or(0, Vec::len);
            s.filling.push(k);
            (self.per_shape.saturating_sub(have), evicted)
        };
        for r in evicted {
            discard(r);
        }
        for _ in 0..want {
            match self.start(sup, shape) {
                Ok(r) => {
                    let dir = r.dir.clone();
                    lock(&self.shapes).ready.entry(k).or_default().push(r);
                    tracing::info!(
                        dir = %dir.display(),
                        "a ready worker of {} vCPUs, {} MiB waits", shape.vcpus, shape.mem_mib
                    );
                }
                Err(e) => {
                    tracing::warn!(
                        vcpus = shape.vcpus,
                        mem_mib = shape.mem_mib,
                        "cannot start a ready worker: {e}"
                    );
                    break;
                }
            }
        }
        lock(&self.shapes).filling.retain(|f| *f != k);
    }

    fn start(&self, sup: &Supervisor, shape: Shape) -> Result<Ready, String> {
        let dir = self.dir.join(format!("{:016x}", vmm::new_instance_id()));
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("Cannot create {}: {e}", dir.display()))?;
        let r = sup
            .cmd
            .clone()
            .log_to(dir.join(WORKER_LOG))
            .spawn(
                &dir.join(CONTROL_SOCK),
                Some(shape),
                Some(&dir.join(CONSOLE_LOG)),
            )
            .map_err(|e| chain(&e));
        match r {
            Ok(worker) => Ok(Ready { worker, dir }),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                Err(e)
            }
        }
    }

    /// Stops every ready worker (a graceful stop of sproutd).
    pub fn stop_all(&self) {
        let all: Vec<Ready> = lock(&self.shapes)
            .ready
            .drain()
            .flat_map(|(_, v)| v)
            .collect();
        for r in all {
            discard(r);
        }
    }

    /// At start: stops the ready workers a previous sproutd left, and
    /// removes their directories (and jails).
    pub fn sweep_leftovers(&self, sup: &Supervisor) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut n = 0;
        for e in rd.flatten() {
            let dir = e.path();
            let sock = dir.join(CONTROL_SOCK);
            if let Ok(mut c) = sprout_worker::Client::connect(&sock) {
                // Only a worker that holds no VM: a ready one.
                if matches!(c.describe(), Ok(d) if d.state == WorkerState::Ready) {
                    let _ = c.stop();
                }
            }
            if let Err(e) = sup.remove_jail_of(&sock) {
                tracing::warn!("a left ready worker's jail: {e}");
            }
            let _ = std::fs::remove_dir_all(&dir);
            n += 1;
        }
        if n > 0 {
            tracing::info!("stopped {n} ready workers a previous sproutd left");
        }
    }
}

fn discard(mut r: Ready) {
    let _ = r.worker.client.stop();
    let _ = r.worker.child.kill();
    let _ = r.worker.wait();
    let _ = std::fs::remove_dir_all(&r.dir);
}

/// After a restore or boot into `worker` (`done`): if it was a ready
/// worker (from `ready_dir`), its socket, console and log move into the
/// sandbox's `dir`, and `worker` knows its new socket.
pub fn settle<D>(
    done: Result<D, String>,
    worker: &mut WorkerProcess,
    ready_dir: Option<&Path>,
    dir: &Path,
) -> Result<D, String> {
    match (done, ready_dir) {
        (Ok(d), Some(rd)) => match move_in(rd, dir) {
            Ok(sock) => {
                worker.socket = sock;
                Ok(d)
            }
            Err(e) => Err(format!("Cannot move a ready worker in: {e}")),
        },
        (r, _) => r,
    }
}

/// Moves a restored ready worker's socket, console and log from its
/// directory `ready_dir` into the sandbox's `dir`; a previous worker's
/// console and log are kept as `*.1`. Returns the worker's socket path there.
fn move_in(ready_dir: &Path, dir: &Path) -> std::io::Result<PathBuf> {
    for name in [CONSOLE_LOG, WORKER_LOG] {
        let dst = dir.join(name);
        if dst.exists() {
            std::fs::rename(&dst, dir.join(format!("{name}.1")))?;
        }
        match std::fs::rename(ready_dir.join(name), &dst) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    let sock = dir.join(CONTROL_SOCK);
    let _ = std::fs::remove_file(&sock);
    std::fs::rename(ready_dir.join(CONTROL_SOCK), &sock)?;
    let _ = std::fs::remove_dir_all(ready_dir);
    Ok(sock)
}

/// Runs [`Pool::refill`] for `shape` in the background.
pub fn refill_later(app: &Arc<super::App>, shape: Shape) {
    if app.pool.per_shape() == 0 {
        return;
    }
    let app = app.clone();
    tokio::task::spawn_blocking(move || app.pool.refill(&app.supervisor, shape));
}
