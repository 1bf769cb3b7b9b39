//! Fork(n) of a running VM.
//!
//! 1. The parent is paused just long enough to write a **fork layer**: a
//!    snapshot without fsyncs into the scratch directory — a diff of what
//!    changed since the parent's previous layer (cost in proportion to the
//!    dirty pages and disk clusters), or a full layer (every non-zero page)
//!    when it has none or its chain is [`crate::MAX_CHAIN_DEPTH`] deep (the
//!    compaction rule: the next layer is written whole, so restore and fault
//!    cost stay flat). The parent then runs on.
//!    ([`Vm::write_fork_layer`])
//! 2. `n` children are restored from that layer stack in parallel — in this
//!    process ([`Vm::fork`]) or each in its own worker process
//!    ([`Vm::restore_fork_layer`]) — each into a pre-built shell when one is
//!    ready, each with private copy-on-write memory, a private disk top over
//!    the frozen disk layers, its own vsock socket and a new instance id.
//! 3. The layer directory is kept while any VM needs it (the parent for its
//!    next diff, every child for its memory and disks, deeper layers for their
//!    base) and removed when the last one is gone: each holds a lease on it
//!    ([`crate::lease`]), counted by the kernel across processes. The chain a
//!    full layer replaces is let go of after the fork's answer, not before
//!    ([`Vm::release_retired_layers`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use devices::legacy::SerialOutput;

use crate::lineage::new_instance_id;
use crate::options::{MemoryBackend, RestoreOptions, SnapshotKind};
use crate::persist::SnapshotError;
use crate::restore::RestoreError;
use crate::shell::ShellPool;
use crate::vm::Vm;

static LAYER_SEQ: AtomicU64 = AtomicU64::new(0);

/// Why a fork did not make its children.
#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    #[error("A fork needs at least one child")]
    NoChildren,
    #[error("The VM has a vsock device: give the fork a directory for the children's sockets")]
    NeedVsockDir,
    #[error(
        "The VM has a network device: give the fork one TAP per child ({want} children, {have} given)"
    )]
    NeedNets { want: usize, have: usize },
    #[error("Cannot write the fork layer")]
    Layer(#[source] SnapshotError),
    #[error("Cannot build a shell for a child")]
    Shell(#[source] crate::vm::VmError),
    #[error("Cannot load the fork layer")]
    Load(#[source] RestoreError),
    #[error("Cannot start child {index}")]
    Child {
        index: usize,
        #[source]
        source: RestoreError,
    },
    #[error("The start of child {index} panicked")]
    ChildPanicked { index: usize },
}

impl ForkError {
    /// A stable snake_case name of the failure, for protocols.
    pub fn code(&self) -> &'static str {
        match self {
            Self::NoChildren | Self::NeedVsockDir | Self::NeedNets { .. } => "bad_request",
            Self::Layer(e) => e.code(),
            Self::Shell(e) => e.code(),
            Self::Load(e) | Self::Child { source: e, .. } => e.code(),
            Self::ChildPanicked { .. } => "internal",
        }
    }
}

/// A fork layer just written: where it is, and what it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForkLayer {
    /// The layer's directory: restore it with [`Vm::restore_fork_layer`].
    pub dir: PathBuf,
    /// Whether it is a diff on the parent's previous layer.
    pub diff: bool,
    /// Layers in its chain, itself included.
    pub depth: usize,
    /// How long the parent was paused to write it.
    pub pause: std::time::Duration,
}

#[derive(Clone)]
pub struct ForkOptions {
    /// Children's memory: `Mmap` (page cache shared by siblings) or `Uffd`.
    pub backend: MemoryBackend,
    /// Where fork layers and the children's private disk tops go.
    pub scratch_dir: PathBuf,
    /// Where the children's vsock sockets go (`<dir>/vm-<instance id>.vsock`);
    /// needed when the parent has vsock.
    pub vsock_dir: Option<PathBuf>,
    pub serial: SerialOutput,
    /// Each child's own TAP and MAC, one per child, in order; needed when
    /// the parent has a network device (a child never shares its parent's
    /// TAP, and each should have a MAC of its own).
    pub nets: Vec<crate::config::NetConfig>,
}

impl ForkOptions {
    pub fn new(scratch_dir: impl Into<PathBuf>) -> Self {
        let scratch_dir = scratch_dir.into();
        Self {
            backend: MemoryBackend::Mmap,
            vsock_dir: Some(scratch_dir.clone()),
            scratch_dir,
            serial: SerialOutput::Sink,
            nets: Vec::new(),
        }
    }
}

impl Vm {
    /// Step 1 of a fork: pauses this VM just long enough to write a fork
    /// layer into a new directory under `scratch_dir`, then lets it run on.
    /// The layer is leased by this VM (for its next diff) and removed when
    /// its last user, in any process, is gone (see [`crate::lease`]).
    pub fn write_fork_layer(&mut self, scratch_dir: &Path) -> Result<ForkLayer, SnapshotError> {
        let kind = self.lineage.fork_layer_kind();
        let dir = scratch_dir.join(format!(
            "sprout-layer-{:016x}-{}",
            self.instance_id(),
            LAYER_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        self.snapshot_with(crate::run_state::VmOp::Fork, &dir, kind, true)?;
        Ok(ForkLayer {
            dir,
            diff: kind == SnapshotKind::Diff,
            depth: self.lineage.depth(),
            pause: self.last_pause,
        })
    }

    /// Step 2 of a fork, in this process or any other: restores the fork
    /// layer in `dir` (into `shell` when given) and runs it. The child leases
    /// every fork layer of the chain for as long as it lives.
    pub fn restore_fork_layer(
        dir: &Path,
        shell: Option<crate::shell::VmShell>,
        opts: RestoreOptions,
    ) -> Result<Vm, RestoreError> {
        let mut child = Self::restore_impl(dir, opts, shell)?;
        child.resume().map_err(RestoreError::Resume)?;
        child.after_restore();
        Ok(child)
    }

    /// Forks this VM into `n` children in this process that start where it
    /// is now; the parent keeps running. With a `pool`, children take its
    /// shells. The two steps are [`Vm::write_fork_layer`] and
    /// [`Vm::restore_fork_layer`]; across processes, call them there.
    pub fn fork(
        &mut self,
        n: usize,
        opts: &ForkOptions,
        pool: Option<&ShellPool>,
    ) -> Result<Vec<Vm>, ForkError> {
        if n == 0 {
            return Err(ForkError::NoChildren);
        }
        if self.config.vsock.is_some() && opts.vsock_dir.is_none() {
            return Err(ForkError::NeedVsockDir);
        }
        if self.config.net.is_some() && opts.nets.len() != n {
            return Err(ForkError::NeedNets {
                want: n,
                have: opts.nets.len(),
            });
        }
        let layer = self
            .write_fork_layer(&opts.scratch_dir)
            .map_err(ForkError::Layer)?;
        let mut shells = Vec::with_capacity(n);
        for _ in 0..n {
            shells.push(match pool {
                Some(p) => Some(p.take().map_err(ForkError::Shell)?),
                None => None,
            });
        }
        // Children get their parent's vsock connection budget.
        let budget = self.config.vsock_max_connections;
        // Loaded and verified once; every child maps the same layer stack.
        let (chain, stack) =
            crate::restore::load_for_restore(&layer.dir).map_err(ForkError::Load)?;
        let results: Vec<Result<Vm, ForkError>> = std::thread::scope(|s| {
            let handles: Vec<_> = shells
                .into_iter()
                .enumerate()
                .map(|(i, shell)| {
                    let (chain, stack) = (&chain, stack.clone());
                    let net = opts.nets.get(i).cloned();
                    s.spawn(move || {
                        let id = new_instance_id();
                        let mut o = RestoreOptions::for_fork(opts.backend);
                        o.instance_id = Some(id);
                        o.vsock_max_connections = budget;
                        o.serial = opts.serial.clone();
                        o.scratch_dir = opts.scratch_dir.clone();
                        o.net = net;
                        o.vsock_uds = opts
                            .vsock_dir
                            .as_ref()
                            .map(|d| d.join(format!("vm-{id:016x}.vsock")));
                        let leases = crate::lease::lease_chain(chain)?;
                        let mut child = Vm::restore_loaded(chain, stack, leases, o, shell)?;
                        child.resume().map_err(RestoreError::Resume)?;
                        child.after_restore();
                        Ok(child)
                    })
                })
                .collect();
            // Meanwhile, the layers a full one let go of are removed.
            self.release_retired_layers();
            handles
                .into_iter()
                .map(|h| h.join())
                .collect::<Vec<_>>()
                .into_iter()
                .enumerate()
                .map(|(index, r)| match r {
                    Ok(r) => r.map_err(|source| ForkError::Child { index, source }),
                    Err(_) => Err(ForkError::ChildPanicked { index }),
                })
                .collect()
        });
        results.into_iter().collect()
    }
}
