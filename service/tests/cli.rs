//! The `sprout` binary: bad input is refused with a clear message and a
//! non-zero status (never a panic); the test guest boots, runs its self-test
//! and resets, and `sprout` exits 0.

use std::process::{Command, Output};

fn sprout(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sprout"))
        .args(args)
        .output()
        .expect("run sprout")
}

fn refused(args: &[&str], says: &str) {
    let out = sprout(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} should fail");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(err.contains(says), "{args:?}: expected {says:?} in: {err}");
}

fn scratch(name: &str, contents: &[u8]) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("sprout-cli-{}-{name}", std::process::id()));
    std::fs::write(&p, contents).unwrap();
    p
}

#[test]
fn bad_input_is_refused_clearly() {
    let tg = testguest_build::TESTGUEST_PATH;
    refused(
        &["vm", "run", "--kernel", "/nonexistent/vmlinux"],
        "does not exist",
    );
    refused(
        &["vm", "run", "--kernel", tg, "--memory-mib", "0"],
        "128 to 8192",
    );
    refused(
        &["vm", "run", "--kernel", tg, "--memory-mib", "100000"],
        "128 to 8192",
    );
    refused(&["vm", "run", "--kernel", tg, "--cpus", "9"], "1 to 4");
    refused(&["vm", "run", "--kernel", tg, "--cpus", "0"], "1 to 4");
    let text = scratch("notakernel", b"#!/bin/sh\necho hello\n");
    refused(
        &["vm", "run", "--kernel", text.to_str().unwrap()],
        "not a kernel",
    );
    let odd = scratch("odd.img", &[0u8; 1000]);
    refused(
        &[
            "vm",
            "run",
            "--kernel",
            tg,
            "--image",
            odd.to_str().unwrap(),
        ],
        "not a multiple of 512",
    );
    refused(
        &["vm", "run", "--kernel", tg, "--image", "/nonexistent.img"],
        "does not exist",
    );
    refused(
        &[
            "vm",
            "run",
            "--kernel",
            tg,
            "--vsock-cid",
            "2",
            "--vsock-uds",
            "/tmp/x.sock",
        ],
        "CID",
    );
    let _ = std::fs::remove_file(text);
    let _ = std::fs::remove_file(odd);
}

#[test]
fn agent_commands_are_refused_clearly_without_an_agent() {
    let tg = testguest_build::TESTGUEST_PATH;
    refused(
        &["vm", "run", "--kernel", tg, "--exec", "true"],
        "need a Linux guest",
    );
    refused(
        &["vm", "run", "--kernel", tg, "--vsock-uds", "/tmp/x.sock"],
        "--vsock-cid",
    );
    refused(
        &["vm", "run", "--put", "nocolon", "--exec", "true"],
        "is not SOURCE:DESTINATION",
    );
    refused(&["vm", "exec", "--exec", "true"], "--api-sock");
    let t = std::time::Instant::now();
    refused(
        &[
            "vm",
            "exec",
            "--vsock-uds",
            "/nonexistent/v.sock",
            "--exec",
            "true",
        ],
        "No VM listens on /nonexistent/v.sock",
    );
    assert!(t.elapsed() < std::time::Duration::from_secs(15));
    refused(
        &[
            "vm",
            "exec",
            "--api-sock",
            "/nonexistent/api.sock",
            "--exec",
            "true",
        ],
        "Cannot connect to /nonexistent/api.sock",
    );
}

#[test]
fn selftest_boots_runs_and_exits_zero() {
    let out = sprout(&[
        "vm",
        "run",
        "--kernel",
        "testguest",
        "--cpus",
        "2",
        "--rng",
        "--cmdline",
        "selftest",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {stderr}");
    assert!(stdout.contains("selftest: done"), "stdout: {stdout}");
    assert!(!stdout.contains("FAIL"), "stdout: {stdout}");
    assert!(stderr.contains("guest reset"), "stderr: {stderr}");
}

fn ctl(sock: &std::path::Path, words: &[&str]) -> (bool, String, String) {
    let mut args = vec!["vm", "ctl", "--api-sock", sock.to_str().unwrap()];
    args.extend_from_slice(words);
    let out = sprout(&args);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).trim().to_string(),
    )
}

#[test]
fn control_socket_drives_a_running_vm() {
    let sock = std::env::temp_dir().join(format!("sprout-cli-{}-api.sock", std::process::id()));
    let mut child = start_vm(&["vm", "run", "--kernel", "testguest"], &sock);
    assert_eq!(ctl(&sock, &["status"]).1, "running");
    // CMD_ECHO (1) of 0x2a on vCPU 0: status 0, rets[0] = 0x2a.
    let (ok, out, err) = ctl(&sock, &["mailbox", "0", "1", "0x2a", "0", "0", "0"]);
    assert!(ok, "{err}");
    assert!(out.starts_with("0 0x2a "), "{out}");
    assert!(ctl(&sock, &["pause"]).0);
    assert_eq!(ctl(&sock, &["status"]).1, "paused");
    assert!(ctl(&sock, &["resume"]).0);
    assert_eq!(ctl(&sock, &["status"]).1, "running");
    let (ok, _, err) = ctl(&sock, &["frobnicate"]);
    assert!(!ok && err.contains("unknown command"), "{err}");
    let (ok, _, err) = ctl(&sock, &["mailbox", "7", "1", "0", "0", "0", "0"]);
    assert!(!ok && err.contains("No vCPU 7"), "{err}");
    assert!(ctl(&sock, &["stop"]).0);
    let status = child.0.wait().unwrap();
    assert!(status.success(), "sprout exit {status:?}");
    assert!(!sock.exists(), "socket file left behind");
}

#[test]
fn snapshot_and_restore_through_the_cli() {
    let tmp = std::env::temp_dir().join(format!("sprout-cli-{}-snap", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    let sock = tmp.join("api.sock");
    let mut child = start_vm(&["vm", "run", "--kernel", "testguest"], &sock);
    // CMD_COUNT (4) by 41 on vCPU 0.
    assert!(ctl(&sock, &["mailbox", "0", "4", "41", "0", "0", "0"]).0);
    let out = tmp.join("snap");
    let snap = |extra: &[&str]| {
        let mut args = vec!["vm", "snapshot", "--api-sock", sock.to_str().unwrap()];
        args.extend_from_slice(extra);
        sprout(&args)
    };
    let o = snap(&["--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // A second snapshot into the same directory is refused, the VM runs on.
    let o = snap(&["--out", out.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("exists"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        sprout(&["vm", "pause", "--api-sock", sock.to_str().unwrap()])
            .status
            .success()
    );
    assert!(
        sprout(&["vm", "resume", "--api-sock", sock.to_str().unwrap()])
            .status
            .success()
    );
    assert!(ctl(&sock, &["mailbox", "0", "4", "1", "0", "0", "0"])
        .1
        .starts_with("0 0x2a "));
    // A diff on top, after the counter moved to 42.
    let diff = tmp.join("diff");
    let o = snap(&["--diff", "--out", diff.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(ctl(&sock, &["stop"]).0);
    assert!(child.0.wait().unwrap().success());

    for (snapdir, count, backend) in [
        (&out, "0x2a", "mmap"),
        (&out, "0x2a", "uffd"),
        (&diff, "0x2b", "uffd"),
    ] {
        let sock2 = tmp.join(format!("{backend}-{count}.sock"));
        let mut r = start_vm(
            &[
                "vm",
                "restore",
                snapdir.to_str().unwrap(),
                "--memory-backend",
                backend,
            ],
            &sock2,
        );
        let (ok, line, err) = ctl(&sock2, &["mailbox", "0", "4", "1", "0", "0", "0"]);
        assert!(ok, "{backend}: {err}");
        assert!(
            line.starts_with(&format!("0 {count} ")),
            "{backend}: counter continues: {line}"
        );
        assert!(ctl(&sock2, &["stop"]).0);
        assert!(r.0.wait().unwrap().success());
    }
    // The test guest has no agent to run a command.
    refused(
        &["vm", "restore", out.to_str().unwrap(), "--exec", "true"],
        "need a Linux guest",
    );
    let bad = sprout(&["vm", "restore", tmp.join("nope").to_str().unwrap()]);
    assert!(!bad.status.success());
    let _ = std::fs::remove_dir_all(&tmp);
}

/// Starts `sprout` with `args` and waits until its control socket `sock` exists.
fn start_vm(args: &[&str], sock: &std::path::Path) -> Reaped {
    let child = Reaped(
        Command::new(env!("CARGO_BIN_EXE_sprout"))
            .args(args)
            .arg("--api-sock")
            .arg(sock)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !sock.exists() {
        assert!(std::time::Instant::now() < deadline, "no API socket");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    child
}

/// A child process that is killed if the test fails before waiting for it.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// SIGKILL of the VMM at random points while it writes a snapshot never
/// leaves a directory that loads as complete: it is absent, or whole.
#[test]
fn a_vmm_killed_mid_snapshot_never_leaves_a_snapshot_that_looks_whole() {
    let tmp = std::env::temp_dir().join(format!("sprout-cli-{}-kill", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    let (mut absent, mut whole) = (0, 0);
    for i in 0..20u64 {
        let sock = tmp.join(format!("k{i}.sock"));
        let mut vm = start_vm(
            &["vm", "run", "--kernel", "testguest", "--memory-mib", "512"],
            &sock,
        );
        // 32 MiB of guest RAM written, so the snapshot takes a while.
        assert!(
            ctl(
                &sock,
                &[
                    "mailbox",
                    "0",
                    "2",
                    "0x1000000",
                    "8192",
                    &i.to_string(),
                    "0"
                ]
            )
            .0
        );
        let dir = tmp.join(format!("snap{i}"));
        let mut snap = Command::new(env!("CARGO_BIN_EXE_sprout"))
            .args([
                "vm",
                "ctl",
                "--api-sock",
                sock.to_str().unwrap(),
                "snapshot",
            ])
            .arg(&dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Kill somewhere between "not started" and "long done".
        std::thread::sleep(std::time::Duration::from_micros((i * 7919 * 7) % 400_000));
        vm.0.kill().unwrap();
        vm.0.wait().unwrap();
        let _ = snap.wait();
        match snapshot::format::Snapshot::load(&dir) {
            Ok(_) => whole += 1,
            Err(e) => {
                assert!(
                    !dir.exists(),
                    "try {i}: {} exists but does not load: {e}",
                    dir.display()
                );
                absent += 1;
            }
        }
    }
    eprintln!("20 kills: {absent} snapshots absent, {whole} complete");
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn fork_through_the_cli_prints_working_child_sockets() {
    let tmp = std::env::temp_dir().join(format!("sprout-cli-{}-fork", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    let sock = tmp.join("p.sock");
    let mut parent = start_vm(&["vm", "run", "--kernel", "testguest"], &sock);
    // CMD_COUNT by 9 in the parent, then fork 3.
    assert!(ctl(&sock, &["mailbox", "0", "4", "9", "0", "0", "0"]).0);
    let out = sprout(&[
        "vm",
        "fork",
        "--api-sock",
        sock.to_str().unwrap(),
        "--count",
        "3",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let socks: Vec<std::path::PathBuf> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(Into::into)
        .collect();
    assert_eq!(socks.len(), 3);
    for (i, s) in socks.iter().enumerate() {
        // Each child continues from the parent's counter on its own.
        let (ok, line, err) = ctl(
            s,
            &["mailbox", "0", "4", &(i + 1).to_string(), "0", "0", "0"],
        );
        assert!(ok, "{err}");
        assert!(line.starts_with(&format!("0 {:#x} ", 9 + i + 1)), "{line}");
    }
    // Each child is its own worker process, not the parent's.
    let pid = |s: &std::path::Path| {
        let (ok, d, err) = ctl(s, &["describe"]);
        assert!(ok, "{err}");
        d.lines()
            .find_map(|l| l.strip_prefix("pid "))
            .expect("describe has a pid")
            .to_string()
    };
    let pids: std::collections::HashSet<String> = socks.iter().map(|s| pid(s)).collect();
    assert_eq!(pids.len(), 3);
    assert!(!pids.contains(&pid(&sock)));
    assert!(!pids.contains(&parent.0.id().to_string()));
    let (ok, _, err) = ctl(&sock, &["fork", "0"]);
    assert!(!ok && err.contains("out of range"), "{err}");
    // The children outlive their parent.
    assert!(ctl(&sock, &["stop"]).0);
    assert!(parent.0.wait().unwrap().success());
    for s in &socks {
        assert!(ctl(s, &["mailbox", "0", "1", "5", "0", "0", "0"]).0);
        assert!(ctl(s, &["stop"]).0);
    }
    let t = std::time::Instant::now();
    while socks.iter().any(|s| s.exists()) {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(30),
            "child sockets stay"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let left: Vec<_> = std::fs::read_dir(&tmp)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    let _ = std::fs::remove_dir_all(&tmp);
}
