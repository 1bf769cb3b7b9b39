//! Tenants, API keys and quota slots through the API: a real `sproutd`
//! run with `--tenants FILE` on this host, its sandboxes Sprout's test
//! guest (docs/api.md, "Tenants and quotas").

mod common;
use common::*;

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

use reqwest::{Client, Method, StatusCode};
use serde_json::{json, Value};

async fn get(c: &Client, d: &Daemon, path: &str) -> Value {
    let r = c.get(d.url(path)).send().await.unwrap();
    let st = r.status();
    let v: Value = r.json().await.unwrap();
    assert!(st.is_success(), "GET {path}: {st} {v}");
    v
}

async fn op(c: &Client, d: &Daemon, path: &str, body: Value) -> (StatusCode, Value) {
    let r = post(c, d, path, body).await;
    let st = r.status();
    (st, r.json().await.unwrap())
}

async fn ok(c: &Client, d: &Daemon, path: &str, body: Value) -> Value {
    let (st, v) = op(c, d, path, body).await;
    assert!(
        st.is_success(),
        "{path}: {st} {v}\n{}",
        Daemon::log(&d.data_dir)
    );
    v
}

/// A request of the route table: method, path (ids filled in), query,
/// body.
async fn send(c: &Client, d: &Daemon, method: &str, path: &str, query: &str) -> (u16, String) {
    let m = Method::from_bytes(method.as_bytes()).unwrap();
    let mut rb = c.request(m, d.url(&format!("{path}{query}")));
    // A body each operation accepts, so that only the id can be what is
    // refused.
    let body = if path.ends_with("/exec") {
        json!({"command": "true"})
    } else if path.ends_with("/checkpoints") {
        json!({"name": "x"})
    } else if path.ends_with("/mkdir") {
        json!({"path": "/workspace/d"})
    } else if path.ends_with("/signal") {
        json!({"signal": "TERM"})
    } else if path.ends_with("/stdin") {
        json!({"data": "x"})
    } else if path.ends_with("/ports") {
        json!({"port": 8000})
    } else {
        json!({})
    };
    rb = if path.ends_with("/files/content") && method == "PUT" {
        rb.header("content-type", "text/plain").body("x")
    } else if path.ends_with("/files/raw") && method == "PUT" {
        rb.header("content-type", "application/octet-stream")
            .body("x")
    } else if method == "POST" {
        rb.json(&body)
    } else {
        rb
    };
    let r = rb.send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// Every route of the OpenAPI document, tried by tenant B with tenant A's
/// ids, answers exactly what it answers for ids nobody has: 404, the same
/// body (the id aside). A route added later is in the document, so in
/// this table.
#[tokio::test]
async fn another_tenants_ids_are_answered_as_unknown_ones_on_every_route() {
    let (_t, dir) = data_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let (ka, la) = new_key();
    let (kb, lb) = new_key();
    let (krev, lrev) = new_key();
    let lrev = lrev.replace(" }", ", revoked = true }");
    let file = dir.with_extension("tenants.toml");
    std::fs::write(
        &file,
        format!(
            "[[tenant]]\nname = \"a\"\nkeys = [{la}, {lrev}]\n\n[[tenant]]\nname = \"b\"\n\
             keys = [{lb}]\n"
        ),
    )
    .unwrap();
    let d = Daemon::start_with(&dir, &["--tenants", file.to_str().unwrap()]);
    let (a, b) = (keyed(&ka), keyed(&kb));

    // Keys: none, wrong and revoked are 401 (saying which, and how to
    // authenticate); health and the document need none.
    let anon = Client::new();
    let r = anon.get(d.url("/v1/runtime/vms")).send().await.unwrap();
    assert_eq!(r.headers()["www-authenticate"], "Bearer realm=\"sproutd\"");
    let m = assert_error(r, StatusCode::UNAUTHORIZED, "unauthorized").await;
    assert!(m.contains("Authorization: Bearer"), "{m}");
    for (k, why) in [("sk-sprout-wrong", "not known"), (krev.as_str(), "revoked")] {
        let r = keyed(k).get(d.url("/v1/info")).send().await.unwrap();
        let m = assert_error(r, StatusCode::UNAUTHORIZED, "unauthorized").await;
        assert!(m.contains(why), "{m}");
    }
    let r = anon
        .get(d.url("/metrics"))
        .header("x-api-key", &ka)
        .send()
        .await
        .unwrap();
    assert_error(r, StatusCode::FORBIDDEN, "forbidden").await;
    for p in ["/v1/health", "/v1/openapi.json"] {
        let r = anon.get(d.url(p)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{p}");
    }
    // Nothing else is public: not the raw file routes, not a HEAD, not a
    // public path with more to it.
    let vm0 = uuid_like();
    for (m, p) in [
        (
            Method::GET,
            format!("/v1/runtime/vms/{vm0}/files/raw?path=/workspace/f"),
        ),
        (
            Method::PUT,
            format!("/v1/runtime/vms/{vm0}/files/raw?path=/workspace/f"),
        ),
        (Method::HEAD, "/v1/runtime/vms".to_owned()),
        (Method::GET, "/v1/health/".to_owned()),
        (Method::GET, "/v1/health/../runtime/vms".to_owned()),
        (Method::GET, "/no/such/route".to_owned()),
    ] {
        let r = anon.request(m.clone(), d.url(&p)).send().await.unwrap();
        assert_eq!(r.status(), 401, "{m} {p}");
    }
    // A non-operator sees neither the data directory nor the service's
    // execs in flight.
    let info = get(&a, &d, "/v1/info").await;
    assert!(info.get("dataDir").is_none(), "{info}");
    assert!(info["execLimits"].get("inFlight").is_none(), "{info}");
    assert_eq!(info["tenant"]["execsInFlight"], 0, "{info}");
    assert_eq!(get(&b, &d, "/v1/info").await["tenant"]["name"], "b");

    // Tenant A's sandbox, snapshot and checkpoint.
    let (vm, _) = schedule_testguest(&a, &d).await;
    let snap = ok(&a, &d, &format!("/v1/runtime/vms/{vm}/snapshot"), json!({})).await;
    let snap = snap["snapshotId"].as_str().unwrap().to_owned();
    let cp = ok(
        &a,
        &d,
        &format!("/v1/runtime/vms/{vm}/checkpoints"),
        json!({"name": "one"}),
    )
    .await;
    let cp = cp["snapshotId"].as_str().unwrap().to_owned();

    let doc: Value = anon
        .get(d.url("/v1/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut tried = 0;
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, opn) in item.as_object().unwrap() {
            let method = method.to_uppercase();
            if !path.contains('{') {
                continue;
            }
            let mine = if path.starts_with("/v1/runtime/snapshots/") {
                snap.clone()
            } else if path.starts_with("/v1/runtime/checkpoints/") {
                cp.clone()
            } else {
                vm.clone()
            };
            let unknown = uuid_like();
            let fill = |id: &str| {
                path.replace("{id}", id)
                    .replace("{execId}", "1")
                    .replace("{port}", "8000")
            };
            let query = if opn["parameters"]
                .as_array()
                .is_some_and(|ps| ps.iter().any(|p| p["name"] == "path"))
            {
                "?path=/workspace/f"
            } else {
                ""
            };
            let (st, body) = send(&b, &d, &method, &fill(&mine), query).await;
            let (st0, body0) = send(&b, &d, &method, &fill(&unknown), query).await;
            assert_eq!(st, 404, "{method} {path} as B: {body}");
            assert_eq!(
                (st, body.replace(&mine, "ID")),
                (st0, body0.replace(&unknown, "ID")),
                "{method} {path}: B is answered otherwise for A's id than for an unknown one"
            );
            let v: Value = serde_json::from_str(&body).unwrap();
            let code = v["error"]["code"].as_str().unwrap();
            assert!(
                ["vm_not_found", "snapshot_not_found", "checkpoint_not_found"].contains(&code),
                "{method} {path}: {body}"
            );
            tried += 1;
        }
    }
    assert!(tried >= 25, "only {tried} routes with ids");
    ports_need_the_owners_key_unless_public(&d, &a, &b, &ka, &kb, &vm).await;

    // A schedule from A's snapshot, as B: the snapshot is unknown to B.
    let r = post(&b, &d, "/v1/runtime/schedule", json!({"snapshot": snap})).await;
    let m = assert_error(r, StatusCode::NOT_FOUND, "snapshot_not_found").await;
    assert!(m.contains(&snap));
    // B's lists hold none of A's; A's hold them; nothing of A's was
    // touched by B's deletes, pauses and reboots.
    assert_eq!(get(&b, &d, "/v1/runtime/vms").await["vms"], json!([]));
    assert_eq!(
        get(&b, &d, "/v1/runtime/snapshots").await["snapshots"],
        json!([])
    );
    let v = get(&a, &d, &format!("/v1/runtime/vms/{vm}")).await;
    assert_eq!(v["state"], "running", "{v}");
    let snaps = get(&a, &d, "/v1/runtime/snapshots").await;
    let ids: Vec<&str> = snaps["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["snapshotId"].as_str().unwrap())
        .collect();
    assert!(
        ids.contains(&snap.as_str()) && ids.contains(&cp.as_str()),
        "{snaps}"
    );
    // On disk, under its tenant and its sandbox.
    for s in [&snap, &cp] {
        let f = d
            .data_dir
            .join("snapshots/a")
            .join(&vm)
            .join(s)
            .join("s/manifest.json");
        assert!(f.is_file(), "{}", f.display());
    }
    assert_eq!(get(&a, &d, "/v1/runtime/vms").await["vms"][0]["vmId"], vm);

    // A SIGHUP takes a revocation without a restart.
    let text = std::fs::read_to_string(&file).unwrap();
    std::fs::write(
        &file,
        text.replace(&la, &la.replace(" }", ", revoked = true }")),
    )
    .unwrap();
    Command::new("kill")
        .args(["-HUP", &d.child.id().to_string()])
        .status()
        .unwrap();
    let t = Instant::now();
    loop {
        let r = a.get(d.url("/v1/info")).send().await.unwrap();
        if r.status() == 401 {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "not revoked");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A bad file keeps the tenants in force.
    std::fs::write(&file, "[[tenant]]\nname = 1\n").unwrap();
    Command::new("kill")
        .args(["-HUP", &d.child.id().to_string()])
        .status()
        .unwrap();
    let t = Instant::now();
    while !Daemon::log(&dir).contains("the tenants read before stay in force") {
        assert!(t.elapsed() < Duration::from_secs(60), "no error logged");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(get(&b, &d, "/v1/info").await["tenant"]["name"], "b");
}

/// A port's URL (docs/api.md, "Ports"): without a key 401, with another
/// tenant's 404 as if closed, with the owner's past the gate (to the
/// test guest's `not_supported`: it has no agent); a public one needs no
/// key; a closed one is 404.
async fn ports_need_the_owners_key_unless_public(
    d: &Daemon,
    a: &Client,
    b: &Client,
    ka: &str,
    kb: &str,
    vm: &str,
) {
    let path = format!("/v1/runtime/vms/{vm}/ports");
    let open = |port: u16, public: bool| ok(a, d, &path, json!({"port": port, "public": public}));
    let p = open(8000, false).await;
    let host = format!("8000-{vm}.localhost:{}", d.base.rsplit(':').next().unwrap());
    assert_eq!(p["url"], format!("http://{host}/"), "{p}");
    assert_eq!(p["public"], false, "{p}");
    let anon = Client::new();
    let to = |host: &str, key: Option<(&str, &str)>| {
        let mut r = anon.get(d.url("/some/page?q=1")).header("host", host);
        if let Some((h, k)) = key {
            r = r.header(h, k);
        }
        r.send()
    };
    let r = to(&host, None).await.unwrap();
    assert_eq!(r.headers()["www-authenticate"], "Bearer realm=\"sproutd\"");
    assert_error(r, StatusCode::UNAUTHORIZED, "unauthorized").await;
    let r = to(&host, Some(("x-api-key", kb))).await.unwrap();
    let m = assert_error(r, StatusCode::NOT_FOUND, "port_not_open").await;
    assert!(m.contains("8000") && m.contains(vm), "{m}");
    let bearer = format!("Bearer {ka}");
    for key in [("x-api-key", ka), ("authorization", bearer.as_str())] {
        let r = to(&host, Some(key)).await.unwrap();
        assert_error(r, StatusCode::BAD_REQUEST, "not_supported").await;
    }
    let other = format!("8001-{vm}.localhost");
    let r = to(&other, Some(("x-api-key", ka))).await.unwrap();
    assert_error(r, StatusCode::NOT_FOUND, "port_not_open").await;
    // B can neither list nor close A's.
    let r = b
        .get(d.url(&format!("/v1/runtime/vms/{vm}/ports")))
        .send()
        .await
        .unwrap();
    assert_error(r, StatusCode::NOT_FOUND, "vm_not_found").await;

    open(8001, true).await;
    let r = to(&other, None).await.unwrap();
    assert_error(r, StatusCode::BAD_REQUEST, "not_supported").await;
    let l = get(a, d, &format!("/v1/runtime/vms/{vm}/ports")).await;
    let ports: Vec<(u64, bool)> = l["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["port"].as_u64().unwrap(), p["public"].as_bool().unwrap()))
        .collect();
    assert_eq!(ports, [(8000, false), (8001, true)], "{l}");
    // Bad ports, and a 33rd.
    for port in [json!(0), json!(65536), json!(-1), json!("80")] {
        let (st, v) = op(
            a,
            d,
            &format!("/v1/runtime/vms/{vm}/ports"),
            json!({"port": port}),
        )
        .await;
        assert_eq!(st, 400, "{port}: {v}");
    }
    for port in 9000..9030 {
        open(port, false).await;
    }
    let (st, v) = op(
        a,
        d,
        &format!("/v1/runtime/vms/{vm}/ports"),
        json!({"port": 9999}),
    )
    .await;
    assert_eq!(
        (st.as_u16(), &v["error"]["code"]),
        (409, &json!("too_many_ports")),
        "{v}"
    );
    for port in [8000, 8001] {
        let r = a
            .delete(d.url(&format!("/v1/runtime/vms/{vm}/ports/{port}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 204);
    }
    let r = to(&other, None).await.unwrap();
    assert_error(r, StatusCode::NOT_FOUND, "port_not_open").await;
    let r = a
        .delete(d.url(&format!("/v1/runtime/vms/{vm}/ports/8000")))
        .send()
        .await
        .unwrap();
    assert_error(r, StatusCode::NOT_FOUND, "port_not_open").await;
}

fn uuid_like() -> String {
    uuid::Uuid::new_v4().to_string()
}

fn vm_ids(list: &Value) -> Vec<String> {
    list["vms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["vmId"].as_str().unwrap().to_owned())
        .collect()
}

/// Two slots: a third create is 402; a pause, a sleep or a delete frees
/// one, a resume or a wake needs one; a fork needs all its children's at
/// once, and a 402 makes no child and no snapshot.
#[tokio::test]
async fn quota_slots_are_held_by_running_sandboxes_only() {
    let (_t, dir) = data_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let (k, l) = new_key();
    let file = dir.with_extension("tenants.toml");
    std::fs::write(
        &file,
        format!("[[tenant]]\nname = \"q\"\nslots = 2\nmax_execs = 4\nkeys = [{l}]\n"),
    )
    .unwrap();
    let d = Daemon::start_with(&dir, &["--tenants", file.to_str().unwrap()]);
    let c = keyed(&k);
    let tg = json!({"image": "testguest", "cpus": 1, "memoryMb": 128});
    let (v1, _) = schedule_testguest(&c, &d).await;
    let (v2, _) = schedule_testguest(&c, &d).await;
    let info = get(&c, &d, "/v1/info").await;
    assert_eq!(
        info["tenant"],
        json!({"name": "q", "slots": 2, "slotsInUse": 2, "maxExecs": 4, "execsInFlight": 0})
    );
    let full = |m: &str| assert!(m.contains("2 of its 2"), "{m}");
    let r = post(&c, &d, "/v1/runtime/schedule", tg.clone()).await;
    full(&assert_error(r, StatusCode::PAYMENT_REQUIRED, "quota_exhausted").await);
    assert_eq!(vm_ids(&get(&c, &d, "/v1/runtime/vms").await).len(), 2);

    // A pause frees a slot; the resume then finds none.
    ok(&c, &d, &format!("/v1/runtime/vms/{v1}/pause"), json!({})).await;
    let (v3, _) = schedule_testguest(&c, &d).await;
    let r = post(&c, &d, &format!("/v1/runtime/vms/{v1}/resume"), json!({})).await;
    full(&assert_error(r, StatusCode::PAYMENT_REQUIRED, "quota_exhausted").await);
    assert_eq!(
        get(&c, &d, &format!("/v1/runtime/vms/{v1}")).await["state"],
        "paused"
    );

    // A sleep frees one too; the wake then finds none.
    ok(&c, &d, &format!("/v1/runtime/vms/{v2}/sleep"), json!({})).await;
    let (v4, _) = schedule_testguest(&c, &d).await;
    let r = post(&c, &d, &format!("/v1/runtime/vms/{v2}/wake"), json!({})).await;
    full(&assert_error(r, StatusCode::PAYMENT_REQUIRED, "quota_exhausted").await);
    assert_eq!(
        get(&c, &d, &format!("/v1/runtime/vms/{v2}")).await["state"],
        "sleeping"
    );

    // One slot free (a delete): a fork of two is refused whole.
    let r = c
        .delete(d.url(&format!("/v1/runtime/vms/{v4}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let before = get(&c, &d, "/v1/runtime/snapshots").await;
    let r = post(
        &c,
        &d,
        &format!("/v1/runtime/vms/{v3}/fork"),
        json!({"count": 2}),
    )
    .await;
    let m = assert_error(r, StatusCode::PAYMENT_REQUIRED, "quota_exhausted").await;
    assert!(m.contains("needs 2"), "{m}");
    let mut left = vm_ids(&get(&c, &d, "/v1/runtime/vms").await);
    left.sort();
    let mut want = vec![v1.clone(), v2.clone(), v3.clone()];
    want.sort();
    assert_eq!(left, want, "no child was made");
    assert_eq!(get(&c, &d, "/v1/runtime/snapshots").await, before);
    // A fork of one fits.
    let f = ok(
        &c,
        &d,
        &format!("/v1/runtime/vms/{v3}/fork"),
        json!({"count": 1}),
    )
    .await;
    assert_eq!(f["forks"][0]["state"], "running", "{f}");
    let info = get(&c, &d, "/v1/info").await;
    assert_eq!(info["tenant"]["slotsInUse"], 2, "{info}");

    // Concurrent creates never hold more than the slots (all full now).
    let del = c
        .delete(d.url(&format!("/v1/runtime/vms/{v3}")))
        .send()
        .await
        .unwrap();
    assert_eq!(del.status(), 200);
    let tries = (0..4).map(|_| {
        let (c, body, url) = (c.clone(), tg.clone(), d.url("/v1/runtime/schedule"));
        tokio::spawn(async move { c.post(url).json(&body).send().await.unwrap().status() })
    });
    let mut got = BTreeMap::new();
    for t in tries {
        *got.entry(t.await.unwrap().as_u16()).or_insert(0) += 1;
    }
    assert_eq!(got, BTreeMap::from([(201, 1), (402, 3)]), "{got:?}");
    let info = get(&c, &d, "/v1/info").await;
    assert_eq!(info["tenant"]["slotsInUse"], 2, "{info}");
}

/// Without a tenants file sproutd listens only on loopback, and says why.
#[test]
fn without_tenants_sproutd_refuses_a_non_loopback_address() {
    let (_t, dir) = data_dir();
    let out = Command::new(env!("CARGO_BIN_EXE_sproutd"))
        .args(["--no-lab", "--listen", "0.0.0.0:0", "--data-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("Refusing to listen on 0.0.0.0:0 without --tenants"),
        "{err}"
    );
    // A bad tenants file is told before anything starts.
    let f = dir.with_extension("bad.toml");
    std::fs::write(
        &f,
        "[[tenant]]\nname = \"x\"\nkeys = [{ sha256 = \"12\" }]\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_sproutd"))
        .args(["--no-lab", "--listen", "127.0.0.1:0", "--tenants"])
        .arg(&f)
        .arg("--data-dir")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("is not valid") && err.contains("64 hex"),
        "{err}"
    );
}
