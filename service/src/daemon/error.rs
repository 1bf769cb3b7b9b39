//! The one error envelope of the REST API and the one mapping from stable
//! error codes to HTTP statuses.
//!
//! Every error answer is `{"error": {"code": CODE, "message": TEXT}}` (plus
//! `"field"` when one request field is to blame). Clients branch on `code`,
//! never on `message`; codes are never renamed or reused (docs/api.md).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// A stable error code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
#[schema(as = ErrorCode)]
pub enum Code {
    /// A malformed request (bad query string, bad header).
    BadRequest,
    /// The body is not JSON (a syntax error, or cut short).
    InvalidJson,
    /// The body is JSON but not of the request's shape: a wrong type, an
    /// unknown or missing field.
    InvalidBody,
    /// A field's value is outside its allowed range or set.
    InvalidValue,
    /// A body that is not `application/json`.
    UnsupportedMediaType,
    PayloadTooLarge,
    /// No such route.
    NotFound,
    /// No API key, or one that is not known or was revoked (with
    /// `--tenants`).
    Unauthorized,
    /// The tenant's key may not do this (`/metrics` needs an operator's).
    Forbidden,
    /// Every sandbox slot of the tenant is held: free one first.
    QuotaExhausted,
    MethodNotAllowed,
    /// No sandbox has this id.
    VmNotFound,
    /// The image named is not built here.
    UnknownImage,
    /// The request is impossible in the sandbox's current state.
    InvalidState,
    /// The sandbox is paused by an operator: exec, file and process calls
    /// wait for a resume (they never wake it).
    Paused,
    /// No snapshot has this id.
    SnapshotNotFound,
    /// No checkpoint has this id.
    CheckpointNotFound,
    /// The sandbox has as many checkpoints as it may keep.
    TooManyCheckpoints,
    /// A snapshot could not be written, or a sandbox's VM could not be
    /// restored from one.
    SnapshotFailed,
    /// The object store (`--s3-endpoint`) failed or refused a request an
    /// archive or unarchive needed.
    StoreFailed,
    /// The template of the create's (image, shape) is being built: retry
    /// after `Retry-After` seconds.
    TemplateBuilding,
    /// This host's KVM cannot run Linux guests (see /v1/info).
    HostUnsupported,
    /// The create's OCI image is being pulled and converted: retry after
    /// `Retry-After` seconds.
    ImagePulling,
    /// `image` is not a valid OCI reference.
    BadImageReference,
    /// The registry (or local layout) has no such image or tag.
    ImageNotFound,
    /// The image is not for linux/amd64.
    ImagePlatform,
    /// The image uses something Sprout cannot run (a layer media type, a
    /// user its /etc/passwd does not name).
    ImageUnsupported,
    /// The image is over the conversion's size limits.
    ImageTooLarge,
    /// The registry could not be reached.
    RegistryUnreachable,
    /// The registry refused the credentials.
    RegistryAuth,
    /// The registry answered with an error.
    RegistryError,
    /// A blob's digest or size does not match its manifest, or a layer is
    /// not a valid archive.
    ImageCorrupt,
    /// The base image could not be built on this host.
    ImageBuildFailed,
    /// The sandbox's VM did not come up (its worker or guest failed).
    BootFailed,
    /// The sandbox's guest agent could not be reached.
    AgentUnavailable,
    /// The agent could not start the command (no such program, bad cwd...).
    ExecFailed,
    /// The sandbox's worker process failed a request.
    WorkerFailed,
    /// The request is not possible for this kind of sandbox (an exec in the
    /// test guest, which has no agent).
    NotSupported,
    /// The sandbox's agent runs too many execs at once: retry later.
    Busy,
    /// sproutd's own exec concurrency limit (per sandbox, or for the whole
    /// service) is reached: retry after `Retry-After` seconds.
    TooManyRequests,
    /// No background process of the sandbox has this id.
    ProcessNotFound,
    /// The background process's stdin is closed (or was never open).
    StdinClosed,
    /// A file path that leaves `/workspace`.
    PathEscape,
    /// A malformed file path (empty, NUL, the root where a child is needed).
    InvalidPath,
    FileNotFound,
    /// The path exists as the wrong kind (a directory for a file...), or a
    /// directory to remove is not empty.
    FileConflict,
    PermissionDenied,
    /// A file's content is not UTF-8 text.
    NotText,
    /// Any other refusal of a file operation by the agent.
    FileError,
    /// The sandbox has not opened this port (`POST /vms/{id}/ports`).
    PortNotOpen,
    /// Nothing in the sandbox accepts connections on the port.
    PortNotListening,
    /// The sandbox has as many open ports as it may.
    TooManyPorts,
    Internal,
}

impl Code {
    pub fn status(self) -> StatusCode {
        match self {
            Self::BadRequest
            | Self::InvalidJson
            | Self::InvalidBody
            | Self::InvalidValue
            | Self::UnknownImage
            | Self::BadImageReference
            | Self::ImageNotFound
            | Self::ImagePlatform
            | Self::ImageUnsupported
            | Self::ImageTooLarge
            | Self::ExecFailed
            | Self::NotSupported
            | Self::PathEscape
            | Self::InvalidPath
            | Self::NotText
            | Self::FileError => StatusCode::BAD_REQUEST,
            Self::FileNotFound => StatusCode::NOT_FOUND,
            Self::FileConflict => StatusCode::CONFLICT,
            Self::PermissionDenied | Self::Forbidden => StatusCode::FORBIDDEN,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::QuotaExhausted => StatusCode::PAYMENT_REQUIRED,
            Self::Busy | Self::TooManyRequests => StatusCode::TOO_MANY_REQUESTS,
            Self::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::NotFound
            | Self::VmNotFound
            | Self::ProcessNotFound
            | Self::SnapshotNotFound
            | Self::CheckpointNotFound
            | Self::PortNotOpen => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::InvalidState
            | Self::Paused
            | Self::TooManyCheckpoints
            | Self::TooManyPorts
            | Self::StdinClosed => StatusCode::CONFLICT,
            Self::HostUnsupported | Self::TemplateBuilding | Self::ImagePulling => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::BootFailed
            | Self::RegistryUnreachable
            | Self::RegistryAuth
            | Self::RegistryError
            | Self::ImageCorrupt
            | Self::AgentUnavailable
            | Self::PortNotListening
            | Self::WorkerFailed
            | Self::SnapshotFailed
            | Self::StoreFailed => StatusCode::BAD_GATEWAY,
            Self::Internal | Self::ImageBuildFailed => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Every code, in the order docs/api.md lists them.
    pub const ALL: [Code; 53] = [
        Self::BadRequest,
        Self::InvalidJson,
        Self::InvalidBody,
        Self::InvalidValue,
        Self::UnknownImage,
        Self::ExecFailed,
        Self::NotSupported,
        Self::PathEscape,
        Self::InvalidPath,
        Self::NotText,
        Self::FileError,
        Self::Unauthorized,
        Self::QuotaExhausted,
        Self::Forbidden,
        Self::NotFound,
        Self::ProcessNotFound,
        Self::FileNotFound,
        Self::VmNotFound,
        Self::SnapshotNotFound,
        Self::CheckpointNotFound,
        Self::PortNotOpen,
        Self::MethodNotAllowed,
        Self::InvalidState,
        Self::Paused,
        Self::TooManyCheckpoints,
        Self::TooManyPorts,
        Self::StdinClosed,
        Self::FileConflict,
        Self::PermissionDenied,
        Self::PayloadTooLarge,
        Self::UnsupportedMediaType,
        Self::Busy,
        Self::TooManyRequests,
        Self::Internal,
        Self::BootFailed,
        Self::AgentUnavailable,
        Self::PortNotListening,
        Self::WorkerFailed,
        Self::SnapshotFailed,
        Self::StoreFailed,
        Self::HostUnsupported,
        Self::TemplateBuilding,
        Self::ImagePulling,
        Self::BadImageReference,
        Self::ImageNotFound,
        Self::ImagePlatform,
        Self::ImageUnsupported,
        Self::ImageTooLarge,
        Self::RegistryUnreachable,
        Self::RegistryAuth,
        Self::RegistryError,
        Self::ImageCorrupt,
        Self::ImageBuildFailed,
    ];

    /// The code's name in answers (`vm_not_found`).
    pub fn name(self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default()
    }

    /// What the code means, one line (the OpenAPI document's descriptions).
    pub fn meaning(self) -> &'static str {
        match self {
            Self::BadRequest => "A malformed request: a bad query string or header, an unknown query parameter",
            Self::InvalidJson => "The body is not JSON (a syntax error, or cut short)",
            Self::InvalidBody => "JSON of the wrong shape: a wrong type, an unknown or missing field",
            Self::InvalidValue => "A field's value is out of range (`field` names it)",
            Self::UnknownImage => "No image of that name is built here (the message lists the images)",
            Self::ExecFailed => "The agent could not start the command (no such program, bad cwd...)",
            Self::NotSupported => "Not possible for this sandbox (exec, processes or files in the test guest, which has no agent)",
            Self::PathEscape => "A file path that leaves /workspace",
            Self::InvalidPath => "A malformed file path (empty, NUL)",
            Self::NotText => "File content that is not UTF-8 text",
            Self::FileError => "Any other refusal of a file operation by the agent",
            Self::NotFound => "No such route",
            Self::Unauthorized => "No API key, or one not known or revoked (sproutd --tenants): send Authorization: Bearer KEY",
            Self::Forbidden => "The tenant's key may not do this (/metrics needs an operator tenant's)",
            Self::QuotaExhausted => "Every sandbox slot of the tenant is held: pause, sleep, hibernate or delete a sandbox first",
            Self::ProcessNotFound => "No background process of the sandbox has this id",
            Self::FileNotFound => "No such file or directory in the sandbox",
            Self::VmNotFound => "No sandbox has this id (also for an id that is not a UUID)",
            Self::MethodNotAllowed => "The route exists, the method does not (`Allow` says which do)",
            Self::InvalidState => "Impossible in the sandbox's current state (`state` says which)",
            Self::Paused => "The sandbox is paused by an operator: resume it first (exec, file and process calls never wake it)",
            Self::SnapshotNotFound => "No snapshot has this id",
            Self::CheckpointNotFound => "No checkpoint has this id",
            Self::PortNotOpen => "The sandbox has not opened this port: POST /v1/runtime/vms/{id}/ports first",
            Self::PortNotListening => "Nothing in the sandbox accepts connections on the port (yet)",
            Self::TooManyPorts => "The sandbox has 32 open ports: close one first",
            Self::TooManyCheckpoints => "The sandbox has 10 checkpoints: delete one first",
            Self::SnapshotFailed => "A snapshot could not be written, or a VM restored from one (the message says why)",
            Self::StoreFailed => "The object store failed or refused what an archive or unarchive needed (the message says why)",
            Self::TemplateBuilding => "The create's (image, shape) template is being built (a first create boots it once): retry after `Retry-After` seconds",
            Self::StdinClosed => "The background process's stdin is closed (or was never open)",
            Self::FileConflict => "A path of the wrong kind, one that exists, or a directory not empty",
            Self::PermissionDenied => "The agent may not touch that file",
            Self::PayloadTooLarge => "The body is over 1 MiB",
            Self::UnsupportedMediaType => "A body that is not application/json",
            Self::Busy => "The sandbox's agent runs too many execs at once: retry after `Retry-After` seconds",
            Self::TooManyRequests => "sproutd's exec limit (per sandbox or for the service) is reached: retry after `Retry-After` seconds",
            Self::Internal => "A bug or a registry failure",
            Self::BootFailed => "The sandbox's worker or guest did not come up (the message quotes the console's end)",
            Self::AgentUnavailable => "The sandbox's agent could not be reached",
            Self::WorkerFailed => "The sandbox's worker failed a request (a stop)",
            Self::HostUnsupported => "This host cannot run Linux guests, or the kernel, image or disk template is missing",
            Self::ImagePulling => "The create's OCI image is being pulled and converted (the message says how far): retry after `Retry-After` seconds",
            Self::BadImageReference => "`image` is not a valid OCI reference (the message says why)",
            Self::ImageNotFound => "The registry or local layout has no such image or tag",
            Self::ImagePlatform => "The image is not for linux/amd64",
            Self::ImageUnsupported => "The image uses what Sprout cannot run (a layer type, a user not in its /etc/passwd, a runtime it has no init for)",
            Self::ImageTooLarge => "The image is over the conversion's limits",
            Self::RegistryUnreachable => "The registry could not be reached",
            Self::RegistryAuth => "The registry refused sproutd's credentials",
            Self::RegistryError => "The registry answered with an error",
            Self::ImageCorrupt => "A blob does not match its digest or size, or a layer is not a valid archive",
            Self::ImageBuildFailed => "The base image could not be built on this host (the message says why)",
        }
    }

    /// The code an error answer of `status` gets when nothing more precise
    /// made it (axum's own rejections, layers' answers).
    pub fn for_status(status: StatusCode) -> Self {
        match status {
            StatusCode::NOT_FOUND => Self::NotFound,
            StatusCode::UNAUTHORIZED => Self::Unauthorized,
            StatusCode::METHOD_NOT_ALLOWED => Self::MethodNotAllowed,
            StatusCode::PAYLOAD_TOO_LARGE => Self::PayloadTooLarge,
            StatusCode::UNSUPPORTED_MEDIA_TYPE => Self::UnsupportedMediaType,
            StatusCode::TOO_MANY_REQUESTS => Self::TooManyRequests,
            s if s.is_client_error() => Self::BadRequest,
            _ => Self::Internal,
        }
    }
}

/// An error answer.
#[derive(Debug)]
pub struct ApiError {
    pub code: Code,
    pub message: String,
    pub field: Option<&'static str>,
    /// Seconds for the `Retry-After` header (a 429 always has one).
    pub retry_after: Option<u64>,
    /// The sandbox's state, when that is why (a 409).
    pub state: Option<&'static str>,
}

/// `Retry-After` of a 429 that names no better time.
pub const DEFAULT_RETRY_AFTER_SECS: u64 = 1;

impl ApiError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            field: None,
            retry_after: None,
            state: None,
        }
    }

    /// `code` because the sandbox is in `state`.
    pub fn in_state(code: Code, state: &'static str, message: impl Into<String>) -> Self {
        Self {
            state: Some(state),
            ..Self::new(code, message)
        }
    }

    /// A bad value of `field`.
    pub fn field(field: &'static str, message: impl Into<String>) -> Self {
        Self {
            field: Some(field),
            ..Self::new(Code::InvalidValue, message)
        }
    }

    /// The same error, blaming `field`.
    pub fn with_field(mut self, field: &'static str) -> Self {
        self.field = Some(field);
        self
    }

    /// The same error, asking the client to retry after `secs` seconds.
    pub fn retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs);
        self
    }

    pub fn vm_not_found(id: &str) -> Self {
        Self::new(Code::VmNotFound, format!("No sandbox has the id {id:?}"))
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.code, self.message)
    }
}

/// Every error answer's body.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = ErrorEnvelope)]
pub struct Envelope<'a> {
    #[schema(inline)]
    error: Body<'a>,
}

#[derive(Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct Body<'a> {
    code: Code,
    /// For people: clients branch on `code`, never on this.
    message: &'a str,
    /// The request field to blame, when one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    field: Option<&'a str>,
    /// The sandbox's current state, when the request is impossible in it.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, value_type = Option<super::registry::State>)]
    state: Option<&'a str>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self.code {
            Code::Internal => tracing::error!(code = ?self.code, "{}", self.message),
            c if c.status().is_server_error() => {
                tracing::warn!(code = ?self.code, "{}", self.message)
            }
            _ => {}
        }
        let body = Envelope {
            error: Body {
                code: self.code,
                message: &self.message,
                field: self.field,
                state: self.state,
            },
        };
        let mut resp = (self.code.status(), axum::Json(body)).into_response();
        let retry = self.retry_after.or_else(|| {
            (self.code.status() == StatusCode::TOO_MANY_REQUESTS)
                .then_some(DEFAULT_RETRY_AFTER_SECS)
        });
        if let Some(secs) = retry {
            resp.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        resp
    }
}

/// `e` and its causes on one line.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_an_error_status_and_a_snake_case_name() {
        let codes = Code::ALL;
        for c in codes {
            assert!(c.status().as_u16() >= 400, "{c:?}");
            let name = serde_json::to_value(c).unwrap();
            let name = name.as_str().unwrap();
            assert!(
                name.chars().all(|ch| ch.is_ascii_lowercase() || ch == '_'),
                "{name}"
            );
        }
        assert_eq!(
            serde_json::to_value(Code::VmNotFound).unwrap(),
            "vm_not_found"
        );
        assert_eq!(Code::for_status(StatusCode::NOT_FOUND), Code::NotFound);
        assert_eq!(Code::for_status(StatusCode::IM_A_TEAPOT), Code::BadRequest);
        assert_eq!(Code::for_status(StatusCode::BAD_GATEWAY), Code::Internal);
        let names: std::collections::BTreeSet<String> = codes.iter().map(|c| c.name()).collect();
        assert_eq!(names.len(), codes.len(), "no code twice");
        assert_eq!(Code::TooManyRequests.name(), "too_many_requests");
    }

    #[test]
    fn every_429_has_a_retry_after() {
        let r = ApiError::new(Code::Busy, "busy").into_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()["retry-after"], "1");
        let r = ApiError::new(Code::TooManyRequests, "full")
            .retry_after(7)
            .into_response();
        assert_eq!(r.headers()["retry-after"], "7");
        let r = ApiError::new(Code::VmNotFound, "no").into_response();
        assert!(!r.headers().contains_key("retry-after"));
    }
}
