//! The snapshot store through the API: a real `sproutd` whose snapshots
//! are mirrored to a real S3-compatible server process on loopback
//! (moto's, installed by tests/s3/install.sh), with sandboxes of Sprout's
//! test guest; and retention (docs/api.md, "The snapshot store").

mod common;
use common::s3::{BUCKET, CREDS, S3};
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

async fn snapshot(c: &Client, d: &Daemon, vm: &str) -> String {
    let r = post(c, d, &format!("/v1/runtime/vms/{vm}/snapshot"), json!({})).await;
    let st = r.status();
    let v: Value = r.json().await.unwrap();
    assert_eq!(st, 201, "{v}\n{}", Daemon::log(&d.data_dir));
    v["snapshotId"].as_str().unwrap().to_owned()
}

/// Takes checkpoint `name` of `vm`.
async fn checkpoint(c: &Client, d: &Daemon, vm: &str, name: &str) {
    let r = post(
        c,
        d,
        &format!("/v1/runtime/vms/{vm}/checkpoints"),
        json!({ "name": name }),
    )
    .await;
    assert_eq!(r.status(), 201, "{}", Daemon::log(&d.data_dir));
}

/// Waits until snapshot `id` is `durable`.
async fn durable(c: &Client, d: &Daemon, id: &str) {
    let t = Instant::now();
    loop {
        let v = get(c, d, &format!("/v1/runtime/snapshots/{id}")).await;
        if v["durable"] == true {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "{id} never became durable: {v}\n{}",
            Daemon::log(&d.data_dir)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn uds(d: &Daemon, id: &str) -> PathBuf {
    d.data_dir.join("vms").join(id).join("vm/vsock.sock")
}

/// Uploads after durable; a store that is down fails no snapshot, which
/// goes up once it is back; a snapshot whose local copy is gone is
/// restored from the store after verification, and a corrupted one is
/// refused.
#[tokio::test]
async fn snapshots_go_to_the_object_store_and_come_back_from_it() {
    let (_t, dir) = data_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let s3 = S3::start(0).await;
    let ep = s3.endpoint();
    let d = Daemon::start_env(&dir, &["--s3-endpoint", &ep, "--s3-bucket", BUCKET], &CREDS);
    let c = Client::new();
    let (vm, _) = schedule_testguest(&c, &d).await;

    // A snapshot: durable once its objects are in the store, each file
    // and the completion last.
    let a = snapshot(&c, &d, &vm).await;
    durable(&c, &d, &a).await;
    let keys = s3.keys(&format!("default/{vm}/{a}/")).await;
    for f in ["manifest.json", "state.bin", "complete.json"] {
        assert!(
            keys.contains(&format!("default/{vm}/{a}/{f}")),
            "{f} not in {keys:?}"
        );
    }
    assert!(
        !keys.iter().any(|k| k.ends_with(".sealed")),
        "the local seal is not uploaded: {keys:?}"
    );

    // Its local copy is laid out as its objects are: tenant, sandbox,
    // snapshot.
    let local = dir.join("snapshots/default").join(&vm).join(&a);
    assert!(
        local.join("s/manifest.json").is_file(),
        "{}",
        local.display()
    );
    // Its local copy deleted: a schedule from it downloads, verifies and
    // runs it.
    std::fs::remove_dir_all(&local).unwrap();
    let v = schedule(&c, &d, json!({"snapshot": a})).await;
    let child = v["vmId"].as_str().unwrap().to_owned();
    assert_eq!(v["state"], "running", "{v}");
    assert_eq!(vsock_echo(&uds(&d, &child), b"back"), b"back");
    assert!(local.join("s/manifest.json").is_file());
    assert!(
        Daemon::log(&dir).contains("downloaded from the object store and verified"),
        "{}",
        Daemon::log(&dir)
    );

    // Gone again, and its device state corrupted in the store (same size): it
    // does not verify, so no sandbox is made of it, and nothing is left.
    std::fs::remove_dir_all(&local).unwrap();
    let mem_key = format!("default/{vm}/{a}/state.bin");
    s3.corrupt(&mem_key);
    let r = post(&c, &d, "/v1/runtime/schedule", json!({"snapshot": a})).await;
    let m = assert_error(r, StatusCode::BAD_GATEWAY, "snapshot_failed").await;
    assert!(m.contains("does not verify"), "{m}");
    assert!(!local.join("s").exists(), "a bad download was kept");

    // The store down: a snapshot still succeeds, not durable; once the
    // store is back it goes up.
    let port = s3.stop();
    let b = snapshot(&c, &d, &vm).await;
    let v = get(&c, &d, &format!("/v1/runtime/snapshots/{b}")).await;
    assert_eq!(v["durable"], false, "{v}");
    let t = Instant::now();
    while !Daemon::log(&dir).contains("uploading snapshots to") {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "no failed upload logged"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let s3 = S3::start(port).await;
    durable(&c, &d, &b).await;
    let keys = s3.keys(&format!("default/{vm}/{b}/")).await;
    assert!(
        keys.contains(&format!("default/{vm}/{b}/complete.json")),
        "{keys:?}"
    );
}

fn user_snapshots(list: &Value) -> Vec<String> {
    list["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["kind"] == "user")
        .map(|s| s["snapshotId"].as_str().unwrap().to_owned())
        .collect()
}

/// Retention keeps the newest 3 user snapshots of a sandbox, and never
/// one that a checkpoint builds on.
#[tokio::test]
async fn retention_keeps_three_and_what_a_checkpoint_builds_on() {
    let (_t, dir) = data_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let d = Daemon::start(&dir);
    let c = Client::new();
    let (vm, _) = schedule_testguest(&c, &d).await;
    let s1 = snapshot(&c, &d, &vm).await;
    checkpoint(&c, &d, &vm, "on s1").await;
    let mut later = Vec::new();
    for _ in 0..4 {
        later.push(snapshot(&c, &d, &vm).await);
    }
    let kept = user_snapshots(&get(&c, &d, "/v1/runtime/snapshots").await);
    // s1: under the checkpoint; then the newest three.
    let want = vec![
        s1.clone(),
        later[1].clone(),
        later[2].clone(),
        later[3].clone(),
    ];
    assert_eq!(kept, want);
    let r = c
        .get(d.url(&format!("/v1/runtime/snapshots/{}", later[0])))
        .send()
        .await
        .unwrap();
    assert_error(r, StatusCode::NOT_FOUND, "snapshot_not_found").await;
    // Without an object store there is no archive.
    let r = post(&c, &d, &format!("/v1/runtime/vms/{vm}/archive"), json!({})).await;
    let m = assert_error(r, StatusCode::BAD_REQUEST, "not_supported").await;
    assert!(m.contains("--s3-endpoint"), "{m}");
    // What is kept still restores (the deleted one's files stay while a
    // later snapshot builds on them).
    let v = schedule(&c, &d, json!({"snapshot": later[1]})).await;
    let kid = v["vmId"].as_str().unwrap().to_owned();
    assert_eq!(vsock_echo(&uds(&d, &kid), b"kept"), b"kept");
}

/// Retention by age needs no new snapshot: a user snapshot past
/// `--keep-days` goes when sproutd starts (and hourly), one a checkpoint
/// builds on stays.
#[tokio::test]
async fn snapshots_past_keep_days_go_without_a_new_snapshot() {
    let (_t, dir) = data_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let d = Daemon::start(&dir);
    let c = Client::new();
    let (vm, _) = schedule_testguest(&c, &d).await;
    let kept = snapshot(&c, &d, &vm).await;
    checkpoint(&c, &d, &vm, "on kept").await;
    let old = snapshot(&c, &d, &vm).await;
    let new = snapshot(&c, &d, &vm).await;
    d.stop();
    // Eight days older, both (the default keeps seven): as if sproutd had
    // been down that long.
    {
        let db = rusqlite::Connection::open(dir.join("registry.db")).unwrap();
        let n = db
            .execute(
                "UPDATE snapshots SET created_ms = created_ms - 8 * 86400000 \
                 WHERE id IN (?1, ?2)",
                [&old, &kept],
            )
            .unwrap();
        assert_eq!(n, 2);
    }
    let d = Daemon::start(&dir);
    let t = Instant::now();
    loop {
        let r = c
            .get(d.url(&format!("/v1/runtime/snapshots/{old}")))
            .send()
            .await
            .unwrap();
        if r.status() == StatusCode::NOT_FOUND {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{old} was not deleted\n{}",
            Daemon::log(&dir)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The one the checkpoint builds on and the new one stay.
    let left = user_snapshots(&get(&c, &d, "/v1/runtime/snapshots").await);
    assert_eq!(left, [kept, new]);
}

/// Survives node loss: archived on node A (its own data directory), A's
/// whole data directory deleted, unarchived on node B, which shares only
/// the object store: the same sandbox, its VM running on from the memory
/// it was archived with.
#[tokio::test]
async fn a_sandbox_archived_on_one_node_is_unarchived_on_another() {
    let (t, _) = data_dir();
    let (dir_a, dir_b) = (t.path().join("a"), t.path().join("b"));
    std::fs::create_dir_all(&dir_a).unwrap();
    std::fs::create_dir_all(&dir_b).unwrap();
    let s3 = S3::start(0).await;
    let ep = s3.endpoint();
    let args = ["--s3-endpoint", ep.as_str(), "--s3-bucket", BUCKET];
    let c = Client::new();

    let a = Daemon::start_env(&dir_a, &args, &CREDS);
    let (vm, _) = schedule_testguest(&c, &a).await;
    assert_eq!(vsock_echo(&uds(&a, &vm), b"on a"), b"on a");
    // A snapshot first: the archive's chain is a diff on it.
    let s1 = snapshot(&c, &a, &vm).await;
    let r = post(&c, &a, &format!("/v1/runtime/vms/{vm}/archive"), json!({})).await;
    let st = r.status();
    let v: Value = r.json().await.unwrap();
    assert_eq!(st, 200, "{v}\n{}", Daemon::log(&dir_a));
    assert_eq!(v["state"], "archived", "{v}");
    assert_eq!(v["workerPid"], Value::Null, "{v}");
    let keys = s3.keys(&format!("default/{vm}/")).await;
    assert!(
        keys.contains(&format!("default/{vm}/archive.json")),
        "{keys:?}"
    );
    assert!(
        !dir_a.join("vms").join(&vm).exists(),
        "the sandbox's local files were freed"
    );
    // An archived sandbox runs nothing until it is unarchived.
    let r = post(&c, &a, &format!("/v1/runtime/vms/{vm}/pause"), json!({})).await;
    assert_error(r, StatusCode::CONFLICT, "invalid_state").await;

    let b = Daemon::start_env(&dir_b, &args, &CREDS);
    let r = c
        .get(b.url(&format!("/v1/runtime/vms/{vm}")))
        .send()
        .await
        .unwrap();
    assert_error(r, StatusCode::NOT_FOUND, "vm_not_found").await;
    let r = post(
        &c,
        &b,
        &format!("/v1/runtime/vms/{vm}/unarchive"),
        json!({}),
    )
    .await;
    let st = r.status();
    let v: Value = r.json().await.unwrap();
    assert_eq!(st, 200, "{v}\n{}", Daemon::log(&dir_b));
    assert_eq!(v["state"], "running", "{v}");
    assert_eq!(v["vmId"], vm.as_str());
    assert_eq!(vsock_echo(&uds(&b, &vm), b"on b"), b"on b");
    // Once: its record is gone from the store, and it runs here.
    assert!(!s3
        .keys(&format!("default/{vm}/"))
        .await
        .contains(&format!("default/{vm}/archive.json")));
    let r = post(
        &c,
        &b,
        &format!("/v1/runtime/vms/{vm}/unarchive"),
        json!({}),
    )
    .await;
    assert_error(r, StatusCode::CONFLICT, "invalid_state").await;
    // Node A, which archived it, knows it was unarchived elsewhere and
    // does not run it twice; its delete there leaves B's objects alone.
    let r = post(
        &c,
        &a,
        &format!("/v1/runtime/vms/{vm}/unarchive"),
        json!({}),
    )
    .await;
    let m = assert_error(r, StatusCode::CONFLICT, "invalid_state").await;
    assert!(m.contains("unarchived elsewhere"), "{m}");
    let before = s3.keys("").await;
    let r = c
        .delete(a.url(&format!("/v1/runtime/vms/{vm}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    a.stop();
    std::fs::remove_dir_all(&dir_a).unwrap();
    assert_eq!(
        s3.keys("").await,
        before,
        "A's delete removed objects B needs"
    );
    // It snapshots on, as a diff on the chain it came back from.
    let s2 = snapshot(&c, &b, &vm).await;
    assert_ne!(s1, s2);
    durable(&c, &b, &s2).await;
    // An unknown id is still unknown.
    let r = post(
        &c,
        &b,
        &format!("/v1/runtime/vms/{}/unarchive", uuid::Uuid::new_v4()),
        json!({}),
    )
    .await;
    assert_error(r, StatusCode::NOT_FOUND, "vm_not_found").await;
    // Archived again on B and deleted there: its record goes first, so no
    // node brings it back.
    let r = post(&c, &b, &format!("/v1/runtime/vms/{vm}/archive"), json!({})).await;
    assert_eq!(r.status(), 200);
    let r = c
        .delete(b.url(&format!("/v1/runtime/vms/{vm}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(!s3
        .keys(&format!("default/{vm}/"))
        .await
        .contains(&format!("default/{vm}/archive.json")));
}

/// An archive frees its tenant's slot; an unarchive needs one (402 when
/// none is free, and it stays archived).
#[tokio::test]
async fn archive_frees_a_slot_and_unarchive_needs_one() {
    let (_t, dir) = data_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let (key, line) = new_key();
    let file = dir.with_extension("tenants.toml");
    std::fs::write(
        &file,
        format!("[[tenant]]\nname = \"one\"\nslots = 1\nkeys = [{line}]\n"),
    )
    .unwrap();
    let s3 = S3::start(0).await;
    let ep = s3.endpoint();
    let d = Daemon::start_env(
        &dir,
        &[
            "--s3-endpoint",
            &ep,
            "--s3-bucket",
            BUCKET,
            "--tenants",
            file.to_str().unwrap(),
        ],
        &CREDS,
    );
    let c = keyed(&key);
    let tg = json!({"image": "testguest", "cpus": 1, "memoryMb": 128});
    let (v1, _) = schedule_testguest(&c, &d).await;
    let r = post(&c, &d, "/v1/runtime/schedule", tg.clone()).await;
    assert_error(r, StatusCode::PAYMENT_REQUIRED, "quota_exhausted").await;
    let r = post(&c, &d, &format!("/v1/runtime/vms/{v1}/archive"), json!({})).await;
    assert_eq!(r.status(), 200);
    let (v2, _) = schedule_testguest(&c, &d).await;
    let r = post(
        &c,
        &d,
        &format!("/v1/runtime/vms/{v1}/unarchive"),
        json!({}),
    )
    .await;
    assert_error(r, StatusCode::PAYMENT_REQUIRED, "quota_exhausted").await;
    assert_eq!(
        get(&c, &d, &format!("/v1/runtime/vms/{v1}")).await["state"],
        "archived"
    );
    let r = c
        .delete(d.url(&format!("/v1/runtime/vms/{v2}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = post(
        &c,
        &d,
        &format!("/v1/runtime/vms/{v1}/unarchive"),
        json!({}),
    )
    .await;
    let st = r.status();
    let v: Value = r.json().await.unwrap();
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["state"], "running");
    assert_eq!(vsock_echo(&uds(&d, &v1), b"one"), b"one");
}

/// Two nodes unarchiving one sandbox: a fresh claim of a third node in its
/// record keeps both away; once that claim is stale, of two unarchives at
/// once, one wins and runs it, the other answers 409 and makes nothing.
#[tokio::test]
async fn of_two_nodes_unarchiving_at_once_one_wins() {
    let (t, _) = data_dir();
    let (dir_a, dir_b) = (t.path().join("a"), t.path().join("b"));
    std::fs::create_dir_all(&dir_a).unwrap();
    std::fs::create_dir_all(&dir_b).unwrap();
    let s3 = S3::start(0).await;
    let ep = s3.endpoint();
    let args = ["--s3-endpoint", ep.as_str(), "--s3-bucket", BUCKET];
    let c = Client::new();
    let a = Daemon::start_env(&dir_a, &args, &CREDS);
    let b = Daemon::start_env(&dir_b, &args, &CREDS);
    let (vm, _) = schedule_testguest(&c, &a).await;
    let r = post(&c, &a, &format!("/v1/runtime/vms/{vm}/archive"), json!({})).await;
    assert_eq!(r.status(), 200, "{}", Daemon::log(&dir_a));
    let key = format!("default/{vm}/archive.json");
    let claim = |age_ms: u64| {
        s3.boto(&format!(
            "r = json.loads(s3.get_object(Bucket=BUCKET, Key='{key}')['Body'].read())\n\
             r['claim'] = {{'node': 'node-c', 'token': '0b3ae0d4-9f50-4d38-a7a3-1c2b3d4e5f60', \
                 'atMs': int(time.time() * 1000) - {age_ms}}}\n\
             s3.put_object(Bucket=BUCKET, Key='{key}', Body=json.dumps(r).encode())"
        ))
    };
    let unarchive = |d: &Daemon| {
        let url = d.url(&format!("/v1/runtime/vms/{vm}/unarchive"));
        let c = c.clone();
        async move { c.post(url).json(&json!({})).send().await.unwrap() }
    };

    // Node C is bringing it back: neither A nor B does, and B (which
    // would import it) records nothing of it.
    claim(1_000);
    for d in [&a, &b] {
        let m = assert_error(unarchive(d).await, StatusCode::CONFLICT, "invalid_state").await;
        assert!(m.contains("being unarchived by node node-c"), "{m}");
    }
    let r = c
        .get(b.url(&format!("/v1/runtime/vms/{vm}")))
        .send()
        .await
        .unwrap();
    assert_error(r, StatusCode::NOT_FOUND, "vm_not_found").await;
    // Nor is it deleted meanwhile: whether it is still to be had is known
    // once C is done.
    let r = c
        .delete(a.url(&format!("/v1/runtime/vms/{vm}")))
        .send()
        .await
        .unwrap();
    let m = assert_error(r, StatusCode::CONFLICT, "invalid_state").await;
    assert!(m.contains("being unarchived by node node-c"), "{m}");
    assert!(s3.keys(&format!("default/{vm}/")).await.contains(&key));

    // C's claim is older than any unarchive takes: C died. A and B at once.
    claim(20 * 60 * 1000);
    let (ra, rb) = tokio::join!(unarchive(&a), unarchive(&b));
    let (sa, sb) = (ra.status(), rb.status());
    let (va, vb): (Value, Value) = (ra.json().await.unwrap(), rb.json().await.unwrap());
    let (win, lose, lost) = match (sa.as_u16(), sb.as_u16()) {
        (200, 409) => (&a, &b, &vb),
        (409, 200) => (&b, &a, &va),
        _ => panic!(
            "A: {sa} {va}\nB: {sb} {vb}\n--- A ---\n{}\n--- B ---\n{}",
            Daemon::log(&dir_a),
            Daemon::log(&dir_b)
        ),
    };
    assert_eq!(lost["error"]["code"], "invalid_state", "{lost}");
    // It lost the claim, or came while the winner's fresh claim was in
    // the record, or once the winner had taken the record.
    let why = lost["error"]["message"].as_str().unwrap();
    assert!(
        why.contains("being unarchived by another node")
            || why.contains("being unarchived by node")
            || why.contains("unarchived elsewhere"),
        "{why}"
    );
    eprintln!("the loser: {why}");
    assert_eq!(vsock_echo(&uds(win, &vm), b"won"), b"won");
    assert!(!s3.keys(&format!("default/{vm}/")).await.contains(&key));
    let running_on = |d: &Daemon| {
        std::fs::read_dir(d.data_dir.join("vms"))
            .map(|rd| rd.flatten().any(|e| e.file_name() == vm.as_str()))
            .unwrap_or(false)
    };
    assert!(running_on(win));
    assert!(!running_on(lose), "the loser made a worker for it");
    // The loser runs nothing of it; a delete there (if it knows it at all)
    // leaves the winner's objects alone.
    let before = s3.keys("").await;
    let r = c
        .delete(lose.url(&format!("/v1/runtime/vms/{vm}")))
        .send()
        .await
        .unwrap();
    assert!(
        [StatusCode::OK, StatusCode::NOT_FOUND].contains(&r.status()),
        "{}",
        r.status()
    );
    assert_eq!(
        s3.keys("").await,
        before,
        "the loser's delete removed objects"
    );
    assert_eq!(vsock_echo(&uds(win, &vm), b"still"), b"still");
}
