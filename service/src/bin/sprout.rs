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
//! sprout vm fork --api-sock PATH [--count N]
//! ```

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use service::api_sock::ApiSocket;
use vmm::{DiskConfig, SerialOutput, VmConfig, VsockConfig};

#[derive(Parser)]
#[command(name = "sprout", version, about = "Sprout microVM sandboxes")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Virtual machines.
    #[command(subcommand)]
    Vm(VmCmd),
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
    /// Linux guests: run this shell command line in the guest through the
    /// agent, print its output and exit with its exit status.
    #[arg(long)]
    exec: Option<String>,
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
    /// Add a virtio-vsock device with this guest CID (>= 3).
    #[arg(long, requires = "vsock_uds")]
    vsock_cid: Option<u64>,
    /// Unix socket the vsock device's host side listens on.
    #[arg(long, requires = "vsock_cid")]
    vsock_uds: Option<PathBuf>,
    /// Add a virtio-rng device.
    #[arg(long)]
    rng: bool,
    /// Serve a control socket here (see `sprout vm ctl`).
    #[arg(long)]
    api_sock: Option<PathBuf>,
}

#[derive(Args)]
struct CtlArgs {
    /// The VM's control socket (`sprout vm run --api-sock`).
    #[arg(long)]
    api_sock: PathBuf,
    /// The command: status | pause | resume | stop | mailbox CPU CMD A0 A1 A2 A3.
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
            cpus: self.cpus,
            memory_mib: self.memory_mib,
            cmdline: self.cmdline,
            exec: self.exec,
            vsock_uds: self.vsock_uds,
            api_sock: self.api_sock,
        }
    }
}

fn run(a: RunArgs) -> Result<bool> {
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
        });
    }
    if let (Some(cid), Some(uds)) = (a.vsock_cid, a.vsock_uds) {
        cfg.vsock = Some(VsockConfig {
            guest_cid: cid,
            uds_path: uds,
        });
    }
    serve(vmm::Vm::start(cfg)?, a.api_sock.as_deref())
}

/// Runs `vm` (with a control socket at `api_sock`) until it ends.
fn serve(vm: vmm::Vm, api_sock: Option<&std::path::Path>) -> Result<bool> {
    let exit = vm.exit_signal();
    let vm = Arc::new(Mutex::new(vm));
    let api = api_sock
        .map(|p| ApiSocket::serve(p, vm.clone()))
        .transpose()?;
    let reason = exit.wait(None).unwrap_or(vmm::ExitReason::Stopped);
    drop(api);
    drop(vm);
    eprintln!("sprout: VM ended: {reason}");
    Ok(reason.is_clean())
}

fn restore(a: RestoreArgs) -> Result<bool> {
    let mut o = vmm::RestoreOptions::new(a.memory_backend);
    o.serial = SerialOutput::Stdout;
    o.vsock_uds = a.vsock_uds;
    let vm = vmm::Vm::restore(&a.dir, o)
        .with_context(|| format!("Cannot restore {}", a.dir.display()))?;
    serve(vm, a.api_sock.as_deref())
}

fn send(sock: &std::path::Path, line: &str) -> Result<bool> {
    let out = request(sock, line)?;
    if !out.is_empty() {
        println!("{out}");
    }
    Ok(true)
}

/// Sends one command line to a control socket; the answer's payload, or its error.
fn request(sock: &std::path::Path, line: &str) -> Result<String> {
    let mut s = UnixStream::connect(sock)
        .with_context(|| format!("Cannot connect to {}", sock.display()))?;
    writeln!(s, "{line}")?;
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer)?;
    let answer = answer.trim_end();
    match answer.strip_prefix("ok") {
        Some(rest) => Ok(rest.trim_start().to_string()),
        None => bail!("{}", answer.strip_prefix("error ").unwrap_or(answer)),
    }
}

fn ctl(a: CtlArgs) -> Result<bool> {
    println!("{}", request(&a.api_sock, &a.command.join(" "))?);
    Ok(true)
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::Vm(VmCmd::Run(a)) => match a.kernel.as_deref() {
            Some(k) if service::linux::is_test_guest(k) => run(a),
            _ => return service::linux::main(a.into_linux()),
        },
        Cmd::Vm(VmCmd::Ctl(a)) => ctl(a),
        Cmd::Vm(VmCmd::Pause(a)) => send(&a.api_sock, "pause"),
        Cmd::Vm(VmCmd::Resume(a)) => send(&a.api_sock, "resume"),
        Cmd::Vm(VmCmd::Snapshot(a)) => {
            let kind = if a.diff { "diff" } else { "full" };
            // The VM process has its own working directory.
            let out = std::path::absolute(&a.out).unwrap_or(a.out);
            match out.to_str() {
                Some(out) if !out.contains(char::is_whitespace) => {
                    send(&a.api_sock, &format!("snapshot {out} {kind}"))
                }
                _ => Err(anyhow::anyhow!(
                    "--out must be a UTF-8 path without white space"
                )),
            }
        }
        Cmd::Vm(VmCmd::Restore(a)) => restore(a),
        Cmd::Vm(VmCmd::Fork(a)) => {
            request(&a.api_sock, &format!("fork {}", a.count)).map(|socks| {
                for sock in socks.split(' ') {
                    println!("{sock}");
                }
                true
            })
        }
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
