//! Rest states: the transitions between a sandbox's states, each serialised
//! per sandbox, and the activity that keeps a sandbox awake.
//!
//! - **One transition at a time.** Every transition (pause, resume, sleep,
//!   wake, snapshot, fork, reboot, hibernate, a checkpoint's restore, a
//!   delete) holds its sandbox's lock for writing from its state check to
//!   its last record; the gate of exec, file and process calls
//!   ([`App::live`]) holds it for reading while it checks the state (and
//!   wakes a sleeping sandbox), so no call sees a sandbox half-way through a
//!   transition. Each transition runs as its own task: a client that goes
//!   away does not cut one short.
//! - **Activity.** A call that passes the gate is busy until it ends (a
//!   streamed exec or an attached process stream for as long as it
//!   streams); the idle sweeper ([`sweeper`]) puts a sandbox to sleep only
//!   when nothing is busy and its last activity is `idleTimeoutSecs` old.
//! - **Snapshots** (see [`super::store`]) are diffs on the sandbox's last
//!   snapshot while its chain is short, else full; each is checked before
//!   it is recorded. Snapshots that nothing builds on any more (a woken
//!   sandbox's sleep snapshot, a deleted checkpoint) are removed by
//!   [`App::collect_garbage`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use guest_agent::client::Client as AgentClient;
use sprout_worker::protocol::GuestKind;
use tokio::sync::RwLock;
use uuid::Uuid;

use super::error::{chain, ApiError, Code};
use super::images::TEST_GUEST_IMAGE;
use super::registry::{Sandbox, SnapshotKind, SnapshotRow, State};
use super::supervisor::{BootError, Booted};
use super::tenants::Caller;
use super::{lock, now_ms, App};

/// How often the idle sweeper looks.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// A sandbox whose worker (its vCPUs and devices) used at least this share
/// of one CPU since the sweeper last looked is computing: not idle, calls or
/// none. Measured in the lab: an idle Linux guest's worker uses 0-2% of a
/// CPU, one running a busy loop 100%.
const COMPUTING: f64 = 0.2;
/// Most fork children restored at once.
const FORK_PARALLEL: usize = 8;
/// How long a `sync` in the guest may take before a reboot goes on without.
const SYNC_TIMEOUT: Duration = Duration::from_secs(30);

/// The per-sandbox locks and activity.
#[derive(Default)]
pub struct Lifecycle {
    locks: std::sync::Mutex<HashMap<Uuid, Arc<RwLock<()>>>>,
    activity: std::sync::Mutex<HashMap<Uuid, Activity>>,
    /// The sweeper's last look at each sandbox's worker CPU time.
    cpu: std::sync::Mutex<HashMap<Uuid, CpuSample>>,
}

/// A worker's CPU time (user and system, in clock ticks) when looked at.
struct CpuSample {
    pid: u32,
    ticks: u64,
    at: Instant,
}

/// Process `pid`'s CPU time, user and system, of all its threads, in clock
/// ticks (`/proc/PID/stat` fields 14 and 15; proc(5)).
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold anything.
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| f.get(n - 3)?.parse::<u64>().ok();
    Some(field(14)? + field(15)?)
}

#[derive(Clone, Copy)]
struct Activity {
    busy: usize,
    last: Instant,
}

impl Lifecycle {
    pub fn lock_of(&self, id: Uuid) -> Arc<RwLock<()>> {
        lock(&self.locks).entry(id).or_default().clone()
    }

    /// Counts `id` as active now.
    pub fn touch(&self, id: Uuid) {
        let mut a = lock(&self.activity);
        let e = a.entry(id).or_insert(Activity {
            busy: 0,
            last: Instant::now(),
        });
        e.last = Instant::now();
    }

    /// `(busy calls, time since the last activity)`.
    fn idle(&self, id: Uuid) -> (usize, Duration) {
        let a = lock(&self.activity);
        a.get(&id)
            .map_or((0, Duration::ZERO), |a| (a.busy, a.last.elapsed()))
    }

    /// Whether `id`'s worker `pid` used at least [`COMPUTING`] of a CPU
    /// since the last call (never on the first call for that worker).
    fn computing(&self, id: Uuid, pid: u32) -> bool {
        cpu_ticks(pid).is_some_and(|ticks| self.computing_at(id, pid, ticks, Instant::now()))
    }

    /// [`Lifecycle::computing`] with the worker's CPU time `ticks` read at `now`.
    fn computing_at(&self, id: Uuid, pid: u32, ticks: u64, now: Instant) -> bool {
        let last = lock(&self.cpu).insert(
            id,
            CpuSample {
                pid,
                ticks,
                at: now,
            },
        );
        let Some(last) = last.filter(|l| l.pid == pid) else {
            return false;
        };
        let secs = now.duration_since(last.at).as_secs_f64();
        let used = ticks.saturating_sub(last.ticks) as f64 / clock_ticks_per_second();
        secs > 0.0 && used >= COMPUTING * secs
    }

    pub fn forget(&self, id: Uuid) {
        lock(&self.locks).remove(&id);
        lock(&self.activity).remove(&id);
        lock(&self.cpu).remove(&id);
    }
}

/// Clock ticks per second of `/proc` CPU times (`_SC_CLK_TCK`, 100 on
/// Linux).
fn clock_ticks_per_second() -> f64 {
    rustix::param::clock_ticks_per_second() as f64
}

/// A call that passed the gate: busy until dropped.
pub struct Busy {
    app: Arc<App>,
    id: Uuid,
}

impl Drop for Busy {
    fn drop(&mut self) {
        let mut a = lock(&self.app.lifecycle.activity);
        if let Some(e) = a.get_mut(&self.id) {
            e.busy = e.busy.saturating_sub(1);
            e.last = Instant::now();
        }
    }
}

/// A running sandbox, its agent, and the call's hold on its activity.
pub struct Live {
    pub s: Sandbox,
    pub agent: Arc<AgentClient>,
    pub busy: Busy,
}

/// What a wake did.
#[derive(Debug, Clone, Default)]
pub struct Woken {
    /// The memory snapshot could not be restored: the sandbox was booted
    /// from its saved disk instead, and this says why.
    pub cold_boot: Option<String>,
}

/// The 409 for `what` in `s`'s state.
pub fn invalid(s: &Sandbox, what: &str) -> ApiError {
    let state = s.state.as_str();
    let code = if s.state == State::Paused && what.starts_with("run") {
        Code::Paused
    } else {
        Code::InvalidState
    };
    let hint = match s.state {
        State::Paused => ": resume it first",
        State::Hibernated => ": wake it first",
        State::Starting => ": wait until it runs",
        State::Failed => ": delete it",
        _ => "",
    };
    ApiError::in_state(
        code,
        state,
        format!("Sandbox {} is {state}: cannot {what}{hint}", s.id),
    )
}

fn snapshot_failed(e: impl Into<String>) -> ApiError {
    ApiError::new(Code::SnapshotFailed, e)
}

fn boot_failed(e: BootError) -> ApiError {
    match e {
        BootError::Unsupported(m) => ApiError::new(Code::HostUnsupported, m),
        BootError::Failed(m) => ApiError::new(Code::BootFailed, m),
        BootError::Worker(m) => ApiError::new(Code::WorkerFailed, m),
        BootError::Identity(m) => ApiError::new(Code::AgentUnavailable, m),
    }
}

fn restore_failed(e: BootError) -> ApiError {
    match e {
        BootError::Unsupported(m) => ApiError::new(Code::HostUnsupported, m),
        BootError::Failed(m) => ApiError::new(Code::SnapshotFailed, m),
        // Not the snapshot's fault: a template is not failed for it.
        BootError::Worker(m) => ApiError::new(Code::WorkerFailed, m),
        BootError::Identity(m) => ApiError::new(Code::AgentUnavailable, m),
    }
}

/// Runs `f` as its own task (a client going away does not cancel it).
pub async fn detached<T: Send + 'static>(
    f: impl std::future::Future<Output = Result<T, ApiError>> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::spawn(f)
        .await
        .map_err(|e| ApiError::internal(format!("a transition task failed: {e}")))?
}

impl App {
    /// The gate of every exec, file and process call: the sandbox `id`
    /// names, running (a sleeping one is woken first, transparently), its
    /// agent, and the call's activity hold. A paused sandbox is `409
    /// paused` (a pause is an operator's and is never undone by a call).
    pub async fn live(self: &Arc<Self>, caller: &Caller, id: &str) -> Result<Live, ApiError> {
        let vm = Uuid::parse_str(id).map_err(|_| ApiError::vm_not_found(id))?;
        // Looked up before any lock is made or dropped: an unknown id, or
        // another tenant's, touches no lock nor activity of the owner's.
        self.sandbox(caller, id).await?;
        let l = self.lifecycle.lock_of(vm);
        // A wake, then a second look; a sandbox that fell asleep again in
        // between (a zero-activity race with the sweeper) is woken again,
        // a few times at most.
        for _ in 0..3 {
            {
                let _g = l.read().await;
                let s = match self.sandbox(caller, id).await {
                    Ok(s) => s,
                    Err(e) => {
                        // No lock is kept for an id nothing has (the
                        // caller's own, deleted since the look above).
                        if e.code == Code::VmNotFound {
                            self.lifecycle.forget(vm);
                        }
                        return Err(e);
                    }
                };
                if s.image == TEST_GUEST_IMAGE {
                    return Err(ApiError::new(
                        Code::NotSupported,
                        format!(
                            "Sandbox {} runs the test guest, which has no agent to exec in",
                            s.id
                        ),
                    ));
                }
                match s.state {
                    State::Running => {
                        let agent = self.agent(&s).ok_or_else(|| {
                            ApiError::new(
                                Code::AgentUnavailable,
                                format!("Sandbox {} has no vsock socket", s.id),
                            )
                        })?;
                        let busy = self.busy(vm);
                        return Ok(Live { s, agent, busy });
                    }
                    State::Sleeping => {}
                    _ => return Err(invalid(&s, "run commands or touch files")),
                }
            }
            let app = self.clone();
            detached(async move { app.wake(vm, true).await.map(|_| ()) }).await?;
        }
        Err(ApiError::new(
            Code::InvalidState,
            format!("Sandbox {vm} keeps falling asleep: retry"),
        ))
    }

    fn busy(self: &Arc<Self>, id: Uuid) -> Busy {
        let mut a = lock(&self.lifecycle.activity);
        let e = a.entry(id).or_insert(Activity {
            busy: 0,
            last: Instant::now(),
        });
        e.busy += 1;
        e.last = Instant::now();
        Busy {
            app: self.clone(),
            id,
        }
    }

    /// The sandbox `id`, read under its lock held for writing.
    async fn locked(
        self: &Arc<Self>,
        id: Uuid,
    ) -> Result<(tokio::sync::OwnedRwLockWriteGuard<()>, Sandbox), ApiError> {
        let g = self.lifecycle.lock_of(id).write_owned().await;
        let s = self
            .db(move |r| r.get_sandbox(id))
            .await?
            .ok_or_else(|| ApiError::vm_not_found(&id.to_string()))?;
        Ok((g, s))
    }

    fn worker_client(s: &Sandbox) -> Result<sprout_worker::Client, ApiError> {
        let sock = s.worker_socket.as_ref().ok_or_else(|| {
            ApiError::new(
                Code::WorkerFailed,
                format!("Sandbox {} has no worker", s.id),
            )
        })?;
        sprout_worker::Client::connect(sock).map_err(|e| {
            ApiError::new(
                Code::WorkerFailed,
                format!(
                    "The worker of sandbox {} does not answer: {}",
                    s.id,
                    chain(&e)
                ),
            )
        })
    }

    /// Pauses a running sandbox's vCPUs.
    pub async fn pause(self: &Arc<Self>, id: Uuid) -> Result<Sandbox, ApiError> {
        let (_g, s) = self.locked(id).await?;
        if s.state != State::Running {
            return Err(invalid(&s, "pause"));
        }
        self.blocking(move || Self::worker_client(&s)?.pause().map_err(worker_err))
            .await?;
        self.set_state(id, State::Paused).await
    }

    /// Resumes a paused sandbox.
    pub async fn resume(self: &Arc<Self>, id: Uuid) -> Result<Sandbox, ApiError> {
        let (_g, s) = self.locked(id).await?;
        if s.state != State::Paused {
            return Err(invalid(&s, "resume"));
        }
        let _slot = self.hold_slots(&s.tenant, vec![id]).await?;
        self.blocking(move || Self::worker_client(&s)?.resume().map_err(worker_err))
            .await?;
        self.lifecycle.touch(id);
        self.set_state(id, State::Running).await
    }

    async fn set_state(self: &Arc<Self>, id: Uuid, st: State) -> Result<Sandbox, ApiError> {
        self.db(move |r| {
            r.set_state(id, st, None)?;
            r.get_sandbox(id)
        })
        .await?
        .ok_or_else(|| ApiError::vm_not_found(&id.to_string()))
    }

    async fn blocking<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| ApiError::internal(format!("a worker task failed: {e}")))?
    }

    /// Writes and records a snapshot of `s` (running or paused; held
    /// locked by the caller): a diff on its lineage when that is short and
    /// still its worker's, else full. The sandbox's lineage becomes it.
    async fn take_snapshot(
        self: &Arc<Self>,
        s: &Sandbox,
        kind: SnapshotKind,
        name: Option<String>,
    ) -> Result<SnapshotRow, ApiError> {
        let parent = match s.lineage_snapshot_id {
            Some(p) => self.db(move |r| r.get_snapshot(p)).await?,
            None => None,
        };
        let sock = s.worker_socket.clone();
        let want = parent.as_ref().map(|p| p.dir.clone());
        // Diff only on the parent the worker itself builds on.
        let parent = match (parent, sock) {
            (Some(p), Some(sock)) if (p.depth as usize) < vmm::MAX_CHAIN_DEPTH => {
                let d = self
                    .blocking(move || super::supervisor::describe(&sock).map_err(worker_failed))
                    .await?;
                let own = d.lineage.parent == want && !d.lineage.fork_layers.contains(&p.dir);
                own.then_some(p)
            }
            _ => None,
        };
        // A diff needs its parent's files: gone from this disk, they come
        // back from the object store; if they cannot, the snapshot is full.
        let parent = match parent {
            Some(p) => match self.ensure_local(p.id).await {
                Ok(_) => Some(p),
                Err(e) => {
                    tracing::warn!(vm = %s.id, "{e}: a full snapshot instead of a diff");
                    None
                }
            },
            None => None,
        };
        let id = Uuid::new_v4();
        let (a, row, diff) = (self.clone(), s.clone(), parent.is_some());
        let t = Instant::now();
        let w = self
            .blocking(move || {
                a.supervisor
                    .snapshot(&row, (&row.tenant, Some(row.id)), id, diff)
                    .map_err(snapshot_failed)
            })
            .await?;
        let snap = SnapshotRow {
            id,
            tenant: s.tenant.clone(),
            vm_id: Some(s.id),
            name,
            dir: w.dir,
            kind,
            parent_id: parent.as_ref().map(|p| p.id),
            depth: parent.as_ref().map_or(1, |p| p.depth + 1),
            image: s.image.clone(),
            runtime: s.runtime,
            cpus: s.cpus,
            memory_mb: s.memory_mb,
            env: s.env.clone(),
            size_bytes: w.size_bytes,
            created_ms: now_ms(),
            uploaded_ms: None,
            imported: false,
        };
        let (row, vm, rest) = (snap.clone(), s.id, s.rest_snapshot_id);
        let recorded = self
            .db(move |r| {
                r.insert_snapshot(&row)?;
                r.set_snapshots(vm, Some(row.id), rest)
            })
            .await;
        if let Err(e) = recorded {
            // Not recorded: not kept.
            self.supervisor.remove_snapshot(&snap.dir);
            return Err(e);
        }
        self.metrics.snapshot.observe(t.elapsed());
        self.snapshot_taken();
        tracing::info!(
            vm = %s.id, snapshot = %id, kind = kind.as_str(), diff,
            bytes = snap.size_bytes, "snapshot in {} ms", t.elapsed().as_millis()
        );
        Ok(snap)
    }

    /// `POST /vms/{id}/snapshot`: a user snapshot; the sandbox is left
    /// paused when asked.
    pub async fn snapshot(
        self: &Arc<Self>,
        id: Uuid,
        leave_paused: bool,
        kind: SnapshotKind,
        name: Option<String>,
    ) -> Result<(Sandbox, SnapshotRow), ApiError> {
        let (_g, s) = self.locked(id).await?;
        if !matches!(s.state, State::Running | State::Paused) {
            return Err(invalid(&s, "take a snapshot"));
        }
        if kind == SnapshotKind::Checkpoint {
            let n = self
                .db(move |r| {
                    Ok(r.list_snapshots()?
                        .iter()
                        .filter(|c| c.kind == SnapshotKind::Checkpoint && c.vm_id == Some(id))
                        .count())
                })
                .await?;
            if n >= super::rest::MAX_CHECKPOINTS {
                return Err(ApiError::new(
                    Code::TooManyCheckpoints,
                    format!(
                        "Sandbox {id} has {n} checkpoints, the most it may keep: delete one \
                         first (nothing is dropped silently)"
                    ),
                ));
            }
        }
        if leave_paused && s.state == State::Running {
            let c = s.clone();
            self.blocking(move || Self::worker_client(&c)?.pause().map_err(worker_err))
                .await?;
            self.db(move |r| r.set_state(id, State::Paused, None))
                .await?;
        }
        let snap = self.take_snapshot(&s, kind, name).await?;
        if kind == SnapshotKind::User {
            self.retain(id).await;
        }
        let s = self.get(id).await?;
        Ok((s, snap))
    }

    /// Retention by age for every sandbox (sproutd runs it at start and
    /// hourly, so that a snapshot past `--keep-days` goes even if its
    /// sandbox takes no new one): [`Self::retain`] for each sandbox, live
    /// or deleted, that has a user snapshot older than that.
    pub async fn retain_by_age(self: &Arc<Self>) {
        let (_, days) = self.retention;
        if days == 0 {
            return;
        }
        let before = now_ms().saturating_sub(u64::from(days) * 86_400_000);
        let vms = match self.db(|r| r.list_snapshots()).await {
            Ok(all) => all
                .into_iter()
                .filter(|s| s.kind == SnapshotKind::User && s.created_ms < before)
                .filter_map(|s| s.vm_id)
                .collect::<std::collections::BTreeSet<_>>(),
            Err(e) => {
                tracing::warn!("retention: {}", e.message);
                return;
            }
        };
        for vm in vms {
            self.retain(vm).await;
        }
    }

    /// Retention, after a user snapshot of `vm`: its user snapshots past
    /// the newest kept, or older than the days kept, are deleted (those a
    /// checkpoint, a template or a sandbox builds on are kept; see
    /// [`super::registry::Registry::retention_victims`]).
    async fn retain(self: &Arc<Self>, vm: Uuid) {
        let (keep, days) = self.retention;
        if keep == 0 && days == 0 {
            return;
        }
        let before = if days == 0 {
            0
        } else {
            now_ms().saturating_sub(u64::from(days) * 86_400_000)
        };
        let r = self
            .db(move |r| {
                let victims = r.retention_victims(vm, keep, before)?;
                for v in &victims {
                    r.set_snapshot_kind(*v, SnapshotKind::Dropped)?;
                }
                Ok(victims)
            })
            .await;
        match r {
            Ok(v) if !v.is_empty() => {
                tracing::info!(vm = %vm, "retention deleted {} snapshots", v.len());
                self.collect_garbage().await;
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(vm = %vm, "retention: {}", e.message),
        }
    }

    async fn get(self: &Arc<Self>, id: Uuid) -> Result<Sandbox, ApiError> {
        self.db(move |r| r.get_sandbox(id))
            .await?
            .ok_or_else(|| ApiError::vm_not_found(&id.to_string()))
    }

    /// Puts a running sandbox to sleep (`to` sleeping) or hibernates it:
    /// snapshot, record, then free its worker. `idle`: the sweeper's, which
    /// gives up rather than wait for the lock or sleep a busy sandbox.
    pub async fn suspend(self: &Arc<Self>, id: Uuid, to: State) -> Result<Sandbox, ApiError> {
        let (g, s) = self.locked(id).await?;
        self.suspend_locked(g, s, to).await
    }

    /// [`suspend`](Self::suspend) with the sandbox's lock `g` held: answers
    /// once the sandbox is recorded asleep (or hibernated); its worker is
    /// stopped after that, still under the lock, so a wake waits for it.
    async fn suspend_locked(
        self: &Arc<Self>,
        g: tokio::sync::OwnedRwLockWriteGuard<()>,
        s: Sandbox,
        to: State,
    ) -> Result<Sandbox, ApiError> {
        let id = s.id;
        let ok = match to {
            State::Sleeping => s.state == State::Running,
            _ => matches!(s.state, State::Running | State::Paused | State::Sleeping),
        };
        if !ok {
            let what = if to == State::Sleeping {
                "sleep"
            } else {
                "hibernate"
            };
            return Err(invalid(&s, what));
        }
        if s.state == State::Sleeping {
            // Asleep already: its snapshot is the hibernation's.
            return self.set_state(id, to).await;
        }
        if to == State::Sleeping {
            let (busy, _) = self.lifecycle.idle(id);
            if busy > 0 {
                return Err(ApiError::in_state(
                    Code::InvalidState,
                    s.state.as_str(),
                    format!(
                        "Sandbox {id} has {busy} calls running (an exec, an attached stream): \
                         it sleeps once they end; hibernate it to stop them"
                    ),
                ));
            }
        }
        let snap = self.take_snapshot(&s, SnapshotKind::Rest, None).await?;
        // Recorded before the worker goes, so its watcher does not take
        // the stop for a failure.
        self.db(move |r| {
            r.set_snapshots(id, Some(snap.id), Some(snap.id))?;
            r.set_worker_opt(id, None)?;
            r.set_state(id, to, None)
        })
        .await?;
        tracing::info!(vm = %id, "{}", to.as_str());
        let answer = self.get(id).await;
        let app = self.clone();
        tokio::spawn(async move {
            let _g = g;
            app.free_worker(&s).await;
            app.collect_garbage().await;
        });
        answer
    }

    /// `POST /vms/{id}/archive`: the sandbox's memory and disk go to the
    /// object store (a rest snapshot of a running or paused one, the one a
    /// sleeping or hibernated one has), with a record another node can
    /// unarchive it from; its worker and local files are freed. Answers
    /// once all of it is in the store.
    pub async fn archive(self: &Arc<Self>, id: Uuid) -> Result<Sandbox, ApiError> {
        let Some(m) = self.mirror.as_ref() else {
            return Err(ApiError::new(
                Code::NotSupported,
                "Archiving needs an object store: run sproutd with --s3-endpoint and --s3-bucket",
            ));
        };
        let (_g, s) = self.locked(id).await?;
        if !matches!(
            s.state,
            State::Running | State::Paused | State::Sleeping | State::Hibernated
        ) {
            return Err(invalid(&s, "archive"));
        }
        let t = Instant::now();
        let rest = if s.state.has_worker() {
            let snap = self.take_snapshot(&s, SnapshotKind::Rest, None).await?;
            self.db(move |r| {
                r.set_snapshots(id, Some(snap.id), Some(snap.id))?;
                r.set_worker_opt(id, None)?;
                r.set_state(id, State::Hibernated, None)
            })
            .await?;
            self.free_worker(&s).await;
            snap.id
        } else {
            s.rest_snapshot_id
                .ok_or_else(|| ApiError::internal(format!("Sandbox {id} has no rest snapshot")))?
        };
        let stored = async {
            self.upload_chain(m, rest).await?;
            let chain = self.chain_rows(rest).await?;
            let s = self.get(id).await.map_err(|e| e.message)?;
            let rec = super::mirror::ArchiveRecord::of(&s, &chain)
                .ok_or_else(|| format!("Sandbox {id} has no rest snapshot"))?;
            m.put_archive(&rec).await
        };
        if let Err(e) = stored.await {
            // Hibernated (its memory and disk kept here): a wake, or
            // another archive, still works.
            return Err(ApiError::new(
                Code::StoreFailed,
                format!("Sandbox {id} is hibernated, not archived: {e}"),
            ));
        }
        let evict = self
            .db(move |r| {
                r.set_state(id, State::Archived, None)?;
                r.evictable(id)
            })
            .await?;
        let a = self.clone();
        let freed = tokio::task::spawn_blocking(move || {
            for e in &evict {
                a.supervisor.remove_snapshot(&e.dir);
            }
            // Its directory (disk, logs) goes too; the store has it all.
            let dir = a.supervisor.vm_dir(id);
            let _ = std::fs::remove_dir_all(dir);
            evict.len()
        })
        .await
        .unwrap_or(0);
        self.metrics.archive.observe(t.elapsed());
        tracing::info!(
            vm = %id, snapshot = %rest, evicted = freed,
            "archived in {} ms", t.elapsed().as_millis()
        );
        self.get(id).await
    }

    /// `POST /vms/{id}/unarchive`: an archived sandbox of this node, or
    /// (with `import`, the record another node left in the store) one it
    /// archived: its chain is downloaded, verified and restored into a new
    /// worker, same id, files and processes. Before anything else this node
    /// claims the sandbox in its record, on the condition that the record
    /// is still the one it read, so of two nodes unarchiving it at once one
    /// goes on and the other answers 409; the record goes once it runs.
    pub async fn unarchive(
        self: &Arc<Self>,
        id: Uuid,
        import: Option<super::mirror::Held>,
    ) -> Result<Sandbox, ApiError> {
        let Some(m) = self.mirror.as_ref() else {
            return Err(ApiError::new(
                Code::NotSupported,
                "Unarchiving needs an object store: run sproutd with --s3-endpoint and --s3-bucket",
            ));
        };
        let mut claimed = None;
        if let Some(held) = import {
            let rest = held.rec.rest_snapshot_id();
            let held = claim(m, id, held, rest).await?;
            let rows = held.rec.rows(self.supervisor.snapshots_dir());
            let imported = match rows {
                None => Err(ApiError::new(
                    Code::StoreFailed,
                    format!("The archive record of sandbox {id} does not hold together"),
                )),
                Some((row, chain)) => match self.db(move |r| r.import_archived(&row, &chain)).await
                {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(why)) => Err(ApiError::new(
                        Code::StoreFailed,
                        format!("The archive record of sandbox {id} is refused: {why}"),
                    )),
                    Err(e) => Err(e),
                },
            };
            if let Err(e) = imported {
                release(m, id, held).await;
                return Err(e);
            }
            tracing::info!(vm = %id, "imported from the object store's archive record");
            claimed = Some(held);
        }
        let (_g, s) = match self.locked(id).await {
            Ok(l) => l,
            Err(e) => {
                if let Some(h) = claimed {
                    release(m, id, h).await;
                }
                return Err(e);
            }
        };
        let claimed_here = claimed.is_some();
        let r = self.unarchive_locked(m, &s, claimed).await;
        if r.is_err() && claimed_here {
            tracing::info!(vm = %id, "imported, not unarchived: it stays archived here");
        }
        r?;
        drop(_g);
        self.get(id).await
    }

    async fn unarchive_locked(
        self: &Arc<Self>,
        m: &super::mirror::Mirror,
        s: &Sandbox,
        claimed: Option<super::mirror::Held>,
    ) -> Result<(), ApiError> {
        let id = s.id;
        let ready = async {
            if s.state != State::Archived {
                return Err(invalid(s, "unarchive"));
            }
            let slot = self.hold_slots(&s.tenant, vec![id]).await?;
            let rest = s
                .rest_snapshot_id
                .ok_or_else(|| ApiError::internal(format!("Sandbox {id} has no rest snapshot")))?;
            Ok((slot, rest))
        };
        let (_slot, rest) = match ready.await {
            Ok(r) => r,
            Err(e) => {
                if let Some(h) = claimed {
                    release(m, id, h).await;
                }
                return Err(e);
            }
        };
        let held = match claimed {
            Some(h) => h,
            None => {
                let got = m
                    .get_archive(&s.tenant, id)
                    .await
                    .map_err(|e| ApiError::new(Code::StoreFailed, e))?
                    .ok_or_else(|| {
                        ApiError::in_state(
                            Code::InvalidState,
                            "archived",
                            format!(
                                "Sandbox {id} was unarchived elsewhere: its archive record is \
                                 gone from the object store (delete it here)"
                            ),
                        )
                    })?;
                claim(m, id, got, rest).await?
            }
        };
        let t = Instant::now();
        // The claim is renewed while the chain downloads and restores
        // (that may take long), and marked taken (conditionally, again)
        // before the sandbox is reported running: a node that lost its
        // claim meanwhile stops what it restored.
        let stop = Arc::new(tokio::sync::Notify::new());
        let renewer = {
            let (a, stop) = (self.clone(), stop.clone());
            tokio::spawn(async move {
                let mut held = held;
                loop {
                    tokio::select! {
                        () = stop.notified() => return Some(held),
                        () = tokio::time::sleep(super::mirror::CLAIM_TTL / 3) => {}
                    }
                    let Some(m) = a.mirror.as_ref() else {
                        return Some(held);
                    };
                    match m.renew_archive(&held).await {
                        Ok(Some(h)) => held = h,
                        Ok(None) => {
                            tracing::error!(vm = %id, "lost its claim in its archive record");
                            return None;
                        }
                        Err(e) => tracing::warn!(vm = %id, "cannot renew its claim: {e}"),
                    }
                }
            })
        };
        let end_renewal = || async {
            stop.notify_one();
            renewer.await.ok().flatten()
        };
        // Starting while it restores: nothing evicts its chain meanwhile.
        let restored = match self
            .db(move |r| r.set_state(id, State::Starting, None))
            .await
        {
            Ok(_) => self.restore_into(s, rest, s.hostname.clone()).await,
            Err(e) => Err(e),
        };
        let held = end_renewal().await;
        if let Err(e) = restored {
            // Still archived: the store keeps it, another try (here or
            // elsewhere) may work.
            let st = State::Archived;
            let back = self.db(move |r| r.set_state(id, st, None)).await;
            if let Some(h) = held {
                release(m, id, h).await;
            }
            back?;
            return Err(ApiError::new(
                e.code,
                format!("Sandbox {id} stays archived: {}", e.message),
            ));
        }
        let committed = match &held {
            Some(h) => m.commit_archive(h).await,
            None => Ok(None),
        };
        if !matches!(committed, Ok(Some(_))) {
            // Another node took it over (or the store cannot say): it must
            // not run here too.
            if let Ok(now) = self.get(id).await {
                self.free_worker(&now).await;
            }
            let st = State::Archived;
            self.db(move |r| {
                r.set_worker_opt(id, None)?;
                r.set_state(id, st, None)
            })
            .await?;
            return Err(match committed {
                Err(e) => ApiError::new(
                    Code::StoreFailed,
                    format!(
                        "Sandbox {id} stays archived: cannot confirm this node's claim in its \
                         archive record: {e}"
                    ),
                ),
                _ => ApiError::in_state(
                    Code::InvalidState,
                    "archived",
                    format!(
                        "Sandbox {id} was taken over by another node while this node restored \
                         it (its claim was not renewed in time): it runs there, not here"
                    ),
                ),
            });
        }
        self.db(move |r| r.set_snapshots(id, Some(rest), None).map(|_| ()))
            .await?;
        // It runs here, and its record says so for good: the record goes
        // (if that fails, the taken claim keeps every node out).
        if let Err(e) = m.delete_archive(&s.tenant, id).await {
            tracing::warn!(vm = %id, "cannot delete its archive record: {e}");
        }
        self.metrics.unarchive.observe(t.elapsed());
        tracing::info!(vm = %id, "unarchived in {} ms", t.elapsed().as_millis());
        Ok(())
    }

    /// Stops the sandbox's worker, keeping its directory.
    async fn free_worker(self: &Arc<Self>, s: &Sandbox) {
        let child = lock(&self.children).remove(&s.id);
        lock(&self.agents).remove(&s.id);
        let (a, s) = (self.clone(), s.clone());
        let _ = tokio::task::spawn_blocking(move || {
            if let Err(e) = a.supervisor.stop_worker(&s, child) {
                tracing::warn!(vm = %s.id, "freeing the worker: {e}");
            }
        })
        .await;
    }

    /// Wakes a sleeping (or, unless `sleeping_only`, hibernated) sandbox:
    /// restores its rest snapshot into a new worker. A hibernated one whose
    /// memory cannot be restored is booted from its saved disk instead; a
    /// sleeping one becomes hibernated, and the error says so.
    pub async fn wake(self: &Arc<Self>, id: Uuid, sleeping_only: bool) -> Result<Woken, ApiError> {
        let (_g, s) = self.locked(id).await?;
        match s.state {
            State::Sleeping => {}
            State::Hibernated if !sleeping_only => {}
            State::Running if sleeping_only => return Ok(Woken::default()),
            _ => return Err(invalid(&s, "wake")),
        }
        let _slot = self.hold_slots(&s.tenant, vec![id]).await?;
        let rest = s
            .rest_snapshot_id
            .ok_or_else(|| ApiError::internal(format!("Sandbox {id} has no rest snapshot")))?;
        let t = Instant::now();
        let r = self.restore_into(&s, rest, s.hostname.clone()).await;
        let woken = match r {
            Ok(()) => Woken::default(),
            Err(e) if s.state == State::Hibernated => {
                tracing::warn!(vm = %id, "cannot restore its memory ({}): booting its disk", e.message);
                self.cold_boot(&s, Some(rest)).await?;
                Woken {
                    cold_boot: Some(e.message),
                }
            }
            // Asleep: its memory and disk are still all in its rest
            // snapshot, and a failed wake never loses them. A worker that
            // could not start leaves it asleep (the next call tries again);
            // memory that cannot be restored leaves it hibernated, whose
            // wake boots its disk.
            Err(e) if e.code == Code::WorkerFailed => {
                return Err(ApiError::new(
                    e.code,
                    format!(
                        "Sandbox {id} is still asleep: cannot wake it: {}",
                        e.message
                    ),
                ));
            }
            Err(e) => {
                let why = format!("Cannot restore its memory: {}", e.message);
                let w = why.clone();
                self.db(move |r| r.set_state(id, State::Hibernated, Some(&w)))
                    .await?;
                return Err(ApiError::new(
                    e.code,
                    format!(
                        "Sandbox {id}: {why}. It is hibernated now, its files kept: \
                         POST /v1/runtime/vms/{id}/wake boots it from its disk"
                    ),
                ));
            }
        };
        self.db(move |r| r.set_snapshots(id, Some(rest), None).map(|_| ()))
            .await?;
        if woken.cold_boot.is_some() {
            self.db(move |r| r.set_snapshots(id, None, None).map(|_| ()))
                .await?;
        }
        self.metrics.wake.observe(t.elapsed());
        self.collect_garbage().await;
        tracing::info!(vm = %id, "woken in {} ms", t.elapsed().as_millis());
        Ok(woken)
    }

    /// Restores `snap` into a new worker for `s` (which has none), and
    /// makes it running: the guest gets the host's clock, fresh entropy and
    /// `hostname` (a new one when `None`).
    async fn restore_into(
        self: &Arc<Self>,
        s: &Sandbox,
        snap: Uuid,
        hostname: Option<String>,
    ) -> Result<(), ApiError> {
        // The chain's directories, each here (downloaded if it was not).
        let chain = self
            .ensure_local(snap)
            .await
            .map_err(|e| ApiError::new(Code::SnapshotFailed, e))?;
        let iid = vmm::new_instance_id();
        // The base image is the snapshot's only file outside it.
        let image: Vec<PathBuf> = self
            .image(&s.image)
            .filter(|_| s.image != TEST_GUEST_IMAGE)
            .map(|i| i.path)
            .into_iter()
            .collect();
        let shape = shape_of(s);
        let (a, row) = (self.clone(), s.clone());
        let t = Instant::now();
        let booted = self
            .blocking(move || {
                a.supervisor
                    .restore(&row, &chain, &image, iid, Some(&a.pool))
                    .map_err(restore_failed)
            })
            .await;
        tracing::debug!(vm = %s.id, "restored into a worker in {} ms", t.elapsed().as_millis());
        let r = match booted {
            Ok(b) => self.adopt_booted(s, b, Some((iid, hostname))).await,
            Err(e) => Err(e),
        };
        // The replacement starts once this sandbox answers, not while its
        // guest comes back (on a small host they would share the CPU).
        super::pool::refill_later(self, shape);
        r
    }

    /// Makes the freshly booted `s` running: its agent answers, its guest
    /// has its host name (see [`hostname_for`]).
    pub async fn start_booted(
        self: &Arc<Self>,
        s: &Sandbox,
        booted: Booted,
    ) -> Result<(), ApiError> {
        let _g = self.lifecycle.lock_of(s.id).write_owned().await;
        self.adopt_booted(s, booted, Some((vmm::new_instance_id(), None)))
            .await
    }

    /// Records a started worker of `s`, waits for its agent (re-identifying
    /// a restored guest), and makes the sandbox running.
    async fn adopt_booted(
        self: &Arc<Self>,
        s: &Sandbox,
        booted: Booted,
        identity: Option<(u64, Option<String>)>,
    ) -> Result<(), ApiError> {
        let id = s.id;
        let sock = booted.worker.socket.clone();
        let pid = booted.worker.pid();
        let vsock = booted.vsock.clone();
        let linux = booted.guest == GuestKind::Linux;
        lock(&self.children).insert(id, booted.worker);
        lock(&self.agents).remove(&id);
        {
            let (sock, vsock) = (sock.clone(), vsock.clone());
            self.db(move |r| r.set_worker(id, &sock, vsock.as_deref(), pid))
                .await?;
        }
        if linux {
            let mut live = s.clone();
            live.vsock_socket = vsock;
            // The host's side of its network is made while its guest
            // comes up; the guest is told its network once both are done.
            let (net, ready) = tokio::join!(
                self.attach_network(s, pid),
                self.ready_agent(&live, &sock, identity)
            );
            let r = match (net, ready) {
                (Ok(lease), Ok(())) => self.configure_network(&live, lease).await,
                (Err(e), _) | (_, Err(e)) => Err(e),
            };
            if let Err(e) = r {
                let child = lock(&self.children).remove(&id);
                let (a, row) = (self.clone(), live.clone());
                let _ = tokio::task::spawn_blocking(move || a.supervisor.stop_worker(&row, child))
                    .await;
                let _ = self.db(move |r| r.set_worker_opt(id, None)).await;
                return Err(e);
            }
        }
        self.db(move |r| r.set_state(id, State::Running, None))
            .await?;
        self.lifecycle.touch(id);
        super::watch::worker(self, id, pid);
        Ok(())
    }

    /// Joins the network namespace of `s`'s new worker `pid` to the host
    /// (see [`super::net`]), if sandboxes have networks here.
    async fn attach_network(
        self: &Arc<Self>,
        s: &Sandbox,
        pid: u32,
    ) -> Result<Option<super::net::Lease>, ApiError> {
        if !self.supervisor.net {
            return Ok(None);
        }
        let (a, id, internet) = (self.clone(), s.id, !s.disable_internet);
        let t = Instant::now();
        let lease = self
            .blocking(move || {
                a.network.attach(id, pid, internet).map_err(|e| {
                    ApiError::new(
                        Code::BootFailed,
                        format!("Cannot give the sandbox its network: {e}"),
                    )
                })
            })
            .await?;
        tracing::debug!(
            vm = %s.id,
            "network attached in {} ms: {} on {}",
            t.elapsed().as_millis(),
            lease.address,
            lease.mac_string()
        );
        Ok(Some(lease))
    }

    /// Tells the guest of `s` its network (its MAC, address, route and
    /// resolvers), if it has one.
    async fn configure_network(
        self: &Arc<Self>,
        s: &Sandbox,
        lease: Option<super::net::Lease>,
    ) -> Result<(), ApiError> {
        let Some(l) = lease else {
            return Ok(());
        };
        let agent = self
            .agent(s)
            .ok_or_else(|| ApiError::new(Code::AgentUnavailable, "The VM has no vsock device"))?;
        let req = guest_agent::protocol::NetConfigure {
            mac: l.mac,
            address: l.address.octets(),
            prefix_len: l.prefix_len,
            gateway: l.gateway.map(|g| g.octets()),
            dns: l.dns.iter().map(|d| d.octets()).collect(),
            interface: None,
        };
        let t = Instant::now();
        agent.net_configure(req).await.map_err(|e| {
            ApiError::new(
                Code::AgentUnavailable,
                format!("The guest could not be given its network: {}", chain(&e)),
            )
        })?;
        tracing::debug!(vm = %s.id, "guest network configured in {} us", t.elapsed().as_micros());
        Ok(())
    }

    /// Waits for the agent of `s`; with `identity`, re-identifies its
    /// guest and records its host name.
    async fn ready_agent(
        self: &Arc<Self>,
        s: &Sandbox,
        sock: &std::path::Path,
        identity: Option<(u64, Option<String>)>,
    ) -> Result<(), ApiError> {
        let agent = self
            .agent(s)
            .ok_or_else(|| ApiError::new(Code::AgentUnavailable, "The VM has no vsock device"))?;
        // The sandbox's machine id is its id: kept across its own sleeps,
        // wakes and checkpoint restores, another for each fork or create.
        let refresh = identity.map(|(instance_id, hostname)| crate::agent::Refresh {
            instance_id,
            hostname: Some(hostname.unwrap_or_else(|| hostname_for(s.id))),
            machine_id: Some(s.id.simple().to_string()),
        });
        let (waited, done) = self
            .supervisor
            .wait_agent(&agent, s.id, sock, refresh.as_ref())
            .await
            .map_err(boot_failed)?;
        if let Some(hostname) = done.and_then(|d| d.hostname) {
            let id = s.id;
            self.db(move |r| r.set_hostname(id, &hostname)).await?;
        }
        tracing::debug!(
            vm = %s.id,
            "agent answered in {} ms{}",
            waited.as_millis(),
            if refresh.is_some() { ", re-identified" } else { "" }
        );
        Ok(())
    }

    /// Boots `s` (which has no worker) from its disk: `from`'s disk
    /// flattened when given (the sandbox's VM came from a snapshot), else
    /// the disk it has. Memory and processes are gone; files stay.
    async fn cold_boot(self: &Arc<Self>, s: &Sandbox, from: Option<Uuid>) -> Result<(), ApiError> {
        let id = s.id;
        if let (Some(snap), false) = (from, s.image == TEST_GUEST_IMAGE) {
            let top = self
                .db(move |r| r.get_snapshot(snap))
                .await?
                .ok_or_else(|| ApiError::internal(format!("snapshot {snap} is gone")))?
                .dir;
            let a = self.clone();
            self.blocking(move || a.supervisor.flatten_disk(&top, id).map_err(snapshot_failed))
                .await?;
        }
        let image = self.image(&s.image).map(|i| i.path).ok_or_else(|| {
            ApiError::new(
                Code::UnknownImage,
                format!(
                    "Image {:?} of sandbox {id} is no longer built here",
                    s.image
                ),
            )
        })?;
        let (a, row) = (self.clone(), s.clone());
        let booted = self
            .blocking(move || {
                a.supervisor
                    .boot(&row, Some(&image), Some(&a.pool))
                    .map_err(boot_failed)
            })
            .await?;
        let hostname = Some(s.hostname.clone().unwrap_or_else(|| hostname_for(id)));
        let r = self
            .adopt_booted(s, booted, Some((vmm::new_instance_id(), hostname)))
            .await;
        super::pool::refill_later(self, shape_of(s));
        r
    }

    /// `POST /vms/{id}/reboot`: the disk is kept; memory, processes and
    /// sessions are lost; same id.
    pub async fn reboot(self: &Arc<Self>, id: Uuid) -> Result<Sandbox, ApiError> {
        let (_g, s) = self.locked(id).await?;
        if !matches!(
            s.state,
            State::Running | State::Paused | State::Sleeping | State::Hibernated
        ) {
            return Err(invalid(&s, "reboot"));
        }
        let _slot = self.hold_slots(&s.tenant, vec![id]).await?;
        let mut from = s.rest_snapshot_id;
        if s.state.has_worker() {
            if s.state == State::Running && s.image != TEST_GUEST_IMAGE {
                // What the guest has not written yet, written (best effort:
                // a guest that does not answer reboots all the same).
                if let Some(agent) = self.agent(&s) {
                    let sync = guest_agent::protocol::Exec {
                        command: "sync".into(),
                        timeout_ms: Some(SYNC_TIMEOUT.as_millis() as u64),
                        ..Default::default()
                    };
                    let r = tokio::time::timeout(SYNC_TIMEOUT, agent.exec_output(sync, None, 4096))
                        .await;
                    if !matches!(r, Ok(Ok(_))) {
                        tracing::warn!(vm = %id, "reboot: the guest did not sync its disks");
                    }
                }
            }
            if s.lineage_snapshot_id.is_some() {
                // Its disk is layers over a private top: freeze it.
                from = Some(self.take_snapshot(&s, SnapshotKind::Rest, None).await?.id);
            }
            self.db(move |r| {
                r.set_worker_opt(id, None)?;
                r.set_snapshots(id, None, from)?;
                r.set_state(id, State::Starting, None)
            })
            .await?;
            self.free_worker(&s).await;
        } else {
            self.db(move |r| r.set_state(id, State::Starting, None))
                .await?;
        }
        let s2 = self.get(id).await?;
        if let Err(e) = self.cold_boot(&s2, from).await {
            let why = format!("The reboot failed: {}", e.message);
            let w = why.clone();
            self.db(move |r| r.set_state(id, State::Failed, Some(&w)))
                .await?;
            return Err(ApiError::new(e.code, format!("Sandbox {id}: {why}")));
        }
        self.db(move |r| r.set_snapshots(id, None, None).map(|_| ()))
            .await?;
        self.collect_garbage().await;
        self.get(id).await
    }

    /// A checkpoint's restore in place: the sandbox (whatever it was doing)
    /// becomes what it was at the checkpoint; same id.
    pub async fn restore_checkpoint(
        self: &Arc<Self>,
        vm: Uuid,
        cp: Uuid,
    ) -> Result<Sandbox, ApiError> {
        let (_g, s) = self.locked(vm).await?;
        if !matches!(
            s.state,
            State::Running | State::Paused | State::Sleeping | State::Hibernated
        ) {
            return Err(invalid(&s, "restore a checkpoint"));
        }
        let _slot = self.hold_slots(&s.tenant, vec![vm]).await?;
        // The checkpoint, looked at again now that the sandbox is ours (a
        // delete may have dropped it meanwhile), and made the sandbox's in
        // the same write, so that nothing collects it from here on.
        let taken = self
            .db(move |r| {
                let ok = r
                    .get_snapshot(cp)?
                    .is_some_and(|c| c.kind == SnapshotKind::Checkpoint && c.vm_id == Some(vm));
                if ok {
                    r.set_snapshots(vm, Some(cp), None)?;
                }
                Ok(ok)
            })
            .await?;
        if !taken {
            return Err(ApiError::new(
                Code::CheckpointNotFound,
                format!("No checkpoint has the id \"{cp}\" (it was deleted)"),
            ));
        }
        if s.state.has_worker() {
            self.db(move |r| r.set_worker_opt(vm, None)).await?;
            self.free_worker(&s).await;
        }
        self.db(move |r| r.set_state(vm, State::Starting, None))
            .await?;
        let s2 = self.get(vm).await?;
        if let Err(e) = self.restore_into(&s2, cp, s.hostname.clone()).await {
            let why = format!("Cannot restore the checkpoint: {}", e.message);
            let w = why.clone();
            self.db(move |r| r.set_state(vm, State::Failed, Some(&w)))
                .await?;
            return Err(ApiError::new(e.code, format!("Sandbox {vm}: {why}")));
        }
        self.collect_garbage().await;
        self.get(vm).await
    }

    /// A new sandbox `s` (recorded, `starting`) from snapshot `snap`, its
    /// guest re-identified; `failed` with the reason if it does not come up.
    pub async fn start_from_snapshot(
        self: &Arc<Self>,
        s: Sandbox,
        snap: Uuid,
    ) -> Result<Sandbox, ApiError> {
        let id = s.id;
        let _g = self.lifecycle.lock_of(id).write_owned().await;
        let t = Instant::now();
        if let Err(e) = self.restore_into(&s, snap, None).await {
            let why = e.message.clone();
            self.db(move |r| r.set_state(id, State::Failed, Some(&why)))
                .await?;
            return Err(ApiError::new(
                e.code,
                format!("Sandbox {id} failed to start: {}", e.message),
            ));
        }
        self.metrics.restore.observe(t.elapsed());
        self.get(id).await
    }

    /// `POST /vms/{id}/fork`: a snapshot of the sandbox, then `count` new
    /// sandboxes restored from it in parallel, each its own worker with
    /// `parentVmId` set and a fresh identity. One child failing does not
    /// fail the others.
    pub async fn fork(
        self: &Arc<Self>,
        id: Uuid,
        count: usize,
    ) -> Result<(SnapshotRow, Vec<Result<Sandbox, (Uuid, ApiError)>>), ApiError> {
        let t = Instant::now();
        let (snap, kids) = {
            let (_g, s) = self.locked(id).await?;
            if !matches!(s.state, State::Running | State::Paused) {
                return Err(invalid(&s, "fork"));
            }
            // Every child's slot, or none and no snapshot either.
            let ids: Vec<Uuid> = (0..count).map(|_| Uuid::new_v4()).collect();
            let _slots = self.hold_slots(&s.tenant, ids.clone()).await?;
            let snap = self.take_snapshot(&s, SnapshotKind::User, None).await?;
            let kids: Vec<Sandbox> = ids.iter().map(|&k| child_of(&s, snap.id, k)).collect();
            let rows = kids.clone();
            self.db(move |r| rows.iter().try_for_each(|k| r.insert_sandbox(k)))
                .await?;
            (snap, kids)
        };
        // At most FORK_PARALLEL restores at once: a fork(100) starts its
        // children in waves rather than 100 worker processes together.
        let wave = Arc::new(tokio::sync::Semaphore::new(FORK_PARALLEL));
        let tasks: Vec<_> = kids
            .into_iter()
            .map(|k| {
                let (app, sid, wave) = (self.clone(), snap.id, wave.clone());
                let kid = k.id;
                let task = tokio::spawn(async move {
                    let _turn = wave.acquire_owned().await;
                    app.start_from_snapshot(k, sid).await.map_err(|e| (kid, e))
                });
                (kid, task)
            })
            .collect();
        let mut out = Vec::with_capacity(tasks.len());
        for (kid, t) in tasks {
            let r = match t.await {
                Ok(r) => r,
                Err(e) => {
                    let why = format!("Its start failed: {e}");
                    let w = why.clone();
                    let _ = self
                        .db(move |r| r.set_state(kid, State::Failed, Some(&w)))
                        .await;
                    Err((kid, ApiError::internal(why)))
                }
            };
            out.push(r);
        }
        self.metrics.fork.observe(t.elapsed());
        Ok((snap, out))
    }

    /// At start and hourly: removes the kept image versions
    /// ([`super::pins`]) that no snapshot here records, no sandbox's VM
    /// reads, and no image is now (a boot or restore meanwhile keeps its
    /// image's version now, or its snapshot's).
    /// All are kept while a snapshot is only in the object store (which
    /// versions it needs is not known until it is downloaded).
    pub async fn sweep_kept_images(self: &Arc<Self>) {
        let snaps = match self.db(|r| r.list_snapshots()).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("cannot list snapshots: {}", e.message);
                return;
            }
        };
        let a = self.clone();
        let _ = tokio::task::spawn_blocking(move || {
            let pins = &a.supervisor.pins;
            let mut needed = std::collections::HashSet::new();
            for s in &snaps {
                match vmm::VmState::recorded_images(&s.dir) {
                    Ok(imgs) => needed.extend(
                        imgs.iter()
                            .filter_map(|i| i.identity)
                            .map(|v| pins.path_of(v)),
                    ),
                    Err(e) => {
                        tracing::info!(
                            "keeping every image version: snapshot {} is not readable here ({e})",
                            s.id
                        );
                        return;
                    }
                }
            }
            needed.extend(
                a.supervisor
                    .sandbox_dirs()
                    .filter_map(|d| super::pins::linked_from(&d)),
            );
            // The images' versions now: kept again at their next boot anyway.
            needed.extend(a.images.iter().filter_map(|i| {
                devices::virtio::block::ImageIdentity::of_path(&i.path)
                    .ok()
                    .map(|v| pins.path_of(v))
            }));
            let gone = pins.sweep(&needed);
            if gone > 0 {
                tracing::info!("removed {gone} image versions nothing here needs any more");
            }
        })
        .await;
    }

    /// At start: removes snapshot directories the registry has no record
    /// of (a write cut short by a crash, a collection whose records went
    /// but whose files did not).
    pub async fn sweep_orphan_snapshots(self: &Arc<Self>) {
        let known = match self.db(|r| r.list_snapshots()).await {
            Ok(all) => all
                .into_iter()
                .filter_map(|s| {
                    s.dir
                        .parent()
                        .and_then(|p| p.file_name())
                        .map(|n| n.to_owned())
                })
                .collect::<std::collections::HashSet<_>>(),
            Err(e) => {
                tracing::warn!("cannot list snapshots: {}", e.message);
                return;
            }
        };
        let root = self.supervisor.snapshots_dir().to_owned();
        let a = self.clone();
        let _ = tokio::task::spawn_blocking(move || {
            // A snapshot's directory is named by its id, whoever's it is.
            for home in snapshot_homes(&root) {
                if !home.file_name().is_some_and(|n| known.contains(n)) {
                    tracing::info!("removing {}: no snapshot of the registry's", home.display());
                    a.supervisor
                        .remove_snapshot(&home.join(super::store::SNAPSHOT_SUBDIR));
                }
            }
        })
        .await;
    }

    /// Removes the snapshots nothing needs any more (see
    /// [`super::registry::Registry::collect_garbage`]).
    pub async fn collect_garbage(self: &Arc<Self>) {
        match self.db(|r| r.collect_garbage()).await {
            Ok(gone) if !gone.is_empty() => {
                let a = self.clone();
                let gone = tokio::task::spawn_blocking(move || {
                    for g in &gone {
                        a.supervisor.remove_snapshot(&g.dir);
                    }
                    tracing::info!("removed {} snapshots nothing builds on", gone.len());
                    gone
                })
                .await;
                if let Ok(gone) = gone {
                    self.forget_uploaded(gone);
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!("snapshot garbage collection: {}", e.message),
        }
    }
}

/// Claims archived sandbox `id` for this node (see
/// [`super::mirror::Mirror::claim_archive`]), whose record here names
/// `rest` as its rest snapshot: 409 if another node has it, or archived it
/// again since.
async fn claim(
    m: &super::mirror::Mirror,
    id: Uuid,
    held: super::mirror::Held,
    rest: Uuid,
) -> Result<super::mirror::Held, ApiError> {
    let conflict = |why: String| ApiError::in_state(Code::InvalidState, "archived", why);
    if held.rec.rest_snapshot_id() != rest {
        return Err(conflict(format!(
            "Sandbox {id} was archived again by another node since this node archived it: this \
             node's record of it is out of date (delete it here, which leaves the store's \
             archive alone, then unarchive it again)"
        )));
    }
    if let Some(c) = held.rec.live_claim(None) {
        return Err(conflict(if c.taken {
            format!(
                "Sandbox {id} was unarchived elsewhere: node {} runs it (delete it here)",
                c.node
            )
        } else {
            format!(
                "Sandbox {id} is being unarchived by node {} (its claim renewed {} s ago)",
                c.node,
                super::now_ms().saturating_sub(c.at_ms) / 1000
            )
        }));
    }
    m.claim_archive(held)
        .await
        .map_err(|e| ApiError::new(Code::StoreFailed, e))?
        .ok_or_else(|| {
            conflict(format!(
                "Sandbox {id} is being unarchived by another node: its archive record changed \
                 while this node claimed it"
            ))
        })
}

/// Gives up this node's claim on archived sandbox `id`.
async fn release(m: &super::mirror::Mirror, id: Uuid, held: super::mirror::Held) {
    if let Err(e) = m.release_archive(held).await {
        tracing::error!(vm = %id, "cannot give up its claim in its archive record: {e}");
    }
}

/// Every snapshot directory under `root`: `<tenant>/<sandbox>/<id>`, and
/// the older layout's `<id>`. An owner's directory that holds nothing is
/// removed on the way.
fn snapshot_homes(root: &Path) -> Vec<PathBuf> {
    fn dirs(d: &Path) -> Vec<PathBuf> {
        std::fs::read_dir(d)
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path())
                    .collect()
            })
            .unwrap_or_default()
    }
    let is_id = |p: &Path| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| Uuid::parse_str(n).is_ok())
    };
    let mut out = Vec::new();
    for top in dirs(root) {
        // The older layout's snapshot: named by its id, holding its `s`
        // (a tenant's directory holds sandboxes' directories, never `s`).
        if is_id(&top) && top.join(super::store::SNAPSHOT_SUBDIR).is_dir() {
            out.push(top);
            continue;
        }
        for vm in dirs(&top) {
            let homes = dirs(&vm);
            if homes.is_empty() {
                let _ = std::fs::remove_dir(&vm);
            }
            out.extend(homes);
        }
        let _ = std::fs::remove_dir(&top);
    }
    out
}

/// A fork child of `s` from `snap`: its shape, image, env, metadata and
/// idle timeout.
fn child_of(s: &Sandbox, snap: Uuid, id: Uuid) -> Sandbox {
    Sandbox {
        id,
        state: State::Starting,
        worker_socket: None,
        vsock_socket: None,
        pid: None,
        created_ms: now_ms(),
        parent_vm_id: Some(s.id),
        snapshot_id: Some(snap),
        failure_reason: None,
        lineage_snapshot_id: Some(snap),
        rest_snapshot_id: None,
        hostname: None,
        ..s.clone()
    }
}

/// A sandbox's host name: `sprout-` and the first 12 hex digits of its id.
pub fn hostname_for(id: Uuid) -> String {
    format!("sprout-{}", &id.simple().to_string()[..12])
}

fn worker_err(e: sprout_worker::ClientError) -> ApiError {
    ApiError::new(
        Code::WorkerFailed,
        format!("The sandbox's worker refused: {}", chain(&e)),
    )
}

fn worker_failed(e: String) -> ApiError {
    ApiError::new(Code::WorkerFailed, e)
}

/// The idle sweeper: every second, each running sandbox with an idle
/// timeout that has had no activity for that long, and runs no call, is
/// put to sleep. A sandbox in a transition is looked at next time.
/// Retention by age at start and every hour ([`App::retain_by_age`]).
pub fn retention_sweeper(app: &Arc<App>) {
    let app = app.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(3600));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut at_start = true;
        loop {
            tick.tick().await;
            app.retain_by_age().await;
            // Hourly too, for a sproutd that runs across image rebuilds (at
            // start it ran before the API served).
            if !std::mem::take(&mut at_start) {
                app.sweep_kept_images().await;
            }
        }
    });
}

pub fn sweeper(app: &Arc<App>) {
    let app = app.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(SWEEP_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Ok(all) = app.db(|r| r.list_sandboxes()).await else {
                continue;
            };
            for s in all {
                let Some(limit) = s.idle_timeout_secs.map(|t| Duration::from_secs(t.into())) else {
                    continue;
                };
                if s.state != State::Running {
                    continue;
                }
                // A guest that computes (a build, a training run in the
                // background) is busy, whatever its calls.
                if s.pid.is_some_and(|pid| app.lifecycle.computing(s.id, pid)) {
                    app.lifecycle.touch(s.id);
                    continue;
                }
                let (busy, idle) = app.lifecycle.idle(s.id);
                if busy > 0 || idle < limit {
                    if !lock(&app.lifecycle.activity).contains_key(&s.id) {
                        // First seen (a re-adopted sandbox): idle from now.
                        app.lifecycle.touch(s.id);
                    }
                    continue;
                }
                let Ok(g) = app.lifecycle.lock_of(s.id).try_write_owned() else {
                    continue;
                };
                let id = s.id;
                let a = app.clone();
                // Its own task, so a slow snapshot holds up no other sandbox.
                tokio::spawn(async move {
                    let Ok(Some(s)) = a.db(move |r| r.get_sandbox(id)).await else {
                        return;
                    };
                    let (busy, idle) = a.lifecycle.idle(id);
                    if s.state != State::Running || busy > 0 || idle < limit {
                        return;
                    }
                    tracing::info!(vm = %id, "idle for {} s: sleeping", idle.as_secs());
                    if let Err(e) = a.suspend_locked(g, s, State::Sleeping).await {
                        tracing::warn!(vm = %id, "idle sleep failed: {}", e.message);
                        a.lifecycle.touch(id);
                    }
                });
            }
        }
    });
}

/// The shape of `s`'s VM, as ready workers are kept.
pub(super) fn shape_of(s: &Sandbox) -> sprout_worker::protocol::Shape {
    sprout_worker::protocol::Shape {
        vcpus: s.cpus,
        mem_mib: u64::from(s.memory_mb),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This process's CPU time is read from /proc, and grows as it computes.
    #[test]
    fn a_process_cpu_time_is_read_and_grows() {
        let me = std::process::id();
        let before = cpu_ticks(me).expect("our own /proc/PID/stat");
        let t = Instant::now();
        let mut x = 0u64;
        while cpu_ticks(me).unwrap() < before + 3 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            assert!(t.elapsed() < Duration::from_secs(60), "no CPU time counted");
        }
        std::hint::black_box(x);
        assert_eq!(cpu_ticks(u32::MAX), None, "no such process");
        assert_eq!(clock_ticks_per_second(), 100.0);
    }

    /// Computing is a share of one CPU since the last look, of the same
    /// worker: never at the first look, nor across a new worker.
    #[test]
    fn computing_is_a_share_of_a_cpu_since_the_last_look() {
        let l = Lifecycle::default();
        let (id, t0) = (Uuid::new_v4(), Instant::now());
        let s = |secs: f64| t0 + Duration::from_secs_f64(secs);
        assert!(!l.computing_at(id, 7, 1000, s(0.0)), "first look");
        // 100 ticks (1 s) over 1 s; 20 over 1 s; 19 over 1 s; 30 over 2 s.
        assert!(l.computing_at(id, 7, 1100, s(1.0)));
        assert!(l.computing_at(id, 7, 1120, s(2.0)));
        assert!(!l.computing_at(id, 7, 1139, s(3.0)));
        assert!(!l.computing_at(id, 7, 1169, s(5.0)));
        // Another worker (a wake): its first look.
        assert!(!l.computing_at(id, 8, 5000, s(6.0)));
        assert!(l.computing_at(id, 8, 5090, s(7.0)));
        l.forget(id);
        assert!(!l.computing_at(id, 8, 6000, s(8.0)), "forgotten");
    }
}
