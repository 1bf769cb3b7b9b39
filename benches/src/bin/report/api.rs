//! `report api URL [--data-dir DIR] [--image NAME] [--label TEXT] [RUNS]`:
//! sproutd's API
//! against a running sproutd, with the library's figure for the same work
//! beside it, measured in the same run on the same sandbox.
//!
//! Rows (RUNS each, interleaved so that noise falls on both alike):
//! - `GET /v1/health`: the cost of one request through the service (no-op);
//! - a buffered exec of `true` through the API, and the same through the
//!   guest agent's own client on the sandbox's vsock socket (the library: what
//!   an embedder gets), when `--data-dir` names sproutd's data directory on
//!   this machine (the socket is found beneath it);
//! - rest states, RUNS / 10 of each (at least 3): pause and resume through
//!   the API, and through the worker's control socket (the library's
//!   transport) on the same sandbox when `--data-dir` is given; a snapshot;
//!   a sleep, and the wake its next exec makes (to that exec's answer);
//!   fork(1) and fork(4) to every child answering an exec;
//! - a port (`POST /vms/{id}/ports`) to a guest `python3 -m http.server`: a
//!   GET of 2 bytes through the port's URL, and the same request over the
//!   agent client's own `open_port` (the library); a 16 MiB download
//!   through the URL, RUNS / 10 (at least 3);
//! - create to first exec: `POST /schedule` then an exec of `true`, restored
//!   from the image's template (built by a first create, not measured).
//!
//! On hosts without hardware virtualization sproutd and this run in the
//! emulated lab (tests/lab/bench-api.sh): those figures are emulated.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use guest_agent::client::{Client as Agent, ClientConfig, Endpoint};
use guest_agent::protocol::{Exec, DEFAULT_VSOCK_PORT};
use serde_json::{json, Value};

/// A row whose name carries `label`.
fn row(label: &str, name: &str, v: Vec<Duration>) {
    super::row(&format!("{label}{name}"), v);
}

pub(super) struct Api {
    pub(super) http: reqwest::blocking::Client,
    pub(super) base: String,
}

impl Api {
    pub(super) fn post(&self, path: &str, body: Value) -> anyhow::Result<Value> {
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

    pub(super) fn exec_true(&self, id: &str) -> anyhow::Result<()> {
        let v = self.post(
            &format!("/v1/runtime/vms/{id}/exec"),
            json!({"command": "true"}),
        )?;
        if v["exitCode"] != 0 {
            bail!("exec true: {v}");
        }
        Ok(())
    }

    /// A create; while the template is built (`503 template_building`),
    /// retried after the `Retry-After` it says.
    pub(super) fn create(&self, image: &str) -> anyhow::Result<String> {
        let body =
            json!({"image": image, "cpus": 1, "memoryMb": 256, "metadata": {"bench": "api"}});
        let t = Instant::now();
        loop {
            let r = self
                .http
                .post(format!("{}/v1/runtime/schedule", self.base))
                .json(&body)
                .send()
                .context("POST /schedule")?;
            let status = r.status();
            let retry = r
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
            let v: Value = r.json().context("POST /schedule: not JSON")?;
            if status == 503 && v["error"]["code"] == "template_building" {
                if t.elapsed() > Duration::from_secs(900) {
                    bail!("the template of {image} is not built after 15 minutes: {v}");
                }
                std::thread::sleep(Duration::from_secs(retry.unwrap_or(1).min(10)));
                continue;
            }
            if !status.is_success() {
                bail!("POST /schedule: {status}: {v}");
            }
            return Ok(v["vmId"].as_str().context("no vmId")?.to_owned());
        }
    }

    pub(super) fn rest(&self, id: &str, what: &str, body: Value) -> anyhow::Result<Value> {
        self.post(&format!("/v1/runtime/vms/{id}/{what}"), body)
    }

    fn delete_snapshot(&self, id: &str) -> anyhow::Result<()> {
        let r = self
            .http
            .delete(format!("{}/v1/runtime/snapshots/{id}", self.base))
            .send()?;
        if !r.status().is_success() {
            bail!("DELETE snapshot {id}: {}", r.status());
        }
        Ok(())
    }

    /// fork(`n`) of `id` to every child answering an exec; the children
    /// and the fork's snapshot deleted after.
    fn fork(&self, id: &str, n: usize) -> anyhow::Result<Duration> {
        let t = Instant::now();
        let v = self.rest(id, "fork", json!({"count": n}))?;
        let kids: Vec<String> = v["forks"]
            .as_array()
            .context("no forks")?
            .iter()
            .map(|k| match (&k["state"], k["vmId"].as_str()) {
                (s, Some(id)) if s == "running" => Ok(id.to_owned()),
                _ => Err(anyhow::anyhow!("a fork child failed: {k}")),
            })
            .collect::<anyhow::Result<_>>()?;
        std::thread::scope(|s| {
            let hs: Vec<_> = kids.iter().map(|k| s.spawn(|| self.exec_true(k))).collect();
            hs.into_iter()
                .try_for_each(|h| h.join().map_err(|_| anyhow::anyhow!("panicked"))?)
        })?;
        let took = t.elapsed();
        for k in &kids {
            self.delete(k)?;
        }
        self.delete_snapshot(v["snapshotId"].as_str().context("no snapshotId")?)?;
        Ok(took)
    }

    pub(super) fn delete(&self, id: &str) -> anyhow::Result<()> {
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
    // Prefixes every row's name (two sproutds measured in one run).
    let mut label = String::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--data-dir" => data_dir = Some(PathBuf::from(it.next().context("--data-dir DIR")?)),
            "--image" => image = it.next().context("--image NAME")?.clone(),
            "--label" => label = format!("[{}] ", it.next().context("--label TEXT")?),
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
    row(&label, "api: GET /v1/health (a no-op request)", health);
    row(
        &label,
        "api: exec `true`, buffered (HTTP to sproutd to the agent)",
        exec,
    );
    if !lib.is_empty() {
        row(
            &label,
            "library: exec `true` through the agent client, same sandbox",
            lib,
        );
    }

    let n = (runs / 10).max(3);
    port_rows(&api, &rt, &id, agent.as_ref(), runs, n, &label)?;
    rest_rows(&api, &id, data_dir.as_deref(), n, &label)?;
    api.delete(&id)?;

    let mut first = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let id = api.create(&image)?;
        api.exec_true(&id)?;
        first.push(t.elapsed());
        api.delete(&id)?;
    }
    row(
        &label,
        &format!(
            "api: create ({image}, 1 vCPU, 256 MiB; from its template) to first exec answered"
        ),
        first,
    );
    Ok(())
}

/// The rest-state rows, `n` runs each, on sandbox `id`.
fn rest_rows(
    api: &Api,
    id: &str,
    data_dir: Option<&Path>,
    n: usize,
    label: &str,
) -> anyhow::Result<()> {
    let ctl = data_dir.map(|d| d.join("vms").join(id).join("control.sock"));
    let mut rows: [(&str, Vec<Duration>); 8] = [
        ("api: pause", Vec::new()),
        ("api: resume", Vec::new()),
        (
            "library: pause through the worker's control socket",
            Vec::new(),
        ),
        (
            "library: resume through the worker's control socket",
            Vec::new(),
        ),
        (
            "api: snapshot (a diff, checked and sealed; the sandbox runs on)",
            Vec::new(),
        ),
        (
            "api: sleep (snapshot; its worker stops after the answer)",
            Vec::new(),
        ),
        (
            "api: wake to first exec (the exec wakes it; it waits for the sleep's worker to stop)",
            Vec::new(),
        ),
        ("api: fork(1) to the child's exec answered", Vec::new()),
    ];
    let mut fork4 = Vec::new();
    let timed = |f: &mut dyn FnMut() -> anyhow::Result<()>| -> anyhow::Result<Duration> {
        let t = Instant::now();
        f()?;
        Ok(t.elapsed())
    };
    for _ in 0..n {
        rows[0]
            .1
            .push(timed(&mut || api.rest(id, "pause", json!({})).map(drop))?);
        rows[1]
            .1
            .push(timed(&mut || api.rest(id, "resume", json!({})).map(drop))?);
        if let Some(ctl) = &ctl {
            let mut c = sprout_worker::Client::connect(ctl)
                .with_context(|| format!("connect {}", ctl.display()))?;
            rows[2].1.push(timed(&mut || Ok(c.pause()?))?);
            rows[3].1.push(timed(&mut || Ok(c.resume()?))?);
        }
        let mut snap = None;
        rows[4].1.push(timed(&mut || {
            snap = Some(api.rest(id, "snapshot", json!({}))?);
            Ok(())
        })?);
        if let Some(s) = snap.as_ref().and_then(|v| v["snapshotId"].as_str()) {
            api.delete_snapshot(s)?;
        }
        rows[5]
            .1
            .push(timed(&mut || api.rest(id, "sleep", json!({})).map(drop))?);
        rows[6].1.push(timed(&mut || api.exec_true(id))?);
        rows[7].1.push(api.fork(id, 1)?);
        fork4.push(api.fork(id, 4)?);
    }
    // The library's snapshot: the worker writes a diff into the sandbox's
    // own vm/ (writable in its jail), nothing verified or recorded. Last:
    // it moves the worker's lineage off the registry's (sproutd's next
    // snapshot of it would be full).
    let mut lib_snap = Vec::new();
    if let (Some(ctl), Some(d)) = (&ctl, data_dir) {
        let vm = d.join("vms").join(id).join("vm");
        let mut c = sprout_worker::Client::connect(ctl)?;
        for i in 0..n {
            let dir = vm.join(format!("bench-snapshot-{i}"));
            lib_snap.push(timed(&mut || Ok(c.snapshot(&dir, true)?))?);
        }
        for i in 0..n {
            let _ = std::fs::remove_dir_all(vm.join(format!("bench-snapshot-{i}")));
        }
    }
    for (name, v) in rows {
        if !v.is_empty() {
            row(label, name, v);
        }
    }
    if !lib_snap.is_empty() {
        row(
            label,
            "library: diff snapshot through the worker's control socket (not verified)",
            lib_snap,
        );
    }
    row(label, "api: fork(4) to every child's exec answered", fork4);
    Ok(())
}

/// The port rows, on sandbox `id` (a guest HTTP server on port 8000).
fn port_rows(
    api: &Api,
    rt: &tokio::runtime::Runtime,
    id: &str,
    agent: Option<&Agent>,
    runs: usize,
    n: usize,
    label: &str,
) -> anyhow::Result<()> {
    let setup = "mkdir -p /tmp/www && printf ok > /tmp/www/small && \
                 head -c 16777216 /dev/zero > /tmp/www/big";
    let v = api.post(
        &format!("/v1/runtime/vms/{id}/exec"),
        json!({"command": "/bin/sh", "argv": ["-c", setup]}),
    )?;
    if v["exitCode"] != 0 {
        bail!("setting up the files to serve: {v}");
    }
    api.post(
        &format!("/v1/runtime/vms/{id}/exec"),
        json!({"command": "/bin/sh", "background": true,
               "argv": ["-c", "cd /tmp/www && exec python3 -m http.server 8000 --bind 127.0.0.1"]}),
    )?;
    let port = api.post(
        &format!("/v1/runtime/vms/{id}/ports"),
        json!({"port": 8000}),
    )?;
    let url = port["url"].as_str().context("no url")?;
    let host = url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();
    let get = |path: &str| -> anyhow::Result<(u16, usize)> {
        let r = api
            .http
            .get(format!("{}{path}", api.base))
            .header("host", &host)
            .send()?;
        let st = r.status().as_u16();
        Ok((st, r.bytes()?.len()))
    };
    let t = Instant::now();
    while get("/small")?.0 != 200 {
        if t.elapsed() > Duration::from_secs(300) {
            bail!("the guest's http.server never answered through {url}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let (mut through, mut lib) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let t = Instant::now();
        let (st, len) = get("/small")?;
        through.push(t.elapsed());
        if (st, len) != (200, 2) {
            bail!("GET /small through the port: {st}, {len} bytes");
        }
        if let Some(a) = agent {
            let t = Instant::now();
            let len = rt.block_on(agent_get(a))?;
            lib.push(t.elapsed());
            if !len.ends_with(b"\r\n\r\nok") {
                bail!(
                    "GET /small over open_port: {:?}",
                    String::from_utf8_lossy(&len)
                );
            }
        }
    }
    row(
        label,
        "api: GET 2 bytes through a port's URL (sproutd to the agent to a guest python http.server)",
        through,
    );
    if !lib.is_empty() {
        row(
            label,
            "library: the same GET over the agent client's open_port",
            lib,
        );
    }
    let mut big = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let (st, len) = get("/big")?;
        big.push(t.elapsed());
        if (st, len) != (200, 16 << 20) {
            bail!("GET /big through the port: {st}, {len} bytes");
        }
    }
    row(label, "api: GET 16 MiB through a port's URL", big);
    Ok(())
}

/// `GET /small` written on a fresh `open_port(8000)`: the whole answer.
async fn agent_get(a: &Agent) -> anyhow::Result<Vec<u8>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = a.open_port(8000).await?;
    s.write_all(b"GET /small HTTP/1.0\r\nHost: bench\r\n\r\n")
        .await?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).await?;
    Ok(out)
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
