//! Exec against the agent run as a host process.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{alive, cmd, noise, sha256_hex, Agent};
use guest_agent::client::ExecEvent;
use guest_agent::protocol::{ErrorCode, StdinMode, User};

const CAP: usize = 16 << 20;

#[tokio::test]
async fn first_chunk_arrives_before_the_command_ends() {
    let agent = Agent::start();
    let client = agent.client();
    let start = Instant::now();
    let mut s = client
        .exec(cmd("sh", &["-c", "echo a; sleep 1; echo b"]))
        .await
        .unwrap();
    let mut events = Vec::new();
    while let Some(ev) = s.next_event().await.unwrap() {
        events.push((start.elapsed(), ev));
    }
    let (t_a, first) = &events[0];
    assert_eq!(*first, ExecEvent::Stdout(b"a\n".to_vec()));
    let (t_exit, last) = events.last().unwrap();
    let ExecEvent::Exit(exit) = last else {
        panic!("last event is not the exit: {last:?}")
    };
    assert_eq!(exit.code, Some(0));
    assert!(
        *t_exit >= *t_a + Duration::from_millis(800),
        "first chunk at {t_a:?}, exit at {t_exit:?}: not streamed"
    );
    let stdout: Vec<u8> = events
        .iter()
        .filter_map(|(_, e)| match e {
            ExecEvent::Stdout(d) => Some(d.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(stdout, b"a\nb\n");
    assert!(exit.duration_us >= 1_000_000);
}

#[tokio::test]
async fn five_mib_of_stdin_round_trips_through_sha256sum() {
    let agent = Agent::start();
    let data = noise(5 << 20, 42);
    let want = sha256_hex(&data);
    let out = agent
        .client()
        .exec_output(cmd("sha256sum", &[]), Some(data), CAP)
        .await
        .unwrap();
    assert_eq!(
        out.exit.code,
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = String::from_utf8(out.stdout).unwrap();
    assert_eq!(got.split_whitespace().next(), Some(want.as_str()));
}

#[tokio::test]
async fn small_stdin_bytes_inline() {
    let agent = Agent::start();
    let mut req = cmd("cat", &[]);
    req.stdin = StdinMode::Bytes(b"inline\xff".to_vec().into());
    let out = agent.client().exec_output(req, None, CAP).await.unwrap();
    assert_eq!(out.stdout, b"inline\xff");
}

#[tokio::test]
async fn timeout_kills_the_whole_group_and_says_so() {
    let agent = Agent::start();
    let mut req = cmd("sh", &["-c", "sleep 100 & echo $!; sleep 100"]);
    req.timeout_ms = Some(500);
    let start = Instant::now();
    let out = agent.client().exec_output(req, None, CAP).await.unwrap();
    let took = start.elapsed();
    assert!(out.exit.timed_out);
    assert_eq!(out.exit.signal, Some(9));
    assert_eq!(out.exit.code, None);
    assert!(took < Duration::from_millis(1500), "took {took:?}");
    let bg: u32 = String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // The background sleep was in the group: it is gone too.
    let deadline = Instant::now() + Duration::from_secs(2);
    while alive(bg) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!alive(bg), "background process {bg} survived the timeout");
}

#[tokio::test]
async fn no_timeout_means_no_timed_out_flag() {
    let agent = Agent::start();
    let mut req = cmd("sh", &["-c", "exit 3"]);
    req.timeout_ms = Some(10_000);
    let out = agent.client().exec_output(req, None, CAP).await.unwrap();
    assert_eq!(
        (out.exit.code, out.exit.signal, out.exit.timed_out),
        (Some(3), None, false)
    );
}

#[tokio::test]
async fn env_and_cwd_are_honoured() {
    let agent = Agent::start();
    std::fs::create_dir(agent.root.join("sub")).unwrap();
    let client = agent.client();
    let mut req = cmd("sh", &["-c", "echo \"$FOO\"; pwd"]);
    req.env = vec![("FOO".into(), "bar baz".into())];
    req.cwd = Some("sub".into());
    let out = client.exec_output(req, None, CAP).await.unwrap();
    let want = format!("bar baz\n{}\n", agent.root.join("sub").display());
    assert_eq!(String::from_utf8(out.stdout).unwrap(), want);

    // Default cwd: the files root. Absolute cwd: as given.
    let out = client
        .exec_output(cmd("pwd", &[]), None, CAP)
        .await
        .unwrap();
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        format!("{}\n", agent.root.display())
    );
    let mut req = cmd("pwd", &[]);
    req.cwd = Some("/".into());
    let out = client.exec_output(req, None, CAP).await.unwrap();
    assert_eq!(out.stdout, b"/\n");

    // A cleared environment holds only what was given.
    let mut req = cmd("/usr/bin/env", &[]);
    req.clear_env = true;
    req.env = vec![("ONLY".into(), "1".into())];
    let out = client.exec_output(req, None, CAP).await.unwrap();
    assert_eq!(out.stdout, b"ONLY=1\n");
}

#[tokio::test]
async fn shell_mode_and_argv() {
    let agent = Agent::start();
    let client = agent.client();
    let mut req = cmd("echo \"$0|$1\"", &["x y", "z"]);
    req.shell = true;
    let out = client.exec_output(req, None, CAP).await.unwrap();
    assert_eq!(out.stdout, b"x y|z\n");
    // Without shell, metacharacters are plain arguments.
    let out = client
        .exec_output(cmd("echo", &["$HOME", "a;b", "*"]), None, CAP)
        .await
        .unwrap();
    assert_eq!(out.stdout, b"$HOME a;b *\n");
}

#[tokio::test]
async fn non_utf8_output_arrives_intact() {
    let agent = Agent::start();
    let script = r"printf '\377\376\000\001\200abc\303'; printf '\000\377' >&2";
    let out = agent
        .client()
        .exec_output(cmd("sh", &["-c", script]), None, CAP)
        .await
        .unwrap();
    assert_eq!(out.stdout, b"\xff\xfe\x00\x01\x80abc\xc3");
    assert_eq!(out.stderr, b"\x00\xff");
    // A larger binary stream: every byte value, many times over.
    let data: Vec<u8> = (0..=255u8).cycle().take(300_000).collect();
    let out = agent
        .client()
        .exec_output(cmd("cat", &[]), Some(data.clone()), CAP)
        .await
        .unwrap();
    assert_eq!(out.stdout, data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_execs_each_answer_once() {
    let agent = Agent::start();
    let client = agent.client();
    let mut tasks = Vec::new();
    for n in 0..64u32 {
        let c = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut req = cmd("sh", &["-c", "sleep 0.2; echo $N"]);
            req.env = vec![("N".into(), n.to_string())];
            c.exec_output(req, None, CAP).await.unwrap()
        }));
    }
    let mut seen = BTreeMap::new();
    for t in tasks {
        let out = t.await.unwrap();
        assert_eq!(out.exit.code, Some(0));
        let n: u32 = String::from_utf8(out.stdout)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        *seen.entry(n).or_insert(0) += 1;
    }
    assert_eq!(seen.len(), 64);
    assert!(seen.iter().all(|(n, c)| *n < 64 && *c == 1), "{seen:?}");
}

#[tokio::test]
async fn kill_a_running_exec_by_id() {
    let agent = Agent::start();
    let client = agent.client();
    let mut s = client.exec(cmd("sleep", &["100"])).await.unwrap();
    assert!(alive(s.pid));
    let e = client.kill(s.exec_id, 9999).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::InvalidSignal));
    let e = client.kill(s.exec_id + 1000, 15).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NoSuchExec));
    client.kill(s.exec_id, 15).await.unwrap();
    let mut exit = None;
    while let Some(ev) = s.next_event().await.unwrap() {
        if let ExecEvent::Exit(e) = ev {
            exit = Some(e);
        }
    }
    let exit = exit.unwrap();
    assert_eq!((exit.signal, exit.timed_out), (Some(15), false));
    // Once finished, the id is gone.
    let e = client.kill(s.exec_id, 15).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NoSuchExec));
}

#[tokio::test]
async fn dropping_the_session_kills_the_process() {
    let agent = Agent::start();
    let s = agent.client().exec(cmd("sleep", &["100"])).await.unwrap();
    let pid = s.pid;
    assert!(alive(pid));
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(3);
    while alive(pid) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!alive(pid), "process {pid} outlived its connection");
}

#[tokio::test]
async fn spawn_failures_and_bad_requests_are_errors() {
    let agent = Agent::start();
    let client = agent.client();
    let e = client
        .exec_output(cmd("/no/such/program", &[]), None, CAP)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::SpawnFailed), "{e}");
    let e = client
        .exec_output(cmd("", &[]), None, CAP)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::BadRequest));
    let e = client
        .exec_output(cmd("echo", &["a\0b"]), None, CAP)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::BadRequest));
    let mut req = cmd("true", &[]);
    req.env = vec![("A=B".into(), "x".into())];
    let e = client.exec_output(req, None, CAP).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::BadRequest));
    // The client still works afterwards.
    let out = client
        .exec_output(cmd("true", &[]), None, CAP)
        .await
        .unwrap();
    assert_eq!(out.exit.code, Some(0));
}

#[tokio::test]
async fn runs_as_another_user_when_root() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: not root");
        return;
    }
    let agent = Agent::start();
    let mut req = cmd("sh", &["-c", "id -u; id -g; id -G"]);
    req.user = Some(User {
        uid: 65534,
        gid: 65534,
    });
    req.cwd = Some("/".into());
    let out = agent.client().exec_output(req, None, CAP).await.unwrap();
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        "65534\n65534\n65534\n"
    );
}

#[tokio::test]
async fn output_cap_per_request_marks_truncation() {
    let agent = Agent::start();
    let mut req = cmd(
        "sh",
        &["-c", "head -c 100000 /dev/zero; head -c 10 /dev/zero >&2"],
    );
    req.output_limit = Some(1000);
    let out = agent.client().exec_output(req, None, CAP).await.unwrap();
    assert_eq!(out.stdout.len(), 1000);
    assert_eq!(out.stderr.len(), 10);
    assert!(out.exit.stdout_truncated && !out.exit.stderr_truncated);
    assert_eq!(
        (out.exit.stdout_bytes, out.exit.stderr_bytes),
        (100_000, 10)
    );
    assert_eq!(out.exit.code, Some(0));
}
