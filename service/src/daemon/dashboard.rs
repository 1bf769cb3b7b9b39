//! The web dashboard (docs/dashboard.md): one page of plain HTML, CSS and
//! JavaScript, embedded in the binary, served at `/dashboard`.
//!
//! Everything it shows it reads from the public API with the caller's own
//! key (the page asks for one when the API answers 401, and keeps it in the
//! tab's `sessionStorage`), so these routes serve only static files and are
//! public ([`super::tenants::public`]): they hold no data. The page is one
//! document for every view (`/dashboard`, `/dashboard/vms/{id}`); its
//! script picks the view from the path. Every answer carries a strict
//! Content-Security-Policy (scripts and styles from this origin only, no
//! inline script, no framing), `X-Content-Type-Options: nosniff`, and an
//! `ETag` with `Cache-Control: no-cache`: a browser keeps the files but
//! asks each time whether they changed (a `304` when not), so a new
//! sproutd's page is never mixed with an old script.

use std::sync::OnceLock;

use axum::extract::Path;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use sha2::{Digest, Sha256};

use super::error::{ApiError, Code};

/// The path the dashboard is served under.
pub const BASE: &str = "/dashboard";

const INDEX: &str = include_str!("dashboard/index.html");
const SCRIPT: &str = include_str!("dashboard/app.js");
const STYLE: &str = include_str!("dashboard/style.css");
const ICON: &str = include_str!("dashboard/icon.svg");

/// The policy of every dashboard answer: nothing but this origin's own
/// script, style and API; no inline script or style, no plugins, no
/// framing, no forms posted anywhere. `blob:` images and downloads are the
/// page's own (file downloads are fetched with the key, then saved).
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self' blob: data:; connect-src 'self'; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

/// One embedded file.
struct Asset {
    body: &'static str,
    content_type: &'static str,
    etag: HeaderValue,
}

fn asset(body: &'static str, content_type: &'static str) -> Asset {
    let hash = Sha256::digest(body.as_bytes());
    let hex: String = hash[..12].iter().map(|b| format!("{b:02x}")).collect();
    Asset {
        body,
        content_type,
        etag: HeaderValue::from_str(&format!("\"{hex}\"")).expect("hex is a header value"),
    }
}

fn assets() -> &'static [Asset; 4] {
    static ALL: OnceLock<[Asset; 4]> = OnceLock::new();
    ALL.get_or_init(|| {
        [
            asset(INDEX, "text/html; charset=utf-8"),
            asset(SCRIPT, "text/javascript; charset=utf-8"),
            asset(STYLE, "text/css; charset=utf-8"),
            asset(ICON, "image/svg+xml"),
        ]
    })
}

/// The dashboard's routes: the page (for each of its views), its script,
/// its style and its icon; any other path under it is `404 not_found`.
pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(BASE, get(index))
        .route("/dashboard/", get(index))
        .route("/dashboard/vms/{id}", get(vm_page))
        .route(
            "/dashboard/app.js",
            get(|h: HeaderMap| async move { serve(&assets()[1], &h) }),
        )
        .route(
            "/dashboard/style.css",
            get(|h: HeaderMap| async move { serve(&assets()[2], &h) }),
        )
        .route(
            "/dashboard/icon.svg",
            get(|h: HeaderMap| async move { serve(&assets()[3], &h) }),
        )
        .route("/dashboard/{*rest}", get(missing))
}

async fn index(h: HeaderMap) -> Response {
    serve(&assets()[0], &h)
}

/// A sandbox's page: the same document (the script reads the id from the
/// path, and the API says whether it names a sandbox).
async fn vm_page(Path(_id): Path<String>, h: HeaderMap) -> Response {
    serve(&assets()[0], &h)
}

async fn missing(Path(rest): Path<String>) -> Response {
    let mut r = ApiError::new(
        Code::NotFound,
        format!("The dashboard has no page or file /dashboard/{rest}"),
    )
    .into_response();
    secure(r.headers_mut());
    r
}

/// The headers every dashboard answer carries.
fn secure(h: &mut HeaderMap) {
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
}

/// `a`, or `304 Not Modified` when the request's `If-None-Match` names its
/// tag.
fn serve(a: &Asset, req: &HeaderMap) -> Response {
    let fresh = req
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().trim_start_matches("W/"))
        .any(|t| t == "*" || t.as_bytes() == a.etag.as_bytes());
    let mut r = if fresh {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static(a.content_type),
            )],
            a.body,
        )
            .into_response()
    };
    let h = r.headers_mut();
    h.insert(header::ETAG, a.etag.clone());
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    secure(h);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The page loads its script and style from the paths served here, and
    /// has no inline script or style the policy would refuse.
    #[test]
    fn the_page_names_only_served_files_and_has_no_inline_code() {
        for p in [
            "/dashboard/app.js",
            "/dashboard/style.css",
            "/dashboard/icon.svg",
        ] {
            assert!(INDEX.contains(&format!("\"{p}\"")), "{p}");
        }
        assert!(!INDEX.contains("<script>"), "inline script");
        assert!(!INDEX.contains("style="), "inline style");
        assert!(!INDEX.contains("<style"), "inline style");
        // No handler attributes (onclick=...): every " on" is text.
        for (i, _) in INDEX.match_indices(" on") {
            let word: String = INDEX[i + 1..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '=')
                .collect();
            assert!(!word.ends_with('='), "inline handler {word}");
        }
        // Data from the API is set as text, never parsed as HTML.
        for bad in [
            "innerHTML",
            "outerHTML",
            "insertAdjacentHTML",
            "document.write",
            "eval(",
        ] {
            assert!(!SCRIPT.contains(bad), "app.js uses {bad}");
        }
    }

    #[test]
    fn a_matching_if_none_match_is_not_modified() {
        let a = &assets()[1];
        let mut h = HeaderMap::new();
        assert_eq!(serve(a, &h).status(), StatusCode::OK);
        h.insert(header::IF_NONE_MATCH, a.etag.clone());
        let r = serve(a, &h);
        assert_eq!(r.status(), StatusCode::NOT_MODIFIED);
        assert_eq!(r.headers()[header::ETAG], a.etag);
        h.insert(header::IF_NONE_MATCH, HeaderValue::from_static("\"other\""));
        assert_eq!(serve(a, &h).status(), StatusCode::OK);
    }
}
