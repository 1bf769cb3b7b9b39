//! Files in a sandbox, through its agent, confined by the agent to
//! `/workspace` (a path that leaves it is `400 path_escape`):
//! `GET /vms/{id}/files?path=` lists a directory, `GET|PUT
//! /vms/{id}/files/content?path=` reads or writes UTF-8 text up to
//! [`MAX_TEXT`] (a larger write is 413, a larger read is cut and says so
//! with `X-Truncated: true`), `POST /vms/{id}/files/mkdir` and `DELETE
//! /vms/{id}/files?path=`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use guest_agent::client::ClientError;
use guest_agent::protocol::{ErrorCode as AgentCode, FileKind};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::error::{ApiError, Code};
use super::exec::failure;
use super::openapi::errors;
use super::routes::ApiJson;
use super::tenants::Caller;
use super::App;

/// Most bytes of text `files/content` reads or writes.
pub const MAX_TEXT: usize = 1 << 20;
/// Most entries one listing shows.
const MAX_ENTRIES: usize = 10_000;

type Vm = axum::extract::Path<String>;

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct PathQuery {
    /// Relative to /workspace, or absolute beneath it.
    path: String,
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct RemoveQuery {
    /// Relative to /workspace, or absolute beneath it.
    path: String,
    /// Remove a directory and everything in it.
    #[serde(default)]
    recursive: bool,
}

type Q<T> = Result<Query<T>, axum::extract::rejection::QueryRejection>;

fn query<T>(q: Q<T>, path: impl Fn(&T) -> &str) -> Result<T, ApiError> {
    let Query(q) = q.map_err(|e| {
        ApiError::new(
            Code::BadRequest,
            format!("Bad query string (path=... is required): {e}"),
        )
    })?;
    check_path(path(&q))?;
    Ok(q)
}

fn check_path(p: &str) -> Result<(), ApiError> {
    if p.is_empty() || p.contains('\0') {
        return Err(ApiError::new(
            Code::InvalidPath,
            "path must be a non-empty path without NUL",
        ));
    }
    Ok(())
}

fn path_query(q: Q<PathQuery>) -> Result<PathQuery, ApiError> {
    query(q, |q| &q.path)
}

/// An agent refusal about a file, as the API tells it.
async fn file_error(
    app: &Arc<App>,
    s: &super::registry::Sandbox,
    path: &str,
    e: ClientError,
) -> ApiError {
    let ClientError::Agent { code, message } = &e else {
        return failure(app, s, &e).await;
    };
    let c = match code {
        AgentCode::PathEscape => Code::PathEscape,
        AgentCode::InvalidPath => Code::InvalidPath,
        AgentCode::NotFound => Code::FileNotFound,
        AgentCode::AlreadyExists
        | AgentCode::NotADirectory
        | AgentCode::IsADirectory
        | AgentCode::NotEmpty => Code::FileConflict,
        AgentCode::PermissionDenied => Code::PermissionDenied,
        AgentCode::TooLarge => Code::PayloadTooLarge,
        _ => Code::FileError,
    };
    ApiError::new(c, format!("{path}: {message}"))
}

#[derive(Serialize, ToSchema)]
#[schema(as = FileEntry)]
struct Entry {
    name: String,
    #[serde(rename = "type")]
    kind: EntryType,
    /// Bytes.
    size: u64,
}

#[derive(Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
#[schema(as = FileType)]
enum EntryType {
    File,
    Dir,
    Symlink,
    Other,
}

/// A directory's entries.
#[derive(Serialize, ToSchema)]
#[schema(as = FileList)]
pub struct Listing {
    path: String,
    /// At most 10000.
    entries: Vec<Entry>,
    /// The directory has more entries than these.
    truncated: bool,
}

fn kind(k: FileKind) -> EntryType {
    match k {
        FileKind::File => EntryType::File,
        FileKind::Dir => EntryType::Dir,
        FileKind::Symlink => EntryType::Symlink,
        FileKind::Other => EntryType::Other,
    }
}

errors!(
    ListErrors = [
        BadRequest,
        InvalidPath,
        PathEscape,
        FileNotFound,
        FileConflict,
        PermissionDenied,
        FileError,
        VmNotFound,
        NotSupported,
        InvalidState,
        Paused,
        AgentUnavailable,
        QuotaExhausted,
    ]
);

const VM: &str = "The sandbox's id";

/// List a directory
#[utoipa::path(get, path = "/v1/runtime/vms/{id}/files", operation_id = "listFiles", tag = "files",
    params(("id" = String, Path, description = VM), PathQuery),
    responses((status = 200, description = "The directory's entries", body = Listing), ListErrors))]
pub async fn list(
    State(app): State<Arc<App>>,
    caller: Caller,
    vm: Vm,
    q: Q<PathQuery>,
) -> Result<Json<Listing>, ApiError> {
    let q = path_query(q)?;
    let super::lifecycle::Live {
        s,
        agent,
        busy: _busy,
    } = app.live(&caller, &vm).await?;
    let all = match agent.list(&q.path).await {
        Ok(v) => v,
        Err(e) => return Err(file_error(&app, &s, &q.path, e).await),
    };
    let truncated = all.len() > MAX_ENTRIES;
    let entries = all
        .into_iter()
        .take(MAX_ENTRIES)
        .map(|f| Entry {
            name: f.name,
            kind: kind(f.kind),
            size: f.size,
        })
        .collect();
    Ok(Json(Listing {
        path: q.path,
        entries,
        truncated,
    }))
}

errors!(
    GetContentErrors = [
        BadRequest,
        InvalidPath,
        PathEscape,
        FileNotFound,
        FileConflict,
        PermissionDenied,
        NotText,
        FileError,
        VmNotFound,
        NotSupported,
        InvalidState,
        Paused,
        AgentUnavailable,
        QuotaExhausted,
    ]
);

/// Read a text file
///
/// At most 1 MiB: a longer file is cut (at a character boundary) and the
/// answer says so with `X-Truncated: true`; content that is not UTF-8 is
/// `400 not_text` (use /files/raw).
#[utoipa::path(get, path = "/v1/runtime/vms/{id}/files/content", operation_id = "readFile",
    tag = "files",
    params(("id" = String, Path, description = VM), PathQuery),
    responses(
        (status = 200, description = "The file's text", body = String,
            content_type = "text/plain; charset=utf-8",
            headers(("X-Truncated" = String, description = "`true` when the file is longer than 1 MiB and was cut"))),
        GetContentErrors,
    ))]
pub async fn get_content(
    State(app): State<Arc<App>>,
    caller: Caller,
    vm: Vm,
    q: Q<PathQuery>,
) -> Result<Response, ApiError> {
    let q = path_query(q)?;
    let super::lifecycle::Live {
        s,
        agent,
        busy: _busy,
    } = app.live(&caller, &vm).await?;
    // One byte past the limit tells a longer file.
    let read = async {
        let mut r = agent
            .read_file(&q.path, 0, Some(MAX_TEXT as u64 + 1))
            .await?;
        let mut out = Vec::new();
        while let Some(chunk) = r.next_chunk().await? {
            out.extend_from_slice(&chunk);
        }
        Ok::<_, ClientError>(out)
    };
    let mut bytes = match read.await {
        Ok(b) => b,
        Err(e) => return Err(file_error(&app, &s, &q.path, e).await),
    };
    let truncated = bytes.len() > MAX_TEXT;
    bytes.truncate(MAX_TEXT);
    let text = match String::from_utf8(bytes) {
        Ok(t) => t,
        // A character cut by the limit.
        Err(e) if truncated && e.utf8_error().error_len().is_none() => {
            let n = e.utf8_error().valid_up_to();
            let mut b = e.into_bytes();
            b.truncate(n);
            String::from_utf8(b).unwrap_or_default()
        }
        Err(_) => {
            return Err(ApiError::new(
                Code::NotText,
                format!("{} is not UTF-8 text", q.path),
            ))
        }
    };
    let mut resp = ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response();
    if truncated {
        resp.headers_mut()
            .insert("x-truncated", HeaderValue::from_static("true"));
    }
    Ok(resp)
}

#[derive(Serialize, ToSchema)]
#[schema(as = FileWritten)]
pub struct Written {
    path: String,
    /// Bytes written.
    bytes: u64,
}

errors!(
    PutContentErrors = [
        BadRequest,
        InvalidPath,
        PathEscape,
        FileNotFound,
        FileConflict,
        PermissionDenied,
        NotText,
        PayloadTooLarge,
        FileError,
        VmNotFound,
        NotSupported,
        InvalidState,
        Paused,
        AgentUnavailable,
        QuotaExhausted,
    ]
);

/// Write a text file
///
/// The body is the file's new content (created or replaced), UTF-8 text of
/// at most 1 MiB (more is `413 payload_too_large`).
#[utoipa::path(put, path = "/v1/runtime/vms/{id}/files/content", operation_id = "writeFile",
    tag = "files",
    params(("id" = String, Path, description = VM), PathQuery),
    request_body(content = String, content_type = "text/plain", description = "UTF-8 text, at most 1 MiB"),
    responses((status = 200, description = "Written", body = Written), PutContentErrors))]
pub async fn put_content(
    State(app): State<Arc<App>>,
    caller: Caller,
    vm: Vm,
    q: Q<PathQuery>,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Json<Written>, ApiError> {
    let q = path_query(q)?;
    let body = body.map_err(|e| {
        ApiError::new(
            Code::for_status(e.status()),
            format!("The file content is over the {MAX_TEXT}-byte limit, or unreadable: {e}"),
        )
    })?;
    if std::str::from_utf8(&body).is_err() {
        return Err(ApiError::new(
            Code::NotText,
            "The content is not UTF-8 text",
        ));
    }
    let super::lifecycle::Live {
        s,
        agent,
        busy: _busy,
    } = app.live(&caller, &vm).await?;
    match agent.write_bytes(&q.path, &body).await {
        Ok(bytes) => Ok(Json(Written {
            path: q.path,
            bytes,
        })),
        Err(e) => Err(file_error(&app, &s, &q.path, e).await),
    }
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = MakeDir)]
pub struct MkdirReq {
    /// Relative to /workspace, or absolute beneath it.
    path: String,
    /// Make missing parents too.
    #[serde(default)]
    parents: bool,
}

#[derive(Serialize, ToSchema)]
#[schema(as = DirMade)]
pub struct Made {
    path: String,
    /// Always true.
    created: bool,
}

errors!(
    MkdirErrors = [
        InvalidJson,
        InvalidBody,
        UnsupportedMediaType,
        PayloadTooLarge,
        InvalidPath,
        PathEscape,
        FileNotFound,
        FileConflict,
        PermissionDenied,
        FileError,
        VmNotFound,
        NotSupported,
        InvalidState,
        Paused,
        AgentUnavailable,
        QuotaExhausted,
    ]
);

/// Make a directory
#[utoipa::path(post, path = "/v1/runtime/vms/{id}/files/mkdir", operation_id = "mkdir",
    tag = "files",
    params(("id" = String, Path, description = VM)),
    request_body = MkdirReq,
    responses((status = 200, description = "Made", body = Made), MkdirErrors))]
pub async fn mkdir(
    State(app): State<Arc<App>>,
    caller: Caller,
    vm: Vm,
    ApiJson(req): ApiJson<MkdirReq>,
) -> Result<Json<Made>, ApiError> {
    check_path(&req.path)?;
    let super::lifecycle::Live {
        s,
        agent,
        busy: _busy,
    } = app.live(&caller, &vm).await?;
    match agent.mkdir(&req.path, req.parents).await {
        Ok(()) => Ok(Json(Made {
            path: req.path,
            created: true,
        })),
        Err(e) => Err(file_error(&app, &s, &req.path, e).await),
    }
}

#[derive(Serialize, ToSchema)]
#[schema(as = FileDeleted)]
pub struct Removed {
    path: String,
    /// Always true.
    deleted: bool,
}

errors!(
    RemoveErrors = [
        BadRequest,
        InvalidPath,
        PathEscape,
        FileNotFound,
        FileConflict,
        PermissionDenied,
        FileError,
        VmNotFound,
        NotSupported,
        InvalidState,
        Paused,
        AgentUnavailable,
        QuotaExhausted,
    ]
);

/// Delete a file or directory
///
/// A directory that is not empty needs `recursive=true` (else `409
/// file_conflict`).
#[utoipa::path(delete, path = "/v1/runtime/vms/{id}/files", operation_id = "deleteFile",
    tag = "files",
    params(("id" = String, Path, description = VM), RemoveQuery),
    responses((status = 200, description = "Deleted", body = Removed), RemoveErrors))]
pub async fn remove(
    State(app): State<Arc<App>>,
    caller: Caller,
    vm: Vm,
    q: Q<RemoveQuery>,
) -> Result<Json<Removed>, ApiError> {
    let q = query(q, |q| &q.path)?;
    let super::lifecycle::Live {
        s,
        agent,
        busy: _busy,
    } = app.live(&caller, &vm).await?;
    match agent.remove(&q.path, q.recursive).await {
        Ok(()) => Ok(Json(Removed {
            path: q.path,
            deleted: true,
        })),
        Err(e) => Err(file_error(&app, &s, &q.path, e).await),
    }
}

/// Bytes of a raw transfer buffered between HTTP and the agent.
const RAW_PIPE: usize = 256 * 1024;

// The errors of both raw transfers.
errors!(
    RawErrors = [
        BadRequest,
        InvalidPath,
        PathEscape,
        FileNotFound,
        FileConflict,
        PermissionDenied,
        FileError,
        VmNotFound,
        NotSupported,
        InvalidState,
        Paused,
        AgentUnavailable,
        QuotaExhausted,
    ]
);

/// Download a file
///
/// The file's bytes, streamed as the agent sends them: no size cap, never
/// held whole in sproutd. A transfer that fails part way cuts the
/// connection (the body ends early).
#[utoipa::path(get, path = "/v1/runtime/vms/{id}/files/raw", operation_id = "readRaw",
    tag = "files",
    params(("id" = String, Path, description = VM), PathQuery),
    responses((status = 200, description = "The file's bytes", body = [u8],
        content_type = "application/octet-stream"), RawErrors))]
pub async fn get_raw(
    State(app): State<Arc<App>>,
    caller: Caller,
    vm: Vm,
    q: Q<PathQuery>,
) -> Result<Response, ApiError> {
    let q = path_query(q)?;
    let super::lifecycle::Live { s, agent, busy } = app.live(&caller, &vm).await?;
    // The first chunk tells a missing file or an escape from a good start.
    let first = async {
        let mut r = agent.read_file(&q.path, 0, None).await?;
        let c = r.next_chunk().await?;
        Ok::<_, ClientError>((r, c))
    };
    let (reader, first) = match first.await {
        Ok(v) => v,
        Err(e) => return Err(file_error(&app, &s, &q.path, e).await),
    };
    let head = futures_util::stream::iter(first.map(|c| Ok::<_, std::io::Error>(Bytes::from(c))));
    let rest = futures_util::stream::unfold(Some(reader), |r| async move {
        let mut r = r?;
        match r.next_chunk().await {
            Ok(Some(c)) => Some((Ok(Bytes::from(c)), Some(r))),
            Ok(None) => None,
            // The client sees the body end early (the connection is cut).
            Err(e) => Some((Err(std::io::Error::other(e.to_string())), None)),
        }
    });
    use futures_util::StreamExt as _;
    // Busy (never put to sleep) until the body is sent or dropped.
    let body = axum::body::Body::from_stream(head.chain(rest).map(move |x| {
        let _ = &busy;
        x
    }));
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], body).into_response())
}

/// Upload a file
///
/// The request body streamed into the file (created or replaced), with no
/// size cap (the 1 MiB body limit does not apply here); a body that fails
/// part way removes the file (`400 bad_request`).
#[utoipa::path(put, path = "/v1/runtime/vms/{id}/files/raw", operation_id = "writeRaw",
    tag = "files",
    params(("id" = String, Path, description = VM), PathQuery),
    request_body(content = [u8], content_type = "application/octet-stream", description = "The file's bytes"),
    responses((status = 200, description = "Written", body = Written), RawErrors))]
pub async fn put_raw(
    State(app): State<Arc<App>>,
    caller: Caller,
    vm: Vm,
    q: Q<PathQuery>,
    body: axum::body::Body,
) -> Result<Json<Written>, ApiError> {
    let q = path_query(q)?;
    let super::lifecycle::Live {
        s,
        agent,
        busy: _busy,
    } = app.live(&caller, &vm).await?;
    let (mut rd, mut wr) = tokio::io::duplex(RAW_PIPE);
    let feeder = tokio::spawn(async move {
        use futures_util::StreamExt as _;
        use tokio::io::AsyncWriteExt as _;
        let mut stream = body.into_data_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| e.to_string())?;
            wr.write_all(&chunk)
                .await
                .map_err(|e| format!("the agent stopped reading: {e}"))?;
        }
        wr.shutdown().await.map_err(|e| e.to_string())
    });
    let wrote = agent
        .write_file(
            &q.path,
            guest_agent::client::WriteOptions::default(),
            &mut rd,
        )
        .await;
    let fed = feeder
        .await
        .unwrap_or_else(|e| Err(format!("the body task failed: {e}")));
    match (wrote, fed) {
        (Ok(bytes), Ok(())) => Ok(Json(Written {
            path: q.path,
            bytes,
        })),
        (Err(e), _) => Err(file_error(&app, &s, &q.path, e).await),
        (Ok(_), Err(why)) => {
            // A partial file must not look like the upload.
            let _ = agent.remove(&q.path, false).await;
            Err(ApiError::new(
                Code::BadRequest,
                format!("The upload of {} failed part way: {why}", q.path),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::openapi::tests::assert_fits;

    #[test]
    fn openapi_file_answers_fit_their_schemas() {
        let l = Listing {
            path: "d".into(),
            entries: vec![
                Entry {
                    name: "a".into(),
                    kind: kind(FileKind::File),
                    size: 5,
                },
                Entry {
                    name: "b".into(),
                    kind: kind(FileKind::Symlink),
                    size: 0,
                },
            ],
            truncated: false,
        };
        let v = serde_json::to_value(&l).unwrap();
        assert_eq!(v["entries"][1]["type"], "symlink");
        assert_fits("FileList", &v);
        let w = Written {
            path: "a".into(),
            bytes: 5,
        };
        assert_fits("FileWritten", &serde_json::to_value(&w).unwrap());
        let m = Made {
            path: "d".into(),
            created: true,
        };
        assert_fits("DirMade", &serde_json::to_value(&m).unwrap());
        let r = Removed {
            path: "d".into(),
            deleted: true,
        };
        assert_fits("FileDeleted", &serde_json::to_value(&r).unwrap());
        let j = r#"{"path":"d/e","parents":true}"#;
        serde_json::from_str::<MkdirReq>(j).unwrap();
        assert_fits("MakeDir", &serde_json::from_str(j).unwrap());
    }

    #[test]
    fn only_delete_takes_recursive() {
        let q = |s: &str| axum::extract::Query::<PathQuery>::try_from_uri(&s.parse().unwrap());
        assert!(q("/x?path=a").is_ok());
        assert!(q("/x?path=a&recursive=true").is_err());
        let r = |s: &str| axum::extract::Query::<RemoveQuery>::try_from_uri(&s.parse().unwrap());
        assert!(r("/x?path=a&recursive=true").unwrap().recursive);
    }
}
