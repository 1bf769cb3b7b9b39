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

use super::error::{ApiError, Code};
use super::exec::{agent_for, failure};
use super::routes::ApiJson;
use super::App;

/// Most bytes of text `files/content` reads or writes.
pub const MAX_TEXT: usize = 1 << 20;
/// Most entries one listing shows.
const MAX_ENTRIES: usize = 10_000;

type Vm = axum::extract::Path<String>;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathQuery {
    path: String,
    /// `DELETE`: remove a directory and everything in it.
    #[serde(default)]
    recursive: bool,
}

fn query(
    q: Result<Query<PathQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<PathQuery, ApiError> {
    let Query(q) = q.map_err(|e| {
        ApiError::new(
            Code::BadRequest,
            format!("Bad query string (path=... is required): {e}"),
        )
    })?;
    if q.path.is_empty() || q.path.contains('\0') {
        return Err(ApiError::new(
            Code::InvalidPath,
            "path must be a non-empty path without NUL",
        ));
    }
    Ok(q)
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

#[derive(Serialize)]
struct Entry {
    name: String,
    #[serde(rename = "type")]
    kind: &'static str,
    size: u64,
}

#[derive(Serialize)]
pub struct Listing {
    path: String,
    entries: Vec<Entry>,
    truncated: bool,
}

fn kind(k: FileKind) -> &'static str {
    match k {
        FileKind::File => "file",
        FileKind::Dir => "dir",
        FileKind::Symlink => "symlink",
        FileKind::Other => "other",
    }
}

pub async fn list(
    State(app): State<Arc<App>>,
    vm: Vm,
    q: Result<Query<PathQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Listing>, ApiError> {
    let q = query(q)?;
    let (s, agent) = agent_for(&app, &vm).await?;
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

pub async fn get_content(
    State(app): State<Arc<App>>,
    vm: Vm,
    q: Result<Query<PathQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let q = query(q)?;
    let (s, agent) = agent_for(&app, &vm).await?;
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

#[derive(Serialize)]
pub struct Written {
    path: String,
    bytes: u64,
}

/// The body is the file's new content, UTF-8 text of at most [`MAX_TEXT`]
/// bytes (the request body limit).
pub async fn put_content(
    State(app): State<Arc<App>>,
    vm: Vm,
    q: Result<Query<PathQuery>, axum::extract::rejection::QueryRejection>,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Json<Written>, ApiError> {
    let q = query(q)?;
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
    let (s, agent) = agent_for(&app, &vm).await?;
    match agent.write_bytes(&q.path, &body).await {
        Ok(bytes) => Ok(Json(Written {
            path: q.path,
            bytes,
        })),
        Err(e) => Err(file_error(&app, &s, &q.path, e).await),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MkdirReq {
    path: String,
    /// Make missing parents too.
    #[serde(default)]
    parents: bool,
}

pub async fn mkdir(
    State(app): State<Arc<App>>,
    vm: Vm,
    ApiJson(req): ApiJson<MkdirReq>,
) -> Result<Json<serde_json::Value>, ApiError> {
    if req.path.is_empty() || req.path.contains('\0') {
        return Err(ApiError::new(
            Code::InvalidPath,
            "path must be a non-empty path without NUL",
        ));
    }
    let (s, agent) = agent_for(&app, &vm).await?;
    match agent.mkdir(&req.path, req.parents).await {
        Ok(()) => Ok(Json(
            serde_json::json!({ "path": req.path, "created": true }),
        )),
        Err(e) => Err(file_error(&app, &s, &req.path, e).await),
    }
}

pub async fn remove(
    State(app): State<Arc<App>>,
    vm: Vm,
    q: Result<Query<PathQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let q = query(q)?;
    let (s, agent) = agent_for(&app, &vm).await?;
    match agent.remove(&q.path, q.recursive).await {
        Ok(()) => Ok(Json(serde_json::json!({ "path": q.path, "deleted": true }))),
        Err(e) => Err(file_error(&app, &s, &q.path, e).await),
    }
}

/// Bytes of a raw transfer buffered between HTTP and the agent.
const RAW_PIPE: usize = 256 * 1024;

/// `GET /vms/{id}/files/raw?path=`: the file's bytes, streamed as the agent
/// sends them (no size cap; never held whole here).
pub async fn get_raw(
    State(app): State<Arc<App>>,
    vm: Vm,
    q: Result<Query<PathQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let q = query(q)?;
    let (s, agent) = agent_for(&app, &vm).await?;
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
    let body = axum::body::Body::from_stream(head.chain(rest));
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], body).into_response())
}

/// `PUT /vms/{id}/files/raw?path=`: the request body streamed into the
/// file (created or truncated), with no size cap; a body that fails part
/// way removes the file.
pub async fn put_raw(
    State(app): State<Arc<App>>,
    vm: Vm,
    q: Result<Query<PathQuery>, axum::extract::rejection::QueryRejection>,
    body: axum::body::Body,
) -> Result<Json<Written>, ApiError> {
    let q = query(q)?;
    let (s, agent) = agent_for(&app, &vm).await?;
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
