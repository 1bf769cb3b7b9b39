//! `sproutd`: the Sprout sandbox REST service (docs/api.md).
//!
//! ```text
//! sproutd [--listen ADDR] [--data-dir DIR] [--no-jail]
//!     serve (default 127.0.0.1:7070, ~/.local/share/sprout); as root, with jailed workers
//! ```
//!
//! The same service is `sprout daemon`; this binary also runs as a worker
//! (`sproutd worker ...`), which is how it starts the sandboxes' workers.

use std::process::ExitCode;

use clap::Parser;

#[derive(Parser)]
#[command(name = "sproutd", version, about = "The Sprout sandbox REST service")]
struct Cli {
    #[command(flatten)]
    daemon: service::daemon::DaemonArgs,
}

fn main() -> ExitCode {
    let mut args = std::env::args_os();
    if std::env::args_os().nth(1).is_some_and(|a| a == "worker") {
        args.nth(1);
        return sprout_worker::worker_main(args);
    }
    service::daemon::main(Cli::parse().daemon)
}
