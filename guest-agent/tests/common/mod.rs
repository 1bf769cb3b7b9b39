//! Runs `sprout-agent` as a host process on a Unix socket in a temp dir, with a temp dir
//! as its files root.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use guest_agent::client::{Client, ClientConfig, Endpoint};

pub struct Agent {
    child: Child,
    pub dir: tempfile::TempDir,
    pub root: PathBuf,
    pub sock: PathBuf,
    extra: Vec<String>,
    wrapper: Vec<String>,
}

impl Agent {
    pub fn start() -> Agent {
        Agent::start_with(&[])
    }

    pub fn start_with(extra: &[&str]) -> Agent {
        Agent::start_wrapped(&[], extra)
    }

    /// Starts the agent with `extra` arguments, as the last argument of the
    /// `wrapper` command (say `ip netns exec NS`, which runs it in a network
    /// namespace).
    pub fn start_wrapped(wrapper: &[&str], extra: &[&str]) -> Agent {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let sock = dir.path().join("agent.sock");
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let wrapper: Vec<String> = wrapper.iter().map(|s| s.to_string()).collect();
        let child = spawn(&wrapper, &sock, &root, &extra);
        let agent = Agent {
            child,
            dir,
            root,
            sock,
            extra,
            wrapper,
        };
        wait_for_socket(&agent.sock);
        agent
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn client(&self) -> Client {
        Client::new(Endpoint::Unix(self.sock.clone()), ClientConfig::default())
    }

    /// Kills the agent process (as a guest reset would) and waits for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the agent again on the same socket and root.
    pub fn restart(&mut self) {
        self.kill();
        self.child = spawn(&self.wrapper, &self.sock, &self.root, &self.extra);
        wait_for_socket(&self.sock);
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill();
    }
}

fn spawn(wrapper: &[String], sock: &Path, root: &Path, extra: &[String]) -> Child {
    let _ = std::fs::remove_file(sock);
    let agent = env!("CARGO_BIN_EXE_sprout-agent");
    let mut cmd = match wrapper.split_first() {
        Some((program, args)) => {
            let mut c = Command::new(program);
            c.args(args).arg(agent);
            c
        }
        None => Command::new(agent),
    };
    cmd.arg("--listen-unix")
        .arg(sock)
        .arg("--root")
        .arg(root)
        .args(extra)
        .stdin(Stdio::null())
        .spawn()
        .expect("start sprout-agent")
}

fn wait_for_socket(sock: &Path) {
    let start = Instant::now();
    while std::os::unix::net::UnixStream::connect(sock).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "agent did not come up"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Resident set size of process `pid` (`self` for this one), in KiB.
pub fn rss_kib(pid: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Deterministic bytes that do not compress or repeat soon (xorshift).
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

pub fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    hex(&sha2::Sha256::digest(data))
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Whether process `pid` still exists (and is not a zombie).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

/// An `Exec` of `command` with `argv`, otherwise default.
pub fn cmd(command: &str, argv: &[&str]) -> guest_agent::protocol::Exec {
    guest_agent::protocol::Exec {
        command: command.into(),
        argv: argv.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}
