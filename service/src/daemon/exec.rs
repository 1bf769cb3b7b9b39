//! `POST /v1/runtime/vms/{id}/exec`: one command run to its end through the
//! sandbox's agent, its output buffered (at most [`MAX_OUTPUT`] bytes per
//! stream; the rest is counted, dropped and flagged).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use guest_agent::client::ClientError;
use guest_agent::protocol::{ErrorCode as AgentCode, Exec};
use serde::{Deserialize, Serialize};
use sprout_worker::protocol::WorkerState;
use utoipa::ToSchema;

use super::error::{chain, ApiError, Code};
use super::exec_limits::{ExecLimits, ExecSlot};
use super::openapi::errors;
use super::registry::Sandbox;
use super::routes::{check_env, ApiJson};
use super::supervisor::describe;
use super::tenants::Caller;
use super::App;

/// Most bytes of each output stream a buffered exec returns.
pub const MAX_OUTPUT: usize = 1 << 20;
/// Longest `timeoutMs`: a day.
const MAX_TIMEOUT_MS: i64 = 24 * 3600 * 1000;
const MAX_ARGS: usize = 4096;
const MAX_COMMAND: usize = 64 * 1024;

/// A command to run.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(as = ExecRequest)]
pub struct ExecReq {
    /// The program: a path, or a name looked up in `PATH` (execve-style; for
    /// a shell line, `/bin/sh` with argv `["-c", LINE]`). 1 byte to 64 KiB.
    #[schema(min_length = 1, max_length = 65536, example = "python3")]
    command: String,
    /// `argv[1..]` (at most 4096).
    #[serde(default)]
    #[schema(max_items = 4096)]
    argv: Vec<String>,
    /// On top of the sandbox's own `env` (the same rules).
    #[serde(default)]
    env: BTreeMap<String, String>,
    /// The working directory (default: the agent's, `/workspace`).
    cwd: Option<String>,
    /// Text fed to the process's stdin, then end of file (default:
    /// `/dev/null`).
    stdin: Option<String>,
    /// `stdin` is base64 (for binary input).
    #[serde(default)]
    stdin_base64: bool,
    /// Kill the whole process group with SIGKILL after this long
    /// (`timedOut` says so).
    #[schema(minimum = 1, maximum = 86400000)]
    timeout_ms: Option<i64>,
    /// Start it as a background process: the answer is `{execId, pid}` at
    /// once (see /processes).
    #[serde(default)]
    background: bool,
    /// Background processes: keep stdin open for `POST .../stdin`.
    #[serde(default)]
    stdin_open: bool,
}

/// A buffered exec's answer.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = ExecResult)]
pub struct ExecResp {
    /// At most 1 MiB (the rest is dropped: `stdoutTruncated`).
    stdout: String,
    stderr: String,
    /// `stdout` is base64: the output was not UTF-8.
    stdout_base64: bool,
    stderr_base64: bool,
    /// Null when a signal ended the process.
    #[schema(required = true)]
    exit_code: Option<i32>,
    /// The signal that ended the process, if one did.
    #[schema(required = true)]
    signal: Option<i32>,
    duration_ms: u64,
    /// The `timeoutMs` passed and the process group was killed.
    timed_out: bool,
    stdout_truncated: bool,
    stderr_truncated: bool,
}

fn text(bytes: Vec<u8>) -> (String, bool) {
    match String::from_utf8(bytes) {
        Ok(s) => (s, false),
        Err(e) => (
            base64::engine::general_purpose::STANDARD.encode(e.as_bytes()),
            true,
        ),
    }
}

fn check(req: &ExecReq) -> Result<Option<Vec<u8>>, ApiError> {
    if req.command.is_empty() || req.command.len() > MAX_COMMAND || req.command.contains('\0') {
        return Err(ApiError::field(
            "command",
            format!("command must be 1 to {MAX_COMMAND} bytes with no NUL"),
        ));
    }
    if req.argv.len() > MAX_ARGS || req.argv.iter().any(|a| a.contains('\0')) {
        return Err(ApiError::field(
            "argv",
            format!("argv must be at most {MAX_ARGS} arguments with no NUL"),
        ));
    }
    check_env("env", &req.env)?;
    if req
        .cwd
        .as_ref()
        .is_some_and(|c| c.is_empty() || c.contains('\0'))
    {
        return Err(ApiError::field("cwd", "cwd must be a path with no NUL"));
    }
    if let Some(t) = req.timeout_ms {
        if !(1..=MAX_TIMEOUT_MS).contains(&t) {
            return Err(ApiError::field(
                "timeoutMs",
                format!("timeoutMs is {t}: it must be 1 to {MAX_TIMEOUT_MS}"),
            ));
        }
    }
    if req.stdin_open && !req.background {
        return Err(ApiError::field(
            "stdinOpen",
            "stdinOpen is for background processes",
        ));
    }
    match (&req.stdin, req.stdin_base64) {
        (None, _) => Ok(None),
        (Some(s), false) => Ok(Some(s.clone().into_bytes())),
        (Some(s), true) => base64::engine::general_purpose::STANDARD
            .decode(s)
            .map(Some)
            .map_err(|e| ApiError::field("stdin", format!("stdin is not base64: {e}"))),
    }
}

errors!(
    ExecErrors = [
        InvalidJson,
        InvalidBody,
        InvalidValue,
        UnsupportedMediaType,
        PayloadTooLarge,
        VmNotFound,
        NotSupported,
        InvalidState,
        Paused,
        ExecFailed,
        StdinClosed,
        ProcessNotFound,
        Busy,
        TooManyRequests,
        AgentUnavailable,
        QuotaExhausted,
    ]
);

/// Run a command
///
/// Runs one command to its end through the sandbox's agent and answers with
/// its output, buffered (`application/json`), or streamed with `Accept:
/// text/event-stream`: Server-Sent Events as the output happens, `stdout`
/// and `stderr` events whose data is an `ExecChunk`, then one `exit`
/// (`ExecExit`) or one `error` (`ErrorEnvelope`) event; event ids count
/// from 1. A client that goes away ends a streamed exec (its process group
/// is killed). With `"background": true` the process starts in the
/// background and the answer is `201` with its `execId` at once (see
/// /processes). An exec past the limits `/v1/info` shows (`execLimits`)
/// is refused at once: `429 too_many_requests` with `Retry-After`.
#[utoipa::path(post, path = "/v1/runtime/vms/{id}/exec", operation_id = "exec", tag = "exec",
    params(("id" = String, Path, description = "The sandbox's id")),
    request_body = ExecReq,
    responses(
        (status = 200, description = "The command ran to its end (buffered), or its events \
            (Accept: text/event-stream)", content(
            (ExecResp = "application/json"),
            (String = "text/event-stream"),
        )),
        (status = 201, description = "A background process started", body = super::procs::Started),
        ExecErrors,
    ))]
pub async fn exec(
    State(app): State<Arc<App>>,
    caller: Caller,
    limits: axum::Extension<Arc<ExecLimits>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<ExecReq>,
) -> Result<Response, ApiError> {
    let stdin = check(&req)?;
    let super::lifecycle::Live { s, agent, busy } = app.live(&caller, &id).await?;
    // Held until the answer is complete (a background process: while it
    // starts); refused at once over the limits.
    let policy = app.tenants.policy(&s.tenant);
    let slot = limits
        .try_acquire(s.id, &s.tenant, policy.max_execs)
        .inspect_err(|e| {
            tracing::info!(vm = %s.id, "exec refused: {}", e.message);
        })?;
    // The sandbox's env, then the request's on top.
    let mut env = s.env.clone();
    env.extend(req.env);
    let x = Exec {
        command: req.command,
        argv: req.argv,
        env: env.into_iter().collect(),
        cwd: req.cwd,
        timeout_ms: req.timeout_ms.map(|t| t as u64),
        output_limit: Some(MAX_OUTPUT as u64),
        ..Exec::default()
    };
    if req.background {
        let started = super::procs::start(&app, &s, &agent, x, stdin, req.stdin_open).await;
        drop(slot);
        drop(busy);
        return started;
    }
    let streamed = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("text/event-stream"));
    tracing::info!(vm = %s.id, command = %x.command, streamed, "exec");
    let t = std::time::Instant::now();
    if streamed {
        return stream(app, s, agent, x, stdin, (slot, busy)).await;
    }
    let out = match agent.exec_output(x, stdin, MAX_OUTPUT).await {
        Ok(out) => out,
        Err(e) => return Err(failure(&app, &s, &e).await),
    };
    app.metrics.exec.observe(t.elapsed());
    drop(slot);
    drop(busy);
    let (stdout, stdout_base64) = text(out.stdout);
    let (stderr, stderr_base64) = text(out.stderr);
    let e = out.exit;
    Ok(Json(ExecResp {
        stdout,
        stderr,
        stdout_base64,
        stderr_base64,
        exit_code: e.code,
        signal: e.signal,
        duration_ms: e.duration_us / 1000,
        timed_out: e.timed_out,
        stdout_truncated: e.stdout_truncated,
        stderr_truncated: e.stderr_truncated,
    })
    .into_response())
}

/// What the `exit` event of a streamed exec carries.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = ExecExit)]
pub struct ExitEvent {
    #[schema(required = true)]
    exit_code: Option<i32>,
    #[schema(required = true)]
    signal: Option<i32>,
    duration_ms: u64,
    timed_out: bool,
    stdout_truncated: bool,
    stderr_truncated: bool,
}

/// A `stdout` or `stderr` event's data (streamed execs and attached
/// background processes).
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = ExecChunk)]
pub struct Chunk {
    /// UTF-8 text, or base64 when `base64`.
    data: String,
    /// The bytes were not UTF-8 text.
    base64: bool,
}

impl Chunk {
    pub fn new(data: String, base64: bool) -> Self {
        Self { data, base64 }
    }
}

/// Splits a stream's bytes into chunks to send: the valid UTF-8 as text,
/// keeping an incomplete character at the end for the next read; bytes that
/// are not UTF-8 as base64.
#[derive(Default)]
struct Utf8Chunks {
    carry: Vec<u8>,
}

impl Utf8Chunks {
    fn push(&mut self, data: &[u8]) -> Option<Chunk> {
        self.carry.extend_from_slice(data);
        let (text_len, keep) = match std::str::from_utf8(&self.carry) {
            Ok(_) => (self.carry.len(), 0),
            // A character cut at the end: keep its start (at most 3 bytes).
            Err(e) if e.error_len().is_none() => {
                (e.valid_up_to(), self.carry.len() - e.valid_up_to())
            }
            Err(_) => {
                let all = std::mem::take(&mut self.carry);
                return Some(Chunk {
                    data: base64::engine::general_purpose::STANDARD.encode(all),
                    base64: true,
                });
            }
        };
        if text_len == 0 {
            return None;
        }
        let rest = self.carry.split_off(text_len);
        let text = std::mem::replace(&mut self.carry, rest);
        debug_assert!(self.carry.len() == keep);
        Some(Chunk {
            data: String::from_utf8(text).unwrap_or_default(),
            base64: false,
        })
    }

    /// What is left at the exit (a cut character): base64.
    fn finish(&mut self) -> Option<Chunk> {
        (!self.carry.is_empty()).then(|| Chunk {
            data: base64::engine::general_purpose::STANDARD.encode(std::mem::take(&mut self.carry)),
            base64: true,
        })
    }
}

/// Most events a streamed exec buffers for a slow client before the
/// process waits (the agent connection is the backpressure beyond it).
const STREAM_BUFFER: usize = 64;

/// A streamed exec: SSE `stdout` and `stderr` events as output arrives,
/// then one `exit` (or `error`) event; ids count from 1. A client that goes
/// away ends the exec (its process group is killed).
async fn stream(
    app: Arc<App>,
    s: Sandbox,
    agent: Arc<guest_agent::client::Client>,
    mut x: Exec,
    stdin: Option<Vec<u8>>,
    slot: (ExecSlot, super::lifecycle::Busy),
) -> Result<Response, ApiError> {
    if stdin.is_some() {
        x.stdin = guest_agent::protocol::StdinMode::Stream;
    }
    let mut session = match agent.exec(x).await {
        Ok(session) => session,
        Err(e) => return Err(failure(&app, &s, &e).await),
    };
    if let (Some(data), Some(mut w)) = (stdin, session.take_stdin()) {
        tokio::spawn(async move {
            // The process may stop reading early: its exit tells, not this.
            if w.write(&data).await.is_ok() {
                let _ = w.close().await;
            }
        });
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Event>(STREAM_BUFFER);
    let t = std::time::Instant::now();
    tokio::spawn(async move {
        // In flight until the stream ends, however it ends.
        let _slot = slot;
        let mut n = 0u64;
        let mut next_id = || {
            n += 1;
            n.to_string()
        };
        let (mut out, mut err) = (Utf8Chunks::default(), Utf8Chunks::default());
        let chunk_event = |name: &'static str, c: Chunk, id: String| {
            Event::default()
                .event(name)
                .id(id)
                .json_data(c)
                .unwrap_or_else(|_| Event::default().event(name))
        };
        loop {
            // A client gone while the process is silent ends it too.
            let next = tokio::select! {
                next = session.next_event() => next,
                () = tx.closed() => return,
            };
            let ev = match next {
                Ok(Some(guest_agent::client::ExecEvent::Stdout(d))) => {
                    out.push(&d).map(|c| chunk_event("stdout", c, next_id()))
                }
                Ok(Some(guest_agent::client::ExecEvent::Stderr(d))) => {
                    err.push(&d).map(|c| chunk_event("stderr", c, next_id()))
                }
                Ok(Some(guest_agent::client::ExecEvent::Exit(e))) => {
                    for (name, c) in [("stdout", out.finish()), ("stderr", err.finish())] {
                        if let Some(c) = c {
                            let _ = tx.send(chunk_event(name, c, next_id())).await;
                        }
                    }
                    app.metrics.exec.observe(t.elapsed());
                    let exit = ExitEvent {
                        exit_code: e.code,
                        signal: e.signal,
                        duration_ms: e.duration_us / 1000,
                        timed_out: e.timed_out,
                        stdout_truncated: e.stdout_truncated,
                        stderr_truncated: e.stderr_truncated,
                    };
                    let ev = Event::default().event("exit").id(next_id());
                    let _ = tx.send(ev.json_data(exit).unwrap_or_default()).await;
                    return;
                }
                Ok(None) => return,
                Err(e) => {
                    let e = failure(&app, &s, &e).await;
                    let body = serde_json::json!({"error": {"code": e.code, "message": e.message}});
                    let ev = Event::default().event("error").id(next_id());
                    let _ = tx.send(ev.json_data(body).unwrap_or_default()).await;
                    return;
                }
            };
            // A send fails once the client has gone: dropping the session
            // then ends the exec.
            if let Some(ev) = ev {
                if tx.send(ev).await.is_err() {
                    return;
                }
            }
        }
    });
    Ok(sse_response(rx))
}

/// An SSE answer that sends what arrives on `rx`, with keep-alives, until
/// the sender is dropped.
pub(super) fn sse_response(rx: tokio::sync::mpsc::Receiver<Event>) -> Response {
    let events = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|ev| (Ok::<_, std::convert::Infallible>(ev), rx))
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// The answer to a failed exec. When the agent could not be reached, the
/// sandbox's worker is asked whether it still holds a live VM: if not (a
/// killed worker, a guest that ended), the sandbox becomes `failed` with
/// the reason.
pub async fn failure(app: &Arc<App>, s: &Sandbox, e: &ClientError) -> ApiError {
    let err = agent_error(s.id, e);
    let Some(sock) = s
        .worker_socket
        .clone()
        .filter(|_| err.code == Code::AgentUnavailable)
    else {
        return err;
    };
    let pid = s.pid;
    let why = tokio::task::spawn_blocking(move || match describe(&sock) {
        Err(e) => Some(format!("The sandbox's worker is gone ({e})")),
        Ok(d) if pid.is_some_and(|p| p != d.pid) => Some(format!(
            "Another process (pid {}) answers on the worker's socket",
            d.pid
        )),
        Ok(d) => match d.state {
            WorkerState::Running | WorkerState::Paused | WorkerState::Created => None,
            other => Some(format!("The sandbox's VM ended ({other})")),
        },
    })
    .await
    .ok()
    .flatten();
    let (Some(why), Some(pid)) = (why, s.pid) else {
        return err;
    };
    let (id, reason) = (s.id, why.clone());
    // Only if it still runs on that worker: a hibernate, reboot or
    // checkpoint restore that stopped or replaced it cut this call off.
    match app.db(move |r| r.fail_worker(id, pid, &reason)).await {
        Ok(true) => {}
        Ok(false) => return err,
        Err(e) => return e,
    }
    tracing::warn!(vm = %id, "marked failed: {why}");
    super::lock(&app.agents).remove(&id);
    ApiError::new(
        Code::AgentUnavailable,
        format!("Sandbox {id} has failed: {why}"),
    )
}

fn agent_error(id: uuid::Uuid, e: &ClientError) -> ApiError {
    match e {
        ClientError::Agent {
            code: AgentCode::Busy,
            message,
        } => ApiError::new(Code::Busy, format!("Sandbox {id} is busy: {message}")),
        ClientError::Agent { code, message } => ApiError::new(
            Code::ExecFailed,
            format!("The command could not run ({code:?}): {message}"),
        ),
        e => ApiError::new(
            Code::AgentUnavailable,
            format!("The agent of sandbox {id} failed: {}", chain(e)),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::openapi::tests::assert_fits;

    #[test]
    fn openapi_exec_answers_and_events_fit_their_schemas() {
        let out = ExecResp {
            stdout: "hi\n".into(),
            stderr: String::new(),
            stdout_base64: false,
            stderr_base64: false,
            exit_code: None,
            signal: Some(9),
            duration_ms: 3,
            timed_out: true,
            stdout_truncated: false,
            stderr_truncated: false,
        };
        assert_fits("ExecResult", &serde_json::to_value(&out).unwrap());
        let exit = ExitEvent {
            exit_code: Some(0),
            signal: None,
            duration_ms: 1,
            timed_out: false,
            stdout_truncated: false,
            stderr_truncated: true,
        };
        assert_fits("ExecExit", &serde_json::to_value(&exit).unwrap());
        assert_fits(
            "ExecChunk",
            &serde_json::to_value(Chunk::new("/w==".into(), true)).unwrap(),
        );
    }

    #[test]
    fn openapi_exec_requests_that_parse_fit_the_request_schema() {
        for j in [
            r#"{"command":"ls"}"#,
            r#"{"command":"sh","argv":["-c","x"],"env":{"A":"1"},"cwd":null,"stdin":"x",
                "stdinBase64":false,"timeoutMs":5,"background":true,"stdinOpen":true}"#,
        ] {
            req(j);
            assert_fits("ExecRequest", &serde_json::from_str(j).unwrap());
        }
    }

    fn req(json: &str) -> ExecReq {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn output_that_is_not_utf8_is_base64() {
        assert_eq!(text(b"hi\n".to_vec()), ("hi\n".into(), false));
        assert_eq!(text(vec![0xff, 0x00]), ("/wA=".into(), true));
    }

    #[test]
    fn streamed_output_keeps_characters_whole_and_sends_the_rest_as_base64() {
        let mut c = Utf8Chunks::default();
        let euro = "€".as_bytes(); // 3 bytes
        let a = c.push(&[b'a', euro[0]]).unwrap();
        assert_eq!((a.data.as_str(), a.base64), ("a", false));
        assert!(c.push(&euro[1..2]).is_none(), "still cut");
        let b = c.push(&[euro[2], b'b']).unwrap();
        assert_eq!((b.data.as_str(), b.base64), ("€b", false));
        let bad = c.push(&[0xff, b'x']).unwrap();
        assert_eq!((bad.data.as_str(), bad.base64), ("/3g=", true));
        assert!(c.finish().is_none());
        assert!(c.push(&euro[..2]).is_none());
        let end = c.finish().unwrap();
        assert!(end.base64);
        assert_eq!(
            base64::engine::general_purpose::STANDARD
                .decode(end.data)
                .unwrap(),
            &euro[..2]
        );
    }

    #[test]
    fn exec_requests_are_checked_field_by_field() {
        let field = |j: &str| check(&req(j)).unwrap_err().field;
        assert_eq!(field(r#"{"command":""}"#), Some("command"));
        assert_eq!(field(r#"{"command":"a\u0000b"}"#), Some("command"));
        assert_eq!(
            field(r#"{"command":"ls","timeoutMs":0}"#),
            Some("timeoutMs")
        );
        assert_eq!(
            field(r#"{"command":"ls","timeoutMs":86400001}"#),
            Some("timeoutMs")
        );
        assert_eq!(field(r#"{"command":"ls","env":{"A=B":"x"}}"#), Some("env"));
        assert_eq!(field(r#"{"command":"ls","cwd":""}"#), Some("cwd"));
        assert_eq!(
            field(r#"{"command":"cat","stdin":"%%%","stdinBase64":true}"#),
            Some("stdin")
        );
        let ok = check(&req(
            r#"{"command":"cat","stdin":"aGk=","stdinBase64":true}"#,
        ))
        .unwrap();
        assert_eq!(ok, Some(b"hi".to_vec()));
        assert!(serde_json::from_str::<ExecReq>(r#"{"command":"ls","shell":true}"#).is_err());
        assert_eq!(
            field(r#"{"command":"cat","stdinOpen":true}"#),
            Some("stdinOpen")
        );
        assert!(check(&req(
            r#"{"command":"cat","stdinOpen":true,"background":true}"#
        ))
        .is_ok());
    }
}
