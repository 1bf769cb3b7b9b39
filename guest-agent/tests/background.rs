//! Background processes against the agent run as a host process: they outlive the
//! connection that started them, keep their recent output in a bounded ring, and are
//! attached to, fed, signalled and listed from any connection.
//!
//! Every wait is on a condition (a gate file the test creates, an event, the exit),
//! bounded by a generous deadline: nothing here depends on how fast the machine is.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{alive, cmd, noise, sha256_hex, Agent};
use guest_agent::client::{Client, ClientError, ProcEvent, ProcStream};
use guest_agent::protocol::{ErrorCode, Exec, StdinMode, StreamKind, MAX_CHUNK};

/// Longest any single wait may take before the test fails (a loaded machine is slow,
/// never this slow).
const PATIENCE: Duration = Duration::from_secs(60);

/// `sh -c script` as a background exec (not yet started).
fn sh(script: &str) -> Exec {
    cmd("sh", &["-c", script])
}

/// A shell snippet that waits until the file `name` exists in the files root (the cwd).
fn wait_gate(name: &str) -> String {
    format!("while [ ! -e {name} ]; do sleep 0.02; done")
}

fn open_gate(root: &Path, name: &str) {
    std::fs::write(root.join(name), b"").unwrap();
}

async fn next(s: &mut ProcStream) -> ProcEvent {
    tokio::time::timeout(PATIENCE, s.next_event())
        .await
        .expect("no event in time")
        .unwrap()
        .expect("stream ended")
}

/// Output events until `want` bytes of stdout have arrived, which must be exactly
/// `want`; the last event's number.
async fn expect_stdout(s: &mut ProcStream, want: &[u8]) -> u64 {
    let mut got = Vec::new();
    let mut seq = 0;
    while got.len() < want.len() {
        match next(s).await {
            ProcEvent::Output {
                seq: n,
                stream: StreamKind::Stdout,
                data,
            } => {
                seq = n;
                got.extend(data);
            }
            other => panic!("expected stdout, got {other:?}"),
        }
    }
    assert_eq!(got, want);
    seq
}

/// Waits for the exit of background process `id`, attaching from the start.
async fn wait_exit(client: &Client, id: u64) -> guest_agent::client::ProcCollected {
    let s = client.attach(id, None).await.unwrap();
    tokio::time::timeout(PATIENCE, s.collect(64 << 20))
        .await
        .expect("process did not exit in time")
        .unwrap()
}

async fn wait_gone(pid: u32) {
    let deadline = Instant::now() + PATIENCE;
    while alive(pid) {
        assert!(Instant::now() < deadline, "process {pid} still alive");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_background_process_outlives_its_connection_and_replays_from_the_start() {
    let agent = Agent::start();
    let started = {
        let client = agent.client();
        let script = format!("echo one; {}; echo two >&2; echo three", wait_gate("go"));
        let s = client.exec_background(sh(&script)).await.unwrap();
        // Wait until it has printed, so its first event is in the ring.
        let mut a = client.attach(s.exec_id, None).await.unwrap();
        assert!(a.attached.running);
        expect_stdout(&mut a, b"one\n").await;
        s
        // Every connection of this client closes here: the attach, the pool.
    };
    assert!(alive(started.pid));
    let client = agent.client();
    let list = client.proc_list().await.unwrap();
    assert!(list
        .iter()
        .any(|p| p.exec_id == started.exec_id && p.running));
    open_gate(&agent.root, "go");
    let out = wait_exit(&client, started.exec_id).await;
    assert_eq!(out.stdout, b"one\nthree\n");
    assert_eq!(out.stderr, b"two\n");
    assert_eq!(out.missed_events, 0);
    let (exit_seq, exit) = out.exit.unwrap();
    assert_eq!((exit.code, exit.signal), (Some(0), None));
    assert_eq!((exit.stdout_bytes, exit.stderr_bytes), (10, 4));
    assert_eq!(exit_seq, out.last_seq);
    // Numbered from 1, without holes: one, two, three (each written after a gate or a
    // different stream, so separate reads), exit. Chunks may still split, never merge
    // across streams.
    assert!(exit_seq >= 4, "exit is event {exit_seq}");
}

#[tokio::test]
async fn reattach_replays_from_any_event_id_and_attachers_come_and_go() {
    let agent = Agent::start();
    let client = agent.client();
    let script = format!(
        "echo 1; {}; echo 2; {}; echo 3",
        wait_gate("g1"),
        wait_gate("g2")
    );
    let s = client.exec_background(sh(&script)).await.unwrap();
    let mut first = client.attach(s.exec_id, None).await.unwrap();
    let mut second = client.attach(s.exec_id, Some(0)).await.unwrap();
    let e1 = expect_stdout(&mut first, b"1\n").await;
    assert_eq!(e1, 1);
    assert_eq!(expect_stdout(&mut second, b"1\n").await, 1);
    // One attacher goes away mid-stream: nothing happens to the process or the other.
    drop(second);
    open_gate(&agent.root, "g1");
    let e2 = expect_stdout(&mut first, b"2\n").await;
    assert_eq!(e2, 2);
    // A third attaches live from the newest event: it gets only what follows.
    let mut third = client.attach(s.exec_id, Some(e2)).await.unwrap();
    assert_eq!(third.attached.next_seq, 3);
    open_gate(&agent.root, "g2");
    assert_eq!(expect_stdout(&mut first, b"3\n").await, 3);
    assert_eq!(expect_stdout(&mut third, b"3\n").await, 3);
    for s in [&mut first, &mut third] {
        match next(s).await {
            ProcEvent::Exit { seq: 4, exit } => assert_eq!(exit.code, Some(0)),
            other => panic!("expected the exit as event 4, got {other:?}"),
        }
        assert!(s.next_event().await.unwrap().is_none());
    }

    // After the exit: replay from the start, from Last-Event-ID 1, past the end.
    let all = wait_exit(&client, s.exec_id).await;
    assert_eq!(
        (all.stdout.as_slice(), all.last_seq),
        (&b"1\n2\n3\n"[..], 4)
    );
    let rest = client
        .attach(s.exec_id, Some(1))
        .await
        .unwrap()
        .collect(1 << 20)
        .await
        .unwrap();
    assert_eq!(rest.stdout, b"2\n3\n");
    assert_eq!(rest.exit.unwrap().0, 4);
    let none = client
        .attach(s.exec_id, Some(4))
        .await
        .unwrap()
        .collect(1 << 20)
        .await
        .unwrap();
    assert!(none.stdout.is_empty() && none.exit.is_none());
    let e = client.attach(s.exec_id, Some(5)).await.err().unwrap();
    assert_eq!(e.code(), Some(ErrorCode::BadRequest), "{e}");
    let e = client.attach(s.exec_id + 100, None).await.err().unwrap();
    assert_eq!(e.code(), Some(ErrorCode::NoSuchExec), "{e}");
}

#[tokio::test]
async fn live_events_arrive_while_the_process_still_runs() {
    let agent = Agent::start();
    let client = agent.client();
    let script = format!("echo first; {}; echo second", wait_gate("go"));
    let s = client.exec_background(sh(&script)).await.unwrap();
    let mut a = client.attach(s.exec_id, None).await.unwrap();
    // The process cannot end before the gate opens: this chunk is live.
    expect_stdout(&mut a, b"first\n").await;
    let listed = client.proc_list().await.unwrap();
    let me = listed.iter().find(|p| p.exec_id == s.exec_id).unwrap();
    assert!(me.running && me.exit.is_none());
    open_gate(&agent.root, "go");
    expect_stdout(&mut a, b"second\n").await;
    assert!(matches!(next(&mut a).await, ProcEvent::Exit { .. }));

    // And with time in between: a print, a one-second sleep, a print. The first chunk
    // is read while the process sleeps (it is an event before the exit's).
    let s = client
        .exec_background(sh("echo a; sleep 1; echo b"))
        .await
        .unwrap();
    let mut a = client.attach(s.exec_id, None).await.unwrap();
    let t0 = Instant::now();
    expect_stdout(&mut a, b"a\n").await;
    let t_first = t0.elapsed();
    expect_stdout(&mut a, b"b\n").await;
    let ProcEvent::Exit { exit, .. } = next(&mut a).await else {
        panic!("no exit")
    };
    assert_eq!(exit.code, Some(0));
    assert!(exit.duration_us >= 1_000_000);
    eprintln!("first chunk after {t_first:?}");
}

#[tokio::test]
async fn ring_overflow_is_reported_as_a_gap_never_silently() {
    let ring = 64 * 1024;
    let agent = Agent::start_with(&["--ring-bytes", &ring.to_string()]);
    let client = agent.client();
    let total = 1_000_000u64;
    let s = client
        .exec_background(sh(&format!("head -c {total} /dev/zero; echo end")))
        .await
        .unwrap();
    // A reader attached while it runs: whatever it missed (it may fall behind the ring)
    // is accounted for, byte for byte.
    let live = wait_exit(&client, s.exec_id).await;
    let exit = live.exit.clone().unwrap().1;
    assert_eq!(exit.stdout_bytes, total + 4);
    assert!(!exit.stdout_truncated, "the ring is not a cap");
    let live_missed = live
        .missed_bytes
        .expect("an attached reader knows the bytes");
    assert_eq!(live_missed + live.stdout.len() as u64, total + 4);
    assert!(live.stdout.ends_with(b"end\n"));
    // A reader from the start, after the exit: the ring holds the newest events only.
    let out = wait_exit(&client, s.exec_id).await;
    assert!(out.missed_events > 0);
    let missed = out
        .missed_bytes
        .expect("a reader from the start knows the bytes");
    assert_eq!(missed + out.stdout.len() as u64, total + 4);
    assert!(out.stdout.ends_with(b"end\n"));
    assert!(
        out.stdout.len() <= ring,
        "{} bytes kept in a ring of {ring}",
        out.stdout.len()
    );
    let info = client
        .proc_list()
        .await
        .unwrap()
        .into_iter()
        .find(|p| p.exec_id == s.exec_id)
        .unwrap();
    assert_eq!(
        (info.dropped_events, info.dropped_bytes),
        (out.missed_events, missed)
    );
    assert!(info.first_seq > 1 && !info.running);

    // Resuming from an event the ring no longer holds: the gap is its first event, with
    // the count of missed events (their bytes the agent cannot know).
    let mut a = client.attach(s.exec_id, Some(1)).await.unwrap();
    match next(&mut a).await {
        ProcEvent::Gap {
            first_seq: 2,
            last_seq,
            bytes: None,
        } => assert_eq!(last_seq, info.first_seq - 1),
        other => panic!("expected a gap from event 2, got {other:?}"),
    }
    // Kept events follow, numbered on from the gap.
    match next(&mut a).await {
        ProcEvent::Output { seq, .. } => assert_eq!(seq, info.first_seq),
        other => panic!("expected output, got {other:?}"),
    }
}

#[tokio::test]
async fn a_signal_reaches_the_whole_process_group() {
    let agent = Agent::start();
    let client = agent.client();
    let s = client
        .exec_background(sh("sleep 30 & echo $!; wait"))
        .await
        .unwrap();
    let mut a = client.attach(s.exec_id, None).await.unwrap();
    let mut line = Vec::new();
    while !line.ends_with(b"\n") {
        match next(&mut a).await {
            ProcEvent::Output { data, .. } => line.extend(data),
            other => panic!("expected the child's pid, got {other:?}"),
        }
    }
    let child: u32 = String::from_utf8(line).unwrap().trim().parse().unwrap();
    assert!(alive(child));
    let e = client.kill(s.exec_id, 12345).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::InvalidSignal));
    client.kill(s.exec_id, 15).await.unwrap();
    let ProcEvent::Exit { exit, .. } = next(&mut a).await else {
        panic!("no exit")
    };
    assert_eq!(exit.signal, Some(15));
    wait_gone(child).await;
    // Finished: no longer signalled.
    let e = client.kill(s.exec_id, 15).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NoSuchExec));
}

#[tokio::test]
async fn stdin_reaches_a_background_process_from_any_connection() {
    let agent = Agent::start();
    let client = agent.client();
    let mut req = cmd("cat", &[]);
    req.stdin = StdinMode::Stream;
    let s = client.exec_background(req).await.unwrap();
    let mut a = client.attach(s.exec_id, None).await.unwrap();
    client.proc_stdin(s.exec_id, b"hello\n").await.unwrap();
    expect_stdout(&mut a, b"hello\n").await;
    // From another client (other connections) too.
    let other = agent.client();
    other.proc_stdin(s.exec_id, b"again\n").await.unwrap();
    expect_stdout(&mut a, b"again\n").await;
    other.proc_stdin_close(s.exec_id).await.unwrap();
    let ProcEvent::Exit { exit, .. } = next(&mut a).await else {
        panic!("no exit")
    };
    assert_eq!(exit.code, Some(0));
    let e = client.proc_stdin(s.exec_id, b"late").await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::StdinClosed), "{e}");

    // Several frames' worth, through sha256sum.
    let data = noise(3 * MAX_CHUNK + 1000, 7);
    let mut req = cmd("sha256sum", &[]);
    req.stdin = StdinMode::Stream;
    let s = client.exec_background(req).await.unwrap();
    client.proc_stdin(s.exec_id, &data).await.unwrap();
    client.proc_stdin_close(s.exec_id).await.unwrap();
    let out = wait_exit(&client, s.exec_id).await;
    let sum = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        sum.split_whitespace().next(),
        Some(sha256_hex(&data).as_str())
    );

    // A process that reads its line and ends before the close comes: the
    // close is done all the same (a client's write-then-close must not race
    // the process's exit).
    let mut req = cmd("/bin/sh", &["-c", "read l; exit 3"]);
    req.stdin = StdinMode::Stream;
    let s = client.exec_background(req).await.unwrap();
    client.proc_stdin(s.exec_id, b"line\n").await.unwrap();
    wait_exit(&client, s.exec_id).await;
    client.proc_stdin_close(s.exec_id).await.unwrap();

    // A process without a stdin stream, an unknown one, an oversized chunk.
    let s = client.exec_background(sh(&wait_gate("go"))).await.unwrap();
    let e = client.proc_stdin(s.exec_id, b"x").await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::StdinClosed), "{e}");
    let e = client.proc_stdin(s.exec_id + 100, b"x").await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NoSuchExec), "{e}");
    open_gate(&agent.root, "go");
    wait_exit(&client, s.exec_id).await;
}

#[tokio::test]
async fn the_listing_shows_running_then_exited() {
    let agent = Agent::start();
    let client = agent.client();
    assert!(client.proc_list().await.unwrap().is_empty());
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let mut req = sh(&format!("{}; exit 7", wait_gate("go")));
    req.stdin = StdinMode::Stream;
    let s = client.exec_background(req).await.unwrap();
    // A foreground exec is not a background process: not listed.
    let fg = client.exec(cmd("sleep", &["30"])).await.unwrap();
    let list = client.proc_list().await.unwrap();
    assert_eq!(list.len(), 1, "{list:?}");
    let p = &list[0];
    assert_eq!((p.exec_id, p.pid), (s.exec_id, s.pid));
    assert!(p.running && p.exit.is_none() && p.stdin_open);
    assert!(p.command.starts_with("sh -c while"), "{:?}", p.command);
    assert!(p.started_unix_ms >= before.saturating_sub(1000));
    assert_eq!((p.first_seq, p.next_seq, p.dropped_bytes), (1, 1, 0));
    drop(fg);

    open_gate(&agent.root, "go");
    wait_exit(&client, s.exec_id).await;
    let list = client.proc_list().await.unwrap();
    let p = &list[0];
    assert!(!p.running && !p.stdin_open);
    assert_eq!(p.exit.as_ref().unwrap().code, Some(7));
    assert_eq!(p.next_seq, 2, "the exit is event 1");
}

#[tokio::test]
async fn limits_refuse_with_clear_codes_and_finished_ones_are_evicted() {
    let agent = Agent::start_with(&["--max-execs", "2", "--max-finished", "1"]);
    let client = agent.client();
    let a = client.exec_background(sh(&wait_gate("a"))).await.unwrap();
    let b = client.exec_background(sh(&wait_gate("b"))).await.unwrap();
    // Running background processes hold exec slots: background and foreground alike
    // are refused.
    let e = client.exec_background(cmd("true", &[])).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Busy), "{e}");
    let e = client
        .exec_output(cmd("true", &[]), None, 100)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Busy), "{e}");

    open_gate(&agent.root, "a");
    wait_exit(&client, a.exec_id).await;
    // Its slot is free again.
    let c = client.exec_background(cmd("true", &[])).await.unwrap();
    wait_exit(&client, c.exec_id).await;
    // Two finished, one kept: the earlier finished (a) is gone, c stays, b runs.
    let e = client.attach(a.exec_id, None).await.err().unwrap();
    assert_eq!(e.code(), Some(ErrorCode::NoSuchExec), "{e}");
    let ids: Vec<u64> = client
        .proc_list()
        .await
        .unwrap()
        .iter()
        .map(|p| p.exec_id)
        .collect();
    assert_eq!(ids, [b.exec_id, c.exec_id]);
    open_gate(&agent.root, "b");
    wait_exit(&client, b.exec_id).await;
}

#[tokio::test]
async fn a_background_timeout_kills_the_group() {
    let agent = Agent::start();
    let client = agent.client();
    let mut req = sh("sleep 30 & echo $!; sleep 30");
    req.timeout_ms = Some(300);
    let s = client.exec_background(req).await.unwrap();
    let out = wait_exit(&client, s.exec_id).await;
    let exit = out.exit.unwrap().1;
    assert!(exit.timed_out);
    assert_eq!(exit.signal, Some(9));
    let child: u32 = String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    wait_gone(child).await;
}

#[tokio::test]
async fn a_foreground_exec_still_dies_with_its_connection() {
    let agent = Agent::start();
    // The foreground call refuses a background request rather than wait for an exit
    // that would never come on its connection.
    let mut req = cmd("true", &[]);
    req.background = true;
    assert!(matches!(
        agent.client().exec(req).await,
        Err(ClientError::Misuse(_))
    ));

    let s = agent.client().exec(cmd("sleep", &["30"])).await.unwrap();
    let pid = s.pid;
    drop(s);
    wait_gone(pid).await;
    // Whereas a background one does not, client and all gone.
    let bg = agent
        .client()
        .exec_background(sh(&wait_gate("go")))
        .await
        .unwrap();
    let client = agent.client();
    assert!(alive(bg.pid));
    assert!(client
        .proc_list()
        .await
        .unwrap()
        .iter()
        .any(|p| p.exec_id == bg.exec_id && p.running));
    open_gate(&agent.root, "go");
    wait_exit(&client, bg.exec_id).await;
    assert!(matches!(
        client.attach(bg.exec_id, Some(99)).await,
        Err(ClientError::Agent { .. })
    ));
}
