//! sproutd's HTTP API on arbitrary requests, as any client on its port could send
//! them: the real router (`service::daemon::in_process::router`, every layer of the
//! daemon's: request ids, body limits, the error envelope, caught panics) over a fresh
//! data directory with no images and no workers, driven in-process with
//! `tower::ServiceExt::oneshot` on a current-thread tokio runtime.
//!
//! Input: an HTTP/1-like text. Line 1 is the method, line 2 the request target (path
//! and query), then `Name: value` header lines (content-type, accept, Last-Event-ID,
//! X-Request-Id or any other) up to an empty line; the rest is the body. A method,
//! target or header that HTTP cannot carry is dropped (hyper would refuse it before
//! the router), and so are Content-Length and Transfer-Encoding (hyper frames the
//! body itself, so they never disagree with it at the router).
//!
//! Every answer: never a panic (a caught one would be a 500), never a 5xx (nothing
//! here can fail on the server's side: no sandbox can exist) but `503
//! host_unsupported` (what this router, which runs no Linux guests, says to a
//! create from an OCI image: as any host without them does), an `X-Request-Id`
//! (the request's own when it sent one), and every non-2xx body (but a HEAD's,
//! which HTTP sends without one) is exactly the JSON error envelope
//! `{"error": {"code", "message"[, "field"]}}`. Every 256 inputs, `/metrics` is
//! scraped: its request series stay bounded whatever methods and paths were sent.

#![no_main]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use axum::body::Body;
use axum::http::{header, HeaderName, HeaderValue, Method, Request, Uri};
use axum::Router;
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt;

/// Most answers a body may have (the largest is `/metrics`).
const MAX_ANSWER: usize = 16 << 20;
/// Most `sproutd_http_requests_total` series: route templates (about 20, and
/// `unmatched`) x methods (the standard ones, and `other`) x statuses sent.
const MAX_SERIES: usize = 4000;

struct Harness {
    rt: tokio::runtime::Runtime,
    router: Router,
    _dir: tempfile::TempDir,
}

fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let dir = tempfile::tempdir().expect("a data directory");
        let router = rt
            .block_on(async { service::daemon::in_process::router(dir.path()) })
            .expect("the router");
        Harness {
            rt,
            router,
            _dir: dir,
        }
    })
}

/// The request the input describes, and its first X-Request-Id; `None` if HTTP
/// could not carry it.
fn request(data: &[u8]) -> Option<(Request<Body>, Option<HeaderValue>)> {
    let (head, body) = match data.windows(2).position(|w| w == b"\n\n") {
        Some(i) => (&data[..i], &data[i + 2..]),
        None => (data, &[][..]),
    };
    let mut lines = head.split(|&b| b == b'\n');
    let method = Method::from_bytes(lines.next()?).ok()?;
    let uri = Uri::try_from(lines.next().unwrap_or(b"/")).ok()?;
    let mut b = Request::builder().method(method).uri(uri);
    let mut request_id = None;
    for l in lines {
        let Some(colon) = l.iter().position(|&c| c == b':') else {
            continue;
        };
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(&l[..colon]),
            HeaderValue::from_bytes(l[colon + 1..].trim_ascii()),
        ) else {
            continue;
        };
        if name == header::CONTENT_LENGTH || name == header::TRANSFER_ENCODING {
            continue;
        }
        if name == "x-request-id" && request_id.is_none() {
            request_id = Some(value.clone());
        }
        b = b.header(name, value);
    }
    Some((b.body(Body::from(body.to_vec())).ok()?, request_id))
}

/// Whether `body` is the error envelope: one key, `error`, an object with a
/// non-empty string `code` and `message` and at most a string `field`.
fn is_envelope(body: &[u8]) -> bool {
    let Ok(serde_json::Value::Object(top)) = serde_json::from_slice(body) else {
        return false;
    };
    let Some(serde_json::Value::Object(e)) = top.get("error").filter(|_| top.len() == 1) else {
        return false;
    };
    let text = |k: &str| {
        e.get(k)
            .and_then(|v| v.as_str())
            .is_some_and(|s| !s.is_empty())
    };
    text("code")
        && text("message")
        && e.keys()
            .all(|k| ["code", "message", "field"].contains(&k.as_str()))
        && e.get("field").is_none_or(|f| f.is_string())
}

/// The envelope's `error.code`, if the body is one.
fn error_code(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    Some(v.get("error")?.get("code")?.as_str()?.to_owned())
}

/// The number of request series `/metrics` shows now.
fn series(h: &Harness) -> usize {
    let req = Request::get("/metrics").body(Body::empty()).unwrap();
    let resp =
        h.rt.block_on(h.router.clone().oneshot(req))
            .unwrap_or_else(|e| match e {});
    assert_eq!(resp.status(), 200, "/metrics");
    let body =
        h.rt.block_on(axum::body::to_bytes(resp.into_body(), MAX_ANSWER))
            .expect("the metrics");
    String::from_utf8_lossy(&body)
        .lines()
        .filter(|l| l.starts_with("sproutd_http_requests_total{"))
        .count()
}

fuzz_target!(|data: &[u8]| {
    let Some((req, request_id)) = request(data) else {
        return;
    };
    let h = harness();
    let what = format!("{} {}", req.method(), req.uri());
    let head = req.method() == Method::HEAD;
    let resp =
        h.rt.block_on(h.router.clone().oneshot(req))
            .unwrap_or_else(|e| match e {});
    let status = resp.status();
    let id = resp.headers().get("x-request-id").cloned();
    let json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    let body =
        h.rt.block_on(axum::body::to_bytes(resp.into_body(), MAX_ANSWER))
            .unwrap_or_else(|e| panic!("{what}: {status}: the body cannot be read: {e}"));
    let shown = String::from_utf8_lossy(&body[..body.len().min(2048)]).into_owned();
    let no_linux = status == 503 && error_code(&body).as_deref() == Some("host_unsupported");
    assert!(
        !status.is_server_error() || no_linux,
        "{what}: {status}: {shown}"
    );
    let id = id.unwrap_or_else(|| panic!("{what}: {status}: no X-Request-Id"));
    if let Some(want) = request_id {
        assert_eq!(id, want, "{what}: the request's own X-Request-Id");
    }
    if !status.is_success() && !head {
        assert!(json, "{what}: {status}: not JSON: {shown}");
        assert!(
            is_envelope(&body),
            "{what}: {status}: not the envelope: {shown}"
        );
    }
    static RUNS: AtomicU64 = AtomicU64::new(0);
    if RUNS.fetch_add(1, Ordering::Relaxed) % 256 == 255 {
        let n = series(h);
        assert!(n <= MAX_SERIES, "{n} request series in /metrics");
    }
});
