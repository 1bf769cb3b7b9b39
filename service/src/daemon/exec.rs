//! `POST /v1/runtime/vms/{id}/exec`: one command run to its end through the
//! sandbox's agent, its output buffered (at most [`MAX_OUTPUT`] bytes per
//! stream; the rest is counted, dropped and flagged).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::Json;
use base64::Engine as _;
use guest_agent::client::ClientError;
use guest_agent::protocol::{ErrorCode as AgentCode, Exec};
use serde::{Deserialize, Serialize};
use sprout_worker::protocol::WorkerState;

use super::error::{chain, ApiError, Code};
use super::images::TEST_GUEST_IMAGE;
use super::registry::{Sandbox, State as VmState};
use super::routes::{check_env, ApiJson};
use super::supervisor::describe;
use super::App;

/// Most bytes of each output stream a buffered exec returns.
pub const MAX_OUTPUT: usize = 1 << 20;
/// Longest `timeoutMs`: a day.
const MAX_TIMEOUT_MS: i64 = 24 * 3600 * 1000;
const MAX_ARGS: usize = 4096;
const MAX_COMMAND: usize = 64 * 1024;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ExecReq {
    /// The program: a path, or a name looked up in `PATH` (execve-style; for
    /// a shell line, `/bin/sh` with argv `["-c", LINE]`).
    command: String,
    /// `argv[1..]`.
    #[serde(default)]
    argv: Vec<String>,
    /// On top of the sandbox's own `env`.
    #[serde(default)]
    env: BTreeMap<String, String>,
    cwd: Option<String>,
    /// Bytes fed to the process's stdin, then end of file.
    stdin: Option<String>,
    /// `stdin` is base64 (for binary input).
    #[serde(default)]
    stdin_base64: bool,
    /// Kill the process group after this long (`timedOut` says so).
    timeout_ms: Option<i64>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ExecResp {
    stdout: String,
    stderr: String,
    /// `stdout` is base64: the output was not UTF-8.
    stdout_base64: bool,
    stderr_base64: bool,
    exit_code: Option<i32>,
    signal: Option<i32>,
    duration_ms: u64,
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
    match (&req.stdin, req.stdin_base64) {
        (None, _) => Ok(None),
        (Some(s), false) => Ok(Some(s.clone().into_bytes())),
        (Some(s), true) => base64::engine::general_purpose::STANDARD
            .decode(s)
            .map(Some)
            .map_err(|e| ApiError::field("stdin", format!("stdin is not base64: {e}"))),
    }
}

pub async fn exec(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ExecReq>,
) -> Result<Json<ExecResp>, ApiError> {
    let stdin = check(&req)?;
    let s = app.sandbox(&id).await?;
    if s.image == TEST_GUEST_IMAGE {
        return Err(ApiError::new(
            Code::NotSupported,
            format!(
                "Sandbox {} runs the test guest, which has no agent to exec in",
                s.id
            ),
        ));
    }
    if s.state != VmState::Running {
        return Err(ApiError::new(
            Code::InvalidState,
            format!(
                "Sandbox {} is {}: exec needs it running",
                s.id,
                s.state.as_str()
            ),
        ));
    }
    let agent = app.agent(&s).ok_or_else(|| {
        ApiError::new(
            Code::AgentUnavailable,
            format!("Sandbox {} has no vsock socket", s.id),
        )
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
    tracing::info!(vm = %s.id, command = %x.command, "exec");
    let t = std::time::Instant::now();
    let out = match agent.exec_output(x, stdin, MAX_OUTPUT).await {
        Ok(out) => out,
        Err(e) => return Err(failure(&app, &s, &e).await),
    };
    app.metrics.exec.observe(t.elapsed());
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
    }))
}

/// The answer to a failed exec. When the agent could not be reached, the
/// sandbox's worker is asked whether it still holds a live VM: if not (a
/// killed worker, a guest that ended), the sandbox becomes `failed` with
/// the reason.
async fn failure(app: &Arc<App>, s: &Sandbox, e: &ClientError) -> ApiError {
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
    let Some(why) = why else { return err };
    let (id, reason) = (s.id, why.clone());
    tracing::warn!(vm = %id, "marked failed: {why}");
    super::lock(&app.agents).remove(&id);
    if let Err(e) = app
        .db(move |r| r.set_state(id, VmState::Failed, Some(&reason)))
        .await
    {
        return e;
    }
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

    fn req(json: &str) -> ExecReq {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn output_that_is_not_utf8_is_base64() {
        assert_eq!(text(b"hi\n".to_vec()), ("hi\n".into(), false));
        assert_eq!(text(vec![0xff, 0x00]), ("/wA=".into(), true));
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
    }
}
