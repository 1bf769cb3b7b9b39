//! The lab-hosted mode: `sproutd` on a host whose KVM cannot run Linux
//! guests (every machine this project is built on: a software KVM that
//! emulates guest supervisor code, docs/guest.md) starts itself inside the
//! emulated hardware-virtualization lab instead.
//!
//! The lab is tests/lab/build.sh's outer VM: QEMU in pure emulation with an
//! emulated AMD SVM CPU, Debian's cloud kernel, `kvm_amd nested=1`, and
//! `sprout` with the guest kernel and images. Booted with
//! `lab.service=sproutd` its init (tests/lab/init) runs `sprout daemon` on
//! port 7070 over a persistent data disk, `<data-dir>/lab/data.ext4`, which
//! holds the registry and every sandbox's files. QEMU's user-mode network
//! (restricted: the lab reaches nothing outside) forwards the address asked
//! for to that port, so the API is the same as on any host.
//!
//! This process stays in the foreground and watches the lab:
//! - the inner sproutd's log lines are passed on to stderr (`lab: …`); the
//!   console is kept in `<data-dir>/lab/console.log` (up to
//!   [`CONSOLE_LOG_CAP`] a run);
//! - the lab's init prints a heartbeat every 5 s; with none for [`STALL`]
//!   (a frozen emulated machine, see docs/architecture.md, issue 18), with
//!   the inner sproutd not answering `/v1/health` for [`UNHEALTHY`], or
//!   when QEMU ends by itself (its stderr is quoted), the lab is started
//!   again: the registry survives, the sandboxes that ran are marked
//!   `failed` by the next inner sproutd;
//! - a shared lock on `<lab>/.in-use` keeps tests/lab/build.sh from
//!   removing the lab while this runs;
//! - SIGINT or SIGTERM stop the inner sproutd and power the lab off (QEMU
//!   is killed if it takes longer than [`STOP_GRACE`]); if this process dies
//!   without that, QEMU gets SIGKILL from the kernel (`PR_SET_PDEATHSIG`).

use std::collections::VecDeque;
use std::io::Write as _;
use std::net::{SocketAddr, SocketAddrV4, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;

use super::DaemonError;

/// The port the inner sproutd listens on (tests/lab/init).
const INNER_PORT: u16 = 7070;
/// Host time without a heartbeat after which the lab counts as frozen.
const STALL: Duration = Duration::from_secs(300);
/// Host time the lab may take from QEMU's start to an answering sproutd.
const BOOT_LIMIT: Duration = Duration::from_secs(900);
/// Host time a stopping lab gets before QEMU is killed.
const STOP_GRACE: Duration = Duration::from_secs(60);
/// Size of a new data disk (a sparse file: only what is written takes space).
const DATA_DISK_GIB: u64 = 64;
/// Console lines kept to show when the lab fails.
const TAIL: usize = 40;
/// Most bytes of one run's console kept in `console.log`.
const CONSOLE_LOG_CAP: u64 = 64 << 20;
/// Host time the lab's sproutd may fail its health check, while the lab's
/// kernel still beats, before the lab counts as hung.
const UNHEALTHY: Duration = Duration::from_secs(300);
/// Restarts allowed before sproutd gives up (the count resets after an
/// hour of running).
const MAX_RESTARTS: u32 = 5;
/// The note `/v1/info` and the start-up line carry in this mode.
pub const EMULATED_NOTE: &str = "served from inside the emulated hardware-virtualization lab \
     (QEMU TCG with nested SVM): latencies there are emulated and not representative";

#[derive(Debug, thiserror::Error)]
pub enum LabError {
    #[error(
        "The emulated lab is not built at {0} (no {1}): run ./serve, or tests/lab/build.sh, \
         which build it"
    )]
    NotBuilt(PathBuf, &'static str),
    #[error(
        "qemu-system-x86_64 is missing, and the lab needs it: \
         apt-get install --no-install-recommends qemu-system-x86"
    )]
    NoQemu,
    #[error("The lab forwards only IPv4 addresses (QEMU's user-mode network): {0} is IPv6")]
    Ipv6(SocketAddr),
    #[error("Cannot listen on {0}")]
    Listen(SocketAddr, #[source] std::io::Error),
    #[error("Cannot make the lab's data disk {0}: {1}")]
    DataDisk(PathBuf, String),
    #[error("Cannot start QEMU")]
    Spawn(#[source] std::io::Error),
    #[error("The lab did not start: {0}\n--- the lab's console (last lines) ---\n{1}")]
    Boot(String, String),
    #[error("The lab failed {0} times; giving up (its console: {1})")]
    GaveUp(u32, PathBuf),
    #[error("Cannot write {0}")]
    File(PathBuf, #[source] std::io::Error),
    #[error("Cannot bring the tenants file {0} into the lab: {1}")]
    Tenants(PathBuf, String),
    #[error("The object store {0} cannot be reached from the lab: {1}")]
    Store(String, String),
    #[error("The registry {0} cannot be forwarded into the lab: {1}")]
    Registry(String, String),
}

/// What the lab needs, resolved before anything starts.
struct Config {
    lab: PathBuf,
    qemu: PathBuf,
    dir: PathBuf,
    disk: PathBuf,
    addr: SocketAddrV4,
    cpus: u8,
    memory_mib: u32,
    /// Arguments for the lab's sproutd (simple tokens: no spaces or commas).
    inner_args: Vec<String>,
    /// The tenants file, brought in at each boot (see [`config_drive`]).
    tenants: Option<PathBuf>,
    /// The object store's credentials for the lab's sproutd, when it has
    /// a mirror.
    s3_env: Option<String>,
    /// The host address the object store is on, forwarded to the lab's
    /// [`INNER_S3`].
    s3_host: Option<String>,
    /// Loopback registries of this host (their host part, their port),
    /// each reachable in the lab at the same address.
    registries: Vec<(String, u16)>,
}

/// The guest address whose connections QEMU forwards to the `i`th
/// registry of [`Config::registries`] (the lab's init listens on the
/// registry's port and passes each connection on to it).
fn inner_registry(i: usize, port: u16) -> String {
    format!("10.0.2.{}:{port}", 110 + i)
}

/// Most registries forwarded into the lab.
const MAX_LAB_REGISTRIES: usize = 16;

/// The host and port of a `--lab-registry`: a loopback registry, since the
/// lab's sproutd reaches it at the same address through its own loopback
/// (and plain HTTP is allowed for loopback registries only).
fn lab_registry(addr: &str) -> Result<(String, u16), LabError> {
    let bad = |why: &str| LabError::Registry(addr.to_owned(), why.to_owned());
    let (host, port) = addr
        .rsplit_once(':')
        .ok_or_else(|| bad("give it as 127.0.0.1:PORT or localhost:PORT"))?;
    let port: u16 = port
        .parse()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| bad("its port must be 1-65535"))?;
    let loopback = host == "localhost"
        || host
            .parse::<std::net::Ipv4Addr>()
            .is_ok_and(|ip| ip.is_loopback());
    if !loopback {
        return Err(bad(
            "only a registry on this host's loopback can be forwarded into the lab \
             (127.0.0.1:PORT or localhost:PORT)",
        ));
    }
    if port == INNER_PORT {
        return Err(bad("port 7070 is the lab's sproutd's own"));
    }
    Ok((host.to_owned(), port))
}

/// Where the lab's sproutd finds the object store: a guest address whose
/// connections QEMU forwards to the host's store (`guestfwd`).
const INNER_S3: &str = "10.0.2.100:9000";

/// The `HOST:PORT` of a plain-http store endpoint, which the lab can
/// forward to.
fn s3_host(endpoint: &str) -> Result<String, LabError> {
    let bad = |why: &str| LabError::Store(endpoint.to_owned(), why.to_owned());
    let rest = endpoint
        .strip_prefix("http://")
        .ok_or_else(|| bad("the lab forwards plain http:// endpoints only"))?;
    let host = rest.trim_end_matches('/');
    let ok = !host.is_empty()
        && !host.contains('/')
        && host
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0))
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b));
    if !ok {
        return Err(bad("give it as http://HOST:PORT"));
    }
    Ok(host.to_owned())
}

/// Where the lab's sproutd finds the tenants file (its init unpacks it
/// there from the third drive, [`tenants_drive`]).
const INNER_TENANTS: &str = "/run/sprout/tenants.toml";

/// The lab directory: `$SPROUT_LAB`, else `<cache>/lab` (tests/lab/build.sh).
pub fn lab_dir() -> PathBuf {
    match std::env::var_os("SPROUT_LAB").filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d),
        None => crate::linux::cache_dir().join("lab"),
    }
}

/// Half the host's RAM, within 2–16 GiB: QEMU maps it but the host gives
/// it pages only as the lab touches them.
fn default_memory_mib() -> u32 {
    let total_kib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .unwrap_or(8 << 20);
    (total_kib / 1024 / 2).clamp(2048, 16384) as u32
}

/// A shared lock on `<lab>/.in-use`.
fn hold_lab(lab: &Path) -> Result<std::fs::File, LabError> {
    let path = lab.join(".in-use");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(|e| LabError::File(path.clone(), e))?;
    rustix::fs::flock(&f, rustix::fs::FlockOperation::LockShared)
        .map_err(|e| LabError::File(path, e.into()))?;
    Ok(f)
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// An address to forward: the one asked for, or a free port for port 0.
/// It is checked (bound and let go) now, so a port in use is told before
/// a boot of minutes.
fn forward_addr(listen: SocketAddr) -> Result<SocketAddrV4, LabError> {
    let SocketAddr::V4(v4) = listen else {
        return Err(LabError::Ipv6(listen));
    };
    let l = TcpListener::bind(v4).map_err(|e| LabError::Listen(listen, e))?;
    let port = l
        .local_addr()
        .map_err(|e| LabError::Listen(listen, e))?
        .port();
    Ok(SocketAddrV4::new(*v4.ip(), port))
}

/// Makes the data disk once: an ext4 file system in a sparse file, made
/// under a temporary name so a half-made one is never used.
fn ensure_data_disk(disk: &Path) -> Result<(), LabError> {
    if disk.is_file() {
        return Ok(());
    }
    let err = |m: String| LabError::DataDisk(disk.to_owned(), m);
    let tmp = disk.with_extension("ext4.tmp");
    let f = std::fs::File::create(&tmp).map_err(|e| err(e.to_string()))?;
    f.set_len(DATA_DISK_GIB << 30)
        .map_err(|e| err(e.to_string()))?;
    drop(f);
    let out = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F", "-L", "sprout-data", "-m", "0"])
        .args(["-E", "lazy_itable_init=1,lazy_journal_init=1"])
        .arg(&tmp)
        .output()
        .map_err(|e| {
            err(format!(
                "cannot run mkfs.ext4 ({e}): apt-get install --no-install-recommends e2fsprogs"
            ))
        })?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(err(format!(
            "mkfs.ext4 failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    std::fs::rename(&tmp, disk).map_err(|e| err(e.to_string()))
}

/// The tenants file's bytes for the lab: `file` if it loads (kept as
/// `tenants.toml.good` in `dir`); if it does not, the last good one (and
/// the error told), so that a bad edit never stops the lab from coming
/// back.
fn lab_tenants(dir: &Path, file: &Path) -> Result<Vec<u8>, LabError> {
    let good = dir.join("tenants.toml.good");
    let err = |m: String| LabError::Tenants(file.to_owned(), m);
    let fresh = super::tenants::Tenants::load(file)
        .map_err(|e| super::error::chain(&e))
        .and_then(|_| std::fs::read(file).map_err(|e| e.to_string()));
    match fresh {
        Ok(b) if b.len() <= MAX_LAB_TENANTS => {
            std::fs::write(&good, &b).map_err(|e| err(e.to_string()))?;
            Ok(b)
        }
        Ok(b) => Err(err(format!(
            "it is {} bytes; the lab takes at most {MAX_LAB_TENANTS}",
            b.len()
        ))),
        Err(e) => match std::fs::read(&good) {
            Ok(b) => {
                eprintln!("sproutd: {e}; the lab keeps the tenants file it had");
                Ok(b)
            }
            Err(_) => Err(err(e)),
        },
    }
}

/// The drive that brings the lab's sproutd what is not on its command
/// line: a tar archive (ustar) that the lab's init unpacks into
/// `/run/sprout/`, with `tenants.toml` (see [`lab_tenants`]), `s3.env`
/// (the object store's credentials, sourced before sproutd starts) and
/// `registries` (a line `PORT GUEST-IP` per forwarded registry: the init
/// listens on the port and passes each connection to the guest address
/// QEMU forwards to the host's registry). Made before each boot; none if
/// there is nothing to bring.
fn config_drive(
    dir: &Path,
    tenants: Option<&Path>,
    s3_env: Option<&str>,
    registries: &[(String, u16)],
) -> Result<Option<PathBuf>, LabError> {
    let mut files: Vec<(&str, Vec<u8>)> = Vec::new();
    if let Some(t) = tenants {
        files.push(("tenants.toml", lab_tenants(dir, t)?));
    }
    if let Some(e) = s3_env {
        files.push(("s3.env", e.as_bytes().to_vec()));
    }
    if !registries.is_empty() {
        let mut lines = String::new();
        for (i, (_, port)) in registries.iter().enumerate() {
            let inner = inner_registry(i, *port);
            let ip = inner.rsplit_once(':').map_or("", |(ip, _)| ip);
            lines.push_str(&format!("{port} {ip}\n"));
        }
        files.push(("registries", lines.into_bytes()));
    }
    if files.is_empty() {
        return Ok(None);
    }
    let drive = dir.join("config.tar");
    let err = |e: std::io::Error| LabError::File(drive.clone(), e);
    let mut tar = Vec::new();
    for (name, data) in &files {
        tar.extend(ustar_entry(name, data));
    }
    tar.resize(tar.len() + 1024, 0);
    let tmp = dir.join("config.tar.tmp");
    std::fs::write(&tmp, &tar).map_err(err)?;
    std::fs::rename(&tmp, &drive).map_err(err)?;
    Ok(Some(drive))
}

/// The store's credentials as `s3.env` holds them: shell assignments,
/// each value single-quoted.
fn s3_env() -> String {
    let mut out = String::new();
    for k in ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"] {
        let v = std::env::var(k).unwrap_or_default().replace('\'', "'\\''");
        out.push_str(&format!("export {k}='{v}'\n"));
    }
    out
}

/// Most bytes of a tenants file served from the lab (it also goes over
/// the console at a SIGHUP).
const MAX_LAB_TENANTS: usize = 1 << 20;

/// One regular file `name` (root's, mode 0600) of a ustar archive: its
/// header and its data, padded to 512 bytes.
fn ustar_entry(name: &str, data: &[u8]) -> Vec<u8> {
    let mut h = [0u8; 512];
    let put = |h: &mut [u8; 512], at: usize, v: &[u8]| h[at..at + v.len()].copy_from_slice(v);
    put(&mut h, 0, name.as_bytes());
    put(&mut h, 100, b"0000600\0");
    put(&mut h, 108, b"0000000\0");
    put(&mut h, 116, b"0000000\0");
    put(&mut h, 124, format!("{:011o}\0", data.len()).as_bytes());
    put(&mut h, 136, b"00000000000\0");
    h[156] = b'0';
    put(&mut h, 257, b"ustar\0");
    put(&mut h, 263, b"00");
    // The checksum counts its own field as spaces.
    put(&mut h, 148, b"        ");
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    put(&mut h, 148, format!("{sum:06o}\0 ").as_bytes());
    let mut out = h.to_vec();
    out.extend_from_slice(data);
    out.resize(out.len().div_ceil(512) * 512, 0);
    out
}

/// What the console reader saw.
#[derive(Debug)]
enum Seen {
    Heartbeat,
    /// The inner sproutd's start-up line.
    Listening,
    /// `lab: …` from the lab's init: it could not set itself up.
    Failed(String),
    /// The lab's init ended sproutd with this status.
    Exit(i32),
}

/// One boot of the lab.
struct Run {
    child: Child,
    stdin: Option<ChildStdin>,
    seen: mpsc::UnboundedReceiver<Seen>,
    tail: std::sync::Arc<std::sync::Mutex<VecDeque<String>>>,
    /// The console reader: it ends when QEMU closes the console.
    reader: tokio::task::JoinHandle<()>,
    /// QEMU's stderr, whole, once QEMU has ended.
    qemu_stderr: tokio::task::JoinHandle<String>,
}

impl Run {
    fn start(cfg: &Config, tenants: Option<&Path>) -> Result<Run, LabError> {
        let console = cfg.dir.join("console.log");
        // The previous boot's console, for a look after a restart.
        let _ = std::fs::rename(&console, cfg.dir.join("console.log.1"));
        let mut log =
            std::fs::File::create(&console).map_err(|e| LabError::File(console.clone(), e))?;
        let mut cmd = Command::new(&cfg.qemu);
        cmd.args(["-accel", "tcg", "-cpu", "max", "-nodefaults", "-no-reboot"])
            .args(["-display", "none", "-serial", "stdio", "-monitor", "none"])
            .arg("-m")
            .arg(cfg.memory_mib.to_string())
            .arg("-smp")
            .arg(cfg.cpus.to_string())
            .arg("-kernel")
            .arg(cfg.lab.join("vmlinuz"))
            .arg("-initrd")
            .arg(cfg.lab.join("initrd.cpio"))
            .arg("-drive")
            .arg(drive(&cfg.lab.join("images.ext4"), true))
            .arg("-drive")
            .arg(drive(&cfg.disk, false));
        if let Some(t) = tenants {
            // The third drive: /dev/vdc in the lab.
            cmd.arg("-drive").arg(drive(t, true));
        }
        let mut nic = format!(
            "user,model=virtio-net-pci,restrict=on,hostfwd=tcp:{}:{}-:{INNER_PORT}",
            cfg.addr.ip(),
            cfg.addr.port()
        );
        if let Some(h) = &cfg.s3_host {
            // Each connection of the lab's sproutd to the store's guest
            // address runs a netcat to the host's store (the only way out
            // of the restricted network).
            let (host, port) = h.rsplit_once(':').unwrap_or((h, "80"));
            nic.push_str(&format!(
                ",guestfwd=tcp:{INNER_S3}-cmd:/bin/busybox nc {host} {port}"
            ));
        }
        for (i, (host, port)) in cfg.registries.iter().enumerate() {
            let host = if host == "localhost" {
                "127.0.0.1"
            } else {
                host
            };
            nic.push_str(&format!(
                ",guestfwd=tcp:{}-cmd:/bin/busybox nc {host} {port}",
                inner_registry(i, *port)
            ));
        }
        cmd.arg("-nic")
            .arg(nic)
            .arg("-append")
            // A periodic tick (nohz=off highres=off): QEMU 7.2 can lose the
            // lab kernel's timer interrupt while a nested guest runs, and
            // only a timer that re-arms itself recovers from that
            // (tests/lab/run.sh, --tick, says how).
            .arg(format!(
                "console=ttyS0 panic=-1 softlockup_panic=1 quiet nohz=off highres=off lab.printk=1 \
                 lab.service=sproutd lab.sproutd={}",
                cfg.inner_args.join(",")
            ))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group: a Ctrl-C on the terminal reaches this
            // process, which stops the lab in order, and not QEMU too.
            .process_group(0)
            .kill_on_drop(true);
        // SAFETY: the closure runs in the forked child before exec and only
        // makes one prctl call, which is async-signal-safe; it touches no
        // memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                rustix::process::set_parent_process_death_signal(Some(
                    rustix::process::Signal::KILL,
                ))
                .map_err(std::io::Error::from)
            });
        }
        let mut child = cmd.spawn().map_err(LabError::Spawn)?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped");
        let mut stderr = child.stderr.take().expect("piped");
        let (tx, seen) = mpsc::unbounded_channel();
        let tail = std::sync::Arc::new(std::sync::Mutex::new(VecDeque::new()));
        let keep = tail.clone();
        let reader = tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).split(b'\n');
            let mut logged = 0u64;
            while let Ok(Some(raw)) = lines.next_segment().await {
                if logged < CONSOLE_LOG_CAP {
                    logged += raw.len() as u64 + 1;
                    let _ = log.write_all(&raw);
                    let _ = log.write_all(b"\n");
                    if logged >= CONSOLE_LOG_CAP {
                        let _ = writeln!(
                            log,
                            "[sproutd: this log stops here, at its cap of {} MiB]",
                            CONSOLE_LOG_CAP >> 20
                        );
                    }
                }
                let line = String::from_utf8_lossy(&raw);
                let line = line.trim_end_matches('\r');
                // (A terminal escape may come before a marker.)
                if line.contains("===SPROUT-LAB-HEARTBEAT") {
                    let _ = tx.send(Seen::Heartbeat);
                    continue;
                }
                {
                    let mut t = super::lock(&keep);
                    if t.len() == TAIL {
                        t.pop_front();
                    }
                    t.push_back(line.to_owned());
                }
                if let Some(code) = line
                    .split("===SPROUT-LAB-EXIT ")
                    .nth(1)
                    .and_then(|r| r.strip_suffix("==="))
                {
                    let _ = tx.send(Seen::Exit(code.trim().parse().unwrap_or(-1)));
                } else if let Some(why) = line.strip_prefix("lab: ") {
                    let _ = tx.send(Seen::Failed(why.to_owned()));
                } else if line.contains("===SPROUT-LAB-") {
                } else if !line.trim().is_empty() && !is_kernel_line(line) {
                    if line.contains("sproutd listening on http://") {
                        let _ = tx.send(Seen::Listening);
                    } else {
                        eprintln!("lab: {line}");
                    }
                }
            }
        });
        // QEMU's own complaints go to the console log's neighbour.
        let qemu_log = cfg.dir.join("qemu.log");
        let qemu_stderr = tokio::spawn(async move {
            let mut buf = Vec::new();
            let _ = (&mut stderr).take(1 << 20).read_to_end(&mut buf).await;
            if !buf.is_empty() {
                let _ = std::fs::write(qemu_log, &buf);
            }
            String::from_utf8_lossy(&buf).trim().to_owned()
        });
        Ok(Run {
            child,
            stdin,
            seen,
            tail,
            reader,
            qemu_stderr,
        })
    }

    /// What to say of a QEMU that ended: its status and its stderr.
    async fn ended(&mut self) -> String {
        let st = match self.child.wait().await {
            Ok(st) => st.to_string(),
            Err(e) => format!("status unknown: {e}"),
        };
        let said = tokio::time::timeout(Duration::from_secs(5), &mut self.qemu_stderr)
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default();
        if said.is_empty() {
            format!("QEMU ended ({st})")
        } else {
            format!("QEMU ended ({st}): {said}")
        }
    }

    fn tail(&self) -> String {
        let t = super::lock(&self.tail);
        t.iter().cloned().collect::<Vec<_>>().join("\n")
    }

    /// Waits until the inner sproutd answers through the forwarded port.
    async fn until_ready(&mut self, cfg: &Config, stop: &mut Stop) -> Result<bool, LabError> {
        let start = Instant::now();
        let mut next_note = Duration::from_secs(20);
        let mut listening = false;
        loop {
            if start.elapsed() > BOOT_LIMIT {
                return Err(LabError::Boot(
                    format!("no answering sproutd after {} s", BOOT_LIMIT.as_secs()),
                    self.tail(),
                ));
            }
            if start.elapsed() > next_note {
                eprintln!(
                    "sproutd: the lab is still starting ({} s; the emulated machine is slow to boot)",
                    start.elapsed().as_secs()
                );
                next_note += Duration::from_secs(20);
            }
            tokio::select! {
                a = stop.wait() => match a {
                    // Given to the lab once it serves.
                    Asked::Reload => {}
                    Asked::Stop => return Ok(false),
                },
                s = self.seen.recv() => match s {
                    Some(Seen::Listening) => listening = true,
                    Some(Seen::Failed(why)) => return Err(LabError::Boot(why, self.tail())),
                    Some(Seen::Exit(c)) => {
                        return Err(LabError::Boot(format!("sproutd in the lab exited with {c}"), self.tail()))
                    }
                    Some(Seen::Heartbeat) => {}
                    None => return Err(LabError::Boot(self.ended().await, self.tail())),
                },
                _ = tokio::time::sleep(Duration::from_millis(500)), if listening => {
                    if health(cfg.addr).await {
                        return Ok(true);
                    }
                }
            }
        }
    }

    /// Runs until the host asks to stop (Ok), or the lab ends or freezes
    /// (Err, with what happened).
    async fn watch(&mut self, cfg: &Config, stop: &mut Stop) -> Result<(), String> {
        let mut last = Instant::now();
        let mut healthy = Instant::now();
        let mut next_check = Instant::now() + Duration::from_secs(60);
        loop {
            if std::mem::take(&mut stop.reload) {
                self.send_tenants(cfg).await;
            }
            tokio::select! {
                a = stop.wait() => match a {
                    Asked::Reload => continue,
                    Asked::Stop => return Ok(()),
                },
                s = self.seen.recv() => match s {
                    Some(Seen::Heartbeat) => last = Instant::now(),
                    Some(Seen::Exit(c)) => return Err(format!("sproutd in the lab exited with {c}")),
                    Some(Seen::Failed(why)) => return Err(why),
                    Some(Seen::Listening) => {}
                    None => return Err(self.ended().await),
                },
                _ = tokio::time::sleep(Duration::from_secs(5)) => {
                    if last.elapsed() > STALL {
                        return Err(format!(
                            "the emulated machine froze (no heartbeat from the lab for {} s)",
                            last.elapsed().as_secs()
                        ));
                    }
                    // The lab beats but its sproutd may hang: asked each minute.
                    if Instant::now() >= next_check {
                        next_check = Instant::now() + Duration::from_secs(60);
                        if health(cfg.addr).await {
                            healthy = Instant::now();
                        } else if healthy.elapsed() > UNHEALTHY {
                            return Err(format!(
                                "the lab's sproutd has not answered /v1/health for {} s",
                                healthy.elapsed().as_secs()
                            ));
                        }
                    }
                }
            }
        }
    }

    /// Gives the lab's sproutd the tenants file again, over the console
    /// (base64 lines, each well under a terminal's line limit); a file
    /// that does not load here is not sent.
    async fn send_tenants(&mut self, cfg: &Config) {
        use base64::Engine as _;
        let Some(f) = &cfg.tenants else {
            eprintln!("sproutd: SIGHUP: no --tenants file to read again");
            return;
        };
        if let Err(e) = super::tenants::Tenants::load(f) {
            eprintln!(
                "sproutd: SIGHUP: {}; the tenants in force stay",
                super::error::chain(&e)
            );
            return;
        }
        let Ok(bytes) = std::fs::read(f) else { return };
        if bytes.len() > MAX_LAB_TENANTS {
            eprintln!(
                "sproutd: SIGHUP: the tenants file is over {MAX_LAB_TENANTS} bytes, the lab's \
                 limit; the tenants in force stay"
            );
            return;
        }
        let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
        let mut msg = String::from("SPROUT-LAB-TENANTS-BEGIN\n");
        for part in b64.as_bytes().chunks(512) {
            msg.push_str("SPROUT-LAB-TENANTS-PART ");
            msg.push_str(&String::from_utf8_lossy(part));
            msg.push('\n');
        }
        msg.push_str("SPROUT-LAB-TENANTS-END\n");
        if let Some(stdin) = self.stdin.as_mut() {
            let send = async {
                stdin.write_all(msg.as_bytes()).await?;
                stdin.flush().await
            };
            let ok = matches!(
                tokio::time::timeout(Duration::from_secs(30), send).await,
                Ok(Ok(()))
            );
            if ok {
                eprintln!("sproutd: SIGHUP: the tenants file went to the lab's sproutd");
            } else {
                eprintln!("sproutd: SIGHUP: cannot reach the lab's console");
            }
        }
    }

    /// Stops sproutd in the lab and powers it off; kills QEMU if it takes
    /// longer than [`STOP_GRACE`].
    async fn stop(mut self) {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = stdin.write_all(b"SPROUT-LAB-SHUTDOWN\n").await;
            let _ = stdin.flush().await;
        }
        match tokio::time::timeout(STOP_GRACE, self.child.wait()).await {
            Ok(_) => {}
            Err(_) => {
                eprintln!(
                    "sproutd: the lab did not power off within {} s; killing QEMU",
                    STOP_GRACE.as_secs()
                );
                let _ = self.child.kill().await;
            }
        }
        // The console's last lines reach the log (and stderr).
        let _ = tokio::time::timeout(Duration::from_secs(5), self.reader).await;
    }

    async fn kill(mut self) {
        let _ = self.child.kill().await;
    }
}

/// A kernel message (`[   11.42] reboot: Power down`): kept in the console
/// log only.
fn is_kernel_line(line: &str) -> bool {
    line.strip_prefix('[')
        .and_then(|r| r.split_once(']'))
        .is_some_and(|(t, _)| {
            let t = t.trim();
            !t.is_empty() && t.chars().all(|c| c.is_ascii_digit() || c == '.')
        })
}

fn drive(path: &Path, read_only: bool) -> std::ffi::OsString {
    // QEMU's option syntax doubles a comma inside a value.
    let p = path.to_string_lossy().replace(',', ",,");
    let ro = if read_only { ",readonly=on" } else { "" };
    format!("file={p},if=virtio,format=raw,cache=writeback{ro}").into()
}

/// Whether `GET /v1/health` through the forward answers 200.
async fn health(addr: SocketAddrV4) -> bool {
    let probe = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(b"GET /v1/health HTTP/1.1\r\nHost: lab\r\nConnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut buf = [0u8; 64];
        let mut n = 0;
        while n < 12 {
            let k = s.read(&mut buf[n..]).await.ok()?;
            if k == 0 {
                break;
            }
            n += k;
        }
        Some(buf[..n].starts_with(b"HTTP/1.1 200"))
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(5), probe).await,
        Ok(Some(true))
    )
}

/// SIGINT or SIGTERM, seen once and remembered.
struct Stop {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    asked: bool,
    /// A SIGHUP came that the running lab has not been given yet.
    reload: bool,
}

/// What [`Stop::wait`] saw.
enum Asked {
    Stop,
    /// SIGHUP: send the lab the tenants file again.
    Reload,
}

impl Stop {
    fn new() -> std::io::Result<Stop> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Stop {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            // Caught (not the default: death) and told.
            hup: signal(SignalKind::hangup())?,
            asked: false,
            reload: false,
        })
    }

    /// Until a stop is asked (for good: later calls return at once) or a
    /// SIGHUP comes.
    async fn wait(&mut self) -> Asked {
        if !self.asked {
            tokio::select! {
                _ = self.int.recv() => {}
                _ = self.term.recv() => {}
                _ = self.hup.recv() => {
                    self.reload = true;
                    return Asked::Reload;
                }
            }
            self.asked = true;
        }
        Asked::Stop
    }
}

/// Serves the API from inside the lab until SIGINT or SIGTERM. `why` is
/// why this host does not serve Linux guests itself.
pub(super) fn serve(
    args: &super::DaemonArgs,
    data_dir: &Path,
    why: &str,
) -> Result<(), DaemonError> {
    let lab = lab_dir();
    for f in ["vmlinuz", "initrd.cpio", "images.ext4"] {
        if !lab.join(f).is_file() {
            return Err(LabError::NotBuilt(lab, f).into());
        }
    }
    let qemu = find_in_path("qemu-system-x86_64").ok_or(LabError::NoQemu)?;
    // Held while this process runs: tests/lab/build.sh removes no lab that
    // is in use (a restart needs its files again).
    let _in_use = hold_lab(&lab)?;
    let dir = data_dir.join("lab");
    std::fs::create_dir_all(&dir).map_err(|e| DaemonError::DataDir(dir.clone(), e))?;
    let addr = forward_addr(args.listen)?;
    let s3_host = match &args.store.s3_endpoint {
        Some(e) => Some(s3_host(e)?),
        None => None,
    };
    let mut registries: Vec<(String, u16)> = Vec::new();
    for r in &args.lab_registry {
        let r = lab_registry(r)?;
        if !registries.iter().any(|(_, p)| *p == r.1) {
            registries.push(r);
        }
    }
    if registries.len() > MAX_LAB_REGISTRIES {
        return Err(LabError::Registry(
            args.lab_registry.join(" "),
            format!("at most {MAX_LAB_REGISTRIES} registries"),
        )
        .into());
    }
    let disk = dir.join("data.ext4");
    ensure_data_disk(&disk)?;
    let cfg = Config {
        lab: std::fs::canonicalize(&lab).unwrap_or(lab),
        qemu,
        dir,
        disk,
        addr,
        cpus: args.lab_cpus,
        memory_mib: args.lab_memory_mib.unwrap_or_else(default_memory_mib),
        inner_args: {
            let mut a = args.exec_limits.to_args();
            if args.no_jail {
                a.push("--no-jail".into());
            }
            if args.no_templates {
                a.push("--no-templates".into());
            }
            a.push("--ready-workers".into());
            a.push(args.ready_workers.to_string());
            if args.tenants.is_some() {
                a.push(format!("--tenants={INNER_TENANTS}"));
            }
            if let (Some(_), Some(bucket)) = (&s3_host, &args.store.s3_bucket) {
                a.push(format!("--s3-endpoint=http://{INNER_S3}"));
                a.push(format!("--s3-bucket={bucket}"));
                a.push(format!("--s3-region={}", args.store.s3_region));
            }
            a.push(format!("--keep-snapshots={}", args.store.keep_snapshots));
            a.push(format!("--keep-days={}", args.store.keep_days));
            a
        },
        tenants: args.tenants.clone(),
        s3_env: s3_host.as_ref().map(|_| s3_env()),
        s3_host,
        registries,
    };
    tracing::warn!("{why}");
    eprintln!(
        "sproutd: starting the emulated lab ({} vCPU, {} MiB; the lab: {}; its console: {})",
        cfg.cpus,
        cfg.memory_mib,
        cfg.lab.display(),
        cfg.dir.join("console.log").display()
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(DaemonError::Runtime)?;
    rt.block_on(supervise(cfg))
}

async fn supervise(cfg: Config) -> Result<(), DaemonError> {
    let mut stop = Stop::new().map_err(DaemonError::Runtime)?;
    let mut failures = 0u32;
    let mut first = true;
    loop {
        let started = Instant::now();
        // Read again at each boot: a restart of the lab takes the file's
        // changes.
        let drive = config_drive(
            &cfg.dir,
            cfg.tenants.as_deref(),
            cfg.s3_env.as_deref(),
            &cfg.registries,
        )?;
        let mut run = Run::start(&cfg, drive.as_deref())?;
        match run.until_ready(&cfg, &mut stop).await {
            Ok(true) => {}
            Ok(false) => {
                run.stop().await;
                return Ok(());
            }
            Err(e) if first => {
                run.kill().await;
                return Err(e.into());
            }
            Err(e) => {
                run.kill().await;
                failures += 1;
                eprintln!("sproutd: {}", super::error::chain(&e));
                if failures > MAX_RESTARTS {
                    return Err(LabError::GaveUp(failures, cfg.dir.join("console.log")).into());
                }
                continue;
            }
        }
        let url = format!("http://{}", cfg.addr);
        if first {
            super::print_banner(&url, Some(&cfg.dir.join("data.ext4")));
            first = false;
        } else {
            eprintln!("sproutd: the lab is serving again on {url}");
        }
        match run.watch(&cfg, &mut stop).await {
            Ok(()) => {
                eprintln!("sproutd: stopping the lab");
                run.stop().await;
                eprintln!("sproutd: stopped; the registry and the sandboxes' files are kept");
                return Ok(());
            }
            Err(what) => {
                run.kill().await;
                if started.elapsed() > Duration::from_secs(3600) {
                    failures = 0;
                }
                failures += 1;
                eprintln!(
                    "sproutd: {what}; starting the lab again (sandboxes that ran are marked failed; \
                     the console of that run: {})",
                    cfg.dir.join("console.log.1").display()
                );
                if failures > MAX_RESTARTS {
                    // (Not started again: its console is still console.log.)
                    return Err(LabError::GaveUp(failures, cfg.dir.join("console.log")).into());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_zero_becomes_a_free_port_and_ipv6_is_refused() {
        let any = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0));
        assert_ne!(forward_addr(any).unwrap().port(), 0);
        let v6: SocketAddr = "[::1]:7070".parse().unwrap();
        assert!(matches!(forward_addr(v6), Err(LabError::Ipv6(_))));
        // A port in use is told now, not after a boot.
        let held = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = held.local_addr().unwrap();
        assert!(matches!(forward_addr(addr), Err(LabError::Listen(..))));
    }

    #[test]
    fn a_data_disk_is_made_once_as_a_sparse_ext4_file() {
        let dir = tempfile::tempdir().unwrap();
        let disk = dir.path().join("data.ext4");
        ensure_data_disk(&disk).unwrap();
        let m = std::fs::metadata(&disk).unwrap();
        assert_eq!(m.len(), DATA_DISK_GIB << 30);
        use std::os::unix::fs::MetadataExt as _;
        assert!(
            m.blocks() * 512 < 256 << 20,
            "not sparse: {} blocks",
            m.blocks()
        );
        crate::linux::check_ext4(&disk).unwrap();
        // A second call keeps what is there.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&disk)
            .unwrap()
            .write_all_at(b"mark", 8 << 20)
            .unwrap();
        ensure_data_disk(&disk).unwrap();
        let mut b = [0u8; 4];
        std::fs::File::open(&disk)
            .unwrap()
            .read_exact_at(&mut b, 8 << 20)
            .unwrap();
        assert_eq!(&b, b"mark");
        assert!(!disk.with_extension("ext4.tmp").exists());
    }

    #[test]
    fn kernel_lines_are_told_from_sproutd_lines() {
        assert!(is_kernel_line("[   11.422892] reboot: Power down"));
        assert!(!is_kernel_line("[lab] something"));
        assert!(!is_kernel_line(
            "2026-12-01T15:58:14Z  INFO service::daemon: x"
        ));
    }

    #[test]
    fn the_config_drive_is_a_tar_that_tar_unpacks() {
        let d = tempfile::tempdir().unwrap();
        let text: String = (0..40)
            .map(|i| format!("[[tenant]]\nname = \"t{i}\"\n"))
            .collect();
        let f = d.path().join("t.toml");
        std::fs::write(&f, &text).unwrap();
        let env = "export AWS_ACCESS_KEY_ID='a'\n";
        let drive = config_drive(d.path(), Some(&f), Some(env), &[])
            .unwrap()
            .unwrap();
        let bytes = std::fs::read(&drive).unwrap();
        assert_eq!(bytes.len() % 512, 0);
        let unpack = |name: &str| {
            let out = std::process::Command::new("tar")
                .arg("-xOf")
                .arg(&drive)
                .arg(name)
                .output()
                .unwrap();
            assert!(out.status.success(), "{out:?}");
            String::from_utf8(out.stdout).unwrap()
        };
        assert_eq!(unpack("tenants.toml"), text);
        assert_eq!(unpack("s3.env"), env);
        // A bad edit keeps the last good tenants file.
        std::fs::write(&f, "[[tenant]]\nname = 7\n").unwrap();
        config_drive(d.path(), Some(&f), None, &[]).unwrap();
        assert_eq!(unpack("tenants.toml"), text);
        // With no good one yet, the error is told.
        let none = d.path().join("none");
        std::fs::create_dir(&none).unwrap();
        let e = config_drive(&none, Some(&f), None, &[]).unwrap_err();
        assert!(e.to_string().contains("not valid"), "{e}");
        assert!(config_drive(&none, None, None, &[]).unwrap().is_none());
    }

    #[test]
    fn only_loopback_registries_are_forwarded_and_the_drive_lists_them() {
        assert_eq!(
            lab_registry("127.0.0.1:5000").unwrap(),
            ("127.0.0.1".into(), 5000)
        );
        assert_eq!(
            lab_registry("localhost:443").unwrap(),
            ("localhost".into(), 443)
        );
        for bad in [
            "registry.example:5000",
            "10.0.0.1:5000",
            "127.0.0.1",
            "127.0.0.1:0",
            "127.0.0.1:99999",
            "127.0.0.1:7070",
            "127.0.0.1:5000,guestfwd=x",
            "[::1]:5000",
        ] {
            let e = lab_registry(bad).unwrap_err().to_string();
            assert!(e.contains(bad), "{bad}: {e}");
        }
        let d = tempfile::tempdir().unwrap();
        let regs = [
            ("127.0.0.1".to_owned(), 5000),
            ("localhost".to_owned(), 5001),
        ];
        let drive = config_drive(d.path(), None, None, &regs).unwrap().unwrap();
        let out = std::process::Command::new("tar")
            .arg("-xOf")
            .arg(&drive)
            .arg("registries")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(
            String::from_utf8(out.stdout).unwrap(),
            "5000 10.0.2.110\n5001 10.0.2.111\n"
        );
    }

    #[test]
    fn only_plain_http_stores_are_forwarded_into_the_lab() {
        assert_eq!(s3_host("http://127.0.0.1:9000").unwrap(), "127.0.0.1:9000");
        assert_eq!(s3_host("http://minio.local:80/").unwrap(), "minio.local:80");
        for bad in [
            "https://s3.amazonaws.com",
            "http://127.0.0.1",
            "http://h:9000/bucket",
            "http://h:0",
            "http://a b:1",
            "http://h:1,guestfwd=x",
        ] {
            assert!(s3_host(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn drive_options_escape_commas() {
        assert_eq!(
            drive(Path::new("/a,b/c.ext4"), true),
            "file=/a,,b/c.ext4,if=virtio,format=raw,cache=writeback,readonly=on"
        );
    }

    use std::net::Ipv4Addr;
    use std::os::unix::fs::FileExt as _;
}
