//! The control socket of `sprout vm run --api-sock PATH`: a Unix socket taking
//! one text command per line and answering one line, `ok ...` or `error ...`.
//!
//! ```text
//! status                     -> ok running | ok paused | ok exited <reason>
//! pause | resume             -> ok
//! stop                       -> ok          (the VM ends; `sprout` exits 0)
//! snapshot DIR [full|diff]   -> ok DIR      (DIR must not exist; default full)
//! fork N                     -> ok SOCK...  (N children, each with its own control
//!                                           socket beside this one; 1 <= N <= 64)
//! mailbox CPU CMD A0 A1 A2 A3 -> ok STATUS R0 R1 R2 R3   (test guest only)
//! vsock                      -> ok PATH     (the VM's vsock socket, if it has one)
//! ```
//!
//! A Linux VM's socket ([`ApiSocket::serve_linux`]) sends each forked child's
//! agent a new identity (instance id, host name, clock, entropy with a CRNG
//! reseed) before `fork` answers, so the first exec in a child is already
//! re-identified.
//!
//! Lines are at most [`MAX_LINE`] bytes; longer ones are refused.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use vmm::vcpu::ExitSignal;
use vmm::{ExitReason, ForkOptions, SnapshotKind, Vm};

use crate::agent;

pub const MAX_LINE: usize = 256;
const MAILBOX_TIMEOUT: Duration = Duration::from_secs(30);

/// Most children one `fork` command makes.
pub const MAX_FORK: usize = 64;

/// VMs forked through control sockets, kept (with their own sockets) until
/// they stop or the process ends.
#[derive(Default)]
pub struct Children {
    live: Mutex<Vec<ApiSocket>>,
    /// The family are Linux guests with the agent.
    linux: bool,
}

/// How long a forked child's agent has to take its new identity.
const REFRESH_TIMEOUT: Duration = Duration::from_secs(60);

/// The listening socket; removed on drop.
pub struct ApiSocket {
    path: PathBuf,
    thread: Option<JoinHandle<()>>,
    exit: Arc<ExitSignal>,
}

impl ApiSocket {
    /// Binds `path` (refusing one in use; a stale socket file is replaced) and
    /// serves it on a thread until the VM exits.
    pub fn serve(path: &Path, vm: Arc<Mutex<Vm>>) -> Result<Self> {
        Self::serve_with(path, vm, Arc::new(Children::default()))
    }

    /// [`ApiSocket::serve`], with children forked through it kept in `children`.
    /// As [`serve`](Self::serve), for a Linux guest with the agent.
    pub fn serve_linux(path: &Path, vm: Arc<Mutex<Vm>>) -> Result<Self> {
        let children = Children {
            live: Mutex::default(),
            linux: true,
        };
        Self::serve_with(path, vm, Arc::new(children))
    }

    pub fn serve_with(path: &Path, vm: Arc<Mutex<Vm>>, children: Arc<Children>) -> Result<Self> {
        if path.exists() {
            if UnixStream::connect(path).is_ok() {
                bail!("API socket {} is in use by another process", path.display());
            }
            std::fs::remove_file(path)
                .with_context(|| format!("Cannot remove stale socket {}", path.display()))?;
        }
        let listener = UnixListener::bind(path)
            .with_context(|| format!("Cannot listen on {}", path.display()))?;
        listener.set_nonblocking(true)?;
        let exit = lock(&vm).exit_signal();
        let exit2 = exit.clone();
        let thread = std::thread::Builder::new()
            .name("sprout-api".into())
            .spawn(move || accept_loop(listener, vm, exit2, children))?;
        Ok(Self {
            path: path.to_owned(),
            thread: Some(thread),
            exit,
        })
    }
}

impl Drop for ApiSocket {
    fn drop(&mut self) {
        self.exit.set(ExitReason::Stopped);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn lock(vm: &Mutex<Vm>) -> std::sync::MutexGuard<'_, Vm> {
    vm.lock().unwrap_or_else(|p| p.into_inner())
}

fn accept_loop(
    listener: UnixListener,
    vm: Arc<Mutex<Vm>>,
    exit: Arc<ExitSignal>,
    children: Arc<Children>,
) {
    let ctx = Ctx {
        vm: &vm,
        children: &children,
        path: listener
            .local_addr()
            .ok()
            .and_then(|a| a.as_pathname().map(Path::to_path_buf))
            .unwrap_or_default(),
    };
    while exit.get().is_none() {
        match listener.accept() {
            Ok((s, _)) => {
                if let Err(e) = serve_conn(s, &ctx) {
                    log::debug!("api socket: {e:#}");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                exit.wait(Some(Duration::from_millis(20)));
            }
            Err(e) => {
                log::warn!("api socket: accept failed: {e}");
                exit.wait(Some(Duration::from_millis(20)));
            }
        }
    }
}

struct Ctx<'a> {
    vm: &'a Arc<Mutex<Vm>>,
    children: &'a Arc<Children>,
    path: PathBuf,
}

fn serve_conn(s: UnixStream, ctx: &Ctx<'_>) -> Result<()> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut w = s.try_clone()?;
    let mut r = BufReader::new(s);
    loop {
        let mut line = Vec::new();
        if (&mut r)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut line)?
            == 0
        {
            return Ok(());
        }
        let answer = if line.len() > MAX_LINE {
            // Overlong: skip to its end (bounded), then refuse it.
            let mut rest = Vec::new();
            (&mut r).take(1 << 20).read_until(b'\n', &mut rest)?;
            format!("error line longer than {MAX_LINE} bytes")
        } else {
            match std::str::from_utf8(&line) {
                Ok(text) => answer(text.trim(), ctx),
                Err(_) => "error command is not UTF-8".into(),
            }
        };
        w.write_all(answer.as_bytes())?;
        w.write_all(b"\n")?;
    }
}

fn answer(line: &str, ctx: &Ctx<'_>) -> String {
    match run_command(line, ctx) {
        Ok(s) if s.is_empty() => "ok".into(),
        Ok(s) => format!("ok {s}"),
        Err(e) => format!("error {}", format!("{e:#}").replace('\n', " ")),
    }
}

fn run_command(line: &str, ctx: &Ctx<'_>) -> Result<String> {
    let vm: &Mutex<Vm> = ctx.vm;
    let mut words = line.split_ascii_whitespace();
    let cmd = words.next().unwrap_or("");
    let args: Vec<&str> = words.collect();
    let no_args = |args: &[&str]| -> Result<()> {
        if !args.is_empty() {
            bail!("{cmd} takes no arguments");
        }
        Ok(())
    };
    match cmd {
        "status" => {
            no_args(&args)?;
            let vm = lock(vm);
            Ok(match vm.exit_reason() {
                Some(r) => format!("exited {r}"),
                None if vm.is_paused() => "paused".into(),
                None => "running".into(),
            })
        }
        "pause" => {
            no_args(&args)?;
            lock(vm).pause()?;
            Ok(String::new())
        }
        "resume" => {
            no_args(&args)?;
            lock(vm).resume()?;
            Ok(String::new())
        }
        "stop" => {
            no_args(&args)?;
            lock(vm).exit_signal().set(ExitReason::Stopped);
            Ok(String::new())
        }
        "mailbox" => {
            if args.len() != 6 {
                bail!("usage: mailbox CPU CMD A0 A1 A2 A3");
            }
            let num = |s: &str| -> Result<u64> {
                let v = match s.strip_prefix("0x") {
                    Some(h) => u64::from_str_radix(h, 16),
                    None => s.parse(),
                };
                v.with_context(|| format!("{s:?} is not a number"))
            };
            let cpu = u8::try_from(num(args[0])?).context("CPU out of range")?;
            let c = u32::try_from(num(args[1])?).context("CMD out of range")?;
            let a = [num(args[2])?, num(args[3])?, num(args[4])?, num(args[5])?];
            let vm = lock(vm);
            let m = vm
                .mailbox()
                .context("this VM's kernel has no mailbox (not the test guest)")?;
            let r = m.call(cpu, c, a, MAILBOX_TIMEOUT)?;
            Ok(format!(
                "{} {:#x} {:#x} {:#x} {:#x}",
                r.status, r.rets[0], r.rets[1], r.rets[2], r.rets[3]
            ))
        }
        "snapshot" => {
            let (dir, kind) = match args.as_slice() {
                [dir] => (dir, SnapshotKind::Full),
                [dir, "full"] => (dir, SnapshotKind::Full),
                [dir, "diff"] => (dir, SnapshotKind::Diff),
                _ => bail!("usage: snapshot DIR [full|diff]"),
            };
            lock(vm).snapshot(Path::new(dir), kind)?;
            Ok((*dir).to_string())
        }
        "fork" => {
            let n: usize = match args.as_slice() {
                [n] => n.parse().with_context(|| format!("{n:?} is not a count"))?,
                _ => bail!("usage: fork N"),
            };
            if !(1..=MAX_FORK).contains(&n) {
                bail!("fork count {n} is out of range: use 1 to {MAX_FORK}");
            }
            let dir = ctx
                .path
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_else(std::env::temp_dir);
            let t = std::time::Instant::now();
            let kids = lock(vm).fork(n, &ForkOptions::new(&dir), None)?;
            log::info!(
                "fork({n}): children running {} us after the request",
                t.elapsed().as_micros()
            );
            if ctx.children.linux {
                refresh_children(&kids)?;
                log::info!(
                    "fork({n}): children re-identified {} us after the request",
                    t.elapsed().as_micros()
                );
            }
            let mut socks = Vec::with_capacity(n);
            let mut live = ctx.children.live.lock().unwrap_or_else(|p| p.into_inner());
            // Forget children that have stopped.
            live.retain(|c| c.exit.get().is_none());
            for kid in kids {
                let sock = dir.join(format!(
                    "{}-{}.sock",
                    ctx.path
                        .file_stem()
                        .and_then(|s| s.to_str())
                        .unwrap_or("vm"),
                    kid.instance_id()
                ));
                let api =
                    ApiSocket::serve_with(&sock, Arc::new(Mutex::new(kid)), ctx.children.clone())?;
                socks.push(sock.display().to_string());
                live.push(api);
            }
            Ok(socks.join(" "))
        }
        "vsock" => {
            no_args(&args)?;
            match lock(vm).vsock_uds() {
                Some(p) => Ok(p.display().to_string()),
                None => bail!("this VM has no vsock device"),
            }
        }
        "" => bail!("empty command"),
        other => {
            bail!(
                "unknown command {other:?} (status, pause, resume, stop, snapshot, fork, mailbox, vsock)"
            )
        }
    }
}

/// Sends every child its new identity, all at once. On any failure the caller
/// drops (stops) all of them: a child sharing its parent's random state must
/// not be used.
fn refresh_children(kids: &[Vm]) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let results = rt.block_on(async {
        let mut set = tokio::task::JoinSet::new();
        for (i, kid) in kids.iter().enumerate() {
            let Some(uds) = kid.vsock_uds() else {
                bail!("child {} has no vsock device", kid.instance_id());
            };
            let client = agent::client(uds);
            let (exit, id) = (kid.exit_signal(), kid.instance_id());
            set.spawn(async move {
                let r = async {
                    agent::wait_ready(&client, &exit, REFRESH_TIMEOUT).await?;
                    agent::refresh_identity(&client, id).await
                }
                .await;
                (i, r)
            });
        }
        let mut out = Vec::new();
        while let Some(r) = set.join_next().await {
            out.push(r?);
        }
        Ok(out)
    })?;
    let failed: Vec<String> = results
        .into_iter()
        .filter_map(|(i, r)| r.err().map(|e| format!("child {i}: {e}")))
        .collect();
    if failed.is_empty() {
        return Ok(());
    }
    bail!(
        "the children could not be re-identified ({})",
        failed.join("; ")
    )
}
