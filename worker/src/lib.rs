//! `sprout-worker`: one VMM worker process per sandbox.
//!
//! A worker holds one VM (or, while ready, a pre-built [`vmm::VmShell`] of a
//! shape waiting for a restore) and serves the typed control protocol of
//! [`protocol`] on a Unix socket: several connections at once, each request
//! handed to the one thread that owns the VM. It runs in its own session,
//! outlives whoever started it, and exits when its VM ends.
//!
//! - [`protocol`]: frames, requests, responses and stable error codes;
//! - [`server`]: the worker side; [`client`]: the blocking client;
//! - [`spawn`]: starting detached workers and a pool of ready ones.

pub mod client;
pub mod jail;
pub mod metrics;
mod owner;
pub mod protocol;
pub mod server;
pub mod spawn;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

pub use client::{Client, ClientError};
pub use protocol::{ErrorCode, Request, Response, WorkerError};
pub use server::{serve_vm, WorkerOptions};
pub use spawn::{ReadyPool, WorkerCommand, WorkerProcess};

pub const USAGE: &str = "usage: sprout-worker --socket PATH [--vcpus N --memory-mib M] \
[--console FILE] [--scratch-dir DIR] [--foreground] [--jail [--jail-uid UID] [--jail-gid GID] [--jail-root DIR]]";

/// The worker's command line (after any prefix such as `sprout worker`):
/// `--socket PATH` (required); `--vcpus N --memory-mib M` make it a ready
/// worker of that shape; `--console FILE` appends the guest console to FILE;
/// `--scratch-dir DIR` holds restored disks' private tops; `--foreground`
/// keeps it in the caller's session; `--jail` (as root) runs it in its own
/// mount namespace as `--jail-uid`/`--jail-gid` (default 65534, nobody)
/// under a seccomp filter per thread, and with `--jail-root DIR` (a
/// [`jail::Jail`]'s root) `pivot_root`s into DIR first; its `--socket` and
/// every path it is given are then paths inside DIR (see [`jail`]).
pub fn worker_main(args: impl IntoIterator<Item = OsString>) -> ExitCode {
    MAIN.get_or_init(std::time::Instant::now);
    let _ = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .try_init();
    match parse(args).and_then(|(o, fg, jail)| start(o, fg, jail)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("sprout-worker: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// When [`worker_main`] began, for the start-up log.
static MAIN: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

/// Microseconds since [`worker_main`] began (0 outside a worker process).
pub(crate) fn us_since_main() -> u128 {
    MAIN.get().map_or(0, |t| t.elapsed().as_micros())
}

type Parsed = (WorkerOptions, bool, Option<jail::JailOptions>);

fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Parsed, String> {
    let mut socket = None;
    let (mut vcpus, mut mem) = (None, None);
    let mut console: Option<PathBuf> = None;
    let mut scratch = None;
    let mut foreground = false;
    let mut jailed = false;
    let mut jail_ids = jail::JailOptions::default();
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let a = a.to_string_lossy().into_owned();
        let mut val = |name: &str| {
            it.next()
                .ok_or_else(|| format!("{name} needs a value\n{USAGE}"))
        };
        match a.as_str() {
            "--socket" => socket = Some(PathBuf::from(val("--socket")?)),
            "--vcpus" => {
                let v = val("--vcpus")?;
                vcpus = Some(
                    v.to_string_lossy()
                        .parse::<u8>()
                        .map_err(|_| format!("--vcpus {v:?} is not a number of vCPUs"))?,
                )
            }
            "--memory-mib" => {
                let v = val("--memory-mib")?;
                mem = Some(
                    v.to_string_lossy()
                        .parse::<u64>()
                        .map_err(|_| format!("--memory-mib {v:?} is not a number of MiB"))?,
                )
            }
            "--console" => console = Some(PathBuf::from(val("--console")?)),
            "--scratch-dir" => scratch = Some(PathBuf::from(val("--scratch-dir")?)),
            "--foreground" => foreground = true,
            "--jail" => jailed = true,
            "--jail-root" => jail_ids.root = Some(PathBuf::from(val("--jail-root")?)),
            "--jail-uid" | "--jail-gid" => {
                let v = val(&a)?;
                let id = v
                    .to_string_lossy()
                    .parse::<u32>()
                    .map_err(|_| format!("{a} {v:?} is not a number"))?;
                if a == "--jail-uid" {
                    jail_ids.uid = id;
                } else {
                    jail_ids.gid = id;
                }
            }
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    let socket = socket.ok_or_else(|| format!("--socket is required\n{USAGE}"))?;
    if jail_ids.root.is_some() && !jailed {
        return Err(format!("--jail-root goes with --jail\n{USAGE}"));
    }
    let shape = match (vcpus, mem) {
        (Some(vcpus), Some(mem_mib)) => Some(protocol::Shape { vcpus, mem_mib }),
        (None, None) => None,
        _ => return Err("--vcpus and --memory-mib go together".into()),
    };
    let serial = match &console {
        None => vmm::SerialOutput::Sink,
        Some(p) => {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map_err(|e| format!("cannot open console file {}: {e}", p.display()))?;
            vmm::SerialOutput::File(Arc::new(Mutex::new(f)))
        }
    };
    Ok((
        WorkerOptions {
            socket,
            shape,
            serial,
            scratch_dir: scratch,
        },
        foreground,
        jailed.then_some(jail_ids),
    ))
}

/// The descriptors a worker may hold: its VM's vsock connection budget
/// (one host fd each) plus room for KVM (VM, vCPUs, memory), eventfds,
/// irqfds and ioeventfds, snapshot layer files and control connections.
pub const OPEN_FILES_LIMIT: u64 = vmm::DEFAULT_VSOCK_CONNECTIONS as u64 + 768;

/// Caps `RLIMIT_NOFILE` (soft and hard) at [`OPEN_FILES_LIMIT`]: one VM per
/// process, so a hostile guest's connections cannot starve the host of fds.
/// A limit already below it is kept.
fn limit_open_files() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let cur = getrlimit(Resource::Nofile);
    let cap = |v: Option<u64>| Some(v.map_or(OPEN_FILES_LIMIT, |v| v.min(OPEN_FILES_LIMIT)));
    let new = Rlimit {
        current: cap(cur.current),
        maximum: cap(cur.maximum),
    };
    if let Err(e) = setrlimit(Resource::Nofile, new) {
        log::warn!("cannot limit open files to {OPEN_FILES_LIMIT}: {e}");
    }
}

fn start(
    opts: WorkerOptions,
    foreground: bool,
    jail: Option<jail::JailOptions>,
) -> Result<ExitCode, String> {
    if !foreground {
        // Its own session: a signal to the starter's process group or the
        // end of its terminal does not reach the VM.
        if let Err(e) = rustix::process::setsid() {
            log::debug!("setsid: {e} (already a session leader)");
        }
    }
    limit_open_files();
    if let Some(j) = &jail {
        // Before any thread: credentials are per thread.
        jail::enter(j).map_err(|e| owner::chain(&e))?;
        log::debug!("jail entered {} us after main", us_since_main());
    }
    let socket = opts.socket.clone();
    match server::run(opts) {
        Ok(Some(r)) if r.is_clean() => {
            log::info!("worker {}: VM ended: {r}", socket.display());
            Ok(ExitCode::SUCCESS)
        }
        Ok(Some(r @ vmm::vcpu::ExitReason::LayerChanged { .. })) => {
            // The same end, status and words as a host thread's SIGBUS in a
            // layer mapping (snapshot::fault), whichever touched it first.
            eprint!("{}", snapshot::fault::LAYER_FAULT_MESSAGE);
            log::error!("worker {}: VM ended: {r}", socket.display());
            Ok(ExitCode::from(snapshot::fault::LAYER_FAULT_EXIT as u8))
        }
        Ok(Some(r)) => {
            // Never a silent failure: whoever reads the worker's log sees why.
            log::error!("worker {}: VM ended: {r}", socket.display());
            Ok(ExitCode::FAILURE)
        }
        Ok(None) => Ok(ExitCode::SUCCESS),
        Err(e) => Err(owner::chain(&e)),
    }
}
