//! Snapshots of a running VM, and VMs restored from them.
//!
//! A snapshot (see the `snapshot` crate for the on-disk format) holds the VM
//! state blob written here (`VmState`: the machine spec, KVM's VM and vCPU
//! state, every device's state), a memory layer (full: every non-zero page;
//! diff: the pages changed since the VM's previous snapshot, from KVM's dirty
//! log and the VMM's own writes) and one disk layer per writable disk (the
//! same rule, per 4 KiB cluster). Read-only base images are referenced by
//! path, never copied.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use devices::bus::lock;
use devices::legacy::{Serial, SerialOutput, SerialRestoreArgs, I8042};
use devices::state::Persist;
use devices::virtio::block::{
    Block, BlockDisk, BlockRestoreArgs, LayerFiles, LayerKind, LayeredDisk,
};
use devices::virtio::mmio::{MmioRestoreArgs, MmioTransport};
use devices::virtio::rng::Rng;
use devices::virtio::vsock::Vsock;
use snapshot::format::{KernelIdentity, Shape, Snapshot, SnapshotWriter};
use snapshot::layers::{write_diff_layer, write_full_layer, DirtyBitmap, LayerStack, RamSource};
use snapshot::uffd::{UffdOptions, UffdRestore, WorkingSet};
use vm_memory::{Bytes, GuestMemoryBackend, GuestMemoryRegion};

use crate::arch::kernel::EntryKind;
use crate::arch::state;
use crate::config::{VmConfig, VmSpec};
use crate::memory::{self, Backing, GuestRam};
use crate::run_state::{VmOp, VmRunState};
use crate::shell::VmShell;
use crate::vcpu::ExitSignal;
use crate::vm::{kvm_vm, new_manager, start_threads, Vm, VmError};
use crate::vm_devices::{Attach, AttachError, DeviceHandles, VirtioDev, VirtioHandle};
use crate::vm_state::{DevState, StateBlobError, VirtioSlot, VmState, STATE_VERSION};

/// Name of the memory layer inside each snapshot directory.
const MEMORY_LAYER: &str = "memory";

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
    /// guest touches this long after the restore ([`Vm::save_working_set`]).
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

#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error(transparent)]
    InvalidState(#[from] crate::run_state::InvalidState),
    #[error(transparent)]
    Lineage(#[from] crate::lineage::LineageError),
    #[error(transparent)]
    Lease(#[from] crate::lease::LeaseError),
    #[error("A fork needs at least one child")]
    NoChildren,
    #[error("The VM has a vsock device: give the fork a directory for the children's sockets")]
    NeedVsockDir,
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error("Snapshot")]
    Snapshot(#[from] snapshot::format::SnapshotError),
    #[error("Memory layer")]
    Layer(#[from] snapshot::layers::LayerError),
    #[error("Cannot map restored memory")]
    Mmap(#[from] snapshot::mmap::MmapError),
    #[error("Cannot start the userfaultfd page server")]
    Uffd(#[from] snapshot::uffd::UffdError),
    #[error("Working set")]
    WorkingSet(#[from] snapshot::uffd::WorkingSetError),
    #[error("Cannot write disk {disk}'s layer")]
    DiskLayer {
        disk: usize,
        #[source]
        source: devices::virtio::block::LayeredError,
    },
    #[error("Snapshot state")]
    StateBlob(#[from] StateBlobError),
    #[error("The snapshot's VM state does not match its manifest: {0}")]
    Inconsistent(String),
    #[error("Device state")]
    Device(#[from] devices::state::StateError),
    #[error("The snapshot has a vsock device: give the restored VM a vsock socket path")]
    NeedVsockPath,
    #[error("Mailbox")]
    Mailbox(#[from] crate::mailbox::MailboxError),
    #[error("Cannot read guest memory")]
    Memory(#[from] memory::MemoryError),
}

fn disk_layer_name(disk: usize) -> String {
    format!("disk{disk}")
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
            Backing::Memfd(f) => memfd_data_ranges(f, self.ram.size).ok(),
            _ => None,
        }
    }
}

/// The extents of a memfd that hold data (pages the guest or VMM touched).
fn memfd_data_ranges(f: &std::fs::File, size: u64) -> io::Result<Vec<(u64, u64)>> {
    use std::os::fd::AsRawFd;
    let fd = f.as_raw_fd();
    let mut out = Vec::new();
    let mut pos: i64 = 0;
    while (pos as u64) < size {
        // SAFETY: lseek on a descriptor we own; it only moves the file offset.
        let start = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if start < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break;
            }
            return Err(e);
        }
        // SAFETY: as above.
        let end = unsafe { libc::lseek(fd, start, libc::SEEK_HOLE) };
        if end < 0 {
            return Err(io::Error::last_os_error());
        }
        out.push((start as u64, (end as u64).min(size)));
        pos = end;
    }
    Ok(out)
}

impl Vm {
    /// Takes a snapshot into `dir` (which must not exist). The VM is paused for
    /// the capture and resumed after, unless it was paused already.
    pub fn snapshot(&mut self, dir: &Path, kind: SnapshotKind) -> Result<(), PersistError> {
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
    ) -> Result<(), PersistError> {
        let before = self.state().after(op)?;
        if kind == SnapshotKind::Diff && self.lineage.parent().is_none() {
            return Err(crate::lineage::LineageError::NoParent.into());
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
            self.pause()?;
        }
        let mut dirty_taken = false;
        let res = self
            .event_loop
            .pause()
            .map_err(|e| PersistError::Vm(VmError::EventLoop(io::Error::other(e))))
            .and_then(|()| self.snapshot_paused(w, kind, &mut dirty_taken));
        self.event_loop.resume();
        if running {
            self.resume()?;
        }
        self.last_pause = paused_at.elapsed();
        let res = res.and_then(|s| {
            let lease = if fork_layer {
                Some(crate::lease::LayerLease::create(s.dir())?)
            } else {
                None
            };
            Ok((s, lease))
        });
        match res {
            Ok((s, lease)) => {
                self.lineage.wrote(s, kind, lease);
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

    fn kernel_identity(&self) -> Result<KernelIdentity, PersistError> {
        match self.lineage.parent() {
            Some(p) => Ok(p.kernel().clone()),
            None => Ok(KernelIdentity::of_file(&self.config.kernel)?),
        }
    }

    fn snapshot_paused(
        &mut self,
        mut w: SnapshotWriter,
        kind: SnapshotKind,
        dirty_taken: &mut bool,
    ) -> Result<Snapshot, PersistError> {
        let mut vcpus = Vec::with_capacity(self.vcpus.len());
        for v in &mut self.vcpus {
            vcpus.push(v.save_state(self.msrs.clone()).map_err(VmError::from)?);
        }
        let arch = state::save_vm(&self.vm, self.has_pit).map_err(VmError::from)?;
        let mut virtio = Vec::with_capacity(self.devices.virtio.len());
        let mut disk = 0usize;
        let mut layered = Vec::new();
        for h in &self.devices.virtio {
            let transport = lock(&h.transport).save();
            let dev = match &h.dev {
                VirtioDev::Block(b) => {
                    let b = lock(b);
                    if let Some(l) = b.layered_disk() {
                        layered.push((disk, l.clone()));
                    }
                    disk += 1;
                    DevState::Block {
                        disk: disk - 1,
                        state: b.save(),
                    }
                }
                VirtioDev::Vsock(v) => DevState::Vsock(lock(v).save()),
                VirtioDev::Rng(r) => DevState::Rng(lock(r).save()),
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
        };
        w.write_state(&state.encode()?)?;

        // Memory: what changed since the last snapshot is read (and reset) now,
        // while nothing runs; later writes count toward the next diff.
        *dirty_taken = true;
        let dirty = memory::take_dirty(&self.vm, &self.ram.mem)?;
        let view = RamView { ram: &self.ram };
        match kind {
            SnapshotKind::Full => write_full_layer(&mut w, MEMORY_LAYER, &view)?,
            SnapshotKind::Diff => {
                let bits =
                    DirtyBitmap::from_words(dirty, self.ram.size / snapshot::PAGE_SIZE as u64)?;
                write_diff_layer(&mut w, MEMORY_LAYER, &view, &bits)?
            }
        };
        let disk_kind = match kind {
            SnapshotKind::Full => LayerKind::Full,
            SnapshotKind::Diff => LayerKind::Diff,
        };
        for (i, l) in &layered {
            let name = disk_layer_name(*i);
            let data = w.add_disk_file(&name, &format!("{name}.data"))?;
            let map = w.add_disk_file(&name, &format!("{name}.map"))?;
            l.write_layer(&data, &map, disk_kind)
                .map_err(|source| PersistError::DiskLayer { disk: *i, source })?;
        }
        let snap = w.commit()?;
        for (_, l) in &layered {
            l.mark_clean();
        }
        Ok(snap)
    }

    /// Restores the VM saved in `dir` (and its parents) and runs it.
    pub fn restore(dir: &Path, opts: RestoreOptions) -> Result<Vm, PersistError> {
        let mut vm = Self::restore_paused(dir, opts)?;
        vm.resume()?;
        vm.after_restore();
        Ok(vm)
    }

    /// Tells devices whose host-side state did not survive (vsock
    /// connections) to reset their guest side; call once the VM runs.
    pub fn after_restore(&mut self) {
        for h in &self.devices.virtio {
            if let VirtioDev::Vsock(v) = &h.dev {
                lock(v).send_transport_reset();
            }
        }
    }

    /// Restores the VM saved in `dir` into a pre-built `shell` of the same
    /// shape (see [`crate::ShellPool`]) and runs it: the KVM set-up, memory
    /// slot registration and vCPU creation were paid ahead of time.
    pub fn restore_in(
        shell: VmShell,
        dir: &Path,
        opts: RestoreOptions,
    ) -> Result<Vm, PersistError> {
        let mut vm = Self::restore_impl(dir, opts, Some(shell))?;
        vm.resume()?;
        vm.after_restore();
        Ok(vm)
    }

    /// Restores the VM saved in `dir` with its vCPUs parked; [`Vm::resume`]
    /// then [`Vm::after_restore`] run it.
    pub fn restore_paused(dir: &Path, opts: RestoreOptions) -> Result<Vm, PersistError> {
        Self::restore_impl(dir, opts, None)
    }

    pub(crate) fn restore_impl(
        dir: &Path,
        opts: RestoreOptions,
        shell: Option<VmShell>,
    ) -> Result<Vm, PersistError> {
        let (chain, stack) = load_for_restore(dir)?;
        let leases = crate::lease::lease_chain(&chain)?;
        Self::restore_loaded(&chain, stack, leases, opts, shell)
    }

    /// Restores from a chain loaded (and verified) once, whose layer stack is
    /// shared by every VM restored from it (a fork's children).
    pub(crate) fn restore_loaded(
        chain: &[Snapshot],
        stack: Arc<LayerStack>,
        leases: Vec<crate::lease::LayerLease>,
        opts: RestoreOptions,
        shell: Option<VmShell>,
    ) -> Result<Vm, PersistError> {
        let t0 = std::time::Instant::now();
        let phase = |what: &str| log::debug!("restore: {what} at {:?}", t0.elapsed());
        let top = chain
            .last()
            .ok_or_else(|| PersistError::Inconsistent("the snapshot chain is empty".into()))?;
        let st = VmState::decode(top.state())?;
        let shape = top.shape();
        let mem_bytes = st.spec.mem_mib << 20;
        if shape.vcpus != st.spec.vcpus
            || shape.mem_bytes != mem_bytes
            || st.vcpus.len() != usize::from(st.spec.vcpus)
        {
            return Err(PersistError::Inconsistent(format!(
                "manifest shape {} vCPUs / {} bytes, state {} vCPUs / {} MiB with {} vCPU states",
                shape.vcpus,
                shape.mem_bytes,
                st.spec.vcpus,
                st.spec.mem_mib,
                st.vcpus.len()
            )));
        }
        let (caps, vm, mut pre_vcpus, msrs, reservation) = match shell {
            Some(s) => {
                if s.vcpus != st.spec.vcpus || s.mem_bytes != mem_bytes {
                    return Err(PersistError::Inconsistent(format!(
                        "the shell is for {} vCPUs / {} bytes, the snapshot {} vCPUs / {} bytes",
                        s.vcpus, s.mem_bytes, st.spec.vcpus, mem_bytes
                    )));
                }
                (s.caps, s.vm, Some(s.vcpu_fds), s.msrs, Some(s.reservation))
            }
            None => {
                let (kvm, caps, vm) = kvm_vm(st.spec.vcpus)?;
                let msrs = state::msr_list(&kvm).map_err(VmError::from)?;
                (caps, vm, None, msrs, None)
            }
        };
        if st.arch.pit.is_some() && !caps.pit2 {
            return Err(PersistError::Inconsistent(
                "the snapshot has a PIT and this host's KVM has none".into(),
            ));
        }

        phase("KVM VM created");
        let registered = reservation.is_some();
        let backing = match opts.backend {
            MemoryBackend::Mmap => Backing::Mmap(match reservation {
                Some(r) => snapshot::mmap::map_private_in(
                    &stack,
                    mem_bytes,
                    snapshot::mmap::MapOptions::default(),
                    r,
                )?,
                None => snapshot::mmap::map_private(&stack, mem_bytes)?,
            }),
            MemoryBackend::Uffd => {
                let ws = if opts.prefetch {
                    WorkingSet::load(top)?
                } else {
                    None
                };
                let record = if ws.is_none() {
                    opts.record_working_set_for
                } else {
                    None
                };
                let uopts = UffdOptions {
                    prefetch: ws,
                    record_working_set_for: record,
                    populate_in_background: false,
                };
                Backing::Uffd(match reservation {
                    Some(r) => UffdRestore::start_in(stack, mem_bytes, uopts, r)?,
                    None => UffdRestore::start(stack, mem_bytes, uopts)?,
                })
            }
        };
        let ram = memory::from_backing(backing)?;
        phase("memory mapped");
        if !registered {
            memory::register(&vm, &ram.mem, true).map_err(VmError::from)?;
            phase("memory registered with KVM");
        }
        state::restore_vm(&vm, &st.arch).map_err(VmError::from)?;

        let exit = Arc::new(ExitSignal::default());
        let mut at = Attach::new(&vm, &ram.mem, new_manager()?, exit.clone());
        let serial_out = opts.serial.clone();
        let serial = at
            .attach_serial_with(|irq_evt| {
                let args = SerialRestoreArgs {
                    irq_evt,
                    out: serial_out,
                };
                Serial::restore(args, &st.serial)
                    .map_err(|e| AttachError::Restore("serial", Box::new(e)))
            })
            .map_err(VmError::from)?;
        let i8042 = at
            .attach_i8042_with(|evt| {
                I8042::restore(evt, &st.i8042)
                    .map_err(|e| AttachError::Restore("i8042", Box::new(e)))
            })
            .map_err(VmError::from)?;
        let mut spec = st.spec.clone();
        let virtio = restore_virtio(&mut at, &st, &mut spec, chain, &opts)?;
        let devices = DeviceHandles {
            serial,
            i8042,
            virtio,
        };
        let mailbox = match st.entry {
            EntryKind::Direct => {
                let m = at.attach_mailbox(st.spec.vcpus).map_err(VmError::from)?;
                m.resync(st.mailbox_ready)?;
                Some(m)
            }
            EntryKind::Linux => None,
        };
        phase("devices restored");
        let mut fds = Vec::with_capacity(st.vcpus.len());
        for (i, s) in st.vcpus.iter().enumerate() {
            let fd = match pre_vcpus
                .as_mut()
                .and_then(|v| (!v.is_empty()).then(|| v.remove(0)))
            {
                Some(fd) => fd,
                None => vm
                    .create_vcpu(i as u64)
                    .map_err(|e| VmError::KvmOp("create a vCPU", e))?,
            };
            state::restore_vcpu(&fd, i as u8, s).map_err(VmError::from)?;
            fds.push(fd);
        }
        phase("vCPUs restored");
        memory::reset_dirty(&vm, &ram.mem)?;
        let (event_loop, vcpus) = start_threads(at, fds, &exit)?;
        let msrs = Arc::new(msrs);
        phase("threads started");
        let instance_id = opts
            .instance_id
            .unwrap_or_else(crate::lineage::new_instance_id);
        Ok(Vm {
            vcpus,
            event_loop,
            mailbox,
            devices,
            exit,
            entry: st.entry,
            has_pit: st.arch.pit.is_some(),
            msrs,
            lineage: crate::lineage::Lineage::restored(instance_id, chain, leases),
            last_pause: Duration::ZERO,
            run: VmRunState::Created,
            vm,
            ram,
            config: VmConfig::from_spec(spec, opts.serial),
        })
    }

    /// With the uffd backend, stores the pages the guest touched in its first
    /// moments after the restore as the snapshot's working set, which later
    /// restores prefetch. Returns whether one was saved.
    pub fn save_working_set(&self) -> Result<bool, PersistError> {
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

/// Loads and verifies `dir`'s chain and opens its layer stack.
pub(crate) fn load_for_restore(
    dir: &Path,
) -> Result<(Vec<Snapshot>, Arc<LayerStack>), PersistError> {
    let chain = Snapshot::load_chain(dir)?;
    let stack = Arc::new(LayerStack::open(&chain)?);
    Ok((chain, stack))
}

static TOP_SEQ: AtomicU64 = AtomicU64::new(0);

fn restore_virtio(
    at: &mut Attach<'_>,
    st: &VmState,
    spec: &mut VmSpec,
    chain: &[Snapshot],
    opts: &RestoreOptions,
) -> Result<Vec<VirtioHandle>, PersistError> {
    let mut out = Vec::with_capacity(st.virtio.len());
    for slot in &st.virtio {
        let t = &slot.transport;
        let restore_t = |what: &'static str| {
            move |mem: &devices::virtio::GuestMemoryMmap,
                  d: Arc<Mutex<dyn devices::virtio::VirtioDevice>>| {
                let args = MmioRestoreArgs {
                    mem: mem.clone(),
                    device: d,
                };
                MmioTransport::restore(args, t).map_err(|e| AttachError::Restore(what, Box::new(e)))
            }
        };
        let h = match &slot.dev {
            DevState::Block { disk: index, state } => {
                let index = *index;
                let cfg = spec.disks.get(index).cloned().ok_or_else(|| {
                    PersistError::Inconsistent(format!("block device names disk {index}"))
                })?;
                let disk = if cfg.read_only {
                    BlockDisk::Image(cfg.path.clone())
                } else {
                    let name = disk_layer_name(index);
                    let layers: Vec<LayerFiles> = chain
                        .iter()
                        .filter(|s| s.disk_layer(&name).is_some())
                        .map(|s| {
                            LayerFiles::mapped(
                                s.dir().join(format!("{name}.data")),
                                s.dir().join(format!("{name}.map")),
                            )
                        })
                        .collect();
                    let top = opts.scratch_dir.join(format!(
                        "sprout-disk-{}-{}-{}",
                        std::process::id(),
                        TOP_SEQ.fetch_add(1, Ordering::Relaxed),
                        name
                    ));
                    let disk = LayeredDisk::create(layers, &top, state.capacity_bytes).map_err(
                        |source| PersistError::DiskLayer {
                            disk: index,
                            source,
                        },
                    )?;
                    // The restored VM writes to a private top, not the original file.
                    spec.disks[index].path = top;
                    BlockDisk::Layered(Arc::new(disk))
                };
                let args = BlockRestoreArgs {
                    disk,
                    read_only: cfg.read_only,
                    id: cfg.id.clone(),
                };
                let blk = Block::restore(args, state)?;
                let dev = Arc::new(Mutex::new(blk));
                let transport = at
                    .attach_virtio("virtio-blk", dev.clone(), restore_t("virtio-blk"))
                    .map_err(VmError::from)?;
                VirtioHandle {
                    transport,
                    dev: VirtioDev::Block(dev),
                }
            }
            DevState::Vsock(s) => {
                let uds = opts.vsock_uds.clone().ok_or(PersistError::NeedVsockPath)?;
                if let Some(v) = spec.vsock.as_mut() {
                    v.uds_path = uds.clone();
                }
                let dev = Arc::new(Mutex::new(Vsock::restore(uds, s)?));
                let transport = at
                    .attach_virtio("virtio-vsock", dev.clone(), restore_t("virtio-vsock"))
                    .map_err(VmError::from)?;
                VirtioHandle {
                    transport,
                    dev: VirtioDev::Vsock(dev),
                }
            }
            DevState::Rng(s) => {
                let dev = Arc::new(Mutex::new(Rng::restore((), s)?));
                let transport = at
                    .attach_virtio("virtio-rng", dev.clone(), restore_t("virtio-rng"))
                    .map_err(VmError::from)?;
                VirtioHandle {
                    transport,
                    dev: VirtioDev::Rng(dev),
                }
            }
        };
        out.push(h);
    }
    Ok(out)
}
