//! The HTTP surface: the router, its layers (request ids, logs, body limit,
//! panics, the error envelope on every error answer) and the sandbox
//! endpoints. Exec is in [`super::exec`].

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{FromRequest, Path, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;
use utoipa::{OpenApi as _, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::error::{ApiError, Code};
use super::exec_limits::{ExecLimitArgs, ExecLimits, ExecLimitsView};
use super::images::TEST_GUEST_IMAGE;
use super::openapi::errors;
use super::registry::{Runtime, Sandbox, State as VmState};
use super::supervisor::BootError;
use super::tenants::Caller;
use super::{lock, now_ms, App, MAX_BODY};

type AppState = State<Arc<App>>;
type Limits = axum::Extension<Arc<ExecLimits>>;

/// Every endpoint with its documentation: the router and the OpenAPI
/// document ([`super::openapi`]) are both made from this one list, so no
/// route is served undocumented. Raw files stream with no cap; every other
/// body is limited to [`MAX_BODY`].
pub fn api() -> OpenApiRouter<Arc<App>> {
    use super::{exec, files, procs, rest};
    let limited = OpenApiRouter::with_openapi(super::openapi::ApiDoc::openapi())
        .routes(routes!(health))
        .routes(routes!(info))
        .routes(routes!(openapi_json))
        .routes(routes!(metrics))
        .routes(routes!(schedule))
        .routes(routes!(super::templates::list))
        .routes(routes!(list))
        .routes(routes!(get_vm, delete_vm))
        .routes(routes!(exec::exec))
        .routes(routes!(files::list, files::remove))
        .routes(routes!(files::get_content, files::put_content))
        .routes(routes!(files::mkdir))
        .routes(routes!(procs::list))
        .routes(routes!(procs::events))
        .routes(routes!(procs::stdin))
        .routes(routes!(procs::signal))
        .routes(routes!(rest::pause))
        .routes(routes!(rest::resume))
        .routes(routes!(rest::sleep))
        .routes(routes!(rest::hibernate))
        .routes(routes!(rest::wake))
        .routes(routes!(rest::reboot))
        .routes(routes!(rest::archive))
        .routes(routes!(rest::unarchive))
        .routes(routes!(rest::snapshot))
        .routes(routes!(rest::fork))
        .routes(routes!(rest::create_checkpoint, rest::list_checkpoints))
        .routes(routes!(rest::restore_checkpoint))
        .routes(routes!(rest::spawn_checkpoint))
        .routes(routes!(rest::delete_checkpoint))
        .routes(routes!(rest::list_snapshots))
        .routes(routes!(rest::get_snapshot, rest::delete_snapshot))
        .routes(routes!(super::ports::open, super::ports::list))
        .routes(routes!(super::ports::close))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .layer(tower_http::limit::RequestBodyLimitLayer::new(MAX_BODY));
    let raw = OpenApiRouter::new().routes(routes!(files::get_raw, files::put_raw));
    limited.merge(raw)
}

pub fn router(app: Arc<App>, limits: &ExecLimitArgs) -> Router {
    let (api, _) = api().split_for_parts();
    let ports = axum::middleware::from_fn_with_state(app.clone(), super::ports::proxy);
    api.merge(super::dashboard::router())
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            super::tenants::authenticate,
        ))
        .layer(axum::middleware::from_fn_with_state(app.clone(), count))
        .with_state(app)
        .layer(axum::Extension(ExecLimits::new(limits)))
        .layer(tower_http::catch_panic::CatchPanicLayer::new())
        .layer(axum::middleware::map_response(envelope))
        // Outside the envelope: a guest's own error answers pass untouched.
        .layer(ports)
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(TraceLayer::new_for_http().make_span_with(|req: &Request| {
            let id = req
                .headers()
                .get("x-request-id")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-");
            tracing::info_span!("request", id, method = %req.method(), uri = %req.uri())
        }))
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
}

/// Counts each answer by its route template (never the raw path: ids would
/// make a series each).
async fn count(State(app): AppState, req: Request, next: axum::middleware::Next) -> Response {
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or("unmatched", |p| p.as_str())
        .to_owned();
    let method = req.method().to_string();
    let resp = next.run(req).await;
    app.metrics.request(&route, &method, resp.status().as_u16());
    resp
}

errors!(MetricsErrors = [Forbidden]);

/// Prometheus metrics
///
/// Text format 0.0.4: `sproutd_sandboxes{state}` (read from the registry at
/// each scrape), `sproutd_http_requests_total{route,method,status}` (by
/// route template, `unmatched` for unknown routes), the histograms
/// `sproutd_create_seconds` and `sproutd_exec_seconds`, the memory gauges
/// `process_resident_memory_bytes` and `sproutd_peak_resident_memory_bytes`,
/// and the exec limits' `sproutd_execs_in_flight` and
/// `sproutd_execs_refused_total{limit="sandbox"|"global"}`.
#[utoipa::path(get, path = "/metrics", operation_id = "metrics", tag = "service",
    responses(
        (status = 200, description = "The metrics", body = String,
            content_type = "text/plain; version=0.0.4; charset=utf-8"),
        MetricsErrors,
    ))]
async fn metrics(
    State(app): AppState,
    caller: Caller,
    limits: Limits,
) -> Result<Response, ApiError> {
    if !caller.0.operator {
        return Err(ApiError::new(
            Code::Forbidden,
            format!(
                "Tenant {:?} is not an operator: /metrics shows the whole service (operator = \
                 true in the tenants file)",
                caller.name()
            ),
        ));
    }
    let all = app.db(|r| r.list_sandboxes()).await?;
    let by_state: Vec<(&str, u64)> = VmState::ALL
        .iter()
        .map(|st| {
            (
                st.as_str(),
                all.iter().filter(|s| s.state == *st).count() as u64,
            )
        })
        .collect();
    let mut text = app.metrics.render(&by_state);
    limits.render_metrics(&mut text);
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

async fn not_found(req: Request) -> ApiError {
    ApiError::new(
        Code::NotFound,
        format!("No route {} {}", req.method(), req.uri().path()),
    )
}

/// Gives every error answer that is not already the envelope (axum's own
/// 405, the body limit's 413, a caught panic's 500) the envelope, keeping
/// its status and headers; a 413 closes the connection.
async fn envelope(mut resp: Response) -> Response {
    let status = resp.status();
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        // The rest of the body is not read: the connection cannot carry
        // another request, and the client must not try to.
        resp.headers_mut().insert(
            header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
    }
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = axum::body::to_bytes(body, 1024)
        .await
        .ok()
        .and_then(|b| String::from_utf8(b.to_vec()).ok())
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty());
    let code = Code::for_status(status);
    let message = match code {
        // A panic's text is no business of the client's.
        Code::Internal => "Internal error".to_owned(),
        // axum adds the Allow header after this layer.
        Code::MethodNotAllowed => "This method is not allowed here (see the Allow header)".into(),
        Code::PayloadTooLarge => format!("The request body is over the {MAX_BODY}-byte limit"),
        _ => text.unwrap_or_else(|| status.canonical_reason().unwrap_or("Error").to_owned()),
    };
    let mut fresh = ApiError::new(code, message).into_response();
    *fresh.status_mut() = status;
    for (k, v) in parts.headers.iter() {
        if k != header::CONTENT_TYPE && k != header::CONTENT_LENGTH {
            fresh.headers_mut().append(k.clone(), v.clone());
        }
    }
    fresh
}

/// A JSON request body: `T` (strict: unknown fields are refused), with
/// every failure as the envelope. An empty body is `{}`.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let json_type = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| {
                let mime = v.split(';').next().unwrap_or("").trim();
                mime.eq_ignore_ascii_case("application/json")
            });
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            let status = e.status();
            ApiError::new(
                Code::for_status(status),
                if status == StatusCode::PAYLOAD_TOO_LARGE {
                    format!("The request body is over the {MAX_BODY}-byte limit")
                } else {
                    format!("Cannot read the request body: {e}")
                },
            )
        })?;
        let bytes: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
            b"{}"
        } else {
            if json_type == Some(false) || json_type.is_none() {
                return Err(ApiError::new(
                    Code::UnsupportedMediaType,
                    "The request body must be JSON (Content-Type: application/json)",
                ));
            }
            &bytes
        };
        serde_json::from_slice(bytes).map(ApiJson).map_err(|e| {
            use serde_json::error::Category;
            match e.classify() {
                Category::Data => {
                    ApiError::new(Code::InvalidBody, format!("Bad request body: {e}"))
                }
                _ => ApiError::new(
                    Code::InvalidJson,
                    format!("The body is not valid JSON: {e}"),
                ),
            }
        })
    }
}

#[derive(Serialize, ToSchema)]
struct Health {
    #[schema(example = "ok")]
    status: &'static str,
}

errors!(HealthErrors = []);

/// Liveness: `{"status": "ok"}` while sproutd serves
#[utoipa::path(get, path = "/v1/health", operation_id = "health", tag = "service",
    responses((status = 200, description = "sproutd serves", body = Health), HealthErrors))]
async fn health() -> Json<Health> {
    Json(Health { status: "ok" })
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct Info {
    /// sproutd's version.
    version: &'static str,
    host_mode: HostModeView,
    /// The images a sandbox can be made from.
    images: Vec<super::registry::Image>,
    /// Where the registry and sandboxes live (shown to an operator tenant
    /// only, with `--tenants`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    data_dir: Option<String>,
    exec_limits: ExecLimitsView,
    /// The caller's tenant and its quota.
    tenant: TenantView,
    network: NetworkView,
}

/// What network sandboxes get here.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = Network)]
struct NetworkView {
    /// Whether sandboxes reach the network (unless `disableInternet`).
    egress: bool,
    /// Whether guest ports are served (`POST /vms/{id}/ports`).
    ports: bool,
    /// Why sandboxes have no network here, when they have none (they run
    /// without one; guest ports are still served, through the agent).
    #[schema(required = true)]
    reason: Option<String>,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = Tenant)]
struct TenantView {
    /// `default` when sproutd runs without `--tenants`.
    name: String,
    /// Sandboxes it may run at once (none: no limit).
    #[schema(required = true)]
    slots: Option<u32>,
    /// Slots held now: its starting, running and stopping sandboxes.
    slots_in_use: u32,
    /// Execs it may have in flight at once (none: no limit).
    #[schema(required = true)]
    max_execs: Option<u32>,
    /// Its execs in flight now.
    execs_in_flight: u32,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = HostMode)]
struct HostModeView {
    /// Whether this host's KVM runs Linux guests (hardware virtualization,
    /// or the emulated lab).
    linux_guests: bool,
    /// Why not, when not.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    reason: Option<String>,
    /// Whether this sproutd runs inside the emulated lab (for a host that
    /// cannot run Linux guests itself).
    lab: bool,
    /// In the lab: that latencies there are emulated.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    note: Option<&'static str>,
}

errors!(InfoErrors = []);

/// The version, the host mode, the images and the exec limits
///
/// Images are found at start in `<cache>/images/NAME.ext4` (the cache is
/// `$SPROUT_CACHE` or `~/.cache/sprout`); `testguest` is there when the test
/// guest is built.
#[utoipa::path(get, path = "/v1/info", operation_id = "info", tag = "service",
    responses((status = 200, description = "What this sproutd is", body = Info), InfoErrors))]
async fn info(
    State(app): AppState,
    caller: Caller,
    limits: Limits,
) -> Result<Json<Info>, ApiError> {
    let name = caller.name().to_owned();
    let held = app.db(move |r| r.slot_holders(&name)).await?;
    let policy = app.tenants.policy(caller.name());
    let mut in_use = held;
    in_use.extend(app.slots.pending(caller.name()));
    Ok(Json(Info {
        version: env!("CARGO_PKG_VERSION"),
        host_mode: HostModeView {
            linux_guests: app.host.linux_guests,
            reason: app.host.reason.clone(),
            lab: app.host.lab,
            note: app.host.lab.then_some(super::lab::EMULATED_NOTE),
        },
        images: app.images.iter().cloned().chain(app.oci.list()).collect(),
        data_dir: caller
            .0
            .operator
            .then(|| app.data_dir.display().to_string()),
        exec_limits: limits.view(caller.0.operator),
        tenant: TenantView {
            name: caller.name().to_owned(),
            slots: policy.slots,
            slots_in_use: in_use.len() as u32,
            max_execs: policy.max_execs,
            execs_in_flight: limits.tenant_in_flight(caller.name()),
        },
        network: NetworkView {
            egress: app.network.egress(),
            ports: true,
            reason: app.network.unavailable().map(str::to_owned),
        },
    }))
}

errors!(OpenapiErrors = []);

/// This document (OpenAPI 3.1), as docs/openapi.json has it
#[utoipa::path(get, path = "/v1/openapi.json", operation_id = "openapi", tag = "service",
    responses((status = 200, description = "The OpenAPI document", body = Object,
        content_type = "application/json"), OpenapiErrors))]
async fn openapi_json() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        super::openapi::json(),
    )
        .into_response()
}

// Numbers are read wide so that a value out of range is told as such,
// naming its field.
/// A sandbox to create; every field is optional.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(as = ScheduleRequest)]
struct ScheduleReq {
    /// An image `/v1/info` lists, or an OCI reference
    /// (`registry.example:5000/app:1`, `oci:/path/to/layout:tag`).
    #[schema(default = "default", example = "default")]
    image: Option<String>,
    /// How the guest comes up: `container` (default), Sprout's agent as
    /// PID 1 starting the image's entrypoint; or `vm`, the image's own
    /// systemd as PID 1 starting the agent as a service (an OCI image
    /// whose `/sbin/init` is systemd; `/v1/info` lists each image's
    /// runtimes).
    #[schema(default = "container")]
    runtime: Option<Runtime>,
    /// A snapshot (or checkpoint) id: the sandbox is restored from it, in
    /// its image and shape (then `image`, `cpus` and `memoryMb` must not be
    /// given), with its guest re-identified before its first exec.
    snapshot: Option<String>,
    #[schema(minimum = 1, maximum = 4, default = 2)]
    cpus: Option<i64>,
    #[schema(minimum = 128, maximum = 8192, default = 1024)]
    memory_mb: Option<i64>,
    /// Stored and shown; enforced by a later issue (sandboxes have no
    /// network yet).
    #[schema(default = false)]
    disable_internet: Option<bool>,
    /// Seconds without an exec, file or process call after which the
    /// sandbox is put to sleep (the next call wakes it). Unset: never.
    #[schema(minimum = 1, maximum = 2592000)]
    idle_timeout_secs: Option<i64>,
    /// The base environment of every exec in the sandbox (at most 256
    /// variables, 32 KiB; names without `=` or NUL, not starting with a
    /// digit). Not shown back.
    env: Option<BTreeMap<String, String>>,
    /// At most 64 keys of 1-128 bytes, values up to 1024 bytes.
    metadata: Option<BTreeMap<String, String>>,
}

pub const MAX_METADATA: usize = 64;
pub const MAX_METADATA_KEY: usize = 128;
pub const MAX_METADATA_VALUE: usize = 1024;
pub const MAX_ENV: usize = 256;
pub const MAX_ENV_BYTES: usize = 32 * 1024;
const MAX_IDLE_TIMEOUT: i64 = 30 * 24 * 3600;

fn range(field: &'static str, v: i64, lo: i64, hi: i64) -> Result<i64, ApiError> {
    if (lo..=hi).contains(&v) {
        Ok(v)
    } else {
        Err(ApiError::field(
            field,
            format!("{field} is {v}: it must be {lo} to {hi}"),
        ))
    }
}

/// Checks environment variables (names and values as execve takes them).
pub fn check_env(field: &'static str, env: &BTreeMap<String, String>) -> Result<(), ApiError> {
    if env.len() > MAX_ENV {
        return Err(ApiError::field(
            field,
            format!("{field} has {} variables: at most {MAX_ENV}", env.len()),
        ));
    }
    let mut bytes = 0;
    for (k, v) in env {
        let bad_name =
            k.is_empty() || k.contains('=') || k.contains('\0') || k.as_bytes()[0].is_ascii_digit();
        if bad_name {
            return Err(ApiError::field(
                field,
                format!("{field}: {k:?} is not a variable name"),
            ));
        }
        if v.contains('\0') {
            return Err(ApiError::field(
                field,
                format!("{field}: the value of {k} holds a NUL byte"),
            ));
        }
        bytes += k.len() + v.len() + 2;
    }
    if bytes > MAX_ENV_BYTES {
        return Err(ApiError::field(
            field,
            format!("{field} is {bytes} bytes: at most {MAX_ENV_BYTES}"),
        ));
    }
    Ok(())
}

fn check_metadata(m: &BTreeMap<String, String>) -> Result<(), ApiError> {
    if m.len() > MAX_METADATA {
        return Err(ApiError::field(
            "metadata",
            format!("metadata has {} keys: at most {MAX_METADATA}", m.len()),
        ));
    }
    for (k, v) in m {
        if k.is_empty() || k.len() > MAX_METADATA_KEY {
            return Err(ApiError::field(
                "metadata",
                format!("metadata key {k:?}: keys are 1 to {MAX_METADATA_KEY} bytes"),
            ));
        }
        if v.len() > MAX_METADATA_VALUE {
            return Err(ApiError::field(
                "metadata",
                format!("metadata value of {k:?}: values are at most {MAX_METADATA_VALUE} bytes"),
            ));
        }
    }
    Ok(())
}

/// A sandbox as the API shows it.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = Vm)]
pub struct VmView {
    /// Issued by sproutd.
    vm_id: Uuid,
    state: VmState,
    image: String,
    runtime: Runtime,
    cpus: u8,
    memory_mb: u32,
    disable_internet: bool,
    #[schema(required = true)]
    idle_timeout_secs: Option<u32>,
    metadata: BTreeMap<String, String>,
    /// RFC 3339 UTC with milliseconds.
    #[schema(format = DateTime)]
    created_at: String,
    /// The snapshot it was made from (a schedule from a snapshot, a fork,
    /// a checkpoint's spawn); null for a boot.
    #[schema(required = true)]
    snapshot_id: Option<Uuid>,
    /// The sandbox it was forked from.
    #[schema(required = true)]
    parent_vm_id: Option<Uuid>,
    /// Its guest's host name, kept across sleeps and wakes (null for the
    /// test guest).
    #[schema(required = true)]
    hostname: Option<String>,
    /// Why, when `failed`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    failure_reason: Option<String>,
    /// The sandbox's worker process, once started.
    #[schema(required = true)]
    worker_pid: Option<u32>,
}

impl From<Sandbox> for VmView {
    fn from(s: Sandbox) -> Self {
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(s.created_ms);
        Self {
            vm_id: s.id,
            state: s.state,
            image: s.image,
            runtime: s.runtime,
            cpus: s.cpus,
            memory_mb: s.memory_mb,
            disable_internet: s.disable_internet,
            idle_timeout_secs: s.idle_timeout_secs,
            metadata: s.metadata,
            created_at: humantime::format_rfc3339_millis(at).to_string(),
            snapshot_id: s.snapshot_id,
            parent_vm_id: s.parent_vm_id,
            hostname: s.hostname,
            failure_reason: s.failure_reason,
            worker_pid: s.pid,
        }
    }
}

errors!(
    ScheduleErrors = [
        InvalidJson,
        InvalidBody,
        InvalidValue,
        UnknownImage,
        SnapshotNotFound,
        UnsupportedMediaType,
        PayloadTooLarge,
        HostUnsupported,
        TemplateBuilding,
        ImagePulling,
        BadImageReference,
        ImageNotFound,
        ImagePlatform,
        ImageUnsupported,
        ImageTooLarge,
        RegistryUnreachable,
        RegistryAuth,
        RegistryError,
        ImageCorrupt,
        ImageBuildFailed,
        BootFailed,
        SnapshotFailed,
        WorkerFailed,
        AgentUnavailable,
        QuotaExhausted,
    ]
);

/// Create a sandbox
///
/// Answers once it runs: its worker process is started, its VM booted from
/// the image (read-only) with a private writable disk, and, for a Linux
/// image, its agent answers. Every field is optional. The boot goes on if
/// the client goes away; a sandbox that fails to start stays listed as
/// `failed` with its `failureReason`, and the answer is `502 boot_failed`.
/// With `snapshot`, the sandbox is restored from that snapshot instead of
/// booted (`502 snapshot_failed` if it cannot be).
///
/// `image` may be an OCI reference (`REGISTRY[:PORT]/NAME[:TAG|@DIGEST]`,
/// or `oci:/PATH[:TAG]` for a local image layout): it is pulled and made
/// into a base image once per digest; a create that finds the pull under
/// way for more than 20 s is answered `503 image_pulling` with
/// `Retry-After` (the pull goes on). The sandbox's `image` is then the
/// reference pinned to its digest (`...@sha256:...`), and the image's
/// entrypoint runs as its main process (its first background process).
#[utoipa::path(post, path = "/v1/runtime/schedule", operation_id = "schedule", tag = "sandboxes",
    request_body(content = Option<ScheduleReq>, description = "Empty counts as `{}`"),
    responses((status = 201, description = "The sandbox, running", body = VmView), ScheduleErrors))]
async fn schedule(
    State(app): AppState,
    caller: Caller,
    ApiJson(req): ApiJson<ScheduleReq>,
) -> Result<(StatusCode, Json<VmView>), ApiError> {
    if let Some(snap) = &req.snapshot {
        for (given, field) in [
            (req.image.is_some(), "image"),
            (req.runtime.is_some(), "runtime"),
            (req.cpus.is_some(), "cpus"),
            (req.memory_mb.is_some(), "memoryMb"),
        ] {
            if given {
                return Err(ApiError::field(
                    field,
                    format!("{field} cannot be given with snapshot: the snapshot's is used"),
                ));
            }
        }
        let idle = req
            .idle_timeout_secs
            .map(|v| range("idleTimeoutSecs", v, 1, MAX_IDLE_TIMEOUT))
            .transpose()?
            .map(|v| v as u32);
        if let Some(env) = &req.env {
            check_env("env", env)?;
        }
        let metadata = req.metadata.unwrap_or_default();
        check_metadata(&metadata)?;
        let snap = super::rest::for_schedule(&app, &caller, snap).await?;
        if snap.image != TEST_GUEST_IMAGE && !app.host.linux_guests {
            return Err(host_unsupported(&app));
        }
        let id = Uuid::new_v4();
        let slot = app.hold_slots(caller.name(), vec![id]).await?;
        let t = std::time::Instant::now();
        let opts = super::rest::FromSnapshot {
            disable_internet: req.disable_internet.unwrap_or(false),
            idle_timeout_secs: idle,
            metadata,
        };
        let s = super::rest::from_snapshot(&app, &caller, &snap, req.env, opts, (id, slot)).await?;
        app.metrics.create.observe(t.elapsed());
        return Ok((StatusCode::CREATED, Json(s.into())));
    }
    let image = req.image.unwrap_or_else(|| "default".into());
    let runtime = req.runtime.unwrap_or_default();
    let cpus = range("cpus", req.cpus.unwrap_or(2), 1, 4)? as u8;
    let memory_mb = range("memoryMb", req.memory_mb.unwrap_or(1024), 128, 8192)? as u32;
    let idle = req
        .idle_timeout_secs
        .map(|v| range("idleTimeoutSecs", v, 1, MAX_IDLE_TIMEOUT))
        .transpose()?
        .map(|v| v as u32);
    let env = req.env.unwrap_or_default();
    check_env("env", &env)?;
    let metadata = req.metadata.unwrap_or_default();
    check_metadata(&metadata)?;
    let oci = crate::oci::is_oci(&image);
    if oci {
        // A malformed reference is the client's mistake on any host.
        if let Err(e) = crate::oci::parse(&image) {
            let e = crate::oci::OciError::from(e);
            return Err(
                ApiError::new(super::oci_images::code_of(&e), super::error::chain(&e))
                    .with_field("image"),
            );
        }
        if !app.host.linux_guests {
            return Err(host_unsupported(&app));
        }
    }
    let found = if oci {
        Some(app.oci.image(&image).await?)
    } else {
        app.images.iter().find(|i| i.name == image).cloned()
    };
    let Some(img) = found else {
        let known: Vec<&str> = app.images.iter().map(|i| i.name.as_str()).collect();
        return Err(ApiError::new(
            Code::UnknownImage,
            format!(
                "No image {image:?} is built here (images: {}; or an OCI reference, \
                 REGISTRY/NAME:TAG or oci:/PATH:TAG)",
                if known.is_empty() {
                    "none".to_owned()
                } else {
                    known.join(", ")
                }
            ),
        )
        .with_field("image"));
    };
    if !img.runtimes.contains(&runtime) {
        return Err(ApiError::new(
            Code::ImageUnsupported,
            format!(
                "Image {} cannot run as runtime {}: the vm runtime needs an OCI image whose \
                 /sbin/init is systemd (its runtimes: {})",
                img.name,
                runtime.as_str(),
                img.runtimes
                    .iter()
                    .map(|r| r.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
        .with_field("runtime"));
    }
    // An OCI image's sandbox records it pinned to its digest.
    let image = img.name.clone();
    if image != TEST_GUEST_IMAGE && !app.host.linux_guests {
        return Err(host_unsupported(&app));
    }
    let disable_internet = req.disable_internet.unwrap_or(false);
    // A slot first: with none free, nothing is booted (not even a
    // template's build).
    let id = Uuid::new_v4();
    let slot = app.hold_slots(caller.name(), vec![id]).await?;
    if app.templates {
        let t = std::time::Instant::now();
        match app.template_for(&img, runtime, cpus, memory_mb).await? {
            super::templates::Lookup::Building(secs) => {
                let key = (runtime, cpus, memory_mb);
                return Err(super::templates::building(&image, key, secs));
            }
            super::templates::Lookup::Ready(snap) => {
                let opts = super::rest::FromSnapshot {
                    disable_internet,
                    idle_timeout_secs: idle,
                    metadata,
                };
                let s =
                    super::rest::from_snapshot(&app, &caller, &snap, Some(env), opts, (id, slot))
                        .await;
                app.metrics.create.observe(t.elapsed());
                return match s {
                    Ok(s) => Ok((StatusCode::CREATED, Json(s.into()))),
                    Err(e) => {
                        if e.code == Code::SnapshotFailed {
                            super::templates::failed(&app, &snap, &e.message).await;
                        }
                        Err(e)
                    }
                };
            }
        }
    }
    let t = std::time::Instant::now();
    let s = Sandbox {
        runtime,
        disable_internet,
        idle_timeout_secs: idle,
        env,
        metadata,
        ..Sandbox::starting(id, caller.name(), &image, cpus, memory_mb, now_ms())
    };
    let row = s.clone();
    app.db(move |r| r.insert_sandbox(&row)).await?;
    // Recorded `starting`: the registry holds its slot from here.
    drop(slot);
    tracing::info!(vm = %s.id, image = %s.image, "scheduling");
    // The boot goes on whatever happens to this request.
    let task = tokio::spawn(start(app.clone(), s.clone(), img.path));
    let started = task
        .await
        .map_err(|e| ApiError::internal(format!("the boot task failed: {e}")))?;
    app.metrics.create.observe(t.elapsed());
    let id = s.id;
    if let Err(e) = started {
        let (code, why) = match &e {
            BootError::Unsupported(m) => (Code::HostUnsupported, m.clone()),
            BootError::Failed(m) => (Code::BootFailed, m.clone()),
            BootError::Worker(m) => (Code::WorkerFailed, m.clone()),
            BootError::Identity(m) => (Code::AgentUnavailable, m.clone()),
        };
        let reason = why.clone();
        app.db(move |r| r.set_state(id, VmState::Failed, Some(&reason)))
            .await?;
        tracing::warn!(vm = %id, "failed to start: {why}");
        return Err(ApiError::new(
            code,
            format!("Sandbox {id} failed to start: {why}"),
        ));
    }
    let s = app.sandbox(&caller, &id.to_string()).await?;
    Ok((StatusCode::CREATED, Json(s.into())))
}

fn host_unsupported(app: &App) -> ApiError {
    ApiError::new(
        Code::HostUnsupported,
        format!(
            "This host cannot run Linux guests: {} (see /v1/info)",
            app.host.reason.as_deref().unwrap_or("unknown")
        ),
    )
}

/// Boots `s`'s worker and waits for its agent (giving its guest its host
/// name); records each step.
async fn start(app: Arc<App>, s: Sandbox, image: std::path::PathBuf) -> Result<(), BootError> {
    let a = app.clone();
    let row = s.clone();
    let booted =
        tokio::task::spawn_blocking(move || a.supervisor.boot(&row, Some(&image), Some(&a.pool)))
            .await
            .map_err(|e| BootError::Failed(format!("the boot task failed: {e}")))??;
    tracing::info!(vm = %s.id, pid = booted.worker.pid(), "worker up, VM booting");
    let t = std::time::Instant::now();
    let r = app.start_booted(&s, booted).await;
    // The next cold boot of this shape takes a ready worker; it starts
    // once this sandbox answers (on a small host they would share the CPU).
    super::pool::refill_later(&app, super::lifecycle::shape_of(&s));
    r.map_err(|e| BootError::Failed(e.message))?;
    tracing::info!(vm = %s.id, "running after {} ms", t.elapsed().as_millis());
    Ok(())
}

#[derive(Serialize, ToSchema)]
struct VmList {
    /// Oldest first.
    vms: Vec<VmView>,
}

errors!(ListErrors = [BadRequest]);

/// List sandboxes
///
/// Every sandbox, oldest first. Filter by metadata with `metadata.KEY=VALUE`
/// query parameters (repeatable; all must match), e.g.
/// `?metadata.team=infra`. Any other parameter is `400 bad_request`.
#[utoipa::path(get, path = "/v1/runtime/vms", operation_id = "listVms", tag = "sandboxes",
    responses((status = 200, description = "The sandboxes", body = VmList), ListErrors))]
async fn list(
    State(app): AppState,
    caller: Caller,
    query: Result<Query<Vec<(String, String)>>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<VmList>, ApiError> {
    let Query(pairs) =
        query.map_err(|e| ApiError::new(Code::BadRequest, format!("Bad query string: {e}")))?;
    let mut want = Vec::new();
    for (k, v) in pairs {
        match k.strip_prefix("metadata.") {
            Some(key) if !key.is_empty() => want.push((key.to_owned(), v)),
            _ => {
                return Err(ApiError::new(
                    Code::BadRequest,
                    format!("Unknown query parameter {k:?} (filter with metadata.KEY=VALUE)"),
                ))
            }
        }
    }
    let all = app.db(|r| r.list_sandboxes()).await?;
    let vms: Vec<VmView> = all
        .into_iter()
        .filter(|s| caller.owns(&s.tenant))
        .filter(|s| {
            want.iter()
                .all(|(k, v)| s.metadata.get(k).is_some_and(|x| x == v))
        })
        .map(VmView::from)
        .collect();
    Ok(Json(VmList { vms }))
}

errors!(GetVmErrors = [VmNotFound]);

/// Get a sandbox
#[utoipa::path(get, path = "/v1/runtime/vms/{id}", operation_id = "getVm", tag = "sandboxes",
    params(("id" = String, Path, description = "The sandbox's id")),
    responses((status = 200, description = "The sandbox", body = VmView), GetVmErrors))]
async fn get_vm(
    State(app): AppState,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<VmView>, ApiError> {
    Ok(Json(app.sandbox(&caller, &id).await?.into()))
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
struct Deleted {
    vm_id: Uuid,
    /// Always true.
    deleted: bool,
}

errors!(DeleteVmErrors = [VmNotFound, InvalidState, WorkerFailed, StoreFailed]);

/// Delete a sandbox
///
/// Stops the sandbox's worker (the VM ends), waits for it to exit, removes
/// the sandbox's files and its record. `409 invalid_state` while it is
/// `starting`; `502 worker_failed` if the worker would not exit (the
/// sandbox is then `failed`).
#[utoipa::path(delete, path = "/v1/runtime/vms/{id}", operation_id = "deleteVm", tag = "sandboxes",
    params(("id" = String, Path, description = "The sandbox's id")),
    responses((status = 200, description = "Deleted", body = Deleted), DeleteVmErrors))]
async fn delete_vm(
    State(app): AppState,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Deleted>, ApiError> {
    let vm = app.sandbox(&caller, &id).await?.id;
    let a = app.clone();
    super::lifecycle::detached(async move { delete(a, vm).await }).await?;
    tracing::info!(vm = %vm, "deleted");
    Ok(Json(Deleted {
        vm_id: vm,
        deleted: true,
    }))
}

/// Deletes sandbox `vm`, after any transition under way; its checkpoints
/// go with it.
async fn delete(app: Arc<App>, vm: Uuid) -> Result<(), ApiError> {
    let _g = app.lifecycle.lock_of(vm).write_owned().await;
    // Looked at again under its lock (the caller's it was).
    let s = app
        .db(move |r| r.get_sandbox(vm))
        .await?
        .ok_or_else(|| ApiError::vm_not_found(&vm.to_string()))?;
    if s.state == VmState::Starting {
        return Err(ApiError::in_state(
            Code::InvalidState,
            s.state.as_str(),
            format!("Sandbox {vm} is starting: delete it once it runs or fails"),
        ));
    }
    if let (VmState::Archived, Some(m), Some(rest)) =
        (s.state, app.mirror.as_ref(), s.rest_snapshot_id)
    {
        // Its record goes first: no node may bring back what is deleted.
        // It is claimed first (as an unarchive would), so an unarchive on
        // another node either wins the record or finds it gone; while
        // another node's claim is live, the delete waits (409). If the
        // record is gone, another node has taken it, or it names another
        // rest snapshot, another node has the sandbox (or archived it
        // again) on these objects: they are that node's, not deleted
        // here.
        let here = m
            .get_archive(&s.tenant, vm)
            .await
            .map_err(|e| ApiError::new(Code::StoreFailed, e))?;
        let ours = match here {
            Some(h) if h.rec.rest_snapshot_id() == rest => match h.rec.live_claim(None) {
                // Another node is bringing it back: whether it is still to be
                // had is known only once that node is done.
                Some(c) if !c.taken => {
                    return Err(ApiError::in_state(
                        Code::InvalidState,
                        "archived",
                        format!(
                            "Sandbox {vm} is being unarchived by node {}: delete it once that \
                             is done (there, if it runs there)",
                            c.node
                        ),
                    ))
                }
                Some(_) => false,
                None => {
                    let won = m
                        .claim_archive(h)
                        .await
                        .map_err(|e| ApiError::new(Code::StoreFailed, e))?;
                    if won.is_none() {
                        return Err(ApiError::in_state(
                            Code::InvalidState,
                            "archived",
                            format!(
                                "Sandbox {vm}'s archive record changed while this node deleted \
                                 it (another node is unarchiving it): try again"
                            ),
                        ));
                    }
                    true
                }
            },
            _ => false,
        };
        if ours {
            m.delete_archive(&s.tenant, vm)
                .await
                .map_err(|e| ApiError::new(Code::StoreFailed, e))?;
        } else {
            app.db(move |r| r.disown_chain(rest)).await?;
        }
    }
    app.db(move |r| r.set_state(vm, VmState::Stopping, None))
        .await?;
    let child = lock(&app.children).remove(&vm);
    lock(&app.agents).remove(&vm);
    let a = app.clone();
    let stopped = tokio::task::spawn_blocking(move || a.supervisor.stop(&s, child))
        .await
        .map_err(|e| ApiError::internal(format!("the stop task failed: {e}")))?;
    if let Err(why) = stopped {
        let reason = why.clone();
        app.db(move |r| r.set_state(vm, VmState::Failed, Some(&reason)))
            .await?;
        return Err(ApiError::new(
            Code::WorkerFailed,
            format!("Cannot delete {vm}: {why}"),
        ));
    }
    app.db(move |r| {
        for c in r.list_snapshots()? {
            if c.vm_id == Some(vm) && c.kind == super::registry::SnapshotKind::Checkpoint {
                r.set_snapshot_kind(c.id, super::registry::SnapshotKind::Dropped)?;
            }
        }
        r.delete_sandbox(vm)
    })
    .await?;
    app.lifecycle.forget(vm);
    app.network.release(vm);
    app.collect_garbage().await;
    Ok(())
}
