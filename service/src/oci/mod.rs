//! OCI images as Sprout base images.
//!
//! [`pull`] takes an OCI reference (a registry's `host[:port]/name:tag` or
//! `@sha256:…`, or a local layout's `oci:/path[:tag]`), resolves it to the
//! linux/amd64 image manifest, fetches the config and the layers it does not
//! have yet into a blob cache (each checked against its digest), applies the
//! layers in order to an empty root ([`unpack`]), adds Sprout's init and
//! agent, and makes a read-only ext4 base image of it ([`build`]).
//!
//! The cache, under `<cache>/oci/`:
//! - `blobs/sha256/<hex>`: verified blobs, shared by every image;
//! - `images/<manifest hex>-<sprout key>/`: `rootfs.ext4` and `image.json`
//!   (the reference, digest, size and the image's run config). The sprout
//!   key hashes what Sprout adds (agent, init, busybox): a new agent makes
//!   a new base image from the cached blobs, without pulling again;
//! - `tmp/`: builds in progress. An image directory appears whole (a
//!   rename) or not at all; a failed pull leaves nothing behind.
//!
//! A reference that names a digest is served from the cache without asking
//! the registry anything; a tag costs one manifest request, then nothing
//! more when its digest is cached.

pub mod build;
pub mod fetch;
pub mod reference;
pub mod unpack;

use std::path::{Path, PathBuf};
use std::time::Instant;

use oci_client::secrets::RegistryAuth;
use serde::{Deserialize, Serialize};

pub use reference::{is_oci, parse, ReferenceError, Source};

#[derive(Debug, thiserror::Error)]
pub enum OciError {
    #[error(transparent)]
    Reference(#[from] ReferenceError),
    #[error("Image not found: {0}")]
    NotFound(String),
    #[error("Registry unreachable: {0}")]
    Unreachable(String),
    #[error("The registry refused the credentials: {0}")]
    Auth(String),
    #[error("Registry error: {0}")]
    Registry(String),
    #[error("Wrong platform: {0}")]
    Platform(String),
    #[error("The image is corrupt: {0}")]
    Corrupt(String),
    #[error("Unsupported image: {0}")]
    Unsupported(String),
    #[error("The image is too large: {0}")]
    TooLarge(String),
    #[error("Cannot build OCI images on this host: {0}")]
    Setup(String),
    #[error("Cannot build the base image: {0}")]
    Build(String),
    #[error("Cannot {op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl OciError {
    pub fn io(op: &'static str, path: &Path, source: std::io::Error) -> OciError {
        OciError::Io {
            op,
            path: path.to_owned(),
            source,
        }
    }

    /// A stable snake_case name of the failure, for the API and the CLI.
    pub fn code(&self) -> &'static str {
        match self {
            OciError::Reference(_) => "bad_image_reference",
            OciError::NotFound(_) => "image_not_found",
            OciError::Unreachable(_) => "registry_unreachable",
            OciError::Auth(_) => "registry_auth",
            OciError::Registry(_) => "registry_error",
            OciError::Platform(_) => "image_platform",
            OciError::Corrupt(_) => "image_corrupt",
            OciError::Unsupported(_) => "image_unsupported",
            OciError::TooLarge(_) => "image_too_large",
            OciError::Setup(_) | OciError::Build(_) | OciError::Io { .. } => "image_build_failed",
        }
    }

    /// Whether the caller's input is at fault (400) rather than the
    /// registry or the image's content (502) or this host (500).
    pub fn http_status(&self) -> u16 {
        match self {
            OciError::Reference(_)
            | OciError::NotFound(_)
            | OciError::Platform(_)
            | OciError::Unsupported(_)
            | OciError::TooLarge(_) => 400,
            OciError::Unreachable(_)
            | OciError::Auth(_)
            | OciError::Registry(_)
            | OciError::Corrupt(_) => 502,
            OciError::Setup(_) | OciError::Build(_) | OciError::Io { .. } => 500,
        }
    }
}

/// How the image asks to be run (its config's `config`), kept beside the
/// base image for the sandbox runtimes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunConfig {
    #[serde(default)]
    pub entrypoint: Vec<String>,
    #[serde(default)]
    pub cmd: Vec<String>,
    #[serde(default)]
    pub env: Vec<String>,
    #[serde(default)]
    pub working_dir: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
    /// `PORT/PROTO` as the image declares them.
    #[serde(default)]
    pub exposed_ports: Vec<String>,
}

/// A base image made from an OCI image (`image.json` in its directory).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OciImage {
    /// The reference it was first pulled by.
    pub reference: String,
    /// The linux/amd64 image manifest's digest.
    pub digest: String,
    /// The read-only ext4 base image.
    pub path: PathBuf,
    pub size_bytes: u64,
    pub layers: usize,
    pub config: RunConfig,
    /// Whether its `/sbin/init` is systemd, which the `vm` runtime needs
    /// (none: converted before this was recorded; not known).
    #[serde(default)]
    pub systemd: Option<bool>,
    pub built_at_ms: u64,
    /// Set on the value [`pull`] returns: whether it was already built.
    #[serde(skip)]
    pub cached: bool,
}

/// What a long pull reports as it goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Progress {
    /// The reference resolved to this manifest.
    Resolved {
        digest: String,
        layers: usize,
        bytes: u64,
    },
    /// Bytes of a blob fetched so far.
    Blob {
        digest: String,
        done: u64,
        total: u64,
    },
    /// A blob already in the cache.
    BlobCached { digest: String },
    /// Layer `index` (from 1) of `of` is being applied.
    Unpacking { index: usize, of: usize },
    /// The root is being made into an ext4 image.
    Building,
    /// The base image is ready (or was already).
    Ready { path: PathBuf, cached: bool },
}

/// What [`pull`] needs besides the reference.
pub struct PullOptions {
    /// Sprout's cache (`<cache>/oci` is used).
    pub cache_dir: PathBuf,
    pub auth: RegistryAuth,
    pub budget: unpack::Budget,
}

impl PullOptions {
    /// Anonymous, or basic credentials from `SPROUT_REGISTRY_USERNAME` and
    /// `SPROUT_REGISTRY_PASSWORD` (a registry's bearer-token exchange is
    /// done with them when it asks for one).
    pub fn from_env(cache_dir: &Path) -> PullOptions {
        let auth = match (
            std::env::var("SPROUT_REGISTRY_USERNAME"),
            std::env::var("SPROUT_REGISTRY_PASSWORD"),
        ) {
            (Ok(u), Ok(p)) if !u.is_empty() => RegistryAuth::Basic(u, p),
            _ => RegistryAuth::Anonymous,
        };
        PullOptions {
            cache_dir: cache_dir.to_owned(),
            auth,
            budget: unpack::Budget::default(),
        }
    }
}

/// The image's config (the fields Sprout reads).
#[derive(Deserialize)]
struct ConfigFile {
    #[serde(default)]
    architecture: String,
    #[serde(default)]
    os: String,
    #[serde(default)]
    config: Option<ContainerConfig>,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ContainerConfig {
    #[serde(default)]
    entrypoint: Option<Vec<String>>,
    #[serde(default)]
    cmd: Option<Vec<String>>,
    #[serde(default)]
    env: Option<Vec<String>>,
    #[serde(default)]
    working_dir: Option<String>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    exposed_ports: Option<std::collections::BTreeMap<String, serde_json::Value>>,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A directory removed on drop unless kept.
struct TempDir(Option<PathBuf>);

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

/// Pulls `image` (an OCI reference) and makes it a base image, or finds the
/// one already made. `progress` hears about every step of a long pull.
pub async fn pull(
    image: &str,
    opts: &PullOptions,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<OciImage, OciError> {
    let source = parse(image)?;
    let oci = opts.cache_dir.join("oci");
    let sprout = build::SproutFiles::locate(&opts.cache_dir)?;
    let key = sprout.key()?;
    // A digest reference is answered from the cache with no request at all.
    if let Source::Registry(r) = &source {
        if let Some(d) = r.digest() {
            if let Some(img) = cached(&oci, d, &key) {
                progress(Progress::Ready {
                    path: img.path.clone(),
                    cached: true,
                });
                return Ok(img);
            }
        }
    }
    let fetcher = fetch::Fetcher::new(&source, opts.auth.clone())?;
    let manifest = fetcher.manifest().await?;
    let bytes = manifest.layers.iter().map(|l| l.size).sum();
    progress(Progress::Resolved {
        digest: manifest.digest.clone(),
        layers: manifest.layers.len(),
        bytes,
    });
    if let Some(img) = cached(&oci, &manifest.digest, &key) {
        progress(Progress::Ready {
            path: img.path.clone(),
            cached: true,
        });
        return Ok(img);
    }
    // One build of a digest at a time on this host; a second caller waits,
    // then finds it built.
    let images = oci.join("images");
    std::fs::create_dir_all(&images).map_err(|e| OciError::io("create", &images, e))?;
    let hex = fetch::hex_of(&manifest.digest)?.to_owned();
    let lock_path = images.join(format!(".{hex}.lock"));
    let lock =
        std::fs::File::create(&lock_path).map_err(|e| OciError::io("create", &lock_path, e))?;
    let lock = tokio::task::spawn_blocking(move || {
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).map(|()| lock)
    })
    .await
    .map_err(|e| OciError::Build(format!("lock task: {e}")))?
    .map_err(|e| OciError::io("lock", &lock_path, e.into()))?;
    if let Some(img) = cached(&oci, &manifest.digest, &key) {
        progress(Progress::Ready {
            path: img.path.clone(),
            cached: true,
        });
        return Ok(img);
    }

    let blobs = fetch::BlobCache::new(&oci)?;
    let (config_path, _) = fetcher.blob(&blobs, &manifest.config, progress).await?;
    let config: ConfigFile = serde_json::from_slice(
        &std::fs::read(&config_path).map_err(|e| OciError::io("read", &config_path, e))?,
    )
    .map_err(|e| OciError::Corrupt(format!("the image config is not valid JSON: {e}")))?;
    if config.os != "linux" || config.architecture != "amd64" {
        return Err(OciError::Platform(format!(
            "the image is for {}/{}; Sprout runs linux/amd64 images",
            if config.os.is_empty() {
                "?"
            } else {
                &config.os
            },
            if config.architecture.is_empty() {
                "?"
            } else {
                &config.architecture
            }
        )));
    }
    let mut layer_paths = Vec::with_capacity(manifest.layers.len());
    for l in &manifest.layers {
        let (p, fetched) = fetcher.blob(&blobs, l, progress).await?;
        if !fetched {
            progress(Progress::BlobCached {
                digest: l.digest.clone(),
            });
        }
        layer_paths.push((p, unpack::Compression::of(&l.media_type)?));
    }

    let tmp_root = oci.join("tmp");
    sweep_stale(&tmp_root);
    std::fs::create_dir_all(&tmp_root).map_err(|e| OciError::io("create", &tmp_root, e))?;
    let work = tmp_root.join(format!("{hex}-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir(&work).map_err(|e| OciError::io("create", &work, e))?;
    let mut guard = TempDir(Some(work.clone()));
    let rootfs = work.join("rootfs");
    std::fs::create_dir(&rootfs).map_err(|e| OciError::io("create", &rootfs, e))?;
    let of = layer_paths.len();
    let mut budget = opts.budget;
    for (i, (blob, compression)) in layer_paths.into_iter().enumerate() {
        progress(Progress::Unpacking { index: i + 1, of });
        let (root, b) = (rootfs.clone(), budget);
        let (stats, left) = tokio::task::spawn_blocking(move || {
            let mut b = b;
            unpack::apply_layer(&root, &blob, compression, &mut b).map(|s| (s, b))
        })
        .await
        .map_err(|e| OciError::Build(format!("unpack task: {e}")))??;
        budget = left;
        log::debug!("oci: layer {}/{of}: {stats:?}", i + 1);
    }
    progress(Progress::Building);
    let started = Instant::now();
    let c = config.config.unwrap_or_default();
    let run_config = RunConfig {
        entrypoint: c.entrypoint.unwrap_or_default(),
        cmd: c.cmd.unwrap_or_default(),
        env: c.env.unwrap_or_default(),
        working_dir: c.working_dir.filter(|w| !w.is_empty()),
        user: c.user.filter(|u| !u.is_empty()),
        exposed_ports: c.exposed_ports.unwrap_or_default().into_keys().collect(),
    };
    let ext4 = work.join("rootfs.ext4");
    let (root, out, rc) = (rootfs.clone(), ext4.clone(), run_config.clone());
    let (size_bytes, systemd) = tokio::task::spawn_blocking(move || {
        let main = build::main_process(&root, &rc)?;
        let systemd = build::init_is_systemd(&root);
        sprout.add_to(&root, main.as_ref())?;
        let n = build::make_ext4(&root, &out)?;
        let _ = std::fs::remove_dir_all(&root);
        Ok::<_, OciError>((n, systemd))
    })
    .await
    .map_err(|e| OciError::Build(format!("build task: {e}")))??;
    log::debug!("oci: ext4 built in {} ms", started.elapsed().as_millis());

    let final_dir = images.join(format!("{hex}-{key}"));
    let img = OciImage {
        reference: source.to_string(),
        digest: manifest.digest.clone(),
        path: final_dir.join("rootfs.ext4"),
        size_bytes,
        layers: of,
        config: run_config,
        systemd: Some(systemd),
        built_at_ms: now_ms(),
        cached: false,
    };
    let json = work.join("image.json");
    let text = serde_json::to_vec_pretty(&img).map_err(|e| OciError::Build(e.to_string()))?;
    std::fs::write(&json, text).map_err(|e| OciError::io("write", &json, e))?;
    for f in [&ext4, &json] {
        let file = std::fs::File::open(f).map_err(|e| OciError::io("open", f, e))?;
        file.sync_all().map_err(|e| OciError::io("sync", f, e))?;
        std::fs::set_permissions(f, std::os::unix::fs::PermissionsExt::from_mode(0o444))
            .map_err(|e| OciError::io("chmod", f, e))?;
    }
    std::fs::rename(&work, &final_dir).map_err(|e| OciError::io("rename", &work, e))?;
    guard.0 = None;
    drop(lock);
    progress(Progress::Ready {
        path: img.path.clone(),
        cached: false,
    });
    Ok(img)
}

/// [`pull`] for callers without a runtime (the CLI).
pub fn pull_blocking(
    image: &str,
    opts: &PullOptions,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<OciImage, OciError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| OciError::Build(format!("cannot start a runtime: {e}")))?;
    rt.block_on(pull(image, opts, progress))
}

/// The base image built for `digest` with Sprout files `key`, if whole.
fn cached(oci: &Path, digest: &str, key: &str) -> Option<OciImage> {
    let hex = fetch::hex_of(digest).ok()?;
    let dir = oci.join("images").join(format!("{hex}-{key}"));
    let mut img: OciImage =
        serde_json::from_slice(&std::fs::read(dir.join("image.json")).ok()?).ok()?;
    img.path = dir.join("rootfs.ext4");
    img.path.is_file().then_some(())?;
    img.cached = true;
    Some(img)
}

/// Every base image in the cache (the newest build of each digest).
pub fn list(cache_dir: &Path) -> Vec<OciImage> {
    let dir = cache_dir.join("oci/images");
    let Ok(rd) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut out: Vec<OciImage> = rd
        .flatten()
        .filter_map(|e| {
            let p = e.path();
            let mut img: OciImage =
                serde_json::from_slice(&std::fs::read(p.join("image.json")).ok()?).ok()?;
            img.path = p.join("rootfs.ext4");
            img.cached = true;
            Some(img)
        })
        .collect();
    out.sort_by_key(|i| std::cmp::Reverse(i.built_at_ms));
    let mut seen = std::collections::HashSet::new();
    out.retain(|i| seen.insert(i.digest.clone()));
    out
}

/// Removes builds a crashed process left in `tmp` (older than a day).
fn sweep_stale(tmp: &Path) {
    let Ok(rd) = std::fs::read_dir(tmp) else {
        return;
    };
    let day = std::time::Duration::from_secs(86_400);
    for e in rd.flatten() {
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > day);
        if old {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// A progress reporter for a terminal or a log: one line a step on stderr,
/// prefixed `sprout: `.
pub fn print_progress(p: Progress) {
    const MIB: f64 = 1048576.0;
    let short = |d: &str| d.get(7..19).unwrap_or(d).to_owned();
    match p {
        Progress::Resolved {
            digest,
            layers,
            bytes,
        } => eprintln!(
            "sprout: image {} ({layers} layers, {:.1} MiB)",
            short(&digest),
            bytes as f64 / MIB
        ),
        Progress::Blob {
            digest,
            done,
            total,
        } => eprintln!(
            "sprout: pulled {} {:.1}/{:.1} MiB",
            short(&digest),
            done as f64 / MIB,
            total as f64 / MIB
        ),
        Progress::BlobCached { digest } => eprintln!("sprout: {} already here", short(&digest)),
        Progress::Unpacking { index, of } => eprintln!("sprout: unpacking layer {index}/{of}"),
        Progress::Building => eprintln!("sprout: building the base image (mkfs.ext4)"),
        Progress::Ready { path, cached } => eprintln!(
            "sprout: base image {}{}",
            path.display(),
            if cached { " (cached)" } else { "" }
        ),
    }
}
