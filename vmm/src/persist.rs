//! Snapshots of a VM (restoring one is [`crate::restore`]'s).
//!
//! A snapshot (see the `snapshot` crate for the on-disk format) holds the VM
//! state blob written here (`VmState`: the machine spec, KVM's VM and vCPU
//! state, every device's state), a memory layer (full: every non-zero page;
//! diff: the pages changed since the VM's previous snapshot, from KVM's dirty
//! log and the VMM's own writes) and one disk layer per writable disk (the
//! same rule, per 4 KiB cluster). Read-only base images are referenced by
//! path, never copied.

use std::io;
use std::path::Path;

use devices::bus::lock;
use devices::state::Persist;
use devices::virtio::block::{LayerKind, StagedLayer, CLUSTER_SIZE};
use snapshot::format::{KernelIdentity, Shape, Snapshot, SnapshotWriter};
use snapshot::layers::{write_diff_layer, write_full_layer, DirtyBitmap, RamSource, StagedPages};
use vm_memory::{Bytes, GuestMemoryBackend, GuestMemoryRegion};

use crate::arch::state;
use crate::event_loop::ParkTimeout;
use crate::lease::{LayerLease, LeaseError};
use crate::lineage::LineageError;
use crate::memory::{self, Backing, GuestRam};
use crate::options::SnapshotKind;
use crate::run_state::{InvalidState, VmOp, VmRunState};
use crate::vcpu::VcpuError;
use crate::vm::{Vm, VmError};
use crate::vm_devices::VirtioDev;
use crate::vm_state::{
    disk_layer_name, DevState, DiskImage, StateBlobError, VirtioSlot, VmState, STATE_VERSION,
};

/// Name of the memory layer inside each snapshot directory.
const MEMORY_LAYER: &str = "memory";

/// Most bytes (dirty pages and dirty disk clusters together) a durable diff
/// snapshot copies out while the VM is paused, to write and fsync them after
/// it runs again. A larger diff, a full snapshot and a fork layer (which is
/// not fsynced, so writing it costs about what copying it would) are written
/// while paused.
pub const STAGE_LIMIT: u64 = 256 << 20;

/// A snapshot captured while the VM was paused: its files written, or staged
/// (its state blob written, its layers copied to memory); either way
/// [`Captured::finish`] publishes it once the VM runs again (fsyncs,
/// manifest, seal, rename).
enum Captured {
    Written(SnapshotWriter),
    Staged {
        w: SnapshotWriter,
        ram: StagedPages,
        dirty: DirtyBitmap,
        disks: Vec<(usize, StagedLayer)>,
    },
}

impl Captured {
    fn staged_bytes(&self) -> u64 {
        match self {
            Self::Written(_) => 0,
            Self::Staged { ram, disks, .. } => {
                ram.bytes() + disks.iter().map(|(_, l)| l.bytes()).sum::<u64>()
            }
        }
    }

    /// Writes what is staged and publishes the snapshot, sealed. A fork
    /// layer's lease file is created and locked in it before it is
    /// published, so a fork layer is never seen without one.
    fn finish(self, fork_layer: bool) -> Result<(Snapshot, Option<LayerLease>), SnapshotError> {
        let mut w = match self {
            Self::Written(w) => w,
            Self::Staged {
                mut w,
                ram,
                dirty,
                disks,
            } => {
                write_diff_layer(&mut w, MEMORY_LAYER, &ram, &dirty)?;
                drop(ram);
                for (i, l) in &disks {
                    let (data, map) = disk_layer_files(&mut w, *i)?;
                    l.write(&data, &map)
                        .map_err(|source| SnapshotError::DiskLayer { disk: *i, source })?;
                }
                w
            }
        };
        // Verified once, as written: the checksums are of the bytes this
        // process wrote, so restores in other processes (fork children, a
        // fresh worker) check the seal's file versions instead of hashing
        // the data again. A file changed afterwards has another version and
        // is hashed in full.
        w.set_seal(true);
        let lease = if fork_layer {
            let path = w.unlisted_file(crate::lease::LEASE_FILE)?;
            Some(
                LayerLease::open_unpublished(&path)
                    .map_err(|e| LeaseError::Io(w.tmp_dir().to_path_buf(), e))?,
            )
        } else {
            None
        };
        let snap = w.commit()?;
        let lease = lease.map(|file| LayerLease::published(snap.dir(), file));
        Ok((snap, lease))
    }
}

/// The data and map files of writable disk `i`'s layer in `w`.
fn disk_layer_files(
    w: &mut SnapshotWriter,
    i: usize,
) -> Result<(std::path::PathBuf, std::path::PathBuf), SnapshotError> {
    let name = disk_layer_name(i);
    let data = w.add_disk_file(&name, &format!("{name}.data"))?;
    let map = w.add_disk_file(&name, &format!("{name}.map"))?;
    Ok((data, map))
}

/// Why a snapshot (or a fork layer) was not taken.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error(transparent)]
    InvalidState(#[from] InvalidState),
    #[error(transparent)]
    Lineage(#[from] LineageError),
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error("Cannot pause the VM for the snapshot")]
    Pause(#[source] VmError),
    #[error("Cannot resume the VM after the snapshot")]
    Resume(#[source] VmError),
    #[error("Cannot park the device event loop")]
    EventLoop(#[from] ParkTimeout),
    #[error("Cannot save vCPU state")]
    Vcpu(#[from] VcpuError),
    #[error("Cannot save the VM's KVM state")]
    Arch(#[from] state::StateError),
    #[error("Cannot write the snapshot")]
    Write(#[from] snapshot::format::SnapshotError),
    #[error("Cannot write the memory layer")]
    Layer(#[from] snapshot::layers::LayerError),
    #[error("Cannot write disk {disk}'s layer")]
    DiskLayer {
        disk: usize,
        #[source]
        source: devices::virtio::block::LayeredError,
    },
    #[error("Cannot encode the VM state")]
    Encode(#[from] StateBlobError),
    #[error("Cannot read the dirty page log")]
    Memory(#[from] memory::MemoryError),
    #[error("Cannot save the working set")]
    WorkingSet(#[from] snapshot::uffd::WorkingSetError),
}

impl SnapshotError {
    /// A stable snake_case name of the failure, for protocols.
    pub fn code(&self) -> &'static str {
        match self {
            Self::InvalidState(_) => "invalid_state",
            Self::Lineage(LineageError::NoParent) => "no_parent",
            Self::Lineage(LineageError::EphemeralParent) => "ephemeral_parent",
            Self::Lease(LeaseError::Gone(_)) => "layer_gone",
            Self::Pause(e) | Self::Resume(e) => e.code(),
            Self::Vcpu(_) | Self::Arch(_) | Self::Memory(_) => "kvm",
            Self::Lease(_)
            | Self::Write(_)
            | Self::Layer(_)
            | Self::DiskLayer { .. }
            | Self::WorkingSet(_) => "io",
            Self::EventLoop(_) | Self::Encode(_) => "internal",
        }
    }
}

/// Guest RAM as the layer writers read it, over the RAM offset space.
struct RamView<'a> {
    ram: &'a GuestRam,
}

impl RamSource for RamView<'_> {
    fn len(&self) -> u64 {
        self.ram.size
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let mut done = 0usize;
        while done < buf.len() {
            let off = offset + done as u64;
            let gpa = memory::offset_to_gpa(self.ram.size, off)
                .ok_or_else(|| io::Error::other(format!("offset {off:#x} is past guest RAM")))?;
            let region = self
                .ram
                .mem
                .find_region(gpa)
                .ok_or_else(|| io::Error::other(format!("no region at {:#x}", gpa.0)))?;
            let in_region = (region.start_addr().0 + region.len() - gpa.0) as usize;
            let n = in_region.min(buf.len() - done);
            self.ram
                .mem
                .read_slice(&mut buf[done..done + n], gpa)
                .map_err(io::Error::other)?;
            done += n;
        }
        Ok(())
    }

    fn data_ranges(&self) -> Option<Vec<(u64, u64)>> {
        match &self.ram.backing {
            Backing::Fresh(r) => touched_ranges(r.as_ptr(), self.ram.size).ok(),
            _ => None,
        }
    }
}

/// The byte ranges of `size` bytes of anonymous memory at `ptr` that hold a
/// page, resident or swapped out (`/proc/self/pagemap`, 8 bytes a page, read
/// 64 Ki entries at a time): the rest was never touched, or was given back,
/// and reads as zero. A booted VM's full snapshot then reads only those.
/// (`mincore` would not do: it does not count a swapped-out page.)
fn touched_ranges(ptr: *const u8, size: u64) -> io::Result<Vec<(u64, u64)>> {
    use std::os::unix::fs::FileExt;
    const PAGE: u64 = snapshot::PAGE_SIZE as u64;
    const PRESENT: u64 = 1 << 63;
    const SWAPPED: u64 = 1 << 62;
    const BATCH: u64 = 64 << 10;
    let map = std::fs::File::open("/proc/self/pagemap")?;
    let (first, pages) = (ptr as u64 / PAGE, size / PAGE);
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut buf = vec![0u8; (BATCH * 8) as usize];
    let mut done = 0;
    while done < pages {
        let n = (pages - done).min(BATCH);
        let entries = &mut buf[..(n * 8) as usize];
        map.read_exact_at(entries, (first + done) * 8)?;
        for (i, e) in entries.chunks_exact(8).enumerate() {
            let e = u64::from_le_bytes(e.try_into().unwrap_or_default());
            if e & (PRESENT | SWAPPED) == 0 {
                continue;
            }
            let start = (done + i as u64) * PAGE;
            match out.last_mut() {
                Some(last) if last.1 == start => last.1 = start + PAGE,
                _ => out.push((start, start + PAGE)),
            }
        }
        done += n;
    }
    Ok(out)
}

impl Vm {
    /// Takes a snapshot into `dir` (which must not exist). The VM is paused for
    /// the capture and resumed after, unless it was paused already.
    pub fn snapshot(&mut self, dir: &Path, kind: SnapshotKind) -> Result<(), SnapshotError> {
        self.lineage.check_snapshot(kind)?;
        self.snapshot_with(VmOp::Snapshot, dir, kind, false)
    }

    /// [`Vm::snapshot`]; a `fork_layer` skips the fsyncs (it is never kept
    /// past its last user, so it needs no crash safety) and is leased.
    pub(crate) fn snapshot_with(
        &mut self,
        op: VmOp,
        dir: &Path,
        kind: SnapshotKind,
        fork_layer: bool,
    ) -> Result<(), SnapshotError> {
        let before = self.state().after(op)?;
        // Layers let go of at the last one and not released since.
        self.release_retired_layers();
        if kind == SnapshotKind::Diff && self.lineage.parent().is_none() {
            return Err(LineageError::NoParent.into());
        }
        // Refuse a bad destination before touching the VM.
        let shape = Shape {
            vcpus: self.config.vcpus,
            mem_bytes: self.ram.size,
        };
        let mut w = SnapshotWriter::new(dir, shape, self.kernel_identity()?)?;
        w.set_fsync(!fork_layer);
        if kind == SnapshotKind::Diff {
            if let Some(p) = self.lineage.parent() {
                w.set_parent(p)?;
            }
        }
        // A created or paused VM's vCPUs are parked already, and stay so.
        let running = before == VmRunState::Running;
        let paused_at = std::time::Instant::now();
        if running {
            self.pause().map_err(SnapshotError::Pause)?;
        }
        let mut dirty_taken = false;
        let res = self
            .event_loop
            .pause()
            .map_err(SnapshotError::from)
            .and_then(|()| self.snapshot_paused(w, kind, !fork_layer, &mut dirty_taken));
        self.event_loop.resume();
        let resumed = if running {
            self.resume().map_err(SnapshotError::Resume)
        } else {
            Ok(())
        };
        self.last_pause = paused_at.elapsed();
        let staged = res.as_ref().map_or(0, Captured::staged_bytes);
        self.last_staged = 0;
        // Published now, with the guest running (a staged diff written
        // first): the layers' files hold copies made while it was paused.
        let res = resumed.and(res).and_then(|c| c.finish(fork_layer));
        log::debug!(
            "snapshot ({kind:?}{}): paused {} us, {staged} bytes staged, published by {} us",
            if fork_layer { ", fork layer" } else { "" },
            self.last_pause.as_micros(),
            paused_at.elapsed().as_micros()
        );
        match res {
            Ok((s, lease)) => {
                self.lineage.wrote(s, kind, lease);
                self.last_staged = staged;
                Ok(())
            }
            Err(e) => {
                if dirty_taken {
                    // What changed since the parent is now unknown: no diff on it.
                    self.lineage.lost_dirty_log();
                }
                Err(e)
            }
        }
    }

    fn kernel_identity(&self) -> Result<KernelIdentity, SnapshotError> {
        match self.lineage.parent() {
            Some(p) => Ok(p.kernel().clone()),
            None => Ok(KernelIdentity::of_file(&self.config.kernel)?),
        }
    }

    /// Captures the paused VM into `w`: writes it whole, or (a diff of at
    /// most [`STAGE_LIMIT`] bytes, when `may_stage`) writes the state blob
    /// and copies the dirty pages and clusters out for [`Captured::finish`].
    fn snapshot_paused(
        &mut self,
        mut w: SnapshotWriter,
        kind: SnapshotKind,
        may_stage: bool,
        dirty_taken: &mut bool,
    ) -> Result<Captured, SnapshotError> {
        let mut vcpus = Vec::with_capacity(self.vcpus.len());
        for v in &mut self.vcpus {
            vcpus.push(v.save_state(self.msrs.clone())?);
        }
        let arch = state::save_vm(&self.vm, self.has_pit)?;
        let mut virtio = Vec::with_capacity(self.devices.virtio.len());
        let mut disk = 0usize;
        let mut layered = Vec::new();
        let mut images = Vec::new();
        for h in &self.devices.virtio {
            let transport = lock(&h.transport).save();
            let dev = match &h.dev {
                VirtioDev::Block(b) => {
                    let b = lock(b);
                    if let Some(l) = b.layered_disk() {
                        layered.push((disk, l.clone()));
                    }
                    if let Some(identity) = b.image_identity() {
                        images.push(DiskImage { disk, identity });
                    }
                    disk += 1;
                    DevState::Block {
                        disk: disk - 1,
                        state: b.save(),
                    }
                }
                VirtioDev::Vsock(v) => DevState::Vsock(lock(v).save()),
                VirtioDev::Rng(r) => DevState::Rng(lock(r).save()),
                VirtioDev::Net(n) => DevState::Net(lock(n).save()),
            };
            virtio.push(VirtioSlot { transport, dev });
        }
        let state = VmState {
            version: STATE_VERSION,
            spec: self.config.spec(),
            entry: self.entry,
            arch,
            vcpus,
            serial: lock(&self.devices.serial).save(),
            i8042: lock(&self.devices.i8042).save(),
            virtio,
            mailbox_ready: self.mailbox.as_ref().map_or(0, |m| m.ready_mask()),
            images,
        };
        w.write_state(&state.encode()?)?;

        // Memory: what changed since the last snapshot is read (and reset) now,
        // while nothing runs; later writes count toward the next diff.
        *dirty_taken = true;
        let dirty = memory::take_dirty(&self.vm, &self.ram.mem)?;
        let view = RamView { ram: &self.ram };
        let bits = match kind {
            SnapshotKind::Full => None,
            SnapshotKind::Diff => Some(DirtyBitmap::from_words(
                dirty,
                self.ram.size / snapshot::PAGE_SIZE as u64,
            )?),
        };
        let disk_bytes: u64 = layered
            .iter()
            .map(|(_, l)| l.dirty_clusters() * CLUSTER_SIZE)
            .sum();
        match bits {
            Some(dirty)
                if may_stage
                    && dirty.count() * snapshot::PAGE_SIZE as u64 + disk_bytes <= STAGE_LIMIT =>
            {
                let ram = StagedPages::capture(&view, &dirty)?;
                let disks = layered
                    .iter()
                    .map(|(i, l)| {
                        l.stage_diff()
                            .map(|s| (*i, s))
                            .map_err(|source| SnapshotError::DiskLayer { disk: *i, source })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Captured::Staged {
                    w,
                    ram,
                    dirty,
                    disks,
                })
            }
            bits => self.write_paused(w, kind, &view, bits, &layered),
        }
    }

    /// Writes the paused VM's layers into `w` and commits it.
    fn write_paused(
        &self,
        mut w: SnapshotWriter,
        kind: SnapshotKind,
        view: &RamView<'_>,
        dirty: Option<DirtyBitmap>,
        layered: &[(usize, std::sync::Arc<devices::virtio::block::LayeredDisk>)],
    ) -> Result<Captured, SnapshotError> {
        match (kind, dirty) {
            (SnapshotKind::Diff, Some(bits)) => {
                write_diff_layer(&mut w, MEMORY_LAYER, view, &bits)?
            }
            _ => write_full_layer(&mut w, MEMORY_LAYER, view)?,
        };
        let disk_kind = match kind {
            SnapshotKind::Full => LayerKind::Full,
            SnapshotKind::Diff => LayerKind::Diff,
        };
        // Unsynced: a durable snapshot's files are fsynced when it is
        // published, after the VM runs again; a fork layer's never are.
        for (i, l) in layered {
            let (data, map) = disk_layer_files(&mut w, *i)?;
            l.write_layer_unsynced(&data, &map, disk_kind)
                .map_err(|source| SnapshotError::DiskLayer { disk: *i, source })?;
        }
        // Later writes count toward the next layer. Should publishing this
        // one fail, the dirty log is lost (`dirty_taken`): nothing builds on
        // the parent.
        for (_, l) in layered {
            l.mark_clean();
        }
        Ok(Captured::Written(w))
    }

    /// With the uffd backend, stores the pages the guest touched in its first
    /// moments after the restore as the snapshot's working set, which later
    /// restores prefetch. Returns whether one was saved.
    pub fn save_working_set(&self) -> Result<bool, SnapshotError> {
        let (Backing::Uffd(u), Some(p)) = (&self.ram.backing, self.lineage.parent()) else {
            return Ok(false);
        };
        match u.working_set() {
            Some(ws) if !ws.is_empty() => {
                ws.save(p)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Page-server counters, for a VM restored with the uffd backend.
    pub fn uffd_stats(&self) -> Option<snapshot::uffd::UffdStats> {
        match &self.ram.backing {
            Backing::Uffd(u) => Some(u.stats()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run_state::VmRunState;
    use crate::vcpu::ExitReason;

    #[test]
    fn codes_are_stable() {
        let e = SnapshotError::from(InvalidState {
            op: "snapshot",
            state: VmRunState::Exited(ExitReason::Reset),
        });
        assert_eq!(e.code(), "invalid_state");
        assert_eq!(
            e.to_string(),
            "Cannot snapshot: the VM has exited (guest reset)"
        );
        assert_eq!(
            SnapshotError::from(LineageError::NoParent).code(),
            "no_parent"
        );
        assert_eq!(
            SnapshotError::from(LineageError::EphemeralParent).code(),
            "ephemeral_parent"
        );
        let gone = LeaseError::Gone("/tmp/x".into());
        assert_eq!(SnapshotError::from(gone).code(), "layer_gone");
    }

    /// Touched pages are found (written, or only read: a read maps the zero
    /// page), untouched and given-back ones are not.
    #[test]
    fn touched_ranges_are_the_pages_that_hold_something() {
        let len = 8 << 20;
        let r = snapshot::Reservation::new(len).unwrap();
        let p = r.as_ptr();
        // SAFETY: all offsets are inside the reservation, which is ours.
        unsafe {
            *p.add(3 * 4096) = 1;
            *p.add(4 * 4096 + 7) = 1;
            *p.add(1000 * 4096) = 1;
            std::ptr::read_volatile(p.add(1500 * 4096));
            *p.add(1800 * 4096) = 1;
            libc::madvise(p.add(1800 * 4096).cast(), 4096, libc::MADV_DONTNEED);
        }
        let got = touched_ranges(p, len as u64).unwrap();
        let page = |n: u64| (n * 4096, (n + 1) * 4096);
        // Where the host backs it with huge pages, a touch brings in the
        // whole 2 MiB around it; every range then covers its touches.
        let covers = |(s, e): (u64, u64)| got.iter().any(|&(a, b)| a <= s && e <= b);
        for n in [3, 4, 1000, 1500] {
            assert!(covers(page(n)), "page {n} in {got:x?}");
        }
        if got.iter().map(|(a, b)| b - a).sum::<u64>() < 2 << 20 {
            assert_eq!(got, vec![(3 * 4096, 5 * 4096), page(1000), page(1500)]);
        }
    }
}
