//! Fork on the test guest: 1 vCPU, 512 MiB parent that has been running.

use std::time::{Duration, Instant};

use guest_abi::layout::TESTGUEST_SCRATCH;
use guest_abi::mailbox as mb;
use vmm::{ForkOptions, MemoryBackend, ShellPool, Vm};

use super::row;
use super::snapshots::{boot, echo, scratch};

fn pss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/smaps_rollup")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Pss:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn all_answer(children: &[Vm]) -> anyhow::Result<()> {
    let boxes: Vec<_> = children
        .iter()
        .map(|c| c.mailbox().expect("mailbox"))
        .collect();
    std::thread::scope(|s| {
        let hs: Vec<_> = boxes
            .iter()
            .map(|m| {
                s.spawn(move || -> anyhow::Result<()> {
                    let r = m.call(0, mb::CMD_ECHO, [3, 0, 0, 0], Duration::from_secs(30))?;
                    anyhow::ensure!(r.is_ok() && r.rets[0] == 3, "bad answer {r:?}");
                    Ok(())
                })
            })
            .collect();
        hs.into_iter()
            .try_for_each(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("panic"))))
    })
}

pub fn run(runs: usize) -> anyhow::Result<()> {
    let dir = scratch()?;
    let mut parent = boot()?;
    let pool = ShellPool::new(1, 512);
    for backend in [MemoryBackend::Mmap, MemoryBackend::Uffd] {
        let mut opts = ForkOptions::new(&dir.0);
        opts.backend = backend;
        for n in [1usize, 4, 16] {
            let (mut total, mut pause) = (Vec::new(), Vec::new());
            let reps = if n == 16 { runs.div_ceil(3) } else { runs };
            for _ in 0..reps {
                pool.fill(n)?; // ahead of time, not measured
                let t = Instant::now();
                let children = parent.fork(n, &opts, Some(&pool))?;
                all_answer(&children)?;
                total.push(t.elapsed());
                pause.push(parent.last_pause());
                drop(children);
            }
            let b = format!("{backend:?}").to_lowercase();
            row(
                &format!("fork({n}) to all children answering, {b}, shells pre-built"),
                total,
            );
            if n == 1 {
                row(&format!("parent pause window during fork(1), {b}"), pause);
            }
        }
    }
    // The parent's pause when 16 MiB changed since its last layer: a diff
    // snapshot of 16 MiB without fsyncs.
    let mut pause16 = Vec::new();
    let opts = ForkOptions::new(&dir.0);
    for i in 0..runs {
        echo(
            &parent,
            mb::CMD_FILL,
            [TESTGUEST_SCRATCH + (64 << 20), 4096, i as u64, 0],
        )?;
        pool.fill(1)?;
        let children = parent.fork(1, &opts, Some(&pool))?;
        pause16.push(parent.last_pause());
        drop(children);
    }
    row(
        "parent pause window, fork(1) after 16 MiB dirtied (= a 16 MiB diff without fsync)",
        pause16,
    );

    // Host memory per child: PSS of this process (the VMM and every child in it).
    for backend in [MemoryBackend::Mmap, MemoryBackend::Uffd] {
        let mut opts = ForkOptions::new(&dir.0);
        opts.backend = backend;
        let n = 8;
        pool.fill(n)?;
        std::thread::sleep(Duration::from_millis(100));
        let before = pss_kib();
        let children = parent.fork(n, &opts, Some(&pool))?;
        all_answer(&children)?;
        std::thread::sleep(Duration::from_millis(100));
        let idle = pss_kib().saturating_sub(before) / n as u64;
        for (i, c) in children.iter().enumerate() {
            echo(
                c,
                mb::CMD_FILL,
                [TESTGUEST_SCRATCH + (128 << 20), 2560, i as u64, 0],
            )?;
        }
        let dirty = pss_kib().saturating_sub(before) / n as u64;
        println!(
            "| PSS per child, {} ({n} children, KiB): idle {idle}, after dirtying 10 MiB {dirty} | | | | | |",
            format!("{backend:?}").to_lowercase()
        );
        drop(children);
    }
    Ok(())
}
