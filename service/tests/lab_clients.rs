//! The client surface against a real `sproutd` serving Linux sandboxes from
//! the emulated lab (docs/cli.md, docs/sdk.md): the `sprout` CLI's whole
//! sandbox life (exec with stdin and status, background processes and
//! attach, `cp` of 32 MiB both ways, files, ports, fork, ls, rm, its
//! errors), then the Python SDK's pytest suite (sdk/python/tests) against
//! the same sproutd.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use sha2::{Digest as _, Sha256};

mod common;
use common::lab::{lab, Hosted};

fn spawn(base: &str, args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_sprout"))
        .arg("--url")
        .arg(base)
        .args(args)
        .env_remove("SPROUT_API_KEY")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run sprout")
}

/// `sprout ARGS` with `stdin` fed from another thread (it may be large).
fn sprout_in(base: &str, args: &[&str], stdin: Vec<u8>) -> Output {
    let mut c = spawn(base, args);
    let mut i = c.stdin.take().unwrap();
    let feeder = std::thread::spawn(move || {
        // (A command that stops reading is no failure here.)
        let _ = i.write_all(&stdin);
    });
    let o = c.wait_with_output().unwrap();
    feeder.join().unwrap();
    o
}

fn ok(base: &str, args: &[&str]) -> String {
    let o = sprout_in(base, args, Vec::new());
    assert!(
        o.status.success(),
        "sprout {args:?}: {}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

fn json(base: &str, args: &[&str]) -> Value {
    let mut a = vec!["--json"];
    a.extend_from_slice(args);
    let out = ok(base, &a);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("sprout {args:?}: {e}: {out}"))
}

/// Exits 1 with a `sprout: error:` line that says `says`.
fn refused(base: &str, args: &[&str], says: &str) -> String {
    let o = sprout_in(base, args, Vec::new());
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "sprout {args:?}: {err}");
    assert!(
        err.starts_with("sprout: error: ") && err.contains(says),
        "sprout {args:?}: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    err
}

fn sha256(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// `sprout exec` (docs/cli.md) against the lab's sproutd: piped stdin goes
/// to the command, its stdout and stderr come back apart, its exit status
/// is sprout's; and output shows while the command still runs.
fn exec_streams_feeds_stdin_and_passes_its_status(base: &str, vm: &str) {
    let sprout = |args: &[&str]| spawn(base, args);
    let mut child = sprout(&[
        "exec",
        vm,
        "--",
        "sh",
        "-c",
        "cat; echo to-stderr >&2; exit 3",
    ]);
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"piped in\n")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert_eq!(o.status.code(), Some(3), "{out}\n{err}");
    assert_eq!(out, "piped in\n");
    assert_eq!(err, "to-stderr\n");

    // The first line arrives while the command still sleeps.
    let mut child = sprout(&[
        "exec",
        vm,
        "--",
        "sh",
        "-c",
        "echo first; sleep 20; echo second",
    ]);
    drop(child.stdin.take());
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "first");
    assert!(
        child.try_wait().unwrap().is_none(),
        "sprout had ended before the command's first line was read"
    );
    assert_eq!(lines.next().unwrap().unwrap(), "second");
    assert!(child.wait().unwrap().success());
}

/// A stdin longer than one request holds (2 MiB, past the inline 256 KiB)
/// is streamed to the command as it is read, all of it, and the command's
/// status still comes back.
fn a_long_stdin_is_streamed(base: &str, vm: &str) {
    let input: Vec<u8> = (0..2u32 << 20).map(|i| (i % 251) as u8).collect();
    let o = sprout_in(
        base,
        &[
            "exec",
            vm,
            "--",
            "sh",
            "-c",
            "sha256sum | cut -d' ' -f1; exit 5",
        ],
        input.clone(),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(5), "{err}");
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        sha256(&input),
        "{err}"
    );
}

/// `exec -d` prints an exec id; `ps` lists the process; `attach` prints
/// its whole output and exits with its status (also after it ended, and
/// from an event id on); `kill` ends one (its status: 128 + 9).
fn background_processes_are_listed_attached_and_killed(base: &str, vm: &str) {
    let ex = ok(
        base,
        &[
            "exec",
            "-d",
            vm,
            "--",
            "sh",
            "-c",
            "echo one; sleep 2; echo two >&2; exit 7",
        ],
    );
    let ex = ex.trim().to_owned();
    assert!(ex.parse::<u64>().is_ok(), "an exec id: {ex:?}");
    let ps = json(base, &["ps", vm]);
    let p = ps["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["execId"].as_u64() == ex.parse().ok())
        .unwrap_or_else(|| panic!("exec {ex} in {ps}"));
    assert!(p["command"].as_str().unwrap().contains("echo one"), "{p}");
    let o = sprout_in(base, &["attach", vm, &ex], Vec::new());
    assert_eq!(o.status.code(), Some(7), "{o:?}");
    assert_eq!(String::from_utf8_lossy(&o.stdout), "one\n");
    assert_eq!(String::from_utf8_lossy(&o.stderr), "two\n");
    // Ended: attach replays what was kept, and its status.
    let o = sprout_in(base, &["attach", vm, &ex], Vec::new());
    assert_eq!(o.status.code(), Some(7), "{o:?}");
    assert_eq!(String::from_utf8_lossy(&o.stdout), "one\n");
    // After its first event: only the rest.
    let o = sprout_in(base, &["attach", vm, &ex, "--after", "1"], Vec::new());
    assert_eq!(o.status.code(), Some(7), "{o:?}");
    assert_eq!(String::from_utf8_lossy(&o.stdout), "");
    assert_eq!(String::from_utf8_lossy(&o.stderr), "two\n");
    let ps = ok(base, &["ps", vm]);
    assert!(ps.starts_with("EXEC") && ps.contains("exit 7"), "{ps}");

    let ex = ok(base, &["exec", "-d", vm, "--", "sleep", "600"]);
    let ex = ex.trim();
    let v = json(base, &["kill", vm, ex, "-s", "KILL"]);
    assert_eq!(v["signal"], 9, "{v}");
    let o = sprout_in(base, &["attach", vm, ex], Vec::new());
    assert_eq!(o.status.code(), Some(128 + 9), "{o:?}");
    refused(base, &["attach", vm, "999999"], "process_not_found");
    refused(base, &["kill", vm, ex, "-s", "NOPE"], "Unknown signal");
}

/// `cp` of 32 MiB into the sandbox and back, to a file, a directory and
/// stdout: the same bytes each way (and in the guest, by its own
/// sha256sum); `files ls|mkdir|rm`; a missing file is an error that
/// leaves no partial file.
fn cp_copies_32_mib_both_ways(base: &str, vm: &str, dir: &Path) {
    let mut big = vec![0u8; 32 << 20];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for b in big.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let want = sha256(&big);
    let local = dir.join("big.bin");
    std::fs::write(&local, &big).unwrap();
    let local_s = local.to_str().unwrap();

    let v = json(base, &["files", "mkdir", vm, "in/deep", "-p"]);
    assert_eq!(v["created"], true, "{v}");
    let t = Instant::now();
    let o = sprout_in(
        base,
        &["cp", "--progress", local_s, &format!("{vm}:in/deep/")],
        Vec::new(),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("100.0%") && err.contains("32.0/32.0 MiB"),
        "progress: {err}"
    );
    eprintln!("cp 32 MiB in: {:?}", t.elapsed());
    let ls = json(base, &["files", "ls", vm, "in/deep"]);
    let e = &ls["entries"][0];
    assert_eq!(
        (e["name"].as_str(), e["size"].as_u64()),
        (Some("big.bin"), Some(32 << 20)),
        "{ls}"
    );
    let table = ok(base, &["files", "ls", vm, "in"]);
    assert!(table.contains("dir") && table.contains("deep/"), "{table}");
    let o = sprout_in(
        base,
        &["exec", vm, "--", "sha256sum", "in/deep/big.bin"],
        Vec::new(),
    );
    assert!(
        String::from_utf8_lossy(&o.stdout).starts_with(&want),
        "{o:?}"
    );

    let back = dir.join("back");
    std::fs::create_dir(&back).unwrap();
    let t = Instant::now();
    let v = json(
        base,
        &[
            "cp",
            &format!("{vm}:in/deep/big.bin"),
            &format!("{}/", back.display()),
        ],
    );
    eprintln!("cp 32 MiB out: {:?}", t.elapsed());
    assert_eq!(v["bytes"], 32 << 20, "{v}");
    assert_eq!(sha256(&std::fs::read(back.join("big.bin")).unwrap()), want);
    let o = sprout_in(
        base,
        &["cp", &format!("{vm}:in/deep/big.bin"), "-"],
        Vec::new(),
    );
    assert!(o.status.success(), "{o:?}");
    assert_eq!(sha256(&o.stdout), want, "to stdout");
    // From stdin, to a named file.
    let o = sprout_in(
        base,
        &["cp", "-", &format!("{vm}:from-stdin.txt")],
        b"hello\n".to_vec(),
    );
    assert!(o.status.success(), "{o:?}");
    let o = sprout_in(
        base,
        &["cp", &format!("{vm}:from-stdin.txt"), "-"],
        Vec::new(),
    );
    assert_eq!(o.stdout, b"hello\n");

    let missing = dir.join("missing.txt");
    refused(
        base,
        &["cp", &format!("{vm}:nope.txt"), missing.to_str().unwrap()],
        "file_not_found",
    );
    assert!(!missing.exists());
    let leftovers: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains(".sprout-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    refused(
        base,
        &["cp", &format!("{vm}:../etc/passwd"), "-"],
        "path_escape",
    );
    refused(base, &["cp", local_s, "also-local"], "neither");
    refused(
        base,
        &["cp", dir.to_str().unwrap(), &format!("{vm}:x")],
        "not a regular file",
    );
    let v = json(base, &["files", "rm", vm, "in", "-r"]);
    assert_eq!(v["deleted"], true, "{v}");
    refused(base, &["files", "ls", vm, "in"], "file_not_found");
}

/// An upgrade (as WebSocket's) answered `101`, then an echo of every byte.
const UPGRADE_ECHO: &str = r#"
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 8001))
s.listen(4)
while True:
    c, _ = s.accept()
    buf = b""
    while b"\r\n\r\n" not in buf:
        d = c.recv(4096)
        if not d:
            break
        buf += d
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n")
    while True:
        d = c.recv(4096)
        if not d:
            break
        c.sendall(d)
    c.close()
"#;

/// `curl` of `url` to `out`: its HTTP status.
fn curl(url: &str, out: &Path) -> u16 {
    let o = Command::new("curl")
        .args(["-sS", "--max-time", "300", "-o"])
        .arg(out)
        .args(["-w", "%{http_code}", url])
        .output()
        .expect("run curl");
    String::from_utf8_lossy(&o.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("curl {url}: {o:?}"))
}

/// `ports open` of a guest `python3 -m http.server`: curl (which resolves
/// `*.localhost` to loopback) downloads 16 MiB through the URL, the same
/// bytes as the guest's; the guest's own 404 passes; an upgrade is carried
/// both ways; `ports close` closes the URL.
fn ports_serve_a_guest_http_server(base: &str, vm: &str, dir: &Path) {
    let hash = ok(
        base,
        &[
            "exec",
            vm,
            "--",
            "sh",
            "-c",
            "mkdir -p www && head -c 16777216 /dev/urandom > www/big && sha256sum www/big",
        ],
    );
    let hash = hash.split_whitespace().next().unwrap().to_owned();
    ok(
        base,
        &[
            "exec",
            "-d",
            vm,
            "--",
            "sh",
            "-c",
            "cd /workspace/www && exec python3 -m http.server 8000",
        ],
    );
    let url = ok(base, &["ports", "open", vm, "8000"]).trim().to_owned();
    let port = base.rsplit(':').next().unwrap();
    assert_eq!(url, format!("http://8000-{vm}.localhost:{port}/"));
    let out = dir.join("big");
    let t = Instant::now();
    loop {
        match curl(&format!("{url}big"), &out) {
            200 => break,
            // Until the server listens.
            502 => {
                let e = std::fs::read_to_string(&out).unwrap_or_default();
                assert!(e.contains("\"port_not_listening\""), "{e}");
            }
            st => panic!(
                "{st}: {}",
                std::fs::read_to_string(&out).unwrap_or_default()
            ),
        }
        assert!(
            t.elapsed() < Duration::from_secs(180),
            "the server never answered"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let got = std::fs::read(&out).unwrap();
    assert_eq!(got.len(), 16 << 20);
    assert_eq!(
        sha256(&got),
        hash,
        "the download differs from the guest's file"
    );
    eprintln!(
        "ports: 16 MiB through the URL in {:?} (with the server's start)",
        t.elapsed()
    );
    assert_eq!(curl(&format!("{url}no-such-file"), &out), 404);
    let page = std::fs::read_to_string(&out).unwrap();
    assert!(
        page.contains("File not found"),
        "the guest's own page: {page}"
    );

    // An upgrade: 101, then bytes both ways on the same connection.
    sprout_in(
        base,
        &["cp", "-", &format!("{vm}:echo.py")],
        UPGRADE_ECHO.into(),
    );
    ok(
        base,
        &["exec", "-d", vm, "--", "python3", "/workspace/echo.py"],
    );
    ok(base, &["ports", "open", vm, "8001", "--public"]);
    let addr = base.trim_start_matches("http://");
    let t = Instant::now();
    let mut c = loop {
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        write!(
            c,
            "GET /ws HTTP/1.1\r\nHost: 8001-{vm}.localhost:{port}\r\nConnection: Upgrade\r\n\
             Upgrade: echo\r\n\r\n"
        )
        .unwrap();
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            assert_eq!(
                c.read(&mut b).unwrap(),
                1,
                "{}",
                String::from_utf8_lossy(&head)
            );
            head.push(b[0]);
        }
        let head = String::from_utf8_lossy(&head).into_owned();
        if head.starts_with("HTTP/1.1 101") {
            assert!(
                head.to_ascii_lowercase().contains("upgrade: echo"),
                "{head}"
            );
            break c;
        }
        assert!(head.starts_with("HTTP/1.1 502"), "{head}");
        assert!(t.elapsed() < Duration::from_secs(180), "no upgrade: {head}");
        std::thread::sleep(Duration::from_millis(500));
    };
    for word in ["ping\n", "and more bytes\n"] {
        c.write_all(word.as_bytes()).unwrap();
        let mut back = vec![0u8; word.len()];
        c.read_exact(&mut back).unwrap();
        assert_eq!(back, word.as_bytes());
    }
    drop(c);

    let ls = ok(base, &["ports", "ls", vm]);
    assert!(
        ls.starts_with("PORT") && ls.contains("8001") && ls.contains("yes"),
        "{ls}"
    );
    ok(base, &["ports", "close", vm, "8000"]);
    assert_eq!(curl(&format!("{url}big"), &out), 404);
    let e: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(e["error"]["code"], "port_not_open", "{e}");
    refused(base, &["ports", "close", vm, "8000"], "port_not_open");
}

/// tests/dashboard/check.py (headless Chromium) on a Linux sandbox with a
/// file and a background process: its processes and files show, and
/// Pause, Resume and Fork 2 work from the page. `SPROUT_UPDATE_SCREENSHOT=1`
/// keeps the detail page's screenshot as docs/dashboard.png.
fn the_dashboard_shows_a_linux_sandbox(base: &str, dir: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = match std::env::var("SPROUT_DASHBOARD_PY") {
        Ok(p) if !p.is_empty() => p,
        _ => {
            let o = Command::new(root.join("tests/dashboard/install.sh"))
                .stderr(Stdio::inherit())
                .output()
                .expect("run tests/dashboard/install.sh");
            assert!(o.status.success(), "tests/dashboard/install.sh failed");
            String::from_utf8(o.stdout).unwrap().trim().to_owned()
        }
    };
    let v = json(
        base,
        &[
            "create",
            "--cpus",
            "1",
            "--memory",
            "256",
            "--meta",
            "team=dashboard",
            "--meta",
            "run=lab",
        ],
    );
    let vm = v["vmId"].as_str().unwrap().to_owned();
    let notes = dir.join("notes.txt");
    std::fs::write(&notes, "hello from the host\n").unwrap();
    ok(
        base,
        &["cp", notes.to_str().unwrap(), &format!("{vm}:notes.txt")],
    );
    ok(base, &["files", "mkdir", &vm, "data"]);
    ok(
        base,
        &[
            "exec",
            "-d",
            &vm,
            "--",
            "sh",
            "-c",
            "echo serving; exec sleep 600",
        ],
    );
    let shot = dir.join("dashboard.png");
    let o = Command::new(&python)
        .arg(root.join("tests/dashboard/check.py"))
        .arg(base)
        .arg(&shot)
        .args(["--vm", &vm])
        .output()
        .expect("run tests/dashboard/check.py");
    assert!(
        o.status.success(),
        "check.py: {}\n{}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        std::fs::metadata(&shot).unwrap().len() > 10_000,
        "a screenshot"
    );
    if std::env::var_os("SPROUT_UPDATE_SCREENSHOT").is_some_and(|v| v == "1") {
        std::fs::copy(&shot, root.join("docs/dashboard.png")).unwrap();
    }
    // The sandbox and the two children its page forked.
    let ls = json(base, &["ls"]);
    let kids: Vec<&str> = ls["vms"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["parentVmId"] == vm.as_str())
        .map(|s| s["vmId"].as_str().unwrap())
        .collect();
    assert_eq!(kids.len(), 2, "{ls}");
    let mut rm = vec!["rm", vm.as_str()];
    rm.extend(kids);
    ok(base, &rm);
}

#[test]
fn the_cli_and_the_python_sdk_drive_linux_sandboxes_in_the_lab() {
    let lab = lab();
    let t = tempfile::tempdir().unwrap();
    let data = t.path().join("data");
    let t0 = Instant::now();
    let h = Hosted::start_with(&lab, &data, 3072, &[]);
    let b = h.base.as_str();
    eprintln!("[{:?}] the lab serves on {b}", t0.elapsed());

    let v = json(
        b,
        &[
            "create",
            "--cpus",
            "1",
            "--memory",
            "256",
            "--meta",
            "suite=clients",
        ],
    );
    let vm = v["vmId"].as_str().unwrap().to_owned();
    assert_eq!(v["state"], "running", "{v}");
    eprintln!("[{:?}] created {vm}", t0.elapsed());
    exec_streams_feeds_stdin_and_passes_its_status(b, &vm);
    a_long_stdin_is_streamed(b, &vm);
    eprintln!("[{:?}] background processes", t0.elapsed());
    background_processes_are_listed_attached_and_killed(b, &vm);
    eprintln!("[{:?}] cp", t0.elapsed());
    cp_copies_32_mib_both_ways(b, &vm, t.path());
    eprintln!("[{:?}] ports", t0.elapsed());
    ports_serve_a_guest_http_server(b, &vm, t.path());

    eprintln!("[{:?}] fork -n 2", t0.elapsed());
    let v = json(b, &["fork", &vm, "-n", "2"]);
    let kids: Vec<String> = v["forks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["vmId"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(kids.len(), 2, "{v}");
    let ls = json(b, &["ls", "--meta", "suite=clients"]);
    let listed = ls["vms"].as_array().unwrap();
    for k in &kids {
        let c = listed
            .iter()
            .find(|s| s["vmId"] == k.as_str())
            .unwrap_or_else(|| panic!("{k} in {ls}"));
        assert_eq!(c["parentVmId"], vm.as_str(), "{c}");
    }
    // A child has its parent's files.
    let o = sprout_in(
        b,
        &["cp", &format!("{}:from-stdin.txt", kids[0]), "-"],
        Vec::new(),
    );
    assert_eq!(o.stdout, b"hello\n", "{o:?}");
    let mut rm = vec!["rm", vm.as_str()];
    rm.extend(kids.iter().map(String::as_str));
    ok(b, &rm);
    let ls = json(b, &["ls", "--meta", "suite=clients"]);
    assert_eq!(ls["vms"].as_array().unwrap().len(), 0, "{ls}");
    refused(b, &["get", &vm], "vm_not_found");
    refused(b, &["create", "--cpus", "0"], "cpus");
    eprintln!("[{:?}] the Python SDK's tests", t0.elapsed());

    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut py = Command::new(root.join("sdk/python/tests/run.sh"))
        .arg(b)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("run sdk/python/tests/run.sh");
    let mut report = String::new();
    for l in BufReader::new(py.stdout.take().unwrap()).lines() {
        let l = l.unwrap();
        eprintln!("pytest: {l}");
        report.push_str(&l);
        report.push('\n');
    }
    let st = py.wait().unwrap();
    assert!(st.success(), "the SDK's tests failed ({st}):\n{report}");

    eprintln!("[{:?}] the dashboard on a Linux sandbox", t0.elapsed());
    the_dashboard_shows_a_linux_sandbox(b, t.path());
    eprintln!("[{:?}] stopping the lab", t0.elapsed());
    let st = h.interrupt();
    assert!(st.success(), "sproutd exited {st}");
    let mut s = String::new();
    let _ = std::fs::File::open(data.with_extension("log")).map(|mut f| f.read_to_string(&mut s));
    assert!(!s.contains("panicked"), "{s}");
}
