//! Templates: the first create of an (image, shape) registers a template
//! build (a VM booted once, its agent waited for, snapshotted, the VM
//! stopped) and is answered `503 template_building` with `Retry-After`;
//! later creates restore the template instead of booting. A failed build is
//! shown with its reason and retried by the next create; a build cut short
//! by a stop of sproutd is failed at the next start.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;
use uuid::Uuid;

use super::error::{chain, ApiError, Code};
use super::images::TEST_GUEST_IMAGE;
use super::openapi::errors;
use super::registry::{
    Image, Runtime, Sandbox, SnapshotKind, SnapshotRow, State as VmState, TemplateRow,
    TemplateState,
};
use super::supervisor::{BootError, CONTROL_SOCK};
use super::{now_ms, App};

/// What a create finds for its (image, shape).
pub enum Lookup {
    Ready(Box<SnapshotRow>),
    /// Being built; retry after this many seconds.
    Building(u64),
}

/// `Retry-After` of a first build when no build has been timed yet: a
/// Linux image's boot takes 5-60 s in the emulated lab, about a second on
/// hardware virtualization; a client that retries early gets another 503.
fn first_estimate(image: &str) -> u64 {
    if image == TEST_GUEST_IMAGE {
        1
    } else {
        10
    }
}

impl App {
    /// The template of (`image`, `runtime`, shape) for a create: ready, or
    /// being built (this call starts the build when there is none, or the
    /// last one failed or its snapshot is gone).
    pub async fn template_for(
        self: &Arc<Self>,
        image: &Image,
        runtime: Runtime,
        cpus: u8,
        memory_mb: u32,
    ) -> Result<Lookup, ApiError> {
        let name = image.name.clone();
        let path = image.path.clone();
        let build_id = Uuid::new_v4();
        let start = self
            .db(move |r| {
                let all = r.list_templates()?;
                let estimate = all
                    .iter()
                    .filter(|t| t.image == name)
                    .filter_map(|t| t.build_ms)
                    .max()
                    .map_or_else(|| first_estimate(&name), |ms| ms.div_ceil(1000).max(1));
                let this = all.into_iter().find(|t| {
                    t.image == name
                        && t.runtime == runtime
                        && t.cpus == cpus
                        && t.memory_mb == memory_mb
                });
                // A rebuild keeps the last build's time: the estimate of
                // the creates that wait for it (shown once ready only).
                let last_ms = this.as_ref().and_then(|t| t.build_ms);
                match this {
                    Some(t) if t.state == TemplateState::Building => {
                        return Ok(Err(estimate));
                    }
                    Some(TemplateRow {
                        state: TemplateState::Ready,
                        snapshot_id: Some(sid),
                        image_identity,
                        ..
                    }) => {
                        // Only over the image it was built over: a guest
                        // restored over another (rebuilt, or changed in
                        // place) would read a file system its memory does
                        // not describe. One from before identities were
                        // recorded is built again too. (An image that cannot
                        // be read now is not a reason: its restore says why.)
                        let now = super::registry::image_identity(&path);
                        if now.is_none() || image_identity == now {
                            if let Some(s) = r.get_snapshot(sid)? {
                                return Ok(Ok(Some(s)));
                            }
                        } else {
                            tracing::info!(
                                image = %name, runtime = runtime.as_str(), cpus, memory_mb,
                                "the image is not the one its template was built over \
                                 (then: {}; now: {}): building the template again",
                                image_identity.as_deref().unwrap_or("not recorded"),
                                now.as_deref().unwrap_or("unreadable")
                            );
                        }
                    }
                    _ => {}
                }
                r.put_template(&TemplateRow {
                    image: name,
                    runtime,
                    cpus,
                    memory_mb,
                    state: TemplateState::Building,
                    snapshot_id: None,
                    failure_reason: None,
                    build_id: Some(build_id),
                    build_ms: last_ms,
                    updated_ms: now_ms(),
                    image_identity: None,
                })?;
                Ok(Err(estimate))
            })
            .await?;
        match start {
            Ok(Some(s)) => Ok(Lookup::Ready(Box::new(s))),
            Ok(None) => unreachable!("a ready template without a snapshot is rebuilt"),
            Err(estimate) => {
                // Only the call that recorded the build starts it.
                let ours = self
                    .db(move |r| {
                        Ok(r.list_templates()?
                            .iter()
                            .any(|t| t.build_id == Some(build_id)))
                    })
                    .await?;
                if ours {
                    tracing::info!(
                        image = %image.name, runtime = runtime.as_str(), cpus, memory_mb,
                        "building a template"
                    );
                    let (app, image) = (self.clone(), image.clone());
                    let key = (runtime, cpus, memory_mb);
                    tokio::spawn(async move { app.build(image, key, build_id).await });
                }
                Ok(Lookup::Building(estimate))
            }
        }
    }

    /// Builds a template and records how it went (a ready one is recorded
    /// by the build, with its snapshot, in one write).
    async fn build(self: Arc<Self>, image: Image, key: (Runtime, u8, u32), build_id: Uuid) {
        let (runtime, cpus, memory_mb) = key;
        let t = Instant::now();
        let r = self.build_template(&image, key, build_id, t).await;
        let took = t.elapsed().as_millis() as u64;
        let name = image.name.clone();
        match r {
            Ok(_) => {
                tracing::info!(image = %name, cpus, memory_mb, "template ready in {took} ms");
                // Its creates restore into ready workers of its shape.
                super::pool::refill_later(
                    &self,
                    sprout_worker::protocol::Shape {
                        vcpus: cpus,
                        mem_mib: u64::from(memory_mb),
                    },
                );
            }
            Err(e) => {
                tracing::warn!(image = %name, cpus, memory_mb, "template build failed: {}", e.message);
                let why = e.message;
                let r = self
                    .db(move |r| {
                        r.put_template(&TemplateRow {
                            image: name,
                            runtime,
                            cpus,
                            memory_mb,
                            state: TemplateState::Failed,
                            snapshot_id: None,
                            failure_reason: Some(why),
                            build_id: None,
                            build_ms: None,
                            updated_ms: now_ms(),
                            image_identity: None,
                        })
                    })
                    .await;
                if let Err(e) = r {
                    tracing::error!("recording a failed template build: {}", e.message);
                }
            }
        }
        self.collect_garbage().await;
    }

    async fn build_template(
        self: &Arc<Self>,
        image: &Image,
        (runtime, cpus, memory_mb): (Runtime, u8, u32),
        build_id: Uuid,
        started: Instant,
    ) -> Result<SnapshotRow, ApiError> {
        // Not a sandbox: never in the registry, its directory removed after.
        let mut s = Sandbox {
            runtime,
            ..Sandbox::starting(build_id, "", &image.name, cpus, memory_mb, now_ms())
        };
        // The image as the build's VM opens it: identified first, so an
        // image replaced during the build is one the template does not
        // claim (its restores would refuse it: see `vmm`'s restore).
        let path = image.path.clone();
        let identity = tokio::task::spawn_blocking(move || super::registry::image_identity(&path))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?;
        let (a, row, path) = (self.clone(), s.clone(), image.path.clone());
        let booted =
            tokio::task::spawn_blocking(move || a.supervisor.boot(&row, Some(&path), None))
                .await
                .map_err(|e| ApiError::internal(e.to_string()))?
                .map_err(|e| match e {
                    BootError::Unsupported(m) => ApiError::new(Code::HostUnsupported, m),
                    BootError::Failed(m) => ApiError::new(Code::BootFailed, m),
                    BootError::Worker(m) => ApiError::new(Code::WorkerFailed, m),
                    BootError::Identity(m) => ApiError::new(Code::AgentUnavailable, m),
                });
        let booted = match booted {
            Ok(b) => b,
            Err(e) => {
                // Its directory (the copy of the disk template) goes too.
                let (a, row) = (self.clone(), s.clone());
                let _ = tokio::task::spawn_blocking(move || a.supervisor.stop(&row, None)).await;
                return Err(e);
            }
        };
        s.worker_socket = Some(booted.worker.socket.clone());
        s.vsock_socket = booted.vsock.clone();
        s.pid = Some(booted.worker.pid());
        let worker = booted.worker;
        let r = async {
            if let (sprout_worker::protocol::GuestKind::Linux, Some(uds)) =
                (booted.guest, &s.vsock_socket)
            {
                let agent = crate::agent::client(uds);
                let sock = s.worker_socket.clone().unwrap_or_default();
                self.supervisor
                    .wait_agent(&agent, build_id, &sock, None)
                    .await
                    .map_err(|e| match e {
                        BootError::Unsupported(m)
                        | BootError::Failed(m)
                        | BootError::Worker(m)
                        | BootError::Identity(m) => ApiError::new(Code::BootFailed, m),
                    })?;
            }
            let snap_id = Uuid::new_v4();
            let (a, row) = (self.clone(), s.clone());
            let w = tokio::task::spawn_blocking(move || {
                a.supervisor.snapshot(&row, ("", None), snap_id, false)
            })
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?
            .map_err(|e| ApiError::new(Code::SnapshotFailed, e))?;
            let snap = SnapshotRow {
                id: snap_id,
                // sproutd's own: no tenant's.
                tenant: String::new(),
                vm_id: None,
                name: Some(match runtime {
                    Runtime::Container => format!("{} {cpus} vCPU {memory_mb} MiB", image.name),
                    Runtime::Vm => format!("{} (vm) {cpus} vCPU {memory_mb} MiB", image.name),
                }),
                dir: w.dir,
                kind: SnapshotKind::Template,
                parent_id: None,
                depth: 1,
                image: image.name.clone(),
                runtime,
                cpus,
                memory_mb,
                env: Default::default(),
                size_bytes: w.size_bytes,
                created_ms: now_ms(),
                uploaded_ms: None,
                imported: false,
            };
            // The snapshot and the ready template in one write: garbage
            // collection never sees the one without the other.
            let row = snap.clone();
            let took = started.elapsed().as_millis() as u64;
            let recorded = self
                .db(move |r| {
                    r.insert_snapshot(&row)?;
                    r.put_template(&TemplateRow {
                        image: row.image.clone(),
                        runtime,
                        cpus,
                        memory_mb,
                        state: TemplateState::Ready,
                        snapshot_id: Some(row.id),
                        failure_reason: None,
                        build_id: None,
                        build_ms: Some(took),
                        updated_ms: now_ms(),
                        image_identity: identity,
                    })
                })
                .await;
            if let Err(e) = recorded {
                self.supervisor.remove_snapshot(&snap.dir);
                return Err(e);
            }
            Ok(snap)
        }
        .await;
        let a = self.clone();
        let stopped =
            tokio::task::spawn_blocking(move || a.supervisor.stop(&s, Some(worker))).await;
        if let Ok(Err(e)) = stopped {
            tracing::warn!(build = %build_id, "after a template build: {e}");
        }
        r
    }

    /// At start: builds a previous sproutd left unfinished are failed (the
    /// next create retries), and their VMs' directories removed.
    pub async fn recover_templates(self: &Arc<Self>) -> Result<(), ApiError> {
        let cut = self
            .db(|r| {
                let mut out = Vec::new();
                for mut t in r.list_templates()? {
                    if t.state != TemplateState::Building {
                        continue;
                    }
                    out.extend(t.build_id.take());
                    t.state = TemplateState::Failed;
                    t.failure_reason = Some("sproutd stopped during the build".into());
                    t.updated_ms = now_ms();
                    r.put_template(&t)?;
                }
                Ok(out)
            })
            .await?;
        for id in cut {
            let dir = self.supervisor.vm_dir(id);
            let sock: PathBuf = dir.join(CONTROL_SOCK);
            let s = Sandbox {
                state: VmState::Stopping,
                worker_socket: sock.symlink_metadata().is_ok().then_some(sock),
                ..Sandbox::starting(id, "", "", 1, 128, 0)
            };
            let a = self.clone();
            let r = tokio::task::spawn_blocking(move || a.supervisor.stop(&s, None)).await;
            if let Ok(Err(e)) = r {
                tracing::warn!(build = %id, "cleaning up a cut-short template build: {e}");
            }
        }
        Ok(())
    }
}

/// A template as the API shows it.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = Template)]
pub struct TemplateView {
    image: String,
    runtime: Runtime,
    cpus: u8,
    memory_mb: u32,
    state: TemplateState,
    /// Its snapshot, once ready.
    #[schema(required = true)]
    snapshot_id: Option<Uuid>,
    /// Why the last build failed (the next create retries it).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    failure_reason: Option<String>,
    /// How long the build took, once ready.
    #[schema(required = true)]
    build_ms: Option<u64>,
    #[schema(format = DateTime)]
    updated_at: String,
}

#[derive(Serialize, ToSchema)]
pub struct TemplateList {
    templates: Vec<TemplateView>,
}

errors!(TemplateErrors = []);

/// List templates
///
/// One per (image, runtime, shape) created so far: `building`, `ready`
/// (later creates restore it) or `failed` (with its reason; the next create
/// of that image, runtime and shape builds it again).
#[utoipa::path(get, path = "/v1/runtime/templates", operation_id = "listTemplates", tag = "sandboxes",
    responses((status = 200, description = "The templates", body = TemplateList), TemplateErrors))]
pub async fn list(State(app): State<Arc<App>>) -> Result<Json<TemplateList>, ApiError> {
    let all = app.db(|r| r.list_templates()).await?;
    Ok(Json(TemplateList {
        templates: all
            .into_iter()
            .map(|t| {
                let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(t.updated_ms);
                TemplateView {
                    image: t.image,
                    runtime: t.runtime,
                    cpus: t.cpus,
                    memory_mb: t.memory_mb,
                    state: t.state,
                    snapshot_id: t.snapshot_id,
                    failure_reason: t.failure_reason,
                    build_ms: t.build_ms.filter(|_| t.state == TemplateState::Ready),
                    updated_at: humantime::format_rfc3339_millis(at).to_string(),
                }
            })
            .collect(),
    }))
}

/// The `503 template_building` of a create that found its template being
/// built.
pub fn building(
    image: &str,
    (runtime, cpus, memory_mb): (Runtime, u8, u32),
    retry_after: u64,
) -> ApiError {
    let rt = match runtime {
        Runtime::Container => "",
        Runtime::Vm => " (runtime vm)",
    };
    ApiError::new(
        Code::TemplateBuilding,
        format!(
            "The template of {image}{rt} with {cpus} vCPUs and {memory_mb} MiB is being built \
             (a first create boots it once): retry after {retry_after} s; GET \
             /v1/runtime/templates shows it"
        ),
    )
    .retry_after(retry_after)
}

/// A create's restore of a template failed: the template is failed, and
/// the next create builds it again.
pub async fn failed(app: &Arc<App>, snap: &SnapshotRow, why: &str) {
    let (image, runtime, cpus, mem, sid, why) = (
        snap.image.clone(),
        snap.runtime,
        snap.cpus,
        snap.memory_mb,
        snap.id,
        format!("A create could not restore it: {why}"),
    );
    let r = app
        .db(move |r| {
            for mut t in r.list_templates()? {
                if t.image == image
                    && t.runtime == runtime
                    && t.cpus == cpus
                    && t.memory_mb == mem
                    && t.snapshot_id == Some(sid)
                {
                    t.state = TemplateState::Failed;
                    t.failure_reason = Some(why.clone());
                    t.snapshot_id = None;
                    t.updated_ms = now_ms();
                    r.put_template(&t)?;
                }
            }
            Ok(())
        })
        .await;
    if let Err(e) = r {
        tracing::warn!(
            "marking a template failed: {}",
            chain(&std::io::Error::other(e.message))
        );
    }
}
