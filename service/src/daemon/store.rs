//! Snapshots on disk, and the worker work behind the rest states: writing a
//! snapshot of a sandbox's VM, restoring one into a fresh worker, and
//! flattening a snapshot's disk layers into one plain disk (for a cold boot
//! from a snapshot's disk: a reboot, or a wake whose memory cannot be
//! restored).
//!
//! Each snapshot is `<data dir>/snapshots/<tenant>/<sandbox id>/<snapshot
//! id>/s` ([`snapshot_home`]; sproutd's own, a template's, are under
//! `_sproutd/_/`), a directory as the `snapshot` crate writes it (a manifest,
//! the VM state, a memory layer and a disk layer per writable disk, all
//! checksummed); a diff names its parent's directory. The object store's
//! keys have the same layout. (Snapshots written before this layout are
//! `snapshots/<snapshot id>/s`; the registry records each one's directory,
//! so they stay where they are.) A jailed worker writes one through a bind mount of
//! `<snapshot id>/` that sproutd makes for it, owned by the jail uid for
//! the write; once written, sproutd takes every file back (root's, not
//! writable by the jail uid), checks the snapshot before the API reports it
//! (`Snapshot::load_written`: all but its data files' bytes, which are taken
//! at the checksums the worker wrote; docs/snapshot-format.md, "Loading"),
//! and seals it (`snapshot::format::seal`): a restore in another process
//! then checks the files' versions instead of hashing them. A restore
//! exposes every snapshot of the chain read-only into the new worker's
//! jail, at the same paths.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use devices::virtio::block::{LayerFiles, LayerKind, LayeredDisk};
use sprout_worker::protocol::{Backend, Request, Response, RestoreSpec, Shape};
use uuid::Uuid;

use super::error::chain;
use super::pool::{settle, Pool, Ready};
use super::registry::Sandbox;
use super::supervisor::{
    give, BootError, Booted, Supervisor, CONSOLE_LOG, CONTROL_SOCK, DISK_BASE, VM_SUBDIR,
    WORKER_LOG,
};

/// In `<data dir>`: the snapshots.
pub const SNAPSHOTS_DIR: &str = "snapshots";
/// In `<snapshots>/<id>/`: the snapshot directory itself.
pub const SNAPSHOT_SUBDIR: &str = "s";

/// The two path components naming who a snapshot belongs to, here and in
/// the object store: its tenant (`_sproutd` for sproutd's own, a
/// template's; no tenant name starts with `_`) and its sandbox (`_` for
/// none).
pub fn owner_parts(tenant: &str, vm: Option<Uuid>) -> (String, String) {
    let t = if tenant.is_empty() {
        "_sproutd".to_owned()
    } else {
        tenant.to_owned()
    };
    (t, vm.map_or_else(|| "_".to_owned(), |v| v.to_string()))
}

/// The directory of snapshot `id` of `tenant`'s sandbox `vm` under
/// `snapshots` (the snapshot itself is its [`SNAPSHOT_SUBDIR`]).
pub fn snapshot_home(snapshots: &Path, tenant: &str, vm: Option<Uuid>, id: Uuid) -> PathBuf {
    let (t, v) = owner_parts(tenant, vm);
    snapshots.join(t).join(v).join(id.to_string())
}

/// A snapshot just written: where, and its size on disk.
pub struct Written {
    pub dir: PathBuf,
    pub size_bytes: u64,
}

impl Supervisor {
    /// Has the worker of `s` write a snapshot of its VM (a diff on its
    /// lineage's parent when `diff`), then verifies it. A running VM is
    /// paused for the capture and runs on; a paused one stays paused. The
    /// snapshot is filed under `owner` (tenant, sandbox): `s`'s own, or
    /// none for sproutd's (a template's).
    pub fn snapshot(
        &self,
        s: &Sandbox,
        owner: (&str, Option<Uuid>),
        id: Uuid,
        diff: bool,
    ) -> Result<Written, String> {
        let sock = s
            .worker_socket
            .clone()
            .ok_or_else(|| "The sandbox has no worker".to_owned())?;
        let base = snapshot_home(self.snapshots_dir(), owner.0, owner.1, id);
        make_home(&base)?;
        let r = self.snapshot_into(&sock, &base, diff);
        if r.is_err() {
            let _ = std::fs::remove_dir_all(&base);
        }
        r
    }

    fn snapshot_into(&self, sock: &Path, base: &Path, diff: bool) -> Result<Written, String> {
        let base = base
            .canonicalize()
            .map_err(|e| format!("Cannot resolve {}: {e}", base.display()))?;
        let jail = self.jail_of(sock);
        if let (Some(j), Some(o)) = (&jail, &self.cmd.jail) {
            give(&base, o.uid, o.gid)?;
            j.expose(&base, false).map_err(|e| {
                format!(
                    "Cannot expose {} to the worker's jail: {}",
                    base.display(),
                    chain(&e)
                )
            })?;
        }
        let dir = base.join(SNAPSHOT_SUBDIR);
        let t = std::time::Instant::now();
        let mut c = sprout_worker::Client::connect(sock)
            .map_err(|e| format!("The sandbox's worker does not answer: {}", chain(&e)))?;
        c.snapshot(&dir, diff)
            .map_err(|e| format!("The worker could not write the snapshot: {}", chain(&e)))?;
        let written = t.elapsed();
        if jail.is_some() {
            // Root's from now on: the worker may read it, never change it.
            take_back(&base).map_err(|e| format!("Cannot take back {}: {e}", base.display()))?;
        }
        let taken = t.elapsed();
        // Checked in full but for the data files' bytes, which are taken at
        // the checksums the worker computed as it wrote them: a worker that
        // lies about them could as well have written other data with
        // matching ones, so hashing them again here protects nothing the
        // seal does not (a restore in any worker, and a sproutd with
        // unjailed workers, take the writer's seal as it is). The manifest,
        // the state and the page maps are read and checked, each data file's
        // presence and size too.
        let snap = snapshot::format::Snapshot::load_written(&dir).map_err(|e| {
            format!(
                "The snapshot written to {} does not verify: {}",
                dir.display(),
                chain(&e)
            )
        })?;
        let checked = t.elapsed();
        // Root's seal: restores in other processes check its file versions
        // instead of hashing the data (issue 13); a file changed after it
        // has a new ctime and is hashed.
        if let Err(e) = snapshot::format::seal::seal(&snap) {
            tracing::warn!("cannot seal {}: {}", dir.display(), chain(&e));
        }
        tracing::debug!(
            "snapshot {}: the worker wrote it in {} us, taken back by {}, checked by {}, sealed by {}",
            dir.display(),
            written.as_micros(),
            taken.as_micros(),
            checked.as_micros(),
            t.elapsed().as_micros()
        );
        Ok(Written {
            size_bytes: du(&dir),
            dir,
        })
    }

    /// Where the restore of the snapshot in `top` into sandbox `id` reads
    /// each image it was taken over: where the image is now (`current`)
    /// while it is that version, else the version kept when it was booted
    /// ([`super::pins`]). Returns the files to expose to the worker, and
    /// the images read elsewhere than the snapshot records. A version found
    /// nowhere is read where the image is now, for the restore to refuse,
    /// naming it and both versions (`image_changed`).
    fn place_images(
        &self,
        id: Uuid,
        top: &Path,
        current: Option<&PathBuf>,
    ) -> (Vec<PathBuf>, BTreeMap<usize, PathBuf>) {
        let recorded = match vmm::VmState::recorded_images(top) {
            Ok(r) => r,
            // Not readable: the restore says why.
            Err(_) => return (current.cloned().into_iter().collect(), BTreeMap::new()),
        };
        let current = current.map(PathBuf::as_path);
        let (mut expose, mut elsewhere) = (Vec::new(), BTreeMap::new());
        for img in recorded {
            // From before images were identified: where it is now, unchecked.
            let Some(version) = img.identity else {
                expose.extend(current.map(Path::to_owned));
                continue;
            };
            let at = match self.pins.find(version, current) {
                Some(at) => {
                    // Kept too when it is still where it was (made on
                    // another node, or swept): it may be rebuilt while this
                    // sandbox lives.
                    if Some(at.as_path()) == current && !self.pins.path_of(version).exists() {
                        if let Err(e) = self.pins.keep(&at) {
                            tracing::warn!(vm = %id, "cannot keep image {}: {e}", at.display());
                        }
                    }
                    at
                }
                // Over the image as it is now, whose restore is refused
                // naming it (the path recorded may be a build long gone).
                None => match current {
                    Some(c) => c.to_owned(),
                    None => continue,
                },
            };
            // As the worker sees it: exposed files are at their canonical paths.
            let seen = at.canonicalize().unwrap_or_else(|_| at.clone());
            if seen != img.path {
                elsewhere.insert(img.disk, seen);
            }
            expose.push(at);
        }
        if expose.is_empty() {
            expose.extend(current.map(Path::to_owned));
        }
        (expose, elsewhere)
    }

    /// Starts a worker for `s` and restores into it the snapshot whose
    /// chain is `dirs` (base first, the snapshot itself last); `read_only`
    /// are the files its VM reads but the snapshot does not hold (its base
    /// image). Returns once the VM runs; its vsock socket is the sandbox's
    /// `vm/vsock.sock`.
    pub fn restore(
        &self,
        s: &Sandbox,
        dirs: &[PathBuf],
        read_only: &[PathBuf],
        instance_id: u64,
        pool: Option<&Pool>,
    ) -> Result<Booted, BootError> {
        let top = dirs
            .last()
            .cloned()
            .ok_or_else(|| BootError::Failed("No snapshot to restore".into()))?;
        let t = std::time::Instant::now();
        let (dir, rw) = self.make_dirs(s.id).map_err(BootError::Failed)?;
        let vsock = rw.join("vsock.sock");
        // A previous worker's socket file, if it left one.
        let _ = std::fs::remove_file(&vsock);
        let sock = dir.join(CONTROL_SOCK);
        let console = dir.join(CONSOLE_LOG);
        let log = dir.join(WORKER_LOG);
        let shape = Shape {
            vcpus: s.cpus,
            mem_mib: u64::from(s.memory_mb),
        };
        // Taken only now: nothing above can fail with it in hand.
        let ready = pool.and_then(|p| p.take(shape));
        let (mut worker, ready_dir) = match ready {
            Some(Ready { worker, dir }) => (worker, Some(dir)),
            None => {
                let w = self
                    .cmd
                    .clone()
                    .log_to(&log)
                    .spawn(&sock, Some(shape), Some(&console))
                    .map_err(|e| {
                        BootError::Worker(format!(
                            "Cannot start a worker: {}{}",
                            chain(&e),
                            self.worker_log_tail(s.id)
                        ))
                    })?;
                (w, None)
            }
        };
        let got_worker = t.elapsed();
        let (read_only, images) = self.place_images(s.id, &top, read_only.first());
        let exposed = match &worker.jail {
            None => Ok(()),
            Some(j) => std::iter::once((rw.as_path(), false))
                .chain(dirs.iter().chain(&read_only).map(|d| (d.as_path(), true)))
                .try_for_each(|(p, ro)| j.expose(p, ro).map(|_| ()))
                .map_err(|e| format!("Cannot expose the snapshot to the jail: {}", chain(&e))),
        };
        let exposed_by = t.elapsed();
        let restored = exposed.and_then(|()| {
            let spec = RestoreSpec {
                dir: top.clone(),
                backend: Backend::Mmap,
                vsock_uds: Some(vsock.clone()),
                instance_id: Some(instance_id),
                prefetch: false,
                // A snapshot with no network device ignores it.
                net: self.net_config(s.id),
            };
            let req = if images.is_empty() {
                Request::Restore(spec)
            } else {
                Request::RestoreOver { spec, images }
            };
            let r = match worker.client.call(&req) {
                Ok(Response::Ok) => {
                    tracing::debug!(
                        vm = %s.id,
                        "restore: a worker ({}) by {} us, the snapshot exposed by {}, restored by {}",
                        if ready_dir.is_some() { "ready" } else { "started" },
                        got_worker.as_micros(),
                        exposed_by.as_micros(),
                        t.elapsed().as_micros()
                    );
                    worker.client.describe()
                }
                Ok(_) => Err(sprout_worker::ClientError::Unexpected("restore", "answer")),
                Err(e) => Err(e),
            };
            r.map_err(|e| {
                format!(
                    "The worker could not restore {}: {}",
                    top.display(),
                    chain(&e)
                )
            })
        });
        // A ready worker's socket, console and log move into the
        // sandbox's directory (its disk top is made by now).
        let restored = settle(restored, &mut worker, ready_dir.as_deref(), &dir);
        match restored {
            Ok(d) => Ok(Booted {
                vsock: d.vsock_uds,
                guest: d.guest.unwrap_or(sprout_worker::protocol::GuestKind::Linux),
                worker,
            }),
            Err(e) => {
                let _ = worker.client.stop();
                let _ = worker.child.kill();
                if let Err(w) = worker.wait() {
                    tracing::warn!(vm = %s.id, "after a failed restore: {w}");
                }
                let tails = match &ready_dir {
                    Some(rd) => {
                        let t = self.tails_in(rd);
                        let _ = std::fs::remove_dir_all(rd);
                        t
                    }
                    None => self.tails(s.id),
                };
                Err(BootError::Failed(format!("{e}{tails}")))
            }
        }
    }

    /// Writes the writable disk of the snapshot `top` (its layers and its
    /// chain's, flattened) as sandbox `id`'s plain disk (replaced, and no
    /// longer a top over a base), the jail uid's when workers are jailed:
    /// what a cold boot from that snapshot's disk boots with.
    pub fn flatten_disk(&self, top: &Path, id: Uuid) -> Result<(), String> {
        let dst = &self.disk_path(id);
        let snaps = snapshot::format::Snapshot::load_chain(top)
            .map_err(|e| format!("Cannot load {}: {}", top.display(), chain(&e)))?;
        let last = snaps.last().ok_or("An empty snapshot chain")?;
        let [layer] = last.manifest().disk_layers.as_slice() else {
            return Err(format!(
                "Snapshot {} has {} writable disks, not one",
                top.display(),
                last.manifest().disk_layers.len()
            ));
        };
        let name = layer.name.clone();
        let mut layers = Vec::new();
        let mut size = 0;
        for s in &snaps {
            let Some(d) = s.disk_layer(&name) else {
                continue;
            };
            let [data, map] = d.files.as_slice() else {
                return Err(format!(
                    "Disk layer {name} of {} is not data + map",
                    s.dir().display()
                ));
            };
            size = std::fs::metadata(s.file_path(data))
                .map_err(|e| format!("Cannot read {}: {e}", s.file_path(data).display()))?
                .len();
            layers.push(LayerFiles::mapped(s.file_path(data), s.file_path(map)));
        }
        let tmp = |ext: &str| dst.with_extension(ext);
        let (scratch, out, out_map) = (tmp("flat-top"), tmp("flat"), tmp("flat-map"));
        for p in [&scratch, &out, &out_map] {
            let _ = std::fs::remove_file(p);
        }
        let r = (|| {
            let disk = LayeredDisk::create(layers, &scratch, size)
                .map_err(|e| format!("Cannot open the disk's layers: {}", chain(&e)))?;
            disk.write_layer(&out, &out_map, LayerKind::Full)
                .map_err(|e| format!("Cannot write the flat disk: {}", chain(&e)))?;
            drop(disk);
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&out)
                .map_err(|e| format!("Cannot open {}: {e}", out.display()))?;
            f.set_len(size)
                .and_then(|()| f.sync_all())
                .map_err(|e| format!("Cannot size {}: {e}", out.display()))?;
            if let Some(o) = &self.cmd.jail {
                give(&out, o.uid, o.gid)?;
            }
            // The old disk's base goes first: a whole image over it would
            // read the base through its holes. (Between the two steps the
            // old disk, which this replaces, is a top without its base.)
            let base = self.disk_base_path(id);
            match std::fs::remove_file(&base) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(format!("Cannot remove {}: {e}", base.display()))
                }
                _ => {}
            }
            std::fs::rename(&out, dst)
                .map_err(|e| format!("Cannot move the flat disk to {}: {e}", dst.display()))
        })();
        for p in [&scratch, &out, &out_map] {
            let _ = std::fs::remove_file(p);
        }
        r
    }

    /// The writable disk of a booted sandbox (`vm/disk.ext4`).
    pub fn disk_path(&self, id: Uuid) -> PathBuf {
        self.vm_dir(id).join(VM_SUBDIR).join("disk.ext4")
    }

    /// The template its disk is a top over, while it is one.
    pub fn disk_base_path(&self, id: Uuid) -> PathBuf {
        self.vm_dir(id).join(DISK_BASE)
    }

    /// Removes a snapshot's files (`dir` is its `s`; its parent, the
    /// snapshot's own directory, goes with it, and so do its sandbox's and
    /// tenant's directories if that leaves them empty).
    pub fn remove_snapshot(&self, dir: &Path) {
        let root = self.snapshots_dir();
        let base = dir.parent().filter(|b| b.starts_with(root) && *b != root);
        let Some(base) = base else {
            tracing::warn!("not removing {}: not a snapshot directory", dir.display());
            return;
        };
        match std::fs::remove_dir_all(base) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!("cannot remove {}: {e}", base.display()),
        }
        remove_empty_parents(root, base);
    }
}

/// Creates a snapshot's directory and its owners' above it. Another
/// snapshot's removal may take an emptied owner's directory away between
/// the two: that is tried again.
pub(super) fn make_home(base: &Path) -> Result<(), String> {
    let mut tries = 0;
    loop {
        match std::fs::create_dir_all(base) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && tries < 5 => tries += 1,
            Err(e) => return Err(format!("Cannot create {}: {e}", base.display())),
        }
    }
}

/// Removes the directories between `root` and `gone` (exclusive) that are
/// empty, deepest first: a sandbox's and a tenant's snapshot directories
/// once they hold nothing.
pub fn remove_empty_parents(root: &Path, gone: &Path) {
    let mut d = gone.parent();
    while let Some(p) = d.filter(|p| p.starts_with(root) && *p != root) {
        // Fails, and stops, at the first one that still holds something.
        if std::fs::remove_dir(p).is_err() {
            return;
        }
        d = p.parent();
    }
}

/// Makes everything under `dir` (what a jailed worker just wrote) root's:
/// directories 0755, files 0644; drops the worker's seal and anything not a
/// file or directory.
fn take_back(dir: &Path) -> std::io::Result<()> {
    let root = Some(rustix::fs::Uid::ROOT);
    let group = Some(rustix::fs::Gid::ROOT);
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        rustix::fs::chown(&d, root, group)?;
        rustix::fs::chmod(&d, rustix::fs::Mode::from_raw_mode(0o755))?;
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let t = e.file_type()?;
            if t.is_dir() {
                todo.push(e.path());
            } else if t.is_file() && e.file_name() == snapshot::format::seal::SEAL_FILE {
                // The worker's own seal: its versions are stale once the
                // files are root's (a chown is a new ctime), and a copy of
                // it owned by root would be trusted; sproutd seals the
                // snapshot itself once it is checked.
                std::fs::remove_file(e.path())?;
            } else if t.is_file() {
                rustix::fs::chown(e.path(), root, group)?;
                rustix::fs::chmod(e.path(), rustix::fs::Mode::from_raw_mode(0o644))?;
            } else {
                // A worker has no business leaving links or sockets here.
                std::fs::remove_file(e.path())?;
            }
        }
    }
    Ok(())
}

/// Bytes `dir`'s files take on disk (sparse files count what they hold).
fn du(dir: &Path) -> u64 {
    let mut n = 0;
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => todo.push(e.path()),
                Ok(m) => n += m.blocks() * 512,
                Err(_) => {}
            }
        }
    }
    n
}
