//! The main process (`sprout-agent --main SPEC`, the `container` runtime):
//! started before the agent serves, listed and attached to as background
//! exec 1, with the spec's environment alone, its working directory and
//! user; one that cannot start is listed as finished with status 127 and
//! the reason on its stderr.

mod common;

use std::time::Duration;

use common::Agent;
use guest_agent::client::{ProcEvent, ProcStream};
use guest_agent::main_process::MainProcess;
use guest_agent::protocol::StreamKind;

const PATIENCE: Duration = Duration::from_secs(60);

/// An agent started with `spec` as its main process (the spec file in `dir`).
fn agent_with(dir: &std::path::Path, spec: &MainProcess) -> Agent {
    let path = dir.join("main.json");
    std::fs::write(&path, spec.to_json()).unwrap();
    Agent::start_with(&["--main", path.to_str().unwrap()])
}

fn me() -> (u32, u32) {
    // SAFETY: getuid and getgid cannot fail and touch no memory.
    unsafe { (libc::getuid(), libc::getgid()) }
}

/// Every event to the exit: (stdout, stderr, the exit's code and signal).
async fn drain(mut s: ProcStream) -> (String, String, (Option<i32>, Option<i32>)) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    loop {
        let ev = tokio::time::timeout(PATIENCE, s.next_event())
            .await
            .expect("no event in time")
            .unwrap()
            .expect("the stream ended before the exit");
        match ev {
            ProcEvent::Output { stream, data, .. } => match stream {
                StreamKind::Stdout => out.extend(data),
                StreamKind::Stderr => err.extend(data),
            },
            ProcEvent::Gap { .. } => panic!("a gap in a short output"),
            ProcEvent::Exit { exit, .. } => {
                return (
                    String::from_utf8_lossy(&out).into_owned(),
                    String::from_utf8_lossy(&err).into_owned(),
                    (exit.code, exit.signal),
                )
            }
        }
    }
}

#[tokio::test]
async fn the_main_process_is_background_exec_one_with_its_specs_env_cwd_and_user() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path().join("srv");
    std::fs::create_dir(&cwd).unwrap();
    let gate = dir.path().join("gate");
    let (uid, gid) = me();
    let spec = MainProcess {
        args: vec![
            "sh".into(),
            "-c".into(),
            format!(
                "echo \"$GREETING from $(pwd) as $(id -u):$(id -g) home=$HOME agent_env=${{CARGO_MANIFEST_DIR-unset}}\"; \
                 echo warn >&2; while [ ! -e {} ]; do sleep 0.02; done; exit 3",
                gate.display()
            ),
        ],
        env: vec![
            ("GREETING".into(), "hello".into()),
            ("PATH".into(), "/usr/bin:/bin".into()),
            ("HOME".into(), "/home/app".into()),
        ],
        cwd: cwd.to_str().unwrap().into(),
        uid,
        gid,
    };
    // The agent inherits this (cargo sets it for tests); the main process
    // must not see it.
    assert!(std::env::var_os("CARGO_MANIFEST_DIR").is_some());
    let agent = agent_with(dir.path(), &spec);
    let c = agent.client();
    let procs = c.proc_list().await.unwrap();
    assert_eq!(procs.len(), 1, "{procs:?}");
    assert_eq!(procs[0].exec_id, 1);
    assert!(procs[0].running, "{procs:?}");
    assert!(procs[0].command.starts_with("sh -c "), "{procs:?}");
    // Exec works beside it.
    let other = c
        .exec(common::cmd("echo", &["beside"]))
        .await
        .unwrap()
        .collect(1024)
        .await
        .unwrap();
    assert_eq!(other.stdout, b"beside\n");
    std::fs::write(&gate, b"").unwrap();
    let (out, err, exit) = drain(c.attach(1, None).await.unwrap()).await;
    assert_eq!(
        out,
        format!(
            "hello from {} as {uid}:{gid} home=/home/app agent_env=unset\n",
            cwd.display()
        )
    );
    assert_eq!(err, "warn\n");
    assert_eq!(exit, (Some(3), None));
}

#[tokio::test]
async fn a_main_process_that_cannot_start_is_listed_with_status_127_and_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let (uid, gid) = me();
    let spec = MainProcess {
        args: vec!["/no/such/program".into(), "arg".into()],
        env: vec![("PATH".into(), "/usr/bin:/bin".into())],
        cwd: "/".into(),
        uid,
        gid,
    };
    let agent = agent_with(dir.path(), &spec);
    let c = agent.client();
    let procs = c.proc_list().await.unwrap();
    assert_eq!(procs.len(), 1, "{procs:?}");
    assert_eq!(procs[0].exec_id, 1);
    assert!(!procs[0].running);
    assert_eq!(procs[0].exit.as_ref().and_then(|e| e.code), Some(127));
    let (out, err, exit) = drain(c.attach(1, None).await.unwrap()).await;
    assert_eq!(out, "");
    assert!(
        err.contains("the main process did not start") && err.contains("/no/such/program"),
        "{err}"
    );
    assert_eq!(exit, (Some(127), None));
    // The agent serves on; the next exec is not given id 1 again.
    let next = c.exec_background(common::cmd("true", &[])).await.unwrap();
    assert_eq!(next.exec_id, 2);
}

#[tokio::test]
async fn a_bad_spec_leaves_the_agent_serving_with_no_main_process() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("main.json");
    std::fs::write(&path, b"{\"args\": []}").unwrap();
    let agent = Agent::start_with(&["--main", path.to_str().unwrap()]);
    let c = agent.client();
    assert!(c.proc_list().await.unwrap().is_empty());
}
