//! Watching workers while they run. Each live sandbox's worker process is
//! watched through a pidfd (readable once the process has exited); when it
//! exits, its sandbox becomes `failed` at once, with how it ended, instead
//! of at the next exec or the next start of sproutd. A sandbox being
//! deleted (`stopping`), or one that has another worker by then, is left
//! alone.

use std::sync::Arc;

use rustix::process::{pidfd_open, Pid, PidfdFlags};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use uuid::Uuid;

use super::registry::State;
use super::App;

/// Watches the worker `pid` of sandbox `id` from now on.
pub fn worker(app: &Arc<App>, id: Uuid, pid: u32) {
    let app = app.clone();
    tokio::spawn(async move {
        let fd = Pid::from_raw(pid as i32)
            .ok_or(rustix::io::Errno::SRCH)
            .and_then(|p| pidfd_open(p, PidfdFlags::NONBLOCK));
        match fd {
            // SAFETY: `fd` is an OwnedFd moved into the AsyncFd: it stays
            // open, the same descriptor, until the AsyncFd is dropped.
            Ok(fd) => match unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) } {
                Ok(afd) => {
                    let _ = afd.readable().await;
                }
                Err(e) => {
                    tracing::warn!(vm = %id, pid, "cannot watch the worker: {e}");
                    return;
                }
            },
            // Gone already (between its start and now).
            Err(rustix::io::Errno::SRCH) => {}
            Err(e) => {
                tracing::warn!(vm = %id, pid, "cannot watch the worker (pidfd_open: {e})");
                return;
            }
        }
        exited(&app, id, pid).await;
    });
}

async fn exited(app: &Arc<App>, id: Uuid, pid: u32) {
    // A worker this sproutd started is its child: reaped here for its
    // status (the record stays for the delete, which waits on it again).
    let status = super::lock(&app.children)
        .get_mut(&id)
        .filter(|w| w.pid() == pid)
        .and_then(|w| w.child.try_wait().ok().flatten());
    let how = match status {
        Some(st) => describe_status(st),
        None => "exited".to_owned(),
    };
    // Its log says why, when it could (a refused syscall names itself).
    let why = format!(
        "The sandbox's worker (pid {pid}) {how} while the sandbox ran{}",
        app.supervisor.worker_log_tail(id)
    );
    let marked = app
        .db(move |r| {
            let Some(s) = r.get_sandbox(id)? else {
                return Ok(false);
            };
            let live = matches!(s.state, State::Starting | State::Running | State::Paused);
            if !live || s.pid != Some(pid) {
                return Ok(false);
            }
            r.set_state(id, State::Failed, Some(&why))?;
            Ok(true)
        })
        .await;
    match marked {
        Ok(true) => {
            super::lock(&app.agents).remove(&id);
            tracing::warn!(vm = %id, pid, "marked failed: its worker {how}");
        }
        Ok(false) => {}
        Err(e) => tracing::error!(vm = %id, "cannot record the worker's exit: {}", e.message),
    }
}

/// `exited with status 3`, `was killed by signal 9 (SIGKILL)`.
fn describe_status(st: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt as _;
    if let Some(code) = st.code() {
        let seccomp = if code == sprout_worker::jail::SECCOMP_EXIT {
            " (its seccomp filter refused a system call)"
        } else {
            ""
        };
        return format!("exited with status {code}{seccomp}");
    }
    match st.signal() {
        Some(sig) => {
            let name = match sig {
                6 => " (SIGABRT)",
                9 => " (SIGKILL)",
                11 => " (SIGSEGV)",
                15 => " (SIGTERM)",
                31 => " (SIGSYS: a system call its seccomp filter refuses)",
                _ => "",
            };
            format!("was killed by signal {sig}{name}")
        }
        None => "ended".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt as _;

    #[test]
    fn statuses_read_as_words() {
        assert_eq!(
            describe_status(std::process::ExitStatus::from_raw(3 << 8)),
            "exited with status 3"
        );
        let killed = describe_status(std::process::ExitStatus::from_raw(9));
        assert_eq!(killed, "was killed by signal 9 (SIGKILL)");
        // A jailed worker's SIGSYS handler exits 159.
        assert_eq!(
            describe_status(std::process::ExitStatus::from_raw(159 << 8)),
            "exited with status 159 (its seccomp filter refused a system call)"
        );
    }
}
