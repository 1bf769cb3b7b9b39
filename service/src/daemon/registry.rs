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

/// One sandbox as recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sandbox {
    pub id: Uuid,
    pub state: State,
    pub image: String,
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
}

/// An image found on disk.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Image {
    pub name: String,
    #[schema(value_type = String)]
    pub path: PathBuf,
    pub size_bytes: u64,
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
        self.conn.execute(
            "INSERT INTO sandboxes (id, state, image, cpus, memory_mb, disable_internet,
                idle_timeout_secs, env, metadata, worker_socket, vsock_socket, pid, created_ms,
                parent_vm_id, snapshot_id, failure_reason)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)",
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
            ],
        )?;
        Ok(())
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

    pub fn get_sandbox(&self, id: Uuid) -> Result<Option<Sandbox>, RegistryError> {
        self.conn
            .query_row(
                &format!("SELECT {COLUMNS} FROM sandboxes WHERE id = ?1"),
                [id.to_string()],
                row_sandbox,
            )
            .optional()?
            .transpose()
    }

    /// Every sandbox, oldest first.
    pub fn list_sandboxes(&self) -> Result<Vec<Sandbox>, RegistryError> {
        let mut st = self.conn.prepare(&format!(
            "SELECT {COLUMNS} FROM sandboxes ORDER BY created_ms, id"
        ))?;
        let rows = st.query_map([], row_sandbox)?;
        let mut out = Vec::new();
        for r in rows {
            out.push(r??);
        }
        Ok(out)
    }

    /// Removes a sandbox's record; false if there was none.
    pub fn delete_sandbox(&self, id: Uuid) -> Result<bool, RegistryError> {
        Ok(self
            .conn
            .execute("DELETE FROM sandboxes WHERE id = ?1", [id.to_string()])?
            == 1)
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
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }
}

const COLUMNS: &str = "id, state, image, cpus, memory_mb, disable_internet, idle_timeout_secs, \
    env, metadata, worker_socket, vsock_socket, pid, created_ms, parent_vm_id, snapshot_id, \
    failure_reason";

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
    Ok((|| {
        let (image, cpus, memory_mb, disable_internet, idle, sock, vsock, pid, created, reason) =
            fields;
        let map = |s: &str, what: &str| {
            serde_json::from_str::<BTreeMap<String, String>>(s)
                .map_err(|e| RegistryError::BadRow(format!("{what} of {id}: {e}")))
        };
        Ok(Sandbox {
            id: Uuid::parse_str(&id).map_err(|_| RegistryError::BadRow(format!("id {id:?}")))?,
            state: state.parse()?,
            image,
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
        })
    })())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox(image: &str, created_ms: u64) -> Sandbox {
        Sandbox {
            id: Uuid::new_v4(),
            state: State::Starting,
            image: image.into(),
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
        }
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
        };
        r.set_images(&[img("test"), img("default")], 5).unwrap();
        assert_eq!(r.images().unwrap(), vec![img("default"), img("test")]);
        r.set_images(&[img("test")], 6).unwrap();
        assert_eq!(r.images().unwrap(), vec![img("test")]);
    }
}
