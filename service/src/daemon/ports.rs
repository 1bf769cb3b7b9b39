//! Ports: a sandbox's TCP port served by sproutd over HTTP, whatever the
//! sandbox's network.
//!
//! `POST /vms/{id}/ports {port, public}` opens one and answers its URL,
//! `http://{port}-{vm id}.{host}/`, where `{host}` is the host the caller
//! reached sproutd by (an IP address or `localhost` becomes `localhost`,
//! whose subdomains browsers and curl resolve to loopback; a name is kept,
//! for a wildcard DNS record to point at sproutd). `GET` lists them and
//! `DELETE /vms/{id}/ports/{port}` closes one.
//!
//! A request whose `Host` names an open port is not the API's: it is
//! passed, as it came, over a fresh agent connection to that port on the
//! guest's loopback ([`guest_agent::client::Client::open_port`]), and the
//! guest's answer comes back as it is (HTTP/1.1; WebSocket and other
//! upgrades are carried both ways once the guest answers `101`). Such a
//! request wakes a sleeping sandbox and keeps it busy while it streams,
//! like an exec. A port that is not `public` needs the key of the tenant
//! that owns the sandbox (as the API does; `X-API-Key` first, then
//! `Authorization: Bearer`), and that header is not passed on to the guest.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use guest_agent::client::ClientError;
use guest_agent::protocol::ErrorCode as AgentCode;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use super::error::{ApiError, Code};
use super::lifecycle::{Busy, Live};
use super::openapi::errors;
use super::registry::PortRow;
use super::routes::ApiJson;
use super::tenants::Caller;
use super::{now_ms, App};

/// Most ports one sandbox may have open.
pub const MAX_PORTS: usize = 32;

/// Headers that belong to one hop (RFC 9110, 7.6.1), never passed on;
/// `Connection` and `Upgrade` are kept for an upgrade.
const HOP_BY_HOP: [&str; 7] = [
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
];

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(as = PortRequest)]
pub struct PortReq {
    /// The guest's TCP port, 1-65535, on its loopback (a server bound to
    /// 0.0.0.0, 127.0.0.1 or ::1 is reached).
    port: u32,
    /// Reachable without an API key (default false: the tenant's key is
    /// needed, as for the API).
    #[serde(default)]
    public: bool,
}

/// An open port.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = Port)]
pub struct PortView {
    port: u16,
    public: bool,
    /// Where sproutd serves it: `http://{port}-{vmId}.{host}/`.
    url: String,
    #[schema(format = DateTime)]
    created_at: String,
}

#[derive(Debug, Serialize, ToSchema)]
#[schema(as = PortList)]
pub struct PortList {
    /// By port number.
    ports: Vec<PortView>,
}

fn view(p: PortRow, host: &str) -> PortView {
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(p.created_ms);
    PortView {
        port: p.port,
        public: p.public,
        url: url_for(host, p.port, p.vm_id),
        created_at: humantime::format_rfc3339_millis(at).to_string(),
    }
}

/// The host the caller reached sproutd by (its `Host` header).
fn request_host(h: &HeaderMap) -> &str {
    h.get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("localhost")
}

/// `http://{port}-{vm}.{domain}{:port}/` for a caller that reached sproutd
/// at `host`.
pub fn url_for(host: &str, port: u16, vm: Uuid) -> String {
    let (name, at) = split_host(host);
    let loopbackish = name.eq_ignore_ascii_case("localhost")
        || name.parse::<std::net::IpAddr>().is_ok()
        || name.starts_with('[');
    let domain = if loopbackish { "localhost" } else { name };
    format!("http://{port}-{vm}.{domain}{at}/")
}

/// `host` as (name, `:port` or "").
fn split_host(host: &str) -> (&str, &str) {
    if host.starts_with('[') {
        return match host.find(']') {
            Some(i) => (&host[..=i], &host[i + 1..]),
            None => (host, ""),
        };
    }
    match host.rfind(':') {
        Some(i) if host[i + 1..].bytes().all(|b| b.is_ascii_digit()) => (&host[..i], &host[i..]),
        _ => (host, ""),
    }
}

/// The (port, sandbox) a `Host` of the form `{port}-{uuid}.…` names.
pub fn target(host: &str) -> Option<(u16, Uuid)> {
    let (name, _) = split_host(host);
    let (label, _) = name.split_once('.')?;
    let (port, vm) = label.split_once('-')?;
    if port.is_empty() || port.len() > 5 || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let port: u16 = port.parse().ok().filter(|p| *p != 0)?;
    let vm = Uuid::try_parse(vm).ok()?;
    Some((port, vm))
}

fn not_open(vm: Uuid, port: u16) -> ApiError {
    ApiError::new(
        Code::PortNotOpen,
        format!("Port {port} of sandbox {vm} is not open: POST /v1/runtime/vms/{vm}/ports first"),
    )
}

errors!(
    OpenPortErrors = [
        InvalidJson,
        InvalidBody,
        InvalidValue,
        UnsupportedMediaType,
        PayloadTooLarge,
        VmNotFound,
        TooManyPorts,
    ]
);

/// Open a port
///
/// Serves the guest's TCP `port` at the answer's `url` (see docs/api.md,
/// "Ports"). Opening an open port again answers it (with `public` as
/// given). Nothing need listen yet: a request to the URL before something
/// does is `502 port_not_listening`. At most 32 per sandbox.
#[utoipa::path(post, path = "/v1/runtime/vms/{id}/ports", operation_id = "openPort", tag = "ports",
    params(("id" = String, Path, description = "The sandbox's id")),
    request_body = PortReq,
    responses((status = 201, description = "Open", body = PortView), OpenPortErrors))]
pub async fn open(
    State(app): State<Arc<App>>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<PortReq>,
) -> Result<(StatusCode, Json<PortView>), ApiError> {
    let port = u16::try_from(req.port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| {
            ApiError::field(
                "port",
                format!("port {} is not a TCP port: 1 to 65535", req.port),
            )
        })?;
    // Any sandbox may open one (a request to it needs the sandbox to
    // run an agent: the test guest's answer `400 not_supported`).
    let s = app.sandbox(&caller, &id).await?;
    let row = PortRow {
        vm_id: s.id,
        port,
        public: req.public,
        created_ms: now_ms(),
    };
    let vm = s.id;
    let row = app
        .db(move |r| r.put_port(&row, MAX_PORTS))
        .await?
        .ok_or_else(|| {
            ApiError::new(
                Code::TooManyPorts,
                format!("Sandbox {vm} has {MAX_PORTS} open ports: close one first"),
            )
        })?;
    tracing::info!(vm = %vm, port, public = req.public, "port open");
    Ok((StatusCode::CREATED, Json(view(row, request_host(&headers)))))
}

errors!(ListPortErrors = [VmNotFound]);

/// List a sandbox's open ports
#[utoipa::path(get, path = "/v1/runtime/vms/{id}/ports", operation_id = "listPorts", tag = "ports",
    params(("id" = String, Path, description = "The sandbox's id")),
    responses((status = 200, description = "Its open ports", body = PortList), ListPortErrors))]
pub async fn list(
    State(app): State<Arc<App>>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Json<PortList>, ApiError> {
    let vm = app.sandbox(&caller, &id).await?.id;
    let rows = app.db(move |r| r.list_ports(vm)).await?;
    let host = request_host(&headers);
    Ok(Json(PortList {
        ports: rows.into_iter().map(|p| view(p, host)).collect(),
    }))
}

errors!(ClosePortErrors = [VmNotFound, PortNotOpen]);

/// Close a port
///
/// Its URL answers `404 port_not_open` from now on; requests already
/// streaming run to their end.
#[utoipa::path(delete, path = "/v1/runtime/vms/{id}/ports/{port}", operation_id = "closePort", tag = "ports",
    params(("id" = String, Path, description = "The sandbox's id"),
        ("port" = u16, Path, description = "The port")),
    responses((status = 204, description = "Closed"), ClosePortErrors))]
pub async fn close(
    State(app): State<Arc<App>>,
    caller: Caller,
    Path((id, port)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let vm = app.sandbox(&caller, &id).await?.id;
    let port: u16 = port.parse().map_err(|_| not_open(vm, 0))?;
    if !app.db(move |r| r.delete_port(vm, port)).await? {
        return Err(not_open(vm, port));
    }
    tracing::info!(vm = %vm, port, "port closed");
    Ok(StatusCode::NO_CONTENT)
}

/// The middleware that serves requests to a port's host (before the API's
/// routes, its authentication and its error envelope: the guest's answers
/// are passed on untouched).
pub async fn proxy(
    State(app): State<Arc<App>>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| req.uri().authority().map(|a| a.as_str()));
    let Some((port, vm)) = host.and_then(target) else {
        return next.run(req).await;
    };
    match forward(app, req, port, vm).await {
        Ok(r) => r,
        Err(e) => {
            let unauthorized = e.code == Code::Unauthorized;
            let mut r = e.into_response();
            if unauthorized {
                r.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"sproutd\""),
                );
            }
            r
        }
    }
}

/// The key a request to a private port carries, taken out of its headers.
fn take_key(h: &mut HeaderMap) -> Option<String> {
    if let Some(v) = h.remove("x-api-key") {
        return v.to_str().ok().map(|s| s.trim().to_owned());
    }
    let bearer = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, k)| k.trim().to_owned());
    if bearer.is_some() {
        h.remove(header::AUTHORIZATION);
    }
    bearer
}

async fn forward(
    app: Arc<App>,
    mut req: Request,
    port: u16,
    vm: Uuid,
) -> Result<Response, ApiError> {
    let row = app
        .db(move |r| r.get_port(vm, port))
        .await?
        .ok_or_else(|| not_open(vm, port))?;
    let caller = if row.public {
        let s = app
            .db(move |r| r.get_sandbox(vm))
            .await?
            .ok_or_else(|| not_open(vm, port))?;
        Caller(app.tenants.policy(&s.tenant))
    } else if app.tenants.multi() {
        let key = take_key(req.headers_mut());
        app.tenants.caller(key.as_deref())?.0
    } else {
        app.tenants.caller(None)?.0
    };
    // Another tenant's sandbox is answered as a closed port.
    let Live { agent, busy, .. } = app
        .live(&caller, &vm.to_string())
        .await
        .map_err(|e| match e.code {
            Code::VmNotFound => not_open(vm, port),
            _ => e,
        })?;
    let stream = agent
        .open_port(port)
        .await
        .map_err(|e| port_error(vm, port, e))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| gateway(vm, port, &e))?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(vm = %vm, port, "port connection: {e}");
        }
    });

    let upgrade = wants_upgrade(req.headers());
    let from_client = upgrade.then(|| hyper::upgrade::on(&mut req));
    strip_hop_by_hop(req.headers_mut(), upgrade);
    let pq = req
        .uri()
        .path_and_query()
        .map_or("/", |pq| pq.as_str())
        .to_owned();
    *req.uri_mut() = Uri::try_from(pq).unwrap_or_else(|_| Uri::from_static("/"));
    let mut resp = sender
        .send_request(req)
        .await
        .map_err(|e| gateway(vm, port, &e))?;

    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(from_client) = from_client {
            let from_guest = hyper::upgrade::on(&mut resp);
            tokio::spawn(async move {
                let _busy = busy;
                match tokio::try_join!(from_client, from_guest) {
                    Ok((c, g)) => {
                        let (mut c, mut g) = (TokioIo::new(c), TokioIo::new(g));
                        let r = tokio::io::copy_bidirectional(&mut c, &mut g).await;
                        tracing::debug!(vm = %vm, port, "upgraded connection ended: {r:?}");
                    }
                    Err(e) => tracing::debug!(vm = %vm, port, "upgrade failed: {e}"),
                }
            });
            return Ok(resp.map(|_| Body::empty()));
        }
    }
    strip_hop_by_hop(resp.headers_mut(), false);
    Ok(resp.map(|b| {
        Body::new(HeldBody {
            inner: b,
            _busy: busy,
        })
    }))
}

fn wants_upgrade(h: &HeaderMap) -> bool {
    h.contains_key(header::UPGRADE)
        && h.get_all(header::CONNECTION).iter().any(|v| {
            v.to_str().is_ok_and(|v| {
                v.split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
            })
        })
}

/// Removes hop-by-hop headers, and those `Connection` names (all but
/// `Connection: upgrade` and `Upgrade` when `upgrade`).
fn strip_hop_by_hop(h: &mut HeaderMap, upgrade: bool) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::try_from(t.trim()).ok())
        .filter(|n| !(upgrade && n == header::UPGRADE))
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in HOP_BY_HOP {
        h.remove(n);
    }
    if !upgrade {
        h.remove(header::CONNECTION);
        h.remove(header::UPGRADE);
    }
}

fn port_error(vm: Uuid, port: u16, e: ClientError) -> ApiError {
    match e.code() {
        Some(AgentCode::Refused) => ApiError::new(
            Code::PortNotListening,
            format!("Nothing in sandbox {vm} accepts connections on port {port} (yet)"),
        ),
        Some(AgentCode::UnknownKind) => ApiError::new(
            Code::NotSupported,
            format!(
                "The agent in sandbox {vm} predates ports: create the sandbox again from a \
                 current image"
            ),
        ),
        _ => ApiError::new(
            Code::AgentUnavailable,
            format!(
                "Cannot reach port {port} of sandbox {vm}: {}",
                super::error::chain(&e)
            ),
        ),
    }
}

fn gateway(vm: Uuid, port: u16, e: &hyper::Error) -> ApiError {
    ApiError::new(
        Code::PortNotListening,
        format!("Port {port} of sandbox {vm} did not answer over HTTP: {e}"),
    )
}

/// A guest's answer body that keeps its sandbox busy while it streams.
struct HeldBody {
    inner: hyper::body::Incoming,
    _busy: Busy,
}

impl http_body::Body for HeldBody {
    type Data = axum::body::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_the_port_and_the_sandbox_under_the_callers_host() {
        let vm = Uuid::parse_str("0b0e6a3c-9a39-4b5e-8d0e-7ad0a8e7c111").unwrap();
        let want = format!("http://8000-{vm}.localhost:7070/");
        for host in [
            "127.0.0.1:7070",
            "localhost:7070",
            "[::1]:7070",
            "LOCALHOST:7070",
        ] {
            assert_eq!(url_for(host, 8000, vm), want, "{host}");
        }
        assert_eq!(
            url_for("sprout.example.com", 80, vm),
            format!("http://80-{vm}.sprout.example.com/")
        );
        for host in [
            want.trim_start_matches("http://").trim_end_matches('/'),
            &format!("8000-{vm}.sprout.example.com"),
        ] {
            assert_eq!(target(host), Some((8000, vm)), "{host}");
        }
    }

    #[test]
    fn other_hosts_are_the_apis() {
        let vm = "0b0e6a3c-9a39-4b5e-8d0e-7ad0a8e7c111";
        for host in [
            "127.0.0.1:7070".to_owned(),
            "localhost".to_owned(),
            format!("0-{vm}.localhost"),
            format!("65536-{vm}.localhost"),
            format!("+80-{vm}.localhost"),
            format!("80-{vm}"),
            format!("80-{vm}x.localhost"),
            format!("80_{vm}.localhost"),
            "[::1]:7070".to_owned(),
            String::new(),
        ] {
            assert_eq!(target(&host), None, "{host}");
        }
    }

    #[test]
    fn hop_by_hop_headers_go_and_an_upgrade_keeps_its_own() {
        let mut h = HeaderMap::new();
        h.insert(
            "connection",
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("upgrade", HeaderValue::from_static("websocket"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        let mut up = h.clone();
        strip_hop_by_hop(&mut h, false);
        assert_eq!(h.keys().map(|k| k.as_str()).collect::<Vec<_>>(), ["x-kept"]);
        up.insert("connection", HeaderValue::from_static("Upgrade"));
        assert!(wants_upgrade(&up));
        strip_hop_by_hop(&mut up, true);
        assert!(up.contains_key("upgrade") && up.contains_key("connection"));
    }

    #[test]
    fn the_key_is_taken_from_the_headers_and_the_apps_own_auth_stays() {
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("sk-1"));
        h.insert("authorization", HeaderValue::from_static("Basic dTpw"));
        assert_eq!(take_key(&mut h).as_deref(), Some("sk-1"));
        assert_eq!(h.get("authorization").unwrap(), "Basic dTpw");
        let mut h = HeaderMap::new();
        h.insert("authorization", HeaderValue::from_static("Bearer sk-2"));
        assert_eq!(take_key(&mut h).as_deref(), Some("sk-2"));
        assert!(h.is_empty());
    }
}
