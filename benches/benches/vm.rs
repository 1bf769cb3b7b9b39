//! VMM core latency on the test guest under this machine's KVM:
//! * `vm_create`: KVM VM + irqchip + guest memory + devices + vCPU threads,
//!   no guest code run;
//! * `boot_to_first_serial_line`: create, run, until the guest's first console
//!   line arrives (includes emulated guest supervisor code on this host);
//! * `mailbox_round_trip`: one ECHO command to a booted, idle guest and back
//!   (host -> irq -> guest wakes from HLT -> answers -> doorbell exit).

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use guest_abi::mailbox as mb;
use vmm::{ConsoleBuffer, SerialOutput, Vm, VmConfig};

fn config(console: &ConsoleBuffer) -> VmConfig {
    let mut c = VmConfig::new(testguest_build::TESTGUEST_PATH);
    c.vcpus = 1;
    c.mem_mib = 256;
    c.serial = SerialOutput::Buffer(console.clone());
    c
}

fn vm_create(c: &mut Criterion) {
    c.bench_function("vm_create", |b| {
        b.iter(|| {
            let vm = Vm::create(config(&ConsoleBuffer::new(4096))).unwrap();
            drop(vm);
        })
    });
}

fn boot_to_first_serial_line(c: &mut Criterion) {
    c.bench_function("boot_to_first_serial_line", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let console = ConsoleBuffer::new(4096);
                let mut vm = Vm::create(config(&console)).unwrap();
                let t = Instant::now();
                vm.resume().unwrap();
                while !console.text().contains('\n') {
                    assert!(t.elapsed() < Duration::from_secs(30), "no console line");
                    std::hint::spin_loop();
                }
                total += t.elapsed();
                drop(vm);
            }
            total
        })
    });
}

fn mailbox_round_trip(c: &mut Criterion) {
    let console = ConsoleBuffer::new(4096);
    let vm = Vm::start(config(&console)).unwrap();
    let m = vm.mailbox().unwrap();
    m.wait_ready(0, Duration::from_secs(30)).unwrap();
    c.bench_function("mailbox_round_trip", |b| {
        b.iter(|| {
            let r = m
                .call(0, mb::CMD_ECHO, [7, 0, 0, 0], Duration::from_secs(10))
                .unwrap();
            assert_eq!(r.rets[0], 7);
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(50).measurement_time(Duration::from_secs(5));
    targets = vm_create, boot_to_first_serial_line, mailbox_round_trip
}
criterion_main!(benches);
