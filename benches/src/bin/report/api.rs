//! `report api URL [--data-dir DIR] [--image NAME] [RUNS]`: sproutd's API
//! against a running sproutd, with the library's figure for the same work
//! beside it, measured in the same run on the same sandbox.
//!
//! Rows (RUNS each, interleaved so that noise falls on both alike):
//! - `GET /v1/health`: the cost of one request through the service (no-op);
//! - a buffered exec of `true` through the API, and the same through the
//!   guest agent's own client on the sandbox's vsock socket (the library: what
//!   an embedder gets), when `--data-dir` names sproutd's data directory on
//!   this machine (the socket is found beneath it);
//! - create to first exec: `POST /schedule` then an exec of `true`
//!   (RUNS / 10 of them, at least 3: each boots a guest).
//!
//! On hosts without hardware virtualization sproutd and this run in the
//! emulated lab (tests/lab/bench-api.sh): those figures are emulated.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use guest_agent::client::{Client as Agent, ClientConfig, Endpoint};
use guest_agent::protocol::{Exec, DEFAULT_VSOCK_PORT};
use serde_json::{json, Value};

use super::row;

struct Api {
    http: reqwest::blocking::Client,
    base: String,
}

impl Api {
    fn post(&self, path: &str, body: Value) -> anyhow::Result<Value> {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .json(&body)
            .send()
            .with_context(|| format!("POST {path}"))?;
        let status = r.status();
        let v: Value = r.json().with_context(|| format!("POST {path}: not JSON"))?;
        if !status.is_success() {
            bail!("POST {path}: {status}: {v}");
        }
        Ok(v)
    }

    fn exec_true(&self, id: &str) -> anyhow::Result<()> {
        let v = self.post(
            &format!("/v1/runtime/vms/{id}/exec"),
            json!({"command": "true"}),
        )?;
        if v["exitCode"] != 0 {
            bail!("exec true: {v}");
        }
        Ok(())
    }

    fn create(&self, image: &str) -> anyhow::Result<String> {
        let v = self.post(
            "/v1/runtime/schedule",
            json!({"image": image, "cpus": 1, "memoryMb": 256, "metadata": {"bench": "api"}}),
        )?;
        Ok(v["vmId"].as_str().context("no vmId")?.to_owned())
    }

    fn delete(&self, id: &str) -> anyhow::Result<()> {
        let r = self
            .http
            .delete(format!("{}/v1/runtime/vms/{id}", self.base))
            .send()?;
        if !r.status().is_success() {
            bail!("DELETE {id}: {}", r.status());
        }
        Ok(())
    }
}

/// The sandbox's vsock socket beneath `dir` (any layout: a path that holds
/// the sandbox's id and ends in `vsock.sock`).
fn find_vsock(dir: &Path, id: &str) -> Option<PathBuf> {
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).ok()?.flatten() {
            let p = e.path();
            let Ok(t) = e.file_type() else { continue };
            if t.is_dir() {
                stack.push(p);
            } else if p.file_name().is_some_and(|n| n == "vsock.sock")
                && p.to_string_lossy().contains(id)
            {
                return Some(p);
            }
        }
    }
    None
}

pub fn run(args: &[String], runs: usize) -> anyhow::Result<()> {
    let mut url = None;
    let mut data_dir = None;
    let mut image = "default".to_owned();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--data-dir" => data_dir = Some(PathBuf::from(it.next().context("--data-dir DIR")?)),
            "--image" => image = it.next().context("--image NAME")?.clone(),
            u if u.starts_with("http://") => url = Some(u.trim_end_matches('/').to_owned()),
            other => bail!("report api: unknown argument {other:?}"),
        }
    }
    let api = Api {
        http: reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(600))
            .build()?,
        base: url.context("report api URL: the sproutd to measure (http://HOST:PORT)")?,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;

    let id = api.create(&image)?;
    let agent = match &data_dir {
        Some(d) => {
            let uds = find_vsock(d, &id)
                .with_context(|| format!("no vsock.sock for {id} beneath {}", d.display()))?;
            Some(Agent::new(
                Endpoint::Vsock {
                    uds_path: uds,
                    port: DEFAULT_VSOCK_PORT,
                },
                ClientConfig::default(),
            ))
        }
        None => None,
    };
    // Warm both paths (connections, the guest's page cache for `true`).
    for _ in 0..5 {
        api.exec_true(&id)?;
        if let Some(a) = &agent {
            rt.block_on(agent_true(a))?;
        }
    }
    let (mut health, mut exec, mut lib) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..runs {
        let t = Instant::now();
        let r = api.http.get(format!("{}/v1/health", api.base)).send()?;
        r.bytes()?;
        health.push(t.elapsed());
        let t = Instant::now();
        api.exec_true(&id)?;
        exec.push(t.elapsed());
        if let Some(a) = &agent {
            let t = Instant::now();
            rt.block_on(agent_true(a))?;
            lib.push(t.elapsed());
        }
    }
    api.delete(&id)?;
    row("api: GET /v1/health (a no-op request)", health);
    row(
        "api: exec `true`, buffered (HTTP to sproutd to the agent)",
        exec,
    );
    if !lib.is_empty() {
        row(
            "library: exec `true` through the agent client, same sandbox",
            lib,
        );
    }

    let creates = (runs / 10).max(3);
    let mut first = Vec::with_capacity(creates);
    for _ in 0..creates {
        let t = Instant::now();
        let id = api.create(&image)?;
        api.exec_true(&id)?;
        first.push(t.elapsed());
        api.delete(&id)?;
    }
    row(
        &format!("api: create ({image}, 1 vCPU, 256 MiB; a cold boot) to first exec answered"),
        first,
    );
    Ok(())
}

async fn agent_true(a: &Agent) -> anyhow::Result<()> {
    let out = a
        .exec_output(
            Exec {
                command: "true".into(),
                ..Exec::default()
            },
            None,
            1 << 20,
        )
        .await?;
    if out.exit.code != Some(0) {
        bail!("agent exec true: {:?}", out.exit);
    }
    Ok(())
}
