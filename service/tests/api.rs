//! sproutd's REST API on this host, through a real HTTP client against a
//! real `sproutd` process on a free loopback port with a temporary data
//! directory: everything that needs no Linux guest. Sandboxes here run
//! Sprout's test guest (image `testguest`), which runs on any KVM host; the
//! Linux path is tested in the lab (tests/tests/lab_sproutd.rs).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use reqwest::{Client, StatusCode};
use serde_json::{json, Value};

mod common;
use common::*;

#[tokio::test]
async fn health_and_info_answer_and_every_answer_has_a_request_id() {
    let (_t, dir) = data_dir();
    let d = Daemon::start(&dir);
    let c = Client::new();
    let r = c.get(d.url("/v1/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let id = r.headers()["x-request-id"].to_str().unwrap().to_owned();
    assert_eq!(id.len(), 36, "a UUID: {id}");
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"status": "ok"}));
    // Taken from the request when given, on success and on error alike.
    for path in ["/v1/health", "/v1/nothing-here"] {
        let r = c
            .get(d.url(path))
            .header("x-request-id", "trace-me-42")
            .send()
            .await
            .unwrap();
        assert_eq!(r.headers()["x-request-id"], "trace-me-42", "{path}");
    }
    let r = c.get(d.url("/v1/health")).send().await.unwrap();
    assert_ne!(r.headers()["x-request-id"].to_str().unwrap(), id);

    let info: Value = c
        .get(d.url("/v1/info"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["version"], env!("CARGO_PKG_VERSION"));
    let linux = info["hostMode"]["linuxGuests"].as_bool().expect("a bool");
    if !linux {
        let why = info["hostMode"]["reason"].as_str().unwrap();
        assert!(why.contains("cannot run Linux guests"), "{why}");
        // Only the test guest, which has no network device: this host's
        // own network is left as it is, and that is said.
        assert_eq!(info["network"]["egress"], false, "{info}");
        let why = info["network"]["reason"].as_str().unwrap();
        assert!(why.contains("only the test guest"), "{why}");
    }
    assert_eq!(info["network"]["ports"], true, "{info}");
    let images: Vec<&str> = info["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap())
        .collect();
    assert!(images.contains(&"testguest"), "{info}");
    assert!(!images.contains(&"scratch"), "{info}");
    // Sprout's own images have no init of their own: `container` only.
    for i in info["images"].as_array().unwrap() {
        if !i["name"].as_str().unwrap().contains('@') {
            assert_eq!(i["runtimes"], json!(["container"]), "{info}");
        }
    }
    assert_eq!(info["dataDir"], dir.display().to_string());
}

#[tokio::test]
async fn unknown_routes_and_methods_get_the_envelope() {
    let (_t, dir) = data_dir();
    let d = Daemon::start(&dir);
    let c = Client::new();
    for path in ["/", "/v1", "/v1/runtime", "/v1/runtime/vm", "/v2/health"] {
        let r = c.get(d.url(path)).send().await.unwrap();
        assert_error(r, StatusCode::NOT_FOUND, "not_found").await;
    }
    let r = c.put(d.url("/v1/health")).send().await.unwrap();
    let allow = r.headers()["allow"].to_str().unwrap().to_owned();
    assert!(allow.contains("GET"), "{allow}");
    assert_error(r, StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed").await;
    let r = c.get(d.url("/v1/runtime/schedule")).send().await.unwrap();
    assert_error(r, StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed").await;
    let r = c
        .patch(d.url("/v1/runtime/vms/00000000-0000-0000-0000-000000000000"))
        .send()
        .await
        .unwrap();
    assert_error(r, StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed").await;
}

#[tokio::test]
async fn bad_bodies_get_the_envelope_with_a_4xx_never_a_500() {
    let (_t, dir) = data_dir();
    let d = Daemon::start(&dir);
    let c = Client::new();
    let exec = "/v1/runtime/vms/00000000-0000-0000-0000-000000000000/exec";
    for path in ["/v1/runtime/schedule", exec] {
        for body in [
            "{",
            "nope",
            "{,}",
            "\u{feff}{}",
            "{'a':1}",
            "\"unterminated",
        ] {
            let r = raw_post(&c, &d, path, body).await;
            assert_error(r, StatusCode::BAD_REQUEST, "invalid_json").await;
        }
        // Deep nesting is refused by the parser, not by a stack overflow.
        let deep: &'static str =
            Box::leak(format!("{}{}", "[".repeat(10_000), "]".repeat(10_000)).into_boxed_str());
        let r = raw_post(&c, &d, path, deep).await;
        assert_eq!(r.status(), 400);
        let v: Value = r.json().await.unwrap();
        let code = v["error"]["code"].as_str().unwrap();
        assert!(["invalid_json", "invalid_body"].contains(&code), "{v}");
        // Not an object, wrong types, unknown fields.
        for body in [
            "[]",
            "null",
            "42",
            r#"{"cpus":"two"}"#,
            r#"{"cpus":2.5}"#,
            r#"{"image":7}"#,
            r#"{"metadata":{"a":1}}"#,
            r#"{"env":["A=1"]}"#,
            r#"{"disableInternet":"yes"}"#,
            r#"{"cpu":2}"#,
            r#"{"command":"ls","argv":"-l"}"#,
            r#"{"command":"ls","timeoutMs":"soon"}"#,
            r#"{"command":"ls","shell":true}"#,
        ] {
            let r = raw_post(&c, &d, path, body).await;
            let m = assert_error(r, StatusCode::BAD_REQUEST, "invalid_body").await;
            assert!(!m.contains("panicked"), "{m}");
        }
        // Not JSON at all.
        let r = c
            .post(d.url(path))
            .header("content-type", "text/plain")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_error(
            r,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        )
        .await;
        // Over the 1 MiB limit, with and without a length announced.
        // (The announced length alone is refused, before any body: a client
        // still writing one may see its connection closed under it.)
        let (status, body) = announced_post(&d, path, 2 << 20);
        assert_eq!(status, 413, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["code"], "payload_too_large", "{body}");
        let (status, body) = chunked_post(&d, path, 2 << 20);
        assert_eq!(status, 413, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["code"], "payload_too_large", "{body}");
    }
    // Still serving.
    let r = c.get(d.url("/v1/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

/// Sends the head of a POST announcing an `n`-byte JSON body, and no body;
/// the answer's status and body.
fn announced_post(d: &Daemon, path: &str, n: usize) -> (u16, String) {
    use std::io::Write;
    let addr = d.base.strip_prefix("http://").unwrap();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {n}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let (status, _, body) = read_answer(&mut s);
    (status, body)
}

/// Reads a whole HTTP answer off `s`: its status, lower-cased head and body
/// (every answer has a request id).
fn read_answer(s: &mut std::net::TcpStream) -> (u16, String, String) {
    use std::io::Read;
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no answer: {text:?}"));
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let head = head.to_ascii_lowercase();
    assert!(head.contains("x-request-id"), "{head}");
    (status, head, body.to_owned())
}

/// POSTs `n` bytes of JSON whitespace in chunks (no Content-Length) over a
/// plain connection; the answer's status and body.
fn chunked_post(d: &Daemon, path: &str, n: usize) -> (u16, String) {
    use std::io::Write;
    let addr = d.base.strip_prefix("http://").unwrap();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let chunk = vec![b' '; 64 * 1024];
    let mut sent = 0;
    while sent < n {
        // The server may answer (and close) before it has read it all.
        if write!(s, "{:x}\r\n", chunk.len()).is_err()
            || s.write_all(&chunk).is_err()
            || s.write_all(b"\r\n").is_err()
        {
            break;
        }
        sent += chunk.len();
    }
    let _ = s.write_all(b"0\r\n\r\n");
    let (status, head, body) = read_answer(&mut s);
    // The rest of the body is not read: the connection is not reused.
    if status == 413 {
        assert!(head.contains("connection: close"), "{head}");
    }
    (status, body.to_owned())
}

#[tokio::test]
async fn values_out_of_range_are_400_naming_the_field() {
    let (_t, dir) = data_dir();
    let d = Daemon::start(&dir);
    let c = Client::new();
    let many: serde_json::Map<String, Value> =
        (0..65).map(|i| (format!("k{i}"), json!("v"))).collect();
    for (body, field) in [
        (json!({"cpus": 0}), "cpus"),
        (json!({"cpus": 5}), "cpus"),
        (json!({"cpus": -1}), "cpus"),
        (json!({"memoryMb": 127}), "memoryMb"),
        (json!({"memoryMb": 8193}), "memoryMb"),
        (json!({"idleTimeoutSecs": 0}), "idleTimeoutSecs"),
        (json!({"env": {"A=B": "1"}}), "env"),
        (json!({"env": {"": "1"}}), "env"),
        (json!({"metadata": many}), "metadata"),
        (json!({"metadata": {"k": "v".repeat(1025)}}), "metadata"),
    ] {
        let r = post(&c, &d, "/v1/runtime/schedule", body.clone()).await;
        let status = r.status();
        let v: Value = r.json().await.unwrap();
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["code"], "invalid_value", "{body}: {v}");
        assert_eq!(v["error"]["field"], field, "{body}: {v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains(field), "{m}");
    }
    let r = post(&c, &d, "/v1/runtime/schedule", json!({"image": "no-such"})).await;
    let m = assert_error(r, StatusCode::BAD_REQUEST, "unknown_image").await;
    assert!(m.contains("testguest"), "lists the images: {m}");
    // A malformed OCI reference, on any host.
    let r = post(
        &c,
        &d,
        "/v1/runtime/schedule",
        json!({"image": "oci:relative:1"}),
    )
    .await;
    let status = r.status();
    let v: Value = r.json().await.unwrap();
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "bad_image_reference", "{v}");
    assert_eq!(v["error"]["field"], "image", "{v}");
    // A runtime the image has no init for, an unknown runtime, and a
    // runtime beside a snapshot (whose runtime is used).
    let body = json!({"image": "testguest", "runtime": "vm", "cpus": 1, "memoryMb": 128});
    let r = post(&c, &d, "/v1/runtime/schedule", body).await;
    let status = r.status();
    let v: Value = r.json().await.unwrap();
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "image_unsupported", "{v}");
    assert_eq!(v["error"]["field"], "runtime", "{v}");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains("systemd") && m.contains("container"), "{m}");
    let r = post(
        &c,
        &d,
        "/v1/runtime/schedule",
        json!({"runtime": "unikernel"}),
    )
    .await;
    let m = assert_error(r, StatusCode::BAD_REQUEST, "invalid_body").await;
    assert!(
        m.contains("container") && m.contains("vm"),
        "names the runtimes: {m}"
    );
    let body = json!({"snapshot": uuid::Uuid::new_v4().to_string(), "runtime": "vm"});
    let r = post(&c, &d, "/v1/runtime/schedule", body).await;
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["field"], "runtime", "{v}");
    // Nothing was created by any of them.
    let v: Value = c
        .get(d.url("/v1/runtime/vms"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v, json!({"vms": []}));
}

#[tokio::test]
async fn a_linux_sandbox_on_a_host_that_cannot_run_linux_is_503() {
    let (_t, dir) = data_dir();
    let d = Daemon::start(&dir);
    let c = Client::new();
    let info: Value = c
        .get(d.url("/v1/info"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let has_default = info["images"]
        .as_array()
        .unwrap()
        .iter()
        .any(|i| i["name"] == "default");
    if info["hostMode"]["linuxGuests"] == true || !has_default {
        eprintln!("this host runs Linux guests or has no default image: nothing to test");
        return;
    }
    let r = post(&c, &d, "/v1/runtime/schedule", json!({})).await;
    let m = assert_error(r, StatusCode::SERVICE_UNAVAILABLE, "host_unsupported").await;
    assert!(m.contains("cannot run Linux guests"), "{m}");
    // An OCI image too (refused before any pull).
    let body = json!({"image": "registry.example:5000/app:1"});
    let r = post(&c, &d, "/v1/runtime/schedule", body).await;
    assert_error(r, StatusCode::SERVICE_UNAVAILABLE, "host_unsupported").await;
    let v: Value = c
        .get(d.url("/v1/runtime/vms"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v, json!({"vms": []}));
}

#[tokio::test]
async fn unknown_ids_are_404_and_bad_queries_400() {
    let (_t, dir) = data_dir();
    let d = Daemon::start(&dir);
    let c = Client::new();
    for id in [
        "6f1c3e2a-8d4b-4c1e-9a7f-0b2d3e4f5a6b",
        "not-a-uuid",
        "1234",
        "%00",
    ] {
        let url = d.url(&format!("/v1/runtime/vms/{id}"));
        let r = c.get(&url).send().await.unwrap();
        assert_error(r, StatusCode::NOT_FOUND, "vm_not_found").await;
        let r = c.delete(&url).send().await.unwrap();
        assert_error(r, StatusCode::NOT_FOUND, "vm_not_found").await;
        let r = c
            .post(format!("{url}/exec"))
            .json(&json!({"command": "true"}))
            .send()
            .await
            .unwrap();
        assert_error(r, StatusCode::NOT_FOUND, "vm_not_found").await;
        for r in [
            c.get(format!("{url}/files?path=x")).send().await.unwrap(),
            c.delete(format!("{url}/files?path=x"))
                .send()
                .await
                .unwrap(),
            c.get(format!("{url}/files/content?path=x"))
                .send()
                .await
                .unwrap(),
            c.put(format!("{url}/files/content?path=x"))
                .body("text")
                .send()
                .await
                .unwrap(),
            c.post(format!("{url}/files/mkdir"))
                .json(&json!({"path": "d"}))
                .send()
                .await
                .unwrap(),
            c.get(format!("{url}/processes")).send().await.unwrap(),
            c.get(format!("{url}/processes/1/events"))
                .send()
                .await
                .unwrap(),
            c.post(format!("{url}/processes/1/stdin"))
                .json(&json!({"data": "x"}))
                .send()
                .await
                .unwrap(),
            c.post(format!("{url}/processes/1/signal"))
                .json(&json!({"signal": "TERM"}))
                .send()
                .await
                .unwrap(),
        ] {
            assert_error(r, StatusCode::NOT_FOUND, "vm_not_found").await;
        }
    }
    for q in ["?foo=bar", "?metadata.=x", "?metadata"] {
        let r = c
            .get(d.url(&format!("/v1/runtime/vms{q}")))
            .send()
            .await
            .unwrap();
        assert_error(r, StatusCode::BAD_REQUEST, "bad_request").await;
    }
}

async fn vms(c: &Client, d: &Daemon, query: &str) -> Vec<Value> {
    let v: Value = c
        .get(d.url(&format!("/v1/runtime/vms{query}")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["vms"].as_array().unwrap().clone()
}

#[tokio::test]
async fn sandboxes_persist_across_restarts_and_a_vanished_worker_is_failed() {
    let (_t, dir) = data_dir();
    let c = Client::new();
    let d = Daemon::start(&dir);
    let mut ids = Vec::new();
    let mut pids = Vec::new();
    for team in ["red", "blue"] {
        let v = schedule(
            &c,
            &d,
            json!({"image": "testguest", "cpus": 1, "memoryMb": 128, "idleTimeoutSecs": 60,
                   "disableInternet": true, "metadata": {"team": team}, "env": {"A": "1"}}),
        )
        .await;
        assert_eq!(v["state"], "running", "{v}");
        assert_eq!(v["image"], "testguest");
        assert_eq!(v["runtime"], "container", "the default: {v}");
        assert_eq!(
            (v["cpus"].clone(), v["memoryMb"].clone()),
            (json!(1), json!(128))
        );
        assert_eq!(v["idleTimeoutSecs"], 60);
        assert_eq!(v["disableInternet"], true);
        assert_eq!(v["metadata"], json!({"team": team}));
        assert!(v["createdAt"].as_str().unwrap().ends_with('Z'), "{v}");
        assert!(v.get("env").is_none(), "env values are not shown: {v}");
        let pid = v["workerPid"].as_u64().unwrap();
        assert!(alive(pid));
        ids.push(v["vmId"].as_str().unwrap().to_owned());
        pids.push(pid);
    }
    assert_ne!(ids[0], ids[1]);
    // The test guest has no agent.
    let r = post(
        &c,
        &d,
        &format!("/v1/runtime/vms/{}/exec", ids[0]),
        json!({"command": "true"}),
    )
    .await;
    assert_error(r, StatusCode::BAD_REQUEST, "not_supported").await;
    let procs = d.url(&format!("/v1/runtime/vms/{}/processes", ids[0]));
    let r = c.get(&procs).send().await.unwrap();
    assert_error(r, StatusCode::BAD_REQUEST, "not_supported").await;
    let files = d.url(&format!("/v1/runtime/vms/{}/files", ids[0]));
    let r = c.get(format!("{files}?path=.")).send().await.unwrap();
    assert_error(r, StatusCode::BAD_REQUEST, "not_supported").await;
    // Bad file requests are refused before any agent is asked.
    let r = c.get(&files).send().await.unwrap();
    assert_error(r, StatusCode::BAD_REQUEST, "bad_request").await;
    let r = c.get(format!("{files}?path=")).send().await.unwrap();
    assert_error(r, StatusCode::BAD_REQUEST, "invalid_path").await;
    let r = c
        .put(format!("{files}/content?path=a"))
        .body(vec![0xffu8, 0xfe])
        .send()
        .await
        .unwrap();
    assert_error(r, StatusCode::BAD_REQUEST, "not_text").await;
    // Bad process requests are refused before any agent is asked.
    for (path, body, code) in [
        ("/x/signal", json!({"signal": "TERM"}), "process_not_found"),
        ("/1/signal", json!({"signal": "SIGFOO"}), "invalid_value"),
        ("/1/signal", json!({"signal": 99}), "invalid_value"),
        ("/1/signal", json!({"sig": 9}), "invalid_body"),
        (
            "/1/stdin",
            json!({"data": "%%", "base64": true}),
            "invalid_value",
        ),
        ("/1/stdin", json!({"data": 1}), "invalid_body"),
    ] {
        let r = post(
            &c,
            &d,
            &format!("/v1/runtime/vms/{}/processes{path}", ids[0]),
            body,
        )
        .await;
        let st = if code == "process_not_found" {
            StatusCode::NOT_FOUND
        } else {
            StatusCode::BAD_REQUEST
        };
        assert_error(r, st, code).await;
    }
    // Filters.
    let red = vms(&c, &d, "?metadata.team=red").await;
    assert_eq!(red.len(), 1);
    assert_eq!(red[0]["vmId"], ids[0].as_str());
    assert!(vms(&c, &d, "?metadata.team=green").await.is_empty());
    assert!(vms(&c, &d, "?metadata.team=red&metadata.other=x")
        .await
        .is_empty());
    assert_eq!(vms(&c, &d, "").await.len(), 2);

    // A graceful stop leaves the workers running; the next sproutd adopts them.
    d.stop();
    assert!(pids.iter().all(|&p| alive(p)), "workers outlive sproutd");
    let d = Daemon::start(&dir);
    let all = vms(&c, &d, "").await;
    assert_eq!(all.len(), 2, "{all:?}");
    for (v, (id, pid)) in all.iter().zip(ids.iter().zip(&pids)) {
        assert_eq!(v["vmId"], id.as_str());
        assert_eq!(v["state"], "running", "{v}");
        assert_eq!(v["workerPid"], *pid);
    }
    // kill -9 of sproutd loses nothing either; kill -9 of one worker makes
    // that sandbox failed, the other untouched.
    d.kill9();
    Command::new("kill")
        .args(["-KILL", &pids[1].to_string()])
        .status()
        .unwrap();
    let t = Instant::now();
    while alive(pids[1]) {
        assert!(t.elapsed() < Duration::from_secs(10), "worker did not die");
        std::thread::sleep(Duration::from_millis(20));
    }
    let d = Daemon::start(&dir);
    let get = |id: &str| c.get(d.url(&format!("/v1/runtime/vms/{id}"))).send();
    let a: Value = get(&ids[0]).await.unwrap().json().await.unwrap();
    assert_eq!(a["state"], "running", "{a}");
    let b: Value = get(&ids[1]).await.unwrap().json().await.unwrap();
    assert_eq!(b["state"], "failed", "{b}");
    let why = b["failureReason"].as_str().unwrap();
    assert!(why.contains("gone"), "{why}");
    // A failed sandbox cannot exec; both can be deleted.
    for id in &ids {
        let r = c
            .delete(d.url(&format!("/v1/runtime/vms/{id}")))
            .send()
            .await
            .unwrap();
        let v: Value = r.json().await.unwrap();
        assert_eq!(v, json!({"vmId": id, "deleted": true}));
        let r = get(id).await.unwrap();
        assert_error(r, StatusCode::NOT_FOUND, "vm_not_found").await;
        assert!(!dir.join("vms").join(id).exists());
    }
    let t = Instant::now();
    while alive(pids[0]) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "deleted worker lives on"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(vms(&c, &d, "").await.is_empty());
    // Deletes are durable too.
    d.stop();
    let d = Daemon::start(&dir);
    assert!(vms(&c, &d, "").await.is_empty());
    // One sproutd per data directory.
    let second = Command::new(env!("CARGO_BIN_EXE_sproutd"))
        .args(["--no-lab", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(&d.data_dir)
        .output()
        .unwrap();
    assert!(!second.status.success());
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(err.contains("Another sproutd"), "{err}");
}

#[tokio::test]
async fn metrics_count_sandboxes_by_state_requests_by_route_and_creates() {
    let (_t, dir) = data_dir();
    let d = Daemon::start(&dir);
    let c = Client::new();
    // The first create builds the template (503), the next restores it.
    let r = post(
        &c,
        &d,
        "/v1/runtime/schedule",
        json!({"image": "testguest", "cpus": 1, "memoryMb": 128}),
    )
    .await;
    assert_error(r, StatusCode::SERVICE_UNAVAILABLE, "template_building").await;
    let id = schedule(
        &c,
        &d,
        json!({"image": "testguest", "cpus": 1, "memoryMb": 128}),
    )
    .await["vmId"]
        .as_str()
        .unwrap()
        .to_owned();
    for _ in 0..3 {
        let r = c
            .get(d.url(&format!("/v1/runtime/vms/{id}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    c.get(d.url("/no/such/route")).send().await.unwrap();
    let r = c.get(d.url("/metrics")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain; version=0.0.4"));
    let text = r.text().await.unwrap();
    for line in [
        "sproutd_sandboxes{state=\"running\"} 1",
        "sproutd_sandboxes{state=\"failed\"} 0",
        "sproutd_create_seconds_count 1",
        "sproutd_exec_seconds_count 0",
        "sproutd_http_requests_total{route=\"/v1/runtime/schedule\",method=\"POST\",status=\"201\"} 1",
        // By route template: one series for every id.
        "sproutd_http_requests_total{route=\"/v1/runtime/vms/{id}\",method=\"GET\",status=\"200\"} 3",
        "sproutd_http_requests_total{route=\"unmatched\",method=\"GET\",status=\"404\"} 1",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
    }
    // The first create, and any while the template was built: 503s.
    let building = "sproutd_http_requests_total{route=\"/v1/runtime/schedule\",method=\"POST\",status=\"503\"} ";
    let n: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix(building))
        .unwrap_or_else(|| panic!("{building} in\n{text}"))
        .parse()
        .unwrap();
    assert!(n >= 1);
    assert!(!text.contains(&id), "no series per sandbox id");
    let r = c
        .delete(d.url(&format!("/v1/runtime/vms/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = c
        .get(d.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.lines()
            .any(|l| l == "sproutd_sandboxes{state=\"running\"} 0"),
        "{text}"
    );
}

/// Polls the sandbox until it is `failed`; its failure reason.
async fn failed_reason(c: &Client, d: &Daemon, id: &str) -> String {
    let t = Instant::now();
    loop {
        let v: Value = c
            .get(d.url(&format!("/v1/runtime/vms/{id}")))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if v["state"] == "failed" {
            return v["failureReason"].as_str().unwrap_or_default().to_owned();
        }
        assert_eq!(v["state"], "running", "{v}");
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "not failed within 20 s of its worker's death: {v}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_worker_that_dies_fails_its_sandbox_at_once_without_an_exec() {
    let (_t, dir) = data_dir();
    let d = Daemon::start(&dir);
    let c = Client::new();
    let mut ids = Vec::new();
    let mut pids = Vec::new();
    for _ in 0..2 {
        let v = schedule(
            &c,
            &d,
            json!({"image": "testguest", "cpus": 1, "memoryMb": 128}),
        )
        .await;
        ids.push(v["vmId"].as_str().unwrap().to_owned());
        pids.push(v["workerPid"].as_u64().unwrap());
    }
    // A worker this sproutd started: its status is in the reason.
    Command::new("kill")
        .args(["-KILL", &pids[0].to_string()])
        .status()
        .unwrap();
    let why = failed_reason(&c, &d, &ids[0]).await;
    assert!(why.contains("was killed by signal 9 (SIGKILL)"), "{why}");
    assert!(why.contains(&format!("pid {}", pids[0])), "{why}");
    // The other is untouched.
    let v: Value = c
        .get(d.url(&format!("/v1/runtime/vms/{}", ids[1])))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["state"], "running", "{v}");
    // A worker re-adopted by a new sproutd is watched too.
    d.stop();
    let d = Daemon::start(&dir);
    Command::new("kill")
        .args(["-KILL", &pids[1].to_string()])
        .status()
        .unwrap();
    let why = failed_reason(&c, &d, &ids[1]).await;
    assert!(why.contains(&format!("pid {}", pids[1])), "{why}");
    assert!(why.contains("exited"), "{why}");
    for id in &ids {
        let r = c
            .delete(d.url(&format!("/v1/runtime/vms/{id}")))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{}", r.status());
    }
    // A deleted sandbox's worker ending is no failure.
    assert!(vms(&c, &d, "").await.is_empty());
}

fn committed_openapi() -> (String, Value) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/openapi.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let v = serde_json::from_str(&text).unwrap();
    (text, v)
}

/// Checks `body`, the JSON answer of `method path` (a documented template)
/// with `status`, against the document.
fn assert_documented(doc: &Value, method: &str, path: &str, status: u16, body: &Value) {
    if let Err(e) = service::daemon::openapi::fits_answer(doc, method, path, status, body) {
        let body: String = body.to_string().chars().take(500).collect();
        panic!("{method} {path} answered {status} {body}: {e}");
    }
}

/// GET /v1/openapi.json is docs/openapi.json, byte for byte; every
/// operation it documents is routed (its answer is never the router's
/// `404 not_found` or `405`) and answers a status and code it documents,
/// with a body that fits the document; every method it does not document
/// on a documented path is 405.
#[tokio::test]
async fn openapi_json_is_the_committed_document_and_every_documented_operation_is_served() {
    let (_t, dir) = data_dir();
    let d = Daemon::start(&dir);
    let c = Client::new();
    let r = c.get(d.url("/v1/openapi.json")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("application/json"));
    let served = r.text().await.unwrap();
    let (committed, doc) = committed_openapi();
    assert!(
        served == committed,
        "the served document is not docs/openapi.json: \
         SPROUT_UPDATE_OPENAPI=1 cargo test -p service openapi"
    );
    let paths = doc["paths"].as_object().unwrap();
    assert!(paths.len() >= 15, "{}", paths.len());
    let all = ["get", "put", "post", "delete", "patch"];
    let mut probed = 0;
    for (template, item) in paths {
        // Ids that name nothing: no probe touches a sandbox.
        let path = template
            .replace("{id}", "6f1c3e2a-8d4b-4c1e-9a7f-0b2d3e4f5a6b")
            .replace("{execId}", "1")
            .replace("{port}", "8000");
        let ops = item.as_object().unwrap();
        for method in all {
            let mut url = d.url(&path);
            let op = ops.get(method);
            let needs_path = op.is_some_and(|op| {
                op["parameters"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|p| p["name"] == "path" && p["in"] == "query")
            });
            if needs_path {
                url.push_str("?path=probe.txt");
            }
            let req = c.request(method.to_uppercase().parse().unwrap(), &url);
            // A JSON body of a field no request has: refused as
            // invalid_body before anything is done.
            let content = op.and_then(|op| op["requestBody"]["content"].as_object());
            let req = match content.and_then(|m| m.keys().next()).map(String::as_str) {
                Some("application/json") => req
                    .header("content-type", "application/json")
                    .body(r#"{"openapiProbe":true}"#),
                Some(_) => req.body("probe"),
                None => req,
            };
            let r = req.send().await.unwrap();
            let status = r.status().as_u16();
            let json = r.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("application/json");
            let body: Value = if json {
                r.json().await.unwrap()
            } else {
                Value::String(r.text().await.unwrap())
            };
            let what = format!("{} {template}", method.to_uppercase());
            let Some(op) = op else {
                assert_eq!(status, 405, "{what} is not documented: {body}");
                assert_eq!(body["error"]["code"], "method_not_allowed", "{what}");
                continue;
            };
            probed += 1;
            assert!(
                status != 405 && !(status == 404 && body["error"]["code"] == "not_found"),
                "{what} is documented but not routed: {status} {body}"
            );
            assert!(
                op["responses"].get(status.to_string()).is_some(),
                "{what} answered {status}, which it does not document: {body}"
            );
            if json {
                assert_documented(&doc, method, template, status, &body);
            }
        }
    }
    assert_eq!(probed, 42);
    // And a route nobody documents is the router's 404.
    let r = c.get(d.url("/v1/runtime/nothing")).send().await.unwrap();
    assert_error(r, StatusCode::NOT_FOUND, "not_found").await;
}

/// A sandbox's whole life, every answer checked against the document.
#[tokio::test]
async fn openapi_real_answers_fit_the_document() {
    let (_t, dir) = data_dir();
    let d = Daemon::start(&dir);
    let c = Client::new();
    let (_, doc) = committed_openapi();
    let check = |method: &str, template: &str, status: u16, body: &Value| {
        assert_documented(&doc, method, template, status, body)
    };
    for (path, template) in [
        ("/v1/health", "/v1/health"),
        ("/v1/info", "/v1/info"),
        ("/v1/runtime/vms", "/v1/runtime/vms"),
    ] {
        let r = c.get(d.url(path)).send().await.unwrap();
        check(
            "get",
            template,
            r.status().as_u16(),
            &r.json().await.unwrap(),
        );
    }
    let body = json!({"image": "testguest", "cpus": 1, "memoryMb": 128, "metadata": {"k": "v"}});
    let r = post(&c, &d, "/v1/runtime/schedule", body.clone()).await;
    let status = r.status().as_u16();
    assert_eq!(status, 503);
    check(
        "post",
        "/v1/runtime/schedule",
        status,
        &r.json().await.unwrap(),
    );
    let vm = schedule(&c, &d, body).await;
    check("post", "/v1/runtime/schedule", 201, &vm);
    let id = vm["vmId"].as_str().unwrap();
    let one = format!("/v1/runtime/vms/{id}");
    let r = c.get(d.url(&one)).send().await.unwrap();
    check("get", "/v1/runtime/vms/{id}", 200, &r.json().await.unwrap());
    let r = c.get(d.url("/v1/runtime/vms")).send().await.unwrap();
    let list: Value = r.json().await.unwrap();
    assert_eq!(list["vms"].as_array().unwrap().len(), 1);
    check("get", "/v1/runtime/vms", 200, &list);
    // Errors, each documented where it happens.
    for (method, path, template, body) in [
        (
            "post",
            "/v1/runtime/schedule".to_owned(),
            "/v1/runtime/schedule",
            json!({"cpus": 9}),
        ),
        (
            "post",
            "/v1/runtime/schedule".to_owned(),
            "/v1/runtime/schedule",
            json!({"image": "nope"}),
        ),
        (
            "post",
            format!("{one}/exec"),
            "/v1/runtime/vms/{id}/exec",
            json!({"command": "true"}),
        ),
        (
            "post",
            format!("{one}/exec"),
            "/v1/runtime/vms/{id}/exec",
            json!({"command": ""}),
        ),
        (
            "get",
            format!("{one}/processes"),
            "/v1/runtime/vms/{id}/processes",
            Value::Null,
        ),
        (
            "get",
            format!("{one}/files?path="),
            "/v1/runtime/vms/{id}/files",
            Value::Null,
        ),
        (
            "get",
            format!("{one}/files?path=a&recursive=true"),
            "/v1/runtime/vms/{id}/files",
            Value::Null,
        ),
    ] {
        let mut req = c.request(method.to_uppercase().parse().unwrap(), d.url(&path));
        if !body.is_null() {
            req = req.json(&body);
        }
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap();
        assert!(status >= 400, "{method} {path}: {v}");
        check(method, template, status, &v);
    }
    let r = c.delete(d.url(&one)).send().await.unwrap();
    check(
        "delete",
        "/v1/runtime/vms/{id}",
        200,
        &r.json().await.unwrap(),
    );
}

#[tokio::test]
async fn exec_limits_are_flags_that_info_shows() {
    let (_t, dir) = data_dir();
    let d = Daemon::start_with(&dir, &["--max-execs-per-vm", "3", "--max-execs", "5"]);
    let info: Value = Client::new()
        .get(d.url("/v1/info"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        info["execLimits"],
        json!({"maxExecsPerVm": 3, "maxExecs": 5, "inFlight": 0})
    );
    let metrics = Client::new()
        .get(d.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "sproutd_execs_in_flight 0",
        "sproutd_execs_refused_total{limit=\"sandbox\"} 0",
        "sproutd_execs_refused_total{limit=\"global\"} 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }
    // Defaults, and a limit of 0 is refused with the reason.
    let (_t2, dir2) = data_dir();
    let d2 = Daemon::start(&dir2);
    let info: Value = Client::new()
        .get(d2.url("/v1/info"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["execLimits"]["maxExecsPerVm"], 32);
    assert_eq!(info["execLimits"]["maxExecs"], 128);
    let (_t3, dir3) = data_dir();
    let out = Command::new(env!("CARGO_BIN_EXE_sproutd"))
        .args([
            "--no-lab",
            "--listen",
            "127.0.0.1:0",
            "--max-execs",
            "0",
            "--data-dir",
        ])
        .arg(&dir3)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--max-execs"), "{err}");
}

/// The lines of `/proc/<pid>/status` that show a jail.
fn jail_status(pid: u64) -> Vec<String> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .filter(|l| {
            ["Uid:", "CapEff:", "NoNewPrivs:", "Seccomp:"]
                .iter()
                .any(|k| l.starts_with(k))
        })
        .map(str::to_owned)
        .collect()
}

/// The names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// The mounts process `pid` sees (its `/proc/PID/mountinfo`, paths from its
/// own root): mount point -> read-only.
fn mounts_of(pid: u64) -> std::collections::BTreeMap<String, bool> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    s.lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f[4].to_owned(), f[5].split(',').any(|o| o == "ro"))
        })
        .collect()
}

/// The first component of an absolute path.
fn top(p: &Path) -> String {
    p.components()
        .nth(1)
        .unwrap()
        .as_os_str()
        .to_string_lossy()
        .into_owned()
}

/// A cold boot takes a ready worker of its shape when one waits (one starts
/// after a sandbox of that shape booted): the VM boots into the worker's
/// shell, and the sandbox runs from its own directory like any other.
#[tokio::test]
async fn a_second_cold_boot_of_a_shape_boots_in_a_ready_worker() {
    let (_t, dir) = data_dir();
    let c = Client::new();
    let d = Daemon::start_with(&dir, &["--no-templates"]);
    let (first, _) = schedule_testguest(&c, &d).await;
    let t = Instant::now();
    while !Daemon::log(&dir).contains("a ready worker of 1 vCPUs, 128 MiB waits") {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no ready worker: {}",
            Daemon::log(&dir)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (second, pid) = schedule_testguest(&c, &d).await;
    let log = Daemon::log(&dir);
    let ready_boot = |id: &str| {
        log.lines()
            .any(|l| l.contains(id) && l.contains("VM started") && l.contains("(a ready worker)"))
    };
    assert!(!ready_boot(&first), "{log}");
    assert!(ready_boot(&second), "{log}");
    let vm_dir = dir.join("vms").join(&second);
    for f in ["control.sock", "console.log"] {
        assert!(
            vm_dir.join(f).symlink_metadata().is_ok(),
            "{f} moved in: {log}"
        );
    }
    assert!(alive(pid));
    assert_eq!(
        vsock_echo(&vm_dir.join("vm/vsock.sock"), b"from a ready worker"),
        b"from a ready worker"
    );
    let r = c
        .delete(d.url(&format!("/v1/runtime/vms/{second}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", Daemon::log(&dir));
    assert!(!alive(pid), "its worker is reaped");
    d.stop();
}

/// Run as root (as here and in CI), sproutd jails each worker: nobody, no
/// capabilities, seccomp filters, and a root holding only the jail's own
/// entries and the sandbox's files; the sandbox still answers (its vsock
/// socket from the host, the API's calls), a restarted sproutd re-adopts
/// it, and a delete, by the sproutd that started the worker or by a later
/// one, leaves no jail behind. Not root: workers run unjailed and the log
/// says why.
#[tokio::test]
async fn a_root_sproutd_jails_each_worker_and_a_delete_removes_the_jail() {
    let (_t, dir) = data_dir();
    let c = Client::new();
    // A booted worker's jail (a restored one's is checked in
    // rest_states.rs). No ready workers: every jail here is a sandbox's.
    let d = Daemon::start_with(&dir, &["--no-templates", "--ready-workers", "0"]);
    let (id, pid) = schedule_testguest(&c, &d).await;
    if rustix::process::geteuid().as_raw() != 0 {
        let log = Daemon::log(&dir);
        assert!(log.contains("workers run unjailed"), "{log}");
        assert!(jail_status(pid).contains(&"Seccomp:\t0".to_owned()));
        return;
    }
    assert!(
        Daemon::log(&dir).contains("workers run jailed"),
        "{}",
        Daemon::log(&dir)
    );
    let st = jail_status(pid);
    for want in [
        "Seccomp:\t2",
        "CapEff:\t0000000000000000",
        "NoNewPrivs:\t1",
        "Uid:\t65534\t65534\t65534\t65534",
    ] {
        assert!(st.iter().any(|l| l == want), "{want:?} not in {st:?}");
    }
    // Its own network namespace: sproutd's API on loopback is out of reach.
    let net = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/net")).unwrap();
    assert_ne!(
        net(&pid.to_string()),
        net("self"),
        "its own network namespace"
    );
    // Its root: the jail's own entries, and the paths of what its VM needs.
    let vm_dir = dir.join("vms").join(&id).canonicalize().unwrap();
    let kernel = Path::new(testguest_build::TESTGUEST_PATH)
        .canonicalize()
        .unwrap();
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let mut want: Vec<String> = ["dev", "proc", "worker"]
        .iter()
        .map(|s| s.to_string())
        .chain([top(&vm_dir), top(&kernel)])
        .collect();
    want.sort();
    want.dedup();
    assert_eq!(names(&root), want);
    assert_eq!(
        names(&root.join("dev")),
        ["kvm", "net", "null", "urandom", "userfaultfd"]
    );
    let inside = |p: &Path| root.join(p.strip_prefix("/").unwrap());
    // Of the sandbox's directory only vm/ (no control link, console or
    // log); of the data directory nothing else (no registry, no jails).
    assert_eq!(names(&inside(&vm_dir)), ["vm"]);
    assert_eq!(names(&inside(&vm_dir.join("vm"))), ["vsock.sock"]);
    let data = dir.canonicalize().unwrap();
    assert_eq!(names(&inside(&data)), ["vms"]);
    assert_eq!(names(&inside(&data.join("vms"))), [id.as_str()]);
    assert!(inside(&kernel).is_file());
    assert!(!root.join("etc/passwd").exists());
    // Mounted in its view: the jail's own and exactly what the VM needs,
    // the kernel read-only, its vm/ read-write.
    let path = |p: &Path| p.display().to_string();
    let want: std::collections::BTreeMap<String, bool> = [
        ("/".to_owned(), false),
        ("/dev".to_owned(), true),
        ("/proc/self".to_owned(), true),
        (path(&kernel), true),
        (path(&vm_dir.join("vm")), false),
    ]
    .into_iter()
    .collect();
    assert_eq!(mounts_of(pid), want);
    // Its control socket is in its jail, linked from the sandbox's.
    let jails = dir.join("jails");
    assert_eq!(names(&jails).len(), 1);
    let link = std::fs::read_link(vm_dir.join("control.sock")).unwrap();
    assert!(
        link.starts_with(jails.canonicalize().unwrap()),
        "{}",
        link.display()
    );

    // The sandbox answers: its vsock socket from the host, and the API.
    let uds = vm_dir.join("vm/vsock.sock");
    assert_eq!(vsock_echo(&uds, b"through the jail"), b"through the jail");
    let r = post(
        &c,
        &d,
        &format!("/v1/runtime/vms/{id}/exec"),
        json!({"command": "true"}),
    )
    .await;
    assert_error(r, StatusCode::BAD_REQUEST, "not_supported").await;
    let r = c
        .get(d.url(&format!("/v1/runtime/vms/{id}/files?path=.")))
        .send()
        .await
        .unwrap();
    assert_error(r, StatusCode::BAD_REQUEST, "not_supported").await;

    // A second sandbox, deleted by the sproutd that started its worker.
    let (id2, pid2) = schedule_testguest(&c, &d).await;
    assert!(jail_status(pid2).contains(&"Seccomp:\t2".to_owned()));
    assert_eq!(names(&jails).len(), 2);
    let r = c
        .delete(d.url(&format!("/v1/runtime/vms/{id2}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", Daemon::log(&dir));
    assert!(!alive(pid2), "its worker is reaped");
    assert_eq!(names(&jails).len(), 1, "its jail is gone");

    // kill -9 of sproutd: the next one re-adopts the jailed worker.
    d.kill9();
    let d = Daemon::start(&dir);
    let v: Value = c
        .get(d.url(&format!("/v1/runtime/vms/{id}")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["state"], "running", "{v}");
    assert_eq!(v["workerPid"], pid);
    assert_eq!(vsock_echo(&uds, b"after a restart"), b"after a restart");
    assert!(jail_status(pid).contains(&"Seccomp:\t2".to_owned()));

    // Its delete stops the adopted worker and removes its jail.
    let r = c
        .delete(d.url(&format!("/v1/runtime/vms/{id}")))
        .send()
        .await
        .unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["deleted"], true, "{v}\n{}", Daemon::log(&dir));
    let t = Instant::now();
    while alive(pid) {
        assert!(t.elapsed() < Duration::from_secs(10), "worker lives on");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(names(&jails).is_empty(), "{:?}", names(&jails));
    assert!(!vm_dir.exists());
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let data = data.display().to_string();
    assert!(
        !mounts.lines().any(|l| l.contains(&data)),
        "no mount is left under {data}:\n{mounts}"
    );
    d.stop();
}
