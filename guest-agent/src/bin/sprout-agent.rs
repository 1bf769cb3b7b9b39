//! `sprout-agent`: the guest agent.
//!
//! As PID 1 in a VM it sets the machine up and runs itself as a child listening on
//! vsock (see `guest_agent::init`). Otherwise it serves on the socket it is given:
//!
//! ```text
//! sprout-agent (--listen-unix PATH | --listen-vsock PORT) [--root DIR]
//!              [--output-limit BYTES] [--max-execs N] [--ring-bytes BYTES]
//!              [--max-finished N] [--allow-identity] [--main SPEC]
//! ```

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use guest_agent::files::Resolver;
use guest_agent::protocol::{DEFAULT_MAX_FINISHED, DEFAULT_OUTPUT_LIMIT, DEFAULT_RING_BYTES};
use guest_agent::server::{Config, Server};

#[derive(Parser, Debug)]
#[command(
    name = "sprout-agent",
    about = "Sprout guest agent: exec and files over vsock"
)]
struct Args {
    /// Listen on this Unix socket path (an agent run as a host process, for tests).
    #[arg(long, value_name = "PATH", conflicts_with = "listen_vsock")]
    listen_unix: Option<PathBuf>,
    /// Listen on this AF_VSOCK port (in a VM).
    #[arg(long, value_name = "PORT")]
    listen_vsock: Option<u32>,
    /// Files root: file requests are confined beneath it.
    #[arg(long, value_name = "DIR", default_value = "/workspace")]
    root: PathBuf,
    /// Per-stream output cap of an exec, in bytes.
    #[arg(long, value_name = "BYTES", default_value_t = DEFAULT_OUTPUT_LIMIT)]
    output_limit: u64,
    /// Most execs running at once, background processes included.
    #[arg(long, value_name = "N", default_value_t = 256)]
    max_execs: usize,
    /// Bound of each background process's ring of recent events, in bytes.
    #[arg(long, value_name = "BYTES", default_value_t = DEFAULT_RING_BYTES)]
    ring_bytes: usize,
    /// Finished background processes kept for attach and listing (earliest finished
    /// forgotten first).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_FINISHED)]
    max_finished: usize,
    /// Serve identity refresh and network configuration (they set the clock, CRNG,
    /// hostname and network of this machine: only for the agent PID 1 starts in a VM).
    #[arg(long)]
    allow_identity: bool,
    /// Start the main process this spec describes (see
    /// `guest_agent::main_process`) before serving.
    #[arg(long, value_name = "SPEC")]
    main: Option<PathBuf>,
    /// Resolve paths component by component instead of with openat2 (tests the fallback).
    #[arg(long, hide = true)]
    no_openat2: bool,
    /// The file network configuration writes name servers to, instead of
    /// /etc/resolv.conf (tests only: an agent run on the host must not touch the host's).
    #[arg(long, hide = true, value_name = "PATH")]
    resolv_conf: Option<PathBuf>,
}

/// How long an idle blocking-pool thread of the agent's runtime waits for work
/// before it exits: a week, so that one is there after a snapshot and restore.
const BLOCKING_KEEP_ALIVE: Duration = Duration::from_secs(7 * 24 * 3600);

fn main() -> anyhow::Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    if std::process::id() == 1 {
        guest_agent::init::run();
    }
    let args = Args::parse();
    // Absolute request paths are matched against the root: use its real path.
    let root = std::fs::canonicalize(&args.root).unwrap_or(args.root);
    let config = Config {
        root,
        resolver: if args.no_openat2 {
            Resolver::Walk
        } else {
            Resolver::Openat2
        },
        output_limit: args.output_limit,
        max_execs: args.max_execs,
        ring_bytes: args.ring_bytes,
        max_finished: args.max_finished,
        allow_identity: args.allow_identity,
        resolv_conf: args
            .resolv_conf
            .unwrap_or_else(|| Config::default().resolv_conf),
        ..Config::default()
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        // Keep idle blocking-pool threads instead of letting them exit after
        // tokio's default 10 s: a guest snapshotted later would otherwise have
        // none, and its first blocking job after a restore (a file request)
        // would start a thread, which costs milliseconds where guest kernel
        // code is emulated. A parked thread costs a stack; the pool's size
        // stays bounded by tokio's cap.
        .thread_keep_alive(BLOCKING_KEEP_ALIVE)
        .build()
        .context("cannot start the tokio runtime")?;
    runtime.block_on(async move {
        let server = Server::new(config);
        if let Some(path) = &args.main {
            start_main(&server, path);
        }
        if let Some(path) = args.listen_unix {
            // A socket left by an earlier run would make bind fail.
            if std::fs::symlink_metadata(&path)
                .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
            {
                std::fs::remove_file(&path).ok();
            }
            let listener = tokio::net::UnixListener::bind(&path)
                .with_context(|| format!("cannot listen on {}", path.display()))?;
            log::info!("listening on {}", path.display());
            server.serve_unix(listener).await?;
        } else if let Some(port) = args.listen_vsock {
            server.serve_vsock(port).await?;
        } else {
            bail!("give --listen-unix PATH or --listen-vsock PORT");
        }
        Ok(())
    })
}

/// Starts the main process `path` describes; a spec that cannot be read is
/// logged (the console shows it) and the agent serves on without one.
fn start_main(server: &Server, path: &std::path::Path) {
    use std::io::Read;
    let mut bytes = Vec::new();
    let read = std::fs::File::open(path).and_then(|f| {
        f.take(guest_agent::main_process::MAX_SPEC_BYTES + 1)
            .read_to_end(&mut bytes)
    });
    if let Err(e) = read {
        log::error!("cannot read the main process spec {}: {e}", path.display());
        return;
    }
    match guest_agent::main_process::MainProcess::from_json(&bytes) {
        Ok(spec) => {
            server.start_main(&spec);
        }
        Err(e) => log::error!("main process spec {}: {e}", path.display()),
    }
}
