//! The end-to-end latency report: runs each measured path many times and
//! prints p50/p99 (and min/max) as a Markdown table for docs/benchmarks.md.
//!
//! `cargo run --release -p sprout-benches --bin report -- [vm|snapshot|fork|workers|all] [RUNS]`
//! (default: all, 200 runs for the VM core, 30 for snapshots). `workers`
//! measures fork and restore across worker processes beside the same
//! in-process; this binary is its own worker (`report worker ...`).
//! `api URL [--data-dir DIR] [--image NAME]` measures a running sproutd's
//! API beside the library (api.rs). With `--json`, one JSON object a row (`{"name", "runs", "p50_ms",
//! "p99_ms", "min_ms", "max_ms"}`) follows the table, to compare commits.

use std::time::{Duration, Instant};

use guest_abi::mailbox as mb;
use vmm::{ConsoleBuffer, SerialOutput, Vm, VmConfig};

fn config(console: &ConsoleBuffer, vcpus: u8) -> VmConfig {
    let mut c = VmConfig::new(testguest_build::TESTGUEST_PATH);
    c.vcpus = vcpus;
    c.mem_mib = 256;
    c.serial = SerialOutput::Buffer(console.clone());
    c
}

/// The rows' JSON lines, printed after the table with `--json`.
static JSON: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

fn row(name: &str, mut v: Vec<Duration>) {
    v.sort();
    let pct = |p: f64| {
        let i = ((v.len() as f64 - 1.0) * p).round() as usize;
        v[i]
    };
    let ms = |d: Duration| format!("{:.3}", d.as_secs_f64() * 1e3);
    println!(
        "| {name} | {} | {} | {} | {} | {} |",
        v.len(),
        ms(pct(0.5)),
        ms(pct(0.99)),
        ms(v[0]),
        ms(v[v.len() - 1])
    );
    let f = |d: Duration| (d.as_secs_f64() * 1e6).round() / 1e3;
    // Keys in this order, for people reading the lines too.
    let line = format!(
        "{{\"name\":{},\"runs\":{},\"p50_ms\":{},\"p99_ms\":{},\"min_ms\":{},\"max_ms\":{}}}",
        serde_json::Value::from(name),
        v.len(),
        f(pct(0.5)),
        f(pct(0.99)),
        f(v[0]),
        f(v[v.len() - 1])
    );
    JSON.lock().unwrap_or_else(|p| p.into_inner()).push(line);
}

fn main() -> anyhow::Result<()> {
    let what = std::env::args().nth(1).unwrap_or_else(|| "all".into());
    if what == "worker" {
        let code = sprout_worker::worker_main(std::env::args_os().skip(2));
        std::process::exit(if code == std::process::ExitCode::SUCCESS {
            0
        } else {
            1
        });
    }
    let json = std::env::args().any(|a| a == "--json");
    let mut pos = std::env::args().skip(1).filter(|a| a != "--json");
    let what = pos.next().unwrap_or_else(|| "all".into());
    let runs: Option<usize> = if what == "api" || what == "archive" {
        None
    } else {
        pos.next().map(|s| s.parse()).transpose()?
    };
    println!("| what | runs | p50 ms | p99 ms | min ms | max ms |");
    println!("| --- | --- | --- | --- | --- | --- |");
    if what == "vm" || what == "all" {
        vm_core(runs.unwrap_or(200))?;
    }
    if what == "snapshot" || what == "all" {
        snapshots::run(runs.unwrap_or(30))?;
    }
    if what == "fork" || what == "all" {
        fork::run(runs.unwrap_or(30))?;
    }
    if what == "workers" || what == "all" {
        workers::run(runs.unwrap_or(30))?;
    }
    if what == "api" {
        // report api URL [--data-dir DIR] [--image NAME] [RUNS]: a number
        // last is the run count.
        let mut rest: Vec<String> = std::env::args().skip(2).filter(|a| a != "--json").collect();
        let runs = match rest.last().map(|l| l.parse::<usize>()) {
            Some(Ok(n)) => {
                rest.pop();
                n
            }
            _ => 100,
        };
        api::run(&rest, runs)?;
    }
    if what == "archive" {
        // report archive URL [RUNS]
        let rest: Vec<String> = std::env::args().skip(2).filter(|a| a != "--json").collect();
        let url = anyhow::Context::context(rest.first(), "report archive URL [RUNS]")?;
        let runs = rest.get(1).map(|r| r.parse()).transpose()?.unwrap_or(5);
        archive::run(url, runs)?;
    }
    if json {
        println!();
        for l in JSON.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            println!("{l}");
        }
    }
    Ok(())
}

mod api;
mod archive;
mod fork;
mod snapshots;
mod workers;

fn vm_core(runs: usize) -> anyhow::Result<()> {
    let mut create = Vec::with_capacity(runs);
    let mut boot = Vec::with_capacity(runs);
    let mut ready = Vec::with_capacity(runs);
    for _ in 0..runs {
        let console = ConsoleBuffer::new(4096);
        let t = Instant::now();
        let mut vm = Vm::create(config(&console, 1))?;
        create.push(t.elapsed());
        let t = Instant::now();
        vm.resume()?;
        while !console.text().contains('\n') {
            anyhow::ensure!(t.elapsed() < Duration::from_secs(30), "no console line");
            std::hint::spin_loop();
        }
        boot.push(t.elapsed());
        vm.mailbox()
            .expect("mailbox")
            .wait_ready(0, Duration::from_secs(30))?;
        ready.push(t.elapsed());
    }
    row(
        "VM create (KVM VM, 256 MiB, devices, 1 vCPU thread; no guest code)",
        create,
    );
    row(
        "boot to first serial line (emulated guest supervisor code)",
        boot,
    );
    row(
        "boot to mailbox ready (emulated guest supervisor code)",
        ready,
    );

    for vcpus in [1u8, 2] {
        let console = ConsoleBuffer::new(4096);
        let vm = Vm::start(config(&console, vcpus))?;
        let m = vm.mailbox().expect("mailbox");
        let cpu = vcpus - 1;
        m.wait_ready(cpu, Duration::from_secs(30))?;
        let mut rt = Vec::with_capacity(runs * 5);
        for i in 0..runs * 5 {
            let t = Instant::now();
            let r = m.call(
                cpu,
                mb::CMD_ECHO,
                [i as u64, 0, 0, 0],
                Duration::from_secs(10),
            )?;
            rt.push(t.elapsed());
            anyhow::ensure!(r.rets[0] == i as u64, "bad echo");
        }
        row(
            &format!(
                "mailbox round trip, idle guest, vCPU {cpu} of {vcpus} (wake from HLT: emulated)"
            ),
            rt,
        );
    }
    Ok(())
}
