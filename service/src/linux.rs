//! `sprout vm run` for Linux guests: the cached guest kernel, a root image
//! (`test`, `default` or a path), a private writable disk, vsock to the agent,
//! and with `--exec` one command run through the agent.
//!
//! Files (see docs/guest.md): `${SPROUT_CACHE:-$HOME/.cache/sprout}/vmlinux`
//! (guest/build-kernel.sh), `.../images/{test,default}.ext4` (read-only base
//! images) and `.../images/scratch.ext4` (the writable-disk template: a sparse,
//! pre-formatted ext4 copied hole by hole for each VM), all built by
//! guest/build-images.sh.
//!
//! The guest's disks: `/dev/vda` the base image (read-only), `/dev/vdb` the
//! writable disk; the image's `/sbin/sprout-init` joins them with overlayfs and
//! execs the agent as PID 1, which listens on vsock port 1024.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::agent::{self, AgentError, Transfer};
use vmm::vcpu::ExitSignal;
use vmm::{ConsoleBuffer, DiskConfig, ExitReason, SerialOutput, Vm, VmConfig, VsockConfig};

/// The kernel command line of a Linux guest before the user's additions and
/// the VMM's virtio-mmio entries. `RUST_LOG` reaches the agent as an
/// environment variable (the kernel hands unknown `key=value` words to init).
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 quiet reboot=k panic=-1 pci=off \
     root=/dev/vda ro rootfstype=ext4 init=/sbin/sprout-init RUST_LOG=warn";
/// What the `vm` runtime adds to the command line: sprout-init execs the
/// image's own init (systemd) instead of the agent, which that init starts
/// as a service.
pub const VM_RUNTIME_CMDLINE: &str = "sprout.init=/sbin/init";
/// The guest CID of the VM's vsock device.
pub const GUEST_CID: u64 = 3;
/// How long to wait for the agent unless `SPROUT_BOOT_TIMEOUT` (seconds) says otherwise.
const BOOT_TIMEOUT: Duration = Duration::from_secs(300);
const CONSOLE_CAP: usize = 64 * 1024;
/// How long `sprout vm exec` waits for a VM's socket to appear.
pub const SOCKET_WAIT: Duration = crate::control::SOCKET_WAIT;
/// How long a broken agent connection may precede the end of a rebooting VM.
const REBOOT_GRACE: Duration = Duration::from_secs(10);
const EXT4_MAGIC_OFFSET: u64 = 1024 + 0x38;
const EXT4_MAGIC: u16 = 0xef53;

#[derive(Debug, thiserror::Error)]
pub enum LinuxError {
    #[error("No guest kernel at {0}: build it with guest/build-kernel.sh, or pass --kernel PATH")]
    NoKernel(PathBuf),
    #[error("No {name} image at {path}: build it with guest/build-images.sh {name}, or pass --image PATH")]
    NoImage { name: String, path: PathBuf },
    #[error("Cannot use the OCI image")]
    Oci(#[source] crate::oci::OciError),
    #[error("{0} is not a kernel Sprout can boot: not an ELF64 x86_64 executable (use an uncompressed vmlinux, not a bzImage)")]
    NotElf(PathBuf),
    #[error("Image {0} does not exist or is not a file")]
    ImageMissing(PathBuf),
    #[error("{0} is not an ext4 image (no ext4 superblock)")]
    NotExt4(PathBuf),
    #[error("Cannot read {0}")]
    Read(PathBuf, #[source] std::io::Error),
    #[error("No writable-disk template at {0}: build it with guest/build-images.sh scratch")]
    NoTemplate(PathBuf),
    #[error("Cannot create the writable disk {0} from the template")]
    Disk(PathBuf, #[source] std::io::Error),
    #[error("Invalid VM configuration")]
    Config(#[from] vmm::ConfigError),
    #[error(transparent)]
    Probe(#[from] vmm::arch::probe::ProbeError),
    #[error("Cannot start the VM")]
    Vm(#[from] vmm::VmError),
    #[error("Cannot serve the control socket")]
    ApiSock(#[source] sprout_worker::server::ServerError),
    #[error("Cannot start the async runtime")]
    Runtime(#[source] std::io::Error),
    #[error("The agent did not answer within {0:?} of boot (last error: {1}); console:\n{2}")]
    AgentTimeout(Duration, String, String),
    #[error("The VM ended ({0}) before its agent answered; console:\n{1}")]
    EndedEarly(ExitReason, String),
    #[error("The command failed to run in the guest: {0}")]
    Exec(String),
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error("Cannot restore {0}")]
    Restore(PathBuf, #[source] vmm::RestoreError),
    #[error("No VM listens on {0} (the socket did not appear within 5 s)")]
    NoVm(PathBuf),
    #[error("--exec, --put and --get need a Linux guest with the agent; this snapshot is of the test guest")]
    NoAgent,
}

/// What `sprout vm run` asked for, for a Linux guest.
#[derive(Clone, Debug)]
pub struct LinuxRun {
    /// An uncompressed ELF vmlinux; the cached guest kernel if `None`.
    pub kernel: Option<PathBuf>,
    /// `test`, `default` or a path to an ext4 base image; `default` if `None`.
    pub image: Option<String>,
    /// The writable disk: an ext4 image, created from the template if it does
    /// not exist (and kept). A private temporary disk if `None`.
    pub disk: Option<PathBuf>,
    /// Where `disk`'s base is kept (sproutd: beside the sandbox's files,
    /// where its worker cannot write). A new disk is then only a top over
    /// the template, which is hard-linked here: nothing is copied. An
    /// existing disk is a top over this file when it exists, else a whole
    /// image. `None` with `disk` set: a new disk is a whole copy of the
    /// template, the caller's to keep.
    pub disk_base: Option<PathBuf>,
    pub cpus: u8,
    pub memory_mib: u64,
    /// Appended to [`DEFAULT_CMDLINE`].
    pub cmdline: String,
    /// Files in, a command, files out, through the agent; without one the
    /// VM runs until it ends.
    pub job: Job,
    /// Where the VM's vsock device listens; a private temporary path if `None`.
    pub vsock_uds: Option<PathBuf>,
    /// Serve the control socket here (without `--exec`).
    pub api_sock: Option<PathBuf>,
}

impl LinuxRun {
    pub fn new() -> Self {
        Self {
            kernel: None,
            image: None,
            disk: None,
            disk_base: None,
            cpus: 1,
            memory_mib: 256,
            cmdline: String::new(),
            job: Job::default(),
            vsock_uds: None,
            api_sock: None,
        }
    }
}

impl Default for LinuxRun {
    fn default() -> Self {
        Self::new()
    }
}

/// Sprout's cache directory: `$SPROUT_CACHE`, else `$HOME/.cache/sprout`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("SPROUT_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache/sprout")
}

/// Whether `kernel` names Sprout's test guest (`testguest`, or an ELF carrying
/// the Sprout note) rather than a Linux kernel.
pub fn is_test_guest(kernel: &str) -> bool {
    kernel == "testguest" || elf_has_sprout_note(Path::new(kernel)).unwrap_or(false)
}

fn elf_has_sprout_note(path: &Path) -> std::io::Result<bool> {
    let mut f = File::open(path)?;
    let mut eh = [0u8; 64];
    f.read_exact(&mut eh)?;
    if &eh[0..4] != b"\x7fELF" || eh[4] != 2 {
        return Ok(false);
    }
    let phoff = u64::from_le_bytes(eh[32..40].try_into().unwrap_or_default());
    let (phentsize, phnum) = (
        u16::from_le_bytes([eh[54], eh[55]]),
        u16::from_le_bytes([eh[56], eh[57]]),
    );
    if phentsize != 56 || phnum > 128 {
        return Ok(false);
    }
    let mut ph = vec![0u8; 56 * usize::from(phnum)];
    f.seek(SeekFrom::Start(phoff))?;
    f.read_exact(&mut ph)?;
    for p in ph.chunks_exact(56) {
        if u32::from_le_bytes(p[0..4].try_into().unwrap_or_default()) != 4 {
            continue; // not PT_NOTE
        }
        let off = u64::from_le_bytes(p[8..16].try_into().unwrap_or_default());
        let size = u64::from_le_bytes(p[32..40].try_into().unwrap_or_default()).min(64 * 1024);
        let mut notes = vec![0u8; size as usize];
        f.seek(SeekFrom::Start(off))?;
        f.read_exact(&mut notes)?;
        if guest_abi::mailbox::find_note(&notes).is_some() {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Refuses a kernel file that is not an ELF64 x86_64 executable with program
/// headers (the VMM checks the rest when it loads it).
pub fn check_kernel(path: &Path) -> Result<(), LinuxError> {
    let mut eh = [0u8; 64];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut eh))
        .map_err(|_| LinuxError::NotElf(path.into()))?;
    let u16_at = |o: usize| u16::from_le_bytes([eh[o], eh[o + 1]]);
    let elf = &eh[0..4] == b"\x7fELF" && eh[4] == 2 && eh[5] == 1;
    if elf
        && u16_at(16) == 2
        && u16_at(18) == 62
        && u16_at(54) == 56
        && (1..=128).contains(&u16_at(56))
    {
        Ok(())
    } else {
        Err(LinuxError::NotElf(path.into()))
    }
}

/// The base image `--image` names.
pub fn resolve_image(image: Option<&str>) -> Result<PathBuf, LinuxError> {
    let name = image.unwrap_or("default");
    let path = match name {
        "test" | "default" => {
            let p = cache_dir().join("images").join(format!("{name}.ext4"));
            if !p.is_file() {
                return Err(LinuxError::NoImage {
                    name: name.into(),
                    path: p,
                });
            }
            p
        }
        r if crate::oci::is_oci(r) => {
            let opts = crate::oci::PullOptions::from_env(&cache_dir());
            let img = crate::oci::pull_blocking(r, &opts, &mut crate::oci::print_progress)
                .map_err(LinuxError::Oci)?;
            img.path
        }
        p => PathBuf::from(p),
    };
    if !path.is_file() {
        return Err(LinuxError::ImageMissing(path));
    }
    check_ext4(&path)?;
    Ok(path)
}

/// Refuses a file without an ext4 superblock.
pub fn check_ext4(path: &Path) -> Result<(), LinuxError> {
    let mut f = File::open(path).map_err(|e| LinuxError::Read(path.into(), e))?;
    let mut magic = [0u8; 2];
    let ok = f.seek(SeekFrom::Start(EXT4_MAGIC_OFFSET)).is_ok() && f.read_exact(&mut magic).is_ok();
    if ok && u16::from_le_bytes(magic) == EXT4_MAGIC {
        Ok(())
    } else {
        Err(LinuxError::NotExt4(path.into()))
    }
}

/// Copies the sparse `template` to `dst` data extent by data extent: the
/// holes stay holes, so a 16 GiB template costs its few MiB of metadata.
pub fn copy_sparse(template: &Path, dst: &Path) -> std::io::Result<()> {
    use rustix::fs::{seek, SeekFrom as At};
    let mut src = File::open(template)?;
    let len = src.metadata()?.len();
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dst)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut pos = 0u64;
    while pos < len {
        let data = match seek(&src, At::Data(pos)) {
            Ok(d) => d,
            Err(rustix::io::Errno::NXIO) => break, // only a hole is left
            Err(e) => return Err(e.into()),
        };
        let hole = seek(&src, At::Hole(data))?.min(len);
        src.seek(SeekFrom::Start(data))?;
        out.seek(SeekFrom::Start(data))?;
        let mut left = hole - data;
        while left > 0 {
            let n = buf.len().min(left as usize);
            src.read_exact(&mut buf[..n])?;
            out.write_all(&buf[..n])?;
            left -= n as u64;
        }
        pos = hole;
    }
    out.set_len(len)?;
    Ok(())
}

/// A private scratch directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> std::io::Result<Self> {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "sprout-vm-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&p)?;
        Ok(Self(p))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `sprout vm run` for a Linux guest; prints errors like the CLI does and
/// returns the process exit status: with `--exec`, the command's (128 + signal
/// if a signal killed it; 0 if the command rebooted the guest); without, 0 if
/// the guest rebooted or powered off, 1 otherwise.
pub fn main(run: LinuxRun) -> ExitCode {
    match self::run(run) {
        Ok(code) => ExitCode::from(code),
        Err(e) => report(&e),
    }
}

/// When this process's `main` began (see [`mark_process_start`]).
static PROCESS_START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

/// Notes the start of the process (call first thing in `main`), so that the
/// boot log can say how long the process took to its VM's start.
pub fn mark_process_start() {
    PROCESS_START.get_or_init(Instant::now);
}

/// [`main`] without the printing: the exit status, or why the VM could not run.
pub fn run(run: LinuxRun) -> Result<u8, LinuxError> {
    let t = Instant::now();
    let pre_us = PROCESS_START.get().map_or(0, |p| (t - *p).as_micros());
    let scratch = Scratch::new().map_err(|e| LinuxError::Disk(std::env::temp_dir(), e))?;
    let mut cfg = vm_config(&run, &scratch.0)?;
    let config_us = t.elapsed().as_micros();
    let uds = cfg
        .vsock
        .as_ref()
        .map(|v| v.uds_path.clone())
        .unwrap_or_else(|| scratch.0.join("vsock.sock"));
    let console = ConsoleBuffer::new(CONSOLE_CAP);
    // With --exec the console is kept for error reports (or shown on stderr
    // with SPROUT_CONSOLE=stderr); stdout is the command's.
    cfg.serial = console_output(&run.job, &console);

    let started = Instant::now();
    let vm = Vm::start(cfg)?;
    // tests/lab/bench-boot.sh reads this line: process start to the VM's
    // start, and the configuration's part of it (probe, writable disk).
    log::info!(
        "vm started {} after main: config {config_us} us, start {} us, \
         before the configuration {pre_us} us, {} minor page faults",
        PROCESS_START
            .get()
            .map_or("unknown time".into(), |p| format!(
                "{} us",
                p.elapsed().as_micros()
            )),
        started.elapsed().as_micros(),
        vmm::minor_faults()
    );
    let code = finish(
        vm,
        &uds,
        &run.job,
        run.api_sock.as_deref(),
        &console,
        false,
        started,
    )?;
    drop(scratch);
    Ok(code)
}

/// The VM configuration of a Linux guest for `run` (everything but its
/// console): the kernel, the base image read-only, the writable disk (created
/// from the template when missing; in `dir` unless `run.disk` names one),
/// vsock to the agent (`run.vsock_uds`, else in `dir`) and rng. Everything the
/// user gave is checked first, then whether this host's KVM can run Linux
/// guests at all. `sprout vm run` and `sproutd` both build their VMs here.
pub fn vm_config(run: &LinuxRun, dir: &Path) -> Result<VmConfig, LinuxError> {
    let kernel = match &run.kernel {
        Some(k) => k.clone(),
        None => {
            let k = cache_dir().join("vmlinux");
            if !k.is_file() {
                return Err(LinuxError::NoKernel(k));
            }
            k
        }
    };
    let mut cfg = VmConfig::new(&kernel);
    cfg.vcpus = run.cpus;
    cfg.mem_mib = run.memory_mib;
    cfg.validate()?;
    check_kernel(&kernel)?;
    let image = resolve_image(run.image.as_deref())?;
    if let Some(d) = run.disk.as_ref().filter(|d| d.exists()) {
        // A top over a base need not hold the superblock itself.
        check_ext4(existing_base(run).as_ref().unwrap_or(d))?;
    }
    let t = Instant::now();
    vmm::arch::probe::check_linux_guests_cached(&cache_dir())?;
    log::debug!(
        "KVM probe (or its kept verdict): {} us",
        t.elapsed().as_micros()
    );

    let template = cache_dir().join("images/scratch.ext4");
    let (disk, disk_base) = writable_disk(run, dir, &template)?;
    let uds = run
        .vsock_uds
        .clone()
        .unwrap_or_else(|| dir.join("vsock.sock"));
    cfg.cmdline = format!("{DEFAULT_CMDLINE} {}", run.cmdline.trim())
        .trim()
        .to_string();
    cfg.disks = vec![
        DiskConfig {
            path: image,
            read_only: true,
            id: "base".into(),
            base: None,
        },
        DiskConfig {
            path: disk,
            read_only: false,
            id: "disk".into(),
            base: disk_base,
        },
    ];
    cfg.vsock = Some(VsockConfig {
        guest_cid: GUEST_CID,
        uds_path: uds,
    });
    cfg.rng = true;
    Ok(cfg)
}

/// `run`'s kept base, when its disk exists and has one.
fn existing_base(run: &LinuxRun) -> Option<PathBuf> {
    run.disk_base.clone().filter(|b| b.exists())
}

/// The writable disk of `run` (made in `dir` when it names none, from
/// `template`) and its base. An existing disk is used as it is, over its kept base if it has
/// one. A new disk is an empty sparse top the template's size over the
/// template, so nothing is copied before the VM starts: over the template's
/// build itself for a private temporary disk (a build is never rewritten,
/// only replaced), else over a hard link to it at `run.disk_base`, which
/// outlives a rebuilt or removed cache. The template is copied whole
/// instead for a disk the caller names with no place for a base, and where
/// a top cannot be trusted or the link cannot be made (another file system).
fn writable_disk(
    run: &LinuxRun,
    dir: &Path,
    template: &Path,
) -> Result<(PathBuf, Option<PathBuf>), LinuxError> {
    if let Some(d) = run.disk.as_ref().filter(|d| d.exists()) {
        return Ok((d.clone(), existing_base(run)));
    }
    let dst = run.disk.clone().unwrap_or_else(|| dir.join("disk.ext4"));
    if !template.is_file() {
        return Err(LinuxError::NoTemplate(template.to_owned()));
    }
    let t = Instant::now();
    let disk_err = |e| LinuxError::Disk(dst.clone(), e);
    let template = template.canonicalize().map_err(disk_err)?;
    let parent = dst.parent().unwrap_or(Path::new("."));
    let base = match (&run.disk, &run.disk_base) {
        _ if !keeps_written_zeros(parent) => None,
        (Some(_), None) => None,
        (None, _) => Some(template.clone()),
        (Some(_), Some(b)) => {
            let _ = std::fs::remove_file(b);
            match std::fs::hard_link(&template, b) {
                Ok(()) => Some(b.clone()),
                Err(e) => {
                    log::debug!(
                        "cannot link the disk template to {} ({e}): copying it",
                        b.display()
                    );
                    None
                }
            }
        }
    };
    match &base {
        Some(_) => {
            let len = std::fs::metadata(&template).map_err(disk_err)?.len();
            let top = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&dst)
                .map_err(disk_err)?;
            top.set_len(len).map_err(disk_err)?;
            log::debug!(
                "writable disk: an empty top over the template: {} us",
                t.elapsed().as_micros()
            );
        }
        None => {
            copy_sparse(&template, &dst).map_err(disk_err)?;
            log::debug!(
                "writable disk copied from the template: {} us",
                t.elapsed().as_micros()
            );
        }
    }
    Ok((dst, base))
}

/// Whether files in `dir` keep written blocks as data, which a top over a
/// base relies on ([`devices::virtio::block::LayeredDisk::open_file_over`]):
/// not on ZFS, which may store a block of zeros as a hole.
fn keeps_written_zeros(dir: &Path) -> bool {
    const ZFS_SUPER_MAGIC: u64 = 0x2fc1_2fc1;
    // f_type's width differs between targets; the magic fits in 32 bits.
    rustix::fs::statfs(dir).is_ok_and(|s| s.f_type as u64 & 0xffff_ffff != ZFS_SUPER_MAGIC)
}

/// Where the guest console goes: the terminal without a job; with one it is
/// kept for error reports (or shown on stderr with `SPROUT_CONSOLE=stderr`),
/// as stdout is the command's.
fn console_output(job: &Job, console: &ConsoleBuffer) -> SerialOutput {
    if job.is_empty() {
        return SerialOutput::Stdout;
    }
    if std::env::var("SPROUT_CONSOLE").as_deref() == Ok("stderr") {
        use std::os::fd::AsFd;
        if let Ok(fd) = std::io::stderr().as_fd().try_clone_to_owned() {
            return SerialOutput::File(Arc::new(Mutex::new(File::from(fd))));
        }
    }
    SerialOutput::Buffer(console.clone())
}

/// Runs `job` in the started or restored Linux VM `vm` and stops it, or
/// without a job serves it (and its control socket) until it ends. `refresh`:
/// the VM was restored, so its guest is re-identified first.
fn finish(
    vm: Vm,
    uds: &Path,
    job: &Job,
    api_sock: Option<&Path>,
    console: &ConsoleBuffer,
    refresh: bool,
    started: Instant,
) -> Result<u8, LinuxError> {
    let exit = vm.exit_signal();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(LinuxError::Runtime)?;
    let id = refresh.then(|| vm.instance_id());
    if !job.is_empty() {
        let r = rt.block_on(run_job(uds, job, &exit, console, id, started));
        if r.is_ok() {
            save_working_set(&vm);
        }
        let reason = vm.stop();
        log::debug!("VM stopped: {reason}");
        return r;
    }
    if id.is_some() {
        // Before anyone else reaches the guest through the control socket.
        if let Err(e) = rt.block_on(run_job(uds, job, &exit, console, id, started)) {
            vm.stop();
            return Err(e);
        }
        save_working_set(&vm);
    }
    drop(rt);
    serve(vm, api_sock)
}

/// A uffd restore's first moments were recorded: keep them as the snapshot's
/// working set, which later restores prefetch (a no-op for mmap restores and
/// snapshots that have one).
fn save_working_set(vm: &Vm) {
    match vm.save_working_set() {
        Ok(true) => log::info!("saved the snapshot's working set for later restores"),
        Ok(false) => {}
        Err(e) => log::warn!("cannot save the snapshot's working set: {e}"),
    }
}

/// Runs `vm` until it ends, serving the worker protocol on `api_sock` if
/// given (see [`crate::control`]); 0 if the guest reset or powered off, else 1.
pub fn serve(vm: Vm, api_sock: Option<&Path>) -> Result<u8, LinuxError> {
    let reason = match api_sock {
        Some(p) => {
            let dir = p
                .parent()
                .filter(|d| !d.as_os_str().is_empty())
                .map_or_else(std::env::temp_dir, Path::to_path_buf);
            sprout_worker::serve_vm(vm, p, &dir).map_err(LinuxError::ApiSock)?
        }
        None => {
            let r = vm.wait(None).unwrap_or(ExitReason::Stopped);
            drop(vm);
            r
        }
    };
    eprintln!("sprout: VM ended: {reason}");
    Ok(u8::from(!reason.is_clean()))
}

/// What `sprout vm restore` asked for.
#[derive(Clone, Debug)]
pub struct Restore {
    pub dir: PathBuf,
    pub backend: vmm::MemoryBackend,
    /// Where the VM's vsock device listens; a private temporary path if `None`.
    pub vsock_uds: Option<PathBuf>,
    pub api_sock: Option<PathBuf>,
    /// Linux guests only: no identity refresh (the guest as it was, for
    /// replaying one state; see `sprout vm restore --keep-identity`).
    pub keep_identity: bool,
    /// Linux guests only.
    pub job: Job,
}

/// Restores a snapshot of either guest and runs it like `sprout vm run`. A
/// Linux guest's agent is sent a new identity (instance id, clock, entropy)
/// before anything else reaches it, unless `keep_identity`. The exit status
/// as [`run`]'s.
pub fn restore(r: Restore) -> Result<u8, LinuxError> {
    let scratch = Scratch::new().map_err(|e| LinuxError::Disk(std::env::temp_dir(), e))?;
    let uds = r
        .vsock_uds
        .clone()
        .unwrap_or_else(|| scratch.0.join("vsock.sock"));
    let console = ConsoleBuffer::new(CONSOLE_CAP);
    let mut o = vmm::RestoreOptions::new(r.backend);
    o.serial = console_output(&r.job, &console);
    o.vsock_uds = Some(uds.clone());
    o.scratch_dir = scratch.0.clone();
    let started = Instant::now();
    let vm = Vm::restore(&r.dir, o).map_err(|e| LinuxError::Restore(r.dir.clone(), e))?;
    log::info!("restored {} us after start", started.elapsed().as_micros());
    let code = if vm.mailbox().is_some() || vm.vsock_uds().is_none() {
        // The test guest (or a guest without an agent).
        if !r.job.is_empty() {
            vm.stop();
            return Err(LinuxError::NoAgent);
        }
        serve(vm, r.api_sock.as_deref())?
    } else {
        finish(
            vm,
            &uds,
            &r.job,
            r.api_sock.as_deref(),
            &console,
            !r.keep_identity,
            started,
        )?
    };
    drop(scratch);
    Ok(code)
}

/// Runs `job` through the agent of an already running Linux VM whose vsock
/// socket is `uds` (`sprout vm exec`). The socket may take a moment to appear
/// (a VM started in the background), the agent as long as a boot.
pub fn exec_in(uds: &Path, job: &Job) -> Result<u8, LinuxError> {
    let t = Instant::now();
    while !uds.exists() {
        if t.elapsed() > SOCKET_WAIT {
            return Err(LinuxError::NoVm(uds.to_owned()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(LinuxError::Runtime)?;
    // This process does not own the VM: nothing ends it from here.
    let exit = ExitSignal::default();
    rt.block_on(run_job(uds, job, &exit, &ConsoleBuffer::new(0), None, t))
}

/// Prints `e` with its causes as the CLI does; the failure exit status.
pub fn report(e: &LinuxError) -> ExitCode {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    eprintln!("sprout: error: {msg}");
    ExitCode::FAILURE
}

fn boot_timeout() -> Duration {
    std::env::var("SPROUT_BOOT_TIMEOUT")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(BOOT_TIMEOUT, Duration::from_secs)
}

/// What to do in the guest once its agent answers: files in, one command,
/// files out.
#[derive(Clone, Debug, Default)]
pub struct Job {
    /// Host files copied into the guest before the command.
    pub put: Vec<Transfer>,
    /// A shell command line (`/bin/sh -c`); its status is the job's.
    pub exec: Option<String>,
    /// Guest files copied to the host after the command.
    pub get: Vec<Transfer>,
}

impl Job {
    pub fn is_empty(&self) -> bool {
        self.put.is_empty() && self.exec.is_none() && self.get.is_empty()
    }
}

/// Waits for the agent (re-identifying the guest first if `refresh` names its
/// new instance id), then runs `job`; the command's exit status (0 without one).
async fn run_job(
    uds: &Path,
    job: &Job,
    exit: &ExitSignal,
    console: &ConsoleBuffer,
    refresh: Option<u64>,
    started: Instant,
) -> Result<u8, LinuxError> {
    let client = agent::client(uds);
    let limit = boot_timeout();
    let us = || started.elapsed().as_micros();
    let refresh = refresh.map(|instance_id| agent::Refresh {
        instance_id,
        hostname: None,
        machine_id: None,
    });
    match agent::wait_ready(&client, exit, limit, refresh.as_ref()).await {
        Ok((_, done)) => {
            // tests/lab/bench-boot.sh, bench-sandbox.sh and bench-peer.sh
            // read these lines. A restored guest's first answer is its
            // identity refresh's.
            log::info!("agent ready {} us after start", us());
            if let Some(done) = done {
                log::info!(
                    "identity refreshed {} us after start: host name {}",
                    us(),
                    done.hostname.as_deref().unwrap_or("?")
                );
            }
        }
        Err(AgentError::Ended(r)) => return Err(LinuxError::EndedEarly(r, console.text())),
        Err(AgentError::Timeout(l, e)) => {
            return Err(LinuxError::AgentTimeout(l, e, console.text()))
        }
        Err(e) => return Err(LinuxError::Agent(e)),
    }
    run_transfers(&client, &job.put, true).await?;
    let code = match &job.exec {
        None => 0,
        Some(cmd) => {
            let code = exec(&client, cmd, exit, console).await?;
            log::info!("command ended {} us after start", us());
            code
        }
    };
    run_transfers(&client, &job.get, false).await?;
    Ok(code)
}

async fn run_transfers(
    client: &guest_agent::client::Client,
    list: &[Transfer],
    put: bool,
) -> Result<(), LinuxError> {
    for t in list {
        let n = if put {
            agent::put(client, &t.from, &t.to).await?
        } else {
            agent::get(client, &t.from, &t.to).await?
        };
        log::info!("copied {} ({n} bytes) to {}", t.from, t.to);
    }
    Ok(())
}

/// Runs `cmd` with `/bin/sh -c`, streams its output and returns its exit status.
async fn exec(
    client: &guest_agent::client::Client,
    cmd: &str,
    exit: &ExitSignal,
    console: &ConsoleBuffer,
) -> Result<u8, LinuxError> {
    tokio::select! {
        r = agent::exec_streamed(client, cmd) => match r {
            // The connection breaks when the command reboots the guest, a
            // little before the VM ends: give it that moment.
            Err(e) => match tokio::time::timeout(REBOOT_GRACE, ended(exit)).await {
                Ok(r) if r.is_clean() => {
                    eprintln!("sprout: the guest ended the VM ({r}) while the command ran");
                    Ok(0)
                }
                _ => Err(LinuxError::Exec(e.to_string())),
            },
            Ok(code) => Ok(code),
        },
        r = ended(exit) => {
            if r.is_clean() {
                eprintln!("sprout: the guest ended the VM ({r}) while the command ran");
                Ok(0)
            } else {
                Err(LinuxError::Exec(format!("the VM failed ({r}); console:\n{}", console.text())))
            }
        }
    }
}

/// Resolves when the VM has ended.
async fn ended(exit: &ExitSignal) -> ExitReason {
    loop {
        if let Some(r) = exit.get() {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("sprout-linux-test-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d.join(name)
    }

    /// What each kind of caller gets as its writable disk: sproutd (a place
    /// for a base) an empty top over a hard link to the template, then the
    /// same again at its next boot; `sprout vm run --disk NEW` a whole
    /// copy; a private disk a top over the template's build itself; and a
    /// copy when the link cannot be made.
    #[test]
    fn a_new_disk_is_an_empty_top_over_the_template_or_else_a_copy() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let build = d.join("build");
        std::fs::create_dir(&build).unwrap();
        let mut f = File::create(build.join("scratch.ext4")).unwrap();
        f.set_len(1 << 30).unwrap();
        f.seek(SeekFrom::Start(EXT4_MAGIC_OFFSET)).unwrap();
        f.write_all(&EXT4_MAGIC.to_le_bytes()).unwrap();
        drop(f);
        let template = d.join("scratch.ext4");
        std::os::unix::fs::symlink(build.join("scratch.ext4"), &template).unwrap();
        let run = |disk: Option<PathBuf>, disk_base: Option<PathBuf>| LinuxRun {
            disk,
            disk_base,
            ..LinuxRun::new()
        };
        let blocks = |p: &Path| std::fs::metadata(p).unwrap().blocks();

        // sproutd: a top and a link; at the next boot, the same.
        let (disk, base) = (d.join("vm/disk.ext4"), d.join("disk-base.ext4"));
        std::fs::create_dir(d.join("vm")).unwrap();
        let r = run(Some(disk.clone()), Some(base.clone()));
        let (got, got_base) = writable_disk(&r, d, &template).unwrap();
        assert_eq!((&got, got_base.as_ref()), (&disk, Some(&base)));
        assert_eq!(std::fs::metadata(&disk).unwrap().len(), 1 << 30);
        assert_eq!(blocks(&disk), 0, "nothing copied");
        let ino = |p: &Path| std::fs::metadata(p).unwrap().ino();
        assert_eq!(ino(&base), ino(&build.join("scratch.ext4")), "a hard link");
        assert_eq!(
            writable_disk(&r, d, &template).unwrap(),
            (disk.clone(), Some(base.clone()))
        );
        // Without its base (flattened), the disk is a whole image.
        std::fs::remove_file(&base).unwrap();
        assert_eq!(writable_disk(&r, d, &template).unwrap(), (disk, None));

        // A disk the user names: theirs, a whole copy.
        let mine = d.join("mine.ext4");
        let (got, none) = writable_disk(&run(Some(mine.clone()), None), d, &template).unwrap();
        assert_eq!((got, none), (mine.clone(), None));
        assert!(blocks(&mine) > 0);
        check_ext4(&mine).unwrap();

        // A private disk: over the template's build itself.
        let (got, b) = writable_disk(&run(None, None), d, &template).unwrap();
        assert_eq!(got, d.join("disk.ext4"));
        assert_eq!(b, Some(build.join("scratch.ext4").canonicalize().unwrap()));

        // No link possible: a copy.
        let far = d.join("far.ext4");
        let r = run(Some(far.clone()), Some(d.join("no/such/dir/base.ext4")));
        assert_eq!(
            writable_disk(&r, d, &template).unwrap(),
            (far.clone(), None)
        );
        check_ext4(&far).unwrap();

        // No template: said so.
        let r = run(Some(d.join("x.ext4")), Some(d.join("xb.ext4")));
        assert!(matches!(
            writable_disk(&r, d, &d.join("missing.ext4")),
            Err(LinuxError::NoTemplate(_))
        ));
    }

    #[test]
    fn sparse_copy_keeps_data_and_holes() {
        let src = tmp("sparse-src");
        let dst = tmp("sparse-dst");
        let _ = std::fs::remove_file(&src);
        let _ = std::fs::remove_file(&dst);
        let mut f = File::create(&src).unwrap();
        f.set_len(1 << 30).unwrap();
        f.write_all(b"head").unwrap();
        f.seek(SeekFrom::Start(300 << 20)).unwrap();
        f.write_all(&[7u8; 10000]).unwrap();
        drop(f);
        copy_sparse(&src, &dst).unwrap();
        let a = std::fs::metadata(&dst).unwrap();
        assert_eq!(a.len(), 1 << 30);
        use std::os::unix::fs::MetadataExt;
        assert!(
            a.blocks() * 512 < 4 << 20,
            "copy is sparse: {} blocks",
            a.blocks()
        );
        let mut g = File::open(&dst).unwrap();
        let mut b = [0u8; 4];
        g.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"head");
        let mut c = vec![0u8; 10002];
        g.seek(SeekFrom::Start((300 << 20) - 1)).unwrap();
        g.read_exact(&mut c).unwrap();
        assert_eq!(c[0], 0);
        assert!(c[1..10001].iter().all(|&x| x == 7));
        assert_eq!(c[10001], 0);
        // Never overwrites.
        assert!(copy_sparse(&src, &dst).is_err());
        std::fs::remove_file(&src).unwrap();
        std::fs::remove_file(&dst).unwrap();
    }

    #[test]
    fn ext4_is_recognised_by_its_superblock() {
        let p = tmp("not-ext4");
        std::fs::write(&p, vec![0u8; 4096]).unwrap();
        assert!(matches!(check_ext4(&p), Err(LinuxError::NotExt4(_))));
        let mut b = vec![0u8; 4096];
        b[1080..1082].copy_from_slice(&EXT4_MAGIC.to_le_bytes());
        std::fs::write(&p, b).unwrap();
        check_ext4(&p).unwrap();
        std::fs::write(&p, b"short").unwrap();
        assert!(matches!(check_ext4(&p), Err(LinuxError::NotExt4(_))));
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn kernel_must_be_an_x86_64_elf_executable() {
        let p = tmp("kernel");
        let mut h = vec![0u8; 64];
        h[0..4].copy_from_slice(b"\x7fELF");
        h[4] = 2;
        h[5] = 1;
        h[16] = 2; // ET_EXEC
        h[18] = 62; // EM_X86_64
        h[54] = 56;
        h[56] = 3;
        std::fs::write(&p, &h).unwrap();
        check_kernel(&p).unwrap();
        for (at, bad) in [(0, 0u8), (4, 1), (16, 3), (18, 3), (56, 0)] {
            let mut b = h.clone();
            b[at] = bad;
            std::fs::write(&p, &b).unwrap();
            assert!(
                matches!(check_kernel(&p), Err(LinuxError::NotElf(_))),
                "byte {at}"
            );
        }
        std::fs::write(&p, b"MZ\x00bzImage").unwrap();
        let e = check_kernel(&p).unwrap_err().to_string();
        assert!(e.contains("not a kernel Sprout can boot"), "{e}");
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn test_guest_is_told_from_linux() {
        assert!(is_test_guest("testguest"));
        assert!(is_test_guest(testguest_build::TESTGUEST_PATH));
        assert!(!is_test_guest("/nonexistent/vmlinux"));
        assert!(!is_test_guest(
            std::env::current_exe().unwrap().to_str().unwrap()
        ));
    }

    #[test]
    fn cmdline_boots_the_overlay_init() {
        for w in [
            "console=ttyS0",
            "reboot=k",
            "panic=-1",
            "root=/dev/vda",
            "ro",
            "init=/sbin/sprout-init",
        ] {
            assert!(DEFAULT_CMDLINE.split_whitespace().any(|x| x == w), "{w}");
        }
    }
}
