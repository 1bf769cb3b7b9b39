//! The guest agent in a real Linux VM (issue #6): `agent-check` (tests/src/bin)
//! runs its exec and files checks through the VM's vsock device, inside the
//! emulated hardware-virtualization lab (tests/lab/, see docs/guest.md), then
//! times exec round trips and file throughput there. The same binary run
//! against the agent as a host process (`--unix`) gives the host-process figures.
//!
//! The `BENCH` lines are printed (`-- --nocapture` shows them); they are
//! emulated-lab figures: the outer machine is QEMU TCG, the VM runs under nested
//! SVM on it, and agent-check is the build `cargo test` made (debug unless
//! `--release`).
//!
//! The write/read round trip moves a 50 MiB file (SHA-256 is built optimized
//! even in test builds: the workspace's `[profile.dev.package.sha2]`); the
//! throughput figure is for 100 MiB each way. About 2.5 minutes of host time
//! in all, on an otherwise idle machine.

use std::time::Duration;

use sprout_tests::lab;

/// Boots a test-image VM with a control socket, waits for its agent, runs
/// agent-check against its vsock socket and stops the VM.
const SCRIPT: &str = r#"
sprout vm run --image test --api-sock /tmp/p.sock >/tmp/console 2>&1 &
vm=$!
# The control socket's file appears (bind) just before it listens: wait until
# it answers, not only until it exists.
i=0
until sprout vm ctl --api-sock /tmp/p.sock status >/dev/null 2>&1; do
  i=$((i + 1))
  if [ "$i" -gt 300 ]; then
    echo "no control socket after 30 s; the VM console:"
    tail -n 60 /tmp/console
    exit 1
  fi
  sleep 0.1
done
if ! sprout vm exec --api-sock /tmp/p.sock --exec 'echo agent: up'; then
  echo "the VM did not come up; its console:"
  tail -n 60 /tmp/console
  exit 1
fi
uds=$(sprout vm ctl --api-sock /tmp/p.sock vsock) || exit 1
start=$(date +%s)
/lab/agent-check --vsock-uds "$uds" --bench-runs 50 --throughput-mib 100 --file-mib 50
status=$?
echo "agent-check: status $status after $(( $(date +%s) - start )) s (lab clock)"
sprout vm ctl --api-sock /tmp/p.sock stop >/dev/null || kill "$vm"
wait "$vm"
if [ "$status" != 0 ]; then
  echo "VM console (tail):"
  tail -n 40 /tmp/console
fi
exit "$status"
"#;

/// The agent-check binary, stripped when `strip` is there (the lab copies it
/// into its initramfs).
fn agent_check(dir: &sprout_tests::TempDir) -> std::path::PathBuf {
    let built = std::path::PathBuf::from(env!("CARGO_BIN_EXE_agent-check"));
    let small = dir.path().join("agent-check");
    let stripped = std::process::Command::new("strip")
        .arg("-o")
        .arg(&small)
        .arg(&built)
        .status()
        .is_ok_and(|s| s.success());
    if stripped {
        small
    } else {
        built
    }
}

#[test]
fn agent_exec_and_files_in_a_vm() {
    let dir = sprout_tests::TempDir::new("lab-agent");
    let out = lab::Script::new(SCRIPT)
        .file(agent_check(&dir))
        .timeout(Duration::from_secs(420))
        .run();
    eprintln!("lab run took {:.0} s host time", out.elapsed.as_secs_f64());
    out.assert_success();
    let checks: Vec<&str> = out
        .stdout
        .lines()
        .filter(|l| l.starts_with("PASS ") || l.starts_with("FAIL "))
        .collect();
    let failed: Vec<&&str> = checks.iter().filter(|l| l.starts_with("FAIL ")).collect();
    assert!(
        failed.is_empty(),
        "failed checks: {failed:#?}\n{}",
        out.stdout
    );
    // Every check ran (setup, 11 checks, 2 benchmarks, cleanup).
    assert_eq!(checks.len(), 15, "{}", out.stdout);
    assert!(
        out.stdout.contains("agent-check: all passed"),
        "{}",
        out.stdout
    );
    let bench: Vec<&str> = out
        .stdout
        .lines()
        .filter(|l| l.starts_with("BENCH "))
        .collect();
    assert_eq!(bench.len(), 3, "{}", out.stdout);
    println!("emulated lab (QEMU TCG + nested SVM), agent in a VM over vsock:");
    for l in checks.iter().chain(&bench) {
        println!("{l}");
    }
}
