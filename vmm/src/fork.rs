//! Fork(n) of a running VM.
//!
//! 1. The parent is paused just long enough to write a **fork layer**: a
//!    snapshot without fsyncs into the scratch directory — a diff of what
//!    changed since the parent's previous layer (cost in proportion to the
//!    dirty pages and disk clusters), or a full layer (every non-zero page)
//!    when it has none or its chain is [`MAX_CHAIN_DEPTH`] deep (the
//!    compaction rule: the next layer is written whole, so restore and fault
//!    cost stay flat). The parent then runs on.
//! 2. `n` children are restored from that layer stack in parallel, each into
//!    a pre-built shell when a pool is given, each with private copy-on-write
//!    memory, a private disk top over the frozen disk layers, its own vsock
//!    socket and a new instance id.
//! 3. The layer directory is kept while any VM needs it (the parent for its
//!    next diff, every child for its memory and disks, deeper layers for their
//!    base) and removed when the last one is gone.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use devices::legacy::SerialOutput;

use crate::persist::{MemoryBackend, PersistError, RestoreOptions, SnapshotKind};
use crate::shell::ShellPool;
use crate::vm::Vm;

/// Past this many layers, a fork writes a full layer instead of a diff.
pub const MAX_CHAIN_DEPTH: usize = 8;

static INSTANCE: AtomicU64 = AtomicU64::new(1);
static LAYER_SEQ: AtomicU64 = AtomicU64::new(0);

/// A process-unique instance id.
pub(crate) fn new_instance_id() -> u64 {
    INSTANCE.fetch_add(1, Ordering::Relaxed)
}

/// A fork layer's directory, removed when the last VM holding it is gone.
pub struct ForkLayer {
    dir: PathBuf,
    /// The layer this one is a diff on: kept as long as this one.
    _parent: Option<Arc<ForkLayer>>,
}

impl ForkLayer {
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }
}

impl Drop for ForkLayer {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            log::warn!("cannot remove fork layer {}: {e}", self.dir.display());
        }
    }
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
}

impl ForkOptions {
    pub fn new(scratch_dir: impl Into<PathBuf>) -> Self {
        let scratch_dir = scratch_dir.into();
        Self {
            backend: MemoryBackend::Mmap,
            vsock_dir: Some(scratch_dir.clone()),
            scratch_dir,
            serial: SerialOutput::Sink,
        }
    }
}

impl Vm {
    /// Forks this VM into `n` children that start where it is now; the
    /// parent keeps running. With a `pool`, children take its shells.
    pub fn fork(
        &mut self,
        n: usize,
        opts: &ForkOptions,
        pool: Option<&ShellPool>,
    ) -> Result<Vec<Vm>, PersistError> {
        if n == 0 {
            return Err(PersistError::NoChildren);
        }
        if self.config.vsock.is_some() && opts.vsock_dir.is_none() {
            return Err(PersistError::NeedVsockDir);
        }
        let kind = if self.parent.is_some() && self.chain_depth < MAX_CHAIN_DEPTH {
            SnapshotKind::Diff
        } else {
            SnapshotKind::Full
        };
        let dir = opts.scratch_dir.join(format!(
            "sprout-layer-{}-{}",
            std::process::id(),
            LAYER_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let base = match kind {
            SnapshotKind::Diff => self.fork_layer.clone(),
            SnapshotKind::Full => None,
        };
        self.snapshot_with(&dir, kind, false)?;
        let layer = Arc::new(ForkLayer {
            dir: dir.clone(),
            _parent: base,
        });
        self.fork_layer = Some(layer.clone());

        let mut shells = Vec::with_capacity(n);
        for _ in 0..n {
            shells.push(match pool {
                Some(p) => Some(p.take()?),
                None => None,
            });
        }
        let ids: Vec<u64> = (0..n).map(|_| crate::fork::new_instance_id()).collect();
        // Loaded and verified once; every child maps the same layer stack.
        let (chain, stack) = crate::persist::load_for_restore(&dir)?;
        let results: Vec<Result<Vm, PersistError>> = std::thread::scope(|s| {
            let handles: Vec<_> = shells
                .into_iter()
                .zip(&ids)
                .map(|(shell, &id)| {
                    let (chain, stack) = (&chain, stack.clone());
                    s.spawn(move || {
                        let mut o = RestoreOptions::new(opts.backend);
                        o.prefetch = false;
                        o.record_working_set_for = None;
                        o.serial = opts.serial.clone();
                        o.scratch_dir = opts.scratch_dir.clone();
                        o.vsock_uds = opts
                            .vsock_dir
                            .as_ref()
                            .map(|d| d.join(format!("vm-{id}.vsock")));
                        let mut child = Vm::restore_loaded(chain, stack, o, shell)?;
                        child.resume()?;
                        child.after_restore();
                        Ok(child)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(PersistError::Inconsistent(
                            "a fork child's start panicked".into(),
                        ))
                    })
                })
                .collect()
        });
        let mut children = Vec::with_capacity(n);
        for (r, id) in results.into_iter().zip(ids) {
            let mut child = r?;
            child.instance_id = id;
            child.fork_layer = Some(layer.clone());
            children.push(child);
        }
        Ok(children)
    }
}
