//! Fork and restore across worker processes against the same in-process,
//! in one run, on the test guest (1 vCPU, 512 MiB, 8 MiB of it written):
//! fork(1), fork(4), fork(16) and fork(100), the children started in
//! parallel from as many ready workers (or pre-built shells).
//!
//! Cross-process: the parent is a `sprout-worker` (this binary as `report
//! worker`); each child is a ready worker started ahead of time (process,
//! KVM VM, vCPU and memory slots made, not measured). Timed: the parent's
//! fork layer, every child's restore of it in parallel, and every child's
//! first mailbox answer, each over its control socket.

use std::path::Path;
use std::time::{Duration, Instant};

use guest_abi::layout::TESTGUEST_SCRATCH;
use guest_abi::mailbox as mb;
use sprout_worker::protocol::{Backend, BootSpec, RestoreSpec, Shape};
use sprout_worker::{Client, Request, WorkerCommand, WorkerProcess};
use vmm::{ForkOptions, MemoryBackend, RestoreOptions, ShellPool, Vm, VmShell};

use super::row;
use super::snapshots::{boot, echo, scratch};

const T: Duration = Duration::from_secs(30);
const SHAPE: Shape = Shape {
    vcpus: 1,
    mem_mib: 512,
};

fn answer(c: &mut Client) -> anyhow::Result<()> {
    let (status, r) = c.mailbox(0, mb::CMD_ECHO, [3, 0, 0, 0], T)?;
    anyhow::ensure!(status == 0 && r[0] == 3, "bad answer {status} {r:?}");
    Ok(())
}

fn cmd() -> anyhow::Result<WorkerCommand> {
    Ok(WorkerCommand::current_exe(&["worker"])?)
}

fn ready(
    cmd: &WorkerCommand,
    dir: &Path,
    n: usize,
    seq: &mut u64,
) -> anyhow::Result<Vec<WorkerProcess>> {
    let socks: Vec<_> = (0..n)
        .map(|_| {
            *seq += 1;
            dir.join(format!("w{seq}.sock"))
        })
        .collect();
    Ok(cmd.spawn_ready(&socks, SHAPE, None)?)
}

fn stop(ws: Vec<WorkerProcess>) {
    for mut w in ws {
        let _ = w.client.stop();
        let _ = w.child.wait();
    }
}

fn spec(dir: &Path) -> RestoreSpec {
    RestoreSpec {
        dir: dir.to_owned(),
        backend: Backend::Mmap,
        vsock_uds: None,
        instance_id: None,
        prefetch: false,
        net: None,
    }
}

pub fn run(runs: usize) -> anyhow::Result<()> {
    let dir = scratch()?;
    let cmd = cmd()?;
    let mut seq = 0;

    // The parents: one in this process, one in a worker, each with 8 MiB written.
    let mut local = boot()?;
    let mut parent = cmd.spawn(&dir.0.join("parent.sock"), None, None)?;
    let mut s = vmm::VmConfig::new(testguest_build::TESTGUEST_PATH);
    s.mem_mib = SHAPE.mem_mib;
    parent.client.call(&Request::Boot(BootSpec {
        spec: s.spec(),
        instance_id: None,
    }))?;
    parent
        .client
        .mailbox(0, mb::CMD_FILL, [TESTGUEST_SCRATCH, 2048, 1, 0], T)?;

    let pool = ShellPool::new(SHAPE.vcpus, SHAPE.mem_mib);
    let opts = ForkOptions::new(&dir.0);
    for n in [1usize, 4, 16, 100] {
        let reps = match n {
            100 => runs.div_ceil(10).max(3),
            16 => runs.div_ceil(3),
            _ => runs,
        };
        let (mut inproc, mut xproc) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            // In-process, shells pre-built.
            pool.fill(n)?;
            let t = Instant::now();
            let kids = local.fork(n, &opts, Some(&pool))?;
            for k in &kids {
                echo(k, mb::CMD_ECHO, [3, 0, 0, 0])?;
            }
            inproc.push(t.elapsed());
            drop(kids);

            // Across processes, ready workers pre-started.
            let mut kids = ready(&cmd, &dir.0, n, &mut seq)?;
            let t = Instant::now();
            let layer = parent.client.write_fork_layer(&dir.0)?;
            std::thread::scope(|s| -> anyhow::Result<()> {
                let hs: Vec<_> = kids
                    .iter_mut()
                    .map(|k| {
                        let sp = spec(&layer.dir);
                        s.spawn(move || -> anyhow::Result<()> {
                            k.client.restore_fork_layer(sp)?;
                            answer(&mut k.client)
                        })
                    })
                    .collect();
                hs.into_iter()
                    .try_for_each(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("panic"))))
            })?;
            xproc.push(t.elapsed());
            stop(kids);
        }
        row(
            &format!("fork({n}) to all answering, in-process, shells pre-built"),
            inproc,
        );
        row(
            &format!("fork({n}) to all answering, across worker processes, ready workers"),
            xproc,
        );
    }

    // Restore of a durable snapshot into a ready VM, to its first answer.
    let snap = dir.0.join("snap");
    parent.client.snapshot(&snap, false)?;
    let (mut inproc, mut xproc) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let shell = VmShell::new(SHAPE.vcpus, SHAPE.mem_mib)?;
        let mut o = RestoreOptions::new(MemoryBackend::Mmap);
        o.prefetch = false;
        o.record_working_set_for = None;
        o.scratch_dir = dir.0.clone();
        let t = Instant::now();
        let vm = Vm::restore_in(shell, &snap, o)?;
        echo(&vm, mb::CMD_ECHO, [3, 0, 0, 0])?;
        inproc.push(t.elapsed());
        drop(vm);

        let mut w = ready(&cmd, &dir.0, 1, &mut seq)?;
        let t = Instant::now();
        w[0].client.restore(spec(&snap))?;
        answer(&mut w[0].client)?;
        xproc.push(t.elapsed());
        stop(w);
    }
    row(
        "restore into a ready VM shell to first answer, in-process (mmap)",
        inproc,
    );
    row(
        "restore into a ready worker to first answer, across processes (mmap)",
        xproc,
    );

    // Host memory of an idle child worker, whole process.
    let n = 16;
    let mut kids = ready(&cmd, &dir.0, n, &mut seq)?;
    let layer = parent.client.write_fork_layer(&dir.0)?;
    for k in &mut kids {
        k.client.restore_fork_layer(spec(&layer.dir))?;
        answer(&mut k.client)?;
    }
    std::thread::sleep(Duration::from_millis(200));
    let (mut pss, mut dirty) = (0, 0);
    for k in &mut kids {
        let m = k.client.metrics()?;
        pss += m.pss_kib;
        dirty += m.private_dirty_kib;
    }
    println!(
        "| PSS per idle child worker process ({n} children, KiB): {} (private dirty {}) | | | | | |",
        pss / n as u64,
        dirty / n as u64
    );
    stop(kids);
    let _ = parent.client.stop();
    let _ = parent.child.wait();
    Ok(())
}
