//! Background processes: `POST /vms/{id}/exec` with `"background": true`
//! starts one and answers `{execId, pid}` at once; it lives in the agent
//! whatever happens to any HTTP connection. `GET /vms/{id}/processes` lists
//! them, `GET .../processes/{execId}/events` attaches (SSE: replays the
//! agent's kept events after `Last-Event-ID`, then follows live ones to the
//! exit), `POST .../stdin` feeds stdin, `POST .../signal` signals the whole
//! process group.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use guest_agent::client::{ClientError, ProcEvent};
use guest_agent::protocol::{ErrorCode as AgentCode, Exec, StdinMode, StreamKind};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::error::{ApiError, Code};
use super::exec::{failure, sse_response, Chunk};
use super::openapi::errors;
use super::routes::ApiJson;
use super::tenants::Caller;
use super::App;

/// Most events an attach buffers for a slow client (the agent connection
/// is the backpressure beyond it).
const STREAM_BUFFER: usize = 64;

/// A background process, started.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = ProcessStarted)]
pub struct Started {
    /// Its id in the sandbox's agent (for /processes/{execId}).
    exec_id: u64,
    /// Its pid in the guest.
    pid: u32,
}

/// Starts `x` in the background; with `stdin`, feeds it (and closes stdin
/// unless `keep_open`).
pub async fn start(
    app: &Arc<App>,
    s: &super::registry::Sandbox,
    agent: &guest_agent::client::Client,
    mut x: Exec,
    stdin: Option<Vec<u8>>,
    keep_open: bool,
) -> Result<Response, ApiError> {
    let stdin_streamed = stdin.is_some() || keep_open;
    if stdin_streamed {
        x.stdin = StdinMode::Stream;
    }
    let started = match agent.exec_background(x).await {
        Ok(st) => st,
        Err(e) => return Err(failure(app, s, &e).await),
    };
    tracing::info!(vm = %s.id, exec_id = started.exec_id, pid = started.pid, "background process");
    if let Some(data) = stdin {
        agent
            .proc_stdin(started.exec_id, &data)
            .await
            .map_err(|e| proc_error(&e))?;
    }
    if stdin_streamed && !keep_open {
        // Only stdin given: the process reads it, then end of file.
        agent
            .proc_stdin_close(started.exec_id)
            .await
            .map_err(|e| proc_error(&e))?;
    }
    Ok((
        axum::http::StatusCode::CREATED,
        Json(Started {
            exec_id: started.exec_id,
            pid: started.pid,
        }),
    )
        .into_response())
}

/// An agent refusal about a background process, as the API tells it.
fn proc_error(e: &ClientError) -> ApiError {
    match e {
        ClientError::Agent {
            code: AgentCode::NoSuchExec,
            message,
        } => ApiError::new(Code::ProcessNotFound, format!("No such process: {message}")),
        ClientError::Agent {
            code: AgentCode::StdinClosed,
            message,
        } => ApiError::new(
            Code::StdinClosed,
            format!("The process's stdin is closed: {message}"),
        ),
        ClientError::Agent {
            code: AgentCode::InvalidSignal,
            message,
        } => ApiError::field("signal", format!("Not a signal the agent sends: {message}")),
        ClientError::Agent { code, message } => ApiError::new(
            Code::ExecFailed,
            format!("The agent refused ({code:?}): {message}"),
        ),
        e => ApiError::new(
            Code::AgentUnavailable,
            format!("The agent failed: {}", super::error::chain(e)),
        ),
    }
}

fn exec_id(raw: &str) -> Result<u64, ApiError> {
    raw.parse().map_err(|_| {
        ApiError::new(
            Code::ProcessNotFound,
            format!("No process has the id {raw:?}"),
        )
    })
}

/// A background process.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = Process)]
struct ProcView {
    exec_id: u64,
    pid: u32,
    /// The command line, for people.
    command: String,
    running: bool,
    /// Null while it runs.
    #[schema(required = true)]
    exit: Option<ExitView>,
    /// By the guest's clock (RFC 3339 UTC with milliseconds).
    #[schema(format = DateTime)]
    started_at: String,
    stdin_open: bool,
    /// The oldest event kept (replay starts there at the earliest) and the
    /// id the next event will have.
    first_event_id: u64,
    next_event_id: u64,
    dropped_events: u64,
    dropped_bytes: u64,
}

/// How a background process ended (also its `exit` event's data).
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = ProcessExit)]
struct ExitView {
    #[schema(required = true)]
    exit_code: Option<i32>,
    #[schema(required = true)]
    signal: Option<i32>,
    duration_ms: u64,
    timed_out: bool,
}

impl From<&guest_agent::protocol::Exit> for ExitView {
    fn from(e: &guest_agent::protocol::Exit) -> Self {
        Self {
            exit_code: e.code,
            signal: e.signal,
            duration_ms: e.duration_us / 1000,
            timed_out: e.timed_out,
        }
    }
}

#[derive(Serialize, ToSchema)]
#[schema(as = ProcessList)]
pub struct ProcList {
    processes: Vec<ProcView>,
}

errors!(
    ListErrors = [
        VmNotFound,
        NotSupported,
        InvalidState,
        Paused,
        ExecFailed,
        AgentUnavailable,
        QuotaExhausted
    ]
);

/// List background processes
///
/// The agent keeps the running ones and the most recently finished.
#[utoipa::path(get, path = "/v1/runtime/vms/{id}/processes", operation_id = "listProcesses",
    tag = "processes",
    params(("id" = String, Path, description = "The sandbox's id")),
    responses((status = 200, description = "The background processes", body = ProcList), ListErrors))]
pub async fn list(
    State(app): State<Arc<App>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<ProcList>, ApiError> {
    let super::lifecycle::Live {
        s,
        agent,
        busy: _busy,
    } = app.live(&caller, &id).await?;
    let procs = match agent.proc_list().await {
        Ok(p) => p,
        Err(e) => return Err(failure(&app, &s, &e).await),
    };
    let processes = procs
        .into_iter()
        .map(|p| {
            let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(p.started_unix_ms);
            ProcView {
                exec_id: p.exec_id,
                pid: p.pid,
                command: p.command,
                running: p.running,
                exit: p.exit.as_ref().map(ExitView::from),
                started_at: humantime::format_rfc3339_millis(at).to_string(),
                stdin_open: p.stdin_open,
                first_event_id: p.first_seq,
                next_event_id: p.next_seq,
                dropped_events: p.dropped_events,
                dropped_bytes: p.dropped_bytes,
            }
        })
        .collect();
    Ok(Json(ProcList { processes }))
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// Replay the kept events after this id, for clients that cannot set
    /// `Last-Event-ID` (the header wins).
    last_event_id: Option<u64>,
}

/// A `gap` event's data: events the agent's ring dropped before this
/// reader got them.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = ProcessGap)]
pub struct GapEvent {
    first_event_id: u64,
    last_event_id: u64,
    /// The bytes of output dropped, when the agent knows.
    #[schema(required = true)]
    bytes: Option<u64>,
}

errors!(
    EventsErrors = [
        BadRequest,
        VmNotFound,
        ProcessNotFound,
        NotSupported,
        InvalidState,
        Paused,
        ExecFailed,
        AgentUnavailable,
        QuotaExhausted,
    ]
);

/// Attach to a background process
///
/// Server-Sent Events: the kept events after `Last-Event-ID` (all kept
/// events without it), then live ones to the exit. Events: `stdout` and
/// `stderr` (`ExecChunk`: text when the chunk is UTF-8, else base64), `gap`
/// (`ProcessGap`), one `exit` (`ProcessExit`), or `error`
/// (`ErrorEnvelope`). Each event's id is the agent's sequence number, so a
/// client that reconnects with the last id it saw misses nothing the ring
/// still holds. Dropping the stream ends the attach only.
#[utoipa::path(get, path = "/v1/runtime/vms/{id}/processes/{execId}/events",
    operation_id = "processEvents", tag = "processes",
    params(
        ("id" = String, Path, description = "The sandbox's id"),
        ("execId" = u64, Path, description = "The process's execId"),
        ("Last-Event-ID" = Option<u64>, Header, description = "Replay the kept events after this id"),
        EventsQuery,
    ),
    responses((status = 200, description = "The process's events", body = String,
        content_type = "text/event-stream"), EventsErrors))]
pub async fn events(
    State(app): State<Arc<App>>,
    caller: Caller,
    Path((id, exec)): Path<(String, String)>,
    headers: HeaderMap,
    query: Result<Query<EventsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) =
        query.map_err(|e| ApiError::new(Code::BadRequest, format!("Bad query string: {e}")))?;
    let exec = exec_id(&exec)?;
    let after = match headers.get("last-event-id") {
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| {
                    ApiError::new(Code::BadRequest, "Last-Event-ID must be an event id")
                })?,
        ),
        None => q.last_event_id,
    };
    let super::lifecycle::Live { s, agent, busy } = app.live(&caller, &id).await?;
    let mut stream = agent
        .attach(exec, after)
        .await
        .map_err(|e| proc_error(&e))?;
    let (tx, rx) = tokio::sync::mpsc::channel::<Event>(STREAM_BUFFER);
    let vm = s.id;
    tokio::spawn(async move {
        // Attached: the sandbox is busy (never put to sleep) meanwhile.
        let _busy = busy;
        loop {
            let ev = match stream.next_event().await {
                Ok(Some(ProcEvent::Output { seq, stream, data })) => {
                    let name = match stream {
                        StreamKind::Stdout => "stdout",
                        StreamKind::Stderr => "stderr",
                    };
                    let c = match String::from_utf8(data) {
                        Ok(t) => Chunk::new(t, false),
                        Err(e) => Chunk::new(
                            base64::engine::general_purpose::STANDARD.encode(e.as_bytes()),
                            true,
                        ),
                    };
                    Event::default()
                        .event(name)
                        .id(seq.to_string())
                        .json_data(c)
                        .unwrap_or_default()
                }
                Ok(Some(ProcEvent::Gap {
                    first_seq,
                    last_seq,
                    bytes,
                })) => Event::default()
                    .event("gap")
                    .id(last_seq.to_string())
                    .json_data(GapEvent {
                        first_event_id: first_seq,
                        last_event_id: last_seq,
                        bytes,
                    })
                    .unwrap_or_default(),
                Ok(Some(ProcEvent::Exit { seq, exit })) => {
                    let ev = Event::default()
                        .event("exit")
                        .id(seq.to_string())
                        .json_data(ExitView::from(&exit))
                        .unwrap_or_default();
                    let _ = tx.send(ev).await;
                    return;
                }
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(vm = %vm, exec_id = exec, "attach: {}", super::error::chain(&e));
                    let e = proc_error(&e);
                    let body = serde_json::json!({"error": {"code": e.code, "message": e.message}});
                    let ev = Event::default().event("error").json_data(body);
                    let _ = tx.send(ev.unwrap_or_default()).await;
                    return;
                }
            };
            // The client went away: the attach ends, the process runs on.
            if tx.send(ev).await.is_err() {
                return;
            }
        }
    });
    Ok(sse_response(rx))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(as = StdinWrite)]
pub struct StdinReq {
    /// Written to the process's stdin (waiting while it does not read).
    #[serde(default)]
    data: String,
    /// `data` is base64.
    #[serde(default)]
    base64: bool,
    /// Close stdin after `data` (the process reads end of file).
    #[serde(default)]
    close: bool,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = StdinWritten)]
pub struct StdinDone {
    bytes: usize,
    closed: bool,
}

errors!(
    StdinErrors = [
        InvalidJson,
        InvalidBody,
        InvalidValue,
        UnsupportedMediaType,
        PayloadTooLarge,
        VmNotFound,
        ProcessNotFound,
        StdinClosed,
        NotSupported,
        InvalidState,
        Paused,
        ExecFailed,
        AgentUnavailable,
        QuotaExhausted,
    ]
);

/// Write to a background process's stdin
///
/// For a process started with `"stdinOpen": true`; `close` closes its stdin
/// after `data` (the process reads end of file).
#[utoipa::path(post, path = "/v1/runtime/vms/{id}/processes/{execId}/stdin",
    operation_id = "processStdin", tag = "processes",
    params(
        ("id" = String, Path, description = "The sandbox's id"),
        ("execId" = u64, Path, description = "The process's execId"),
    ),
    request_body(content = Option<StdinReq>, description = "Empty counts as `{}`"),
    responses((status = 200, description = "Written", body = StdinDone), StdinErrors))]
pub async fn stdin(
    State(app): State<Arc<App>>,
    caller: Caller,
    Path((id, exec)): Path<(String, String)>,
    ApiJson(req): ApiJson<StdinReq>,
) -> Result<Json<StdinDone>, ApiError> {
    let exec = exec_id(&exec)?;
    let data = if req.base64 {
        base64::engine::general_purpose::STANDARD
            .decode(&req.data)
            .map_err(|e| ApiError::field("data", format!("data is not base64: {e}")))?
    } else {
        req.data.into_bytes()
    };
    let super::lifecycle::Live {
        agent, busy: _busy, ..
    } = app.live(&caller, &id).await?;
    if !data.is_empty() {
        agent
            .proc_stdin(exec, &data)
            .await
            .map_err(|e| proc_error(&e))?;
    }
    if req.close {
        agent
            .proc_stdin_close(exec)
            .await
            .map_err(|e| proc_error(&e))?;
    }
    Ok(Json(StdinDone {
        bytes: data.len(),
        closed: req.close,
    }))
}

/// A signal: a number 1-64, or a name (HUP, INT, QUIT, KILL, USR1, USR2,
/// TERM, CONT, STOP, with or without `SIG`).
#[derive(Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Signal {
    Number(i64),
    Name(String),
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = SignalSend)]
pub struct SignalReq {
    /// Default `TERM`.
    signal: Option<Signal>,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = SignalSent)]
pub struct Signalled {
    exec_id: u64,
    /// The signal's number.
    signal: i32,
}

/// The signals a name may give.
const SIGNALS: &[(&str, i32)] = &[
    ("HUP", 1),
    ("INT", 2),
    ("QUIT", 3),
    ("KILL", 9),
    ("USR1", 10),
    ("USR2", 12),
    ("TERM", 15),
    ("CONT", 18),
    ("STOP", 19),
];

fn signal_number(s: &Option<Signal>) -> Result<i32, ApiError> {
    match s {
        None => Ok(15),
        Some(Signal::Number(n)) if (1..=64).contains(n) => Ok(*n as i32),
        Some(Signal::Number(n)) => Err(ApiError::field(
            "signal",
            format!("signal is {n}: it must be 1 to 64"),
        )),
        Some(Signal::Name(name)) => {
            let up = name.to_ascii_uppercase();
            let bare = up.strip_prefix("SIG").unwrap_or(&up);
            SIGNALS
                .iter()
                .find(|(n, _)| *n == bare)
                .map(|(_, v)| *v)
                .ok_or_else(|| {
                    ApiError::field(
                        "signal",
                        format!(
                            "Unknown signal {name:?} (names: {})",
                            SIGNALS.iter().map(|s| s.0).collect::<Vec<_>>().join(", ")
                        ),
                    )
                })
        }
    }
}

errors!(
    SignalErrors = [
        InvalidJson,
        InvalidBody,
        InvalidValue,
        UnsupportedMediaType,
        PayloadTooLarge,
        VmNotFound,
        ProcessNotFound,
        NotSupported,
        InvalidState,
        Paused,
        ExecFailed,
        AgentUnavailable,
        QuotaExhausted,
    ]
);

/// Signal a background process
///
/// The signal reaches its whole process group.
#[utoipa::path(post, path = "/v1/runtime/vms/{id}/processes/{execId}/signal",
    operation_id = "processSignal", tag = "processes",
    params(
        ("id" = String, Path, description = "The sandbox's id"),
        ("execId" = u64, Path, description = "The process's execId"),
    ),
    request_body(content = Option<SignalReq>, description = "Empty counts as `{}` (TERM)"),
    responses((status = 200, description = "Signalled", body = Signalled), SignalErrors))]
pub async fn signal(
    State(app): State<Arc<App>>,
    caller: Caller,
    Path((id, exec)): Path<(String, String)>,
    ApiJson(req): ApiJson<SignalReq>,
) -> Result<Json<Signalled>, ApiError> {
    let exec = exec_id(&exec)?;
    let sig = signal_number(&req.signal)?;
    let super::lifecycle::Live {
        s,
        agent,
        busy: _busy,
    } = app.live(&caller, &id).await?;
    agent.kill(exec, sig).await.map_err(|e| proc_error(&e))?;
    tracing::info!(vm = %s.id, exec_id = exec, signal = sig, "signalled");
    Ok(Json(Signalled {
        exec_id: exec,
        signal: sig,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::openapi::tests::assert_fits;

    #[test]
    fn openapi_process_answers_and_events_fit_their_schemas() {
        let exit = ExitView {
            exit_code: None,
            signal: Some(15),
            duration_ms: 2,
            timed_out: false,
        };
        assert_fits("ProcessExit", &serde_json::to_value(&exit).unwrap());
        let list = ProcList {
            processes: vec![ProcView {
                exec_id: 7,
                pid: 55,
                command: "/bin/sh -c x".into(),
                running: false,
                exit: Some(exit),
                started_at: "2026-12-01T14:19:59.122Z".into(),
                stdin_open: false,
                first_event_id: 1,
                next_event_id: 4,
                dropped_events: 0,
                dropped_bytes: 0,
            }],
        };
        assert_fits("ProcessList", &serde_json::to_value(&list).unwrap());
        let started = Started {
            exec_id: 7,
            pid: 55,
        };
        assert_fits("ProcessStarted", &serde_json::to_value(&started).unwrap());
        let gap = GapEvent {
            first_event_id: 2,
            last_event_id: 9,
            bytes: None,
        };
        assert_fits("ProcessGap", &serde_json::to_value(&gap).unwrap());
        let done = StdinDone {
            bytes: 6,
            closed: true,
        };
        assert_fits("StdinWritten", &serde_json::to_value(&done).unwrap());
        let sent = Signalled {
            exec_id: 7,
            signal: 15,
        };
        assert_fits("SignalSent", &serde_json::to_value(&sent).unwrap());
        for j in [r#"{}"#, r#"{"signal":9}"#, r#"{"signal":"TERM"}"#] {
            serde_json::from_str::<SignalReq>(j).unwrap();
            assert_fits("SignalSend", &serde_json::from_str(j).unwrap());
        }
        let j = r#"{"data":"aGk=","base64":true,"close":true}"#;
        serde_json::from_str::<StdinReq>(j).unwrap();
        assert_fits("StdinWrite", &serde_json::from_str(j).unwrap());
    }

    #[test]
    fn signals_are_numbers_or_names() {
        let sig = |j: &str| signal_number(&serde_json::from_str::<SignalReq>(j).unwrap().signal);
        assert_eq!(sig("{}").unwrap(), 15);
        assert_eq!(sig(r#"{"signal":9}"#).unwrap(), 9);
        assert_eq!(sig(r#"{"signal":"SIGINT"}"#).unwrap(), 2);
        assert_eq!(sig(r#"{"signal":"kill"}"#).unwrap(), 9);
        assert_eq!(sig(r#"{"signal":0}"#).unwrap_err().field, Some("signal"));
        assert_eq!(sig(r#"{"signal":65}"#).unwrap_err().field, Some("signal"));
        assert_eq!(
            sig(r#"{"signal":"SIGFOO"}"#).unwrap_err().field,
            Some("signal")
        );
        assert!(serde_json::from_str::<SignalReq>(r#"{"sig":9}"#).is_err());
    }
}
