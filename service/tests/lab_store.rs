//! The snapshot store with Linux sandboxes, served from the emulated lab
//! (service/src/daemon/lab.rs) with a real S3-compatible server on this
//! host's loopback (moto's), which the lab reaches through QEMU's
//! forwarding: a sandbox archived on node A survives the loss of A's whole
//! data directory and is unarchived on node B with its files and a
//! process's memory intact.

use std::time::{Duration, Instant};

use reqwest::Client;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

mod common;
use common::lab::{lab, schedule, Hosted};
use common::s3::{BUCKET, CREDS, S3};

fn client() -> Client {
    Client::builder()
        .timeout(Duration::from_secs(900))
        .build()
        .unwrap()
}

async fn post(c: &Client, h: &Hosted, path: &str, body: Value) -> (u16, Value) {
    let r = c.post(h.url(path)).json(&body).send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

async fn raw(c: &Client, h: &Hosted, vm: &str, path: &str) -> Option<Vec<u8>> {
    let r = c
        .get(h.url(&format!("/v1/runtime/vms/{vm}/files/raw?path={path}")))
        .send()
        .await
        .unwrap();
    match r.status().as_u16() {
        200 => Some(r.bytes().await.unwrap().to_vec()),
        404 => None,
        s => panic!("GET {path}: {s} {}", r.text().await.unwrap()),
    }
}

/// Waits until `path` in `vm` holds something; its bytes.
async fn appears(c: &Client, h: &Hosted, vm: &str, path: &str) -> Vec<u8> {
    let t = Instant::now();
    loop {
        if let Some(b) = raw(c, h, vm, path).await.filter(|b| !b.is_empty()) {
            return b;
        }
        assert!(t.elapsed() < Duration::from_secs(300), "{path} never came");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// A program that draws a random token once, keeps it only in its memory,
/// and writes it to /workspace/tok again and again.
const KEEPER: &str = concat!(
    "import os, time\n",
    "t = os.urandom(8).hex()\n",
    "while True:\n",
    "    open('/workspace/tok.tmp', 'w').write(t)\n",
    "    os.replace('/workspace/tok.tmp', '/workspace/tok')\n",
    "    time.sleep(0.3)\n",
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_linux_sandbox_archived_on_node_a_comes_back_on_node_b() {
    let lab = lab();
    let t = tempfile::tempdir().unwrap();
    let (data_a, data_b) = (t.path().join("a"), t.path().join("b"));
    let s3 = S3::start(0).await;
    let ep = s3.endpoint();
    let args = ["--s3-endpoint", ep.as_str(), "--s3-bucket", BUCKET];
    let c = client();
    let t0 = Instant::now();

    let a = Hosted::start_env(&lab, &data_a, 2048, &args, &CREDS);
    eprintln!("[{:?}] node A serves on {}", t0.elapsed(), a.base);
    let v = schedule(&c, &a, json!({"cpus": 1, "memoryMb": 256})).await;
    let vm = v["vmId"].as_str().unwrap().to_owned();
    // A file, checksummed here.
    let data: Vec<u8> = (0..(1u32 << 20))
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let sum = Sha256::digest(&data);
    let r = c
        .put(a.url(&format!(
            "/v1/runtime/vms/{vm}/files/raw?path=/workspace/data.bin"
        )))
        .header("content-type", "application/octet-stream")
        .body(data.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    // A process whose state is in its memory only.
    let (st, v) = post(
        &c,
        &a,
        &format!("/v1/runtime/vms/{vm}/exec"),
        json!({"command": "python3", "argv": ["-c", KEEPER], "background": true}),
    )
    .await;
    assert_eq!(st, 201, "{v}");
    let exec_id = v["execId"].clone();
    let token = appears(&c, &a, &vm, "/workspace/tok").await;
    eprintln!(
        "[{:?}] the keeper holds {:?}",
        t0.elapsed(),
        String::from_utf8_lossy(&token)
    );

    let ta = Instant::now();
    let (st, v) = post(&c, &a, &format!("/v1/runtime/vms/{vm}/archive"), json!({})).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["state"], "archived", "{v}");
    eprintln!("[{:?}] archived in {:?}", t0.elapsed(), ta.elapsed());
    assert!(s3
        .keys(&format!("default/{vm}/"))
        .await
        .contains(&format!("default/{vm}/archive.json")));

    // Node A is lost: stopped, its whole data directory (the lab's data
    // disk with its registry and snapshots) deleted.
    let st = a.interrupt();
    assert!(st.success(), "node A exited {st}");
    std::fs::remove_dir_all(&data_a).unwrap();

    let b = Hosted::start_env(&lab, &data_b, 2048, &args, &CREDS);
    eprintln!("[{:?}] node B serves on {}", t0.elapsed(), b.base);
    let tb = Instant::now();
    let (st, v) = post(
        &c,
        &b,
        &format!("/v1/runtime/vms/{vm}/unarchive"),
        json!({}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["state"], "running", "{v}");
    eprintln!("[{:?}] unarchived in {:?}", t0.elapsed(), tb.elapsed());

    // The file, byte for byte.
    let got = raw(&c, &b, &vm, "/workspace/data.bin").await.unwrap();
    assert_eq!(Sha256::digest(&got), sum, "data.bin changed");
    // The process runs on, with the token it drew on node A: removed, the
    // file comes back with the same one.
    let r = c
        .delete(b.url(&format!("/v1/runtime/vms/{vm}/files?path=/workspace/tok")))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    assert_eq!(appears(&c, &b, &vm, "/workspace/tok").await, token);
    let list: Value = c
        .get(b.url(&format!("/v1/runtime/vms/{vm}/processes")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let text = list.to_string();
    assert!(text.contains(&exec_id.to_string()), "{list}");
    let st = b.interrupt();
    assert!(st.success(), "node B exited {st}");
}
