//! Fetching an OCI image: its manifest (picking linux/amd64 from an index),
//! its config and its layers, from a registry (`oci-client`) or a local OCI
//! image layout, into a blob cache where every file is the verified content
//! of its digest. Nothing unverified is ever stored under its digest's name.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use oci_client::secrets::RegistryAuth;
use serde::Deserialize;
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWriteExt;

use super::reference::{is_loopback_registry, Source};
use super::{OciError, Progress};
use crate::daemon::error_chain as chain;

/// The media types a manifest request accepts.
const MANIFEST_TYPES: [&str; 4] = [
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];
/// Most bytes of a manifest, an index or a config.
const MAX_JSON: u64 = 4 << 20;
/// Most layers in one image.
const MAX_LAYERS: usize = 256;

/// A content descriptor (the fields Sprout reads).
#[derive(Clone, Debug, Deserialize)]
pub struct Descriptor {
    #[serde(rename = "mediaType", default)]
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(default)]
    pub platform: Option<Platform>,
    #[serde(default)]
    pub annotations: HashMap<String, String>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct Platform {
    pub architecture: String,
    pub os: String,
}

/// An image manifest or an index (whichever fields the document has).
#[derive(Debug, Deserialize)]
struct Document {
    #[serde(default)]
    config: Option<Descriptor>,
    #[serde(default)]
    layers: Vec<Descriptor>,
    #[serde(default)]
    manifests: Option<Vec<Descriptor>>,
}

/// An image manifest, resolved to one platform.
#[derive(Clone, Debug)]
pub struct Manifest {
    /// The digest of the image manifest itself (not of an index above it).
    pub digest: String,
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
}

/// The verified blobs of an image, by digest, under `<cache>/blobs/sha256/`.
pub struct BlobCache {
    dir: PathBuf,
}

impl BlobCache {
    pub fn new(oci_dir: &Path) -> Result<BlobCache, OciError> {
        let dir = oci_dir.join("blobs/sha256");
        std::fs::create_dir_all(&dir).map_err(|e| OciError::io("create", &dir, e))?;
        Ok(BlobCache { dir })
    }

    /// Where blob `digest` lives once verified (`digest` was checked by
    /// [`hex_of`]).
    pub fn path(&self, digest: &str) -> Result<PathBuf, OciError> {
        Ok(self.dir.join(hex_of(digest)?))
    }

    fn has(&self, d: &Descriptor) -> Result<Option<PathBuf>, OciError> {
        let p = self.path(&d.digest)?;
        Ok(std::fs::metadata(&p)
            .ok()
            .filter(|m| m.is_file() && m.len() == d.size)
            .map(|_| p))
    }

    fn temp(&self, digest: &str) -> Result<PathBuf, OciError> {
        Ok(self
            .dir
            .join(format!(".tmp-{}-{}", hex_of(digest)?, uuid::Uuid::new_v4())))
    }
}

/// The hex part of a `sha256:` digest, checked (64 lowercase hex digits).
pub fn hex_of(digest: &str) -> Result<&str, OciError> {
    match digest.strip_prefix("sha256:") {
        Some(h)
            if h.len() == 64
                && h.bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()) =>
        {
            Ok(h)
        }
        _ => Err(OciError::Corrupt(format!(
            "unsupported or malformed digest {digest:?} (Sprout takes sha256 digests)"
        ))),
    }
}

fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

/// Where the blobs come from.
pub enum Fetcher {
    Registry {
        client: Box<oci_client::Client>,
        reference: oci_client::Reference,
        auth: RegistryAuth,
    },
    Layout {
        dir: PathBuf,
        tag: Option<String>,
    },
}

impl Fetcher {
    /// A fetcher for `source`; for a registry, its HTTP client (which
    /// needs a TLS set-up even for a plain-HTTP loopback registry: a host
    /// without CA certificates has none).
    pub fn new(source: &Source, auth: RegistryAuth) -> Result<Fetcher, OciError> {
        Ok(match source {
            Source::Registry(r) => {
                let protocol = if is_loopback_registry(r.resolve_registry()) {
                    oci_client::client::ClientProtocol::Http
                } else {
                    oci_client::client::ClientProtocol::Https
                };
                let config = oci_client::client::ClientConfig {
                    protocol,
                    // Sprout picks the platform itself (to say what an index
                    // offers when it has no linux/amd64).
                    platform_resolver: None,
                    connect_timeout: Some(std::time::Duration::from_secs(10)),
                    read_timeout: Some(std::time::Duration::from_secs(60)),
                    ..Default::default()
                };
                // oci-client falls back to reqwest's `Client::new()` when its
                // own set-up fails, and that panics when TLS cannot be set
                // up: an error here, not a panic in the pull.
                let client = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    oci_client::Client::new(config)
                }))
                .map_err(|_| {
                    OciError::Setup(
                        "cannot set up an HTTP client for the registry: TLS cannot be \
                         initialised on this host (are CA certificates installed? Debian: \
                         apt-get install ca-certificates)"
                            .into(),
                    )
                })?;
                Fetcher::Registry {
                    client: Box::new(client),
                    reference: r.clone(),
                    auth,
                }
            }
            Source::Layout { dir, tag } => Fetcher::Layout {
                dir: dir.clone(),
                tag: tag.clone(),
            },
        })
    }

    /// The image manifest for linux/amd64, with its digest checked against
    /// the reference's when it names one.
    pub async fn manifest(&self) -> Result<Manifest, OciError> {
        let (bytes, digest) = self.top_manifest().await?;
        let doc = parse_document(&bytes)?;
        let (doc, digest) = match doc.manifests {
            Some(list) => {
                let d = pick_platform(&list)?;
                let bytes = self.manifest_by_digest(&d).await?;
                let doc = parse_document(&bytes)?;
                if doc.manifests.is_some() {
                    return Err(OciError::Corrupt(
                        "an index entry for linux/amd64 is itself an index".into(),
                    ));
                }
                (doc, d.digest)
            }
            None => (doc, digest),
        };
        let config = doc
            .config
            .ok_or_else(|| OciError::Corrupt("the image manifest has no config".into()))?;
        hex_of(&config.digest)?;
        if config.size > MAX_JSON {
            return Err(OciError::Corrupt(format!(
                "the image config is {} bytes (at most {MAX_JSON})",
                config.size
            )));
        }
        if doc.layers.len() > MAX_LAYERS {
            return Err(OciError::Corrupt(format!(
                "the image has {} layers (at most {MAX_LAYERS})",
                doc.layers.len()
            )));
        }
        for l in &doc.layers {
            hex_of(&l.digest)?;
            super::unpack::Compression::of(&l.media_type)?;
        }
        Ok(Manifest {
            digest,
            config,
            layers: doc.layers,
        })
    }

    /// The document the reference names, and its digest (checked).
    async fn top_manifest(&self) -> Result<(Vec<u8>, String), OciError> {
        match self {
            Fetcher::Registry {
                client,
                reference,
                auth,
            } => {
                let (bytes, _) = client
                    .pull_manifest_raw(reference, auth, &MANIFEST_TYPES)
                    .await
                    .map_err(|e| registry_error(reference, e))?;
                if bytes.len() as u64 > MAX_JSON {
                    return Err(OciError::Corrupt("the manifest is over 4 MiB".into()));
                }
                // The digest is always computed here: a registry's header is
                // not trusted, and a digest reference must match.
                let digest = sha256_digest(&bytes);
                if let Some(want) = reference.digest() {
                    if want != digest {
                        return Err(OciError::Corrupt(format!(
                            "the registry's manifest for {want} has digest {digest}"
                        )));
                    }
                }
                Ok((bytes.to_vec(), digest))
            }
            Fetcher::Layout { dir, tag } => {
                let index = dir.join("index.json");
                let bytes = read_bounded(&index)?;
                let doc = parse_document(&bytes)?;
                let list = doc.manifests.ok_or_else(|| {
                    OciError::Corrupt(format!("{} has no manifests", index.display()))
                })?;
                let tagged: Vec<&Descriptor> = list
                    .iter()
                    .filter(|d| match tag {
                        Some(t) => {
                            d.annotations.get("org.opencontainers.image.ref.name") == Some(t)
                        }
                        None => true,
                    })
                    .collect();
                let d = match (tagged.as_slice(), tag) {
                    ([d], _) => (*d).clone(),
                    ([], Some(t)) => {
                        return Err(OciError::NotFound(format!(
                            "no image tagged {t:?} in the layout {}",
                            dir.display()
                        )))
                    }
                    ([], None) => {
                        return Err(OciError::NotFound(format!(
                            "the layout {} holds no image",
                            dir.display()
                        )))
                    }
                    (_, _) => {
                        return Err(OciError::NotFound(format!(
                            "the layout {} holds several images: name one (oci:{}:TAG)",
                            dir.display(),
                            dir.display()
                        )))
                    }
                };
                let bytes = self.manifest_by_digest(&d).await?;
                Ok((bytes, d.digest))
            }
        }
    }

    /// A manifest (or index) by its descriptor, checked against its digest.
    async fn manifest_by_digest(&self, d: &Descriptor) -> Result<Vec<u8>, OciError> {
        hex_of(&d.digest)?;
        if d.size > MAX_JSON {
            return Err(OciError::Corrupt(format!(
                "manifest {} is {} bytes (at most {MAX_JSON})",
                d.digest, d.size
            )));
        }
        let bytes = match self {
            Fetcher::Registry {
                client,
                reference,
                auth,
            } => {
                let r = reference.clone_with_digest(d.digest.clone());
                client
                    .pull_manifest_raw(&r, auth, &MANIFEST_TYPES)
                    .await
                    .map_err(|e| registry_error(&r, e))?
                    .0
                    .to_vec()
            }
            Fetcher::Layout { dir, .. } => read_bounded(&layout_blob(dir, &d.digest)?)?,
        };
        let got = sha256_digest(&bytes);
        if got != d.digest {
            return Err(OciError::Corrupt(format!(
                "manifest {} has digest {got}",
                d.digest
            )));
        }
        Ok(bytes)
    }

    /// Blob `d`, verified, in `cache` (fetched only when not there yet).
    /// Returns its path and whether it was fetched.
    pub async fn blob(
        &self,
        cache: &BlobCache,
        d: &Descriptor,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<(PathBuf, bool), OciError> {
        if let Some(p) = cache.has(d)? {
            return Ok((p, false));
        }
        let dst = cache.path(&d.digest)?;
        let tmp = cache.temp(&d.digest)?;
        let r = self.fetch_to(&tmp, d, progress).await;
        let r = r.and_then(|()| {
            let len = std::fs::metadata(&tmp)
                .map_err(|e| OciError::io("stat", &tmp, e))?
                .len();
            if len != d.size {
                return Err(OciError::Corrupt(format!(
                    "blob {} is {len} bytes, its descriptor says {}",
                    d.digest, d.size
                )));
            }
            std::fs::rename(&tmp, &dst).map_err(|e| OciError::io("rename", &tmp, e))
        });
        if r.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        r.map(|()| (dst, true))
    }

    async fn fetch_to(
        &self,
        tmp: &Path,
        d: &Descriptor,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<(), OciError> {
        match self {
            Fetcher::Registry {
                client, reference, ..
            } => {
                let file = tokio::fs::File::create(tmp)
                    .await
                    .map_err(|e| OciError::io("create", tmp, e))?;
                let desc = oci_client::manifest::OciDescriptor {
                    media_type: d.media_type.clone(),
                    digest: d.digest.clone(),
                    size: d.size as i64,
                    ..Default::default()
                };
                let mut w = Counting {
                    inner: tokio::io::BufWriter::with_capacity(1 << 20, file),
                    done: 0,
                    total: d.size,
                    digest: &d.digest,
                    progress,
                    last: 0,
                };
                // oci-client checks the data against the digest as it comes.
                client
                    .pull_blob(reference, &desc, &mut w)
                    .await
                    .map_err(|e| match e {
                        oci_client::errors::OciDistributionError::DigestError(e) => {
                            OciError::Corrupt(format!("blob {}: {e}", d.digest))
                        }
                        e => registry_error(reference, e),
                    })?;
                w.inner
                    .flush()
                    .await
                    .map_err(|e| OciError::io("write", tmp, e))?;
                w.inner
                    .get_mut()
                    .sync_all()
                    .await
                    .map_err(|e| OciError::io("sync", tmp, e))?;
                Ok(())
            }
            Fetcher::Layout { dir, .. } => {
                let src = layout_blob(dir, &d.digest)?;
                let (tmp, src, want, size) =
                    (tmp.to_owned(), src.clone(), d.digest.clone(), d.size);
                tokio::task::spawn_blocking(move || copy_verified(&src, &tmp, &want, size))
                    .await
                    .map_err(|e| OciError::Build(format!("copy task: {e}")))??;
                progress(Progress::Blob {
                    digest: d.digest.clone(),
                    done: d.size,
                    total: d.size,
                });
                Ok(())
            }
        }
    }
}

/// An `AsyncWrite` that counts (and bounds) what passes and reports progress.
struct Counting<'a, W> {
    inner: W,
    done: u64,
    total: u64,
    digest: &'a str,
    progress: &'a mut (dyn FnMut(Progress) + Send),
    last: u64,
}

impl<W: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Counting<'_, W> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = &mut *self;
        if this.done + buf.len() as u64 > this.total {
            return std::task::Poll::Ready(Err(std::io::Error::other(format!(
                "the registry sent more than the {} bytes of blob {}",
                this.total, this.digest
            ))));
        }
        let r = std::pin::Pin::new(&mut this.inner).poll_write(cx, buf);
        if let std::task::Poll::Ready(Ok(n)) = &r {
            this.done += *n as u64;
            // A line every 8 MiB, and at the end.
            if this.done - this.last >= 8 << 20 || this.done == this.total {
                this.last = this.done;
                (this.progress)(Progress::Blob {
                    digest: this.digest.to_owned(),
                    done: this.done,
                    total: this.total,
                });
            }
        }
        r
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Copies `src` to `dst` checking its size and sha256 as it goes.
fn copy_verified(src: &Path, dst: &Path, digest: &str, size: u64) -> Result<(), OciError> {
    let f = std::fs::File::open(src).map_err(|e| OciError::io("open", src, e))?;
    let mut out = std::fs::File::create(dst).map_err(|e| OciError::io("create", dst, e))?;
    let mut h = Sha256::new();
    let mut r = f.take(size + 1);
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = r.read(&mut buf).map_err(|e| OciError::io("read", src, e))?;
        if k == 0 {
            break;
        }
        n += k as u64;
        h.update(&buf[..k]);
        std::io::Write::write_all(&mut out, &buf[..k])
            .map_err(|e| OciError::io("write", dst, e))?;
    }
    let got = format!("sha256:{:x}", h.finalize());
    if n != size || got != digest {
        return Err(OciError::Corrupt(format!(
            "blob {digest} in the layout has {n} bytes and digest {got} (expected {size} bytes)"
        )));
    }
    out.sync_all().map_err(|e| OciError::io("sync", dst, e))
}

fn layout_blob(dir: &Path, digest: &str) -> Result<PathBuf, OciError> {
    Ok(dir.join("blobs/sha256").join(hex_of(digest)?))
}

fn read_bounded(path: &Path) -> Result<Vec<u8>, OciError> {
    let f = std::fs::File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => {
            OciError::NotFound(format!("{} does not exist", path.display()))
        }
        _ => OciError::io("open", path, e),
    })?;
    let mut v = Vec::new();
    f.take(MAX_JSON + 1)
        .read_to_end(&mut v)
        .map_err(|e| OciError::io("read", path, e))?;
    if v.len() as u64 > MAX_JSON {
        return Err(OciError::Corrupt(format!(
            "{} is over {MAX_JSON} bytes",
            path.display()
        )));
    }
    Ok(v)
}

fn parse_document(bytes: &[u8]) -> Result<Document, OciError> {
    serde_json::from_slice(bytes)
        .map_err(|e| OciError::Corrupt(format!("the manifest is not valid JSON: {e}")))
}

/// The linux/amd64 entry of an index, or an error naming what it offers.
fn pick_platform(list: &[Descriptor]) -> Result<Descriptor, OciError> {
    if let Some(d) = list.iter().find(|d| {
        d.platform
            .as_ref()
            .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
    }) {
        return Ok(d.clone());
    }
    let offered: Vec<String> = list
        .iter()
        .filter_map(|d| d.platform.as_ref())
        .map(|p| format!("{}/{}", p.os, p.architecture))
        .collect();
    Err(OciError::Platform(format!(
        "the image index has no linux/amd64 image (it has: {})",
        if offered.is_empty() {
            "no platform-tagged images".into()
        } else {
            offered.join(", ")
        }
    )))
}

/// A registry failure as an [`OciError`]: unreachable, unknown, or refused.
fn registry_error(
    r: &oci_client::Reference,
    e: oci_client::errors::OciDistributionError,
) -> OciError {
    use oci_client::errors::OciDistributionError as E;
    let what = r.whole();
    match e {
        E::RequestError(ref re) if re.is_connect() || re.is_timeout() => {
            OciError::Unreachable(format!(
                "cannot reach the registry {}: {}",
                r.resolve_registry(),
                chain(&e)
            ))
        }
        E::ImageManifestNotFoundError(m) => OciError::NotFound(format!("{what}: {m}")),
        E::ServerError { code: 404, .. } => {
            OciError::NotFound(format!("{what}: the registry has no such image or tag"))
        }
        E::RegistryError { ref envelope, .. }
            if envelope.errors.iter().any(|x| {
                matches!(
                    x.code,
                    oci_client::errors::OciErrorCode::ManifestUnknown
                        | oci_client::errors::OciErrorCode::NameUnknown
                        | oci_client::errors::OciErrorCode::BlobUnknown
                )
            }) =>
        {
            OciError::NotFound(format!("{what}: {}", chain(&e)))
        }
        E::AuthenticationFailure(m) | E::UnauthorizedError { url: m } => {
            OciError::Auth(format!("{what}: {m}"))
        }
        e => OciError::Registry(format!("{what}: {}", chain(&e))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(os: &str, arch: &str) -> Descriptor {
        Descriptor {
            media_type: "application/vnd.oci.image.manifest.v1+json".into(),
            digest: format!("sha256:{}", "1".repeat(64)),
            size: 10,
            platform: Some(Platform {
                architecture: arch.into(),
                os: os.into(),
            }),
            annotations: HashMap::new(),
        }
    }

    #[test]
    fn an_index_without_linux_amd64_says_what_it_has() {
        let e = pick_platform(&[desc("linux", "arm64"), desc("windows", "amd64")]).unwrap_err();
        assert!(e.to_string().contains("linux/arm64, windows/amd64"), "{e}");
        assert!(pick_platform(&[desc("linux", "arm64"), desc("linux", "amd64")]).is_ok());
    }

    #[test]
    fn digests_must_be_sha256_and_well_formed() {
        assert!(hex_of(&format!("sha256:{}", "a".repeat(64))).is_ok());
        for bad in [
            "sha512:aa".to_string(),
            format!("sha256:{}", "A".repeat(64)),
            format!("sha256:{}", "a".repeat(63)),
            format!("sha256:../../{}", "a".repeat(58)),
        ] {
            assert!(hex_of(&bad).is_err(), "{bad}");
        }
    }
}
