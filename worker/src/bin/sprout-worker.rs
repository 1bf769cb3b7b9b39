//! `sprout-worker --socket PATH [...]`: one VM in one process; see the
//! `sprout_worker` crate.

fn main() -> std::process::ExitCode {
    sprout_worker::worker_main(std::env::args_os().skip(1))
}
