//! What the API tests share: a real `sproutd` on a free loopback port with
//! a temporary data directory, and checks of its answers.
#![allow(dead_code)]

pub mod lab;
pub mod oci;
pub mod s3;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use reqwest::{Client, Response, StatusCode};
use serde_json::{json, Value};
use std::time::Duration;

/// A running sproutd.
pub struct Daemon {
    pub child: Child,
    pub base: String,
    pub data_dir: PathBuf,
}

impl Daemon {
    pub fn start(data_dir: &Path) -> Daemon {
        Self::start_with(data_dir, &[])
    }

    pub fn start_with(data_dir: &Path, extra: &[&str]) -> Daemon {
        Self::start_env(data_dir, extra, &[])
    }

    /// With `envs` set in its environment too.
    pub fn start_env(data_dir: &Path, extra: &[&str], envs: &[(&str, &str)]) -> Daemon {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(data_dir.with_extension("log"))
            .unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_sproutd"))
            .args(["--no-lab", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .args(extra)
            .envs(envs.iter().copied())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("start sproutd");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("sproutd listening on ")
            .unwrap_or_else(|| panic!("sproutd said {line:?}; log: {}", Self::log(data_dir)))
            .to_owned();
        Daemon {
            child,
            base: addr,
            data_dir: data_dir.to_owned(),
        }
    }

    pub fn log(data_dir: &Path) -> String {
        std::fs::read_to_string(data_dir.with_extension("log")).unwrap_or_default()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// SIGTERM (a graceful stop), waited for.
    pub fn stop(mut self) {
        let pid = self.child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        let st = self.child.wait().unwrap();
        assert!(st.success(), "sproutd exited {st}");
    }

    /// SIGKILL, waited for.
    pub fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A test's temporary directory and the data directory in it.
pub fn data_dir() -> (DataDir, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let d = t.path().join("data");
    (DataDir(t), d)
}

/// A test's temporary directory. Its sandboxes' worker processes, which
/// outlive a killed or stopped sproutd by design (the next one adopts
/// them), are killed when it goes, so no test leaves VMs running.
pub struct DataDir(tempfile::TempDir);

impl DataDir {
    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for DataDir {
    fn drop(&mut self) {
        kill_workers_of(self.0.path());
        // A worker a killed sproutd had forked but not yet exec'd shows up
        // as one a moment later.
        std::thread::sleep(std::time::Duration::from_millis(100));
        kill_workers_of(self.0.path());
    }
}

/// SIGKILL to every `sprout-worker` process whose command line names a
/// path under `dir` (its console, jail root or socket).
pub fn kill_workers_of(dir: &Path) {
    let needle = format!("{}/", dir.display());
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let cmd = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains("sprout-worker") && cmd.contains(&needle) {
            // SAFETY: kill(2) on a pid read from /proc; at worst it names
            // a process that has just ended (ESRCH, ignored).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// Checks that `r` is the error envelope with `status` and `code`, and has
/// a request id; its message.
pub async fn assert_error(r: Response, status: StatusCode, code: &str) -> String {
    let got = r.status();
    assert!(
        r.headers().contains_key("x-request-id"),
        "no request id: {r:?}"
    );
    let ct = r.headers()["content-type"].to_str().unwrap().to_owned();
    let body = r.text().await.unwrap();
    assert_eq!(got, status, "{body}");
    assert!(ct.starts_with("application/json"), "{ct}: {body}");
    let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"));
    assert_eq!(v["error"]["code"], code, "{body}");
    let msg = v["error"]["message"]
        .as_str()
        .expect("a message")
        .to_owned();
    assert!(!msg.is_empty(), "{body}");
    msg
}

pub async fn post(c: &Client, d: &Daemon, path: &str, body: Value) -> Response {
    c.post(d.url(path)).json(&body).send().await.unwrap()
}

pub async fn raw_post(c: &Client, d: &Daemon, path: &str, body: &'static str) -> Response {
    c.post(d.url(path))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap()
}

/// Bytes through the test guest's vsock echo port (1234), from the host
/// side of the sandbox's vsock socket.
pub fn vsock_echo(uds: &Path, msg: &[u8]) -> Vec<u8> {
    use std::io::{Read, Write};
    // A freshly booted test guest may not listen yet: a refused handshake
    // (the device closes the stream) is tried again, for a while.
    let t = std::time::Instant::now();
    let mut s = loop {
        let mut s = std::os::unix::net::UnixStream::connect(uds)
            .unwrap_or_else(|e| panic!("connect {}: {e}", uds.display()));
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        // The device may close the stream at once (the guest refused).
        let mut line = String::new();
        if s.write_all(b"CONNECT 1234\n").is_ok() {
            let _ = BufReader::new(&mut s).read_line(&mut line);
        }
        if line.starts_with("OK ") {
            break s;
        }
        assert!(
            line.is_empty() && t.elapsed() < Duration::from_secs(30),
            "vsock handshake answer {line:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    s.write_all(msg).unwrap();
    let mut got = vec![0u8; msg.len()];
    s.read_exact(&mut got).unwrap();
    got
}

pub async fn schedule_testguest(c: &Client, d: &Daemon) -> (String, u64) {
    let v = schedule(
        c,
        d,
        json!({"image": "testguest", "cpus": 1, "memoryMb": 128}),
    )
    .await;
    (
        v["vmId"].as_str().unwrap().to_owned(),
        v["workerPid"].as_u64().unwrap(),
    )
}

/// `POST /schedule`: while its template is built, `503 template_building`
/// with `Retry-After`, retried as it says; the created sandbox.
pub async fn schedule(c: &Client, d: &Daemon, body: Value) -> Value {
    let t = std::time::Instant::now();
    loop {
        let r = post(c, d, "/v1/runtime/schedule", body.clone()).await;
        let status = r.status();
        let retry = r
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().parse::<u64>().unwrap());
        let v: Value = r.json().await.unwrap();
        if status == 503 && v["error"]["code"] == "template_building" {
            let secs = retry.expect("a 503 template_building has a Retry-After");
            assert!(secs >= 1 && t.elapsed() < Duration::from_secs(300), "{v}");
            tokio::time::sleep(Duration::from_secs(secs)).await;
            continue;
        }
        assert_eq!(status, 201, "{v}\n{}", Daemon::log(&d.data_dir));
        return v;
    }
}

pub fn alive(pid: u64) -> bool {
    // A zombie (an exited child not yet reaped) is not alive.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !s.rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

/// A new API key and the line of the tenants file that `sproutd --new-key`
/// prints for it (`{ sha256 = "…" }`).
pub fn new_key() -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sproutd"))
        .arg("--new-key")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let key = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    let err = String::from_utf8(out.stderr).unwrap();
    let line = err
        .lines()
        .find_map(|l| l.trim().strip_prefix("keys = [")?.strip_suffix(']'))
        .unwrap_or_else(|| panic!("no keys line: {err}"))
        .to_owned();
    (key, line)
}

/// A client that sends `key` as `Authorization: Bearer`.
pub fn keyed(key: &str) -> Client {
    let mut h = reqwest::header::HeaderMap::new();
    h.insert(
        reqwest::header::AUTHORIZATION,
        format!("Bearer {key}").parse().unwrap(),
    );
    Client::builder()
        .default_headers(h)
        .timeout(Duration::from_secs(900))
        .build()
        .unwrap()
}
