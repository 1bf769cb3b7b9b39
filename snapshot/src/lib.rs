//! Sprout snapshots.
//!
//! A snapshot is a directory: a manifest, an opaque VM state blob (the VMM's
//! serialized vCPU, VM and device state), memory layers and disk layers. This
//! crate owns the format, writes it crash-safely, verifies it on load, and
//! restores guest memory from a stack of layers with one of two backends.
//!
//! Memory is addressed in the **RAM offset space** `[0, mem_size)`: the VMM maps
//! guest physical regions onto it in order (below the MMIO gap, then above
//! 4 GiB), exactly as its host memory is laid out. A page frame number (`pfn`) is an
//! offset divided by [`PAGE_SIZE`].
//!
//! * [`format`]: the manifest, [`format::SnapshotWriter`] (temp dir, fsync,
//!   rename, fsync parent) and [`format::Snapshot::load`] (verifies every file).
//! * [`layers`]: memory layer files (full: every non-zero page; diff: only the
//!   pages in a dirty bitmap) and [`layers::LayerStack`], the page lookup over a
//!   base and its diffs.
//! * [`mmap`]: restore by `MAP_PRIVATE` of the layer files (kernel copy-on-write,
//!   page cache shared across restores).
//! * [`uffd`]: restore into anonymous memory registered with userfaultfd and
//!   served by a page-server thread, with working-set recording and prefetch.
//!
//! The on-disk format is described in `docs/snapshot-format.md`.

pub mod fault;
pub mod format;
pub mod layers;
pub mod mmap;
pub mod thread_hook;
pub mod uffd;

/// Size of a guest page, and of the chunks files are checksummed in.
pub const PAGE_SIZE: usize = 4096;

pub mod reservation;
pub use reservation::Reservation;

pub use format::{
    Checksum, KernelIdentity, Manifest, Shape, Snapshot, SnapshotError, SnapshotId, SnapshotWriter,
    FORMAT_VERSION,
};
pub use layers::{
    write_diff_layer, write_full_layer, DirtyBitmap, LayerError, LayerStack, Page, RamSource,
    StagedPages,
};
pub use mmap::{map_private, MmapError, PrivateMapping};
pub use uffd::{UffdError, UffdOptions, UffdRestore, UffdStats, WorkingSet};

#[cfg(test)]
pub(crate) mod testutil;

#[cfg(test)]
mod tests {
    fn send_sync<T: Send + Sync>() {}

    #[test]
    fn restored_memory_can_be_owned_by_another_thread() {
        send_sync::<crate::PrivateMapping>();
        send_sync::<crate::UffdRestore>();
        send_sync::<crate::LayerStack>();
        send_sync::<crate::Snapshot>();
    }
}
