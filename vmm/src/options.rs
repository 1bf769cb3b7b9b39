//! What a caller chooses for a snapshot or a restore.

use std::path::PathBuf;
use std::time::Duration;

use devices::legacy::SerialOutput;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SnapshotKind {
    /// Every non-zero page and every written disk cluster.
    Full,
    /// Only what changed since this VM's previous snapshot (or its restore),
    /// which becomes the new snapshot's parent.
    Diff,
}

/// How a restore maps guest memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryBackend {
    /// `MAP_PRIVATE` of the layer files: kernel copy-on-write, page cache
    /// shared by every restore of the snapshot.
    Mmap,
    /// Anonymous memory served by a userfaultfd page server.
    Uffd,
}

impl std::str::FromStr for MemoryBackend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mmap" => Ok(Self::Mmap),
            "uffd" => Ok(Self::Uffd),
            other => Err(format!(
                "unknown memory backend {other:?}: use mmap or uffd"
            )),
        }
    }
}

pub struct RestoreOptions {
    pub backend: MemoryBackend,
    /// uffd: fill the snapshot's recorded working set before the guest runs.
    pub prefetch: bool,
    /// uffd: when the snapshot has no working set yet, record the pages the
    /// guest touches this long after the restore ([`crate::Vm::save_working_set`]).
    pub record_working_set_for: Option<Duration>,
    pub serial: SerialOutput,
    /// Where the restored VM's vsock host side listens (the snapshot's own
    /// socket may belong to a VM that still runs). Needed if it has vsock.
    pub vsock_uds: Option<PathBuf>,
    /// Where the restored VM's private writable disk tops are created
    /// (unlinked at once, so nothing is left behind).
    pub scratch_dir: PathBuf,
    /// The restored VM's instance id; a random one when `None`.
    pub instance_id: Option<u64>,
    /// The restored vsock device's connection budget (see
    /// [`crate::VmConfig::vsock_max_connections`]): a host-side limit, not
    /// part of the snapshot.
    pub vsock_max_connections: usize,
    /// The restored VM's network device: its own TAP and MAC (the
    /// snapshot's TAP may belong to a VM that still runs). Needed if it has
    /// one.
    pub net: Option<crate::config::NetConfig>,
    /// Read-only disk `i` reads its image at this path, not at the one the
    /// snapshot recorded: the same image elsewhere (a copy, a link that
    /// outlives a rebuild). The restored VM's spec names it; the restore
    /// still refuses an image that is not the one recorded
    /// ([`crate::RestoreError::ImageChanged`]).
    pub image_paths: std::collections::BTreeMap<usize, PathBuf>,
}

impl RestoreOptions {
    pub fn new(backend: MemoryBackend) -> Self {
        Self {
            backend,
            prefetch: true,
            record_working_set_for: Some(Duration::from_millis(200)),
            serial: SerialOutput::Sink,
            vsock_uds: None,
            scratch_dir: std::env::temp_dir(),
            instance_id: None,
            vsock_max_connections: crate::config::DEFAULT_VSOCK_CONNECTIONS,
            net: None,
            image_paths: Default::default(),
        }
    }

    /// For a fork child: no working set to prefetch or record (the layer is
    /// fresh and short-lived).
    pub fn for_fork(backend: MemoryBackend) -> Self {
        Self {
            prefetch: false,
            record_working_set_for: None,
            ..Self::new(backend)
        }
    }
}
