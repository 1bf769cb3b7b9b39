//! `agent-check`: exercises a running guest agent through the host client, the way
//! issue #6 lists it, and measures exec round trips and file throughput.
//!
//! ```text
//! agent-check (--vsock-uds PATH [--port N] | --unix PATH)
//!             [--bench-runs N] [--throughput-mib M] [--file-mib M] [--no-checks]
//!             [--only NAME]
//! ```
//!
//! * `--vsock-uds PATH`: a VM's vsock socket (`sprout vm ctl --api-sock S vsock`); the
//!   agent is on vsock port `--port` (1024).
//! * `--unix PATH`: the agent run as a host process
//!   (`sprout-agent --listen-unix PATH --root DIR`).
//! * `--bench-runs N` (50): exec round trips of `true` to time; 0 skips them.
//! * `--throughput-mib M` (100): size of the file written then read for the throughput
//!   figures; 0 skips them.
//! * `--file-mib M` (50): size of the file of the write/read round-trip check.
//! * `--no-checks`: only the benchmarks.
//! * `--only NAME`: only the check NAME (with setup and cleanup), e.g. to repeat one.
//!
//! Prints one line per check, `PASS name (detail)` or `FAIL name: why`, and the
//! benchmarks' `BENCH ...` lines; exits 1 if a check failed, 2 on a usage error.
//!
//! Everything it creates lives in `agent-check/` beneath the agent's files root, plus
//! two directories beside the root (`agent-check-outside`, the target of the escape
//! attempts, and `<root>-agent-check-sibling`), all removed at the end. Everything the
//! agent sends is treated as hostile: output is collected under small caps, listings
//! and reads are bounded, and what is printed of it is cut short and escaped.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::ExitCode;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use guest_agent::client::{
    Client, ClientConfig, ClientError, Endpoint, ExecEvent, ExecOutput, WriteOptions,
};
use guest_agent::protocol::{
    ErrorCode, Exec, FileKind, WriteMode, DEFAULT_VSOCK_PORT, MAX_CHUNK, MAX_PATH,
};
use sha2::Digest;
use tokio::io::{AsyncRead, ReadBuf};
use tokio::task::JoinSet;

/// The limit of one check, host time (the emulated lab is slow).
const CHECK_LIMIT: Duration = Duration::from_secs(180);
/// Most output kept of a command whose output is expected to be short.
const SMALL: usize = 64 << 10;
/// The directory beneath the files root that the checks work in.
const BASE: &str = "agent-check";
/// The escape suite's directory.
const ESC: &str = "agent-check/esc";
/// Beside the files root: what the escape attempts aim at.
const OUTSIDE: &str = "agent-check-outside";

/// Every check and benchmark, in the order they run (`--only` takes one).
const NAMES: [&str; 13] = [
    "exec_streamed",
    "exec_stdin_5mib_sha256",
    "exec_timeout",
    "exec_env_cwd",
    "exec_non_utf8",
    "exec_64_concurrent",
    "exec_yes_flood_cap",
    "files_round_trip",
    "files_ops",
    "files_escapes",
    "files_escape_swap_race",
    "bench_exec_rt",
    "bench_file_throughput",
];

const USAGE: &str = "usage: agent-check (--vsock-uds PATH [--port N] | --unix PATH) \
                     [--bench-runs N] [--throughput-mib M] [--file-mib M] [--no-checks] [--only NAME]";

struct Opts {
    endpoint: Endpoint,
    bench_runs: usize,
    throughput_mib: u64,
    file_mib: u64,
    checks: bool,
    only: Option<String>,
}

fn parse_args() -> Result<Opts, String> {
    let mut args = std::env::args_os().skip(1);
    let (mut vsock, mut unix, mut port) = (None, None, DEFAULT_VSOCK_PORT);
    let (mut bench_runs, mut throughput_mib, mut file_mib, mut checks) = (50, 100, 50, true);
    let mut only = None;
    fn num<T>(flag: &str, v: Option<std::ffi::OsString>, max: T) -> Result<T, String>
    where
        T: std::str::FromStr + PartialOrd + std::fmt::Display,
    {
        let v = v.ok_or_else(|| format!("{flag} needs a value"))?;
        let n: T = v
            .to_str()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("{flag}: not a number: {}", v.to_string_lossy()))?;
        if n > max {
            return Err(format!("{flag}: at most {max}"));
        }
        Ok(n)
    }
    while let Some(a) = args.next() {
        match a.to_str().unwrap_or("") {
            "--vsock-uds" => {
                vsock = Some(PathBuf::from(
                    args.next().ok_or("--vsock-uds needs a path")?,
                ))
            }
            "--unix" => unix = Some(PathBuf::from(args.next().ok_or("--unix needs a path")?)),
            "--port" => port = num("--port", args.next(), u32::MAX)?,
            "--bench-runs" => bench_runs = num("--bench-runs", args.next(), 1_000_000)?,
            "--throughput-mib" => throughput_mib = num("--throughput-mib", args.next(), 64 << 10)?,
            "--file-mib" => file_mib = num("--file-mib", args.next(), 4 << 10)?,
            "--no-checks" => checks = false,
            "--only" => {
                let name = args.next().ok_or("--only needs a check name")?;
                let name = name.to_string_lossy().into_owned();
                if !NAMES.contains(&name.as_str()) {
                    return Err(format!(
                        "--only: no check {name:?}; checks: {}",
                        NAMES.join(" ")
                    ));
                }
                only = Some(name);
            }
            "-h" | "--help" => return Err(String::new()),
            _ => return Err(format!("unknown argument {}", a.to_string_lossy())),
        }
    }
    if file_mib == 0 {
        return Err("--file-mib must be at least 1".into());
    }
    let endpoint = match (vsock, unix) {
        (Some(uds_path), None) => Endpoint::Vsock { uds_path, port },
        (None, Some(p)) => Endpoint::Unix(p),
        _ => return Err("give exactly one of --vsock-uds and --unix".into()),
    };
    Ok(Opts {
        endpoint,
        bench_runs,
        throughput_mib,
        file_mib,
        checks,
        only,
    })
}

fn main() -> ExitCode {
    let opts = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("agent-check: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("agent-check: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    if rt.block_on(run(opts)) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Everything; whether all went well.
async fn run(opts: Opts) -> bool {
    let config = ClientConfig {
        // The lab is an emulated machine running an emulated one.
        connect_timeout: Duration::from_secs(30),
        request_timeout: Duration::from_secs(60),
        max_idle: 8,
        max_list_entries: 100_000,
        ..ClientConfig::default()
    };
    let client = Client::new(opts.endpoint.clone(), config);
    println!("agent-check: agent at {}", opts.endpoint);

    let ctx = match tokio::time::timeout(CHECK_LIMIT, setup(&client)).await {
        Ok(Ok((ctx, detail))) => {
            println!("PASS setup ({detail})");
            ctx
        }
        Ok(Err(e)) => {
            println!("FAIL setup: {e}");
            return false;
        }
        Err(_) => {
            println!("FAIL setup: no answer within {CHECK_LIMIT:?}");
            return false;
        }
    };

    let mut r = Runner {
        only: opts.only.clone(),
        ok: true,
    };
    if opts.checks || opts.only.is_some() {
        let c = &ctx;
        r.check("exec_streamed", streamed(c)).await;
        r.check("exec_stdin_5mib_sha256", stdin_sha256(c)).await;
        r.check("exec_timeout", exec_timeout(c)).await;
        r.check("exec_env_cwd", env_cwd(c)).await;
        r.check("exec_non_utf8", non_utf8(c)).await;
        r.check("exec_64_concurrent", concurrent(c)).await;
        r.check("exec_yes_flood_cap", yes_flood(c)).await;
        r.check("files_round_trip", file_round_trip(c, opts.file_mib))
            .await;
        r.check("files_ops", file_ops(c)).await;
        r.check("files_escapes", escapes(c)).await;
        r.check("files_escape_swap_race", swap_race(c)).await;
    }
    if opts.bench_runs > 0 {
        r.check("bench_exec_rt", bench_exec(&ctx, opts.bench_runs))
            .await;
    }
    if opts.throughput_mib > 0 {
        r.check(
            "bench_file_throughput",
            bench_throughput(&ctx, opts.throughput_mib),
        )
        .await;
    }
    let mut ok = r.ok;
    ok &= check("cleanup", cleanup(&ctx)).await;
    println!("agent-check: {}", if ok { "all passed" } else { "FAILED" });
    ok
}

type CheckResult = Result<String, String>;

/// Runs the checks (or only the one named) and remembers whether all passed.
struct Runner {
    only: Option<String>,
    ok: bool,
}

impl Runner {
    async fn check(&mut self, name: &str, f: impl Future<Output = CheckResult>) {
        if self.only.as_deref().is_none_or(|o| o == name) {
            self.ok &= check(name, f).await;
        }
    }
}

/// Runs one check under [`CHECK_LIMIT`] and prints its line.
async fn check(name: &str, f: impl Future<Output = CheckResult>) -> bool {
    let t = Instant::now();
    let r = tokio::time::timeout(CHECK_LIMIT, f).await;
    let took = secs(t.elapsed());
    match r {
        Ok(Ok(detail)) => {
            println!("PASS {name} ({detail}; {took})");
            true
        }
        Ok(Err(why)) => {
            println!("FAIL {name}: {why} ({took})");
            false
        }
        Err(_) => {
            println!("FAIL {name}: not done within {CHECK_LIMIT:?}");
            false
        }
    }
}

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)*) => {
        if !$cond {
            return Err(format!($($fmt)*));
        }
    };
}

/// Agent errors (and anything else from the client) as a short, escaped message.
trait Ctx<T> {
    fn ctx(self, what: &str) -> Result<T, String>;
}

impl<T> Ctx<T> for Result<T, ClientError> {
    fn ctx(self, what: &str) -> Result<T, String> {
        self.map_err(|e| format!("{what}: {}", describe(&e)))
    }
}

fn describe(e: &ClientError) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    shown(&s, 300)
}

/// At most `max` characters of `s`, escaped (it may come from the agent).
fn shown(s: &str, max: usize) -> String {
    let mut out: String = s.chars().take(max).flat_map(char::escape_debug).collect();
    if s.chars().nth(max).is_some() {
        out.push_str("...");
    }
    out
}

fn shown_bytes(b: &[u8]) -> String {
    shown(&String::from_utf8_lossy(&b[..b.len().min(200)]), 200)
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

fn cmd(command: &str, argv: &[&str]) -> Exec {
    Exec {
        command: command.into(),
        argv: argv.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// `sh -c script agent-check args...` (the args are `$1`...), killed after 120 s.
fn sh(script: &str, args: &[&str]) -> Exec {
    let mut argv = vec!["-c", script, "agent-check"];
    argv.extend_from_slice(args);
    let mut req = cmd("sh", &argv);
    req.timeout_ms = Some(120_000);
    req
}

fn sha256_hex(data: &[u8]) -> String {
    hex(&sha2::Sha256::digest(data))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Deterministic bytes that do not compress or repeat soon (xorshift).
fn noise(len: usize, seed: u64) -> Vec<u8> {
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

/// This process's resident set, in KiB.
fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// What the checks share: the client and where the agent's files root is.
struct Check {
    client: Client,
    /// The files root as the agent's processes see it (absolute).
    root: String,
    /// The directory that holds the root.
    parent: String,
}

impl Check {
    /// Runs `req` to the end keeping at most `cap` bytes per stream.
    async fn run(&self, req: Exec, cap: usize) -> Result<ExecOutput, String> {
        let what = shown(&req.command, 60);
        self.client
            .exec_output(req, None, cap)
            .await
            .ctx(&format!("exec {what}"))
    }

    /// Runs a shell script that must succeed; its stdout.
    async fn sh_ok(&self, script: &str, args: &[&str]) -> Result<String, String> {
        let out = self.run(sh(script, args), SMALL).await?;
        ensure!(
            out.exit.code == Some(0),
            "`{}` ended with {:?}/signal {:?}: {}",
            shown(script, 80),
            out.exit.code,
            out.exit.signal,
            shown_bytes(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// Pings the agent and finds its files root (an exec's default directory).
async fn setup(client: &Client) -> Result<(Check, String), String> {
    let pong = client.ping().await.ctx("ping")?;
    let out = client
        .exec_output(cmd("pwd", &[]), None, 8192)
        .await
        .ctx("exec pwd")?;
    let root = String::from_utf8_lossy(&out.stdout).trim_end().to_string();
    ensure!(
        out.exit.code == Some(0) && root.starts_with('/') && root.len() < 1024,
        "`pwd` in the files root said {:?} ({:?})",
        shown(&root, 100),
        out.exit.code
    );
    ensure!(
        root != "/",
        "the agent's files root is missing (exec runs in /): start it with --root DIR"
    );
    ensure!(
        !root.contains(['\n', '\0']),
        "odd files root {:?}",
        shown(&root, 100)
    );
    let parent = match root.trim_end_matches('/').rsplit_once('/') {
        Some(("", _)) => "/".to_string(),
        Some((p, _)) => p.to_string(),
        None => return Err(format!("odd files root {:?}", shown(&root, 100))),
    };
    let c = Check {
        client: client.clone(),
        root: root.trim_end_matches('/').to_string(),
        parent,
    };
    // Leftovers of an earlier run go first.
    let sibling = format!("{}-agent-check-sibling", c.root);
    c.sh_ok(
        "rm -rf \"$1\" \"$2\" \"$3\"",
        &[BASE, &format!("{}/{OUTSIDE}", c.parent), &sibling],
    )
    .await?;
    c.client.mkdir(BASE, false).await.ctx("mkdir agent-check")?;
    let detail = format!(
        "agent {} protocol {}, files root {}",
        shown(&pong.agent_version, 40),
        pong.protocol,
        shown(&c.root, 100)
    );
    Ok((c, detail))
}

/// The first stdout chunk arrives while the command still runs.
async fn streamed(c: &Check) -> CheckResult {
    let mut req = cmd("sh", &["-c", "echo a; sleep 1; echo b"]);
    req.timeout_ms = Some(60_000);
    let start = Instant::now();
    let mut s = c.client.exec(req).await.ctx("exec")?;
    let mut stdout = Vec::new();
    let mut first_at = None;
    let exit = loop {
        match s.next_event().await.ctx("event")? {
            Some(ExecEvent::Stdout(d)) => {
                first_at.get_or_insert((start.elapsed(), d.clone()));
                ensure!(stdout.len() + d.len() <= SMALL, "too much output");
                stdout.extend(d);
            }
            Some(ExecEvent::Stderr(d)) => return Err(format!("stderr: {}", shown_bytes(&d))),
            Some(ExecEvent::Exit(e)) => break e,
            None => return Err("no exit".into()),
        }
    };
    let exit_at = start.elapsed();
    let Some((first_at, first)) = first_at else {
        return Err("no output".into());
    };
    ensure!(
        first == b"a\n",
        "first chunk {:?}, expected \"a\\n\"",
        shown_bytes(&first)
    );
    ensure!(stdout == b"a\nb\n", "stdout {:?}", shown_bytes(&stdout));
    ensure!(exit.code == Some(0), "exit {exit:?}");
    let lead = exit_at.saturating_sub(first_at);
    // `sleep 1` between the two: a buffered answer would bring both at the end.
    ensure!(
        lead >= Duration::from_millis(500),
        "first chunk at {}, exit at {}: not streamed",
        secs(first_at),
        secs(exit_at)
    );
    Ok(format!(
        "first chunk at {}, exit at {}: {} before the exit",
        secs(first_at),
        secs(exit_at),
        secs(lead)
    ))
}

/// 5 MiB through `sha256sum` on stdin.
async fn stdin_sha256(c: &Check) -> CheckResult {
    let data = noise(5 << 20, 42);
    let want = sha256_hex(&data);
    let mut req = cmd("sha256sum", &[]);
    req.timeout_ms = Some(120_000);
    let t = Instant::now();
    let out = c
        .client
        .exec_output(req, Some(data), 4096)
        .await
        .ctx("exec sha256sum")?;
    let took = t.elapsed();
    ensure!(
        out.exit.code == Some(0),
        "sha256sum ended {:?}: {}",
        out.exit,
        shown_bytes(&out.stderr)
    );
    let got = String::from_utf8_lossy(&out.stdout);
    let got = got.split_whitespace().next().unwrap_or("");
    ensure!(
        got == want,
        "guest hash {:?}, host hash {want}",
        shown(got, 80)
    );
    Ok(format!(
        "hash {}..., {:.1} MiB/s",
        &want[..16],
        5.0 / took.as_secs_f64()
    ))
}

/// The timeout kills the whole process group and says so.
async fn exec_timeout(c: &Check) -> CheckResult {
    const TIMEOUT: Duration = Duration::from_secs(2);
    const SLACK: Duration = Duration::from_secs(3);
    let mut req = cmd("sh", &["-c", "sleep 100 & echo $!; sleep 100"]);
    req.timeout_ms = Some(TIMEOUT.as_millis() as u64);
    let t = Instant::now();
    let out = c.run(req, SMALL).await?;
    let took = t.elapsed();
    ensure!(out.exit.timed_out, "not marked timed out: {:?}", out.exit);
    ensure!(
        out.exit.signal == Some(9) && out.exit.code.is_none(),
        "exit {:?}",
        out.exit
    );
    ensure!(
        took < TIMEOUT + SLACK,
        "ended after {}, limit {} + {}",
        secs(took),
        secs(TIMEOUT),
        secs(SLACK)
    );
    // The background sleep was in the group: gone too.
    let bg = String::from_utf8_lossy(&out.stdout);
    let bg: u32 = bg
        .trim()
        .parse()
        .map_err(|_| format!("background pid {:?}", shown(&bg, 40)))?;
    let mut gone = false;
    for _ in 0..20 {
        let state = c
            .sh_ok(
                "if [ -d /proc/$1 ] && ! grep -q '^State:.*Z' /proc/$1/status 2>/dev/null; \
                 then echo alive; else echo gone; fi",
                &[&bg.to_string()],
            )
            .await?;
        if state.trim() == "gone" {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    ensure!(gone, "background sleep {bg} survived the timeout");
    Ok(format!(
        "timeout {}: ended after {}, SIGKILL, group gone",
        secs(TIMEOUT),
        secs(took)
    ))
}

/// Variables, the working directory and a cleared environment.
async fn env_cwd(c: &Check) -> CheckResult {
    c.client
        .mkdir("agent-check/cwd dir", false)
        .await
        .ctx("mkdir")?;
    let mut req = cmd("sh", &["-c", "echo \"$FOO\"; pwd"]);
    req.env = vec![("FOO".into(), "bar baz".into())];
    req.cwd = Some("agent-check/cwd dir".into());
    let out = c.run(req, SMALL).await?;
    let want = format!("bar baz\n{}/agent-check/cwd dir\n", c.root);
    ensure!(
        out.stdout == want.as_bytes(),
        "got {:?}, want {want:?}",
        shown_bytes(&out.stdout)
    );
    let mut req = cmd("pwd", &[]);
    req.cwd = Some("/".into());
    let out = c.run(req, SMALL).await?;
    ensure!(
        out.stdout == b"/\n",
        "cwd / gave {:?}",
        shown_bytes(&out.stdout)
    );
    let mut req = cmd("/usr/bin/env", &[]);
    req.clear_env = true;
    req.env = vec![("ONLY".into(), "1".into())];
    let out = c.run(req, SMALL).await?;
    ensure!(
        out.stdout == b"ONLY=1\n",
        "cleared environment: {:?}",
        shown_bytes(&out.stdout)
    );
    // Without a shell, metacharacters are plain arguments.
    let out = c.run(cmd("echo", &["$HOME", "a;b", "*"]), SMALL).await?;
    ensure!(
        out.stdout == b"$HOME a;b *\n",
        "argv: {:?}",
        shown_bytes(&out.stdout)
    );
    Ok("FOO, cwd (relative and /), clear_env, argv without a shell".into())
}

/// Bytes that are not UTF-8 arrive as they were written.
async fn non_utf8(c: &Check) -> CheckResult {
    let script = r"printf '\377\376\000\001\200abc\303'; printf '\000\377' >&2";
    let out = c.run(cmd("sh", &["-c", script]), SMALL).await?;
    ensure!(
        out.stdout == b"\xff\xfe\x00\x01\x80abc\xc3",
        "stdout {:02x?}",
        &out.stdout[..out.stdout.len().min(64)]
    );
    ensure!(
        out.stderr == b"\x00\xff",
        "stderr {:02x?}",
        &out.stderr[..out.stderr.len().min(64)]
    );
    // Every byte value, many times over, through cat.
    let data: Vec<u8> = (0..=255u8).cycle().take(300_000).collect();
    let mut req = cmd("cat", &[]);
    req.timeout_ms = Some(120_000);
    let out = c
        .client
        .exec_output(req, Some(data.clone()), 1 << 20)
        .await
        .ctx("exec cat")?;
    ensure!(
        out.stdout == data,
        "cat gave {} bytes back, {} differ",
        out.stdout.len(),
        out.stdout.iter().zip(&data).filter(|(a, b)| a != b).count()
    );
    Ok("printf bytes on both streams, 300000 bytes of every value through cat".into())
}

/// 64 execs at once, each answering its own number exactly once.
async fn concurrent(c: &Check) -> CheckResult {
    let mut tasks = JoinSet::new();
    let t = Instant::now();
    for n in 0..64u32 {
        let client = c.client.clone();
        tasks.spawn(async move {
            let mut req = cmd("sh", &["-c", "echo $N"]);
            req.env = vec![("N".into(), n.to_string())];
            req.timeout_ms = Some(120_000);
            (n, client.exec_output(req, None, 256).await)
        });
    }
    let mut seen = BTreeMap::new();
    let mut errors = Vec::new();
    while let Some(r) = tasks.join_next().await {
        let (n, r) = r.map_err(|e| format!("task: {e}"))?;
        match r {
            Ok(out) if out.exit.code == Some(0) => {
                let s = String::from_utf8_lossy(&out.stdout);
                match s.trim().parse::<u32>() {
                    Ok(got) => *seen.entry(got).or_insert(0u32) += 1,
                    Err(_) => errors.push(format!(
                        "exec {n} said {:?} (stdout_bytes {}, exit {:?})",
                        shown(&s, 40),
                        out.exit.stdout_bytes,
                        out.exit.code
                    )),
                }
            }
            Ok(out) => errors.push(format!("exec {n} ended {:?}", out.exit)),
            Err(e) => errors.push(format!("exec {n}: {}", describe(&e))),
        }
    }
    ensure!(
        errors.is_empty(),
        "{} failed, first: {}",
        errors.len(),
        errors[0]
    );
    let wrong: Vec<_> = seen.iter().filter(|(n, k)| **n >= 64 || **k != 1).collect();
    ensure!(
        seen.len() == 64 && wrong.is_empty(),
        "{} distinct answers; wrong: {wrong:?}",
        seen.len()
    );
    Ok(format!("64 of 64 distinct, in {}", secs(t.elapsed())))
}

/// `yes` past a 1 MiB cap: exactly the cap arrives, marked truncated, and this
/// process's memory does not follow the flood.
async fn yes_flood(c: &Check) -> CheckResult {
    const CAP: u64 = 1 << 20;
    let mut req = cmd("yes", &[]);
    req.timeout_ms = Some(4000);
    req.output_limit = Some(CAP);
    let before = rss_kib().ok_or("cannot read this process's RSS")?;
    let mut peak = before;
    let mut s = c.client.exec(req).await.ctx("exec yes")?;
    let (mut got, mut stderr) = (0u64, 0u64);
    let exit = loop {
        match s.next_event().await.ctx("event")? {
            Some(ExecEvent::Stdout(d)) => got += d.len() as u64,
            Some(ExecEvent::Stderr(d)) => stderr += d.len() as u64,
            Some(ExecEvent::Exit(e)) => break e,
            None => return Err("no exit".into()),
        }
        ensure!(
            got <= 8 * CAP,
            "{got} bytes and counting: the cap does not hold"
        );
        peak = peak.max(rss_kib().unwrap_or(0));
    };
    let growth = peak.saturating_sub(before);
    ensure!(got == CAP, "received {got} bytes, cap {CAP}");
    ensure!(
        exit.stdout_truncated && !exit.stderr_truncated && stderr == 0,
        "exit {exit:?}"
    );
    ensure!(
        exit.stdout_bytes > CAP,
        "yes wrote only {} bytes",
        exit.stdout_bytes
    );
    ensure!(
        exit.timed_out,
        "yes was not stopped by its timeout: {exit:?}"
    );
    ensure!(growth < 16 << 10, "RSS grew by {growth} KiB");
    Ok(format!(
        "received exactly {CAP} of {} bytes yes wrote; RSS {before} -> peak {peak} KiB",
        exit.stdout_bytes
    ))
}

/// `len` bytes of 1 MiB blocks, each a different rotation of one block of noise:
/// cheap to make even in a debug build on an emulated CPU, and no two blocks alike.
fn blocks(len: usize, seed: u64) -> Vec<u8> {
    const BLOCK: usize = 1 << 20;
    let base = noise(BLOCK, seed);
    let mut out = Vec::with_capacity(len + BLOCK);
    let mut i = 0;
    while out.len() < len {
        let r = (i * 4099) % BLOCK;
        out.extend_from_slice(&base[r..]);
        out.extend_from_slice(&base[..r]);
        i += 1;
    }
    out.truncate(len);
    out
}

/// Write a file, hash it in the guest, read it back chunk by chunk.
async fn file_round_trip(c: &Check, mib: u64) -> CheckResult {
    let path = "agent-check/big/nested/blob";
    c.client
        .mkdir("agent-check/big/nested", true)
        .await
        .ctx("mkdir -p")?;
    let len = (mib << 20) as usize;
    let data = blocks(len, 7);
    let t = Instant::now();
    let want = sha256_hex(&data);
    let hashed = t.elapsed();
    let t = Instant::now();
    let n = c
        .client
        .write_file(path, WriteOptions::default(), &mut &data[..])
        .await
        .ctx("write")?;
    let wrote = t.elapsed();
    ensure!(n == len as u64, "wrote {n} of {len} bytes");

    // The agent's side of it, hashed there.
    let t = Instant::now();
    let out = c.sh_ok("sha256sum \"$1\"", &[path]).await?;
    let there = out.split_whitespace().next().unwrap_or("");
    ensure!(
        there == want,
        "hash in the guest {:?}, on the host {want}",
        shown(there, 80)
    );
    let hashed_there = t.elapsed();

    // Read back and compared byte for byte as it comes.
    let t = Instant::now();
    let mut r = c.client.read_file(path, 0, None).await.ctx("read")?;
    let mut chunks = 0u64;
    let mut at = 0usize;
    while let Some(chunk) = r.next_chunk().await.ctx("read chunk")? {
        ensure!(chunk.len() <= MAX_CHUNK, "chunk of {} bytes", chunk.len());
        let Some(expected) = data.get(at..at + chunk.len()) else {
            return Err(format!("more than the {len} bytes written"));
        };
        ensure!(chunk == expected, "bytes {at}..{} differ", at + chunk.len());
        at += chunk.len();
        chunks += 1;
    }
    let read = t.elapsed();
    ensure!(
        at == len && r.received() == len as u64 && r.hit_eof(),
        "read {} bytes, eof {}",
        r.received(),
        r.hit_eof()
    );

    // A range from the middle, and past the end.
    let off = (len / 2) as u64 + 7;
    let mut r = c
        .client
        .read_file(path, off, Some(100_000))
        .await
        .ctx("range read")?;
    let mut part = Vec::new();
    while let Some(chunk) = r.next_chunk().await.ctx("range chunk")? {
        ensure!(part.len() + chunk.len() <= 100_000, "range too long");
        part.extend(chunk);
    }
    ensure!(
        part == data[off as usize..off as usize + 100_000] && !r.hit_eof(),
        "range read of {} bytes differs (eof {})",
        part.len(),
        r.hit_eof()
    );
    let mut r = c
        .client
        .read_file(path, len as u64 + 1000, None)
        .await
        .ctx("read past the end")?;
    ensure!(
        r.next_chunk().await.ctx("read past the end")?.is_none() && r.hit_eof(),
        "reading past the end gave data or no eof"
    );
    c.client.remove(path, false).await.ctx("remove")?;
    Ok(format!(
        "{mib} MiB: sha256 {}... on the host ({}) and in the guest ({}); written in {}, \
         read back identical in {chunks} chunks in {}",
        &want[..16],
        secs(hashed),
        secs(hashed_there),
        secs(wrote),
        secs(read)
    ))
}

fn expect_code<T>(r: Result<T, ClientError>, want: ErrorCode, what: &str) -> Result<(), String> {
    match r {
        Ok(_) => Err(format!("{what}: allowed, expected {want:?}")),
        Err(e) if e.code() == Some(want) => Ok(()),
        Err(e) => Err(format!("{what}: expected {want:?}, got {}", describe(&e))),
    }
}

/// list, stat, mkdir, rename, remove and their errors.
async fn file_ops(c: &Check) -> CheckResult {
    let cl = &c.client;
    let d = "agent-check/ops";
    cl.mkdir(&format!("{d}/a/b/c"), true)
        .await
        .ctx("mkdir -p")?;
    cl.mkdir(&format!("{d}/a/b/c"), true)
        .await
        .ctx("mkdir -p of an existing directory")?;
    expect_code(
        cl.mkdir(&format!("{d}/a/b"), false).await,
        ErrorCode::AlreadyExists,
        "mkdir of an existing directory",
    )?;
    expect_code(
        cl.mkdir(&format!("{d}/x/y"), false).await,
        ErrorCode::NotFound,
        "mkdir without its parent",
    )?;
    let opts = WriteOptions {
        mode: WriteMode::CreateNew,
        perm: Some(0o600),
    };
    cl.write_file(&format!("{d}/a/f.txt"), opts, &mut &b"hello"[..])
        .await
        .ctx("write")?;
    expect_code(
        cl.write_file(&format!("{d}/a/f.txt"), opts, &mut &b"again"[..])
            .await,
        ErrorCode::AlreadyExists,
        "create-new of an existing file",
    )?;
    c.sh_ok("ln -s b/c \"$1/a/link\"", &[d]).await?;

    let mut entries = cl.list(&format!("{d}/a")).await.ctx("list")?;
    entries.sort_by(|x, y| x.name.cmp(&y.name));
    let got: Vec<_> = entries.iter().map(|e| (e.name.as_str(), e.kind)).collect();
    ensure!(
        got == [
            ("b", FileKind::Dir),
            ("f.txt", FileKind::File),
            ("link", FileKind::Symlink)
        ],
        "listing {got:?}"
    );
    ensure!(
        entries[1].size == 5 && entries[1].mode == 0o600 && entries[2].size == 3,
        "sizes/modes {:?}",
        entries
            .iter()
            .map(|e| (e.size, format!("{:o}", e.mode)))
            .collect::<Vec<_>>()
    );
    let st = cl.stat(&format!("{d}/a/f.txt")).await.ctx("stat")?;
    ensure!(
        (st.name.as_str(), st.kind, st.size, st.mode) == ("f.txt", FileKind::File, 5, 0o600),
        "stat {st:?}"
    );
    let st = cl.stat(&format!("{d}/a/link")).await.ctx("stat link")?;
    ensure!(
        st.kind == FileKind::Symlink,
        "stat of a symlink: {:?}",
        st.kind
    );
    let st = cl.stat("").await.ctx("stat of the root")?;
    ensure!(st.kind == FileKind::Dir, "the root is a {:?}", st.kind);
    expect_code(
        cl.stat(&format!("{d}/a/nope")).await,
        ErrorCode::NotFound,
        "stat of a missing file",
    )?;
    expect_code(
        cl.list(&format!("{d}/a/f.txt")).await,
        ErrorCode::NotADirectory,
        "list of a file",
    )?;

    // A directory larger than one batch.
    c.sh_ok(
        "mkdir \"$1/many\" && i=0; while [ $i -lt 700 ]; do : > \"$1/many/$i\"; i=$((i+1)); done",
        &[d],
    )
    .await?;
    let many = cl.list(&format!("{d}/many")).await.ctx("list many")?;
    ensure!(many.len() == 700, "{} of 700 entries listed", many.len());

    cl.rename(&format!("{d}/a/f.txt"), &format!("{d}/a/b/c/g.txt"))
        .await
        .ctx("rename")?;
    let via = cl
        .read_to_vec(&format!("{d}/a/link/g.txt"), 100)
        .await
        .ctx("read through a symlink inside")?;
    ensure!(via == b"hello", "read {:?}", shown_bytes(&via));
    expect_code(
        cl.remove(&format!("{d}/a"), false).await,
        ErrorCode::NotEmpty,
        "remove of a full directory",
    )?;
    cl.remove(&format!("{d}/a/link"), false)
        .await
        .ctx("remove symlink")?;
    cl.stat(&format!("{d}/a/b/c/g.txt"))
        .await
        .ctx("removing a symlink removed its target")?;
    cl.remove(&format!("{d}/a"), true).await.ctx("remove -r")?;
    expect_code(
        cl.stat(&format!("{d}/a")).await,
        ErrorCode::NotFound,
        "stat after remove -r",
    )?;
    expect_code(
        cl.remove("", true).await,
        ErrorCode::InvalidPath,
        "remove of the root",
    )?;
    cl.remove(d, true).await.ctx("remove -r")?;
    Ok("mkdir (-p), create-new, list (3 batches), stat, rename, symlink, remove (-r) and their errors".into())
}

/// Lays out the escape suite: `ESC/...` inside the root, `<parent>/agent-check-outside`
/// and `<root>-agent-check-sibling` outside it. Made with exec: file requests are
/// confined.
async fn escape_layout(c: &Check) -> Result<(), String> {
    let outside = format!("{}/{OUTSIDE}", c.parent);
    let sibling = format!("{}-agent-check-sibling", c.root);
    // From ESC, three `..` reach the root's parent (ESC is two levels deep).
    let script = r#"set -e
        esc=$1; outside=$2; sibling=$3; root=$4
        mkdir -p "$outside" "$sibling" "$esc/a/b/c" "$esc/flip"
        echo SECRET > "$outside/secret"
        echo SECRET > "$sibling/file"
        printf inside > "$esc/a/b/c/f"
        printf inside > "$esc/flip/f"
        cd "$esc"
        ln -s / slash
        ln -s ../../.. up
        ln -s ../../../agent-check-outside/secret upfile
        ln -s "$outside/secret" abs
        ln -s "$root/$esc/a/b/c/f" absin
        ln -s ../../../agent-check-outside outdir
        ln -s ../../../agent-check-outside other
        ln -s a/b inner
        ln -s ../../../../../.. a/b/c/over
        ln -s ../../../agent-check-outside/planted-dangling dang
        ln -s /proc/self/root proc
        ln -s loop loop
    "#;
    c.sh_ok(script, &[ESC, &outside, &sibling, &c.root])
        .await
        .map(drop)
}

/// What outside the root looks like: `ls -A` of the outside directory, its secret, and
/// which of the names escapes would have made beside the root exist.
async fn outside_state(c: &Check) -> Result<String, String> {
    c.sh_ok(
        r#"cd "$1" && ls -A && cat secret && cat "$2/file"
           for n in agent-check-newdir agent-check-stolen agent-check-planted; do
             [ ! -e "$3/$n" ] || echo "made $n"; done"#,
        &[
            &format!("{}/{OUTSIDE}", c.parent),
            &format!("{}-agent-check-sibling", c.root),
            &c.parent,
        ],
    )
    .await
}

/// At least 15 ways out of the files root, all refused; legitimate nested paths (also
/// through symlinks that stay inside) work.
async fn escapes(c: &Check) -> CheckResult {
    escape_layout(c).await?;
    let cl = &c.client;
    let (root, parent) = (&c.root, &c.parent);
    let e = |p: &str| format!("{ESC}/{p}");
    let mut attempts = 0u32;
    let mut codes: BTreeMap<String, u32> = BTreeMap::new();
    let mut wrong = Vec::new();
    let mut judge = |what: String, r: Result<(), ClientError>| {
        attempts += 1;
        match r {
            Err(err) => match err.code() {
                Some(code @ (ErrorCode::PathEscape | ErrorCode::InvalidPath)) => {
                    *codes.entry(format!("{code:?}")).or_insert(0) += 1
                }
                _ => wrong.push(format!(
                    "{what}: refused for the wrong reason: {}",
                    describe(&err)
                )),
            },
            Ok(()) => wrong.push(format!("{what}: ALLOWED")),
        }
    };
    let long = "a/".repeat(MAX_PATH / 2 + 50);
    let reads = [
        format!("../{OUTSIDE}/secret"),
        "/etc/passwd".into(),
        format!("{BASE}/../../{OUTSIDE}/secret"),
        e("a/b/c/../../../../../../agent-check-outside/secret"),
        e("a\0b"),
        e("slash/etc/passwd"),
        e("up/agent-check-outside/secret"),
        e("upfile"),
        e("abs"),
        e("absin"),
        e("outdir/secret"),
        e("a/b/c/over/agent-check-outside/secret"),
        e("inner/../../../../../agent-check-outside/secret"),
        e("proc/etc/passwd"),
        e("loop"),
        format!("{parent}/{OUTSIDE}/secret"),
        format!("{root}/../{OUTSIDE}/secret"),
        format!("{root}-agent-check-sibling/file"),
        "..".into(),
        long,
    ];
    for p in &reads {
        let r = cl.read_to_vec(p, 1 << 20).await.map(drop);
        judge(format!("read {:?}", shown(p, 60)), r);
    }
    for p in [e("up"), "/tmp".into(), "..".into(), e("outdir"), e("slash")] {
        let r = cl.list(&p).await.map(drop);
        judge(format!("list {p:?}"), r);
    }
    for p in [
        format!("../{OUTSIDE}"),
        e("outdir/secret"),
        e("up/agent-check-outside"),
        "/etc".into(),
    ] {
        let r = cl.stat(&p).await.map(drop);
        judge(format!("stat {p:?}"), r);
    }
    for p in [
        e("dang"),
        e("outdir/planted"),
        e("up/agent-check-outside/planted"),
        e("a/b/c/over/agent-check-outside/planted"),
        e("abs"),
        "../agent-check-planted".into(),
    ] {
        let r = cl.write_bytes(&p, b"owned").await.map(drop);
        judge(format!("write {p:?}"), r);
    }
    for (p, parents) in [
        (e("outdir/newdir"), false),
        (e("up/x/y"), true),
        ("../agent-check-newdir".into(), true),
    ] {
        let r = cl.mkdir(&p, parents).await;
        judge(format!("mkdir {p:?}"), r);
    }
    for p in [
        e("outdir/secret"),
        format!("../{OUTSIDE}"),
        e("up/agent-check-outside/secret"),
        "/etc/hostname".into(),
    ] {
        let r = cl.remove(&p, true).await;
        judge(format!("remove {p:?}"), r);
    }
    for (from, to) in [
        (e("a/b/c/f"), "../agent-check-stolen".to_string()),
        (e("outdir/secret"), format!("{BASE}/stolen")),
        (e("a/b/c/f"), e("outdir/stolen")),
        ("/etc/hostname".into(), format!("{BASE}/stolen")),
    ] {
        let r = cl.rename(&from, &to).await;
        judge(format!("rename {from:?} {to:?}"), r);
    }
    ensure!(
        wrong.is_empty(),
        "{} of {attempts} attempts not refused as escapes: {}",
        wrong.len(),
        wrong.join("; ")
    );
    ensure!(
        codes.contains_key("InvalidPath") && codes.contains_key("PathEscape"),
        "expected both PathEscape and InvalidPath among {codes:?}"
    );
    let state = outside_state(c).await?;
    ensure!(
        state == "secret\nSECRET\nSECRET\n",
        "outside the root changed: {:?}",
        shown(&state, 200)
    );

    // Legitimate nested paths, through symlinks that stay inside too.
    let mut fine = 0;
    for p in [
        e("a/b/c/f"),
        e("inner/c/f"),
        e("a/./b/../b/c/f"),
        e("inner/../b/c/f"),
        format!("{root}/{ESC}/a/b/c/f"),
    ] {
        let got = cl.read_to_vec(&p, 100).await.ctx(&format!("read {p:?}"))?;
        ensure!(got == b"inside", "{p:?} read {:?}", shown_bytes(&got));
        fine += 1;
    }
    cl.mkdir(&e("inner/c/d/e"), true)
        .await
        .ctx("mkdir -p through a symlink inside")?;
    cl.write_bytes(&e("inner/c/d/e/new"), b"n")
        .await
        .ctx("write through a symlink inside")?;
    cl.rename(&e("inner/c/d/e/new"), &e("a/moved"))
        .await
        .ctx("rename through a symlink inside")?;
    let st = cl.stat(&e("a/moved")).await.ctx("stat")?;
    ensure!(st.size == 1, "moved file has {} bytes", st.size);
    fine += 4;
    // Removing a symlink that points outside removes the link only.
    cl.remove(&e("outdir"), true)
        .await
        .ctx("remove of a symlink to outside")?;
    let state = outside_state(c).await?;
    ensure!(
        state == "secret\nSECRET\nSECRET\n",
        "removing a symlink changed its target: {:?}",
        shown(&state, 200)
    );
    fine += 1;
    Ok(format!(
        "{attempts} escape attempts refused ({}), outside untouched; {fine} legitimate \
         operations on nested paths worked",
        codes
            .iter()
            .map(|(k, v)| format!("{v} {k}"))
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

/// A process in the guest swaps `flip` between a directory inside and a symlink to
/// outside while files requests go through it: nothing outside is read or made.
async fn swap_race(c: &Check) -> CheckResult {
    let flip = format!("{ESC}/flip");
    let cl = &c.client;
    // Start clean whatever the previous check left.
    cl.stat(&format!("{ESC}/other"))
        .await
        .ctx("the escape layout is missing")?;
    let mut req = sh(
        r#"cd "$1" || exit 1; n=0
           while [ ! -e stop ]; do
             mv flip tmpd && mv other flip && mv flip other && mv tmpd flip || exit 3
             n=$((n+1))
           done
           echo "$n""#,
        &[ESC],
    );
    req.timeout_ms = Some(150_000);
    let swapper = {
        let client = cl.clone();
        tokio::spawn(async move { client.exec_output(req, None, 4096).await })
    };
    let t = Instant::now();
    let (mut inside, mut escaped, mut missing, mut i) = (0u32, 0u32, 0u32, 0u32);
    let mut bad = None;
    while (i < 100 || inside < 3 || escaped < 3) && t.elapsed() < Duration::from_secs(60) {
        if swapper.is_finished() {
            break;
        }
        match cl.read_to_vec(&format!("{flip}/f"), 4096).await {
            Ok(d) if d == b"inside" => inside += 1,
            Ok(d) => {
                bad = Some(format!(
                    "read through the swapped-in symlink: {:?}",
                    shown_bytes(&d)
                ));
                break;
            }
            Err(e) => match e.code() {
                Some(ErrorCode::PathEscape) => escaped += 1,
                Some(ErrorCode::NotFound | ErrorCode::NotADirectory) => missing += 1,
                _ => {
                    bad = Some(format!("unexpected error {}", describe(&e)));
                    break;
                }
            },
        }
        let _ = cl.write_bytes(&format!("{flip}/planted{i}"), b"x").await;
        let _ = cl.mkdir(&format!("{flip}/dir{i}"), false).await;
        i += 1;
    }
    cl.write_bytes(&format!("{ESC}/stop"), b"")
        .await
        .ctx("stop the swapper")?;
    let out = swapper
        .await
        .map_err(|e| format!("swapper task: {e}"))?
        .ctx("swapper")?;
    ensure!(
        out.exit.code == Some(0),
        "the swapper ended {:?}: {}",
        out.exit,
        shown_bytes(&out.stderr)
    );
    let swaps = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if let Some(b) = bad {
        return Err(b);
    }
    let state = outside_state(c).await?;
    ensure!(
        state == "secret\nSECRET\nSECRET\n",
        "made or changed outside the root: {:?}",
        shown(&state, 300)
    );
    ensure!(
        inside > 0 && escaped > 0,
        "the race never hit one side in {i} rounds: {inside} inside, {escaped} refused"
    );
    Ok(format!(
        "{} swap cycles; {i} rounds: {inside} reads inside, {escaped} refused as escapes, \
         {missing} between swaps; nothing made outside",
        shown(&swaps, 20)
    ))
}

/// Percentile `p` (nearest rank) of sorted `v`.
fn pct(v: &[u64], p: usize) -> u64 {
    let rank = (v.len() * p).div_ceil(100).max(1);
    v[rank - 1]
}

/// `true`, `runs` times, each on a new connection as the client does it: from the
/// request to the exit event. Also the part up to `ExecStarted` (connect, request,
/// spawn) and the agent's own spawn-to-exit time.
async fn bench_exec(c: &Check, runs: usize) -> CheckResult {
    let req = || {
        let mut r = cmd("true", &[]);
        r.timeout_ms = Some(60_000);
        r
    };
    for _ in 0..3 {
        c.run(req(), 64).await?;
    }
    let (mut total, mut started, mut agent) = (
        Vec::with_capacity(runs),
        Vec::with_capacity(runs),
        Vec::with_capacity(runs),
    );
    for _ in 0..runs {
        let t = Instant::now();
        let s = c.client.exec(req()).await.ctx("exec true")?;
        let t_started = t.elapsed();
        let out = s.collect(64).await.ctx("exec true")?;
        total.push(t.elapsed().as_micros() as u64);
        started.push(t_started.as_micros() as u64);
        agent.push(out.exit.duration_us);
        ensure!(out.exit.code == Some(0), "true ended {:?}", out.exit);
    }
    for v in [&mut total, &mut started, &mut agent] {
        v.sort_unstable();
    }
    let line = format!(
        "BENCH exec_rt_us p50={} p99={} n={runs} min={} max={} started_p50={} \
         agent_spawn_to_exit_p50={}",
        pct(&total, 50),
        pct(&total, 99),
        total[0],
        total[total.len() - 1],
        pct(&started, 50),
        pct(&agent, 50),
    );
    println!("{line}");
    Ok(line.trim_start_matches("BENCH ").to_string())
}

/// Yields `total` bytes by repeating `block` (no memory beyond it).
struct Repeat {
    block: Vec<u8>,
    at: usize,
    left: u64,
}

impl AsyncRead for Repeat {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        let n = buf
            .remaining()
            .min(this.block.len() - this.at)
            .min(usize::try_from(this.left).unwrap_or(usize::MAX));
        buf.put_slice(&this.block[this.at..this.at + n]);
        this.at = (this.at + n) % this.block.len();
        this.left -= n as u64;
        Poll::Ready(Ok(()))
    }
}

/// Writes then reads an `mib` MiB file; MiB/s each way.
async fn bench_throughput(c: &Check, mib: u64) -> CheckResult {
    let path = "agent-check/throughput";
    let len = mib << 20;
    let mut src = Repeat {
        block: noise(1 << 20, 99),
        at: 0,
        left: len,
    };
    let t = Instant::now();
    let n = c
        .client
        .write_file(path, WriteOptions::default(), &mut src)
        .await
        .ctx("write")?;
    let w = t.elapsed().as_secs_f64();
    ensure!(n == len, "wrote {n} of {len} bytes");
    let t = Instant::now();
    let mut r = c.client.read_file(path, 0, None).await.ctx("read")?;
    while r.next_chunk().await.ctx("read chunk")?.is_some() {
        ensure!(r.received() <= len, "more than {len} bytes");
    }
    let rd = t.elapsed().as_secs_f64();
    ensure!(r.received() == len, "read {} of {len} bytes", r.received());
    c.client.remove(path, false).await.ctx("remove")?;
    let (wm, rm) = (mib as f64 / w, mib as f64 / rd);
    println!("BENCH file_write_mib_s={wm:.1} mib={mib} secs={w:.2}");
    println!("BENCH file_read_mib_s={rm:.1} mib={mib} secs={rd:.2}");
    Ok(format!(
        "{mib} MiB: write {wm:.1} MiB/s, read {rm:.1} MiB/s"
    ))
}

async fn cleanup(c: &Check) -> CheckResult {
    c.sh_ok(
        "rm -rf \"$1\" \"$2\" \"$3\"",
        &[
            BASE,
            &format!("{}/{OUTSIDE}", c.parent),
            &format!("{}-agent-check-sibling", c.root),
        ],
    )
    .await?;
    Ok("removed what the checks made".into())
}
