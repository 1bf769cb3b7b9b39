//! The registry: `sproutd`'s durable record of sandboxes, snapshots, layers
//! and images, in one SQLite file (WAL) under the data directory.
//!
//! The schema is a list of migrations applied in order; the database's
//! `user_version` is the number applied. A database from a newer `sproutd`
//! (a higher `user_version` than this one knows) is refused, never rewritten.
//! Every write is one transaction, committed before the API answers, so
//! nothing acknowledged is lost to a crash (`synchronous = FULL`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use rusqlite::{params, Connection, OptionalExtension, Row};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The schema, one migration per entry; never edit one that has shipped,
/// append a new one.
const MIGRATIONS: &[&str] = &[
    // 1: sandboxes, snapshots, layers, images.
    r#"
    CREATE TABLE images (
        name        TEXT PRIMARY KEY,
        path        TEXT NOT NULL,
        size_bytes  INTEGER NOT NULL,
        digest      TEXT,
        seen_at_ms  INTEGER NOT NULL
    );
    CREATE TABLE layers (
        id          TEXT PRIMARY KEY,
        dir         TEXT NOT NULL UNIQUE,
        kind        TEXT NOT NULL CHECK (kind IN ('full', 'diff', 'fork')),
        parent_id   TEXT REFERENCES layers(id),
        refcount    INTEGER NOT NULL DEFAULT 0 CHECK (refcount >= 0),
        created_ms  INTEGER NOT NULL
    );
    CREATE TABLE snapshots (
        id          TEXT PRIMARY KEY,
        vm_id       TEXT,
        name        TEXT,
        dir         TEXT NOT NULL,
        layer_id    TEXT REFERENCES layers(id),
        created_ms  INTEGER NOT NULL
    );
    CREATE TABLE sandboxes (
        id                TEXT PRIMARY KEY,
        state             TEXT NOT NULL CHECK (state IN ('starting', 'running', 'paused',
                              'sleeping', 'archived', 'hibernated', 'stopping', 'failed')),
        image             TEXT NOT NULL,
        cpus              INTEGER NOT NULL CHECK (cpus BETWEEN 1 AND 4),
        memory_mb         INTEGER NOT NULL CHECK (memory_mb BETWEEN 128 AND 8192),
        disable_internet  INTEGER NOT NULL,
        idle_timeout_secs INTEGER,
        env               TEXT NOT NULL,
        metadata          TEXT NOT NULL,
        worker_socket     TEXT,
        vsock_socket      TEXT,
        pid               INTEGER,
        created_ms        INTEGER NOT NULL,
        parent_vm_id      TEXT,
        snapshot_id       TEXT REFERENCES snapshots(id),
        failure_reason    TEXT
    );
    CREATE INDEX sandboxes_by_state ON sandboxes(state);
    "#,
    // 2: rest states. A snapshot knows what it is for, what it was taken
    // of (image, shape, base env), its parent in its chain and its depth;
    // a sandbox knows the snapshot its VM's next diff builds on (`lineage`)
    // and, asleep or hibernated, the one that wakes it (`rest`).
    r#"
    ALTER TABLE snapshots ADD COLUMN kind TEXT NOT NULL DEFAULT 'user'
        CHECK (kind IN ('user', 'rest', 'checkpoint', 'template', 'dropped'));
    ALTER TABLE snapshots ADD COLUMN parent_id TEXT REFERENCES snapshots(id);
    ALTER TABLE snapshots ADD COLUMN depth INTEGER NOT NULL DEFAULT 1;
    ALTER TABLE snapshots ADD COLUMN image TEXT NOT NULL DEFAULT '';
    ALTER TABLE snapshots ADD COLUMN cpus INTEGER NOT NULL DEFAULT 1;
    ALTER TABLE snapshots ADD COLUMN memory_mb INTEGER NOT NULL DEFAULT 128;
    ALTER TABLE snapshots ADD COLUMN env TEXT NOT NULL DEFAULT '{}';
    ALTER TABLE snapshots ADD COLUMN size_bytes INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE snapshots ADD COLUMN diff INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE sandboxes ADD COLUMN lineage_snapshot_id TEXT;
    ALTER TABLE sandboxes ADD COLUMN rest_snapshot_id TEXT;
    ALTER TABLE sandboxes ADD COLUMN hostname TEXT;
    CREATE INDEX snapshots_by_vm ON snapshots(vm_id, kind);
    CREATE TABLE templates (
        image          TEXT NOT NULL,
        cpus           INTEGER NOT NULL,
        memory_mb      INTEGER NOT NULL,
        state          TEXT NOT NULL CHECK (state IN ('building', 'ready', 'failed')),
        snapshot_id    TEXT REFERENCES snapshots(id),
        failure_reason TEXT,
        build_id       TEXT,
        build_ms       INTEGER,
        updated_ms     INTEGER NOT NULL,
        PRIMARY KEY (image, cpus, memory_mb)
    );
    "#,
    // 3: tenants. Every sandbox and snapshot is its tenant's; what was
    // recorded before is the single-tenant mode's `default`'s. Templates
    // are sproutd's own (their snapshots' tenant is '').
    r#"
    ALTER TABLE sandboxes ADD COLUMN tenant TEXT NOT NULL DEFAULT 'default';
    ALTER TABLE snapshots ADD COLUMN tenant TEXT NOT NULL DEFAULT 'default';
    UPDATE snapshots SET tenant = '' WHERE kind = 'template';
    CREATE INDEX sandboxes_by_tenant ON sandboxes(tenant, state);
    "#,
    // 4: the snapshot store's mirror: when a snapshot was uploaded whole,
    // and whether it came from another node's archive (whose objects this
    // node never deletes).
    r#"
    ALTER TABLE snapshots ADD COLUMN uploaded_ms INTEGER;
    ALTER TABLE snapshots ADD COLUMN imported INTEGER NOT NULL DEFAULT 0;
    "#,
    // 5: runtimes. A sandbox and a snapshot record the runtime its guest
    // was booted with (what came before is `container`'s), and a template
    // is one (image, runtime, shape)'s: the table is rebuilt, since a
    // primary key cannot be altered in SQLite.
    r#"
    ALTER TABLE sandboxes ADD COLUMN runtime TEXT NOT NULL DEFAULT 'container'
        CHECK (runtime IN ('container', 'vm'));
    ALTER TABLE snapshots ADD COLUMN runtime TEXT NOT NULL DEFAULT 'container'
        CHECK (runtime IN ('container', 'vm'));
    CREATE TABLE templates_v5 (
        image          TEXT NOT NULL,
        runtime        TEXT NOT NULL CHECK (runtime IN ('container', 'vm')),
        cpus           INTEGER NOT NULL,
        memory_mb      INTEGER NOT NULL,
        state          TEXT NOT NULL CHECK (state IN ('building', 'ready', 'failed')),
        snapshot_id    TEXT REFERENCES snapshots(id),
        failure_reason TEXT,
        build_id       TEXT,
        build_ms       INTEGER,
        updated_ms     INTEGER NOT NULL,
        PRIMARY KEY (image, runtime, cpus, memory_mb)
    );
    INSERT INTO templates_v5 (image, runtime, cpus, memory_mb, state, snapshot_id,
        failure_reason, build_id, build_ms, updated_ms)
        SELECT image, 'container', cpus, memory_mb, state, snapshot_id, failure_reason,
            build_id, build_ms, updated_ms FROM templates;
    DROP TABLE templates;
    ALTER TABLE templates_v5 RENAME TO templates;
    "#,
    // 6: ports a sandbox exposes through sproutd (`POST /vms/{id}/ports`).
    r#"
    CREATE TABLE ports (
        vm_id       TEXT NOT NULL,
        port        INTEGER NOT NULL CHECK (port BETWEEN 1 AND 65535),
        public      INTEGER NOT NULL,
        created_ms  INTEGER NOT NULL,
        PRIMARY KEY (vm_id, port)
    );
    "#,
    // 7: which version of its image a template was built over
    // (`devices::virtio::block::ImageIdentity`); none: from before, unknown.
    r#"
    ALTER TABLE templates ADD COLUMN image_identity TEXT;
    "#,
];

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("Registry database error")]
    Sql(#[from] rusqlite::Error),
    #[error("The registry {0} is of schema version {1}, newer than this sproutd's {2}")]
    TooNew(PathBuf, u32, u32),
    #[error("The registry holds a bad row: {0}")]
    BadRow(String),
}

/// A port a sandbox exposes through sproutd.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortRow {
    pub vm_id: Uuid,
    pub port: u16,
    /// Reachable without the tenant's key.
    pub public: bool,
    pub created_ms: u64,
}

fn row_port(r: &Row<'_>) -> rusqlite::Result<Result<PortRow, RegistryError>> {
    let vm: String = r.get(0)?;
    let port: u16 = r.get(1)?;
    let public: bool = r.get(2)?;
    let created: i64 = r.get(3)?;
    Ok(Uuid::parse_str(&vm)
        .map(|vm_id| PortRow {
            vm_id,
            port,
            public,
            created_ms: created as u64,
        })
        .map_err(|_| RegistryError::BadRow(format!("port of {vm:?}: not a sandbox id"))))
}

/// A sandbox's state (DESIGN.md's rest states; the transitions between them
/// are the API's business, not the registry's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
#[schema(as = VmState)]
pub enum State {
    /// Its worker is being started and its guest booted.
    Starting,
    Running,
    Paused,
    Sleeping,
    Archived,
    Hibernated,
    /// Being deleted.
    Stopping,
    /// Its worker or guest failed; `failure_reason` says how.
    Failed,
}

impl State {
    pub const ALL: [State; 8] = [
        Self::Starting,
        Self::Running,
        Self::Paused,
        Self::Sleeping,
        Self::Archived,
        Self::Hibernated,
        Self::Stopping,
        Self::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Running => "running",
            Self::Paused => "paused",
            Self::Sleeping => "sleeping",
            Self::Archived => "archived",
            Self::Hibernated => "hibernated",
            Self::Stopping => "stopping",
            Self::Failed => "failed",
        }
    }

    /// Whether a worker process is expected to hold this sandbox's VM.
    pub fn has_worker(self) -> bool {
        matches!(
            self,
            Self::Starting | Self::Running | Self::Paused | Self::Stopping
        )
    }
}

impl FromStr for State {
    type Err = RegistryError;

    fn from_str(s: &str) -> Result<Self, RegistryError> {
        Ok(match s {
            "starting" => Self::Starting,
            "running" => Self::Running,
            "paused" => Self::Paused,
            "sleeping" => Self::Sleeping,
            "archived" => Self::Archived,
            "hibernated" => Self::Hibernated,
            "stopping" => Self::Stopping,
            "failed" => Self::Failed,
            other => return Err(RegistryError::BadRow(format!("unknown state {other:?}"))),
        })
    }
}

/// How a sandbox's guest is brought up (docs/api.md, "Runtimes").
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Runtime {
    /// Sprout's agent is PID 1 and starts the image's entrypoint as the
    /// sandbox's main process.
    #[default]
    Container,
    /// The image's own init (`/sbin/init`, systemd) is PID 1 and starts
    /// the agent as one of its services.
    Vm,
}

impl Runtime {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Container => "container",
            Self::Vm => "vm",
        }
    }
}

impl FromStr for Runtime {
    type Err = RegistryError;

    fn from_str(s: &str) -> Result<Self, RegistryError> {
        match s {
            "container" => Ok(Self::Container),
            "vm" => Ok(Self::Vm),
            other => Err(RegistryError::BadRow(format!("unknown runtime {other:?}"))),
        }
    }
}

/// One sandbox as recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sandbox {
    pub id: Uuid,
    /// Whose it is (docs/api.md, "Tenants and quotas").
    pub tenant: String,
    pub state: State,
    pub image: String,
    pub runtime: Runtime,
    pub cpus: u8,
    pub memory_mb: u32,
    pub disable_internet: bool,
    pub idle_timeout_secs: Option<u32>,
    pub env: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
    pub worker_socket: Option<PathBuf>,
    pub vsock_socket: Option<PathBuf>,
    pub pid: Option<u32>,
    /// Unix time in milliseconds.
    pub created_ms: u64,
    pub parent_vm_id: Option<Uuid>,
    pub snapshot_id: Option<Uuid>,
    pub failure_reason: Option<String>,
    /// The snapshot its VM's next diff builds on (the last one it took or
    /// was restored from); none after a boot.
    pub lineage_snapshot_id: Option<Uuid>,
    /// Sleeping or hibernated: the snapshot that wakes it.
    pub rest_snapshot_id: Option<Uuid>,
    /// The host name its guest keeps across sleeps and wakes (set after
    /// its first restore).
    pub hostname: Option<String>,
}

impl Sandbox {
    /// A new sandbox of `tenant`, `image` and shape, `starting`, nothing
    /// else set.
    pub fn starting(
        id: Uuid,
        tenant: &str,
        image: &str,
        cpus: u8,
        memory_mb: u32,
        created_ms: u64,
    ) -> Sandbox {
        Sandbox {
            id,
            tenant: tenant.to_owned(),
            state: State::Starting,
            image: image.to_owned(),
            runtime: Runtime::Container,
            cpus,
            memory_mb,
            disable_internet: false,
            idle_timeout_secs: None,
            env: BTreeMap::new(),
            metadata: BTreeMap::new(),
            worker_socket: None,
            vsock_socket: None,
            pid: None,
            created_ms,
            parent_vm_id: None,
            snapshot_id: None,
            failure_reason: None,
            lineage_snapshot_id: None,
            rest_snapshot_id: None,
            hostname: None,
        }
    }
}

/// What a snapshot is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
#[schema(as = SnapshotKind)]
pub enum SnapshotKind {
    /// Taken by `POST /vms/{id}/snapshot` or a fork: kept until deleted.
    User,
    /// A sleeping or hibernated sandbox's memory and disk (sproutd's own).
    Rest,
    /// A named checkpoint of a sandbox.
    Checkpoint,
    /// An (image, shape)'s template: a booted VM whose agent answered.
    Template,
    /// Deleted, but kept on disk while a later snapshot or a sandbox
    /// still builds on it.
    Dropped,
}

impl SnapshotKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::User => "user",
            Self::Rest => "rest",
            Self::Checkpoint => "checkpoint",
            Self::Template => "template",
            Self::Dropped => "dropped",
        }
    }
}

impl FromStr for SnapshotKind {
    type Err = RegistryError;

    fn from_str(s: &str) -> Result<Self, RegistryError> {
        Ok(match s {
            "user" => Self::User,
            "rest" => Self::Rest,
            "checkpoint" => Self::Checkpoint,
            "template" => Self::Template,
            "dropped" => Self::Dropped,
            other => {
                return Err(RegistryError::BadRow(format!(
                    "unknown snapshot kind {other:?}"
                )))
            }
        })
    }
}

/// One snapshot as recorded: its directory (the snapshot itself, as the
/// `snapshot` crate wrote it) and what it was taken of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotRow {
    pub id: Uuid,
    /// Whose it is: its sandbox's tenant ('' for a template).
    pub tenant: String,
    /// The sandbox it was taken of (which may be gone since).
    pub vm_id: Option<Uuid>,
    /// A checkpoint's name.
    pub name: Option<String>,
    pub dir: PathBuf,
    pub kind: SnapshotKind,
    /// The snapshot it is a diff on (none for a full one).
    pub parent_id: Option<Uuid>,
    /// Snapshots in its chain, itself included.
    pub depth: u32,
    pub image: String,
    pub runtime: Runtime,
    pub cpus: u8,
    pub memory_mb: u32,
    pub env: BTreeMap<String, String>,
    pub size_bytes: u64,
    pub created_ms: u64,
    /// When it was uploaded whole to the object store (none: not yet, or
    /// no store).
    pub uploaded_ms: Option<u64>,
    /// Recorded from another node's archive record: its objects are not
    /// this node's to delete.
    pub imported: bool,
}

/// Where a template's build is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
#[schema(as = TemplateState)]
pub enum TemplateState {
    Building,
    Ready,
    Failed,
}

impl TemplateState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Building => "building",
            Self::Ready => "ready",
            Self::Failed => "failed",
        }
    }
}

impl FromStr for TemplateState {
    type Err = RegistryError;

    fn from_str(s: &str) -> Result<Self, RegistryError> {
        Ok(match s {
            "building" => Self::Building,
            "ready" => Self::Ready,
            "failed" => Self::Failed,
            other => {
                return Err(RegistryError::BadRow(format!(
                    "unknown template state {other:?}"
                )))
            }
        })
    }
}

/// The template of one (image, runtime, shape).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TemplateRow {
    pub image: String,
    pub runtime: Runtime,
    pub cpus: u8,
    pub memory_mb: u32,
    pub state: TemplateState,
    pub snapshot_id: Option<Uuid>,
    pub failure_reason: Option<String>,
    /// While building: the build's id (its VM's directory under `vms/`).
    pub build_id: Option<Uuid>,
    pub build_ms: Option<u64>,
    pub updated_ms: u64,
    /// The identity of the image it was built over ([`image_identity`]);
    /// none for one from before it was recorded.
    pub image_identity: Option<String>,
}

/// The identity of the image file at `path` now (the test guest's kernel
/// for `testguest`), as a template records it: its size and the hash of its
/// head (`ImageIdentity`), which a rebuilt or changed image does not share.
/// None when it cannot be read.
pub fn image_identity(path: &Path) -> Option<String> {
    devices::virtio::block::ImageIdentity::of_path(path)
        .ok()
        .map(|i| i.to_string())
}

/// An image found on disk.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Image {
    pub name: String,
    #[schema(value_type = String)]
    pub path: PathBuf,
    pub size_bytes: u64,
    /// The runtimes a sandbox of it can have: `container` always; `vm`
    /// for an OCI image whose `/sbin/init` is systemd.
    pub runtimes: Vec<Runtime>,
}

pub struct Registry {
    conn: Connection,
}

fn path_text(p: &Option<PathBuf>) -> Option<String> {
    p.as_ref().map(|p| p.to_string_lossy().into_owned())
}

impl Registry {
    /// Opens (creating it if needed) the registry at `path` and brings its
    /// schema up to date.
    pub fn open(path: &Path) -> Result<Self, RegistryError> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        let mut r = Self { conn };
        r.migrate(path)?;
        Ok(r)
    }

    /// The schema version of the open database.
    pub fn schema_version(&self) -> Result<u32, RegistryError> {
        Ok(self
            .conn
            .pragma_query_value(None, "user_version", |r| r.get(0))?)
    }

    fn migrate(&mut self, path: &Path) -> Result<(), RegistryError> {
        let have = self.schema_version()?;
        let known = MIGRATIONS.len() as u32;
        if have > known {
            return Err(RegistryError::TooNew(path.to_owned(), have, known));
        }
        for (i, sql) in MIGRATIONS.iter().enumerate().skip(have as usize) {
            let tx = self.conn.transaction()?;
            tx.execute_batch(sql)?;
            tx.pragma_update(None, "user_version", i as u32 + 1)?;
            tx.commit()?;
            tracing::info!("registry: applied schema migration {}", i + 1);
        }
        Ok(())
    }

    pub fn insert_sandbox(&self, s: &Sandbox) -> Result<(), RegistryError> {
        insert_sandbox_in(&self.conn, s)
    }

    /// Records where a sandbox's worker is (none: it has no worker, as
    /// when asleep); false if there is no such sandbox.
    pub fn set_worker_opt(
        &self,
        id: Uuid,
        worker: Option<(&Path, Option<&Path>, u32)>,
    ) -> Result<bool, RegistryError> {
        match worker {
            Some((sock, vsock, pid)) => self.set_worker(id, sock, vsock, pid),
            None => Ok(self.conn.execute(
                "UPDATE sandboxes SET vsock_socket = NULL, pid = NULL WHERE id = ?1",
                [id.to_string()],
            )? == 1),
        }
    }

    /// Sets the snapshots a sandbox builds on and wakes from.
    pub fn set_snapshots(
        &self,
        id: Uuid,
        lineage: Option<Uuid>,
        rest: Option<Uuid>,
    ) -> Result<bool, RegistryError> {
        let n = self.conn.execute(
            "UPDATE sandboxes SET lineage_snapshot_id = ?2, rest_snapshot_id = ?3 WHERE id = ?1",
            params![
                id.to_string(),
                lineage.map(|u| u.to_string()),
                rest.map(|u| u.to_string())
            ],
        )?;
        Ok(n == 1)
    }

    pub fn set_hostname(&self, id: Uuid, hostname: &str) -> Result<bool, RegistryError> {
        let n = self.conn.execute(
            "UPDATE sandboxes SET hostname = ?2 WHERE id = ?1",
            params![id.to_string(), hostname],
        )?;
        Ok(n == 1)
    }

    pub fn insert_snapshot(&self, s: &SnapshotRow) -> Result<(), RegistryError> {
        insert_snapshot_in(&self.conn, s)
    }

    pub fn get_snapshot(&self, id: Uuid) -> Result<Option<SnapshotRow>, RegistryError> {
        self.one(
            &format!("SELECT {SNAP_COLUMNS} FROM snapshots WHERE id = ?1"),
            id,
            row_snapshot,
        )
    }

    /// Every snapshot, oldest first.
    pub fn list_snapshots(&self) -> Result<Vec<SnapshotRow>, RegistryError> {
        self.all(
            &format!("SELECT {SNAP_COLUMNS} FROM snapshots ORDER BY created_ms, id"),
            row_snapshot,
        )
    }

    /// The row `sql` (with `?1` the id) selects, through `row`.
    fn one<T>(
        &self,
        sql: &str,
        id: Uuid,
        row: fn(&Row<'_>) -> rusqlite::Result<Result<T, RegistryError>>,
    ) -> Result<Option<T>, RegistryError> {
        self.conn
            .query_row(sql, [id.to_string()], row)
            .optional()?
            .transpose()
    }

    /// Every row `sql` selects, through `row`.
    fn all<T>(
        &self,
        sql: &str,
        row: fn(&Row<'_>) -> rusqlite::Result<Result<T, RegistryError>>,
    ) -> Result<Vec<T>, RegistryError> {
        let mut st = self.conn.prepare(sql)?;
        let rows = st.query_map([], row)?;
        let mut out = Vec::new();
        for r in rows {
            out.push(r??);
        }
        Ok(out)
    }

    /// Marks the snapshots of `snap`'s chain as not this node's to delete
    /// from the object store (another node took over what builds on them).
    pub fn disown_chain(&self, snap: Uuid) -> Result<(), RegistryError> {
        let mut next = Some(snap);
        let mut n = 0;
        while let (Some(id), true) = (next, n <= vmm::MAX_CHAIN_DEPTH + 1) {
            self.conn.execute(
                "UPDATE snapshots SET imported = 1 WHERE id = ?1",
                [id.to_string()],
            )?;
            next = self.get_snapshot(id)?.and_then(|s| s.parent_id);
            n += 1;
        }
        Ok(())
    }

    /// Records that snapshot `id` is in the object store.
    pub fn set_uploaded(&self, id: Uuid, at_ms: u64) -> Result<bool, RegistryError> {
        let n = self.conn.execute(
            "UPDATE snapshots SET uploaded_ms = ?2 WHERE id = ?1",
            params![id.to_string(), at_ms as i64],
        )?;
        Ok(n == 1)
    }

    /// The user snapshots of `vm` that retention deletes: all but the
    /// newest `keep` (0: no limit), and any taken before `before_ms` (0: no
    /// limit); never one that a checkpoint, a template or an archived
    /// sandbox builds on, nor one a sandbox was made from (or builds on
    /// through it). (One a sleeping sandbox builds on may go: its files
    /// stay while anything builds on them.)
    pub fn retention_victims(
        &self,
        vm: Uuid,
        keep: u32,
        before_ms: u64,
    ) -> Result<Vec<Uuid>, RegistryError> {
        let all = self.list_snapshots()?;
        let by_id: std::collections::HashMap<Uuid, &SnapshotRow> =
            all.iter().map(|s| (s.id, s)).collect();
        let mut protected = std::collections::HashSet::new();
        let mut protect = |from: Option<Uuid>| {
            let mut next = from;
            let mut n = 0;
            while let Some(id) = next {
                if !protected.insert(id) || n > vmm::MAX_CHAIN_DEPTH + 1 {
                    break;
                }
                n += 1;
                next = by_id.get(&id).and_then(|s| s.parent_id);
            }
        };
        for s in &all {
            if matches!(s.kind, SnapshotKind::Checkpoint | SnapshotKind::Template) {
                protect(Some(s.id));
            }
        }
        for sb in self.list_sandboxes()? {
            // What a sandbox was made from (a fork's children: "a live
            // child's layers"), and what an archive is made of.
            protect(sb.snapshot_id);
            if sb.state == State::Archived {
                protect(sb.rest_snapshot_id);
            }
        }
        let mut mine: Vec<&SnapshotRow> = all
            .iter()
            .filter(|s| s.kind == SnapshotKind::User && s.vm_id == Some(vm))
            .collect();
        // Newest first.
        mine.sort_by(|a, b| b.created_ms.cmp(&a.created_ms).then(b.id.cmp(&a.id)));
        Ok(mine
            .into_iter()
            .enumerate()
            .filter(|(i, s)| {
                (keep > 0 && *i >= keep as usize) || (before_ms > 0 && s.created_ms < before_ms)
            })
            .map(|(_, s)| s.id)
            .filter(|id| !protected.contains(id))
            .collect())
    }

    pub fn set_snapshot_kind(&self, id: Uuid, kind: SnapshotKind) -> Result<bool, RegistryError> {
        let n = self.conn.execute(
            "UPDATE snapshots SET kind = ?2 WHERE id = ?1",
            params![id.to_string(), kind.as_str()],
        )?;
        Ok(n == 1)
    }

    /// Records the template of its (image, shape), replacing any.
    pub fn put_template(&self, t: &TemplateRow) -> Result<(), RegistryError> {
        self.conn.execute(
            "INSERT OR REPLACE INTO templates (image, cpus, memory_mb, state, snapshot_id,
                failure_reason, build_id, build_ms, updated_ms, runtime, image_identity)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
            params![
                t.image,
                t.cpus,
                t.memory_mb,
                t.state.as_str(),
                t.snapshot_id.map(|u| u.to_string()),
                t.failure_reason,
                t.build_id.map(|u| u.to_string()),
                t.build_ms.map(|v| v as i64),
                t.updated_ms as i64,
                t.runtime.as_str(),
                t.image_identity,
            ],
        )?;
        Ok(())
    }

    /// Every template, by image, runtime and shape.
    pub fn list_templates(&self) -> Result<Vec<TemplateRow>, RegistryError> {
        let mut st = self.conn.prepare(
            "SELECT image, cpus, memory_mb, state, snapshot_id, failure_reason, build_id,
                build_ms, updated_ms, runtime, image_identity FROM templates
                ORDER BY image, runtime, cpus, memory_mb",
        )?;
        let rows = st.query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, u8>(1)?,
                r.get::<_, u32>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, Option<String>>(4)?,
                r.get::<_, Option<String>>(5)?,
                r.get::<_, Option<String>>(6)?,
                r.get::<_, Option<i64>>(7)?,
                r.get::<_, i64>(8)?,
                r.get::<_, String>(9)?,
                r.get::<_, Option<String>>(10)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (image, cpus, memory_mb, state, snap, why, build, ms, updated, runtime, ident) =
                row?;
            out.push(TemplateRow {
                image,
                runtime: runtime.parse()?,
                cpus,
                memory_mb,
                state: state.parse()?,
                snapshot_id: uuid_col(snap, "template snapshot_id")?,
                failure_reason: why,
                build_id: uuid_col(build, "template build_id")?,
                build_ms: ms.map(|v| v.max(0) as u64),
                updated_ms: updated.max(0) as u64,
                image_identity: ident,
            });
        }
        Ok(out)
    }

    /// The snapshots nothing needs any more: every one that is not a user
    /// snapshot, a checkpoint or a template's, that no sandbox builds on,
    /// wakes from or was made from, and that is in the chain of no kept
    /// snapshot. Their records are removed here (children before
    /// parents); the caller removes their directories.
    pub fn collect_garbage(&mut self) -> Result<Vec<SnapshotRow>, RegistryError> {
        let snaps = self.list_snapshots()?;
        let by_id: std::collections::HashMap<Uuid, &SnapshotRow> =
            snaps.iter().map(|s| (s.id, s)).collect();
        let mut roots: Vec<Uuid> = snaps
            .iter()
            .filter(|s| matches!(s.kind, SnapshotKind::User | SnapshotKind::Checkpoint))
            .map(|s| s.id)
            .collect();
        roots.extend(self.list_templates()?.iter().filter_map(|t| t.snapshot_id));
        for s in self.list_sandboxes()? {
            roots.extend(s.lineage_snapshot_id);
            roots.extend(s.rest_snapshot_id);
            roots.extend(s.snapshot_id);
        }
        let mut keep = std::collections::HashSet::new();
        for mut id in roots {
            // Each chain is at most a few snapshots deep; `keep` stops loops.
            while keep.insert(id) {
                match by_id.get(&id).and_then(|s| s.parent_id) {
                    Some(p) => id = p,
                    None => break,
                }
            }
        }
        let mut gone: Vec<SnapshotRow> = snaps
            .iter()
            .filter(|s| !keep.contains(&s.id))
            .cloned()
            .collect();
        // Deepest first: a child's record goes before its parent's.
        gone.sort_by_key(|s| std::cmp::Reverse(s.depth));
        let tx = self.conn.transaction()?;
        for s in &gone {
            tx.execute("DELETE FROM snapshots WHERE id = ?1", [s.id.to_string()])?;
        }
        tx.commit()?;
        Ok(gone)
    }

    /// The snapshots of archived sandbox `vm`'s chain whose local files
    /// nothing else here needs: sproutd's own (rest, dropped) and in the
    /// object store, on no chain of a sandbox that is not archived nor of
    /// a user snapshot, checkpoint or template.
    pub fn evictable(&self, vm: Uuid) -> Result<Vec<SnapshotRow>, RegistryError> {
        let snaps = self.list_snapshots()?;
        let by_id: std::collections::HashMap<Uuid, &SnapshotRow> =
            snaps.iter().map(|s| (s.id, s)).collect();
        let chain = |from: Option<Uuid>, out: &mut std::collections::HashSet<Uuid>| {
            let mut next = from;
            while let Some(id) = next {
                if !out.insert(id) {
                    break;
                }
                next = by_id.get(&id).and_then(|s| s.parent_id);
            }
        };
        let mut needed = std::collections::HashSet::new();
        let mut mine = std::collections::HashSet::new();
        for s in self.list_sandboxes()? {
            if s.id == vm {
                chain(s.rest_snapshot_id, &mut mine);
            } else if s.state != State::Archived {
                chain(s.lineage_snapshot_id, &mut needed);
                chain(s.rest_snapshot_id, &mut needed);
                chain(s.snapshot_id, &mut needed);
            }
        }
        for s in &snaps {
            if matches!(
                s.kind,
                SnapshotKind::User | SnapshotKind::Checkpoint | SnapshotKind::Template
            ) {
                chain(Some(s.id), &mut needed);
            }
        }
        Ok(snaps
            .iter()
            .filter(|s| mine.contains(&s.id) && !needed.contains(&s.id))
            .filter(|s| matches!(s.kind, SnapshotKind::Rest | SnapshotKind::Dropped))
            .filter(|s| s.uploaded_ms.is_some())
            .cloned()
            .collect())
    }

    /// Records an archived sandbox from another node and the snapshots of
    /// its chain (those not known here), in one write; `Ok(Err(why))` (and
    /// nothing recorded) if a snapshot of the chain is known here as
    /// another tenant's, or the sandbox's id is taken.
    pub fn import_archived(
        &mut self,
        s: &Sandbox,
        chain: &[SnapshotRow],
    ) -> Result<Result<(), String>, RegistryError> {
        let tx = self.conn.transaction()?;
        let taken: i64 = tx.query_row(
            "SELECT COUNT(*) FROM sandboxes WHERE id = ?1",
            [s.id.to_string()],
            |r| r.get(0),
        )?;
        if taken > 0 {
            return Ok(Err(format!("a sandbox {} is recorded here already", s.id)));
        }
        for c in chain {
            let known: Option<String> = tx
                .query_row(
                    "SELECT tenant FROM snapshots WHERE id = ?1",
                    [c.id.to_string()],
                    |r| r.get(0),
                )
                .optional()?;
            match known {
                None => insert_snapshot_in(&tx, c)?,
                Some(t) if t == c.tenant => {}
                Some(_) => {
                    return Ok(Err(format!(
                        "snapshot {} of its chain is another tenant's here",
                        c.id
                    )))
                }
            }
        }
        insert_sandbox_in(&tx, s)?;
        tx.commit()?;
        Ok(Ok(()))
    }

    /// Records where a sandbox's worker is; false if there is no such sandbox.
    pub fn set_worker(
        &self,
        id: Uuid,
        socket: &Path,
        vsock: Option<&Path>,
        pid: u32,
    ) -> Result<bool, RegistryError> {
        let n = self.conn.execute(
            "UPDATE sandboxes SET worker_socket = ?2, vsock_socket = ?3, pid = ?4 WHERE id = ?1",
            params![
                id.to_string(),
                socket.to_string_lossy(),
                vsock.map(|v| v.to_string_lossy().into_owned()),
                pid
            ],
        )?;
        Ok(n == 1)
    }

    /// Sets a sandbox's state (and its failure reason, cleared unless
    /// given); false if there is no such sandbox.
    pub fn set_state(
        &self,
        id: Uuid,
        state: State,
        reason: Option<&str>,
    ) -> Result<bool, RegistryError> {
        let n = self.conn.execute(
            "UPDATE sandboxes SET state = ?2, failure_reason = ?3 WHERE id = ?1",
            params![id.to_string(), state.as_str(), reason],
        )?;
        Ok(n == 1)
    }

    /// Marks a sandbox failed only while it is still `running` or `paused`
    /// with worker `pid` (a transition that replaced or stopped its worker
    /// meanwhile is not a failure); whether it did.
    pub fn fail_worker(&self, id: Uuid, pid: u32, reason: &str) -> Result<bool, RegistryError> {
        let n = self.conn.execute(
            "UPDATE sandboxes SET state = 'failed', failure_reason = ?3
             WHERE id = ?1 AND pid = ?2 AND state IN ('running', 'paused')",
            params![id.to_string(), pid, reason],
        )?;
        Ok(n == 1)
    }

    pub fn get_sandbox(&self, id: Uuid) -> Result<Option<Sandbox>, RegistryError> {
        self.one(
            &format!("SELECT {COLUMNS} FROM sandboxes WHERE id = ?1"),
            id,
            row_sandbox,
        )
    }

    /// Every sandbox, oldest first.
    /// The sandboxes of `tenant` that hold a slot: every one whose VM is
    /// meant to run (starting or running; one being deleted holds none,
    /// whatever it was before).
    pub fn slot_holders(
        &self,
        tenant: &str,
    ) -> Result<std::collections::HashSet<Uuid>, RegistryError> {
        let mut st = self.conn.prepare_cached(
            "SELECT id FROM sandboxes WHERE tenant = ?1 AND state IN ('starting', 'running')",
        )?;
        let ids = st.query_map([tenant], |r| r.get::<_, String>(0))?;
        let mut out = std::collections::HashSet::new();
        for id in ids {
            let id = id?;
            out.insert(
                Uuid::parse_str(&id).map_err(|_| RegistryError::BadRow(format!("id {id:?}")))?,
            );
        }
        Ok(out)
    }

    pub fn list_sandboxes(&self) -> Result<Vec<Sandbox>, RegistryError> {
        self.all(
            &format!("SELECT {COLUMNS} FROM sandboxes ORDER BY created_ms, id"),
            row_sandbox,
        )
    }

    /// Removes a sandbox's record, and its ports; false if there was none.
    pub fn delete_sandbox(&self, id: Uuid) -> Result<bool, RegistryError> {
        self.conn
            .execute("DELETE FROM ports WHERE vm_id = ?1", [id.to_string()])?;
        Ok(self
            .conn
            .execute("DELETE FROM sandboxes WHERE id = ?1", [id.to_string()])?
            == 1)
    }

    /// Records (or, open already, updates) port `p.port` of `p.vm_id`;
    /// refused past `max` ports for the sandbox. The row as recorded.
    pub fn put_port(&mut self, p: &PortRow, max: usize) -> Result<Option<PortRow>, RegistryError> {
        let tx = self.conn.transaction()?;
        let vm = p.vm_id.to_string();
        let open: i64 = tx.query_row(
            "SELECT COUNT(*) FROM ports WHERE vm_id = ?1 AND port != ?2",
            params![vm, p.port],
            |r| r.get(0),
        )?;
        if open as usize >= max {
            return Ok(None);
        }
        tx.execute(
            "INSERT INTO ports (vm_id, port, public, created_ms) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT (vm_id, port) DO UPDATE SET public = excluded.public",
            params![vm, p.port, p.public, p.created_ms as i64],
        )?;
        let row = tx.query_row(
            "SELECT vm_id, port, public, created_ms FROM ports WHERE vm_id = ?1 AND port = ?2",
            params![vm, p.port],
            row_port,
        )??;
        tx.commit()?;
        Ok(Some(row))
    }

    /// Port `port` of sandbox `vm`, if open.
    pub fn get_port(&self, vm: Uuid, port: u16) -> Result<Option<PortRow>, RegistryError> {
        self.conn
            .query_row(
                "SELECT vm_id, port, public, created_ms FROM ports WHERE vm_id = ?1 AND port = ?2",
                params![vm.to_string(), port],
                row_port,
            )
            .optional()?
            .transpose()
    }

    /// The open ports of sandbox `vm`, by number.
    pub fn list_ports(&self, vm: Uuid) -> Result<Vec<PortRow>, RegistryError> {
        let mut st = self.conn.prepare(
            "SELECT vm_id, port, public, created_ms FROM ports WHERE vm_id = ?1 ORDER BY port",
        )?;
        let rows = st.query_map([vm.to_string()], row_port)?;
        let mut out = Vec::new();
        for r in rows {
            out.push(r??);
        }
        Ok(out)
    }

    /// Closes port `port` of `vm`; false if it was not open.
    pub fn delete_port(&self, vm: Uuid, port: u16) -> Result<bool, RegistryError> {
        Ok(self.conn.execute(
            "DELETE FROM ports WHERE vm_id = ?1 AND port = ?2",
            params![vm.to_string(), port],
        )? == 1)
    }

    /// Replaces the image list with `images` (what is on disk now).
    pub fn set_images(&mut self, images: &[Image], now_ms: u64) -> Result<(), RegistryError> {
        let tx = self.conn.transaction()?;
        tx.execute("DELETE FROM images", [])?;
        for i in images {
            tx.execute(
                "INSERT INTO images (name, path, size_bytes, seen_at_ms) VALUES (?1, ?2, ?3, ?4)",
                params![
                    i.name,
                    i.path.to_string_lossy(),
                    i.size_bytes as i64,
                    now_ms as i64
                ],
            )?;
        }
        tx.commit()?;
        Ok(())
    }

    pub fn images(&self) -> Result<Vec<Image>, RegistryError> {
        let mut st = self
            .conn
            .prepare("SELECT name, path, size_bytes FROM images ORDER BY name")?;
        let rows = st.query_map([], |r| {
            Ok(Image {
                name: r.get(0)?,
                path: PathBuf::from(r.get::<_, String>(1)?),
                size_bytes: r.get::<_, i64>(2)?.max(0) as u64,
                runtimes: vec![Runtime::Container],
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }
}

fn insert_sandbox_in(conn: &Connection, s: &Sandbox) -> Result<(), RegistryError> {
    conn.execute(
        "INSERT INTO sandboxes (id, state, image, cpus, memory_mb, disable_internet,
            idle_timeout_secs, env, metadata, worker_socket, vsock_socket, pid, created_ms,
            parent_vm_id, snapshot_id, failure_reason, lineage_snapshot_id,
            rest_snapshot_id, hostname, tenant, runtime)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16,
            ?17, ?18, ?19, ?20, ?21)",
        params![
            s.id.to_string(),
            s.state.as_str(),
            s.image,
            s.cpus,
            s.memory_mb,
            s.disable_internet,
            s.idle_timeout_secs,
            json(&s.env),
            json(&s.metadata),
            path_text(&s.worker_socket),
            path_text(&s.vsock_socket),
            s.pid,
            s.created_ms as i64,
            s.parent_vm_id.map(|u| u.to_string()),
            s.snapshot_id.map(|u| u.to_string()),
            s.failure_reason,
            s.lineage_snapshot_id.map(|u| u.to_string()),
            s.rest_snapshot_id.map(|u| u.to_string()),
            s.hostname,
            s.tenant,
            s.runtime.as_str(),
        ],
    )?;
    Ok(())
}

fn insert_snapshot_in(conn: &Connection, s: &SnapshotRow) -> Result<(), RegistryError> {
    conn.execute(
        "INSERT INTO snapshots (id, vm_id, name, dir, kind, parent_id, depth, image, cpus,
            memory_mb, env, size_bytes, created_ms, diff, tenant, uploaded_ms, imported,
            runtime)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16,
            ?17, ?18)",
        params![
            s.id.to_string(),
            s.vm_id.map(|u| u.to_string()),
            s.name,
            s.dir.to_string_lossy(),
            s.kind.as_str(),
            s.parent_id.map(|u| u.to_string()),
            s.depth,
            s.image,
            s.cpus,
            s.memory_mb,
            json(&s.env),
            s.size_bytes as i64,
            s.created_ms as i64,
            s.parent_id.is_some(),
            s.tenant,
            s.uploaded_ms.map(|u| u as i64),
            s.imported,
            s.runtime.as_str(),
        ],
    )?;
    Ok(())
}

const COLUMNS: &str = "id, state, image, cpus, memory_mb, disable_internet, idle_timeout_secs, \
    env, metadata, worker_socket, vsock_socket, pid, created_ms, parent_vm_id, snapshot_id, \
    failure_reason, lineage_snapshot_id, rest_snapshot_id, hostname, tenant, runtime";

const SNAP_COLUMNS: &str = "id, vm_id, name, dir, kind, parent_id, depth, image, cpus, memory_mb, \
    env, size_bytes, created_ms, tenant, uploaded_ms, imported, runtime";

fn row_snapshot(r: &Row<'_>) -> rusqlite::Result<Result<SnapshotRow, RegistryError>> {
    let id: String = r.get(0)?;
    let vm: Option<String> = r.get(1)?;
    let name: Option<String> = r.get(2)?;
    let dir: String = r.get(3)?;
    let kind: String = r.get(4)?;
    let parent: Option<String> = r.get(5)?;
    let depth: u32 = r.get(6)?;
    let image: String = r.get(7)?;
    let cpus: u8 = r.get(8)?;
    let memory_mb: u32 = r.get(9)?;
    let env: String = r.get(10)?;
    let size: i64 = r.get(11)?;
    let created: i64 = r.get(12)?;
    let tenant: String = r.get(13)?;
    let uploaded: Option<i64> = r.get(14)?;
    let imported: bool = r.get(15)?;
    let runtime: String = r.get(16)?;
    Ok((|| {
        Ok(SnapshotRow {
            runtime: runtime.parse()?,
            imported,
            uploaded_ms: uploaded.map(|u| u.max(0) as u64),
            id: Uuid::parse_str(&id)
                .map_err(|_| RegistryError::BadRow(format!("snapshot id {id:?}")))?,
            tenant,
            vm_id: uuid_col(vm, "vm_id")?,
            name,
            dir: PathBuf::from(dir),
            kind: kind.parse()?,
            parent_id: uuid_col(parent, "parent_id")?,
            depth,
            image,
            cpus,
            memory_mb,
            env: serde_json::from_str(&env)
                .map_err(|e| RegistryError::BadRow(format!("env of snapshot {id}: {e}")))?,
            size_bytes: size.max(0) as u64,
            created_ms: created.max(0) as u64,
        })
    })())
}

fn json(m: &BTreeMap<String, String>) -> String {
    serde_json::to_string(m).unwrap_or_else(|_| "{}".into())
}

fn uuid_col(s: Option<String>, what: &str) -> Result<Option<Uuid>, RegistryError> {
    s.map(|s| Uuid::parse_str(&s).map_err(|_| RegistryError::BadRow(format!("{what} {s:?}"))))
        .transpose()
}

fn row_sandbox(r: &Row<'_>) -> rusqlite::Result<Result<Sandbox, RegistryError>> {
    let id: String = r.get(0)?;
    let state: String = r.get(1)?;
    let env: String = r.get(7)?;
    let metadata: String = r.get(8)?;
    let parent: Option<String> = r.get(13)?;
    let snapshot: Option<String> = r.get(14)?;
    let fields = (
        r.get::<_, String>(2)?,
        r.get::<_, u8>(3)?,
        r.get::<_, u32>(4)?,
        r.get::<_, bool>(5)?,
        r.get::<_, Option<u32>>(6)?,
        r.get::<_, Option<String>>(9)?,
        r.get::<_, Option<String>>(10)?,
        r.get::<_, Option<u32>>(11)?,
        r.get::<_, i64>(12)?,
        r.get::<_, Option<String>>(15)?,
    );
    let lineage: Option<String> = r.get(16)?;
    let rest: Option<String> = r.get(17)?;
    let hostname: Option<String> = r.get(18)?;
    let tenant: String = r.get(19)?;
    let runtime: String = r.get(20)?;
    Ok((|| {
        let (image, cpus, memory_mb, disable_internet, idle, sock, vsock, pid, created, reason) =
            fields;
        let map = |s: &str, what: &str| {
            serde_json::from_str::<BTreeMap<String, String>>(s)
                .map_err(|e| RegistryError::BadRow(format!("{what} of {id}: {e}")))
        };
        Ok(Sandbox {
            id: Uuid::parse_str(&id).map_err(|_| RegistryError::BadRow(format!("id {id:?}")))?,
            tenant,
            state: state.parse()?,
            image,
            runtime: runtime.parse()?,
            cpus,
            memory_mb,
            disable_internet,
            idle_timeout_secs: idle,
            env: map(&env, "env")?,
            metadata: map(&metadata, "metadata")?,
            worker_socket: sock.map(PathBuf::from),
            vsock_socket: vsock.map(PathBuf::from),
            pid,
            created_ms: created.max(0) as u64,
            parent_vm_id: uuid_col(parent, "parent_vm_id")?,
            snapshot_id: uuid_col(snapshot, "snapshot_id")?,
            failure_reason: reason,
            lineage_snapshot_id: uuid_col(lineage, "lineage_snapshot_id")?,
            rest_snapshot_id: uuid_col(rest, "rest_snapshot_id")?,
            hostname,
        })
    })())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox(image: &str, created_ms: u64) -> Sandbox {
        Sandbox {
            id: Uuid::new_v4(),
            tenant: "t".into(),
            state: State::Starting,
            image: image.into(),
            runtime: Runtime::Vm,
            cpus: 2,
            memory_mb: 1024,
            disable_internet: true,
            idle_timeout_secs: Some(600),
            env: BTreeMap::from([("A".into(), "1".into())]),
            metadata: BTreeMap::from([("team".into(), "x \"quoted\" ü".into())]),
            worker_socket: None,
            vsock_socket: None,
            pid: None,
            created_ms,
            parent_vm_id: None,
            snapshot_id: None,
            failure_reason: None,
            lineage_snapshot_id: None,
            rest_snapshot_id: None,
            hostname: None,
        }
    }

    fn snap(kind: SnapshotKind, parent: Option<&SnapshotRow>) -> SnapshotRow {
        SnapshotRow {
            tenant: "t".into(),
            uploaded_ms: None,
            imported: false,
            id: Uuid::new_v4(),
            vm_id: None,
            name: None,
            dir: PathBuf::from(format!("/s/{}", Uuid::new_v4())),
            kind,
            parent_id: parent.map(|p| p.id),
            depth: parent.map_or(1, |p| p.depth + 1),
            image: "test".into(),
            runtime: Runtime::Container,
            cpus: 1,
            memory_mb: 128,
            env: BTreeMap::new(),
            size_bytes: 4096,
            created_ms: 1,
        }
    }

    #[test]
    fn garbage_is_what_no_sandbox_or_kept_snapshot_builds_on() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = Registry::open(&dir.path().join("registry.db")).unwrap();
        // rest0 <- user1 (kept) ; rest0 <- rest2 (a sandbox wakes from it);
        // dropped3 (nothing) ; rest4 (nothing) <- rest5 (nothing).
        let rest0 = snap(SnapshotKind::Rest, None);
        let user1 = snap(SnapshotKind::User, Some(&rest0));
        let rest2 = snap(SnapshotKind::Rest, Some(&rest0));
        let dropped3 = snap(SnapshotKind::Dropped, None);
        let rest4 = snap(SnapshotKind::Rest, None);
        let rest5 = snap(SnapshotKind::Rest, Some(&rest4));
        for s in [&rest0, &user1, &rest2, &dropped3, &rest4, &rest5] {
            r.insert_snapshot(s).unwrap();
        }
        let mut sb = sandbox("test", 1);
        sb.rest_snapshot_id = Some(rest2.id);
        r.insert_sandbox(&sb).unwrap();
        let gone: Vec<Uuid> = r.collect_garbage().unwrap().iter().map(|s| s.id).collect();
        assert_eq!(gone.len(), 3, "{gone:?}");
        assert_eq!(gone[0], rest5.id, "a child before its parent");
        assert!(gone.contains(&rest4.id) && gone.contains(&dropped3.id));
        assert_eq!(r.get_snapshot(user1.id).unwrap(), Some(user1.clone()));
        assert!(r.get_snapshot(rest0.id).unwrap().is_some());
        // Once the sandbox wakes from nothing, rest2 goes; rest0 stays for user1.
        r.set_snapshots(sb.id, None, None).unwrap();
        let gone: Vec<Uuid> = r.collect_garbage().unwrap().iter().map(|s| s.id).collect();
        assert_eq!(gone, vec![rest2.id]);
        r.set_snapshot_kind(user1.id, SnapshotKind::Dropped)
            .unwrap();
        assert_eq!(r.collect_garbage().unwrap().len(), 2);
        assert!(r.list_snapshots().unwrap().is_empty());
    }

    #[test]
    fn sandboxes_survive_a_reopen_with_every_field() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("registry.db");
        let (a, mut b) = (sandbox("default", 1000), sandbox("test", 2000));
        b.parent_vm_id = Some(a.id);
        {
            let r = Registry::open(&db).unwrap();
            r.insert_sandbox(&a).unwrap();
            r.insert_sandbox(&b).unwrap();
            assert!(r
                .set_worker(b.id, Path::new("/w.sock"), Some(Path::new("/v.sock")), 42)
                .unwrap());
            assert!(r.set_state(b.id, State::Failed, Some("gone")).unwrap());
            assert!(!r.set_state(Uuid::new_v4(), State::Running, None).unwrap());
        }
        let r = Registry::open(&db).unwrap();
        let mut want_b = b.clone();
        want_b.worker_socket = Some("/w.sock".into());
        want_b.vsock_socket = Some("/v.sock".into());
        want_b.pid = Some(42);
        want_b.state = State::Failed;
        want_b.failure_reason = Some("gone".into());
        assert_eq!(r.list_sandboxes().unwrap(), vec![a.clone(), want_b.clone()]);
        assert_eq!(r.get_sandbox(b.id).unwrap(), Some(want_b));
        assert!(r.delete_sandbox(a.id).unwrap());
        assert!(!r.delete_sandbox(a.id).unwrap());
        assert_eq!(r.get_sandbox(a.id).unwrap(), None);
        assert_eq!(r.list_sandboxes().unwrap().len(), 1);
    }

    #[test]
    fn the_schema_is_migrated_once_and_wal_is_on() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("registry.db");
        let r = Registry::open(&db).unwrap();
        assert_eq!(r.schema_version().unwrap(), MIGRATIONS.len() as u32);
        let mode: String = r
            .conn
            .pragma_query_value(None, "journal_mode", |x| x.get(0))
            .unwrap();
        assert_eq!(mode, "wal");
        drop(r);
        // Reopening applies nothing again (a second CREATE TABLE would fail).
        let r = Registry::open(&db).unwrap();
        assert_eq!(r.schema_version().unwrap(), MIGRATIONS.len() as u32);
        for t in ["sandboxes", "snapshots", "layers", "images"] {
            let n: i64 = r
                .conn
                .query_row(
                    "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1",
                    [t],
                    |x| x.get(0),
                )
                .unwrap();
            assert_eq!(n, 1, "{t}");
        }
    }

    #[test]
    fn runtimes_migrate_from_schema_4_and_key_templates() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("registry.db");
        // A registry as schema 4 left it: a sandbox and a ready template.
        {
            let mut c = Connection::open(&db).unwrap();
            let tx = c.transaction().unwrap();
            for sql in &MIGRATIONS[..4] {
                tx.execute_batch(sql).unwrap();
            }
            tx.pragma_update(None, "user_version", 4).unwrap();
            tx.execute(
                "INSERT INTO sandboxes (id, state, image, cpus, memory_mb, disable_internet,
                    env, metadata, created_ms) VALUES (?1, 'running', 'default', 1, 256, 0,
                    '{}', '{}', 1)",
                [Uuid::nil().to_string()],
            )
            .unwrap();
            tx.execute(
                "INSERT INTO templates (image, cpus, memory_mb, state, updated_ms)
                 VALUES ('default', 1, 256, 'failed', 3)",
                [],
            )
            .unwrap();
            tx.commit().unwrap();
        }
        let r = Registry::open(&db).unwrap();
        assert_eq!(r.schema_version().unwrap(), MIGRATIONS.len() as u32);
        let s = r.get_sandbox(Uuid::nil()).unwrap().unwrap();
        assert_eq!(s.runtime, Runtime::Container);
        let old = r.list_templates().unwrap();
        assert_eq!(old.len(), 1);
        assert_eq!(old[0].runtime, Runtime::Container);
        assert_eq!(old[0].updated_ms, 3);
        // Built before image identities were recorded: unknown.
        assert_eq!(old[0].image_identity, None);
        // The same image and shape in the other runtime is another template.
        let vm = TemplateRow {
            runtime: Runtime::Vm,
            state: TemplateState::Building,
            updated_ms: 4,
            image_identity: Some("4096 bytes, head 01".into()),
            ..old[0].clone()
        };
        r.put_template(&vm).unwrap();
        let all = r.list_templates().unwrap();
        assert_eq!(all, vec![old[0].clone(), vm]);
        let bad = r.conn.execute(
            "UPDATE sandboxes SET runtime = 'unikernel' WHERE id = ?1",
            [Uuid::nil().to_string()],
        );
        assert!(bad.is_err());
        for rt in [Runtime::Container, Runtime::Vm] {
            assert_eq!(rt.as_str().parse::<Runtime>().unwrap(), rt);
            assert_eq!(serde_json::to_value(rt).unwrap(), rt.as_str());
        }
    }

    #[test]
    fn a_newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("registry.db");
        drop(Registry::open(&db).unwrap());
        let c = Connection::open(&db).unwrap();
        c.pragma_update(None, "user_version", 99).unwrap();
        drop(c);
        assert!(matches!(
            Registry::open(&db),
            Err(RegistryError::TooNew(_, 99, _))
        ));
    }

    #[test]
    fn the_schema_refuses_impossible_rows() {
        let dir = tempfile::tempdir().unwrap();
        let r = Registry::open(&dir.path().join("registry.db")).unwrap();
        let mut s = sandbox("default", 1);
        s.cpus = 9;
        assert!(r.insert_sandbox(&s).is_err());
        let s = sandbox("default", 1);
        r.insert_sandbox(&s).unwrap();
        assert!(r.insert_sandbox(&s).is_err(), "a duplicate id");
        let bad = r.conn.execute(
            "UPDATE sandboxes SET state = 'exploded' WHERE id = ?1",
            [s.id.to_string()],
        );
        assert!(bad.is_err());
    }

    #[test]
    fn every_state_has_a_name_it_parses_back_from() {
        for st in State::ALL {
            assert_eq!(st.as_str().parse::<State>().unwrap(), st);
            assert_eq!(serde_json::to_value(st).unwrap(), st.as_str());
        }
        assert!("exploded".parse::<State>().is_err());
    }

    #[test]
    fn images_are_replaced_whole() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = Registry::open(&dir.path().join("registry.db")).unwrap();
        let img = |n: &str| Image {
            name: n.into(),
            path: PathBuf::from(format!("/i/{n}.ext4")),
            size_bytes: 7,
            runtimes: vec![Runtime::Container],
        };
        r.set_images(&[img("test"), img("default")], 5).unwrap();
        assert_eq!(r.images().unwrap(), vec![img("default"), img("test")]);
        r.set_images(&[img("test")], 6).unwrap();
        assert_eq!(r.images().unwrap(), vec![img("test")]);
    }
}
