//! Rest states of Linux sandboxes, through a real HTTP client on this host
//! against `sproutd --lab` (the service a host without hardware
//! virtualization runs, its API served from inside the emulated lab): the
//! issue's lifecycle, with files, processes, identities and wakes checked
//! inside the guests. The state machine itself, on the test guest, is in
//! service/tests/rest_states.rs.

use std::time::{Duration, Instant};

use reqwest::Client;
use serde_json::{json, Value};

mod common;
use common::lab::{lab, Hosted};

async fn call(c: &Client, h: &Hosted, method: &str, path: &str, body: Value) -> (u16, Value) {
    let url = h.url(path);
    let req = match method {
        "GET" => c.get(url),
        "DELETE" => c.delete(url),
        _ => c.post(url).json(&body),
    };
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
    )
}

/// A rest-state operation that must succeed.
async fn op(c: &Client, h: &Hosted, id: &str, what: &str, body: Value) -> Value {
    let (st, v) = call(c, h, "POST", &format!("/v1/runtime/vms/{id}/{what}"), body).await;
    assert!((200..300).contains(&st), "{what} of {id}: {st} {v}");
    v
}

async fn vm(c: &Client, h: &Hosted, id: &str) -> Value {
    let (st, v) = call(c, h, "GET", &format!("/v1/runtime/vms/{id}"), json!({})).await;
    assert_eq!(st, 200, "{v}");
    v
}

/// `sh -c script` in the sandbox: (status, the answer).
async fn sh(c: &Client, h: &Hosted, id: &str, script: &str) -> (u16, Value) {
    call(
        c,
        h,
        "POST",
        &format!("/v1/runtime/vms/{id}/exec"),
        json!({"command": "/bin/sh", "argv": ["-c", script]}),
    )
    .await
}

/// `sh -c script`, which must exit 0; its stdout, trimmed.
async fn out(c: &Client, h: &Hosted, id: &str, script: &str) -> String {
    let (st, v) = sh(c, h, id, script).await;
    assert_eq!(st, 200, "{script}: {v}");
    assert_eq!(v["exitCode"], 0, "{script}: {v}");
    v["stdout"].as_str().unwrap().trim().to_owned()
}

async fn schedule(c: &Client, h: &Hosted, body: Value) -> String {
    common::lab::schedule(c, h, body).await["vmId"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// 20 MiB in 20 files under /workspace/tree, and their checksums.
const MAKE_TREE: &str = "mkdir -p /workspace/tree && cd /workspace/tree && i=1; \
    while [ $i -le 20 ]; do head -c 1048576 /dev/urandom > f$i; i=$((i+1)); done; \
    sha256sum f* > /workspace/tree.sums";
const CHECK_TREE: &str =
    "cd /workspace/tree && sha256sum -c /workspace/tree.sums >/dev/null && echo intact";
/// A background counter, one step a 0.2 s, in /tmp (the guest's memory).
const COUNTER: &str =
    "i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; echo tick$i; sleep 0.2; done";

/// The counter now, then that it moves on.
async fn counting(c: &Client, h: &Hosted, id: &str) -> u64 {
    // `echo $i > /tmp/counter` truncates before it writes: a read can fall
    // between the two (or before the first write) and see nothing.
    let read = || async {
        let t = Instant::now();
        loop {
            let s = out(c, h, id, "cat /tmp/counter").await;
            match s.parse::<u64>() {
                Ok(n) => return n,
                Err(_) if s.is_empty() && t.elapsed() < Duration::from_secs(60) => {}
                Err(e) => panic!("counter {s:?}: {e}"),
            }
        }
    };
    let a = read().await;
    let t = Instant::now();
    loop {
        let b = read().await;
        if b > a {
            return b;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the counter stopped at {a}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Attaches to the counter's output stream (background process `exec`)
/// and reads it until a tick later than `after` arrives: its stream can be
/// re-attached, and it is live.
async fn attach_sees_ticks(c: &Client, h: &Hosted, id: &str, exec: u64, after: u64) {
    let url = h.url(&format!("/v1/runtime/vms/{id}/processes/{exec}/events"));
    let mut r = c
        .get(url)
        .header("accept", "text/event-stream")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut text = String::new();
    let t = Instant::now();
    let latest = |text: &str| {
        text.split("tick")
            .skip(1)
            .filter_map(|s| {
                s.split(|ch: char| !ch.is_ascii_digit())
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .max()
            .unwrap_or(0)
    };
    while latest(&text) <= after {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no tick past {after}: {text}"
        );
        match tokio::time::timeout(Duration::from_secs(60), r.chunk()).await {
            Ok(Ok(Some(b))) => text.push_str(&String::from_utf8_lossy(&b)),
            other => panic!("the stream ended ({other:?}): {text}"),
        }
    }
    assert!(text.contains("event: stdout"), "{text}");
}

async fn identity(c: &Client, h: &Hosted, id: &str) -> (String, String, String) {
    let o = out(
        c,
        h,
        id,
        "hostname; cat /etc/machine-id; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'",
    )
    .await;
    let l: Vec<&str> = o.lines().collect();
    assert_eq!(l.len(), 3, "{o}");
    (l[0].into(), l[1].into(), l[2].into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn linux_sandboxes_through_every_rest_state_from_the_lab() {
    let lab = lab();
    // SPROUT_KEEP=1 keeps the data directory (and its lab data disk, with
    // every sandbox's console) for a look after a failure.
    let t = tempfile::Builder::new()
        .prefix("lab-rest")
        .tempdir()
        .unwrap();
    let (_t, dir) = if std::env::var_os("SPROUT_KEEP").is_some() {
        let d = t.keep();
        eprintln!("keeping {}", d.display());
        (None, d)
    } else {
        let d = t.path().to_owned();
        (Some(t), d)
    };
    let extra: Vec<String> = std::env::var("SPROUT_LAB_REST_ARGS")
        .map(|a| a.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default();
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let h = Hosted::start_with(&lab, &dir.join("data"), 3072, &extra);
    let c = Client::new();
    let shape = json!({"image": "test", "cpus": 1, "memoryMb": 256});

    // The lifecycle: schedule, exec, files, snapshot, fork 2.
    let p = schedule(&c, &h, shape.clone()).await;
    let pv = vm(&c, &h, &p).await;
    assert!(
        pv["hostname"].as_str().unwrap().starts_with("sprout-"),
        "{pv}"
    );
    assert_eq!(
        out(&c, &h, &p, "hostname").await,
        pv["hostname"].as_str().unwrap()
    );
    out(&c, &h, &p, MAKE_TREE).await;
    out(&c, &h, &p, "echo parent > /workspace/who").await;
    let (st, bg) = call(
        &c,
        &h,
        "POST",
        &format!("/v1/runtime/vms/{p}/exec"),
        json!({"command": "/bin/sh", "argv": ["-c", COUNTER], "background": true}),
    )
    .await;
    assert_eq!(st, 201, "{bg}");
    counting(&c, &h, &p).await;
    let snap = op(&c, &h, &p, "snapshot", json!({})).await;
    assert_eq!(snap["state"], "running");
    let f = op(&c, &h, &p, "fork", json!({"count": 2})).await;
    let kids: Vec<String> = f["forks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| {
            assert_eq!(k["state"], "running", "{f}");
            k["vmId"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(kids.len(), 2);
    let mut ids = vec![identity(&c, &h, &p).await];
    // A sandbox's machine id is its id (each child has its own, below).
    let machine_id = |id: &str| id.replace('-', "");
    assert_eq!(ids[0].1, machine_id(&p), "{ids:?}");
    for (i, k) in kids.iter().enumerate() {
        assert_eq!(vm(&c, &h, k).await["parentVmId"], p.as_str());
        assert_eq!(out(&c, &h, k, "cat /workspace/who").await, "parent");
        assert_eq!(out(&c, &h, k, CHECK_TREE).await, "intact");
        // The parent's processes came along, count on in each child, and
        // their output streams can be attached there.
        let n = counting(&c, &h, k).await;
        attach_sees_ticks(&c, &h, k, bg["execId"].as_u64().unwrap(), n).await;
        out(&c, &h, k, &format!("echo child{i} > /workspace/who")).await;
        ids.push(identity(&c, &h, k).await);
        assert_eq!(ids[i + 1].1, machine_id(k), "{ids:?}");
    }
    // Writes stay private.
    assert_eq!(out(&c, &h, &p, "cat /workspace/who").await, "parent");
    assert_eq!(out(&c, &h, &kids[0], "cat /workspace/who").await, "child0");
    assert_eq!(out(&c, &h, &kids[1], "cat /workspace/who").await, "child1");
    for a in 0..ids.len() {
        for b in a + 1..ids.len() {
            assert_ne!(ids[a].0, ids[b].0, "host names {ids:?}");
            assert_ne!(ids[a].1, ids[b].1, "machine ids {ids:?}");
            assert_ne!(ids[a].2, ids[b].2, "urandom {ids:?}");
        }
    }
    for k in &kids {
        let (st, v) = call(&c, &h, "DELETE", &format!("/v1/runtime/vms/{k}"), json!({})).await;
        assert_eq!(st, 200, "{v}");
    }

    // Pause: exec is 409 paused, and does not wake it; resume.
    op(&c, &h, &p, "pause", json!({})).await;
    let (st, v) = sh(&c, &h, &p, "true").await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (409, Some("paused")),
        "{v}"
    );
    assert_eq!(vm(&c, &h, &p).await["state"], "paused");
    op(&c, &h, &p, "resume", json!({})).await;

    // 10 pause/resume and 10 sleep/wake cycles: files intact, the counter
    // counting, after each. A sleeping sandbox is woken by the exec itself.
    let host = vm(&c, &h, &p).await["hostname"].clone();
    let mut last = 0;
    for i in 0..10 {
        op(&c, &h, &p, "pause", json!({})).await;
        op(&c, &h, &p, "resume", json!({})).await;
        assert_eq!(
            out(&c, &h, &p, CHECK_TREE).await,
            "intact",
            "pause cycle {i}"
        );
        let n = counting(&c, &h, &p).await;
        assert!(n > last, "the counter went back: {n} after {last}");
        last = n;
    }
    for i in 0..10 {
        let v = op(&c, &h, &p, "sleep", json!({})).await;
        assert_eq!(v["state"], "sleeping");
        assert!(v["workerPid"].is_null());
        // One call, a slower answer, never an error.
        assert_eq!(
            out(&c, &h, &p, CHECK_TREE).await,
            "intact",
            "sleep cycle {i}"
        );
        let v = vm(&c, &h, &p).await;
        assert_eq!(v["state"], "running");
        assert_eq!(v["hostname"], host, "the host name stays");
        let n = counting(&c, &h, &p).await;
        assert!(n > last, "the counter went back: {n} after {last}");
        last = n;
    }
    assert_eq!(out(&c, &h, &p, "hostname").await, host.as_str().unwrap());
    // So does its machine id: the same machine, woken (systemd's journal,
    // D-Bus and whatever else keys on it see no new machine).
    assert_eq!(out(&c, &h, &p, "cat /etc/machine-id").await, machine_id(&p));
    let exec_id = bg["execId"].as_u64().unwrap();
    attach_sees_ticks(&c, &h, &p, exec_id, last).await;
    // The background process is still listed and attached to its exec id.
    let (_, procs) = call(
        &c,
        &h,
        "GET",
        &format!("/v1/runtime/vms/{p}/processes"),
        json!({}),
    )
    .await;
    assert!(
        procs["processes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["execId"] == bg["execId"] && x["running"] == true),
        "{procs}"
    );

    // Hibernate: the worker goes; wake: same id, files, counter.
    let before = vm(&c, &h, &p).await["workerPid"].clone();
    let v = op(&c, &h, &p, "hibernate", json!({})).await;
    assert_eq!(v["state"], "hibernated");
    assert!(v["workerPid"].is_null());
    let (st, v) = sh(&c, &h, &p, "true").await;
    assert_eq!(st, 409, "a hibernated sandbox is not woken by an exec: {v}");
    assert_eq!(v["error"]["state"], "hibernated");
    let w = op(&c, &h, &p, "wake", json!({})).await;
    assert_eq!(w["coldBoot"], false, "{w}");
    assert_eq!(w["vm"]["vmId"], p.as_str());
    assert_ne!(w["vm"]["workerPid"], before);
    assert_eq!(out(&c, &h, &p, CHECK_TREE).await, "intact");
    assert_eq!(out(&c, &h, &p, "cat /etc/machine-id").await, machine_id(&p));
    let n = counting(&c, &h, &p).await;
    attach_sees_ticks(&c, &h, &p, exec_id, n).await;

    // Checkpoint, change, restore in place: as it was; spawn from it.
    let (st, cp) = call(
        &c,
        &h,
        "POST",
        &format!("/v1/runtime/vms/{p}/checkpoints"),
        json!({"name": "before"}),
    )
    .await;
    assert_eq!(st, 201, "{cp}");
    let cp = cp["snapshotId"].as_str().unwrap().to_owned();
    out(
        &c,
        &h,
        &p,
        "echo changed > /workspace/who; rm /workspace/tree/f1",
    )
    .await;
    let (st, v) = call(
        &c,
        &h,
        "POST",
        &format!("/v1/runtime/checkpoints/{cp}/restore"),
        json!({}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(out(&c, &h, &p, "cat /workspace/who").await, "parent");
    assert_eq!(out(&c, &h, &p, CHECK_TREE).await, "intact");
    let (st, sp) = call(
        &c,
        &h,
        "POST",
        &format!("/v1/runtime/checkpoints/{cp}/spawn"),
        json!({}),
    )
    .await;
    assert_eq!(st, 201, "{sp}");
    let sp = sp["vmId"].as_str().unwrap().to_owned();
    assert_eq!(out(&c, &h, &sp, "cat /workspace/who").await, "parent");
    assert_eq!(out(&c, &h, &sp, CHECK_TREE).await, "intact");
    assert_ne!(identity(&c, &h, &sp).await.0, identity(&c, &h, &p).await.0);
    call(
        &c,
        &h,
        "DELETE",
        &format!("/v1/runtime/vms/{sp}"),
        json!({}),
    )
    .await;

    // Reboot: files kept, the counter gone.
    out(&c, &h, &p, "echo kept > /workspace/kept").await;
    let v = op(&c, &h, &p, "reboot", json!({})).await;
    assert_eq!(v["state"], "running", "{v}");
    assert_eq!(out(&c, &h, &p, "cat /workspace/kept").await, "kept");
    assert_eq!(out(&c, &h, &p, CHECK_TREE).await, "intact");
    let (_, v) = sh(&c, &h, &p, "cat /tmp/counter").await;
    assert_ne!(v["exitCode"], 0, "memory is gone after a reboot: {v}");
    call(&c, &h, "DELETE", &format!("/v1/runtime/vms/{p}"), json!({})).await;

    // Idle timeout 5 s: asleep within 10 s of its last call; not while a
    // 20 s exec runs; the next exec wakes it and answers.
    let mut idle_shape = shape.clone();
    idle_shape["idleTimeoutSecs"] = json!(5);
    let q = schedule(&c, &h, idle_shape).await;
    out(&c, &h, &q, "echo idle > /workspace/i").await;
    let t = Instant::now();
    while vm(&c, &h, &q).await["state"] != "sleeping" {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "not asleep 10 s after its last call"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let t = Instant::now();
    let (st, v) = sh(&c, &h, &q, "sleep 20; cat /workspace/i").await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["stdout"], "idle\n");
    assert!(t.elapsed() >= Duration::from_secs(20));
    // It ran 20 s with a 5 s timeout: it was never put to sleep under it
    // (a sleep would have cut the exec off).
    assert_eq!(v["exitCode"], 0, "{v}");
    // A guest that computes is busy: a busy loop started in the background
    // (no call runs) keeps it awake three times its timeout; once the loop
    // is killed, it sleeps on time.
    let (st, v) = call(
        &c,
        &h,
        "POST",
        &format!("/v1/runtime/vms/{q}/exec"),
        json!({"command": "/bin/sh", "argv": ["-c", "while :; do :; done"], "background": true}),
    )
    .await;
    assert_eq!(st, 201, "{v}");
    let spin = v["execId"].as_u64().unwrap();
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(15) {
        let v = vm(&c, &h, &q).await;
        assert_eq!(v["state"], "running", "put to sleep while computing: {v}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    op(
        &c,
        &h,
        &q,
        &format!("processes/{spin}/signal"),
        json!({"signal": "KILL"}),
    )
    .await;
    let t = Instant::now();
    while vm(&c, &h, &q).await["state"] != "sleeping" {
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "not asleep 15 s after its computing ended"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    call(&c, &h, "DELETE", &format!("/v1/runtime/vms/{q}"), json!({})).await;

    let (_, snaps) = call(&c, &h, "GET", "/v1/runtime/snapshots", json!({})).await;
    for s in snaps["snapshots"].as_array().unwrap() {
        let id = s["snapshotId"].as_str().unwrap();
        call(
            &c,
            &h,
            "DELETE",
            &format!("/v1/runtime/snapshots/{id}"),
            json!({}),
        )
        .await;
    }
    let st = h.interrupt();
    assert!(st.success(), "{st}");
}
