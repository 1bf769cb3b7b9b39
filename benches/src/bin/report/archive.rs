//! `report archive URL [RUNS]`: archive and unarchive through sproutd's
//! API, of a sandbox with 64 MiB of dirty memory (a process holding 64 MiB
//! of random bytes) and 64 MiB of disk writes (a file of random bytes,
//! fsynced), against a sproutd with an object store (`--s3-endpoint`).
//! Each run: a create from the image's template, the dirtying, the archive
//! (to its answer: every byte in the store), the unarchive (to its answer:
//! running again), an exec that checks the process and the file survived,
//! and a delete. On hosts without hardware virtualization sproutd runs in
//! the emulated lab (tests/lab/bench-archive.sh): those figures are
//! emulated.

use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::json;

use super::api::Api;

/// Holds 64 MiB of random bytes in its memory (drawn in user mode, which
/// the lab runs natively), then writes its pid and sleeps.
const HOLDER: &str = "import os, random, time\n\
b = bytearray(random.randbytes(64 << 20))\n\
open('/workspace/held', 'w').write(str(os.getpid()))\n\
time.sleep(86400)\n";

/// 64 MiB of random bytes to the sandbox's disk, fsynced.
const WRITER: &str = concat!(
    "import random, os\n",
    "f = open('/workspace/disk.bin', 'wb')\n",
    "for _ in range(64):\n",
    "    f.write(random.randbytes(1 << 20))\n",
    "f.flush(); os.fsync(f.fileno())\n",
    "print(os.path.getsize('/workspace/disk.bin'))\n",
);

pub fn run(url: &str, runs: usize) -> anyhow::Result<()> {
    let api = Api {
        http: reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(1800))
            .build()?,
        base: url.trim_end_matches('/').to_owned(),
    };
    let (mut archive, mut unarchive) = (Vec::new(), Vec::new());
    for i in 0..runs {
        let id = api.create("default")?;
        let v = api.post(
            &format!("/v1/runtime/vms/{id}/exec"),
            json!({"command": "python3", "argv": ["-c", HOLDER], "background": true}),
        )?;
        if v["execId"].is_null() {
            bail!("no execId: {v}");
        }
        let t = Instant::now();
        loop {
            let v = api.post(
                &format!("/v1/runtime/vms/{id}/exec"),
                json!({"command": "cat", "argv": ["/workspace/held"]}),
            )?;
            if v["exitCode"] == 0 {
                break;
            }
            if t.elapsed() > Duration::from_secs(600) {
                bail!("the holder never held its bytes: {v}");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let v = api.post(
            &format!("/v1/runtime/vms/{id}/exec"),
            json!({"command": "python3", "argv": ["-c", WRITER]}),
        )?;
        if v["stdout"].as_str().map(str::trim) != Some("67108864") {
            bail!("the writer failed: {v}");
        }
        let t = Instant::now();
        let v = api.rest(&id, "archive", json!({}))?;
        archive.push(t.elapsed());
        if v["state"] != "archived" {
            bail!("archive: {v}");
        }
        let t = Instant::now();
        let v = api.rest(&id, "unarchive", json!({}))?;
        unarchive.push(t.elapsed());
        if v["state"] != "running" {
            bail!("unarchive: {v}");
        }
        // Both survived: the holder runs on, the file is whole.
        let v = api.post(
            &format!("/v1/runtime/vms/{id}/exec"),
            json!({"command": "sh", "argv": ["-c",
                "kill -0 \"$(cat /workspace/held)\" && stat -c %s /workspace/disk.bin"]}),
        )?;
        if v["stdout"].as_str().map(str::trim) != Some("67108864") {
            bail!("after the unarchive: {v}");
        }
        api.delete(&id)?;
        eprintln!(
            "[report archive] run {}/{runs}: archive {:?}, unarchive {:?}",
            i + 1,
            archive[i],
            unarchive[i]
        );
    }
    super::row(
        "api: archive (64 MiB dirty memory, 64 MiB disk writes; 1 vCPU, 256 MiB) to all in the store",
        archive,
    );
    super::row("api: unarchive of it, from the store to running", unarchive);
    Ok(())
}
