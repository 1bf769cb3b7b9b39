//! Where a VM comes from and what its next layer builds on, in one place.
//!
//! A VM's lineage is its instance id, the snapshot it last took or was
//! restored from (its **parent**: a diff snapshot or a fork layer is written
//! on top of it), how deep that parent's chain is, and the leases it holds on
//! the fork layers of that chain (see [`crate::lease`]). The rules:
//! - a user's diff snapshot needs a parent, and not a fork layer (fork
//!   layers are not kept, so nothing durable may build on one);
//! - a fork layer is a diff on the parent while the chain is shorter than
//!   [`MAX_CHAIN_DEPTH`], else a full layer (restore cost stays flat);
//! - after a full layer, nothing below it is needed: its leases are let go;
//! - when a capture fails after the dirty log was read, what changed since
//!   the parent is unknown: the lineage forgets its parent, and the next
//!   layer is full.

use snapshot::format::Snapshot;

use crate::lease::LayerLease;

/// Past this many layers, a fork writes a full layer instead of a diff.
pub const MAX_CHAIN_DEPTH: usize = 8;

/// Whole or changed-only: see [`crate::SnapshotKind`].
pub use crate::options::SnapshotKind;

/// Why a layer cannot be written on this lineage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LineageError {
    #[error("A diff snapshot needs an earlier snapshot of this VM: take a full one first")]
    NoParent,
    #[error("This VM's last layer is a fork layer, which is not kept: take a full snapshot")]
    EphemeralParent,
}

#[derive(Debug)]
pub struct Lineage {
    instance_id: u64,
    parent: Option<Snapshot>,
    /// Layers in `parent`'s chain (0 without a parent).
    depth: usize,
    /// Leases on the fork layers of `parent`'s chain, bottom first.
    leases: Vec<LayerLease>,
    /// Leases let go of (a full layer began a new chain, or the dirty log
    /// was lost) but not dropped yet: dropping the last lease on a layer
    /// removes its directory, ~0.2 ms a layer on ext4 here (1.7 ms for a
    /// chain of 8), which a fork should not wait for. Whoever wrote the
    /// layer drops them once its caller has the answer
    /// ([`crate::Vm::release_retired_layers`]).
    retired: Vec<LayerLease>,
}

impl Lineage {
    /// A VM booted from nothing.
    pub fn new(instance_id: u64) -> Self {
        Self {
            instance_id,
            parent: None,
            depth: 0,
            leases: Vec::new(),
            retired: Vec::new(),
        }
    }

    /// A VM restored from `chain` (bottom first), holding `leases` on its
    /// fork layers.
    pub fn restored(instance_id: u64, chain: &[Snapshot], leases: Vec<LayerLease>) -> Self {
        Self {
            instance_id,
            parent: chain.last().cloned(),
            depth: chain.len(),
            leases,
            retired: Vec::new(),
        }
    }

    pub fn instance_id(&self) -> u64 {
        self.instance_id
    }

    /// The snapshot the next diff (or fork layer) builds on.
    pub fn parent(&self) -> Option<&Snapshot> {
        self.parent.as_ref()
    }

    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Whether the parent is a fork layer (not kept once unused).
    pub fn parent_is_fork_layer(&self) -> bool {
        match (&self.parent, self.leases.last()) {
            (Some(p), Some(l)) => p.dir() == l.dir(),
            _ => false,
        }
    }

    /// The fork layers this VM holds, bottom first.
    pub fn leases(&self) -> &[LayerLease] {
        &self.leases
    }

    /// Checks that a user's snapshot of `kind` can be written.
    pub fn check_snapshot(&self, kind: SnapshotKind) -> Result<(), LineageError> {
        match kind {
            SnapshotKind::Full => Ok(()),
            SnapshotKind::Diff if self.parent.is_none() => Err(LineageError::NoParent),
            SnapshotKind::Diff if self.parent_is_fork_layer() => Err(LineageError::EphemeralParent),
            SnapshotKind::Diff => Ok(()),
        }
    }

    /// What the next fork layer is.
    pub fn fork_layer_kind(&self) -> SnapshotKind {
        if self.parent.is_some() && self.depth < MAX_CHAIN_DEPTH {
            SnapshotKind::Diff
        } else {
            SnapshotKind::Full
        }
    }

    /// Records a layer written on this lineage: `lease` is set for a fork layer.
    pub fn wrote(&mut self, snap: Snapshot, kind: SnapshotKind, lease: Option<LayerLease>) {
        match kind {
            SnapshotKind::Full => {
                self.depth = 1;
                self.retired.append(&mut self.leases);
            }
            SnapshotKind::Diff => self.depth += 1,
        }
        self.leases.extend(lease);
        self.parent = Some(snap);
    }

    /// The dirty log was read but no layer was written: what changed since
    /// the parent is unknown, so nothing may build on it.
    pub fn lost_dirty_log(&mut self) {
        self.parent = None;
        self.depth = 0;
        self.retired.append(&mut self.leases);
    }

    /// The leases let go of since the last call (see `retired`): dropping
    /// them removes the layers nobody else holds.
    pub fn take_retired(&mut self) -> Vec<LayerLease> {
        std::mem::take(&mut self.retired)
    }
}

/// A random 64-bit instance id, unique across processes and hosts in
/// practice (never 0).
pub fn new_instance_id() -> u64 {
    let mut b = [0u8; 8];
    loop {
        match rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()) {
            Ok(8) => {}
            // getrandom(2) never fails for 8 bytes once the pool is up; fall
            // back on the clock and pid rather than panic.
            _ => {
                let t = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as u64);
                b = (t ^ (u64::from(std::process::id()) << 40)).to_le_bytes();
            }
        }
        let id = u64::from_le_bytes(b);
        if id != 0 {
            return id;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_vm_has_no_parent_and_forks_whole() {
        let l = Lineage::new(7);
        assert_eq!(l.instance_id(), 7);
        assert_eq!(
            l.check_snapshot(SnapshotKind::Diff),
            Err(LineageError::NoParent)
        );
        assert_eq!(l.check_snapshot(SnapshotKind::Full), Ok(()));
        assert_eq!(l.fork_layer_kind(), SnapshotKind::Full);
        assert!(!l.parent_is_fork_layer());
    }

    #[test]
    fn forgetting_the_dirty_log_forgets_the_parent() {
        let root = tempfile::tempdir().unwrap();
        let f = snap(root.path(), "fork", None);
        let mut l = Lineage::new(1);
        l.wrote(
            f.clone(),
            SnapshotKind::Full,
            Some(LayerLease::create(f.dir()).unwrap()),
        );
        l.lost_dirty_log();
        assert!(l.leases().is_empty());
        assert!(
            f.dir().exists(),
            "removed before the retired lease was dropped"
        );
        drop(l.take_retired());
        assert!(!f.dir().exists());
        assert_eq!(l.depth(), 0);
        assert!(l.parent().is_none());
        assert_eq!(l.fork_layer_kind(), SnapshotKind::Full);
    }

    fn snap(root: &std::path::Path, name: &str, parent: Option<&Snapshot>) -> Snapshot {
        let k = root.join("kernel");
        std::fs::write(&k, b"kernel").unwrap();
        let shape = snapshot::format::Shape {
            vcpus: 1,
            mem_bytes: 1 << 20,
        };
        let kernel = snapshot::format::KernelIdentity::of_file(&k).unwrap();
        let mut w = snapshot::format::SnapshotWriter::new(&root.join(name), shape, kernel).unwrap();
        w.set_fsync(false);
        if let Some(p) = parent {
            w.set_parent(p).unwrap();
        }
        w.write_state(b"state").unwrap();
        w.commit().unwrap()
    }

    #[test]
    fn fork_layers_chain_up_to_the_depth_limit_then_start_whole() {
        let root = tempfile::tempdir().unwrap();
        let mut l = Lineage::new(1);
        let mut prev: Option<Snapshot> = None;
        for i in 0..MAX_CHAIN_DEPTH + 2 {
            let kind = l.fork_layer_kind();
            let expect = if i % MAX_CHAIN_DEPTH == 0 {
                SnapshotKind::Full
            } else {
                SnapshotKind::Diff
            };
            assert_eq!(kind, expect, "layer {i}");
            let parent = (kind == SnapshotKind::Diff)
                .then_some(())
                .and(prev.as_ref());
            let s = snap(root.path(), &format!("l{i}"), parent);
            let lease = LayerLease::create(s.dir()).unwrap();
            l.wrote(s.clone(), kind, Some(lease));
            assert!(l.parent_is_fork_layer());
            assert_eq!(
                l.check_snapshot(SnapshotKind::Diff),
                Err(LineageError::EphemeralParent)
            );
            assert_eq!(
                l.leases().len(),
                l.depth(),
                "one lease per layer of the chain"
            );
            prev = Some(s);
        }
        // The first full layer's chain was let go when the second began,
        // and is removed (nobody else holds it) once the retired leases
        // are dropped, not while the new layer is being handed out.
        assert!(root.path().join("l0").exists());
        assert_eq!(l.take_retired().len(), MAX_CHAIN_DEPTH);
        assert!(!root.path().join("l0").exists());
        assert!(l.take_retired().is_empty());
        assert!(root.path().join(format!("l{MAX_CHAIN_DEPTH}")).exists());
    }

    #[test]
    fn a_durable_snapshot_after_a_fork_layer_takes_diffs_again() {
        let root = tempfile::tempdir().unwrap();
        let mut l = Lineage::new(1);
        let f = snap(root.path(), "fork", None);
        l.wrote(
            f.clone(),
            SnapshotKind::Full,
            Some(LayerLease::create(f.dir()).unwrap()),
        );
        let s = snap(root.path(), "snap", None);
        l.wrote(s, SnapshotKind::Full, None);
        assert!(!l.parent_is_fork_layer());
        assert_eq!(l.check_snapshot(SnapshotKind::Diff), Ok(()));
        drop(l.take_retired());
        assert!(
            !root.path().join("fork").exists(),
            "the unused fork layer is removed"
        );
        assert!(root.path().join("snap").exists());
    }

    #[test]
    fn instance_ids_differ() {
        let ids: std::collections::HashSet<u64> = (0..1000).map(|_| new_instance_id()).collect();
        assert_eq!(ids.len(), 1000);
        assert!(!ids.contains(&0));
    }
}
