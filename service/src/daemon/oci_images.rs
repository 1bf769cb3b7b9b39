//! OCI images as sandbox images: a create's `image` may be an OCI reference
//! (see `crate::oci`). sproutd pulls and converts it once per manifest
//! digest, in the background; a create waits up to [`WAIT`] for that, then
//! answers `503 image_pulling` with `Retry-After` and how far the pull got,
//! and the pull goes on without it. Every create of a tag asks the registry
//! which digest the tag names now (one manifest request), so a re-tagged
//! image is a new image.
//!
//! A sandbox records its image pinned, `REFERENCE@sha256:DIGEST`: its
//! template (keyed on the image's name) is the digest's, and a wake or
//! restore finds the base image by that digest, whatever the tag names
//! since.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use super::error::{ApiError, Code};
use super::registry::{Image, Runtime};
use crate::oci::{self, OciError, OciImage, Progress, PullOptions};

/// How long a create waits for its image's pull before answering 503.
pub const WAIT: Duration = Duration::from_secs(20);
/// `Retry-After` of an `image_pulling` answer.
pub const RETRY_AFTER_SECS: u64 = 5;

type Outcome = Option<Result<OciImage, (Code, String)>>;

/// One pull in flight.
struct Pull {
    /// How far it got, for the 503's message.
    status: Mutex<String>,
    done: watch::Sender<Outcome>,
}

/// The pulls in flight, by reference.
pub struct Pulls {
    cache_dir: PathBuf,
    running: Mutex<HashMap<String, Arc<Pull>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Pulls {
    pub fn new(cache_dir: &Path) -> Pulls {
        Pulls {
            cache_dir: cache_dir.to_owned(),
            running: Mutex::new(HashMap::new()),
        }
    }

    /// The base image `reference` names, pulled and converted if it is not
    /// yet (joining a pull of it already under way).
    pub async fn image(self: &Arc<Self>, reference: &str) -> Result<Image, ApiError> {
        let pull = {
            let mut running = lock(&self.running);
            match running.get(reference) {
                Some(p) => p.clone(),
                None => {
                    let p = Arc::new(Pull {
                        status: Mutex::new("resolving the reference".into()),
                        done: watch::channel(None).0,
                    });
                    running.insert(reference.to_owned(), p.clone());
                    tokio::spawn(self.clone().run(reference.to_owned(), p.clone()));
                    p
                }
            }
        };
        let mut rx = pull.done.subscribe();
        let waited = tokio::time::timeout(WAIT, rx.wait_for(Option::is_some)).await;
        match waited {
            Ok(Ok(outcome)) => match outcome.clone() {
                Some(Ok(img)) => Ok(image_of(reference, &img)),
                Some(Err((code, why))) => Err(ApiError::new(code, why).with_field("image")),
                None => Err(ApiError::internal("the pull ended with no outcome")),
            },
            Ok(Err(_)) => Err(ApiError::internal(format!(
                "the pull of {reference} was dropped"
            ))),
            Err(_) => {
                let status = lock(&pull.status).clone();
                Err(ApiError::new(
                    Code::ImagePulling,
                    format!(
                        "Image {reference} is being pulled ({status}): retry after {RETRY_AFTER_SECS} s"
                    ),
                )
                .retry_after(RETRY_AFTER_SECS))
            }
        }
    }

    async fn run(self: Arc<Self>, reference: String, pull: Arc<Pull>) {
        let opts = PullOptions::from_env(&self.cache_dir);
        let p = pull.clone();
        let mut progress = move |ev: Progress| {
            let text = match ev {
                Progress::Resolved { layers, bytes, .. } => {
                    format!("{layers} layers, {} to fetch", mib(bytes))
                }
                Progress::Blob { done, total, .. } => {
                    format!("fetching a layer: {} of {}", mib(done), mib(total))
                }
                Progress::BlobCached { .. } => "a layer was cached".into(),
                Progress::Unpacking { index, of } => format!("unpacking layer {index} of {of}"),
                Progress::Building => "building the base image".into(),
                Progress::Ready { .. } => "ready".into(),
            };
            *lock(&p.status) = text;
        };
        let t = std::time::Instant::now();
        // On a task of its own: a pull that panics is a failed pull (every
        // create waiting on it is answered), never one left "being pulled".
        let r = reference.clone();
        let outcome = tokio::spawn(async move { oci::pull(&r, &opts, &mut progress).await })
            .await
            .unwrap_or_else(|e| {
                Err(OciError::Build(format!(
                    "the pull stopped unexpectedly: {}",
                    panic_text(e)
                )))
            });
        match &outcome {
            Ok(img) if !img.cached => tracing::info!(
                image = %reference,
                digest = %img.digest,
                "pulled and converted in {} ms",
                t.elapsed().as_millis()
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!(image = %reference, "pull failed: {}", super::error::chain(e)),
        }
        let outcome = outcome.map_err(|e| (code_of(&e), super::error::chain(&e)));
        // Gone from the table first: a create after this one asks the
        // registry again (the tag may move).
        lock(&self.running).remove(&reference);
        pull.done.send_replace(Some(outcome));
    }

    /// The base image a pinned name (`...@sha256:DIGEST`) recorded by a
    /// sandbox stands for, if it is in the cache.
    pub fn by_name(&self, name: &str) -> Option<Image> {
        let (_, hex) = name.rsplit_once("@sha256:")?;
        let digest = format!("sha256:{hex}");
        oci::list(&self.cache_dir)
            .into_iter()
            .find(|i| i.digest == digest)
            .map(|i| image_of(name, &i))
    }

    /// Every OCI base image in the cache, by the reference it was first
    /// pulled by, pinned.
    pub fn list(&self) -> Vec<Image> {
        oci::list(&self.cache_dir)
            .iter()
            .map(|i| image_of(&i.reference, i))
            .collect()
    }
}

/// What a failed pull task's panic said.
fn panic_text(e: tokio::task::JoinError) -> String {
    match e.try_into_panic() {
        Ok(p) => p
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".into()),
        Err(e) => e.to_string(),
    }
}

/// `reference` pinned to the image's digest (as given if it already is).
pub fn pinned(reference: &str, digest: &str) -> String {
    match reference.rsplit_once('@') {
        Some((_, d)) if d == digest => reference.to_owned(),
        Some((name, _)) => format!("{name}@{digest}"),
        None => format!("{reference}@{digest}"),
    }
}

fn image_of(reference: &str, img: &OciImage) -> Image {
    Image {
        name: pinned(reference, &img.digest),
        path: img.path.clone(),
        size_bytes: img.size_bytes,
        // An image converted before this was recorded may try `vm`.
        runtimes: if img.systemd != Some(false) {
            vec![Runtime::Container, Runtime::Vm]
        } else {
            vec![Runtime::Container]
        },
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// The API's code for a failed pull.
pub fn code_of(e: &OciError) -> Code {
    match e {
        OciError::Reference(_) => Code::BadImageReference,
        OciError::NotFound(_) => Code::ImageNotFound,
        OciError::Unreachable(_) => Code::RegistryUnreachable,
        OciError::Auth(_) => Code::RegistryAuth,
        OciError::Registry(_) => Code::RegistryError,
        OciError::Platform(_) => Code::ImagePlatform,
        OciError::Corrupt(_) => Code::ImageCorrupt,
        OciError::Unsupported(_) => Code::ImageUnsupported,
        OciError::TooLarge(_) => Code::ImageTooLarge,
        OciError::Setup(_) | OciError::Build(_) | OciError::Io { .. } => Code::ImageBuildFailed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reference_is_pinned_to_its_digest_once() {
        let d = "sha256:abc";
        assert_eq!(pinned("r:5000/py:1", d), "r:5000/py:1@sha256:abc");
        assert_eq!(pinned("r:5000/py@sha256:abc", d), "r:5000/py@sha256:abc");
        assert_eq!(pinned("r:5000/py@sha256:old", d), "r:5000/py@sha256:abc");
        assert_eq!(pinned("oci:/l:1", d), "oci:/l:1@sha256:abc");
    }

    #[test]
    fn every_pull_error_has_the_code_and_status_the_puller_gives_it() {
        let all = [
            OciError::Reference(oci::reference::ReferenceError::Empty),
            OciError::NotFound(String::new()),
            OciError::Unreachable(String::new()),
            OciError::Auth(String::new()),
            OciError::Registry(String::new()),
            OciError::Platform(String::new()),
            OciError::Corrupt(String::new()),
            OciError::Unsupported(String::new()),
            OciError::TooLarge(String::new()),
            OciError::Setup(String::new()),
            OciError::Build(String::new()),
        ];
        for e in all {
            let c = code_of(&e);
            assert_eq!(c.name(), e.code(), "{e:?}");
            assert_eq!(c.status().as_u16(), e.http_status(), "{e:?}");
        }
    }
}
