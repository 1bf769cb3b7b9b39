//! The thread that owns the worker's VM (or its ready shell) and carries out
//! requests one at a time. Socket threads never touch the VM: they hand each
//! request over a channel and wait for its answer.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use vmm::vcpu::ExitSignal;
use vmm::{RestoreOptions, SerialOutput, Vm, VmConfig, VmError, VmShell};

use crate::metrics;
use crate::protocol::{
    Description, ErrorCode, ForkLayerInfo, GuestKind, LineageInfo, Request, Response, RestoreSpec,
    Shape, WorkerError, WorkerState, PROTOCOL_VERSION,
};

/// What the worker holds.
pub enum Slot {
    /// A pre-built VM of a shape, waiting for a restore.
    Ready(VmShell),
    Empty,
    Vm(Box<Vm>),
}

/// Everything the owner thread keeps.
pub struct Owner {
    pub slot: Slot,
    pub socket: PathBuf,
    pub serial: SerialOutput,
    /// Where restored VMs' private disk tops go.
    pub scratch_dir: PathBuf,
    pub started_at_ms: u64,
    /// The shape a ready worker was built for (kept after its shell is used).
    pub shape: Option<Shape>,
}

/// What the server loop does after a request.
pub enum After {
    Continue,
    /// A VM now runs: watch its exit signal.
    Watch(Arc<ExitSignal>),
    /// Stop the VM and end the worker.
    End,
}

fn err(code: ErrorCode, msg: impl Into<String>) -> Response {
    Response::Error(WorkerError::new(code, msg))
}

/// The message of `e` with its causes, on one line.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// The protocol code of a VMM failure's stable code (`code()` of the VMM's
/// error types).
pub fn protocol_code(code: &str) -> ErrorCode {
    match code {
        "invalid_state" => ErrorCode::InvalidState,
        "no_parent" => ErrorCode::NoParent,
        "ephemeral_parent" => ErrorCode::EphemeralParent,
        "layer_gone" => ErrorCode::LayerGone,
        // The snapshot does not fit its image: the message says which.
        "bad_snapshot" | "image_changed" => ErrorCode::BadSnapshot,
        "shape_mismatch" => ErrorCode::ShapeMismatch,
        "bad_request" => ErrorCode::BadRequest,
        "io" => ErrorCode::Io,
        "kvm" => ErrorCode::Kvm,
        _ => ErrorCode::Internal,
    }
}

pub fn vm_code(e: &VmError) -> ErrorCode {
    protocol_code(e.code())
}

/// A failed VMM operation `what`, with its code and causes.
fn vmm_err(what: &str, code: &'static str, e: &dyn std::error::Error) -> Response {
    err(protocol_code(code), format!("Cannot {what}: {}", chain(e)))
}

impl Owner {
    fn vm(&mut self) -> Result<&mut Vm, Response> {
        match &mut self.slot {
            Slot::Vm(vm) => Ok(vm),
            _ => Err(err(ErrorCode::NoVm, "This worker holds no VM")),
        }
    }

    pub fn state(&self) -> WorkerState {
        match &self.slot {
            Slot::Ready(_) => WorkerState::Ready,
            Slot::Empty => WorkerState::Empty,
            Slot::Vm(vm) => match vm.state() {
                vmm::VmRunState::Created => WorkerState::Created,
                vmm::VmRunState::Running => WorkerState::Running,
                vmm::VmRunState::Paused => WorkerState::Paused,
                vmm::VmRunState::Exited(r) => WorkerState::Exited(r.to_string()),
                vmm::VmRunState::Failed(why) => WorkerState::Failed(why),
            },
        }
    }

    pub fn describe(&self) -> Description {
        let mut d = Description {
            protocol: PROTOCOL_VERSION,
            pid: std::process::id(),
            started_at_ms: self.started_at_ms,
            socket: self.socket.clone(),
            state: self.state(),
            shape: self.shape,
            instance_id: None,
            guest: None,
            config: None,
            lineage: LineageInfo::default(),
            vsock_uds: None,
        };
        if let Slot::Vm(vm) = &self.slot {
            let spec = vm.config().spec();
            d.shape = Some(Shape {
                vcpus: spec.vcpus,
                mem_mib: spec.mem_mib,
            });
            d.instance_id = Some(vm.instance_id());
            d.guest = Some(match vm.entry_kind() {
                vmm::vm::EntryKind::Direct => GuestKind::TestGuest,
                vmm::vm::EntryKind::Linux => GuestKind::Linux,
            });
            d.vsock_uds = vm.vsock_uds().map(Path::to_path_buf);
            let l = vm.lineage();
            d.lineage = LineageInfo {
                parent: l.parent().map(|p| p.dir().to_path_buf()),
                depth: l.depth(),
                fork_layers: l.leases().iter().map(|x| x.dir().to_path_buf()).collect(),
            };
            d.config = Some(spec);
        }
        d
    }

    /// Work left from the last request once its answer is on its way: the
    /// fork layers a full one let go of are removed (~1.7 ms for a chain
    /// of 8 on ext4 here, which the fork's caller need not wait for).
    pub fn after_reply(&mut self) {
        if let Slot::Vm(vm) = &mut self.slot {
            vm.release_retired_layers();
        }
    }

    /// Carries out one request.
    pub fn handle(&mut self, req: Request) -> (Response, After) {
        match self.handle_inner(req) {
            Ok(x) => x,
            Err(r) => (r, After::Continue),
        }
    }

    fn handle_inner(&mut self, req: Request) -> Result<(Response, After), Response> {
        let ok = |after| Ok((Response::Ok, after));
        match req {
            Request::Describe => Ok((
                Response::Description(Box::new(self.describe())),
                After::Continue,
            )),
            Request::Boot(b) => {
                if let Slot::Vm(_) = self.slot {
                    return Err(err(ErrorCode::HasVm, "This worker already holds a VM"));
                }
                let mut cfg = VmConfig::from_spec(b.spec, self.serial.clone());
                cfg.instance_id = b.instance_id;
                // A ready worker boots into its shell (one of another shape
                // is dropped): its KVM VM, vCPUs and memory slots are made.
                let shell = match std::mem::replace(&mut self.slot, Slot::Empty) {
                    Slot::Ready(s) => Some(s),
                    _ => None,
                };
                let vm = Vm::start_in(cfg, shell)
                    .map_err(|e| err(vm_code(&e), format!("Cannot boot the VM: {}", chain(&e))))?;
                let exit = vm.exit_signal();
                self.slot = Slot::Vm(Box::new(vm));
                Ok((Response::Ok, After::Watch(exit)))
            }
            Request::Restore(spec) => self.restore(spec, false, Default::default()),
            Request::RestoreOver { spec, images } => self.restore(spec, false, images),
            Request::RestoreForkLayer(spec) => self.restore(spec, true, Default::default()),
            Request::Pause => {
                // The VM's run state refuses an impossible transition.
                self.vm()?.pause().map_err(|e| vm_failed("pause", &e))?;
                ok(After::Continue)
            }
            Request::Resume => {
                self.vm()?.resume().map_err(|e| vm_failed("resume", &e))?;
                ok(After::Continue)
            }
            Request::Snapshot { dir, diff } => {
                let kind = if diff {
                    vmm::SnapshotKind::Diff
                } else {
                    vmm::SnapshotKind::Full
                };
                self.vm()?
                    .snapshot(&dir, kind)
                    .map_err(|e| vmm_err("snapshot", e.code(), &e))?;
                ok(After::Continue)
            }
            Request::WriteForkLayer { scratch_dir } => {
                let l = self
                    .vm()?
                    .write_fork_layer(&scratch_dir)
                    .map_err(|e| vmm_err("write a fork layer", e.code(), &e))?;
                Ok((
                    Response::ForkLayer(ForkLayerInfo {
                        dir: l.dir,
                        diff: l.diff,
                        depth: l.depth,
                        pause_us: l.pause.as_micros() as u64,
                    }),
                    After::Continue,
                ))
            }
            Request::Stop => ok(After::End),
            Request::Metrics => {
                let mut m = metrics::process();
                if let Slot::Vm(vm) = &self.slot {
                    m.last_pause_us = vm.last_pause().as_micros() as u64;
                    if let Some(s) = vm.uffd_stats() {
                        m.uffd_faults = Some(s.faults);
                        m.uffd_prefetched = Some(s.pages_prefetched);
                    }
                }
                Ok((Response::Metrics(m), After::Continue))
            }
            Request::Vcpus => Ok((Response::Vcpus(self.vm()?.inspect_vcpus()), After::Continue)),
            Request::Mailbox {
                cpu,
                cmd,
                args,
                timeout_ms,
            } => {
                let vm = self.vm()?;
                let Some(m) = vm.mailbox() else {
                    return Err(err(
                        ErrorCode::NotSupported,
                        "This VM's kernel has no mailbox (not the test guest)",
                    ));
                };
                if cpu >= vm.config().vcpus {
                    return Err(err(
                        ErrorCode::BadRequest,
                        format!("No vCPU {cpu} (the VM has {})", vm.config().vcpus),
                    ));
                }
                let t = Duration::from_millis(u64::from(timeout_ms.clamp(1, 600_000)));
                let r = m
                    .wait_ready(cpu, t)
                    .and_then(|()| m.call(cpu, cmd, args, t))
                    .map_err(|e| err(ErrorCode::Timeout, format!("Mailbox: {}", chain(&e))))?;
                Ok((
                    Response::Mailbox {
                        status: r.status,
                        rets: r.rets,
                    },
                    After::Continue,
                ))
            }
        }
    }

    fn restore(
        &mut self,
        spec: RestoreSpec,
        fork: bool,
        images: std::collections::BTreeMap<usize, PathBuf>,
    ) -> Result<(Response, After), Response> {
        let shell = match std::mem::replace(&mut self.slot, Slot::Empty) {
            Slot::Vm(vm) => {
                self.slot = Slot::Vm(vm);
                return Err(err(ErrorCode::HasVm, "This worker already holds a VM"));
            }
            Slot::Ready(s) => Some(s),
            Slot::Empty => None,
        };
        let mut o = if fork {
            RestoreOptions::for_fork(spec.backend.into())
        } else {
            RestoreOptions::new(spec.backend.into())
        };
        if !fork {
            o.prefetch = spec.prefetch;
        }
        o.serial = self.serial.clone();
        o.vsock_uds = spec.vsock_uds;
        o.scratch_dir = self.scratch_dir.clone();
        o.instance_id = spec.instance_id;
        o.net = spec.net;
        o.image_paths = images;
        let r = match (fork, shell) {
            (true, shell) => Vm::restore_fork_layer(&spec.dir, shell, o),
            (false, Some(shell)) => Vm::restore_in(shell, &spec.dir, o),
            (false, None) => Vm::restore(&spec.dir, o),
        };
        let vm =
            r.map_err(|e| vmm_err(&format!("restore {}", spec.dir.display()), e.code(), &e))?;
        let exit = vm.exit_signal();
        self.slot = Slot::Vm(Box::new(vm));
        Ok((Response::Ok, After::Watch(exit)))
    }
}

/// A failed pause or resume: an invalid transition already says what was
/// refused ("Cannot pause: the VM is paused"); anything else gets the operation.
fn vm_failed(op: &str, e: &VmError) -> Response {
    match e {
        VmError::InvalidState(_) => err(vm_code(e), chain(e)),
        _ => err(vm_code(e), format!("Cannot {op}: {}", chain(e))),
    }
}
