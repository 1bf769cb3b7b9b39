//! The VMM core on the test guest under real KVM: boot, vCPUs, memory, reset,
//! and clean teardown.

use guest_abi::layout::{MIB, TESTGUEST_SCRATCH};
use guest_abi::mailbox::{self as mb, checksum_step, pattern_word};
use sprout_tests::{boot, call, config, TIMEOUT};
use vm_memory::{Bytes, GuestAddress};
use vmm::ExitReason;

#[test]
fn boots_and_prints_to_serial() {
    let (cfg, console) = config(1, 256);
    let vm = boot(cfg, &console);
    assert!(
        console.text().contains("sprout testguest: cpu 0 up"),
        "console: {}",
        console.text()
    );
    let r = call(&vm, 0, mb::CMD_ECHO, [0xfeed_f00d, 0, 0, 0]);
    assert_eq!(r.rets[0], 0xfeed_f00d);
    assert_eq!(r.rets[1], 0);
}

#[test]
fn two_vcpus_both_answer() {
    let (cfg, console) = config(2, 256);
    let vm = boot(cfg, &console);
    for cpu in 0..2u8 {
        let r = call(&vm, cpu, mb::CMD_ECHO, [100 + u64::from(cpu), 0, 0, 0]);
        assert_eq!(r.rets, [100 + u64::from(cpu), u64::from(cpu), 0, 0]);
    }
    // Both count at once: each advances its own counter.
    let m = vm.mailbox().unwrap();
    std::thread::scope(|s| {
        for cpu in 0..2u8 {
            s.spawn(move || {
                let r = m
                    .call(cpu, mb::CMD_COUNT, [1_000_000, 0, 0, 0], TIMEOUT)
                    .unwrap();
                assert_eq!(r.rets[0], 1_000_000);
            });
        }
    });
    assert_eq!(m.counter(0).unwrap(), 1_000_000);
    assert_eq!(m.counter(1).unwrap(), 1_000_000);
}

#[test]
fn the_maximum_of_four_vcpus_each_answer() {
    let (cfg, console) = config(4, 256);
    let vm = boot(cfg, &console);
    for cpu in 0..4u8 {
        let r = call(&vm, cpu, mb::CMD_ECHO, [cpu.into(), 0, 0, 0]);
        assert_eq!(r.rets[1], u64::from(cpu), "answered by the wrong vCPU");
    }
    for cpu in 1..4u8 {
        assert!(console.text().contains(&format!("cpu {cpu} up")));
    }
}

#[test]
fn ram_size_is_honoured_below_and_above_the_gap() {
    for mib in [200u64, 3584] {
        let (cfg, console) = config(1, mib);
        let vm = boot(cfg, &console);
        let r = call(&vm, 0, mb::CMD_MEMINFO, [0; 4]);
        let bytes = mib * MIB;
        // Usable RAM is all of it but the legacy hole between 640 KiB and 1 MiB.
        let hole = guest_abi::layout::HIMEM_START - guest_abi::layout::LOWMEM_END;
        assert_eq!(r.rets[0], bytes - hole, "{mib} MiB");
        let end = if bytes > guest_abi::layout::MMIO_GAP_START {
            bytes + (guest_abi::layout::MMIO_GAP_END - guest_abi::layout::MMIO_GAP_START)
        } else {
            bytes
        };
        assert_eq!(r.rets[1], end, "{mib} MiB: end of RAM");
        assert_eq!(r.rets[2], 1, "{mib} MiB: last page writable");
    }
}

#[test]
fn patterns_cross_between_guest_and_host() {
    let (cfg, console) = config(1, 256);
    let vm = boot(cfg, &console);
    let mem = vm.memory();
    let pages = 512u64; // 2 MiB
    let gpa = TESTGUEST_SCRATCH;

    // Guest writes, host reads back every word.
    let seed = 0x5eed;
    let r = call(&vm, 0, mb::CMD_FILL, [gpa, pages, seed, 0]);
    let mut buf = vec![0u8; (pages * 4096) as usize];
    mem.read_slice(&mut buf, GuestAddress(gpa)).unwrap();
    let mut sum = 0;
    for (i, w) in buf.chunks_exact(8).enumerate() {
        let addr = gpa + i as u64 * 8;
        let word = u64::from_le_bytes(w.try_into().unwrap());
        assert_eq!(word, pattern_word(seed, addr), "word at {addr:#x}");
        sum = checksum_step(sum, word);
    }
    assert_eq!(r.rets[0], sum);

    // Host writes, guest checksums.
    let gpa2 = gpa + 64 * MIB;
    let mut sum = 0;
    for (i, w) in buf.chunks_exact_mut(8).enumerate() {
        let v = pattern_word(77, i as u64);
        w.copy_from_slice(&v.to_le_bytes());
        sum = checksum_step(sum, v);
    }
    mem.write_slice(&buf, GuestAddress(gpa2)).unwrap();
    let r = call(&vm, 0, mb::CMD_CHECKSUM, [gpa2, pages, 0, 0]);
    assert_eq!(r.rets[0], sum);

    // The guest refuses buffers inside its own image or outside RAM.
    let m = vm.mailbox().unwrap();
    let bad = m
        .call(0, mb::CMD_FILL, [0x10_0000, 1, 0, 0], TIMEOUT)
        .unwrap();
    assert_eq!(bad.status, mb::STATUS_BAD_ARG);
    let bad = m
        .call(0, mb::CMD_CHECKSUM, [255 * MIB, 2 * 256, 0, 0], TIMEOUT)
        .unwrap();
    assert_eq!(bad.status, mb::STATUS_BAD_ARG);
}

#[test]
fn stopping_a_running_vm_is_clean() {
    let (cfg, console) = config(1, 128);
    let vm = boot(cfg, &console);
    assert_eq!(vm.exit_reason(), None);
    assert_eq!(vm.stop(), ExitReason::Stopped);
}

#[test]
fn the_run_state_follows_the_vm_and_refuses_what_it_does_not_allow() {
    use vmm::{SnapshotKind, Vm, VmError, VmRunState};
    let dir = sprout_tests::TempDir::new("run-state");
    let (cfg, console) = config(2, 128);
    let mut vm = Vm::create(cfg).unwrap();
    assert_eq!(vm.state(), VmRunState::Created);
    assert!(!vm.is_paused());
    let e = vm.pause().unwrap_err();
    assert_eq!(e.to_string(), "Cannot pause: the VM has not started");
    vm.resume().unwrap();
    assert_eq!(vm.state(), VmRunState::Running);
    for c in 0..2 {
        vm.mailbox()
            .unwrap()
            .wait_ready(c, TIMEOUT)
            .unwrap_or_else(|e| panic!("vCPU {c} not ready: {e}\nconsole:\n{}", console.text()));
    }

    let e = vm.resume().unwrap_err();
    assert!(matches!(&e, VmError::InvalidState(s) if s.state == VmRunState::Running));
    assert_eq!(e.to_string(), "Cannot resume: the VM is running");

    vm.pause().unwrap();
    assert_eq!(vm.state(), VmRunState::Paused);
    assert!(vm.is_paused());
    let e = vm.pause().unwrap_err();
    assert_eq!(e.to_string(), "Cannot pause: the VM is paused");
    // A snapshot of a paused VM leaves it paused.
    vm.snapshot(&dir.path().join("paused"), SnapshotKind::Full)
        .unwrap();
    assert_eq!(vm.state(), VmRunState::Paused);
    vm.resume().unwrap();
    call(&vm, 1, mb::CMD_ECHO, [7, 0, 0, 0]);

    // The guest resets the machine: every operation but stop is refused.
    vm.mailbox()
        .unwrap()
        .call(
            0,
            mb::CMD_RESET,
            [0; 4],
            std::time::Duration::from_millis(1),
        )
        .ok();
    assert_eq!(vm.wait(Some(TIMEOUT)), Some(ExitReason::Reset));
    assert_eq!(vm.state(), VmRunState::Exited(ExitReason::Reset));
    let e = vm
        .snapshot(&dir.path().join("exited"), SnapshotKind::Full)
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "Cannot snapshot: the VM has exited (guest reset)"
    );
    assert!(!dir.path().join("exited").exists());
    assert!(vm.pause().is_err());
    assert!(vm.resume().is_err());
    assert_eq!(vm.stop(), ExitReason::Reset);
}

/// A vCPU stuck in a device handler (here: waiting for the serial device's
/// lock, which another thread holds forever) never acknowledges its exit;
/// `stop` gives up on it within its deadline instead of hanging, and says so.
#[test]
fn stop_returns_when_a_vcpu_is_stuck_in_a_device() {
    use std::time::{Duration, Instant};
    let (cfg, console) = config(2, 128);
    let vm = boot(cfg, &console);
    let serial = vm.serial_device();
    let (locked_tx, locked_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        let _g = serial.lock().unwrap_or_else(|p| p.into_inner());
        locked_tx.send(()).unwrap();
        let _ = release_rx.recv();
    });
    locked_rx.recv().unwrap();
    let m = vm.mailbox().unwrap();
    let msg = guest_abi::layout::TESTGUEST_SCRATCH;
    vm_memory::Bytes::write_slice(vm.memory(), b"wedged", vm_memory::GuestAddress(msg)).unwrap();
    // vCPU 0 blocks on the serial lock printing this; the call times out.
    assert!(m
        .call(0, mb::CMD_PRINT, [msg, 6, 0, 0], Duration::from_millis(300))
        .is_err());
    let t = Instant::now();
    let reason = vm.stop();
    let took = t.elapsed();
    assert!(took < Duration::from_secs(5), "stop took {took:?}");
    assert!(!reason.is_clean(), "{reason:?}");
    assert!(reason.to_string().contains("vCPU 0"), "{reason}");
    // Let the abandoned thread finish so the process ends tidily.
    release_tx.send(()).unwrap();
    holder.join().unwrap();
}

/// A boot into a shell built ahead of time (a ready worker's): the guest runs
/// and its RAM is the range the shell reserved (and registered with KVM);
/// a shell of another shape is not used, and the VM boots as without one.
#[test]
fn boots_into_a_shell_of_its_shape_and_not_into_another() {
    for (shell, cpus) in [((2, 256), 2), ((1, 128), 1)] {
        let (cfg, console) = config(cpus, 256);
        let s = vmm::VmShell::new(shell.0, shell.1).unwrap();
        let vm = vmm::Vm::start_in(cfg, Some(s)).expect("VM starts in the shell");
        let mbox = vm.mailbox().expect("test guest has a mailbox");
        for c in 0..cpus {
            mbox.wait_ready(c, TIMEOUT)
                .unwrap_or_else(|e| panic!("vCPU {c}: {e}\nconsole:\n{}", console.text()));
            let r = call(&vm, c, mb::CMD_ECHO, [7 + u64::from(c), 0, 0, 0]);
            assert_eq!(r.rets[..2], [7 + u64::from(c), u64::from(c)]);
        }
        // What the guest writes, the host reads where RAM is mapped.
        let (gpa, pages, seed) = (TESTGUEST_SCRATCH, 16u64, 0x5eed);
        call(&vm, 0, mb::CMD_FILL, [gpa, pages, seed, 0]);
        let mut buf = vec![0u8; (pages * 4096) as usize];
        vm.memory().read_slice(&mut buf, GuestAddress(gpa)).unwrap();
        for (i, w) in buf.chunks_exact(8).enumerate() {
            let addr = gpa + i as u64 * 8;
            let word = u64::from_le_bytes(w.try_into().unwrap());
            assert_eq!(word, pattern_word(seed, addr), "word at {addr:#x}");
        }
        drop(vm);
    }
}
