//! `sprout create|ls|get|pause|…` against a real `sproutd` on this host,
//! with sandboxes of Sprout's test guest (docs/cli.md). `sprout exec` needs
//! a Linux guest: it is tested against the lab's sproutd
//! (tests/lab_hosted.rs).

mod common;
use common::*;

use std::io::Write as _;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

/// Runs `sprout --url BASE ARGS…` with `stdin`; its output.
fn sprout(base: &str, args: &[&str], stdin: &[u8]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sprout"))
        .arg("--url")
        .arg(base)
        .args(args)
        .env_remove("SPROUT_API_KEY")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run sprout");
    let mut i = child.stdin.take().unwrap();
    i.write_all(stdin).unwrap();
    drop(i);
    child.wait_with_output().unwrap()
}

fn ok(base: &str, args: &[&str]) -> String {
    let o = sprout(base, args, b"");
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

/// Fails with status 1 and a `sprout: error:` line that says `says`.
fn refused(base: &str, args: &[&str], says: &str) {
    let o = sprout(base, args, b"");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "sprout {args:?}: {err}");
    assert!(
        err.starts_with("sprout: error: ") && err.contains(says),
        "sprout {args:?}: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// A sandbox's life through the CLI: create (metadata, shape), ls with a
/// filter, get, pause, resume, snapshot, checkpoint, fork -n 2 (the
/// children list their parent), sleep and wake, rm; tables for people,
/// JSON for scripts.
#[test]
fn a_sandbox_lifecycle_through_the_cli() {
    let (_t, dir) = data_dir();
    let d = Daemon::start(&dir);
    let b = d.base.as_str();
    let v = json(
        b,
        &[
            "create",
            "--image",
            "testguest",
            "--cpus",
            "1",
            "--memory",
            "128",
            "--meta",
            "team=infra",
            "--meta",
            "run=cli",
            "--no-internet",
        ],
    );
    assert_eq!(v["state"], "running", "{v}");
    assert_eq!(v["metadata"]["team"], "infra", "{v}");
    assert_eq!(v["disableInternet"], true, "{v}");
    let id = v["vmId"].as_str().unwrap().to_owned();

    // A table for people: a header and the sandbox's row.
    let table = ok(b, &["ls"]);
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("ID ") && lines[0].contains("STATE"),
        "{table}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with(&id) && l.contains("running") && l.contains("team=infra")),
        "{table}"
    );
    let detail = ok(b, &["get", &id]);
    assert!(
        detail.contains(&format!("id              {id}")),
        "{detail}"
    );

    // Filters: all must match.
    let v = json(b, &["ls", "--meta", "team=infra", "--meta", "run=cli"]);
    assert_eq!(v["vms"].as_array().unwrap().len(), 1, "{v}");
    let v = json(b, &["ls", "--meta", "team=other"]);
    assert_eq!(v["vms"], serde_json::json!([]), "{v}");

    assert_eq!(json(b, &["pause", &id])["state"], "paused");
    assert_eq!(json(b, &["resume", &id])["state"], "running");
    let snap = json(b, &["snapshot", &id]);
    assert!(snap["snapshotId"].is_string(), "{snap}");
    assert_eq!(snap["state"], "running", "{snap}");
    let cp = json(b, &["checkpoint", "create", &id, "before-fork"]);
    assert_eq!(cp["name"], "before-fork", "{cp}");
    let cps = ok(b, &["checkpoint", "ls", &id]);
    assert!(cps.contains("before-fork"), "{cps}");
    // Ports (served only where an agent runs; the records are the same).
    let url = ok(b, &["ports", "open", &id, "8000"]);
    assert!(
        url.trim()
            .starts_with(&format!("http://8000-{id}.localhost:")),
        "{url}"
    );
    let p = json(b, &["ports", "open", &id, "8001", "--public"]);
    assert_eq!(p["public"], true, "{p}");
    let ls = ok(b, &["ports", "ls", &id]);
    assert!(
        ls.starts_with("PORT") && ls.contains("8000") && ls.contains("yes"),
        "{ls}"
    );
    assert_eq!(json(b, &["ports", "close", &id, "8000"])["closed"], true);
    refused(b, &["ports", "close", &id, "8000"], "port_not_open");
    refused(b, &["ports", "open", &id, "0"], "port 0");

    let f = json(b, &["fork", &id, "-n", "2"]);
    let kids: Vec<String> = f["forks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["vmId"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(kids.len(), 2, "{f}");
    let all = json(b, &["ls"]);
    for k in &kids {
        let row = all["vms"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["vmId"] == k.as_str())
            .unwrap_or_else(|| panic!("{k} not listed: {all}"));
        assert_eq!(row["parentVmId"], id.as_str(), "{row}");
        assert_eq!(row["state"], "running", "{row}");
        // Each child answers on its own vsock.
        let uds = dir.join("vms").join(k).join("vm/vsock.sock");
        assert_eq!(vsock_echo(&uds, b"kid"), b"kid");
    }

    assert_eq!(json(b, &["sleep", &id])["state"], "sleeping");
    let w = json(b, &["wake", &id]);
    assert_eq!(
        (&w["vm"]["state"], &w["coldBoot"]),
        (&"running".into(), &false.into()),
        "{w}"
    );
    assert!(ok(b, &["get", &id]).contains("running"));

    // rm of several: each said; one unknown among them fails the command
    // and names it, the others still go.
    let gone = uuid::Uuid::new_v4().to_string();
    let o = sprout(b, &["rm", &kids[0], &gone, &kids[1]], b"");
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert_eq!(o.status.code(), Some(1), "{out}{err}");
    assert!(out.contains(&format!("{} deleted", kids[0])), "{out}");
    assert!(out.contains(&format!("{} deleted", kids[1])), "{out}");
    assert!(err.contains(&gone) && err.contains("vm_not_found"), "{err}");
    ok(b, &["rm", &id]);
    assert_eq!(json(b, &["ls"])["vms"], serde_json::json!([]));
}

/// Every error path prints the server's code and message (or what is
/// wrong locally) and exits 1; nothing panics.
#[test]
fn errors_are_clear_and_exit_non_zero() {
    let (_t, dir) = data_dir();
    let d = Daemon::start(&dir);
    let base = d.base.clone();
    let b = base.as_str();
    let unknown = uuid::Uuid::new_v4().to_string();
    refused(b, &["get", &unknown], "vm_not_found, HTTP 404");
    refused(b, &["pause", &unknown], "vm_not_found");
    refused(b, &["get", "../info"], "is not an id");
    refused(
        b,
        &["create", "--image", "testguest", "--cpus", "99"],
        "cpus",
    );
    refused(b, &["create", "--image", "no-such-image"], "unknown_image");
    // A usage error is clap's: status 2, saying what is wrong.
    let o = sprout(b, &["ls", "--meta", "novalue"], b"");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("is not KEY=VALUE"), "{err}");
    // The test guest has no agent: an exec is refused by the server, clearly.
    let v = json(
        b,
        &[
            "create",
            "--image",
            "testguest",
            "--cpus",
            "1",
            "--memory",
            "128",
        ],
    );
    let id = v["vmId"].as_str().unwrap();
    let o = sprout(b, &["exec", id, "--", "true"], b"");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.starts_with("sprout: error: "), "{err}");
    // So are its files and processes; a copy leaves no partial file.
    let t = tempfile::tempdir().unwrap();
    let local = t.path().join("f.txt");
    std::fs::write(&local, "x").unwrap();
    let local = local.to_str().unwrap();
    refused(b, &["cp", local, &format!("{id}:f.txt")], "not_supported");
    let back = t.path().join("back.txt");
    refused(
        b,
        &["cp", &format!("{id}:f.txt"), back.to_str().unwrap()],
        "not_supported",
    );
    assert_eq!(
        std::fs::read_dir(t.path()).unwrap().count(),
        1,
        "no partial download"
    );
    refused(b, &["files", "ls", id], "not_supported");
    refused(b, &["ps", id], "not_supported");
    refused(b, &["attach", id, "1"], "not_supported");
    refused(b, &["cp", &format!("{unknown}:f.txt"), "-"], "vm_not_found");
    refused(b, &["cp", local, "elsewhere.txt"], "neither");
    refused(
        b,
        &["cp", &format!("{id}:a"), &format!("{id}:b")],
        "both sides",
    );
    refused(
        b,
        &["cp", "/no/such/file", &format!("{id}:x")],
        "/no/such/file",
    );
    refused("https://127.0.0.1:1", &["ls"], "only http://");
    drop(d);
    // Nothing listens there now.
    refused(b, &["ls"], "cannot reach sproutd at");
    refused(
        b,
        &["cp", local, &format!("{id}:f.txt")],
        "cannot reach sproutd at",
    );
}

/// `sprout completions SHELL` prints a script that completes the sandbox
/// commands.
#[test]
fn completions_are_printed_for_each_shell() {
    for (shell, says) in [
        ("bash", "complete -F"),
        ("zsh", "#compdef sprout"),
        ("fish", "complete -c sprout"),
    ] {
        let o = sprout("http://127.0.0.1:1", &["completions", shell], b"");
        assert!(o.status.success(), "{shell}: {o:?}");
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(out.contains(says), "{shell}: {out}");
        for cmd in ["create", "exec", "attach", "cp", "checkpoint"] {
            assert!(out.contains(cmd), "{shell} completes {cmd}");
        }
    }
    let o = sprout("http://127.0.0.1:1", &["completions", "nosh"], b"");
    assert_eq!(o.status.code(), Some(2));
}
