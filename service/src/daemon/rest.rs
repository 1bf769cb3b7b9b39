//! The rest-state endpoints (docs/api.md, "Rest states"): pause, resume,
//! sleep, hibernate, wake, reboot, snapshot, fork, checkpoints and
//! snapshots. The transitions themselves are [`super::lifecycle`]'s.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use super::error::{ApiError, Code};
use super::lifecycle::detached;
use super::openapi::errors;
use super::registry::{Runtime, Sandbox, SnapshotKind, SnapshotRow, State as VmState};
use super::routes::{ApiJson, VmView};
use super::tenants::{Caller, SlotHold};
use super::{now_ms, App};

type AppState = State<Arc<App>>;

/// Most checkpoints one sandbox keeps.
pub const MAX_CHECKPOINTS: usize = 10;
/// Most children of one fork.
pub const MAX_FORK: i64 = 100;
/// Longest checkpoint name.
const MAX_NAME: usize = 128;

async fn vm_id(app: &Arc<App>, caller: &Caller, id: &str) -> Result<Uuid, ApiError> {
    Ok(app.sandbox(caller, id).await?.id)
}

errors!(TransitionErrors = [VmNotFound, InvalidState, WorkerFailed]);
errors!(ResumeErrors = [VmNotFound, InvalidState, WorkerFailed, QuotaExhausted]);
errors!(SuspendErrors = [VmNotFound, InvalidState, WorkerFailed, SnapshotFailed]);
errors!(
    WakeErrors = [
        VmNotFound,
        InvalidState,
        WorkerFailed,
        SnapshotFailed,
        BootFailed,
        AgentUnavailable,
        QuotaExhausted,
        HostUnsupported,
        UnknownImage,
    ]
);

/// Pause a sandbox
///
/// An operator pause: the vCPUs stop, memory and processes stay. Exec,
/// file and process calls on a paused sandbox are `409 paused` and never
/// wake it; `POST …/resume` does.
#[utoipa::path(post, path = "/v1/runtime/vms/{id}/pause", operation_id = "pauseVm", tag = "rest states",
    params(("id" = String, Path, description = "The sandbox's id")),
    responses((status = 200, description = "Paused", body = VmView), TransitionErrors))]
pub async fn pause(
    State(app): AppState,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<VmView>, ApiError> {
    let vm = vm_id(&app, &caller, &id).await?;
    let a = app.clone();
    Ok(Json(
        detached(async move { a.pause(vm).await }).await?.into(),
    ))
}

/// Resume a paused sandbox
#[utoipa::path(post, path = "/v1/runtime/vms/{id}/resume", operation_id = "resumeVm", tag = "rest states",
    params(("id" = String, Path, description = "The sandbox's id")),
    responses((status = 200, description = "Running again", body = VmView), ResumeErrors))]
pub async fn resume(
    State(app): AppState,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<VmView>, ApiError> {
    let vm = vm_id(&app, &caller, &id).await?;
    let a = app.clone();
    Ok(Json(
        detached(async move { a.resume(vm).await }).await?.into(),
    ))
}

/// Put a sandbox to sleep
///
/// Its memory and disk are snapshotted and its worker freed; the next
/// exec, file or process call wakes it transparently (a slower answer,
/// never an error). Refused (`409`) while a call runs in it (an exec, an
/// attached process stream): a sandbox never sleeps under a running
/// command. `idleTimeoutSecs` on schedule does this when it is idle.
#[utoipa::path(post, path = "/v1/runtime/vms/{id}/sleep", operation_id = "sleepVm", tag = "rest states",
    params(("id" = String, Path, description = "The sandbox's id")),
    responses((status = 200, description = "Sleeping", body = VmView), SuspendErrors))]
pub async fn sleep(
    State(app): AppState,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<VmView>, ApiError> {
    let vm = vm_id(&app, &caller, &id).await?;
    let a = app.clone();
    let s = detached(async move { a.suspend(vm, VmState::Sleeping).await }).await?;
    Ok(Json(s.into()))
}

/// Hibernate a sandbox
///
/// Like sleep (memory and disk saved, worker freed, same id), but nothing
/// wakes it except `POST …/wake`; running calls are cut off. A sleeping
/// sandbox can be hibernated too.
#[utoipa::path(post, path = "/v1/runtime/vms/{id}/hibernate", operation_id = "hibernateVm", tag = "rest states",
    params(("id" = String, Path, description = "The sandbox's id")),
    responses((status = 200, description = "Hibernated", body = VmView), SuspendErrors))]
pub async fn hibernate(
    State(app): AppState,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<VmView>, ApiError> {
    let vm = vm_id(&app, &caller, &id).await?;
    let a = app.clone();
    let s = detached(async move { a.suspend(vm, VmState::Hibernated).await }).await?;
    Ok(Json(s.into()))
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct WakeResp {
    vm: VmView,
    /// The memory snapshot could not be restored: the sandbox was booted
    /// from its saved disk (files kept, processes gone).
    cold_boot: bool,
    /// Why, when `coldBoot`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    cold_boot_reason: Option<String>,
}

/// Wake a hibernated (or sleeping) sandbox
///
/// Restores its memory and disk into a new worker: same id, files and
/// processes. If its memory cannot be restored it is booted from its saved
/// disk instead, and the answer says so (`coldBoot`).
#[utoipa::path(post, path = "/v1/runtime/vms/{id}/wake", operation_id = "wakeVm", tag = "rest states",
    params(("id" = String, Path, description = "The sandbox's id")),
    responses((status = 200, description = "Running again", body = WakeResp), WakeErrors))]
pub async fn wake(
    State(app): AppState,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<WakeResp>, ApiError> {
    let vm = vm_id(&app, &caller, &id).await?;
    let a = app.clone();
    let w = detached(async move { a.wake(vm, false).await }).await?;
    let s = app.sandbox(&caller, &id).await?;
    Ok(Json(WakeResp {
        vm: s.into(),
        cold_boot: w.cold_boot.is_some(),
        cold_boot_reason: w.cold_boot,
    }))
}

errors!(
    ArchiveErrors = [
        VmNotFound,
        InvalidState,
        NotSupported,
        WorkerFailed,
        SnapshotFailed,
        StoreFailed,
    ]
);

/// Archive a sandbox
///
/// Its memory and disk (a snapshot of a running or paused sandbox, the
/// saved one of a sleeping or hibernated one) go to the object store
/// (`sproutd --s3-endpoint`), with a record of the sandbox; its worker and
/// local files are freed, and so is its slot. Answers once all of it is in
/// the store. `POST …/unarchive`, here or on any sproutd that shares the
/// bucket, brings it back. Without an object store: `400 not_supported`;
/// if the store fails, the sandbox is left hibernated (`502
/// store_failed`).
#[utoipa::path(post, path = "/v1/runtime/vms/{id}/archive", operation_id = "archiveVm", tag = "rest states",
    params(("id" = String, Path, description = "The sandbox's id")),
    responses((status = 200, description = "Archived", body = VmView), ArchiveErrors))]
pub async fn archive(
    State(app): AppState,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<VmView>, ApiError> {
    let vm = vm_id(&app, &caller, &id).await?;
    let a = app.clone();
    Ok(Json(
        detached(async move { a.archive(vm).await }).await?.into(),
    ))
}

errors!(
    UnarchiveErrors = [
        VmNotFound,
        InvalidState,
        NotSupported,
        QuotaExhausted,
        WorkerFailed,
        SnapshotFailed,
        StoreFailed,
        BootFailed,
        AgentUnavailable,
        HostUnsupported,
    ]
);

/// Unarchive a sandbox
///
/// An archived sandbox of this sproutd, or one another sproutd sharing the
/// object store archived (its record is read from the store, under the
/// caller's tenant): its memory and disk are downloaded, verified and
/// restored into a new worker, same id, files and processes. Needs a
/// slot. Its archive record is removed once it runs, so it is unarchived
/// once.
#[utoipa::path(post, path = "/v1/runtime/vms/{id}/unarchive", operation_id = "unarchiveVm", tag = "rest states",
    params(("id" = String, Path, description = "The sandbox's id")),
    responses((status = 200, description = "Running again", body = VmView), UnarchiveErrors))]
pub async fn unarchive(
    State(app): AppState,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<VmView>, ApiError> {
    let import = match app.sandbox(&caller, &id).await {
        Ok(_) => None,
        Err(e) if e.code == Code::VmNotFound => {
            // Not here: another node's archive, if the store has one of
            // this tenant's (another tenant's sandbox here is answered as
            // an unknown id is).
            let (Some(m), Ok(vm)) = (app.mirror.as_ref(), Uuid::parse_str(&id)) else {
                return Err(e);
            };
            let rec = m
                .get_archive(caller.name(), vm)
                .await
                .map_err(|m| ApiError::new(Code::StoreFailed, m))?;
            let here = app.db(move |r| r.get_sandbox(vm)).await?.is_some();
            match rec {
                Some(held) if !here => Some(held),
                _ => return Err(e),
            }
        }
        Err(e) => return Err(e),
    };
    let vm = Uuid::parse_str(&id).map_err(|_| ApiError::vm_not_found(&id))?;
    let a = app.clone();
    Ok(Json(
        detached(async move { a.unarchive(vm, import).await })
            .await?
            .into(),
    ))
}

/// Reboot a sandbox
///
/// Its disk is kept (written out first); memory, processes and sessions
/// are lost; same id. Works from running, paused, sleeping and hibernated.
#[utoipa::path(post, path = "/v1/runtime/vms/{id}/reboot", operation_id = "rebootVm", tag = "rest states",
    params(("id" = String, Path, description = "The sandbox's id")),
    responses((status = 200, description = "Rebooted and running", body = VmView), WakeErrors))]
pub async fn reboot(
    State(app): AppState,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<VmView>, ApiError> {
    let vm = vm_id(&app, &caller, &id).await?;
    let a = app.clone();
    Ok(Json(
        detached(async move { a.reboot(vm).await }).await?.into(),
    ))
}

#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(as = SnapshotRequest)]
pub struct SnapshotReq {
    /// Leave the sandbox paused after the snapshot (else it runs on).
    #[serde(default)]
    leave_paused: bool,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotTaken {
    vm_id: Uuid,
    snapshot_id: Uuid,
    /// The sandbox's state after the snapshot.
    state: VmState,
}

errors!(
    SnapshotErrors = [
        InvalidJson,
        InvalidBody,
        UnsupportedMediaType,
        PayloadTooLarge,
        VmNotFound,
        InvalidState,
        WorkerFailed,
        SnapshotFailed,
    ]
);

/// Snapshot a sandbox
///
/// Writes its memory, device state and disk (a diff on its last snapshot
/// when there is one), checks the snapshot, seals and records it; `POST
/// /schedule {"snapshot": id}` makes new sandboxes from it. The sandbox is
/// paused only for the capture, unless `leavePaused`.
#[utoipa::path(post, path = "/v1/runtime/vms/{id}/snapshot", operation_id = "snapshotVm", tag = "rest states",
    params(("id" = String, Path, description = "The sandbox's id")),
    request_body(content = Option<SnapshotReq>, description = "Empty counts as `{}`"),
    responses((status = 201, description = "Taken", body = SnapshotTaken), SnapshotErrors))]
pub async fn snapshot(
    State(app): AppState,
    caller: Caller,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<SnapshotReq>,
) -> Result<(StatusCode, Json<SnapshotTaken>), ApiError> {
    let vm = vm_id(&app, &caller, &id).await?;
    let a = app.clone();
    let (s, snap) = detached(async move {
        a.snapshot(vm, req.leave_paused, SnapshotKind::User, None)
            .await
    })
    .await?;
    Ok((
        StatusCode::CREATED,
        Json(SnapshotTaken {
            vm_id: s.id,
            snapshot_id: snap.id,
            state: s.state,
        }),
    ))
}

#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(as = ForkRequest)]
pub struct ForkReq {
    #[schema(minimum = 1, maximum = 100, default = 1)]
    count: Option<i64>,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ForkChild {
    vm_id: Uuid,
    state: VmState,
    /// Why this child failed, when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    error: Option<String>,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Forked {
    source_vm_id: Uuid,
    /// The snapshot every child was restored from.
    snapshot_id: Uuid,
    /// One per child, each its own result.
    forks: Vec<ForkChild>,
}

errors!(
    ForkErrors = [
        InvalidJson,
        InvalidBody,
        InvalidValue,
        UnsupportedMediaType,
        PayloadTooLarge,
        VmNotFound,
        InvalidState,
        WorkerFailed,
        SnapshotFailed,
        QuotaExhausted,
    ]
);

/// Fork a sandbox
///
/// Snapshots it (it runs on), then starts `count` new sandboxes from that
/// snapshot in parallel, each its own worker with `parentVmId` set, the
/// parent's files and processes, its own copy-on-write memory and a
/// private disk over the parent's frozen layers, and a fresh identity (host
/// name, machine id, entropy, clock) before its first exec. One child
/// failing is not the call failing: each has its own result.
#[utoipa::path(post, path = "/v1/runtime/vms/{id}/fork", operation_id = "forkVm", tag = "rest states",
    params(("id" = String, Path, description = "The sandbox's id")),
    request_body(content = Option<ForkReq>, description = "Empty counts as `{}`"),
    responses((status = 201, description = "Forked", body = Forked), ForkErrors))]
pub async fn fork(
    State(app): AppState,
    caller: Caller,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ForkReq>,
) -> Result<(StatusCode, Json<Forked>), ApiError> {
    let count = req.count.unwrap_or(1);
    if !(1..=MAX_FORK).contains(&count) {
        return Err(ApiError::field(
            "count",
            format!("count is {count}: it must be 1 to {MAX_FORK}"),
        ));
    }
    let vm = vm_id(&app, &caller, &id).await?;
    let a = app.clone();
    let (snap, kids) = detached(async move { a.fork(vm, count as usize).await }).await?;
    let forks = kids
        .into_iter()
        .map(|k| match k {
            Ok(s) => ForkChild {
                vm_id: s.id,
                state: s.state,
                error: None,
            },
            Err((id, e)) => ForkChild {
                vm_id: id,
                state: VmState::Failed,
                error: Some(e.message),
            },
        })
        .collect();
    Ok((
        StatusCode::CREATED,
        Json(Forked {
            source_vm_id: vm,
            snapshot_id: snap.id,
            forks,
        }),
    ))
}

/// A snapshot as the API shows it.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = Snapshot)]
pub struct SnapshotView {
    snapshot_id: Uuid,
    kind: SnapshotKind,
    /// The sandbox it was taken of (it may be gone since).
    #[schema(required = true)]
    vm_id: Option<Uuid>,
    /// A checkpoint's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    name: Option<String>,
    image: String,
    runtime: Runtime,
    cpus: u8,
    memory_mb: u32,
    /// The snapshot it is a diff on, if any.
    #[schema(required = true)]
    parent_snapshot_id: Option<Uuid>,
    /// Bytes it takes on disk (a diff: what changed).
    size_bytes: u64,
    /// Whether it is in the object store (sproutd's `--s3-endpoint`), with
    /// every snapshot it builds on: it survives the loss of this node's
    /// disk.
    durable: bool,
    #[schema(format = DateTime)]
    created_at: String,
}

impl From<SnapshotRow> for SnapshotView {
    fn from(s: SnapshotRow) -> Self {
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(s.created_ms);
        Self {
            snapshot_id: s.id,
            kind: s.kind,
            vm_id: s.vm_id,
            name: s.name,
            image: s.image,
            runtime: s.runtime,
            cpus: s.cpus,
            memory_mb: s.memory_mb,
            parent_snapshot_id: s.parent_id,
            size_bytes: s.size_bytes,
            durable: s.uploaded_ms.is_some(),
            created_at: humantime::format_rfc3339_millis(at).to_string(),
        }
    }
}

#[derive(Serialize, ToSchema)]
pub struct SnapshotList {
    /// Oldest first.
    snapshots: Vec<SnapshotView>,
}

errors!(ListSnapshotErrors = []);

/// List snapshots
///
/// User snapshots (taken by `…/snapshot` or a fork) and checkpoints;
/// sproutd's own (a sleeping sandbox's) are not shown.
#[utoipa::path(get, path = "/v1/runtime/snapshots", operation_id = "listSnapshots", tag = "rest states",
    responses((status = 200, description = "The snapshots", body = SnapshotList), ListSnapshotErrors))]
pub async fn list_snapshots(
    State(app): AppState,
    caller: Caller,
) -> Result<Json<SnapshotList>, ApiError> {
    let all = app.db(|r| r.list_snapshots()).await?;
    Ok(Json(SnapshotList {
        snapshots: all
            .into_iter()
            .filter(|s| matches!(s.kind, SnapshotKind::User | SnapshotKind::Checkpoint))
            .filter(|s| caller.owns(&s.tenant))
            .map(SnapshotView::from)
            .collect(),
    }))
}

/// The snapshot `id` names, of one of `kinds`; `code` (404) if none.
async fn snapshot_row(
    app: &Arc<App>,
    caller: &Caller,
    id: &str,
    kinds: &'static [SnapshotKind],
    code: Code,
) -> Result<SnapshotRow, ApiError> {
    let what = if code == Code::CheckpointNotFound {
        "checkpoint"
    } else {
        "snapshot"
    };
    let missing = || ApiError::new(code, format!("No {what} has the id {id:?}"));
    let uuid = Uuid::parse_str(id).map_err(|_| missing())?;
    app.db(move |r| r.get_snapshot(uuid))
        .await?
        .filter(|s| kinds.contains(&s.kind) && caller.owns(&s.tenant))
        .ok_or_else(missing)
}

const USER_KINDS: &[SnapshotKind] = &[SnapshotKind::User, SnapshotKind::Checkpoint];
const CHECKPOINT: &[SnapshotKind] = &[SnapshotKind::Checkpoint];

errors!(GetSnapshotErrors = [SnapshotNotFound]);

/// Get a snapshot
#[utoipa::path(get, path = "/v1/runtime/snapshots/{id}", operation_id = "getSnapshot", tag = "rest states",
    params(("id" = String, Path, description = "The snapshot's id")),
    responses((status = 200, description = "The snapshot", body = SnapshotView), GetSnapshotErrors))]
pub async fn get_snapshot(
    State(app): AppState,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<SnapshotView>, ApiError> {
    let s = snapshot_row(&app, &caller, &id, USER_KINDS, Code::SnapshotNotFound).await?;
    Ok(Json(s.into()))
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotDeleted {
    snapshot_id: Uuid,
    /// Always true.
    deleted: bool,
}

/// Delete a snapshot
///
/// It is no longer listed nor usable; its files go once no sandbox or
/// later snapshot builds on them.
#[utoipa::path(delete, path = "/v1/runtime/snapshots/{id}", operation_id = "deleteSnapshot", tag = "rest states",
    params(("id" = String, Path, description = "The snapshot's id")),
    responses((status = 200, description = "Deleted", body = SnapshotDeleted), GetSnapshotErrors))]
pub async fn delete_snapshot(
    State(app): AppState,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<SnapshotDeleted>, ApiError> {
    let s = snapshot_row(&app, &caller, &id, USER_KINDS, Code::SnapshotNotFound).await?;
    drop_snapshot(&app, s.id).await?;
    Ok(Json(SnapshotDeleted {
        snapshot_id: s.id,
        deleted: true,
    }))
}

async fn drop_snapshot(app: &Arc<App>, id: Uuid) -> Result<(), ApiError> {
    app.db(move |r| r.set_snapshot_kind(id, SnapshotKind::Dropped))
        .await?;
    app.collect_garbage().await;
    Ok(())
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(as = CheckpointRequest)]
pub struct CheckpointReq {
    /// 1-128 bytes; need not be unique.
    name: String,
}

errors!(
    CheckpointErrors = [
        InvalidJson,
        InvalidBody,
        InvalidValue,
        UnsupportedMediaType,
        PayloadTooLarge,
        VmNotFound,
        InvalidState,
        TooManyCheckpoints,
        WorkerFailed,
        SnapshotFailed,
    ]
);

/// Checkpoint a sandbox
///
/// A named snapshot of it (it runs on). At most 10 per sandbox: the 11th
/// is `409 too_many_checkpoints` (none is dropped silently). Checkpoints
/// go with their sandbox's delete.
#[utoipa::path(post, path = "/v1/runtime/vms/{id}/checkpoints", operation_id = "createCheckpoint", tag = "checkpoints",
    params(("id" = String, Path, description = "The sandbox's id")),
    request_body = CheckpointReq,
    responses((status = 201, description = "Taken", body = SnapshotView), CheckpointErrors))]
pub async fn create_checkpoint(
    State(app): AppState,
    caller: Caller,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<CheckpointReq>,
) -> Result<(StatusCode, Json<SnapshotView>), ApiError> {
    if req.name.is_empty() || req.name.len() > MAX_NAME {
        return Err(ApiError::field(
            "name",
            format!(
                "name is {} bytes: it must be 1 to {MAX_NAME}",
                req.name.len()
            ),
        ));
    }
    let vm = vm_id(&app, &caller, &id).await?;
    let a = app.clone();
    let (_, snap) = detached(async move {
        a.snapshot(vm, false, SnapshotKind::Checkpoint, Some(req.name))
            .await
    })
    .await?;
    Ok((StatusCode::CREATED, Json(snap.into())))
}

errors!(ListCheckpointErrors = [VmNotFound]);

/// List a sandbox's checkpoints
#[utoipa::path(get, path = "/v1/runtime/vms/{id}/checkpoints", operation_id = "listCheckpoints", tag = "checkpoints",
    params(("id" = String, Path, description = "The sandbox's id")),
    responses((status = 200, description = "Oldest first", body = SnapshotList), ListCheckpointErrors))]
pub async fn list_checkpoints(
    State(app): AppState,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<SnapshotList>, ApiError> {
    let vm = vm_id(&app, &caller, &id).await?;
    let all = app.db(|r| r.list_snapshots()).await?;
    Ok(Json(SnapshotList {
        snapshots: all
            .into_iter()
            .filter(|s| s.kind == SnapshotKind::Checkpoint && s.vm_id == Some(vm))
            .map(SnapshotView::from)
            .collect(),
    }))
}

errors!(
    CheckpointRestoreErrors = [
        CheckpointNotFound,
        VmNotFound,
        InvalidState,
        WorkerFailed,
        SnapshotFailed,
        BootFailed,
        AgentUnavailable,
        QuotaExhausted,
    ]
);

/// Restore a checkpoint in place
///
/// Its sandbox (same id) becomes what it was at the checkpoint: memory,
/// processes and files; everything since is gone.
#[utoipa::path(post, path = "/v1/runtime/checkpoints/{id}/restore", operation_id = "restoreCheckpoint", tag = "checkpoints",
    params(("id" = String, Path, description = "The checkpoint's id")),
    responses((status = 200, description = "Restored and running", body = VmView), CheckpointRestoreErrors))]
pub async fn restore_checkpoint(
    State(app): AppState,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<VmView>, ApiError> {
    let cp = snapshot_row(&app, &caller, &id, CHECKPOINT, Code::CheckpointNotFound).await?;
    let vm = cp
        .vm_id
        .ok_or_else(|| ApiError::new(Code::VmNotFound, "The checkpoint's sandbox is gone"))?;
    vm_id(&app, &caller, &vm.to_string()).await?;
    let a = app.clone();
    let s = detached(async move { a.restore_checkpoint(vm, cp.id).await }).await?;
    Ok(Json(s.into()))
}

/// Spawn a sandbox from a checkpoint
///
/// A new sandbox, as `POST /schedule {"snapshot": id}` makes one.
#[utoipa::path(post, path = "/v1/runtime/checkpoints/{id}/spawn", operation_id = "spawnCheckpoint", tag = "checkpoints",
    params(("id" = String, Path, description = "The checkpoint's id")),
    responses((status = 201, description = "The new sandbox, running", body = VmView), CheckpointRestoreErrors))]
pub async fn spawn_checkpoint(
    State(app): AppState,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<VmView>), ApiError> {
    let cp = snapshot_row(&app, &caller, &id, CHECKPOINT, Code::CheckpointNotFound).await?;
    let id = Uuid::new_v4();
    let slot = app.hold_slots(caller.name(), vec![id]).await?;
    let s = from_snapshot(&app, &caller, &cp, None, Default::default(), (id, slot))
        .await
        .map_err(|e| match e.code {
            Code::SnapshotNotFound => ApiError::new(Code::CheckpointNotFound, e.message),
            _ => e,
        })?;
    Ok((StatusCode::CREATED, Json(s.into())))
}

errors!(DeleteCheckpointErrors = [CheckpointNotFound]);

/// Delete a checkpoint
#[utoipa::path(delete, path = "/v1/runtime/checkpoints/{id}", operation_id = "deleteCheckpoint", tag = "checkpoints",
    params(("id" = String, Path, description = "The checkpoint's id")),
    responses((status = 200, description = "Deleted", body = SnapshotDeleted), DeleteCheckpointErrors))]
pub async fn delete_checkpoint(
    State(app): AppState,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<SnapshotDeleted>, ApiError> {
    let cp = snapshot_row(&app, &caller, &id, CHECKPOINT, Code::CheckpointNotFound).await?;
    drop_snapshot(&app, cp.id).await?;
    Ok(Json(SnapshotDeleted {
        snapshot_id: cp.id,
        deleted: true,
    }))
}

/// A new sandbox `id` from `snap`, in its image and shape, with `metadata`
/// and (when given) `env` instead of the snapshot's; `slot` is its slot,
/// held by the caller before it did anything else.
pub async fn from_snapshot(
    app: &Arc<App>,
    caller: &Caller,
    snap: &SnapshotRow,
    env: Option<std::collections::BTreeMap<String, String>>,
    opts: FromSnapshot,
    (id, slot): (Uuid, SlotHold),
) -> Result<Sandbox, ApiError> {
    let s = Sandbox {
        runtime: snap.runtime,
        disable_internet: opts.disable_internet,
        idle_timeout_secs: opts.idle_timeout_secs,
        env: env.unwrap_or_else(|| snap.env.clone()),
        metadata: opts.metadata,
        snapshot_id: Some(snap.id),
        lineage_snapshot_id: Some(snap.id),
        ..Sandbox::starting(
            id,
            caller.name(),
            &snap.image,
            snap.cpus,
            snap.memory_mb,
            now_ms(),
        )
    };
    // Recorded only while the snapshot still is, in one write: from then on
    // the sandbox keeps it (and the registry its slot).
    let row = s.clone();
    let recorded = app
        .db(move |r| {
            let there = r
                .get_snapshot(row.snapshot_id.unwrap_or_default())?
                .is_some();
            if there {
                r.insert_sandbox(&row)?;
            }
            Ok(there)
        })
        .await?;
    drop(slot);
    if !recorded {
        return Err(ApiError::new(
            Code::SnapshotNotFound,
            format!("No snapshot has the id \"{}\" (it was deleted)", snap.id),
        ));
    }
    tracing::info!(vm = %s.id, snapshot = %snap.id, "scheduling from a snapshot");
    let (a, sid) = (app.clone(), snap.id);
    detached(async move { a.start_from_snapshot(s, sid).await }).await
}

/// What a schedule from a snapshot takes from its request.
#[derive(Default)]
pub struct FromSnapshot {
    pub disable_internet: bool,
    pub idle_timeout_secs: Option<u32>,
    pub metadata: std::collections::BTreeMap<String, String>,
}

/// The user snapshot or checkpoint `id` names, for a schedule.
pub async fn for_schedule(
    app: &Arc<App>,
    caller: &Caller,
    id: &str,
) -> Result<SnapshotRow, ApiError> {
    snapshot_row(app, caller, id, USER_KINDS, Code::SnapshotNotFound)
        .await
        .map_err(|e| e.with_field("snapshot"))
}
