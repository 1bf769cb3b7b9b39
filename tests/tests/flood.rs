//! The host keeps control of a hostile guest: the test guest's `CMD_FLOOD` keeps
//! the virtio-blk and virtio-rng queues full and notifies without pause on vCPU 0,
//! and pause, snapshot, resume, restore and stop still finish within deadlines
//! timed on the host, while vCPU 1 keeps answering its mailbox.

use std::time::{Duration, Instant};

use guest_abi::layout::TESTGUEST_SCRATCH;
use guest_abi::mailbox as mb;
use sprout_tests::{boot, call, config, TempDir, TIMEOUT};
use vm_memory::{Bytes, GuestAddress};
use vmm::mailbox::MailboxError;
use vmm::{
    vm::STOP_DEADLINE, DiskConfig, ExitReason, MemoryBackend, RestoreOptions, SnapshotKind, Vm,
};

const PAUSE_DEADLINE: Duration = Duration::from_secs(2);
const RESUME_DEADLINE: Duration = Duration::from_secs(2);
const SNAPSHOT_DEADLINE: Duration = Duration::from_secs(10);
const RESTORE_DEADLINE: Duration = Duration::from_secs(10);
/// A mailbox round trip to the vCPU that is not flooding.
const CALL_DEADLINE: Duration = Duration::from_secs(2);
const STOP_MARGIN: Duration = Duration::from_secs(1);
/// Sectors per flooded blk read.
const SECTORS: u64 = 8;
/// Chains each device must return to count as "the flood runs".
const PROGRESS: u64 = 20_000;
/// Chains one device may return while the other returns none: 64 dispatches'
/// worth at the devices' `MAX_CHAINS_PER_DISPATCH` (64).
const STARVED: u64 = 4096;

/// Runs `f`, asserts it took at most `deadline`, and returns its result and time.
fn timed<T>(what: &str, deadline: Duration, f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let r = f();
    let took = t.elapsed();
    assert!(
        took <= deadline,
        "{what} took {took:?} under the flood (deadline {deadline:?})"
    );
    eprintln!("flood: {what}: {took:?}");
    (r, took)
}

/// vCPU 0's flood counter (chains the devices returned).
fn flood_count(vm: &Vm) -> u64 {
    vm.mailbox().unwrap().counter(0).unwrap()
}

/// Chains each device (blk, rng) returned to the flood.
fn device_counts(vm: &Vm) -> [u64; 2] {
    let at = mb::flood_counts_gpa(TESTGUEST_SCRATCH, SECTORS);
    vm.memory().read_obj(GuestAddress(at)).unwrap()
}

/// Polls, within `TIMEOUT`, until the devices returned `PROGRESS` more chains
/// than `from`, and each device `PROGRESS` more than it had then: the flood runs.
/// Between two polls, neither device may return `STARVED` chains while the other
/// returns none: the guest refills and notifies both queues on every pass, so a
/// device that is not served then is kept from the event loop by the other's
/// dispatch (which `MAX_CHAINS_PER_DISPATCH` bounds).
fn wait_flood_past(vm: &Vm, from: u64) -> u64 {
    let deadline = Instant::now() + TIMEOUT;
    let each_from = device_counts(vm);
    let mut last = each_from;
    loop {
        let n = flood_count(vm);
        let each = device_counts(vm);
        let step = [each[0] - last[0], each[1] - last[1]];
        assert!(
            !(step[0] >= STARVED && step[1] == 0 || step[1] >= STARVED && step[0] == 0),
            "one device's flood starved the other: (blk, rng) returned {step:?} between two polls"
        );
        last = each;
        if n >= from + PROGRESS && each.iter().zip(each_from).all(|(&e, f)| e >= f + PROGRESS) {
            return n;
        }
        if let Some(r) = vm.exit_reason() {
            panic!("the VM ended under the flood: {r}");
        }
        assert!(
            Instant::now() < deadline,
            "the flood made no progress: {n} chains after {TIMEOUT:?}, from {from}; \
             per device (blk, rng) {each:?}, from {each_from:?}"
        );
        // A poll interval, not a wait for the condition: the loop checks it again.
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// vCPU 1 answers an echo within `CALL_DEADLINE`.
fn echo_other_vcpu(vm: &Vm, what: &str, v: u64) -> Duration {
    let (r, took) = timed(what, CALL_DEADLINE, || {
        vm.mailbox()
            .unwrap()
            .call(1, mb::CMD_ECHO, [v, 0, 0, 0], CALL_DEADLINE)
            .unwrap_or_else(|e| panic!("{what}: {e}"))
    });
    assert!(r.is_ok(), "{what}: {r:?}");
    assert_eq!(r.rets, [v, 1, 0, 0], "{what}");
    took
}

fn flood_args() -> [u64; 4] {
    [mb::FLOOD_BLK | mb::FLOOD_RNG, 0, TESTGUEST_SCRATCH, SECTORS]
}

#[test]
fn host_controls_a_vm_whose_guest_floods_blk_and_rng() {
    let dir = TempDir::new("flood");
    let disk = dir.path().join("disk.img");
    std::fs::write(&disk, vec![0x5a; 1 << 20]).unwrap();
    let (mut cfg, console) = config(2, 256);
    cfg.disks = vec![DiskConfig {
        path: disk,
        read_only: false,
        id: "flood".into(),
        base: None,
    }];
    cfg.rng = true;
    let mut vm = boot(cfg, &console);
    let mbox = vm.mailbox().unwrap();

    // Bad requests are answered, not flooded.
    let ask = |cpu, args| mbox.call(cpu, mb::CMD_FLOOD, args, TIMEOUT).unwrap();
    assert_eq!(ask(1, flood_args()).status, mb::STATUS_NO_DEVICE);
    assert_eq!(
        ask(0, [0, 0, TESTGUEST_SCRATCH, 1]).status,
        mb::STATUS_BAD_ARG
    );
    assert_eq!(
        ask(0, [4, 0, TESTGUEST_SCRATCH, 1]).status,
        mb::STATUS_BAD_ARG
    );
    assert_eq!(ask(0, [1, 0, 0, 1]).status, mb::STATUS_BAD_ARG);
    assert_eq!(
        ask(0, [1, 0, TESTGUEST_SCRATCH, 0]).status,
        mb::STATUS_BAD_ARG
    );
    assert_eq!(
        ask(0, [1, 7, TESTGUEST_SCRATCH, 1]).status,
        mb::STATUS_NO_DEVICE
    );

    // Start it: vCPU 0 answers "started", then floods for good.
    let r = call(&vm, 0, mb::CMD_FLOOD, flood_args());
    assert_eq!(r.rets[0], mb::FLOOD_BLK | mb::FLOOD_RNG);
    let (t0, c0) = (Instant::now(), flood_count(&vm));
    let n = wait_flood_past(&vm, c0);
    let rate = (n - c0) as f64 / t0.elapsed().as_secs_f64();
    eprintln!("flood: {rate:.0} chains/s returned");
    // vCPU 0 serves nothing any more; vCPU 1 does.
    let e = mbox
        .call(0, mb::CMD_ECHO, [1, 0, 0, 0], Duration::from_millis(200))
        .unwrap_err();
    assert!(matches!(e, MailboxError::Timeout { cpu: 0, .. }), "{e}");
    echo_other_vcpu(&vm, "echo on vCPU 1", 11);

    // Pause: the flood stops (the counter stays put across a snapshot of the paused VM).
    timed("pause", PAUSE_DEADLINE, || vm.pause().expect("pause"));
    let paused_at = flood_count(&vm);
    assert!(paused_at >= n);
    let snap_paused = dir.path().join("snap-paused");
    let (r, _) = timed("full snapshot (paused)", SNAPSHOT_DEADLINE, || {
        vm.snapshot(&snap_paused, SnapshotKind::Full)
    });
    r.expect("snapshot of the paused VM");
    assert!(vm.is_paused());
    assert_eq!(flood_count(&vm), paused_at, "the flood ran while paused");

    // Resume: the flood goes on and vCPU 1 still answers.
    timed("resume", RESUME_DEADLINE, || vm.resume().expect("resume"));
    wait_flood_past(&vm, paused_at);
    echo_other_vcpu(&vm, "echo on vCPU 1 after resume", 12);

    // A full snapshot of the running, flooding VM (it pauses and resumes inside).
    let snap = dir.path().join("snap-running");
    let (r, _) = timed("full snapshot (running)", SNAPSHOT_DEADLINE, || {
        vm.snapshot(&snap, SnapshotKind::Full)
    });
    r.expect("snapshot of the running VM");
    assert!(!vm.is_paused());
    wait_flood_past(&vm, flood_count(&vm));
    echo_other_vcpu(&vm, "echo on vCPU 1 after the snapshot", 13);

    // Stop, under the flood.
    let (reason, _) = timed("stop", STOP_DEADLINE + STOP_MARGIN, || vm.stop());
    assert_eq!(reason, ExitReason::Stopped, "console:\n{}", console.text());

    // Each snapshot restores, the restored guest floods again, and the host controls it.
    for (tag, snap) in [("paused", &snap_paused), ("running", &snap)] {
        let mut o = RestoreOptions::new(MemoryBackend::Mmap);
        o.scratch_dir = dir.path().to_path_buf();
        let (r, _) = timed(&format!("restore ({tag})"), RESTORE_DEADLINE, || {
            Vm::restore(snap, o)
        });
        let mut r = r.unwrap_or_else(|e| panic!("restore of the {tag} snapshot: {e}"));
        wait_flood_past(&r, flood_count(&r));
        echo_other_vcpu(&r, &format!("echo on vCPU 1, restored ({tag})"), 14);
        timed(&format!("pause, restored ({tag})"), PAUSE_DEADLINE, || {
            r.pause().expect("pause")
        });
        timed(
            &format!("resume, restored ({tag})"),
            RESUME_DEADLINE,
            || r.resume().expect("resume"),
        );
        let (reason, _) = timed(
            &format!("stop, restored ({tag})"),
            STOP_DEADLINE + STOP_MARGIN,
            || r.stop(),
        );
        assert_eq!(reason, ExitReason::Stopped, "restored ({tag})");
    }
}

/// KVM completes an MMIO or port access (the register load, the instruction
/// pointer step) only on the next `KVM_RUN`. A vCPU asked to pause right after
/// such an exit must complete it before parking, or its saved state would make
/// a restored vCPU redo the access. A 4 MiB `CMD_PRINT` keeps vCPU 1 in serial
/// MMIO exits (one per byte): many pauses land right after one, and each must
/// have gone through the parking `KVM_RUN` (its last return is `interrupted`,
/// never the access's exit). Without that step the last exit is the access.
#[test]
fn a_pause_right_after_an_mmio_exit_completes_the_access_first() {
    const LEN: usize = 4 << 20;
    let (cfg, console) = config(2, 256);
    let mut vm = boot(cfg, &console);
    vm.memory()
        .write_slice(&vec![b'.'; LEN], GuestAddress(TESTGUEST_SCRATCH))
        .unwrap();
    // Start the print and leave it running: the call gives up at once.
    let e = vm
        .mailbox()
        .unwrap()
        .call(
            1,
            mb::CMD_PRINT,
            [TESTGUEST_SCRATCH, LEN as u64, 0, 0],
            Duration::from_millis(1),
        )
        .unwrap_err();
    assert!(matches!(e, MailboxError::Timeout { cpu: 1, .. }), "{e}");

    // Enough pauses that some land right after an MMIO exit, however the
    // machine is loaded; bounded by TIMEOUT (and by the print's end).
    let deadline = Instant::now() + TIMEOUT;
    let (mut pauses, mut after_mmio) = (0u32, 0u32);
    while (pauses < 200 || after_mmio < 20) && Instant::now() < deadline {
        vm.pause().expect("pause");
        pauses += 1;
        let reports = vm.inspect_vcpus();
        let v1 = &reports[1];
        assert!(!v1.in_kvm_run, "{v1}");
        assert_eq!(
            v1.last_exit, "interrupted",
            "vCPU 1 parked without completing its last access: {v1}"
        );
        assert!(v1.regs.is_some(), "{v1}");
        if v1.parked_after.starts_with("mmio") {
            after_mmio += 1;
        }
        vm.resume().expect("resume");
    }
    eprintln!("park: {after_mmio} of {pauses} pauses came right after an MMIO exit");
    assert!(
        after_mmio >= 20,
        "only {after_mmio} of {pauses} pauses came right after an MMIO exit: \
         the test did not exercise the case"
    );

    // Inspecting a running VM pauses it for a moment and leaves it running.
    let reports = vm.inspect_vcpus();
    assert_eq!(reports.len(), 2);
    for r in &reports {
        let regs = r
            .regs
            .as_ref()
            .unwrap_or_else(|| panic!("no registers: {r}"));
        assert_ne!(regs.rip, 0, "{r}");
        assert!(r.kvm_run_entries > 0, "{r}");
    }
    assert!(!vm.is_paused());
    let before = vm.inspect_vcpus()[1].kvm_run_entries;
    let printing = Instant::now() + TIMEOUT;
    while vm.inspect_vcpus()[1].kvm_run_entries == before {
        assert!(
            Instant::now() < printing,
            "vCPU 1 stopped running after the inspections"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(vm.stop(), ExitReason::Stopped);
}
