//! `sprout`: run microVMs from the command line.
//!
//! ```text
//! sprout vm run --kernel PATH|testguest [--image PATH] [--disk PATH] [--cpus N]
//!               [--memory-mib M] [--cmdline STR] [--vsock-cid N --vsock-uds PATH] [--rng]
//!               [--api-sock PATH]
//! sprout vm ctl --api-sock PATH status|pause|resume|stop|snapshot DIR [full|diff]|mailbox ...
//! sprout vm pause|resume --api-sock PATH
//! sprout vm snapshot --api-sock PATH [--diff] --out DIR
//! sprout vm restore DIR [--memory-backend mmap|uffd] [--vsock-uds PATH] [--api-sock PATH]
//! sprout vm fork --api-sock PATH [--count N]     children are worker processes
//! sprout worker --socket PATH [...]              run as a worker (sprout-worker)
//! sprout daemon [--listen ADDR] [--data-dir DIR]  run sproutd, the REST service
//! sprout api [--addr HOST:PORT] METHOD PATH [BODY]  one request to a sproutd
//! sprout [--url URL] [--json] create|ls|get|exec|pause|resume|sleep|
//!        hibernate|wake|reboot|snapshot|fork|checkpoint|cp|files|ps|attach|kill|rm ...
//! sprout completions bash|zsh|fish|...           a shell completion script
//!                                                the sandbox commands (docs/cli.md)
//! ```

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use vmm::{DiskConfig, SerialOutput, VmConfig, VsockConfig};

#[derive(Parser)]
#[command(name = "sprout", version, about = "Sprout microVM sandboxes")]
struct Cli {
    #[command(flatten)]
    conn: service::cli::Conn,
    #[command(subcommand)]
    cmd: Cmd,
}

// Parsed once per run: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Virtual machines.
    #[command(subcommand)]
    Vm(VmCmd),
    /// Run as a worker process (as `sprout-worker` does).
    #[command(hide = true)]
    Worker(WorkerArgs),
    /// Run sproutd, the sandbox REST service (docs/api.md).
    Daemon(service::daemon::DaemonArgs),
    /// OCI images made into Sprout base images, on this host (docs/guest.md).
    #[command(subcommand)]
    Image(ImageCmd),
    #[command(flatten)]
    Sandbox(service::cli::SandboxCmd),
    /// Send one request to a sproutd and print the answer's body; exits 0
    /// for a 2xx answer, 1 otherwise (the status goes to stderr).
    Api(ApiArgs),
    /// Print a shell completion script: `source <(sprout completions bash)`.
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
}

#[derive(Args)]
struct ApiArgs {
    /// sproutd's address.
    #[arg(long, default_value = service::daemon::DEFAULT_LISTEN)]
    addr: String,
    /// Seconds to wait for each read or write (a schedule waits for a boot).
    #[arg(long, default_value_t = 900)]
    timeout: u64,
    /// The Accept header (text/event-stream: a streamed exec, printed as
    /// its events arrive).
    #[arg(long)]
    accept: Option<String>,
    /// Another request header, `NAME: VALUE` (repeatable).
    #[arg(long)]
    header: Vec<String>,
    /// Print the answer's status line and headers before its body.
    #[arg(short, long)]
    include: bool,
    /// Send this file's bytes as the body (instead of BODY).
    #[arg(long, conflicts_with = "body")]
    data_file: Option<PathBuf>,
    /// GET, POST, DELETE...
    method: String,
    /// The path, e.g. /v1/runtime/vms.
    path: String,
    /// A JSON body.
    body: Option<String>,
}

#[derive(Subcommand)]
enum ImageCmd {
    /// Pull an OCI image (`HOST[:PORT]/NAME:TAG`, `NAME@sha256:…`, or a
    /// local layout `oci:/PATH[:TAG]`) and make its base image, or find the
    /// one already made; prints its path (`--json`: its record).
    /// Credentials: SPROUT_REGISTRY_USERNAME and SPROUT_REGISTRY_PASSWORD.
    Pull {
        /// The OCI reference.
        reference: String,
    },
    /// List the base images made from OCI images.
    Ls,
}

#[derive(Subcommand)]
enum VmCmd {
    /// Boot a guest with its console on this terminal; exits when the guest
    /// resets or powers off (status 0) or fails (status 1).
    Run(RunArgs),
    /// Send one command to a running VM's control socket and print the answer.
    Ctl(CtlArgs),
    /// Pause a running VM (every vCPU parked).
    Pause(SockArgs),
    /// Resume a paused VM.
    Resume(SockArgs),
    /// Snapshot a running VM into a new directory.
    Snapshot(SnapshotArgs),
    /// Restore a VM from a snapshot directory and run it like `vm run`.
    Restore(RestoreArgs),
    /// Fork a running VM into N children; prints each child's control socket.
    Fork(ForkArgs),
    /// Run a command (and copy files) in a running Linux VM through its agent.
    Exec(ExecArgs),
}

#[derive(Args)]
struct WorkerArgs {
    /// The worker's own arguments (`--socket PATH [--vcpus N --memory-mib M] ...`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<std::ffi::OsString>,
}

#[derive(Args)]
struct JobArgs {
    /// Linux guests: run this shell command line in the guest through the
    /// agent, stream its output and exit with its exit status.
    #[arg(long)]
    exec: Option<String>,
    /// Linux guests: copy the host file LOCAL to REMOTE in the guest (beneath
    /// /workspace) before the command; repeatable.
    #[arg(long, value_name = "LOCAL:REMOTE")]
    put: Vec<service::agent::Transfer>,
    /// Linux guests: copy REMOTE in the guest (beneath /workspace) to the host
    /// file LOCAL after the command; repeatable.
    #[arg(long, value_name = "REMOTE:LOCAL")]
    get: Vec<service::agent::Transfer>,
}

impl JobArgs {
    fn into_job(self) -> service::linux::Job {
        service::linux::Job {
            put: self.put,
            exec: self.exec,
            get: self.get,
        }
    }
}

#[derive(Args)]
struct ExecArgs {
    /// The VM's control socket (its vsock socket is asked for).
    #[arg(
        long,
        required_unless_present = "vsock_uds",
        conflicts_with = "vsock_uds"
    )]
    api_sock: Option<PathBuf>,
    /// The VM's vsock socket.
    #[arg(long)]
    vsock_uds: Option<PathBuf>,
    #[command(flatten)]
    job: JobArgs,
}

#[derive(Args)]
struct ForkArgs {
    #[arg(long)]
    api_sock: PathBuf,
    /// How many children (1-64).
    #[arg(long, default_value_t = 1)]
    count: usize,
}

#[derive(Args)]
struct SockArgs {
    /// The VM's control socket (`sprout vm run --api-sock`).
    #[arg(long)]
    api_sock: PathBuf,
}

#[derive(Args)]
struct SnapshotArgs {
    #[arg(long)]
    api_sock: PathBuf,
    /// Only what changed since the VM's previous snapshot (or its restore).
    #[arg(long)]
    diff: bool,
    /// The new snapshot directory (must not exist).
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct RestoreArgs {
    /// The snapshot directory.
    dir: PathBuf,
    /// How guest memory is restored: mmap (MAP_PRIVATE of the snapshot files)
    /// or uffd (userfaultfd page server with working-set prefetch).
    #[arg(long, default_value = "mmap")]
    memory_backend: vmm::MemoryBackend,
    /// The restored VM's vsock socket (required if the snapshot has vsock).
    #[arg(long)]
    vsock_uds: Option<PathBuf>,
    /// Serve a control socket here (see `sprout vm ctl`).
    #[arg(long)]
    api_sock: Option<PathBuf>,
    /// Restore a Linux guest exactly as it was snapshotted: its clock, random
    /// state, host name and machine id are not refreshed (its agent is only
    /// pinged). For replaying one state again; guests restored so from one
    /// snapshot share their random state, so never run them side by side
    /// where that matters.
    #[arg(long)]
    keep_identity: bool,
    #[command(flatten)]
    job: JobArgs,
}

#[derive(Args)]
struct RunArgs {
    /// Kernel: an uncompressed ELF vmlinux (default: the cached guest kernel),
    /// or `testguest` for Sprout's built-in test guest.
    #[arg(long)]
    kernel: Option<String>,
    /// Root image: `test`, `default` (the default) or the path of an ext4 base
    /// image (read-only virtio-blk). For the test guest: any disk image.
    #[arg(long)]
    image: Option<String>,
    #[command(flatten)]
    job: JobArgs,
    /// Private writable disk (virtio-blk); created sparse if missing.
    #[arg(long)]
    disk: Option<PathBuf>,
    /// Size of a writable disk created by --disk, in MiB.
    #[arg(long, default_value_t = 16384)]
    disk_size_mib: u64,
    /// vCPUs (1-4).
    #[arg(long, default_value_t = 1)]
    cpus: u8,
    /// Guest RAM in MiB (128-8192).
    #[arg(long, default_value_t = 256)]
    memory_mib: u64,
    /// Kernel command line (the VMM appends its virtio-mmio devices).
    #[arg(long, default_value = "")]
    cmdline: String,
    /// How a Linux image runs: `container` (the agent is PID 1 and starts
    /// an OCI image's entrypoint) or `vm` (the image's own /sbin/init, say
    /// systemd, is PID 1 and starts the agent as a service).
    #[arg(long, value_enum, default_value_t = Runtime::Container)]
    runtime: Runtime,
    /// Test guest: add a virtio-vsock device with this guest CID (>= 3).
    #[arg(long, requires = "vsock_uds")]
    vsock_cid: Option<u64>,
    /// Unix socket the vsock device's host side listens on (Linux guests: a
    /// private temporary path by default; the test guest also needs
    /// --vsock-cid).
    #[arg(long)]
    vsock_uds: Option<PathBuf>,
    /// Add a virtio-rng device.
    #[arg(long)]
    rng: bool,
    /// Serve a control socket here (see `sprout vm ctl`).
    #[arg(long)]
    api_sock: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Runtime {
    Container,
    Vm,
}

#[derive(Args)]
struct CtlArgs {
    /// The VM's control socket (`sprout vm run --api-sock`).
    #[arg(long)]
    api_sock: PathBuf,
    /// The command: status | describe | metrics | pause | resume | stop |
    /// snapshot DIR [full|diff] | fork N | vsock | mailbox CPU CMD A0 A1 A2 A3.
    #[arg(required = true, num_args = 1..)]
    command: Vec<String>,
}

fn kernel_path(k: &str) -> PathBuf {
    if k == "testguest" {
        PathBuf::from(testguest_build::TESTGUEST_PATH)
    } else {
        PathBuf::from(k)
    }
}

impl RunArgs {
    fn into_linux(self) -> service::linux::LinuxRun {
        service::linux::LinuxRun {
            kernel: self.kernel.map(PathBuf::from),
            image: self.image,
            disk: self.disk,
            // A disk the user names is theirs to keep: a whole image.
            disk_base: None,
            cpus: self.cpus,
            memory_mib: self.memory_mib,
            cmdline: match self.runtime {
                Runtime::Container => self.cmdline,
                Runtime::Vm => format!("{} {}", service::linux::VM_RUNTIME_CMDLINE, self.cmdline),
            },
            job: self.job.into_job(),
            vsock_uds: self.vsock_uds,
            api_sock: self.api_sock,
        }
    }
}

fn run(a: RunArgs) -> Result<bool> {
    if a.job.exec.is_some() || !a.job.put.is_empty() || !a.job.get.is_empty() {
        bail!("--exec, --put and --get need a Linux guest with the agent, not the test guest");
    }
    let mut cfg = VmConfig::new(kernel_path(a.kernel.as_deref().unwrap_or("testguest")));
    cfg.vcpus = a.cpus;
    cfg.mem_mib = a.memory_mib;
    cfg.cmdline = a.cmdline;
    cfg.serial = SerialOutput::Stdout;
    // An interactive terminal types into the guest's console (line by line:
    // the terminal stays in cooked mode).
    cfg.console_input = std::io::stdin().is_terminal();
    cfg.rng = a.rng;
    if let Some(p) = a.image {
        cfg.disks.push(DiskConfig {
            path: PathBuf::from(p),
            read_only: true,
            id: "base".into(),
            base: None,
        });
    }
    if let Some(p) = a.disk {
        if !p.exists() {
            if a.disk_size_mib == 0 {
                bail!("--disk-size-mib must be at least 1");
            }
            let f = std::fs::File::create(&p)
                .with_context(|| format!("Cannot create disk {}", p.display()))?;
            f.set_len(a.disk_size_mib << 20)
                .with_context(|| format!("Cannot size disk {}", p.display()))?;
        }
        cfg.disks.push(DiskConfig {
            path: p,
            read_only: false,
            id: "disk".into(),
            base: None,
        });
    }
    match (a.vsock_cid, a.vsock_uds) {
        (Some(cid), Some(uds)) => {
            cfg.vsock = Some(VsockConfig {
                guest_cid: cid,
                uds_path: uds,
            })
        }
        (None, Some(_)) => bail!("the test guest's vsock device needs --vsock-cid too"),
        _ => {}
    }
    Ok(service::linux::serve(vmm::Vm::start(cfg)?, a.api_sock.as_deref())? == 0)
}

fn restore(a: RestoreArgs) -> ExitCode {
    let r = service::linux::Restore {
        dir: a.dir,
        backend: a.memory_backend,
        vsock_uds: a.vsock_uds,
        api_sock: a.api_sock,
        keep_identity: a.keep_identity,
        job: a.job.into_job(),
    };
    match service::linux::restore(r) {
        Ok(code) => ExitCode::from(code),
        Err(e) => service::linux::report(&e),
    }
}

fn exec(a: ExecArgs) -> ExitCode {
    let uds = match (a.vsock_uds, a.api_sock) {
        (Some(u), _) => Ok(u),
        (None, Some(sock)) => service::control::vsock_uds(&sock).map_err(anyhow::Error::from),
        (None, None) => Err(anyhow::anyhow!("give --api-sock or --vsock-uds")),
    };
    let uds = match uds {
        Ok(u) => u,
        Err(e) => {
            eprintln!("sprout: error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let job = a.job.into_job();
    if job.is_empty() {
        eprintln!("sprout: error: nothing to do: give --exec, --put or --get");
        return ExitCode::FAILURE;
    }
    match service::linux::exec_in(&uds, &job) {
        Ok(code) => ExitCode::from(code),
        Err(e) => service::linux::report(&e),
    }
}

/// Runs one control command and prints its answer (if any).
fn send(sock: &std::path::Path, words: &[&str]) -> Result<bool> {
    let words: Vec<String> = words.iter().map(|w| w.to_string()).collect();
    let out = service::control::command(sock, &words)?;
    if !out.is_empty() {
        println!("{out}");
    }
    Ok(true)
}

fn ctl(a: CtlArgs) -> Result<bool> {
    let out = service::control::command(&a.api_sock, &a.command)?;
    if !out.is_empty() {
        println!("{out}");
    }
    Ok(true)
}

fn api(a: ApiArgs, api_key: Option<&str>) -> ExitCode {
    let method = a.method.to_ascii_uppercase();
    let file_body = match &a.data_file {
        Some(p) => match std::fs::read(p) {
            Ok(b) => Some(b),
            Err(e) => {
                eprintln!("sprout: error: cannot read {}: {e}", p.display());
                return ExitCode::FAILURE;
            }
        },
        None => None,
    };
    let body = file_body
        .as_deref()
        .or_else(|| a.body.as_deref().map(str::as_bytes));
    let timeout = std::time::Duration::from_secs(a.timeout.max(1));
    let mut out = std::io::stdout();
    let mut headers = a.header.clone();
    if let Some(acc) = &a.accept {
        headers.push(format!("Accept: {acc}"));
    }
    if let Some(k) = api_key.filter(|k| !k.is_empty()) {
        headers.push(format!("Authorization: Bearer {k}"));
    }
    let req = service::daemon::api_client::Request {
        addr: &a.addr,
        method: &method,
        path: &a.path,
        body,
        headers: &headers,
        include: a.include,
        timeout,
    };
    match service::daemon::api_client::request(&req, &mut out) {
        Ok(status) => {
            use std::io::Write as _;
            let _ = out.write_all(b"\n");
            eprintln!("sprout: HTTP {status}");
            if (200..300).contains(&status) {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("sprout: error: {}", service::daemon::error_chain(&e));
            ExitCode::FAILURE
        }
    }
}

fn image(c: ImageCmd, json: bool) -> Result<bool> {
    let cache = service::linux::cache_dir();
    match c {
        ImageCmd::Pull { reference } => {
            if !service::oci::is_oci(&reference) {
                bail!(
                    "{reference:?} is not an OCI reference (HOST[:PORT]/NAME:TAG, \
                     NAME@sha256:DIGEST or oci:/PATH[:TAG])"
                );
            }
            let opts = service::oci::PullOptions::from_env(&cache);
            let started = std::time::Instant::now();
            let img =
                service::oci::pull_blocking(&reference, &opts, &mut service::oci::print_progress)
                    .map_err(|e| {
                    anyhow::anyhow!("{} ({})", service::daemon::error_chain(&e), e.code())
                })?;
            if json {
                println!("{}", serde_json::to_string(&img)?);
            } else {
                eprintln!(
                    "sprout: {} in {:.1} s",
                    if img.cached {
                        "found"
                    } else {
                        "pulled and built"
                    },
                    started.elapsed().as_secs_f64()
                );
                println!("{}", img.path.display());
            }
        }
        ImageCmd::Ls => {
            let all = service::oci::list(&cache);
            if json {
                println!("{}", serde_json::to_string(&all)?);
            } else {
                println!("{:<19} {:>9}  {:<6} REFERENCE", "DIGEST", "SIZE", "LAYERS");
                for i in all {
                    println!(
                        "{:<19} {:>7.0}Mi  {:<6} {}",
                        i.digest.get(..19).unwrap_or(&i.digest),
                        i.size_bytes as f64 / 1048576.0,
                        i.layers,
                        i.reference
                    );
                }
            }
        }
    }
    Ok(true)
}

fn main() -> ExitCode {
    service::linux::mark_process_start();
    let cli = Cli::parse();
    match cli.cmd {
        // sproutd logs with tracing.
        Cmd::Daemon(a) => return service::daemon::main(a),
        Cmd::Api(a) => return api(a, cli.conn.api_key.as_deref()),
        Cmd::Sandbox(c) => return service::cli::main(&cli.conn, c),
        Cmd::Completions { shell } => {
            use clap::CommandFactory as _;
            clap_complete::generate(shell, &mut Cli::command(), "sprout", &mut std::io::stdout());
            return ExitCode::SUCCESS;
        }
        _ => {}
    }
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let res = match cli.cmd {
        Cmd::Daemon(_) | Cmd::Api(_) | Cmd::Sandbox(_) | Cmd::Completions { .. } => {
            unreachable!("handled above")
        }
        Cmd::Vm(VmCmd::Run(a)) => match a.kernel.as_deref() {
            Some(k) if service::linux::is_test_guest(k) => run(a),
            _ => return service::linux::main(a.into_linux()),
        },
        Cmd::Vm(VmCmd::Ctl(a)) => ctl(a),
        Cmd::Vm(VmCmd::Pause(a)) => send(&a.api_sock, &["pause"]),
        Cmd::Vm(VmCmd::Resume(a)) => send(&a.api_sock, &["resume"]),
        Cmd::Vm(VmCmd::Snapshot(a)) => {
            let kind = if a.diff { "diff" } else { "full" };
            match a.out.to_str() {
                Some(out) => send(&a.api_sock, &["snapshot", out, kind]),
                None => Err(anyhow::anyhow!("--out must be a UTF-8 path")),
            }
        }
        Cmd::Vm(VmCmd::Restore(a)) => return restore(a),
        Cmd::Vm(VmCmd::Exec(a)) => return exec(a),
        Cmd::Vm(VmCmd::Fork(a)) => service::control::fork(&a.api_sock, a.count)
            .map(|socks| {
                for sock in socks {
                    println!("{}", sock.display());
                }
                true
            })
            .map_err(anyhow::Error::from),
        Cmd::Worker(a) => return sprout_worker::worker_main(a.args),
        Cmd::Image(c) => image(c, cli.conn.json),
    };
    match res {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("sprout: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
