//! Tenants: who a request is from, what it may see, and how much it may
//! hold (docs/api.md, "Tenants and quotas").
//!
//! With `--tenants FILE`, every request but `GET /v1/health`, `GET
//! /v1/openapi.json` and the dashboard's static files (`/dashboard`) must
//! carry an API key (`Authorization: Bearer KEY` or `X-API-Key: KEY`).
//! The file holds no key, only each key's SHA-256: a key is 256 random
//! bits ([`new_key`]), so one unsalted hash is as strong as the key, and
//! the file can be read by anyone who may read the configuration. Each
//! key names its tenant; a tenant sees only the
//! sandboxes, snapshots, checkpoints, processes and files that it made
//! (another's id is answered exactly as an unknown one), and holds at most
//! `slots` running sandboxes and `max_execs` execs in flight. SIGHUP
//! re-reads the file (a bad file keeps the one in force, and says why).
//!
//! Without the file, sproutd is single-tenant: every request is the
//! tenant `default`, with no quota, and sproutd listens only on loopback.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use super::error::{ApiError, Code};
use super::{lock, App};

/// The tenant of single-tenant mode, and of every sandbox recorded before
/// tenants existed.
pub const DEFAULT_TENANT: &str = "default";
/// Most tenants, and most keys, one file may hold.
const MAX_TENANTS: usize = 10_000;
const MAX_KEYS: usize = 100_000;
/// Largest tenants file read.
const MAX_FILE: u64 = 16 << 20;
/// The most any tenant may be given of either limit.
const MAX_SLOTS: u32 = 100_000;
/// How an API key begins ([`new_key`] makes them).
pub const KEY_PREFIX: &str = "sk-sprout-";

/// The file's shape.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    tenant: Vec<TenantEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantEntry {
    name: String,
    /// Running sandboxes at once (none: no limit).
    slots: Option<u32>,
    /// Execs in flight at once, in all its sandboxes (none: no limit).
    max_execs: Option<u32>,
    /// May read `/metrics` (the whole service's figures).
    #[serde(default)]
    operator: bool,
    #[serde(default)]
    keys: Vec<KeyEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyEntry {
    /// The key's SHA-256, 64 hex digits.
    sha256: String,
    /// For people (logs say it, never the key).
    name: Option<String>,
    /// Answered 401 as revoked.
    #[serde(default)]
    revoked: bool,
}

/// What a tenant may do.
#[derive(Debug, PartialEq, Eq)]
pub struct Policy {
    pub name: String,
    pub slots: Option<u32>,
    pub max_execs: Option<u32>,
    pub operator: bool,
}

/// The tenant a request is from (set by [`authenticate`]).
#[derive(Clone, Debug)]
pub struct Caller(pub Arc<Policy>);

impl Caller {
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// Whether `tenant` (a row's) is this caller's.
    pub fn owns(&self, tenant: &str) -> bool {
        self.0.name == tenant
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        parts
            .extensions
            .get::<Caller>()
            .cloned()
            .ok_or_else(|| ApiError::internal("the request was not authenticated"))
    }
}

#[derive(Debug)]
enum Key {
    Live(Arc<Policy>, String),
    Revoked(String),
}

#[derive(Debug, Default)]
struct Table {
    keys: HashMap<[u8; 32], Key>,
    by_name: HashMap<String, Arc<Policy>>,
}

#[derive(Debug, thiserror::Error)]
pub enum TenantsError {
    #[error("Cannot read the tenants file {0}")]
    Read(PathBuf, #[source] std::io::Error),
    #[error("The tenants file {0} is over {MAX_FILE} bytes")]
    TooBig(PathBuf),
    #[error("The tenants file {0} is not valid: {1}")]
    Invalid(PathBuf, String),
}

/// The tenants in force.
pub struct Tenants {
    file: Option<PathBuf>,
    table: RwLock<Arc<Table>>,
    single: Arc<Policy>,
}

impl Tenants {
    /// Single-tenant mode.
    pub fn single() -> Self {
        Self {
            file: None,
            table: RwLock::default(),
            single: Arc::new(Policy {
                name: DEFAULT_TENANT.into(),
                slots: None,
                max_execs: None,
                operator: true,
            }),
        }
    }

    /// The tenants of `file`.
    pub fn load(file: &Path) -> Result<Self, TenantsError> {
        let t = Self {
            file: Some(file.to_owned()),
            ..Self::single()
        };
        let table = read(file)?;
        *t.table.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(table);
        Ok(t)
    }

    pub fn multi(&self) -> bool {
        self.file.is_some()
    }

    /// Reads the file again; on an error the tenants in force stay.
    pub fn reload(&self) -> Result<(usize, usize), TenantsError> {
        let Some(f) = &self.file else {
            return Ok((1, 0));
        };
        let table = read(f)?;
        let n = (table.by_name.len(), table.keys.len());
        *self.table.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(table);
        Ok(n)
    }

    fn table(&self) -> Arc<Table> {
        self.table.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The policy of `tenant` now (a tenant no longer in the file: no
    /// slot and no exec, so that its sandboxes wake or start no more).
    pub fn policy(&self, tenant: &str) -> Arc<Policy> {
        if !self.multi() {
            return self.single.clone();
        }
        self.table()
            .by_name
            .get(tenant)
            .cloned()
            .unwrap_or_else(|| {
                Arc::new(Policy {
                    name: tenant.to_owned(),
                    slots: Some(0),
                    max_execs: Some(0),
                    operator: false,
                })
            })
    }

    /// The caller that `key` names, or why not.
    pub(super) fn caller(&self, key: Option<&str>) -> Result<(Caller, Option<String>), ApiError> {
        if !self.multi() {
            return Ok((Caller(self.single.clone()), None));
        }
        let key = key.ok_or_else(|| {
            unauthorized(
                "An API key is needed: send it as Authorization: Bearer KEY (or X-API-Key: KEY)",
            )
        })?;
        let table = self.table();
        match table.keys.get(&digest(key)) {
            Some(Key::Live(p, name)) => Ok((Caller(p.clone()), Some(name.clone()))),
            Some(Key::Revoked(name)) => {
                tracing::info!(key = name, "a revoked key was used");
                Err(unauthorized("This API key was revoked"))
            }
            None => Err(unauthorized("This API key is not known here")),
        }
    }
}

fn unauthorized(m: &str) -> ApiError {
    ApiError::new(Code::Unauthorized, m)
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn read(path: &Path) -> Result<Table, TenantsError> {
    use std::io::Read as _;
    let f = std::fs::File::open(path).map_err(|e| TenantsError::Read(path.into(), e))?;
    let mut text = String::new();
    f.take(MAX_FILE + 1)
        .read_to_string(&mut text)
        .map_err(|e| TenantsError::Read(path.into(), e))?;
    if text.len() as u64 > MAX_FILE {
        return Err(TenantsError::TooBig(path.into()));
    }
    parse(&text).map_err(|m| TenantsError::Invalid(path.into(), m))
}

/// A tenant's name is a path component of its snapshots, here and in the
/// object store; names starting with `_` are sproutd's own (`_sproutd`).
fn valid_name(n: &str) -> bool {
    (1..=64).contains(&n.len())
        && n.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        // Not a snapshot's directory name of the older layout either.
        && uuid::Uuid::parse_str(n).is_err()
        && n.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

fn parse(text: &str) -> Result<Table, String> {
    let file: File = toml::from_str(text).map_err(|e| e.to_string())?;
    if file.tenant.is_empty() {
        return Err("it names no tenant ([[tenant]] tables)".into());
    }
    if file.tenant.len() > MAX_TENANTS {
        return Err(format!("it names over {MAX_TENANTS} tenants"));
    }
    let mut t = Table::default();
    for e in file.tenant {
        if !valid_name(&e.name) {
            return Err(format!(
                "tenant name {:?}: 1-64 of a-z, 0-9, - and _, starting with a letter or digit, \
                 and not a UUID",
                e.name
            ));
        }
        for (what, v) in [("slots", e.slots), ("max_execs", e.max_execs)] {
            if v.is_some_and(|v| v > MAX_SLOTS) {
                return Err(format!("tenant {:?}: {what} is over {MAX_SLOTS}", e.name));
            }
        }
        let p = Arc::new(Policy {
            name: e.name.clone(),
            slots: e.slots,
            max_execs: e.max_execs,
            operator: e.operator,
        });
        if t.by_name.insert(e.name.clone(), p.clone()).is_some() {
            return Err(format!("tenant {:?} is named twice", e.name));
        }
        for k in e.keys {
            let h = k.sha256.to_ascii_lowercase();
            let mut d = [0u8; 32];
            if h.len() != 64 || !h.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(format!(
                    "tenant {:?}: sha256 {:?} is not 64 hex digits (sproutd --new-key makes a key \
                     and its line)",
                    e.name, k.sha256
                ));
            }
            for (i, byte) in d.iter_mut().enumerate() {
                *byte = u8::from_str_radix(&h[2 * i..2 * i + 2], 16).unwrap_or(0);
            }
            let name = k.name.unwrap_or_else(|| h[..8].to_owned());
            let key = if k.revoked {
                Key::Revoked(name)
            } else {
                Key::Live(p.clone(), name)
            };
            if t.keys.insert(d, key).is_some() {
                return Err(format!("the key {h} is listed twice"));
            }
            if t.keys.len() > MAX_KEYS {
                return Err(format!("it lists over {MAX_KEYS} keys"));
            }
        }
    }
    Ok(t)
}

/// A new API key and its line for the tenants file.
pub fn new_key() -> std::io::Result<(String, String)> {
    use base64::Engine as _;
    let mut b = [0u8; 32];
    let mut got = 0;
    while got < b.len() {
        match rustix::rand::getrandom(&mut b[got..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => got += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let key = format!(
        "{KEY_PREFIX}{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
    );
    let line = format!("{{ sha256 = \"{}\" }}", hex(&digest(&key)));
    Ok((key, line))
}

/// The key a request carries, if any.
fn key_of(req: &Request) -> Option<&str> {
    let h = req.headers();
    if let Some(v) = h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        let v = v.trim();
        if let Some((scheme, k)) = v.split_once(' ') {
            if scheme.eq_ignore_ascii_case("bearer") {
                return Some(k.trim());
            }
        }
        return None;
    }
    h.get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

/// Routes anyone may ask. The dashboard's (`/dashboard` and under it) are
/// static files with no data in them: the page reads everything through
/// the API, with the key its user gives it.
pub fn public(path: &str) -> bool {
    matches!(path, "/v1/health" | "/v1/openapi.json")
        || path == super::dashboard::BASE
        || path.starts_with("/dashboard/")
}

/// The middleware that makes every request a [`Caller`]'s, or answers 401.
pub async fn authenticate(
    State(app): State<Arc<App>>,
    mut req: Request,
    next: axum::middleware::Next,
) -> Response {
    if public(req.uri().path()) {
        return next.run(req).await;
    }
    match app.tenants.caller(key_of(&req)) {
        Ok((caller, key)) => {
            if let Some(key) = key {
                tracing::debug!(tenant = caller.name(), key, "authenticated");
            }
            req.extensions_mut().insert(caller);
            next.run(req).await
        }
        Err(e) => {
            tracing::info!(uri = %req.uri(), "refused: {}", e.message);
            let mut r = e.into_response();
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"sproutd\""),
            );
            r
        }
    }
}

/// Why `listen` is refused without tenants (none: it is loopback).
pub fn refuse_listen(listen: std::net::SocketAddr) -> Option<String> {
    (!listen.ip().is_loopback()).then(|| {
        format!(
            "Refusing to listen on {listen} without --tenants: with no API keys, anyone who \
             reaches that address could run code in every sandbox. Give --tenants FILE \
             (docs/api.md, \"Tenants and quotas\"), or listen on 127.0.0.1"
        )
    })
}

/// The sandboxes being brought to a state that holds a slot, by tenant
/// (each with a count: two holds may name one sandbox).
#[derive(Default)]
pub struct Slots {
    held: Mutex<HashMap<String, HashMap<Uuid, usize>>>,
}

/// Slots held for sandboxes on their way to running; dropping it lets go
/// (by then the registry says they run, or they failed).
#[must_use = "the slots are held only while this is"]
pub struct SlotHold {
    slots: Arc<Slots>,
    tenant: String,
    ids: Vec<Uuid>,
}

impl Drop for SlotHold {
    fn drop(&mut self) {
        let mut all = lock(&self.slots.held);
        if let Some(m) = all.get_mut(&self.tenant) {
            for id in &self.ids {
                if let Some(n) = m.get_mut(id) {
                    *n -= 1;
                    if *n == 0 {
                        m.remove(id);
                    }
                }
            }
            if m.is_empty() {
                all.remove(&self.tenant);
            }
        }
    }
}

impl Slots {
    /// Holds a slot of `tenant` for each of `ids` that holds none yet
    /// (`running`: the tenant's sandboxes that hold one in the registry),
    /// all or none; `Err((used, limit))` if they do not fit.
    pub fn hold(
        self: &Arc<Self>,
        tenant: &str,
        limit: Option<u32>,
        running: HashSet<Uuid>,
        ids: &[Uuid],
    ) -> Result<SlotHold, (usize, u32)> {
        let mut all = lock(&self.held);
        if let Some(limit) = limit {
            let mut used = running;
            if let Some(m) = all.get(tenant) {
                used.extend(m.keys().copied());
            }
            let before = used.len();
            used.extend(ids.iter().copied());
            if used.len() > limit as usize {
                return Err((before, limit));
            }
        }
        let m = all.entry(tenant.to_owned()).or_default();
        for id in ids {
            *m.entry(*id).or_insert(0) += 1;
        }
        Ok(SlotHold {
            slots: self.clone(),
            tenant: tenant.to_owned(),
            ids: ids.to_vec(),
        })
    }

    /// Sandboxes of `tenant` held on their way to running.
    pub fn pending(&self, tenant: &str) -> HashSet<Uuid> {
        lock(&self.held)
            .get(tenant)
            .map(|m| m.keys().copied().collect())
            .unwrap_or_default()
    }
}

impl App {
    /// Holds slots of `tenant` for `ids` (sandboxes about to start, or to
    /// run again), all or nothing: `402 quota_exhausted` if they do not
    /// fit. Held until the returned hold drops.
    pub async fn hold_slots(
        self: &Arc<Self>,
        tenant: &str,
        ids: Vec<Uuid>,
    ) -> Result<SlotHold, ApiError> {
        let policy = self.tenants.policy(tenant);
        let (t, slots) = (tenant.to_owned(), self.slots.clone());
        let n = ids.len();
        let r = self
            .db(move |r| {
                let running = r.slot_holders(&t)?;
                Ok(slots.hold(&t, policy.slots, running, &ids))
            })
            .await?;
        r.map_err(|(used, limit)| {
            ApiError::new(
                Code::QuotaExhausted,
                format!(
                    "Tenant {tenant:?} runs {used} of its {limit} sandbox slots: this needs {n} \
                     more. Pause, sleep, hibernate or delete one first"
                ),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_key_is_found_by_its_line_and_a_revoked_one_is_told() {
        let (key, line) = new_key().unwrap();
        assert!(key.starts_with(KEY_PREFIX) && key.len() == KEY_PREFIX.len() + 43);
        let (key2, line2) = new_key().unwrap();
        assert_ne!(key, key2);
        let sha = |l: &str| l.split('"').nth(1).unwrap().to_owned();
        let text = format!(
            "[[tenant]]\nname = \"a\"\nslots = 2\nkeys = [{line}]\n\n[[tenant]]\nname = \"b\"\n\
             keys = [{{ sha256 = \"{}\", revoked = true }}]\n",
            sha(&line2).to_uppercase()
        );
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("tenants.toml");
        std::fs::write(&f, &text).unwrap();
        let t = Tenants::load(&f).unwrap();
        let (c, _) = t.caller(Some(&key)).unwrap();
        assert_eq!(c.name(), "a");
        assert_eq!(c.0.slots, Some(2));
        let e = t.caller(Some(&key2)).unwrap_err();
        assert_eq!(e.code, Code::Unauthorized);
        assert!(e.message.contains("revoked"), "{}", e.message);
        assert!(t.caller(Some("sk-sprout-nope")).is_err());
        assert!(t.caller(None).is_err());
        // A tenant gone from the file holds nothing.
        assert_eq!(t.policy("gone").slots, Some(0));
        // A bad file keeps the tenants in force.
        std::fs::write(&f, "[[tenant]]\nname = \"Bad Name\"\n").unwrap();
        assert!(t.reload().is_err());
        assert_eq!(t.caller(Some(&key)).unwrap().0.name(), "a");
    }

    #[test]
    fn bad_files_are_refused_saying_why() {
        for (text, why) in [
            ("", "no tenant"),
            ("[[tenant]]\nname = \"\"\n", "tenant name"),
            ("[[tenant]]\nname = \"_sproutd\"\n", "tenant name"),
            ("[[tenant]]\nname = \"-a\"\n", "tenant name"),
            (
                "[[tenant]]\nname = \"0123456789abcdef0123456789abcdef\"\n",
                "tenant name",
            ),
            ("[[tenant]]\nname = \"a\"\nslot = 1\n", "unknown field"),
            (
                "[[tenant]]\nname = \"a\"\n[[tenant]]\nname = \"a\"\n",
                "twice",
            ),
            (
                "[[tenant]]\nname = \"a\"\nkeys = [{ sha256 = \"abc\" }]\n",
                "64 hex",
            ),
            ("[[tenant]]\nname = \"a\"\nslots = -1\n", "slots"),
            ("[[tenant]]\nname = \"a\"\nslots = 100001\n", "over"),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(why), "{text:?}: {e}");
        }
        let h = "a".repeat(64);
        let dup = format!(
            "[[tenant]]\nname = \"a\"\nkeys = [{{ sha256 = \"{h}\" }}]\n[[tenant]]\nname = \"b\"\n\
             keys = [{{ sha256 = \"{h}\" }}]\n"
        );
        assert!(parse(&dup).unwrap_err().contains("twice"));
    }

    #[test]
    fn slots_are_held_all_or_none_and_let_go_on_drop() {
        let s = Arc::new(Slots::default());
        let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let running: HashSet<Uuid> = [a].into();
        // One running, one free: two more do not fit, and hold nothing.
        assert_eq!(
            s.hold("t", Some(2), running.clone(), &[b, c]).err(),
            Some((1, 2))
        );
        assert!(s.pending("t").is_empty());
        let h = s.hold("t", Some(2), running.clone(), &[b]).unwrap();
        assert!(s.hold("t", Some(2), running.clone(), &[c]).is_err());
        // A sandbox already running (or held) needs no second slot.
        let again = s.hold("t", Some(2), running.clone(), &[a, b]).unwrap();
        // Other tenants are not counted.
        let _other = s.hold("u", Some(1), HashSet::new(), &[c]).unwrap();
        drop(h);
        assert!(s.pending("t").contains(&b), "still held by the second");
        drop(again);
        assert!(s.pending("t").is_empty());
        let _c = s.hold("t", Some(2), running, &[c]).unwrap();
        // No limit: anything fits.
        let _n = s.hold("v", None, HashSet::new(), &[a, b, c]).unwrap();
    }
}
