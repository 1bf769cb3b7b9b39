//! Linux guests end to end, under real KVM semantics: each test runs `sprout`
//! inside the emulated hardware-virtualization lab (tests/lab/, see
//! docs/guest.md), because this project's machines' own KVM cannot run Linux.
//!
//! Slow (an outer VM boot plus an emulated guest boot per `sprout` run: about
//! 75 s for the file). The lab is built (or taken from the cache) on first
//! use; `./test` builds the kernel and images it needs first.

use sprout_tests::lab;

/// `sprout vm run` of a Linux guest with the test image, running `cmd`.
fn exec(args: &str, cmd: &str) -> String {
    format!("sprout vm run --image test {args} --exec '{cmd}'")
}

#[test]
fn the_lab_runs_the_test_guest_under_svm_kvm() {
    let out = lab::run(
        "grep -qw svm /proc/cpuinfo && echo 'cpu: svm'\n\
         sprout vm run --kernel \"$SPROUT_CACHE/testguest\" --cmdline selftest\n\
         echo \"status: $?\"",
    );
    out.assert_success();
    assert_eq!(out.values("cpu:"), ["svm"], "{}", out.stdout);
    assert!(out.stdout.contains("selftest: done"), "{}", out.stdout);
    assert_eq!(out.values("status:"), ["0"], "{}", out.stdout);
}

#[test]
fn uname_shows_our_kernel() {
    let out = lab::run(&format!("{}\necho \"status: $?\"", exec("", "uname -a")));
    out.assert_success();
    assert_eq!(out.values("status:"), ["0"], "{}", out.stdout);
    // Our build (guest/build-kernel.sh stamps the source package), not the
    // lab's own Debian cloud kernel.
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("Linux "))
        .unwrap_or_else(|| panic!("no uname line in:\n{}", out.stdout));
    assert!(line.contains(" 6.12."), "{line}");
    assert!(line.contains("linux-source-6.12"), "{line}");
    assert!(line.contains("x86_64"), "{line}");
}

#[test]
fn cpus_memory_and_the_tsc_deadline_timer_reach_the_guest() {
    let out = lab::run(&format!(
        "{}\n{}\n{}\n",
        exec(
            "--cpus 2",
            "echo nproc: $(nproc); grep -m1 \"cpu cores\" /proc/cpuinfo | tr -d \"\\t\"; \
             echo tsc-deadline cpus: $(grep -cw tsc_deadline_timer /proc/cpuinfo); \
             echo pit lines: $(grep -c \"^ *0:\" /proc/interrupts)"
        ),
        exec("--memory-mib 256", "grep MemTotal /proc/meminfo"),
        exec("--memory-mib 512", "grep MemTotal /proc/meminfo"),
    ));
    out.assert_success();
    assert_eq!(out.values("nproc:"), ["2"], "{}", out.stdout);
    // One package of two cores (CPUID topology leaves), not two packages.
    assert_eq!(out.values("cpu cores:"), ["2"], "{}", out.stdout);
    // Every vCPU has the TSC-deadline timer, so Linux neither calibrates its
    // LAPIC timer against the PIT nor checks the PIT's interrupt at boot
    // (0.3-0.5 s of each boot in the lab): IRQ 0 never gets a line.
    assert_eq!(out.values("tsc-deadline cpus:"), ["2"], "{}", out.stdout);
    assert_eq!(out.values("pit lines:"), ["0"], "{}", out.stdout);
    let kib: Vec<u64> = out
        .values("MemTotal:")
        .iter()
        .map(|v| v.trim_end_matches("kB").trim().parse().unwrap())
        .collect();
    assert_eq!(kib.len(), 2, "{}", out.stdout);
    // All of it less what the kernel keeps for itself.
    assert!((200 * 1024..=256 * 1024).contains(&kib[0]), "{kib:?}");
    assert!((450 * 1024..=512 * 1024).contains(&kib[1]), "{kib:?}");
}

#[test]
fn python_runs_on_the_default_image() {
    let out = lab::run(
        "sprout vm run --exec \"python3 -c 'print(2**100)'\"\necho \"status: $?\"\n\
         sprout vm run --exec 'python3 -c \"import sys; sys.exit(7)\"'\necho \"status: $?\"",
    );
    out.assert_success();
    assert!(
        out.stdout.contains("1267650600228229401496703205376"),
        "{}",
        out.stdout
    );
    // The command's exit status is sprout's.
    assert_eq!(out.values("status:"), ["0", "7"], "{}", out.stdout);
}

#[test]
fn workspace_and_root_changes_survive_on_the_writable_disk() {
    let disk = "--disk /tmp/rw.ext4";
    let out = lab::run(&format!(
        "{}\n{}\n",
        exec(
            disk,
            "echo kept > /workspace/note && echo also > /root/note && sync && echo written"
        ),
        exec(
            disk,
            "echo ws: $(cat /workspace/note); echo root: $(cat /root/note); \
             echo fs: $(stat -f -c %T /workspace)"
        ),
    ));
    out.assert_success();
    assert_eq!(out.values("written"), [""], "{}", out.stdout);
    assert_eq!(out.values("ws:"), ["kept"], "{}", out.stdout);
    assert_eq!(out.values("root:"), ["also"], "{}", out.stdout);
    assert_eq!(out.values("fs:"), ["ext2/ext3"], "{}", out.stdout);
}

#[test]
fn reboot_in_the_guest_ends_the_vm_with_status_0() {
    let out = lab::run(&format!(
        "{}\necho \"status: $?\"\n{}\necho \"status: $?\"",
        exec("", "echo rebooting; reboot; sleep 60; exit 9"),
        exec("", "exit 3"),
    ));
    out.assert_success();
    assert!(out.stdout.contains("rebooting"), "{}", out.stdout);
    assert!(
        out.stdout.contains("the guest ended the VM"),
        "{}",
        out.stdout
    );
    assert_eq!(out.values("status:"), ["0", "3"], "{}", out.stdout);
}
