//! The snapshot store's mirror: an S3-compatible object store that every
//! user snapshot and checkpoint (and each snapshot its chain builds on) is
//! copied to once it is durable on local disk (docs/api.md, "The snapshot
//! store").
//!
//! A snapshot is uploaded as the objects `<tenant>/<vm>/<snapshot>/<file>`
//! (each file of its directory but the local seal), then
//! `<tenant>/<vm>/<snapshot>/complete.json`, which lists them: a snapshot
//! is in the store when that object is. The registry records the upload
//! (`uploaded_ms`), and the API calls such a snapshot `durable`. An upload
//! that fails is logged and retried with backoff; it never fails the
//! snapshot. A restore whose snapshot's local copy is gone downloads it
//! (its ancestors first), verifies it whole, and only then uses it.
//! Snapshots are deleted from the store when their local files are.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use object_store::path::Path as Key;
use object_store::{ObjectStore, ObjectStoreExt as _, PutPayload, WriteMultipart};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::error::chain;
use super::registry::{Runtime, Sandbox, SnapshotKind, SnapshotRow, State};
use super::{now_ms, App};

/// Bytes read and sent at a time (and the multipart part size).
const CHUNK: usize = 8 << 20;
/// The object that completes a snapshot's upload.
const COMPLETE: &str = "complete.json";
/// Longest wait between two upload attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Most files a snapshot in the store may list (a download trusts nothing
/// it reads).
const MAX_FILES: usize = 64;
/// Longest one request to the store may take, its body included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(1800);
/// Largest `complete.json` read.
const MAX_COMPLETE: u64 = 64 << 10;

#[derive(Clone, Debug, Default, clap::Args)]
pub struct StoreArgs {
    /// The S3-compatible object store to mirror snapshots to: its endpoint
    /// URL (e.g. http://127.0.0.1:9000). Credentials come from
    /// AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY.
    #[arg(long, requires = "s3_bucket", value_name = "URL")]
    pub s3_endpoint: Option<String>,
    /// The bucket (it must exist).
    #[arg(long, requires = "s3_endpoint")]
    pub s3_bucket: Option<String>,
    /// The region the store is asked for.
    #[arg(long, default_value = "us-east-1")]
    pub s3_region: String,
    /// User snapshots kept per sandbox: older ones are deleted after each
    /// snapshot, unless a checkpoint, a template or a sandbox builds on
    /// them (0: no limit).
    #[arg(long, default_value_t = 3)]
    pub keep_snapshots: u32,
    /// User snapshots older than this many days are deleted after each
    /// snapshot, on the same terms (0: no limit).
    #[arg(long, default_value_t = 7)]
    pub keep_days: u32,
}

/// What `complete.json` says.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Complete {
    snapshot: Uuid,
    files: Vec<Entry>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    name: String,
    /// The file's length (holes included).
    size: u64,
    /// Its object's bytes: see [`pack_header`].
    stored: u64,
}

/// How each file's object begins: `PACK_MAGIC`, the file's length and the
/// number of its data extents (u64 little-endian each), then each extent's
/// offset and length, then the extents' bytes in order. A sparse file (a
/// memory layer is its RAM's size, its zero pages holes) costs what it
/// holds, and comes back as sparse.
const PACK_MAGIC: &[u8; 8] = b"SPRXPAK1";
/// A download's extents, the one being written, and how much of it is.
type Plan = (Vec<(u64, u64)>, usize, u64);

/// Most extents one file's object may list.
const MAX_EXTENTS: u64 = 1 << 21;

/// The data extents of `f` (`(offset, length)`, in order), by SEEK_DATA and
/// SEEK_HOLE.
fn extents(f: &std::fs::File, len: u64) -> std::io::Result<Vec<(u64, u64)>> {
    use rustix::fs::{seek, SeekFrom};
    let mut out = Vec::new();
    let mut off = 0;
    while off < len {
        let data = match seek(f, SeekFrom::Data(off)) {
            Ok(d) => d,
            Err(rustix::io::Errno::NXIO) => break,
            Err(e) => return Err(e.into()),
        };
        if data >= len {
            break;
        }
        let hole = seek(f, SeekFrom::Hole(data))?.min(len);
        out.push((data, hole - data));
        off = hole;
    }
    Ok(out)
}

fn pack_header(len: u64, ext: &[(u64, u64)]) -> Vec<u8> {
    let mut h = Vec::with_capacity(24 + 16 * ext.len());
    h.extend_from_slice(PACK_MAGIC);
    h.extend_from_slice(&len.to_le_bytes());
    h.extend_from_slice(&(ext.len() as u64).to_le_bytes());
    for (o, l) in ext {
        h.extend_from_slice(&o.to_le_bytes());
        h.extend_from_slice(&l.to_le_bytes());
    }
    h
}

/// Parses a pack header from the start of `b`: the extents and the
/// header's length, `None` if `b` is too short yet, or why it is bad.
type Extents = (Vec<(u64, u64)>, usize);

fn parse_pack_header(b: &[u8], size: u64) -> Result<Option<Extents>, String> {
    let u = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]));
    if b.len() < 24 {
        return Ok(None);
    }
    if &b[..8] != PACK_MAGIC {
        return Err("it is not a packed file".into());
    }
    if u(8) != size {
        return Err(format!("it says {} bytes, its entry {size}", u(8)));
    }
    let n = u(16);
    if n > MAX_EXTENTS {
        return Err(format!("it lists {n} extents, over {MAX_EXTENTS}"));
    }
    let end = 24 + 16 * n as usize;
    if b.len() < end {
        return Ok(None);
    }
    let mut ext = Vec::with_capacity(n as usize);
    let mut at = 0u64;
    for i in 0..n as usize {
        let (o, l) = (u(24 + 16 * i), u(32 + 16 * i));
        if o < at || l == 0 || o.checked_add(l).is_none_or(|e| e > size) {
            return Err(format!(
                "its extent {i} ({o}, {l}) is out of order or range"
            ));
        }
        at = o + l;
        ext.push((o, l));
    }
    Ok(Some((ext, end)))
}

/// An archived sandbox, as `<tenant>/<vm>/archive.json` holds it: what
/// another node needs to record it and restore it (its snapshots' objects
/// are beside their own keys).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ArchiveRecord {
    version: u32,
    sandbox: SandboxRecord,
    /// Its rest snapshot's chain, base first.
    chain: Vec<SnapRecord>,
    /// The node bringing it back (or deleting it), if one is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    claim: Option<Claim>,
}

/// A node's claim on an archived sandbox: written into its record with the
/// record's version as the precondition (`If-Match`), so of two nodes that
/// read the same record, one claim lands and the other is refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Claim {
    /// The claiming node's id (`<data dir>/node-id`).
    pub node: String,
    /// This claim's own id: one node may try twice at once.
    pub token: Uuid,
    /// When it was made or last renewed, in ms since the epoch (the
    /// claimer renews it every third of [`CLAIM_TTL`] while it restores).
    pub at_ms: u64,
    /// The claimer restored the sandbox and runs it: the record is about to
    /// go, and no other node may ever take it over.
    #[serde(default)]
    pub taken: bool,
}

/// A claim not renewed for this long is a node that died mid-unarchive:
/// another node may take the sandbox over.
pub const CLAIM_TTL: Duration = Duration::from_secs(15 * 60);

/// An archive record as read from the store (or as this node last wrote
/// it), with the version a change to it must match.
#[derive(Debug)]
pub struct Held {
    pub rec: ArchiveRecord,
    version: object_store::UpdateVersion,
}

impl ArchiveRecord {
    /// Its rest snapshot.
    pub fn rest_snapshot_id(&self) -> Uuid {
        self.sandbox.rest_snapshot_id
    }

    /// A claim on it that keeps this node out: another's (not `mine`) that
    /// is taken, or renewed within [`CLAIM_TTL`].
    pub fn live_claim(&self, mine: Option<Uuid>) -> Option<&Claim> {
        self.claim.as_ref().filter(|c| {
            Some(c.token) != mine
                && (c.taken || now_ms().saturating_sub(c.at_ms) < CLAIM_TTL.as_millis() as u64)
        })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct SandboxRecord {
    id: Uuid,
    tenant: String,
    image: String,
    /// Absent for `container` (as in records from before runtimes).
    #[serde(default, skip_serializing_if = "is_container")]
    runtime: Runtime,
    cpus: u8,
    memory_mb: u32,
    disable_internet: bool,
    idle_timeout_secs: Option<u32>,
    env: BTreeMap<String, String>,
    metadata: BTreeMap<String, String>,
    created_ms: u64,
    parent_vm_id: Option<Uuid>,
    snapshot_id: Option<Uuid>,
    hostname: Option<String>,
    rest_snapshot_id: Uuid,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct SnapRecord {
    id: Uuid,
    tenant: String,
    vm_id: Option<Uuid>,
    name: Option<String>,
    kind: SnapshotKind,
    parent_id: Option<Uuid>,
    depth: u32,
    image: String,
    #[serde(default, skip_serializing_if = "is_container")]
    runtime: Runtime,
    cpus: u8,
    memory_mb: u32,
    env: BTreeMap<String, String>,
    size_bytes: u64,
    created_ms: u64,
}

fn is_container(r: &Runtime) -> bool {
    *r == Runtime::Container
}

const ARCHIVE_VERSION: u32 = 1;
/// Largest archive record read.
const MAX_RECORD: usize = 4 << 20;

impl ArchiveRecord {
    /// The record of archived sandbox `s`, whose rest snapshot's chain is
    /// `chain` (base first).
    pub fn of(s: &Sandbox, chain: &[SnapshotRow]) -> Option<ArchiveRecord> {
        Some(ArchiveRecord {
            version: ARCHIVE_VERSION,
            sandbox: SandboxRecord {
                id: s.id,
                tenant: s.tenant.clone(),
                image: s.image.clone(),
                runtime: s.runtime,
                cpus: s.cpus,
                memory_mb: s.memory_mb,
                disable_internet: s.disable_internet,
                idle_timeout_secs: s.idle_timeout_secs,
                env: s.env.clone(),
                metadata: s.metadata.clone(),
                created_ms: s.created_ms,
                parent_vm_id: s.parent_vm_id,
                snapshot_id: s.snapshot_id,
                hostname: s.hostname.clone(),
                rest_snapshot_id: s.rest_snapshot_id?,
            },
            chain: chain
                .iter()
                .map(|c| SnapRecord {
                    id: c.id,
                    tenant: c.tenant.clone(),
                    vm_id: c.vm_id,
                    name: c.name.clone(),
                    kind: c.kind,
                    parent_id: c.parent_id,
                    depth: c.depth,
                    image: c.image.clone(),
                    runtime: c.runtime,
                    cpus: c.cpus,
                    memory_mb: c.memory_mb,
                    env: c.env.clone(),
                    size_bytes: c.size_bytes,
                    created_ms: c.created_ms,
                })
                .collect(),
            claim: None,
        })
    }

    /// The sandbox (archived) and its chain's rows, as this node records
    /// them: each snapshot in `<snapshots>/<tenant>/<sandbox>/<id>/s`. None if the record does
    /// not hold together (its chain does not end in its rest snapshot, a
    /// parent is not the one before, a shape is out of range).
    pub fn rows(&self, snapshots: &Path) -> Option<(Sandbox, Vec<SnapshotRow>)> {
        let r = &self.sandbox;
        let ok = self.version == ARCHIVE_VERSION
            && !self.chain.is_empty()
            && self.chain.len() <= vmm::MAX_CHAIN_DEPTH + 1
            && self.chain.last().map(|c| c.id) == Some(r.rest_snapshot_id)
            && self.chain[0].parent_id.is_none()
            && self
                .chain
                .windows(2)
                .all(|w| w[1].parent_id == Some(w[0].id))
            && (1..=4).contains(&r.cpus)
            && (128..=8192).contains(&r.memory_mb)
            // Each snapshot the sandbox's tenant's, or sproutd's own (a
            // template's).
            && self
                .chain
                .iter()
                .all(|c| c.tenant == r.tenant || (c.tenant.is_empty() && c.vm_id.is_none()));
        if !ok {
            return None;
        }
        let now = now_ms();
        let chain = self
            .chain
            .iter()
            .enumerate()
            .map(|(i, c)| SnapshotRow {
                id: c.id,
                tenant: c.tenant.clone(),
                vm_id: c.vm_id,
                name: c.name.clone(),
                dir: super::store::snapshot_home(snapshots, &c.tenant, c.vm_id, c.id)
                    .join(super::store::SNAPSHOT_SUBDIR),
                // Here, only the sandbox's chain: its rest snapshot, and what
                // it builds on (not listed, not a template or checkpoint of
                // this node's).
                kind: if i + 1 == self.chain.len() {
                    SnapshotKind::Rest
                } else {
                    SnapshotKind::Dropped
                },
                parent_id: c.parent_id,
                depth: i as u32 + 1,
                image: c.image.clone(),
                runtime: c.runtime,
                cpus: c.cpus,
                memory_mb: c.memory_mb,
                env: c.env.clone(),
                size_bytes: c.size_bytes,
                created_ms: c.created_ms,
                uploaded_ms: Some(now),
                imported: true,
            })
            .collect();
        let s = Sandbox {
            state: State::Archived,
            runtime: r.runtime,
            disable_internet: r.disable_internet,
            idle_timeout_secs: r.idle_timeout_secs,
            env: r.env.clone(),
            metadata: r.metadata.clone(),
            parent_vm_id: r.parent_vm_id,
            snapshot_id: r.snapshot_id,
            rest_snapshot_id: Some(r.rest_snapshot_id),
            hostname: r.hostname.clone(),
            ..Sandbox::starting(r.id, &r.tenant, &r.image, r.cpus, r.memory_mb, r.created_ms)
        };
        Some((s, chain))
    }
}

/// One lock per snapshot being downloaded.
#[derive(Default)]
pub struct Downloads {
    gates: std::sync::Mutex<std::collections::HashMap<Uuid, Arc<tokio::sync::Mutex<()>>>>,
}

impl Downloads {
    fn gate(&self, id: Uuid) -> Arc<tokio::sync::Mutex<()>> {
        let mut g = super::lock(&self.gates);
        // Gates nobody holds or waits on go (a few at a time stay).
        g.retain(|_, m| Arc::strong_count(m) > 1);
        g.entry(id).or_default().clone()
    }
}

/// The mirror, when one is configured.
pub struct Mirror {
    store: Arc<dyn ObjectStore>,
    /// This node's id, in its claims on archived sandboxes.
    node: String,
    /// Where it is, for logs.
    pub url: String,
    wake: tokio::sync::Notify,
}

/// This node's id: made once, kept in `<data dir>/node-id`.
fn node_id(data_dir: &Path) -> Result<String, String> {
    let f = data_dir.join("node-id");
    match std::fs::read_to_string(&f) {
        Ok(s) if Uuid::parse_str(s.trim()).is_ok() => return Ok(s.trim().to_owned()),
        Ok(_) => tracing::warn!("{} is not a node id: making a new one", f.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("Cannot read {}: {e}", f.display())),
    }
    let id = Uuid::new_v4().to_string();
    let tmp = f.with_extension("tmp");
    std::fs::write(&tmp, format!("{id}\n"))
        .and_then(|()| std::fs::rename(&tmp, &f))
        .map_err(|e| format!("Cannot write {}: {e}", f.display()))?;
    Ok(id)
}

impl Mirror {
    /// The mirror `args` configure (none without `--s3-endpoint`), for the
    /// node whose data dir is `data_dir`.
    pub fn new(args: &StoreArgs, data_dir: &Path) -> Result<Option<Mirror>, String> {
        let (Some(endpoint), Some(bucket)) = (&args.s3_endpoint, &args.s3_bucket) else {
            return Ok(None);
        };
        let id = std::env::var("AWS_ACCESS_KEY_ID").unwrap_or_default();
        let secret = std::env::var("AWS_SECRET_ACCESS_KEY").unwrap_or_default();
        if id.is_empty() || secret.is_empty() {
            return Err(
                "--s3-endpoint needs credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
                    .into(),
            );
        }
        let plain = endpoint.starts_with("http://");
        let store = object_store::aws::AmazonS3Builder::new()
            .with_endpoint(endpoint)
            .with_bucket_name(bucket)
            .with_region(&args.s3_region)
            .with_access_key_id(id)
            .with_secret_access_key(secret)
            .with_virtual_hosted_style_request(false)
            // A store that is down is retried by the uploader, at its pace.
            .with_retry(object_store::RetryConfig {
                max_retries: 2,
                retry_timeout: Duration::from_secs(20),
                ..Default::default()
            })
            // A request's whole time, body included: a part is 8 MiB, but
            // a download is one object (a memory layer can be GiBs).
            .with_client_options(
                object_store::ClientOptions::new()
                    .with_allow_http(plain)
                    // Plain http needs no CA roots (the lab has none).
                    .with_no_system_certificates(plain)
                    .with_connect_timeout(Duration::from_secs(10))
                    .with_read_timeout(Duration::from_secs(60))
                    .with_timeout(REQUEST_TIMEOUT),
            )
            .build()
            .map_err(|e| format!("Bad object store settings: {}", chain(&e)))?;
        Ok(Some(Mirror {
            store: Arc::new(store),
            node: node_id(data_dir)?,
            url: format!("{endpoint}/{bucket}"),
            wake: tokio::sync::Notify::new(),
        }))
    }

    /// The key prefix of `row`'s objects.
    fn prefix(row: &SnapshotRow) -> String {
        let (tenant, vm) = super::store::owner_parts(&row.tenant, row.vm_id);
        format!("{tenant}/{vm}/{}", row.id)
    }

    /// Uploads the snapshot in `row.dir`; its bytes.
    async fn upload(&self, row: &SnapshotRow) -> Result<u64, String> {
        let prefix = Self::prefix(row);
        let mut names = Vec::new();
        let rd = std::fs::read_dir(&row.dir)
            .map_err(|e| format!("Cannot read {}: {e}", row.dir.display()))?;
        for e in rd {
            let e = e.map_err(|e| format!("Cannot read {}: {e}", row.dir.display()))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let meta = e.metadata().map_err(|e| format!("{name}: {e}"))?;
            // Only the snapshot's own files (not the local seal, nothing
            // hidden): what a download accepts.
            if name.starts_with('.') || !meta.is_file() {
                continue;
            }
            names.push(name);
        }
        names.sort();
        let mut files = Vec::new();
        let mut total = 0;
        for name in names {
            let key = Key::from(format!("{prefix}/{name}"));
            let (size, stored) = self.put_file(&row.dir.join(&name), &key).await?;
            total += stored;
            files.push(Entry { name, size, stored });
        }
        let complete = Complete {
            snapshot: row.id,
            files,
        };
        let body = serde_json::to_vec(&complete).map_err(|e| e.to_string())?;
        self.store
            .put(&Key::from(format!("{prefix}/{COMPLETE}")), body.into())
            .await
            .map_err(|e| format!("Cannot upload {prefix}/{COMPLETE}: {}", chain(&e)))?;
        Ok(total)
    }

    /// Sends one file packed (its data extents only; in parts when
    /// large); its length and its object's bytes.
    async fn put_file(&self, path: &Path, key: &Key) -> Result<(u64, u64), String> {
        use tokio::io::{AsyncReadExt as _, AsyncSeekExt as _};
        let err = |e: &dyn std::error::Error| format!("Cannot upload {key}: {}", chain(e));
        let rerr = |e: std::io::Error| format!("Cannot read {}: {e}", path.display());
        let std_file = std::fs::File::open(path).map_err(rerr)?;
        let len = std_file.metadata().map_err(rerr)?.len();
        let (std_file, ext) = tokio::task::spawn_blocking(move || {
            let e = extents(&std_file, len);
            (std_file, e)
        })
        .await
        .map_err(|e| e.to_string())?;
        let ext = ext.map_err(rerr)?;
        let header = pack_header(len, &ext);
        let data: u64 = ext.iter().map(|(_, l)| l).sum();
        let stored = header.len() as u64 + data;
        let mut f = tokio::fs::File::from_std(std_file);
        if stored <= CHUNK as u64 {
            let mut buf = header;
            for (o, l) in &ext {
                f.seek(std::io::SeekFrom::Start(*o)).await.map_err(rerr)?;
                let at = buf.len();
                buf.resize(at + *l as usize, 0);
                f.read_exact(&mut buf[at..]).await.map_err(rerr)?;
            }
            self.store
                .put(key, PutPayload::from(buf))
                .await
                .map_err(|e| err(&e))?;
            return Ok((len, stored));
        }
        let up = self.store.put_multipart(key).await.map_err(|e| err(&e))?;
        let mut w = WriteMultipart::new_with_chunk_size(up, CHUNK);
        w.write(&header);
        let mut buf = vec![0u8; CHUNK];
        for (o, l) in &ext {
            let read = async {
                f.seek(std::io::SeekFrom::Start(*o)).await?;
                Ok::<_, std::io::Error>(())
            };
            if let Err(e) = read.await {
                let _ = w.abort().await;
                return Err(rerr(e));
            }
            let mut left = *l;
            while left > 0 {
                let n = left.min(CHUNK as u64) as usize;
                if let Err(e) = f.read_exact(&mut buf[..n]).await {
                    let _ = w.abort().await;
                    return Err(rerr(e));
                }
                if let Err(e) = w.wait_for_capacity(4).await {
                    let _ = w.abort().await;
                    return Err(err(&e));
                }
                w.write(&buf[..n]);
                left -= n as u64;
            }
        }
        w.finish().await.map_err(|e| err(&e))?;
        Ok((len, stored))
    }

    /// Downloads `row`'s snapshot into `tmp` (made here, beside its
    /// directory); its bytes.
    async fn download(&self, row: &SnapshotRow, tmp: &Path) -> Result<u64, String> {
        use tokio::io::{AsyncSeekExt as _, AsyncWriteExt as _};
        let prefix = Self::prefix(row);
        let got = self
            .store
            .get(&Key::from(format!("{prefix}/{COMPLETE}")))
            .await
            .map_err(|e| format!("{prefix} is not in the object store: {}", chain(&e)))?;
        if got.meta.size > MAX_COMPLETE {
            return Err(format!("{prefix}/{COMPLETE} is over {MAX_COMPLETE} bytes"));
        }
        let bytes = got
            .bytes()
            .await
            .map_err(|e| format!("Cannot read {prefix}/{COMPLETE}: {}", chain(&e)))?;
        let complete: Complete = serde_json::from_slice(&bytes)
            .map_err(|e| format!("{prefix}/{COMPLETE} is not valid: {e}"))?;
        if complete.snapshot != row.id || complete.files.len() > MAX_FILES {
            return Err(format!("{prefix}/{COMPLETE} is not this snapshot's"));
        }
        std::fs::create_dir(tmp).map_err(|e| format!("Cannot create {}: {e}", tmp.display()))?;
        let mut total = 0u64;
        for f in &complete.files {
            let plain = !f.name.is_empty()
                && !f.name.starts_with('.')
                && !f.name.contains('/')
                && f.name != COMPLETE;
            if !plain {
                return Err(format!("{prefix}/{COMPLETE} names a bad file {:?}", f.name));
            }
            let key = Key::from(format!("{prefix}/{}", f.name));
            let path = tmp.join(&f.name);
            let werr = |e: std::io::Error| format!("Cannot write {}: {e}", path.display());
            let out = tokio::fs::File::create(&path).await.map_err(werr)?;
            // Holes stay holes: only the extents are written.
            out.set_len(f.size).await.map_err(werr)?;
            let mut out = out;
            let mut s = self
                .store
                .get(&key)
                .await
                .map_err(|e| format!("Cannot download {key}: {}", chain(&e)))?
                .into_stream();
            let mut got = 0u64;
            let mut head: Vec<u8> = Vec::new();
            // Once the header is read: the extents, the one being written,
            // and how much of it is.
            let mut plan: Option<Plan> = None;
            while let Some(chunk) = s.next().await {
                let chunk = chunk.map_err(|e| format!("Cannot download {key}: {}", chain(&e)))?;
                got += chunk.len() as u64;
                if got > f.stored {
                    return Err(format!("{key} is longer than its {} bytes", f.stored));
                }
                let mut rest: &[u8] = &chunk;
                if plan.is_none() {
                    head.extend_from_slice(rest);
                    match parse_pack_header(&head, f.size).map_err(|e| format!("{key}: {e}"))? {
                        None => continue,
                        Some((ext, end)) => {
                            let data: u64 = ext.iter().map(|(_, l)| l).sum();
                            if end as u64 + data != f.stored {
                                return Err(format!("{key}: its extents do not fill it"));
                            }
                            let tail = head.split_off(end);
                            plan = Some((ext, 0, 0));
                            head = tail;
                            rest = &head;
                        }
                    }
                }
                let Some((ext, i, done)) = plan.as_mut() else {
                    continue;
                };
                let mut rest = rest.to_vec();
                while !rest.is_empty() {
                    let Some(&(o, l)) = ext.get(*i) else {
                        return Err(format!("{key}: more bytes than its extents"));
                    };
                    let n = (l - *done).min(rest.len() as u64) as usize;
                    out.seek(std::io::SeekFrom::Start(o + *done))
                        .await
                        .map_err(werr)?;
                    out.write_all(&rest[..n]).await.map_err(werr)?;
                    *done += n as u64;
                    if *done == l {
                        *i += 1;
                        *done = 0;
                    }
                    rest.drain(..n);
                }
                head.clear();
            }
            if got != f.stored || plan.as_ref().is_none_or(|(e, i, _)| *i != e.len()) {
                return Err(format!("{key} is {got} bytes, not {}", f.stored));
            }
            out.sync_all().await.map_err(werr)?;
            total += got;
        }
        Ok(total)
    }

    fn archive_key(tenant: &str, vm: Uuid) -> Key {
        Key::from(format!("{tenant}/{vm}/archive.json"))
    }

    /// Writes the archive record of a sandbox.
    pub async fn put_archive(&self, rec: &ArchiveRecord) -> Result<(), String> {
        let body = serde_json::to_vec(rec).map_err(|e| e.to_string())?;
        let key = Self::archive_key(&rec.sandbox.tenant, rec.sandbox.id);
        self.store
            .put(&key, body.into())
            .await
            .map(|_| ())
            .map_err(|e| format!("Cannot upload {key}: {}", chain(&e)))
    }

    /// The archive record of `tenant`'s sandbox `vm`, if the store has one.
    pub async fn get_archive(&self, tenant: &str, vm: Uuid) -> Result<Option<Held>, String> {
        let key = Self::archive_key(tenant, vm);
        let got = match self.store.get(&key).await {
            Ok(g) => g,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(format!("Cannot read {key}: {}", chain(&e))),
        };
        if got.meta.size > MAX_RECORD as u64 {
            return Err(format!("{key} is over {MAX_RECORD} bytes"));
        }
        let version = object_store::UpdateVersion {
            e_tag: got.meta.e_tag.clone(),
            version: got.meta.version.clone(),
        };
        if version.e_tag.is_none() {
            return Err(format!(
                "{key} has no ETag: the object store cannot arbitrate between two nodes"
            ));
        }
        let bytes = got
            .bytes()
            .await
            .map_err(|e| format!("Cannot read {key}: {}", chain(&e)))?;
        let rec: ArchiveRecord =
            serde_json::from_slice(&bytes).map_err(|e| format!("{key} is not valid: {e}"))?;
        if rec.sandbox.id != vm || rec.sandbox.tenant != tenant {
            return Err(format!("{key} is another sandbox's"));
        }
        Ok(Some(Held { rec, version }))
    }

    /// Claims the archived sandbox of `held` for this node: its record
    /// rewritten with a new claim of this node's, on the condition that it
    /// is still the version read. `Ok(None)` if it is not (another node
    /// changed or removed it since).
    pub async fn claim_archive(&self, held: Held) -> Result<Option<Held>, String> {
        let mut rec = held.rec;
        rec.claim = Some(Claim {
            node: self.node.clone(),
            token: Uuid::new_v4(),
            at_ms: now_ms(),
            taken: false,
        });
        self.put_if(rec, held.version).await
    }

    /// Renews this node's claim in `held` (its time now).
    pub async fn renew_archive(&self, held: &Held) -> Result<Option<Held>, String> {
        let mut rec = held.rec.clone();
        if let Some(c) = rec.claim.as_mut() {
            c.at_ms = now_ms();
        }
        self.put_if(rec, held.version.clone()).await
    }

    /// Marks this node's claim in `held` taken: it runs the sandbox. `None`
    /// if the claim was lost meanwhile (then this node must not run it).
    pub async fn commit_archive(&self, held: &Held) -> Result<Option<Held>, String> {
        let mut rec = held.rec.clone();
        if let Some(c) = rec.claim.as_mut() {
            c.taken = true;
            c.at_ms = now_ms();
        }
        self.put_if(rec, held.version.clone()).await
    }

    /// Puts back the record of `held` (claimed by this node) unclaimed,
    /// for a later unarchive here or elsewhere.
    pub async fn release_archive(&self, held: Held) -> Result<(), String> {
        let mut rec = held.rec;
        rec.claim = None;
        match self.put_if(rec, held.version).await? {
            Some(_) => Ok(()),
            None => Err("its record changed meanwhile".into()),
        }
    }

    /// Writes `rec` if the record is still `version`. A refusal is checked
    /// against what the store holds: if that is `rec`'s own claim (a retry
    /// of a write that landed, whose answer was lost), it stands.
    async fn put_if(
        &self,
        rec: ArchiveRecord,
        version: object_store::UpdateVersion,
    ) -> Result<Option<Held>, String> {
        let body = serde_json::to_vec(&rec).map_err(|e| e.to_string())?;
        let key = Self::archive_key(&rec.sandbox.tenant, rec.sandbox.id);
        let opts = object_store::PutOptions::from(object_store::PutMode::Update(version));
        match self.store.put_opts(&key, body.into(), opts).await {
            Ok(r) => Ok(Some(Held {
                rec,
                version: object_store::UpdateVersion {
                    e_tag: r.e_tag,
                    version: r.version,
                },
            })),
            Err(
                object_store::Error::Precondition { .. } | object_store::Error::NotFound { .. },
            ) => {
                let now = self
                    .get_archive(&rec.sandbox.tenant, rec.sandbox.id)
                    .await?;
                Ok(now.filter(|h| h.rec.claim.is_some() && h.rec.claim == rec.claim))
            }
            Err(e) => Err(format!("Cannot update {key}: {}", chain(&e))),
        }
    }

    /// This node's id in claims.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Deletes the archive record of `tenant`'s sandbox `vm`.
    pub async fn delete_archive(&self, tenant: &str, vm: Uuid) -> Result<(), String> {
        let key = Self::archive_key(tenant, vm);
        match self.store.delete(&key).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(format!("Cannot delete {key}: {}", chain(&e))),
        }
    }

    /// Deletes `row`'s objects (best effort: what is left is logged).
    async fn remove(&self, row: &SnapshotRow) {
        let prefix = Key::from(Self::prefix(row));
        // The completion first: what is left is no snapshot.
        let done = Key::from(format!("{prefix}/{COMPLETE}"));
        if let Err(e) = self.store.delete(&done).await {
            tracing::warn!(snapshot = %row.id, "cannot delete it from the object store: {}", chain(&e));
            return;
        }
        let mut list = self.store.list(Some(&prefix));
        while let Some(o) = list.next().await {
            match o {
                Ok(o) => {
                    if let Err(e) = self.store.delete(&o.location).await {
                        tracing::warn!(
                            "cannot delete {} from the object store: {}",
                            o.location,
                            chain(&e)
                        );
                    }
                }
                Err(e) => {
                    tracing::warn!(snapshot = %row.id, "cannot list it in the object store: {}", chain(&e));
                    break;
                }
            }
        }
    }
}

impl App {
    /// Starts the uploader (with a mirror): it uploads every user snapshot
    /// and checkpoint not yet in the store, each after the snapshots its
    /// chain builds on, whenever one is taken and at least once a minute,
    /// retrying a failure with backoff.
    pub fn start_uploader(self: &Arc<Self>) {
        if self.mirror.is_none() {
            return;
        }
        let app = self.clone();
        tokio::spawn(async move {
            let mut backoff = Duration::from_secs(1);
            loop {
                let Some(m) = app.mirror.as_ref() else { return };
                match app.upload_pending(m).await {
                    Ok(()) => {
                        backoff = Duration::from_secs(1);
                        let _ =
                            tokio::time::timeout(Duration::from_secs(60), m.wake.notified()).await;
                    }
                    Err(e) => {
                        tracing::warn!(
                            "uploading snapshots to {}: {e}; retrying in {} s",
                            m.url,
                            backoff.as_secs()
                        );
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                    }
                }
            }
        });
    }

    /// Tells the uploader that a snapshot was taken.
    pub fn snapshot_taken(&self) {
        if let Some(m) = &self.mirror {
            m.wake.notify_one();
        }
    }

    async fn upload_pending(self: &Arc<Self>, m: &Mirror) -> Result<(), String> {
        let all = self
            .db(|r| r.list_snapshots())
            .await
            .map_err(|e| e.message)?;
        let by_id: std::collections::HashMap<Uuid, &SnapshotRow> =
            all.iter().map(|s| (s.id, s)).collect();
        let mut failed = None;
        for s in all
            .iter()
            .filter(|s| matches!(s.kind, SnapshotKind::User | SnapshotKind::Checkpoint))
            .filter(|s| s.uploaded_ms.is_none())
        {
            // Its chain, base first: what it builds on goes up before it.
            let mut chain: Vec<&SnapshotRow> = vec![s];
            while let Some(p) = chain.last().and_then(|c| c.parent_id) {
                match by_id.get(&p) {
                    Some(p) if chain.len() <= vmm::MAX_CHAIN_DEPTH + 1 => chain.push(*p),
                    _ => break,
                }
            }
            let ids: Vec<Uuid> = chain
                .into_iter()
                .rev()
                .filter(|r| r.uploaded_ms.is_none())
                .map(|r| r.id)
                .collect();
            // One that fails does not hold back the others.
            if let Err(e) = self.upload_rows(m, ids).await {
                failed.get_or_insert(e);
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Uploads the snapshots `ids` (base first) that are not in the store.
    async fn upload_rows(self: &Arc<Self>, m: &Mirror, ids: Vec<Uuid>) -> Result<(), String> {
        for id in ids {
            let t = std::time::Instant::now();
            // Taken again now: a delete may have removed it, or another
            // upload done it, meanwhile.
            let Some(row) = self
                .db(move |r| r.get_snapshot(id))
                .await
                .map_err(|e| e.message)?
            else {
                continue;
            };
            if row.uploaded_ms.is_some() {
                continue;
            }
            let bytes = m.upload(&row).await?;
            self.db(move |r| r.set_uploaded(id, now_ms()))
                .await
                .map_err(|e| e.message)?;
            tracing::info!(
                snapshot = %id, bytes,
                "uploaded to the object store in {} ms", t.elapsed().as_millis()
            );
        }
        Ok(())
    }

    /// The rows of `snap`'s chain, base first.
    pub async fn chain_rows(self: &Arc<Self>, snap: Uuid) -> Result<Vec<SnapshotRow>, String> {
        self.db(move |r| {
            let mut out = Vec::new();
            let mut next = Some(snap);
            while let Some(id) = next {
                let Some(s) = r.get_snapshot(id)? else { break };
                next = s.parent_id;
                out.push(s);
                if out.len() > vmm::MAX_CHAIN_DEPTH + 1 {
                    break;
                }
            }
            out.reverse();
            Ok(out)
        })
        .await
        .map_err(|e| e.message)
    }

    /// Uploads `snap`'s chain now (what is not in the store yet), base
    /// first: for an archive, which answers once it is durable.
    pub async fn upload_chain(self: &Arc<Self>, m: &Mirror, snap: Uuid) -> Result<(), String> {
        let ids = self.chain_rows(snap).await?.iter().map(|r| r.id).collect();
        self.upload_rows(m, ids).await
    }

    /// Makes every snapshot of `snap`'s chain local: one whose directory
    /// is gone is downloaded from the mirror and verified whole (and
    /// sealed) before it is used. The chain's directories, base first.
    pub async fn ensure_local(self: &Arc<Self>, snap: Uuid) -> Result<Vec<PathBuf>, String> {
        let rows = self.chain_rows(snap).await?;
        let dirs = rows.iter().map(|r| r.dir.clone()).collect();
        let mut parent: Option<PathBuf> = None;
        for row in rows {
            let here = parent.replace(row.dir.clone());
            let present = |r: &SnapshotRow| {
                r.dir
                    .join(snapshot::format::MANIFEST_FILE)
                    .symlink_metadata()
                    .is_ok()
            };
            if present(&row) {
                continue;
            }
            let (Some(m), Some(_)) = (&self.mirror, row.uploaded_ms) else {
                return Err(format!(
                    "Snapshot {}'s files are gone from {} and it is not in an object store",
                    row.id,
                    row.dir.display()
                ));
            };
            // One download of a snapshot at a time; whoever waited finds
            // it here.
            let gate = self.downloads.gate(row.id);
            let _turn = gate.lock().await;
            if present(&row) {
                continue;
            }
            let base = row
                .dir
                .parent()
                .ok_or_else(|| format!("{} has no parent", row.dir.display()))?
                .to_path_buf();
            super::store::make_home(&base)?;
            let tmp = base.join(format!(".download-{}", Uuid::new_v4().simple()));
            let t = std::time::Instant::now();
            let fetched = m.download(&row, &tmp).await;
            let (dir, tmp2) = (row.dir.clone(), tmp.clone());
            let placed = tokio::task::spawn_blocking(move || {
                let bytes = fetched?;
                // Verified where it was downloaded, and only then put in
                // place. Copied from another node, its parent is here now
                // (a link the load checks by the parent's id).
                let check = || -> Result<(), String> {
                    if let Some(p) = &here {
                        snapshot::format::relink_parent(&tmp2, p).map_err(|e| chain(&e))?;
                    }
                    snapshot::format::Snapshot::load(&tmp2)
                        .map(|_| ())
                        .map_err(|e| format!("it does not verify: {}", chain(&e)))
                };
                check()?;
                // A partial directory a crash left is not a snapshot.
                let _ = std::fs::remove_dir_all(&dir);
                std::fs::rename(&tmp2, &dir)
                    .map_err(|e| format!("Cannot move it into {}: {e}", dir.display()))?;
                match snapshot::format::Snapshot::load(&dir) {
                    Ok(s) => {
                        if let Err(e) = snapshot::format::seal::seal(&s) {
                            tracing::warn!("cannot seal {}: {}", dir.display(), chain(&e));
                        }
                    }
                    Err(e) => return Err(format!("it does not verify: {}", chain(&e))),
                }
                Ok::<_, String>(bytes)
            })
            .await
            .map_err(|e| e.to_string())?;
            let tmp3 = tmp.clone();
            let _ = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(tmp3)).await;
            let bytes =
                placed.map_err(|e| format!("Snapshot {} from the object store: {e}", row.id))?;
            tracing::info!(
                snapshot = %row.id, bytes,
                "downloaded from the object store and verified in {} ms",
                t.elapsed().as_millis()
            );
        }
        Ok(dirs)
    }

    /// Deletes from the mirror the snapshots whose local files went.
    pub fn forget_uploaded(self: &Arc<Self>, gone: Vec<SnapshotRow>) {
        if self.mirror.is_none() {
            return;
        }
        // Another node's (imported from its archive) are not this node's
        // to delete: that node, or an archive of it, may need them.
        let gone: Vec<SnapshotRow> = gone
            .into_iter()
            .filter(|s| s.uploaded_ms.is_some() && !s.imported)
            .collect();
        if gone.is_empty() {
            return;
        }
        let app = self.clone();
        tokio::spawn(async move {
            if let Some(m) = &app.mirror {
                for s in &gone {
                    m.remove(s).await;
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt as _;

    #[test]
    fn a_sparse_file_packs_to_its_extents_and_the_header_is_checked() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("mem");
        let f = std::fs::File::create(&p).unwrap();
        let size = 64 << 20;
        f.set_len(size).unwrap();
        f.write_all_at(&[1u8; 4096], 1 << 20).unwrap();
        f.write_all_at(&[2u8; 8192], 40 << 20).unwrap();
        f.sync_all().unwrap();
        let ext = extents(&f, size).unwrap();
        let data: u64 = ext.iter().map(|(_, l)| l).sum();
        assert!(!ext.is_empty() && data < 1 << 20, "{ext:?}");
        assert!(ext
            .iter()
            .any(|(o, l)| *o <= 1 << 20 && o + l >= (1 << 20) + 4096));
        let h = pack_header(size, &ext);
        let (back, end) = parse_pack_header(&h, size).unwrap().unwrap();
        assert_eq!((back, end), (ext.clone(), h.len()));
        // Too short yet, then wrong in each way.
        assert!(parse_pack_header(&h[..10], size).unwrap().is_none());
        assert!(parse_pack_header(&h[..h.len() - 1], size)
            .unwrap()
            .is_none());
        assert!(parse_pack_header(&h, size + 1).is_err());
        let mut bad = h.clone();
        bad[0] ^= 1;
        assert!(parse_pack_header(&bad, size).is_err());
        let beyond = pack_header(size, &[(size - 10, 20)]);
        assert!(parse_pack_header(&beyond, size).is_err());
        let backwards = pack_header(size, &[(8192, 4096), (0, 4096)]);
        assert!(parse_pack_header(&backwards, size).is_err());
        let many = [
            PACK_MAGIC.as_slice(),
            &size.to_le_bytes(),
            &u64::MAX.to_le_bytes(),
        ]
        .concat();
        assert!(parse_pack_header(&many, size).is_err());
    }
}

/// The parsers of what the object store gives back, for the `fuzz/` crate
/// only: not an API.
#[doc(hidden)]
pub mod fuzzing {
    use std::path::Path;

    /// A packed file's header, as a download parses it.
    #[allow(clippy::type_complexity)]
    pub fn pack_header(b: &[u8], size: u64) -> Result<Option<(Vec<(u64, u64)>, usize)>, String> {
        super::parse_pack_header(b, size)
    }

    /// An archive record, as an unarchive reads and imports it: the
    /// number of snapshots it would record, if it holds together.
    pub fn archive_rows(b: &[u8]) -> Option<usize> {
        let rec: super::ArchiveRecord = serde_json::from_slice(b).ok()?;
        let base = Path::new("/snapshots");
        let (s, chain) = rec.rows(base)?;
        assert_eq!(s.rest_snapshot_id, chain.last().map(|c| c.id));
        for (i, c) in chain.iter().enumerate() {
            assert!(c.dir.starts_with(base) && c.imported);
            assert_eq!(c.depth as usize, i + 1);
            assert!(c.tenant == s.tenant || c.tenant.is_empty());
        }
        Some(chain.len())
    }
}
