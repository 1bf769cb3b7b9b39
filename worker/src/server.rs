//! The worker's control socket: an accept thread, a thread per connection,
//! and the owner loop (the calling thread) that holds the VM.
//!
//! A worker exits when its VM ends (the guest resets or powers off, or a
//! `Stop`), removing its control socket; the VM's vsock socket goes with the
//! device.

use std::io::{BufReader, BufWriter, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::Arc;
use std::time::Duration;

use vmm::{ExitReason, SerialOutput, Vm, VmShell};

use crate::jail::Kind;
use crate::owner::{After, Owner, Slot};
use crate::protocol::{
    read_frame, write_frame, ErrorCode, FrameError, Request, Response, Shape, WorkerError,
};

/// Most connections served at once; more are closed at once.
pub const MAX_CONNECTIONS: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("Control socket {0} is in use by another process")]
    InUse(PathBuf),
    #[error("Cannot listen on {0}")]
    Bind(PathBuf, #[source] std::io::Error),
    #[error("Cannot start a worker thread")]
    Thread(#[source] std::io::Error),
    #[error("Cannot build a VM shell of {0} vCPUs / {1} MiB")]
    Shell(u8, u64, #[source] vmm::VmError),
}

/// How a worker starts.
pub struct WorkerOptions {
    pub socket: PathBuf,
    /// Build a shell of this shape and wait for a restore (a ready worker).
    pub shape: Option<Shape>,
    pub serial: SerialOutput,
    /// Where restored VMs' private disk tops go; the socket's directory if `None`.
    pub scratch_dir: Option<PathBuf>,
}

enum Event {
    Request(Request, SyncSender<Reply>),
    Exited,
}

/// An answer, and for a final one a way to say it was written.
struct Reply {
    response: Response,
    written: Option<SyncSender<()>>,
}

/// A bound control socket, removed on drop.
struct Listener {
    path: PathBuf,
    stop: Arc<AtomicBool>,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept thread so it sees `stop`.
        let _ = UnixStream::connect(&self.path);
        let _ = std::fs::remove_file(&self.path);
    }
}

fn bind(path: &Path, tx: Sender<Event>) -> Result<Listener, ServerError> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(ServerError::InUse(path.to_owned()));
        }
        let _ = std::fs::remove_file(path);
    }
    let l = UnixListener::bind(path).map_err(|e| ServerError::Bind(path.to_owned(), e))?;
    // Only this user may drive the VM.
    let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600));
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    std::thread::Builder::new()
        .name("sprout-ctl".into())
        .spawn(move || {
            // Its connection threads inherit this filter.
            crate::jail::apply_or_exit(Kind::Control);
            accept_loop(l, tx, stop2)
        })
        .map_err(ServerError::Thread)?;
    Ok(Listener {
        path: path.to_owned(),
        stop,
    })
}

fn accept_loop(l: UnixListener, tx: Sender<Event>, stop: Arc<AtomicBool>) {
    let live = Arc::new(AtomicUsize::new(0));
    for s in l.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(s) = s else { continue };
        if live.load(Ordering::SeqCst) >= MAX_CONNECTIONS {
            log::warn!("control socket: {MAX_CONNECTIONS} connections already: refusing one");
            continue;
        }
        live.fetch_add(1, Ordering::SeqCst);
        let (tx, live2) = (tx.clone(), live.clone());
        let spawned = std::thread::Builder::new()
            .name("sprout-conn".into())
            .spawn(move || {
                connection(s, &tx);
                live2.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            live.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

fn connection(s: UnixStream, tx: &Sender<Event>) {
    let Ok(w) = s.try_clone() else { return };
    let mut r = BufReader::new(s);
    let mut w = BufWriter::new(w);
    let mut send =
        |resp: &Response| -> bool { write_frame(&mut w, resp).is_ok() && w.flush().is_ok() };
    loop {
        let req = match read_frame::<Request>(&mut r) {
            Ok(Some(req)) => req,
            Ok(None) | Err(FrameError::Io(_)) => return,
            Err(e) => {
                // Garbage, another version, an oversized frame: say why,
                // then close this connection (and nothing else).
                log::debug!("control socket: closing a connection: {e}");
                send(&Response::Error(WorkerError::new(e.code(), e.to_string())));
                return;
            }
        };
        let (rtx, rrx) = mpsc::sync_channel(1);
        let reply = match tx
            .send(Event::Request(req, rtx))
            .ok()
            .and_then(|()| rrx.recv().ok())
        {
            Some(r) => r,
            None => {
                send(&Response::Error(WorkerError::new(
                    ErrorCode::Ending,
                    "The worker is ending",
                )));
                return;
            }
        };
        let ok = send(&reply.response);
        if let Some(done) = reply.written {
            let _ = done.send(());
            return;
        }
        if !ok {
            return;
        }
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Runs a worker: binds its socket, builds its shell if it is a ready one,
/// then serves until its VM ends. Returns why the VM ended (`None`: it never
/// had one).
pub fn run(opts: WorkerOptions) -> Result<Option<ExitReason>, ServerError> {
    let started_at_ms = now_ms();
    let (tx, rx) = mpsc::channel();
    // Bound first: a client may connect at once; its requests wait for the shell.
    let listener = bind(&opts.socket, tx.clone())?;
    // tests/lab/bench-spawn.sh reads this line.
    log::debug!(
        "listening {} us after main, {} minor page faults",
        crate::us_since_main(),
        vmm::minor_faults()
    );
    let slot = match opts.shape {
        Some(s) => Slot::Ready(
            VmShell::new(s.vcpus, s.mem_mib)
                .map_err(|e| ServerError::Shell(s.vcpus, s.mem_mib, e))?,
        ),
        None => Slot::Empty,
    };
    let owner = Owner {
        slot,
        scratch_dir: opts
            .scratch_dir
            .clone()
            .or_else(|| opts.socket.parent().map(Path::to_path_buf))
            .unwrap_or_else(std::env::temp_dir),
        socket: opts.socket,
        serial: opts.serial,
        started_at_ms,
        shape: opts.shape,
    };
    // Socket bound, shell built: from here on the owner runs confined, and
    // so (on top of their own filters) do the threads it starts.
    crate::jail::apply_or_exit(Kind::Owner);
    Ok(serve(owner, rx, tx, listener))
}

/// Serves a VM built by the caller (`sprout vm run --api-sock`) on `socket`
/// until it ends.
pub fn serve_vm(vm: Vm, socket: &Path, scratch_dir: &Path) -> Result<ExitReason, ServerError> {
    let (tx, rx) = mpsc::channel();
    let listener = bind(socket, tx.clone())?;
    watch(vm.exit_signal(), tx.clone());
    let owner = Owner {
        serial: vm.config().serial.clone(),
        slot: Slot::Vm(Box::new(vm)),
        socket: socket.to_owned(),
        scratch_dir: scratch_dir.to_owned(),
        started_at_ms: now_ms(),
        shape: None,
    };
    Ok(serve(owner, rx, tx, listener).unwrap_or(ExitReason::Stopped))
}

fn watch(exit: Arc<vmm::vcpu::ExitSignal>, tx: Sender<Event>) {
    let spawned = std::thread::Builder::new()
        .name("sprout-exitwatch".into())
        .spawn(move || {
            crate::jail::apply_or_exit(Kind::Control);
            exit.wait(None);
            let _ = tx.send(Event::Exited);
        });
    if let Err(e) = spawned {
        log::error!("cannot watch the VM's end: {e}");
    }
}

fn serve(
    mut owner: Owner,
    rx: Receiver<Event>,
    tx: Sender<Event>,
    listener: Listener,
) -> Option<ExitReason> {
    while let Ok(ev) = rx.recv() {
        match ev {
            Event::Exited => break,
            Event::Request(req, reply) => {
                // Test builds only: a jailed owner's refused call.
                #[cfg(feature = "test-hooks")]
                crate::jail::test_hooks::on_request();
                let what = req.name();
                let t = std::time::Instant::now();
                let (response, after) = owner.handle(req);
                log::debug!("{what}: {} us", t.elapsed().as_micros());
                match after {
                    After::Continue => {
                        let _ = reply.send(Reply {
                            response,
                            written: None,
                        });
                        owner.after_reply();
                    }
                    After::Watch(exit) => {
                        watch(exit, tx.clone());
                        let _ = reply.send(Reply {
                            response,
                            written: None,
                        });
                        owner.after_reply();
                    }
                    After::End => {
                        let (dtx, drx) = mpsc::sync_channel(1);
                        let _ = reply.send(Reply {
                            response,
                            written: Some(dtx),
                        });
                        let _ = drx.recv_timeout(Duration::from_secs(1));
                        break;
                    }
                }
            }
        }
    }
    // The VM and its leases go first: once the socket is gone, so is
    // everything this worker held.
    let reason = match std::mem::replace(&mut owner.slot, Slot::Empty) {
        Slot::Vm(vm) => Some(vm.stop()),
        _ => None,
    };
    drop(owner);
    drop(listener);
    reason
}
