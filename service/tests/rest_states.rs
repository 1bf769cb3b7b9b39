//! Rest states through the API on this host: a real `sproutd` (workers
//! jailed when run as root, as here and in CI) with sandboxes of Sprout's
//! test guest, whose vsock echo port (1234) shows from the host that a VM
//! runs, and runs the memory it was snapshotted with. The Linux path (exec
//! wakes, files and processes across every state) is in the lab:
//! service/tests/lab_rest.rs.

mod common;
use common::*;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use reqwest::{Client, StatusCode};
use serde_json::{json, Value};

async fn get(c: &Client, d: &Daemon, path: &str) -> Value {
    let r = c.get(d.url(path)).send().await.unwrap();
    let st = r.status();
    let v: Value = r.json().await.unwrap();
    assert!(st.is_success(), "GET {path}: {st} {v}");
    v
}

/// POSTs `body` to `/v1/runtime/vms/{id}/{op}`, expecting a success.
async fn op(c: &Client, d: &Daemon, id: &str, op: &str, body: Value) -> Value {
    let r = post(c, d, &format!("/v1/runtime/vms/{id}/{op}"), body).await;
    let st = r.status();
    let v: Value = r.json().await.unwrap();
    assert!(
        st.is_success(),
        "{op} of {id}: {st} {v}\n{}",
        Daemon::log(&d.data_dir)
    );
    v
}

async fn vm(c: &Client, d: &Daemon, id: &str) -> Value {
    get(c, d, &format!("/v1/runtime/vms/{id}")).await
}

fn uds(d: &Daemon, id: &str) -> PathBuf {
    d.data_dir.join("vms").join(id).join("vm/vsock.sock")
}

/// The sandbox's VM answers on its vsock echo port.
fn answers(d: &Daemon, id: &str, msg: &str) {
    assert_eq!(vsock_echo(&uds(d, id), msg.as_bytes()), msg.as_bytes());
}

fn pid(v: &Value) -> u64 {
    v["workerPid"]
        .as_u64()
        .unwrap_or_else(|| panic!("no worker: {v}"))
}

/// The snapshots under the data directory's `snapshots/`, each
/// `<tenant>/<sandbox>/<id>`: their ids.
fn snapshot_dirs(d: &Daemon) -> Vec<String> {
    snapshot_paths(d)
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect()
}

fn snapshot_paths(d: &Daemon) -> Vec<PathBuf> {
    let sub = |p: &std::path::Path| -> Vec<PathBuf> {
        match std::fs::read_dir(p) {
            Ok(rd) => rd.map(|e| e.unwrap().path()).collect(),
            Err(_) => Vec::new(),
        }
    };
    let mut out = Vec::new();
    for t in sub(&d.data_dir.join("snapshots")) {
        for v in sub(&t) {
            out.extend(sub(&v));
        }
    }
    out
}

/// Snapshot `id`'s directory (its `s` holds the files).
fn snapshot_path(d: &Daemon, id: &str) -> PathBuf {
    snapshot_paths(d)
        .into_iter()
        .find(|p| p.file_name().is_some_and(|n| n == id))
        .unwrap_or_else(|| panic!("no snapshot directory of {id}"))
}

/// Every rest state of one sandbox in a row, each checked from the API, the
/// worker processes and the VM's own vsock; forks and forks of forks;
/// checkpoints; and at the end nothing left on disk.
#[tokio::test]
async fn a_sandbox_goes_through_every_rest_state_and_leaves_nothing_behind() {
    let (_t, dir) = data_dir();
    let c = Client::new();
    let d = Daemon::start(&dir);
    let (id, pid0) = schedule_testguest(&c, &d).await;
    answers(&d, &id, "booted");

    // Pause: the worker holds a paused VM; its vsock does not echo.
    let v = op(&c, &d, &id, "pause", json!({})).await;
    assert_eq!(v["state"], "paused");
    assert_eq!(pid(&v), pid0);
    let v = op(&c, &d, &id, "resume", json!({})).await;
    assert_eq!(v["state"], "running");
    answers(&d, &id, "resumed");

    // A snapshot that leaves it paused; listed; a second one is a diff.
    let v = op(&c, &d, &id, "snapshot", json!({"leavePaused": true})).await;
    assert_eq!(v["state"], "paused");
    assert_eq!(v["vmId"], id.as_str());
    let snap1 = v["snapshotId"].as_str().unwrap().to_owned();
    assert_eq!(vm(&c, &d, &id).await["state"], "paused");
    op(&c, &d, &id, "resume", json!({})).await;
    let v = op(&c, &d, &id, "snapshot", json!({})).await;
    assert_eq!(v["state"], "running");
    let snap2 = v["snapshotId"].as_str().unwrap().to_owned();
    let s2 = get(&c, &d, &format!("/v1/runtime/snapshots/{snap2}")).await;
    assert_eq!(s2["parentSnapshotId"], snap1.as_str(), "{s2}");
    assert_eq!(s2["kind"], "user");
    assert_eq!(
        (s2["cpus"].as_u64(), s2["memoryMb"].as_u64()),
        (Some(1), Some(128))
    );
    let all = get(&c, &d, "/v1/runtime/snapshots").await;
    assert_eq!(all["snapshots"].as_array().unwrap().len(), 2, "{all}");

    // Sleep: the worker is gone, the sandbox says so; wake: a new worker
    // runs the same VM.
    let v = op(&c, &d, &id, "sleep", json!({})).await;
    assert_eq!(v["state"], "sleeping");
    assert!(v["workerPid"].is_null(), "{v}");
    wait_gone(pid0);
    let v = op(&c, &d, &id, "wake", json!({})).await;
    assert_eq!(v["vm"]["state"], "running");
    assert_eq!(v["coldBoot"], false);
    let pid1 = pid(&v["vm"]);
    assert_ne!(pid1, pid0);
    answers(&d, &id, "woken");

    // Hibernate, wake; reboot (the test guest boots afresh).
    let v = op(&c, &d, &id, "hibernate", json!({})).await;
    assert_eq!(v["state"], "hibernated");
    wait_gone(pid1);
    let v = op(&c, &d, &id, "wake", json!({})).await;
    assert_eq!(v["vm"]["state"], "running");
    answers(&d, &id, "after hibernation");
    let pid2 = pid(&v["vm"]);
    let v = op(&c, &d, &id, "reboot", json!({})).await;
    assert_eq!(v["state"], "running");
    assert_ne!(pid(&v), pid2);
    answers(&d, &id, "rebooted");

    // Fork 2: two new sandboxes, each its own worker, answering.
    let v = op(&c, &d, &id, "fork", json!({"count": 2})).await;
    assert_eq!(v["sourceVmId"], id.as_str());
    let forks = v["forks"].as_array().unwrap().clone();
    assert_eq!(forks.len(), 2, "{v}");
    let fork_snap = v["snapshotId"].as_str().unwrap().to_owned();
    let mut kids = Vec::new();
    for f in &forks {
        assert_eq!(f["state"], "running", "{f}");
        let k = f["vmId"].as_str().unwrap().to_owned();
        let kv = vm(&c, &d, &k).await;
        assert_eq!(kv["parentVmId"], id.as_str());
        assert_eq!(kv["snapshotId"], fork_snap.as_str());
        answers(&d, &k, "a child");
        kids.push(k);
    }
    assert_ne!(
        pid(&vm(&c, &d, &kids[0]).await),
        pid(&vm(&c, &d, &kids[1]).await)
    );
    answers(&d, &id, "the parent runs on");
    // Jailed (as root): a child's worker sees its snapshot's chain
    // read-only, and writes only its own vm/.
    if rustix::process::geteuid().as_raw() == 0 {
        let kid = pid(&vm(&c, &d, &kids[0]).await);
        let mounts = std::fs::read_to_string(format!("/proc/{kid}/mountinfo")).unwrap();
        let mut rw = Vec::new();
        let mut snaps = 0;
        for l in mounts.lines() {
            let f: Vec<&str> = l.split(' ').collect();
            let ro = f[5].split(',').any(|o| o == "ro");
            if f[4].contains("/snapshots/") {
                assert!(ro, "a snapshot mounted writable: {l}");
                snaps += 1;
            } else if !ro {
                rw.push(f[4].to_owned());
            }
        }
        assert!(snaps >= 1, "{mounts}");
        let own = dir
            .join("vms")
            .join(&kids[0])
            .join("vm")
            .canonicalize()
            .unwrap();
        assert_eq!(rw, ["/".to_owned(), own.display().to_string()], "{mounts}");
        // Its snapshot's files are root's: the worker cannot change them.
        let snap_dir = snapshot_path(&d, &fork_snap).join("s");
        for e in std::fs::read_dir(&snap_dir).unwrap() {
            let m = std::fs::metadata(e.unwrap().path()).unwrap();
            use std::os::unix::fs::MetadataExt;
            assert_eq!((m.uid(), m.mode() & 0o022), (0, 0));
        }
    }
    // A fork of a fork.
    let v = op(&c, &d, &kids[0], "fork", json!({})).await;
    let grandchild = v["forks"][0]["vmId"].as_str().unwrap().to_owned();
    assert_eq!(v["forks"][0]["state"], "running", "{v}");
    assert_eq!(
        vm(&c, &d, &grandchild).await["parentVmId"],
        kids[0].as_str()
    );
    answers(&d, &grandchild, "a grandchild");

    // A schedule from a snapshot: in its shape; shape fields refused.
    let r = post(
        &c,
        &d,
        "/v1/runtime/schedule",
        json!({"snapshot": snap2, "cpus": 2}),
    )
    .await;
    let msg = assert_error(r, StatusCode::BAD_REQUEST, "invalid_value").await;
    assert!(msg.contains("cpus"), "{msg}");
    let r = post(&c, &d, "/v1/runtime/schedule", json!({"snapshot": uuid()})).await;
    assert_error(r, StatusCode::NOT_FOUND, "snapshot_not_found").await;
    let r = post(
        &c,
        &d,
        "/v1/runtime/schedule",
        json!({"snapshot": snap1, "metadata": {"k": "v"}}),
    )
    .await;
    assert_eq!(r.status(), 201);
    let from: Value = r.json().await.unwrap();
    assert_eq!(from["state"], "running", "{from}");
    assert_eq!(from["snapshotId"], snap1.as_str());
    assert_eq!(from["metadata"]["k"], "v");
    assert_eq!(from["cpus"], 1);
    let from = from["vmId"].as_str().unwrap().to_owned();
    answers(&d, &from, "from a snapshot");

    // Checkpoints: ten, then a clear refusal; restore in place; spawn;
    // delete.
    let mut cps = Vec::new();
    for i in 0..10 {
        let r = post(
            &c,
            &d,
            &format!("/v1/runtime/vms/{from}/checkpoints"),
            json!({"name": format!("cp{i}")}),
        )
        .await;
        assert_eq!(r.status(), 201);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["kind"], "checkpoint");
        assert_eq!(v["name"], format!("cp{i}"));
        cps.push(v["snapshotId"].as_str().unwrap().to_owned());
    }
    let r = post(
        &c,
        &d,
        &format!("/v1/runtime/vms/{from}/checkpoints"),
        json!({"name": "eleventh"}),
    )
    .await;
    assert_error(r, StatusCode::CONFLICT, "too_many_checkpoints").await;
    let list = get(&c, &d, &format!("/v1/runtime/vms/{from}/checkpoints")).await;
    assert_eq!(list["snapshots"].as_array().unwrap().len(), 10);
    let before = pid(&vm(&c, &d, &from).await);
    let r = c
        .post(d.url(&format!("/v1/runtime/checkpoints/{}/restore", cps[3])))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let v = vm(&c, &d, &from).await;
    assert_eq!(v["state"], "running");
    assert_ne!(pid(&v), before, "a new worker");
    answers(&d, &from, "restored in place");
    let r = c
        .post(d.url(&format!("/v1/runtime/checkpoints/{}/spawn", cps[0])))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let spawned: Value = r.json().await.unwrap();
    let spawned = spawned["vmId"].as_str().unwrap().to_owned();
    answers(&d, &spawned, "spawned");
    let r = c
        .delete(d.url(&format!("/v1/runtime/checkpoints/{}", cps[9])))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = c
        .delete(d.url(&format!("/v1/runtime/checkpoints/{}", cps[9])))
        .send()
        .await
        .unwrap();
    assert_error(r, StatusCode::NOT_FOUND, "checkpoint_not_found").await;
    let list = get(&c, &d, &format!("/v1/runtime/vms/{from}/checkpoints")).await;
    assert_eq!(list["snapshots"].as_array().unwrap().len(), 9);
    let r = post(
        &c,
        &d,
        &format!("/v1/runtime/vms/{from}/checkpoints"),
        json!({"name": "tenth again"}),
    )
    .await;
    assert_eq!(r.status(), 201);

    // Metrics of each kind of transition.
    let m = c
        .get(d.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for h in [
        "sproutd_snapshot_seconds_count",
        "sproutd_wake_seconds_count",
        "sproutd_fork_seconds_count",
        "sproutd_restore_seconds_count",
    ] {
        let n: u64 = m
            .lines()
            .find_map(|l| l.strip_prefix(h).map(|v| v.trim().parse().unwrap()))
            .unwrap_or_else(|| panic!("{h} not in {m}"));
        assert!(n >= 1, "{h} {n}");
    }

    // Deleting every sandbox and user snapshot leaves no snapshot file.
    for v in [&id, &kids[0], &kids[1], &grandchild, &from, &spawned] {
        let r = c
            .delete(d.url(&format!("/v1/runtime/vms/{v}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    }
    assert!(!snapshot_dirs(&d).is_empty(), "user snapshots stay");
    for s in get(&c, &d, "/v1/runtime/snapshots").await["snapshots"]
        .as_array()
        .unwrap()
    {
        assert_eq!(s["kind"], "user", "checkpoints go with their sandbox: {s}");
        let r = c
            .delete(d.url(&format!(
                "/v1/runtime/snapshots/{}",
                s["snapshotId"].as_str().unwrap()
            )))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    // What is left is the template's snapshot (kept for later creates).
    let t = get(&c, &d, "/v1/runtime/templates").await;
    let t = &t["templates"][0];
    assert_eq!(
        (t["image"].as_str(), t["state"].as_str()),
        (Some("testguest"), Some("ready")),
        "{t}"
    );
    assert_eq!(snapshot_dirs(&d), [t["snapshotId"].as_str().unwrap()]);
    // sproutd's own; the sandboxes' and their tenant's directories went
    // with their last snapshot.
    assert_eq!(
        names_or_empty(&dir.join("snapshots")),
        ["_sproutd"],
        "{:?}",
        snapshot_paths(&d)
    );
    assert!(names_or_empty(&dir.join("vms")).is_empty());
    // Ready workers wait, one per shape restored in (jailed as root),
    // and go with a graceful stop.
    let ready = names_or_empty(&dir.join("ready"));
    assert_eq!(ready.len(), 1, "{ready:?}");
    if rustix::process::geteuid().as_raw() == 0 {
        assert_eq!(names_or_empty(&dir.join("jails")).len(), 1);
    }
    d.stop();
    assert!(names_or_empty(&dir.join("ready")).is_empty());
    assert!(names_or_empty(&dir.join("jails")).is_empty());
}

fn names_or_empty(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn uuid() -> String {
    "0b3ae0d4-9f50-4d38-a7a3-1c2b3d4e5f60".into()
}

fn wait_gone(pid: u64) {
    let t = Instant::now();
    while alive(pid) {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "worker {pid} still runs"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Checks that `r` is a 409 naming `state`, with `code`.
async fn assert_409(r: reqwest::Response, code: &str, state: &str, what: &str) {
    let st = r.status();
    let v: Value = r.json().await.unwrap();
    assert_eq!(st, 409, "{what}: {v}");
    assert_eq!(v["error"]["code"], code, "{what}: {v}");
    assert_eq!(v["error"]["state"], state, "{what}: {v}");
}

/// Every transition a state does not allow is 409 with that state, and
/// leaves the sandbox as it was.
#[tokio::test]
async fn every_impossible_transition_is_409_with_the_current_state() {
    let (_t, dir) = data_dir();
    let c = Client::new();
    let d = Daemon::start(&dir);
    let (id, _) = schedule_testguest(&c, &d).await;
    // (state to put it in, how, the operations it refuses)
    let table: [(&str, &[&str], &[&str]); 4] = [
        ("running", &[], &["resume", "wake"]),
        ("paused", &["pause"], &["pause", "sleep", "wake"]),
        (
            "sleeping",
            &["sleep"],
            &[
                "pause",
                "resume",
                "sleep",
                "snapshot",
                "fork",
                "checkpoints",
            ],
        ),
        (
            "hibernated",
            &["hibernate"],
            &[
                "pause",
                "resume",
                "sleep",
                "hibernate",
                "snapshot",
                "fork",
                "checkpoints",
            ],
        ),
    ];
    for (state, how, refused) in table {
        for h in how {
            op(&c, &d, &id, h, json!({})).await;
        }
        assert_eq!(vm(&c, &d, &id).await["state"], state);
        for o in refused {
            let body = if *o == "checkpoints" {
                json!({"name": "x"})
            } else {
                json!({})
            };
            let r = post(&c, &d, &format!("/v1/runtime/vms/{id}/{o}"), body).await;
            assert_409(r, "invalid_state", state, &format!("{o} when {state}")).await;
            assert_eq!(vm(&c, &d, &id).await["state"], state, "after {o}");
        }
        // Back to running for the next row.
        match state {
            "paused" => {
                op(&c, &d, &id, "resume", json!({})).await;
            }
            "sleeping" | "hibernated" => {
                op(&c, &d, &id, "wake", json!({})).await;
            }
            _ => {}
        }
        answers(&d, &id, state);
    }
    // Failed (its worker killed): everything but a delete is refused.
    let p = pid(&vm(&c, &d, &id).await);
    std::process::Command::new("kill")
        .args(["-9", &p.to_string()])
        .status()
        .unwrap();
    let t = Instant::now();
    while vm(&c, &d, &id).await["state"] != "failed" {
        assert!(t.elapsed() < Duration::from_secs(60), "not failed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for o in [
        "pause",
        "resume",
        "sleep",
        "hibernate",
        "wake",
        "reboot",
        "snapshot",
        "fork",
    ] {
        let r = post(&c, &d, &format!("/v1/runtime/vms/{id}/{o}"), json!({})).await;
        assert_409(r, "invalid_state", "failed", o).await;
    }
    let r = c
        .delete(d.url(&format!("/v1/runtime/vms/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Unknown sandboxes and bad counts.
    let r = post(
        &c,
        &d,
        &format!("/v1/runtime/vms/{}/pause", uuid()),
        json!({}),
    )
    .await;
    assert_error(r, StatusCode::NOT_FOUND, "vm_not_found").await;
    let (id, _) = schedule_testguest(&c, &d).await;
    for n in [0, 101, -1] {
        let r = post(
            &c,
            &d,
            &format!("/v1/runtime/vms/{id}/fork"),
            json!({"count": n}),
        )
        .await;
        assert_error(r, StatusCode::BAD_REQUEST, "invalid_value").await;
    }
    let r = post(
        &c,
        &d,
        &format!("/v1/runtime/vms/{id}/checkpoints"),
        json!({"name": ""}),
    )
    .await;
    assert_error(r, StatusCode::BAD_REQUEST, "invalid_value").await;
    let r = c
        .post(d.url(&format!("/v1/runtime/checkpoints/{}/restore", uuid())))
        .send()
        .await
        .unwrap();
    assert_error(r, StatusCode::NOT_FOUND, "checkpoint_not_found").await;
    d.stop();
}

/// Pause, resume, snapshot and fork fired at one sandbox all at once: each
/// is answered (done, or 409 with the state it met), none is a 5xx, and
/// the sandbox is usable after, in the state the API says.
#[tokio::test]
async fn concurrent_transitions_on_one_sandbox_leave_it_usable() {
    let (_t, dir) = data_dir();
    let c = Client::new();
    let d = Daemon::start(&dir);
    let (id, _) = schedule_testguest(&c, &d).await;
    let ops = [
        "pause", "resume", "fork", "snapshot", "pause", "resume", "sleep", "wake", "resume", "fork",
    ];
    let mut tasks = Vec::new();
    for (i, o) in ops.iter().cycle().take(20).enumerate() {
        let (c, url, o) = (
            c.clone(),
            d.url(&format!("/v1/runtime/vms/{id}/{o}")),
            o.to_string(),
        );
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis((i % 4) as u64 * 5)).await;
            let r = c.post(url).json(&json!({})).send().await.unwrap();
            (o, r.status().as_u16(), r.text().await.unwrap())
        }));
    }
    let mut kids = Vec::new();
    for t in tasks {
        let (o, st, body) = t.await.unwrap();
        assert!(
            matches!(st, 200 | 201 | 409),
            "{o}: {st} {body}\n{}",
            Daemon::log(&d.data_dir)
        );
        if o == "fork" && st == 201 {
            let v: Value = serde_json::from_str(&body).unwrap();
            for f in v["forks"].as_array().unwrap() {
                assert_eq!(f["state"], "running", "{f}");
                kids.push(f["vmId"].as_str().unwrap().to_owned());
            }
        }
    }
    // Whatever state it ended in, it is that state, and it runs once woken
    // or resumed.
    let v = vm(&c, &d, &id).await;
    match v["state"].as_str().unwrap() {
        "paused" => {
            op(&c, &d, &id, "resume", json!({})).await;
        }
        "sleeping" => {
            op(&c, &d, &id, "wake", json!({})).await;
        }
        "running" => {}
        other => panic!("ended {other}: {v}"),
    }
    answers(&d, &id, "still usable");
    for k in &kids {
        answers(&d, k, "a child of the storm");
    }
    d.stop();
}

/// `idleTimeoutSecs`: a sandbox with no activity is put to sleep within
/// seconds; one without the setting never is.
#[tokio::test]
async fn an_idle_sandbox_sleeps_within_seconds_of_its_timeout() {
    let (_t, dir) = data_dir();
    let c = Client::new();
    let d = Daemon::start(&dir);
    let idle = schedule(
        &c,
        &d,
        json!({"image": "testguest", "cpus": 1, "memoryMb": 128, "idleTimeoutSecs": 2}),
    )
    .await;
    let idle = idle["vmId"].as_str().unwrap().to_owned();
    let (busy, _) = schedule_testguest(&c, &d).await;
    let t = Instant::now();
    while vm(&c, &d, &idle).await["state"] != "sleeping" {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "not asleep: {}",
            vm(&c, &d, &idle).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took = t.elapsed();
    assert!(
        took >= Duration::from_secs(1),
        "slept after {took:?}, before its timeout"
    );
    assert_eq!(vm(&c, &d, &busy).await["state"], "running");
    // Woken, it sleeps again when idle again.
    op(&c, &d, &idle, "wake", json!({})).await;
    answers(&d, &idle, "awake again");
    let t = Instant::now();
    while vm(&c, &d, &idle).await["state"] != "sleeping" {
        assert!(t.elapsed() < Duration::from_secs(30), "not asleep again");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    d.stop();
}

/// Flips a byte of the memory layer of the one snapshot not in `before`:
/// it no longer verifies.
fn damage_the_new_snapshot(d: &Daemon, before: &std::collections::BTreeSet<String>) {
    let after: Vec<String> = snapshot_dirs(d)
        .into_iter()
        .filter(|s| !before.contains(s))
        .collect();
    assert_eq!(after.len(), 1, "one new snapshot: {after:?}");
    let snap = snapshot_path(d, &after[0]).join("s");
    let mem = std::fs::read_dir(&snap)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("memory")
                && p.metadata().unwrap().len() > 0
        })
        .unwrap_or_else(|| panic!("no memory layer in {}", snap.display()));
    let mut bytes = std::fs::read(&mem).unwrap();
    let at = bytes.iter().position(|b| *b != 0).unwrap_or(0);
    bytes[at] ^= 0xff;
    std::fs::write(&mem, bytes).unwrap();
}

/// A hibernated sandbox whose memory snapshot no longer verifies is woken
/// by a cold boot from its disk, and the answer says so and why. A sleeping
/// one is not failed for it: its wake is refused, saying why, and it is
/// hibernated, whose wake then boots its disk.
#[tokio::test]
async fn a_wake_whose_snapshot_is_damaged_cold_boots_and_says_so() {
    let (_t, dir) = data_dir();
    let c = Client::new();
    let d = Daemon::start(&dir);
    let (id, _) = schedule_testguest(&c, &d).await;
    let before = snapshot_dirs(&d).into_iter().collect();
    op(&c, &d, &id, "hibernate", json!({})).await;
    damage_the_new_snapshot(&d, &before);
    let v = op(&c, &d, &id, "wake", json!({})).await;
    assert_eq!(v["coldBoot"], true, "{v}");
    assert!(!v["coldBootReason"].as_str().unwrap().is_empty(), "{v}");
    assert_eq!(v["vm"]["state"], "running");
    answers(&d, &id, "cold booted");

    let (id, _) = schedule_testguest(&c, &d).await;
    let before = snapshot_dirs(&d).into_iter().collect();
    op(&c, &d, &id, "sleep", json!({})).await;
    damage_the_new_snapshot(&d, &before);
    let r = post(&c, &d, &format!("/v1/runtime/vms/{id}/wake"), json!({})).await;
    assert_eq!(r.status(), 502);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "snapshot_failed", "{e}");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("Cannot restore its memory") && msg.contains("hibernated now"),
        "{msg}"
    );
    let v = vm(&c, &d, &id).await;
    assert_eq!(v["state"], "hibernated", "{v}");
    assert!(
        v["failureReason"]
            .as_str()
            .is_some_and(|r| r.contains("Cannot restore its memory")),
        "{v}"
    );
    let v = op(&c, &d, &id, "wake", json!({})).await;
    assert_eq!(v["coldBoot"], true, "{v}");
    assert_eq!(v["vm"]["state"], "running");
    assert!(v["vm"]["failureReason"].is_null(), "{v}");
    answers(&d, &id, "cold booted from sleep");
    d.stop();
}

/// Ready workers a killed sproutd left are stopped by the next one, and a
/// create from a template takes a ready worker (its worker's log and
/// console move into the sandbox's directory).
#[tokio::test]
async fn ready_workers_are_taken_by_restores_and_a_killed_sproutds_are_stopped() {
    let (_t, dir) = data_dir();
    let c = Client::new();
    let d = Daemon::start(&dir);
    let (a, _) = schedule_testguest(&c, &d).await;
    // The template's shape gets a ready worker.
    let dir2 = dir.clone();
    let waits = |n: usize| {
        let dir = dir2.clone();
        async move {
            let t = Instant::now();
            while Daemon::log(&dir)
                .matches("a ready worker of 1 vCPUs, 128 MiB waits")
                .count()
                < n
            {
                assert!(t.elapsed() < Duration::from_secs(30), "no ready worker");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    // The template's build, then `a`'s restore, each left one waiting.
    waits(2).await;
    let first = names_or_empty(&dir.join("ready"));
    assert_eq!(first.len(), 1, "{first:?}");
    let (b, pid_b) = schedule_testguest(&c, &d).await;
    answers(&d, &b, "restored into a ready worker");
    // It was the ready one: its directory is gone, its files moved in.
    let sock = dir.join("ready").join(&first[0]).join("control.sock");
    assert!(!sock.exists(), "{}", sock.display());
    let vm_dir = dir.join("vms").join(&b);
    assert!(vm_dir.join("worker.log").exists() && vm_dir.join("control.sock").exists());
    assert!(alive(pid_b));
    // A replacement comes; then sproutd dies by kill -9.
    waits(3).await;
    let left = names_or_empty(&dir.join("ready"));
    let left_sock = dir.join("ready").join(&left[0]).join("control.sock");
    assert!(std::os::unix::net::UnixStream::connect(&left_sock).is_ok());
    d.kill9();
    let d = Daemon::start(&dir);
    assert!(
        !dir.join("ready").join(&left[0]).exists(),
        "the left ready worker is gone"
    );
    assert!(std::os::unix::net::UnixStream::connect(&left_sock).is_err());
    // The sandboxes were re-adopted and run.
    answers(&d, &a, "re-adopted");
    answers(&d, &b, "re-adopted too");
    d.stop();
}

/// A fork of 12 (more than restore at once): every child runs, answers on
/// its own vsock, and has its own worker.
#[tokio::test]
async fn a_fork_of_twelve_starts_every_child() {
    let (_t, dir) = data_dir();
    let c = Client::new();
    let d = Daemon::start(&dir);
    let (id, _) = schedule_testguest(&c, &d).await;
    let v = op(&c, &d, &id, "fork", json!({"count": 12})).await;
    let forks = v["forks"].as_array().unwrap();
    assert_eq!(forks.len(), 12, "{v}");
    let mut pids = std::collections::BTreeSet::new();
    for f in forks {
        assert_eq!(f["state"], "running", "{f}");
        let k = f["vmId"].as_str().unwrap();
        answers(&d, k, "one of twelve");
        pids.insert(pid(&vm(&c, &d, k).await));
    }
    assert_eq!(pids.len(), 12);
    for f in forks {
        let k = f["vmId"].as_str().unwrap();
        let r = c
            .delete(d.url(&format!("/v1/runtime/vms/{k}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    d.stop();
}
