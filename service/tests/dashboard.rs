//! The web dashboard (docs/dashboard.md) served by a real `sproutd` on this
//! host, with sandboxes of Sprout's test guest: its files over HTTP (types,
//! the Content-Security-Policy, caching, 404s), the page in headless
//! Chromium (tests/dashboard/check.py: the list, a sandbox's page, Pause,
//! Resume, Fork 2, a screenshot), and with `--tenants` a page that loads
//! without a key while every call it makes needs one.
//!
//! The browser and Selenium come from tests/dashboard/install.sh (`./test`
//! runs it and exports `SPROUT_DASHBOARD_PY`, the venv's python; without
//! it, this test runs the script itself). `SPROUT_UPDATE_SCREENSHOT=1`
//! writes the screenshot to docs/dashboard.png.

mod common;
use common::*;

use std::path::{Path, PathBuf};
use std::process::Command;

use reqwest::{Client, StatusCode};
use serde_json::{json, Value};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/dashboard");

/// The python that has Selenium (tests/dashboard/install.sh's).
fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("SPROUT_DASHBOARD_PY") {
        return p.into();
    }
    let out = Command::new(format!("{SCRIPT}/install.sh"))
        .output()
        .expect("run tests/dashboard/install.sh");
    assert!(
        out.status.success(),
        "tests/dashboard/install.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// Runs check.py against `d` with `args`; panics with its output unless it
/// passes.
fn check_py(d: &Daemon, shot: &Path, args: &[&str]) {
    let out = Command::new(python())
        .arg(format!("{SCRIPT}/check.py"))
        .arg(&d.base)
        .arg(shot)
        .args(args)
        .output()
        .expect("run tests/dashboard/check.py");
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!("{err}");
    assert!(
        out.status.success(),
        "tests/dashboard/check.py {args:?}: {}\n{err}\nsproutd's log:\n{}",
        out.status,
        Daemon::log(&d.data_dir)
    );
}

async fn get_json(c: &Client, d: &Daemon, path: &str) -> Value {
    let r = c.get(d.url(path)).send().await.unwrap();
    let st = r.status();
    let v: Value = r.json().await.unwrap();
    assert!(st.is_success(), "GET {path}: {st} {v}");
    v
}

/// Deletes every sandbox (their workers would outlive the test).
async fn delete_all(c: &Client, d: &Daemon) {
    let all = get_json(c, d, "/v1/runtime/vms").await;
    for v in all["vms"].as_array().unwrap() {
        let id = v["vmId"].as_str().unwrap();
        let r = c
            .delete(d.url(&format!("/v1/runtime/vms/{id}")))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "delete {id}: {}", r.status());
    }
}

fn header<'a>(r: &'a reqwest::Response, name: &str) -> &'a str {
    r.headers()
        .get(name)
        .unwrap_or_else(|| panic!("no {name} on {}: {:?}", r.url(), r.headers()))
        .to_str()
        .unwrap()
}

/// The policy and the headers every dashboard answer carries.
fn assert_secure(r: &reqwest::Response) {
    let csp = header(r, "content-security-policy");
    for part in [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "frame-ancestors 'none'",
    ] {
        assert!(csp.contains(part), "{csp} lacks {part}");
    }
    assert!(
        !csp.contains("unsafe-inline") && !csp.contains("unsafe-eval"),
        "{csp}"
    );
    assert_eq!(header(r, "x-content-type-options"), "nosniff");
    assert_eq!(header(r, "x-frame-options"), "DENY");
}

/// Every page and file of the dashboard: its type, policy and cache
/// headers; an unchanged file is `304`; anything else under /dashboard is
/// `404 not_found`; the page loads only files served here.
#[tokio::test]
async fn the_dashboard_serves_its_files_with_a_strict_policy() {
    let (_t, dir) = data_dir();
    let d = Daemon::start(&dir);
    let c = Client::new();
    let id = "6f1c3e2a-8d4b-4c1e-9a7f-0b2d3e4f5a6b";
    let mut page = None;
    for (path, ct) in [
        ("/dashboard", "text/html; charset=utf-8"),
        ("/dashboard/", "text/html; charset=utf-8"),
        (
            &format!("/dashboard/vms/{id}") as &str,
            "text/html; charset=utf-8",
        ),
        ("/dashboard/app.js", "text/javascript; charset=utf-8"),
        ("/dashboard/style.css", "text/css; charset=utf-8"),
        ("/dashboard/icon.svg", "image/svg+xml"),
    ] {
        let r = c.get(d.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
        assert_eq!(header(&r, "content-type"), ct, "{path}");
        assert_eq!(header(&r, "cache-control"), "no-cache", "{path}");
        assert_secure(&r);
        let etag = header(&r, "etag").to_owned();
        let body = r.text().await.unwrap();
        assert!(!body.is_empty(), "{path}");
        if ct.starts_with("text/html") {
            assert!(body.contains("<title>Sprout</title>"), "{body}");
            assert!(
                page.as_ref().is_none_or(|p| *p == body),
                "one page for every view"
            );
            page = Some(body);
        }
        // Unchanged: not sent again.
        let r = c
            .get(d.url(path))
            .header("if-none-match", &etag)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 304, "{path}");
        assert_eq!(header(&r, "etag"), etag);
        // HEAD is answered as GET, without the body.
        let r = c.head(d.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 200, "HEAD {path}");
        assert_eq!(header(&r, "content-type"), ct, "HEAD {path}");
    }
    let page = page.unwrap();
    for asset in [
        "/dashboard/app.js",
        "/dashboard/style.css",
        "/dashboard/icon.svg",
    ] {
        assert!(page.contains(&format!("\"{asset}\"")), "{asset}");
    }
    assert!(
        !page.contains("<script>") && !page.contains("style="),
        "inline code: {page}"
    );

    for path in [
        "/dashboard/nothing.js",
        "/dashboard/vms",
        "/dashboard/vms/",
        &format!("/dashboard/vms/{id}/files") as &str,
        "/dashboardx",
    ] {
        let r = c.get(d.url(path)).send().await.unwrap();
        let msg = assert_error(r, StatusCode::NOT_FOUND, "not_found").await;
        assert!(!msg.is_empty(), "{path}");
    }
    let r = c.get(d.url("/dashboard/nothing.js")).send().await.unwrap();
    assert_secure(&r);
    // Only GET (and HEAD): the dashboard changes nothing itself.
    let r = c.post(d.url("/dashboard")).send().await.unwrap();
    assert_error(r, StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed").await;
    d.stop();
}

/// The dashboard in headless Chromium against sandboxes of the test guest:
/// the list, a sandbox's page, Pause, Resume and Fork 2 (checked through the
/// API and on the page), and a screenshot of the sandbox's page.
#[tokio::test]
async fn the_dashboard_in_chromium_pauses_resumes_and_forks_a_sandbox() {
    let py = python();
    assert!(py.exists(), "{}", py.display());
    let (t, dir) = data_dir();
    let d = Daemon::start(&dir);
    let c = Client::new();
    // Markup in metadata must stay text on the page (check.py looks).
    let vm = schedule(
        &c,
        &d,
        json!({"image": "testguest", "cpus": 1, "memoryMb": 128,
               "metadata": {"team": "dashboard", "note": "<img src=x onerror=alert(1)>"}}),
    )
    .await;
    let id = vm["vmId"].as_str().unwrap().to_owned();
    let (other, _) = schedule_testguest(&c, &d).await;

    let shot = t.path().join("dashboard.png");
    check_py(&d, &shot, &["--vm", &id]);

    // The API agrees with what the page was seen to do.
    let v = get_json(&c, &d, &format!("/v1/runtime/vms/{id}")).await;
    assert_eq!(v["state"], "running", "{v}");
    let all = get_json(&c, &d, "/v1/runtime/vms").await;
    let kids: Vec<&Value> = all["vms"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["parentVmId"] == id.as_str())
        .collect();
    assert_eq!(kids.len(), 2, "{all}");
    assert!(kids.iter().all(|k| k["state"] == "running"), "{all}");
    let o = get_json(&c, &d, &format!("/v1/runtime/vms/{other}")).await;
    assert_eq!(
        o["state"], "running",
        "the other sandbox was not touched: {o}"
    );

    let png = std::fs::read(&shot).unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(png.len() > 10_000, "{} bytes", png.len());
    if std::env::var_os("SPROUT_UPDATE_SCREENSHOT").is_some_and(|v| v == "1") {
        let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/dashboard.png");
        std::fs::write(&docs, &png).unwrap();
        eprintln!("wrote {}", docs.display());
    }
    delete_all(&c, &d).await;
    d.stop();
}

/// With `--tenants`, the page and its files load without a key (they hold
/// no data), every API call the page makes needs one (401 without, with
/// `WWW-Authenticate`), and in Chromium the page asks for the key, shows
/// nothing before it, and then the tenant's sandboxes.
#[tokio::test]
async fn with_tenants_the_page_loads_without_a_key_and_its_data_needs_one() {
    let (t, dir) = data_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let (k, l) = new_key();
    let file = dir.with_extension("tenants.toml");
    std::fs::write(&file, format!("[[tenant]]\nname = \"web\"\nkeys = [{l}]\n")).unwrap();
    let d = Daemon::start_with(&dir, &["--tenants", file.to_str().unwrap()]);
    let c = keyed(&k);
    let (id, _) = schedule_testguest(&c, &d).await;

    let anon = Client::new();
    for path in [
        "/dashboard".to_owned(),
        "/dashboard/".to_owned(),
        format!("/dashboard/vms/{id}"),
        "/dashboard/app.js".to_owned(),
        "/dashboard/style.css".to_owned(),
    ] {
        let r = anon.get(d.url(&path)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
        assert_secure(&r);
    }
    let r = anon.get(d.url("/dashboard/nothing")).send().await.unwrap();
    assert_error(r, StatusCode::NOT_FOUND, "not_found").await;
    // What the page reads and does.
    let vm = format!("/v1/runtime/vms/{id}");
    for (method, path) in [
        ("GET", "/v1/info".to_owned()),
        ("GET", "/v1/runtime/vms".to_owned()),
        ("GET", "/v1/runtime/snapshots".to_owned()),
        ("GET", vm.clone()),
        ("GET", format!("{vm}/processes")),
        ("GET", format!("{vm}/files?path=.")),
        ("GET", format!("{vm}/files/raw?path=a.txt")),
        ("POST", format!("{vm}/pause")),
        ("POST", format!("{vm}/resume")),
        ("POST", format!("{vm}/fork")),
        ("POST", format!("{vm}/snapshot")),
        ("DELETE", vm.clone()),
    ] {
        let r = anon
            .request(method.parse().unwrap(), d.url(&path))
            .send()
            .await
            .unwrap();
        assert_eq!(
            header(&r, "www-authenticate"),
            "Bearer realm=\"sproutd\"",
            "{method} {path}"
        );
        assert_error(r, StatusCode::UNAUTHORIZED, "unauthorized").await;
    }
    // Nothing was done without the key.
    let v = get_json(&c, &d, &vm).await;
    assert_eq!(v["state"], "running", "{v}");
    let list = get_json(&c, &d, "/v1/runtime/vms").await;
    assert_eq!(list["vms"].as_array().unwrap().len(), 1, "{list}");

    // In the browser: the key form, then the sandbox.
    check_py(
        &d,
        &t.path().join("tenants.png"),
        &["--api-key", &k, "--vm", &id, "--list-only"],
    );
    delete_all(&c, &d).await;
    d.stop();
}
