//! A `yes` flood: the per-stream cap holds and no memory grows without bound. Alone in
//! its test binary so that nothing else moves this process's RSS.

mod common;

use std::time::Duration;

use common::{cmd, rss_kib, Agent};
use guest_agent::client::ExecEvent;
use guest_agent::protocol::DEFAULT_OUTPUT_LIMIT;

#[tokio::test]
async fn yes_flood_hits_the_cap_and_memory_stays_bounded() {
    let agent = Agent::start();
    let client = agent.client();
    client.ping().await.unwrap();
    let agent_pid = agent.pid().to_string();
    let host_before = rss_kib("self");
    let agent_before = rss_kib(&agent_pid);

    // A bounded flood, so the check does not depend on how fast this machine
    // is: the agent must drain all of it, far past the cap, for `head` to end.
    const FLOOD: u64 = 5 * DEFAULT_OUTPUT_LIMIT;
    let mut req = cmd("sh", &["-c", &format!("yes | head -c {FLOOD}")]);
    req.timeout_ms = Some(600_000);
    let mut s = client.exec(req).await.unwrap();
    let mut received = 0u64;
    let mut exit = None;
    let mut agent_peak = agent_before;
    while let Some(ev) = s.next_event().await.unwrap() {
        match ev {
            ExecEvent::Stdout(d) => received += d.len() as u64,
            ExecEvent::Stderr(d) => panic!("stderr: {d:?}"),
            ExecEvent::Exit(e) => exit = Some(e),
        }
        agent_peak = agent_peak.max(rss_kib(&agent_pid));
    }
    // Keep sampling the agent while `yes` is still being drained... it is dead now;
    // one more sample after the exit.
    tokio::time::sleep(Duration::from_millis(50)).await;
    agent_peak = agent_peak.max(rss_kib(&agent_pid));
    let exit = exit.unwrap();
    let host_after = rss_kib("self");

    assert!(!exit.timed_out && exit.stdout_truncated && !exit.stderr_truncated);
    assert_eq!(exit.code, Some(0), "{exit:?}");
    assert_eq!(
        received, DEFAULT_OUTPUT_LIMIT,
        "exactly the cap is delivered"
    );
    assert_eq!(
        exit.stdout_bytes, FLOOD,
        "the agent did not drain the whole flood past the cap"
    );
    let host_growth = host_after.saturating_sub(host_before);
    let agent_growth = agent_peak.saturating_sub(agent_before);
    eprintln!(
        "yes wrote {} MiB; host RSS {host_before} -> {host_after} KiB; agent RSS {agent_before} -> peak {agent_peak} KiB",
        exit.stdout_bytes >> 20
    );
    assert!(
        host_growth < 16 * 1024,
        "host RSS grew by {host_growth} KiB"
    );
    assert!(
        agent_growth < 16 * 1024,
        "agent RSS grew by {agent_growth} KiB"
    );

    // Collected, the output is cut at the client's cap as well.
    let req = cmd("sh", &["-c", "yes | head -c 8388608"]);
    let out = client.exec_output(req, None, 1 << 20).await.unwrap();
    assert_eq!(out.stdout.len(), 1 << 20);
    assert!(
        out.exit.stdout_truncated && !out.exit.timed_out,
        "{:?}",
        out.exit
    );
}
