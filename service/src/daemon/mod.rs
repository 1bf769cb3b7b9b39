//! `sproutd`: the sandbox REST service (docs/api.md).
//!
//! One process serves HTTP (axum on tokio); each sandbox is a detached
//! worker process ([`supervisor`]) recorded in the SQLite [`registry`] under
//! the data directory. A stopped `sproutd` leaves its workers running, and
//! the next one re-adopts them by `describe` ([`App::adopt_all`]); a sandbox
//! whose worker vanished is marked `failed` with the reason.
//!
//! `sproutd --listen ADDR --data-dir DIR`, also run as `sprout daemon`.

pub mod api_client;
mod dashboard;
mod error;
mod exec;
mod exec_limits;
mod files;
mod images;
pub mod in_process;
mod lab;
mod lifecycle;
mod metrics;
mod mirror;
mod net;
mod oci_images;
pub mod openapi;
mod pins;
mod pool;
mod ports;
mod procs;
pub mod registry;
mod rest;
mod routes;
mod rtnl;
mod store;
mod supervisor;
mod templates;
pub mod tenants;
mod watch;

use std::collections::HashMap;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use uuid::Uuid;

pub use error::{chain as error_chain, ApiError, Code};
#[doc(hidden)]
pub use mirror::fuzzing as store_fuzzing;
use registry::{Image, Registry, RegistryError, Sandbox, State};
use supervisor::Supervisor;

/// The default listen address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7070";
/// Most bytes of any request body.
pub const MAX_BODY: usize = 1 << 20;

#[derive(Clone, Debug, clap::Args)]
pub struct DaemonArgs {
    /// The address to serve HTTP on (port 0: any free port; the line
    /// `sproutd listening on http://ADDR` on stdout says which).
    #[arg(long, default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,
    /// Where the registry and the sandboxes' files live (default
    /// `~/.local/share/sprout`).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Serve from inside the emulated hardware-virtualization lab even
    /// where this host's KVM runs Linux guests (the default is to use the
    /// lab only where it cannot).
    #[arg(long, conflicts_with = "no_lab")]
    pub lab: bool,
    /// Never start the lab: serve from this host, where Linux images fail
    /// with `host_unsupported` if its KVM cannot run them (the test guest
    /// still runs).
    #[arg(long)]
    pub no_lab: bool,
    /// vCPUs of the lab's emulated machine (1 is the most reliable: see
    /// docs/architecture.md, issue 18).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=8))]
    pub lab_cpus: u8,
    /// RAM of the lab's emulated machine in MiB (default: half the host's,
    /// within 2048–16384).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1024..=262144))]
    pub lab_memory_mib: Option<u32>,
    /// A registry on this host's loopback (`127.0.0.1:PORT` or
    /// `localhost:PORT`) that the lab's sproutd pulls OCI images from under
    /// the same address (repeatable; the lab reaches nothing else).
    #[arg(long, value_name = "HOST:PORT")]
    pub lab_registry: Vec<String>,
    /// Only say whether this host's KVM runs Linux guests, and so whether
    /// sproutd would serve from the lab, then exit: 0 if it runs them, 3 if
    /// not (./serve asks this to know whether to build the lab).
    #[arg(long)]
    pub check_host: bool,
    #[command(flatten)]
    pub exec_limits: exec_limits::ExecLimitArgs,
    #[command(flatten)]
    pub store: mirror::StoreArgs,
    /// Start workers unjailed even as root, for debugging: each then runs
    /// as root and sees the whole host. By default a root `sproutd` jails
    /// every worker (docs/api.md, "Jailed workers").
    #[arg(long)]
    pub no_jail: bool,
    /// Cold-boot every create instead of restoring its (image, shape)'s
    /// template (by default the first create builds one and is answered
    /// `503 template_building`; docs/api.md, "Templates").
    #[arg(long)]
    pub no_templates: bool,
    /// The tenants file: API keys (their SHA-256) and each tenant's quota
    /// (docs/api.md, "Tenants and quotas"). Without it sproutd is
    /// single-tenant and listens only on loopback. SIGHUP re-reads it.
    #[arg(long, value_name = "FILE")]
    pub tenants: Option<PathBuf>,
    /// Print a new API key and its line for the tenants file, then exit.
    #[arg(long)]
    pub new_key: bool,
    /// Worker processes kept started, jailed and holding a VM shell, for
    /// each shape sandboxes are restored or booted in, so that a create
    /// from a template, a fork, a wake or a cold boot does not wait for
    /// one (0: none).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(0..=16))]
    pub ready_workers: u16,
    /// Give sandboxes no network device (by default each gets one, with
    /// NAT egress unless `disableInternet`, where the host allows:
    /// docs/api.md, "Network").
    #[arg(long)]
    pub no_network: bool,
    /// A DNS resolver for sandboxes' guests (repeatable, at most 4; default:
    /// the host's own non-loopback ones, from /etc/resolv.conf or
    /// systemd-resolved's upstream list).
    #[arg(long, value_name = "IPV4")]
    pub dns: Vec<std::net::Ipv4Addr>,
}

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("Cannot create the data directory {0}")]
    DataDir(PathBuf, #[source] std::io::Error),
    #[error("Another sproutd uses the data directory {0}")]
    Locked(PathBuf),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error("Cannot listen on {0}")]
    Listen(SocketAddr, #[source] std::io::Error),
    #[error("Cannot start the async runtime")]
    Runtime(#[source] std::io::Error),
    #[error("Cannot find the program to run workers with")]
    Worker(#[source] std::io::Error),
    #[error("Serving HTTP failed")]
    Serve(#[source] std::io::Error),
    #[error(transparent)]
    Lab(#[from] lab::LabError),
    #[error(transparent)]
    Tenants(#[from] tenants::TenantsError),
    /// A setting refused, saying why.
    #[error("{0}")]
    Insecure(String),
    #[error("{0}")]
    Usage(String),
}

/// Whether this host can run Linux guests (the VMM's probe).
#[derive(Clone, Debug)]
pub struct HostMode {
    pub linux_guests: bool,
    /// Why not, when not.
    pub reason: Option<String>,
    /// Whether this sproutd runs inside the emulated lab for a host that
    /// cannot run Linux guests (`SPROUT_LAB_HOSTED`, set by the lab's init).
    pub lab: bool,
}

/// What every request handler shares.
pub struct App {
    registry: Mutex<Registry>,
    supervisor: Supervisor,
    images: Vec<Image>,
    /// OCI images: pulls in flight, and those in the cache.
    oci: Arc<oci_images::Pulls>,
    host: HostMode,
    data_dir: PathBuf,
    /// Agent clients by sandbox (each keeps a few idle connections).
    agents: Mutex<HashMap<Uuid, Arc<guest_agent::client::Client>>>,
    /// Workers this process started (reaped on delete); adopted ones are
    /// not our children.
    children: Mutex<HashMap<Uuid, sprout_worker::WorkerProcess>>,
    metrics: metrics::Metrics,
    /// Per-sandbox transition locks and activity (rest states).
    lifecycle: lifecycle::Lifecycle,
    /// Creates restore their (image, shape)'s template (else cold-boot).
    templates: bool,
    /// Ready workers by shape.
    pool: pool::Pool,
    /// API keys and what each tenant may hold.
    tenants: tenants::Tenants,
    /// Sandbox slots held for starts and wakes in flight.
    slots: Arc<tenants::Slots>,
    /// The object store snapshots are mirrored to, if any.
    mirror: Option<mirror::Mirror>,
    /// Downloads from it in flight.
    downloads: mirror::Downloads,
    /// Retention of user snapshots: (newest kept, days kept; 0: no limit).
    retention: (u32, u32),
    /// Sandboxes' networks (or why they have none).
    network: net::Network,
}

/// Locks `m`, whatever a panicking holder left (every value here stays
/// consistent between statements).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl App {
    /// The base image a sandbox's image name stands for: a built image, or
    /// an OCI image in the cache (by the digest its pinned name carries).
    fn image(&self, name: &str) -> Option<Image> {
        self.images
            .iter()
            .find(|i| i.name == name)
            .cloned()
            .or_else(|| self.oci.by_name(name))
    }

    /// Runs `f` on the registry, off the async threads.
    async fn db<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&mut Registry) -> Result<T, RegistryError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let app = self.clone();
        tokio::task::spawn_blocking(move || f(&mut lock(&app.registry)))
            .await
            .map_err(|e| ApiError::internal(format!("registry task failed: {e}")))?
            .map_err(|e| ApiError::internal(error::chain(&e)))
    }

    /// The sandbox `id` names, if it is `caller`'s; 404 if none (another
    /// tenant's is answered exactly as an unknown id).
    async fn sandbox(
        self: &Arc<Self>,
        caller: &tenants::Caller,
        id: &str,
    ) -> Result<Sandbox, ApiError> {
        let uuid = Uuid::parse_str(id).map_err(|_| ApiError::vm_not_found(id))?;
        self.db(move |r| r.get_sandbox(uuid))
            .await?
            .filter(|s| caller.owns(&s.tenant))
            .ok_or_else(|| ApiError::vm_not_found(id))
    }

    fn agent(&self, s: &Sandbox) -> Option<Arc<guest_agent::client::Client>> {
        let uds = s.vsock_socket.as_ref()?;
        let mut agents = lock(&self.agents);
        Some(
            agents
                .entry(s.id)
                .or_insert_with(|| Arc::new(crate::agent::client(uds)))
                .clone(),
        )
    }

    /// Re-adopts every sandbox a previous `sproutd` left with a worker: a
    /// live one keeps (or takes) its worker's state, a vanished one becomes
    /// `failed`; one being deleted is deleted.
    async fn adopt_all(self: &Arc<Self>) -> Result<(), ApiError> {
        let all = self.db(|r| r.list_sandboxes()).await?;
        // A wake cut short by a stop of sproutd: the sandbox is still asleep
        // (its snapshot intact), and the worker its wake started is not its.
        for s in all
            .iter()
            .filter(|s| matches!(s.state, State::Sleeping | State::Hibernated) && s.pid.is_some())
        {
            let (id, app, row) = (s.id, self.clone(), s.clone());
            let r =
                tokio::task::spawn_blocking(move || app.supervisor.stop_worker(&row, None)).await;
            if let Ok(Err(e)) = r {
                tracing::warn!(vm = %id, "stopping the worker of a wake cut short: {e}");
            }
            self.db(move |r| r.set_worker_opt(id, None)).await?;
            tracing::info!(vm = %id, "a wake was cut short: still {}", s.state.as_str());
        }
        for s in all.into_iter().filter(|s| s.state.has_worker()) {
            let id = s.id;
            if s.state == State::Stopping {
                let app = self.clone();
                let r = tokio::task::spawn_blocking(move || app.supervisor.stop(&s, None)).await;
                match r {
                    Ok(Ok(())) => {
                        self.db(move |r| r.delete_sandbox(id)).await?;
                        tracing::info!(vm = %id, "finished the delete a previous sproutd began");
                    }
                    _ => {
                        let why = "The worker did not stop when the sandbox was deleted";
                        self.db(move |r| r.set_state(id, State::Failed, Some(why)))
                            .await?;
                    }
                }
                continue;
            }
            let pid = s.pid;
            let app = self.clone();
            let probe = tokio::task::spawn_blocking(move || app.supervisor.adopt(&s));
            let (state, why) =
                match tokio::time::timeout(std::time::Duration::from_secs(10), probe).await {
                    Ok(Ok(v)) => v,
                    Ok(Err(e)) => (State::Failed, Some(format!("Re-adoption failed: {e}"))),
                    Err(_) => (
                        State::Failed,
                        Some("The sandbox's worker did not answer within 10 s".into()),
                    ),
                };
            match &why {
                None => tracing::info!(vm = %id, "re-adopted its worker ({})", state.as_str()),
                Some(w) => tracing::warn!(vm = %id, "marked failed: {w}"),
            }
            let live = why.is_none();
            self.db(move |r| r.set_state(id, state, why.as_deref()))
                .await?;
            if let (true, Some(pid)) = (live, pid) {
                watch::worker(self, id, pid);
            }
        }
        Ok(())
    }
}

/// `~/.local/share/sprout`.
pub fn default_data_dir() -> PathBuf {
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".local/share/sprout")
}

/// Runs `sproutd` until SIGINT or SIGTERM; the process exit status.
pub fn main(args: DaemonArgs) -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(
            std::io::IsTerminal::is_terminal(&std::io::stderr())
                && std::env::var_os("NO_COLOR").is_none(),
        )
        .try_init();
    if args.new_key {
        return match tenants::new_key() {
            Ok((key, line)) => {
                println!("{key}");
                eprintln!(
                    "sproutd: a new API key (above; it is shown only now). Put its SHA-256 in \
                     the keys of its tenant in the tenants file:\n  keys = [{line}]"
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("sproutd: error: cannot draw random bytes for a key: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if args.check_host {
        return match vmm::arch::probe::check_linux_guests_cached(&crate::linux::cache_dir()) {
            Ok(()) => {
                println!("this host's KVM runs Linux guests: sproutd serves them directly");
                ExitCode::SUCCESS
            }
            Err(e) => {
                println!(
                    "this host's KVM cannot run Linux guests ({}): sproutd serves from the emulated lab",
                    error::chain(&e)
                );
                ExitCode::from(3)
            }
        };
    }
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sproutd: error: {}", error::chain(&e));
            ExitCode::FAILURE
        }
    }
}

fn lock_data_dir(dir: &Path) -> Result<std::fs::File, DaemonError> {
    let path = dir.join("sproutd.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| DaemonError::DataDir(path.clone(), e))?;
    rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive)
        .map_err(|_| DaemonError::Locked(dir.to_owned()))?;
    Ok(f)
}

/// Prints how to reach a listening sproutd on stdout: the address line
/// (tests and scripts read it) and a first request to try. `lab_disk`: the
/// data disk, when serving from the lab.
fn print_banner(url: &str, lab_disk: Option<&Path>) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "sproutd listening on {url}");
    if lab_disk.is_some() {
        let _ = writeln!(out, "  {}", lab::EMULATED_NOTE);
    }
    let json = "-H 'content-type: application/json'";
    let vm_id = r#"sed 's/.*"vmId":"\([^"]*\)".*/\1/'"#;
    let exec = r#"'{"command":"uname","argv":["-a"]}'"#;
    let _ = writeln!(
        out,
        "  Try a sandbox from the default image and a command in it (the first create builds the \
         image's template, answered 503 with Retry-After until it is ready; curl retries):\n    \
         id=$(curl -sf --retry 60 -X POST {url}/v1/runtime/schedule {json} -d '{{}}' | {vm_id}) && \\\n    \
         curl -s -X POST {url}/v1/runtime/vms/$id/exec {json} -d {exec}"
    );
    let keep = lab_disk.map_or(String::new(), |d| {
        format!(
            "; the registry and the sandboxes' files stay on {}",
            d.display()
        )
    });
    let _ = writeln!(out, "  The dashboard: {url}{}", dashboard::BASE);
    let _ = writeln!(
        out,
        "  The API is in docs/api.md; {url}/v1/info says what this host serves. Stop with Ctrl-C{keep}."
    );
    let _ = out.flush();
}

fn run(args: DaemonArgs) -> Result<(), DaemonError> {
    let data_dir = args.data_dir.clone().unwrap_or_else(default_data_dir);
    std::fs::create_dir_all(data_dir.join("vms"))
        .map_err(|e| DaemonError::DataDir(data_dir.clone(), e))?;
    let _lock = lock_data_dir(&data_dir)?;
    let lab_hosted = std::env::var_os("SPROUT_LAB_HOSTED").is_some();
    let max_dns = guest_agent::protocol::MAX_NET_DNS;
    if args.dns.len() > max_dns {
        return Err(DaemonError::Usage(format!(
            "--dns is given {} times: a guest takes at most {max_dns} resolvers",
            args.dns.len()
        )));
    }
    let tenants = match &args.tenants {
        Some(f) => tenants::Tenants::load(f)?,
        // Inside the lab, only the host's forwarded address reaches this
        // sproutd, and the host's sproutd checked that one.
        None if lab_hosted => tenants::Tenants::single(),
        None => {
            if let Some(why) = tenants::refuse_listen(args.listen) {
                return Err(DaemonError::Insecure(why));
            }
            tenants::Tenants::single()
        }
    };
    let mirror = mirror::Mirror::new(&args.store, &data_dir).map_err(DaemonError::Insecure)?;
    let probe = vmm::arch::probe::check_linux_guests_cached(&crate::linux::cache_dir())
        .map_err(|e| error::chain(&e));
    // Where this KVM cannot run Linux guests, serve from the lab (unless
    // told not to); --lab serves from it anyway.
    if args.lab || (probe.is_err() && !args.no_lab) {
        let why = match &probe {
            Ok(()) => "--lab was given",
            Err(e) => e.as_str(),
        };
        return lab::serve(&args, &data_dir, why);
    }
    let mut registry = Registry::open(&data_dir.join("registry.db"))?;
    let images = images::scan();
    registry.set_images(&images, now_ms())?;
    let host = HostMode {
        linux_guests: probe.is_ok(),
        reason: probe.err(),
        lab: lab_hosted,
    };
    let cmd = crate::control::worker_command().map_err(DaemonError::Worker)?;
    let mut supervisor = Supervisor::new(cmd, &data_dir, !args.no_jail);
    // Only Linux guests have a network device: a host that runs only the
    // test guest changes nothing of its own network.
    let network = if host.linux_guests {
        let mut n = net::Network::start(supervisor.jailed(), !args.no_network, &args.dns);
        if lab_hosted && n.enabled() {
            // QEMU's restricted user network: nothing outside the host's
            // forwarded ports (which keeps the host's own services out of
            // the guests' reach).
            n.set_no_egress(
                "served from the emulated lab, whose own network reaches nothing outside: \
                 sandboxes have a network device and an address, but no egress",
            );
        }
        n
    } else {
        net::Network::off("this host runs only the test guest, which has no network device")
    };
    supervisor.net = network.enabled();
    let app = Arc::new(App {
        registry: Mutex::new(registry),
        supervisor,
        images,
        oci: Arc::new(oci_images::Pulls::new(&crate::linux::cache_dir())),
        host,
        data_dir: data_dir.clone(),
        agents: Mutex::new(HashMap::new()),
        children: Mutex::new(HashMap::new()),
        metrics: metrics::Metrics::default(),
        lifecycle: lifecycle::Lifecycle::default(),
        templates: !args.no_templates,
        pool: pool::Pool::new(&data_dir, usize::from(args.ready_workers)),
        tenants,
        slots: Default::default(),
        mirror,
        downloads: Default::default(),
        retention: (args.store.keep_snapshots, args.store.keep_days),
        network,
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(DaemonError::Runtime)?;
    rt.block_on(async move {
        // Caught from the start: a SIGHUP while workers are re-adopted
        // must not end sproutd.
        reload_on_hangup(&app);
        if let Err(e) = app.adopt_all().await {
            tracing::error!("re-adopting workers: {}", e.message);
        }
        {
            let a = app.clone();
            let _ =
                tokio::task::spawn_blocking(move || a.pool.sweep_leftovers(&a.supervisor)).await;
        }
        if let Err(e) = app.recover_templates().await {
            tracing::error!("recovering template builds: {}", e.message);
        }
        app.sweep_orphan_snapshots().await;
        app.collect_garbage().await;
        // After the collection: what it removed needs no image either.
        app.sweep_kept_images().await;
        lifecycle::sweeper(&app);
        lifecycle::retention_sweeper(&app);
        app.start_uploader();
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .map_err(|e| DaemonError::Listen(args.listen, e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| DaemonError::Listen(args.listen, e))?;
        let stop = shutdown();
        match &app.host.reason {
            None if app.host.lab => tracing::info!("{}", lab::EMULATED_NOTE),
            None => tracing::info!("this host's KVM runs Linux guests"),
            Some(r) => tracing::warn!(
                "this host's KVM cannot run Linux guests ({r}), and --no-lab: only the test \
                 guest runs here"
            ),
        }
        match app.network.unavailable() {
            None => tracing::info!(
                "sandboxes get a network: each its own namespace, TAP and address, NAT egress \
                 unless disableInternet (docs/api.md, \"Network\"); DNS: {}",
                match app.network.dns() {
                    [] => "none (the host has only loopback resolvers: give one with --dns)"
                        .to_string(),
                    d => d
                        .iter()
                        .map(|a| a.to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                }
            ),
            Some(why) => tracing::warn!(
                "sandboxes have no egress: {why}; guest ports are still served through the \
                 agent (POST /v1/runtime/vms/{{id}}/ports)"
            ),
        }
        tracing::info!(data_dir = %app.data_dir.display(), "listening on http://{addr}");
        if app.host.lab {
            // The host's sproutd prints the banner with its own address.
            let _ = writeln!(std::io::stdout(), "sproutd listening on http://{addr}");
        } else {
            print_banner(&format!("http://{addr}"), None);
        }
        let in_lab = app.host.lab;
        let keep = app.clone();
        axum::serve(listener, routes::router(app, &args.exec_limits))
            .with_graceful_shutdown(stop)
            .await
            .map_err(DaemonError::Serve)?;
        // Ready workers hold no sandbox: they go with this sproutd.
        let _ = tokio::task::spawn_blocking(move || keep.pool.stop_all()).await;
        if in_lab {
            tracing::info!("stopped; the lab powers off, and its sandboxes' VMs with it");
        } else {
            tracing::info!("stopped; workers keep running and are re-adopted on the next start");
        }
        Ok(())
    })
}

/// Re-reads the tenants file at each SIGHUP (a bad one keeps the tenants
/// in force); without one, a SIGHUP is only logged.
fn reload_on_hangup(app: &Arc<App>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        tracing::warn!("cannot catch SIGHUP: the tenants file is read only at start");
        return;
    };
    let app = app.clone();
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            if !app.tenants.multi() {
                tracing::info!("SIGHUP: no --tenants file to read again");
                continue;
            }
            let a = app.clone();
            match tokio::task::spawn_blocking(move || a.tenants.reload()).await {
                Ok(Ok((t, k))) => {
                    tracing::info!("SIGHUP: read the tenants file again: {t} tenants, {k} keys")
                }
                Ok(Err(e)) => tracing::error!(
                    "SIGHUP: {}; the tenants read before stay in force",
                    error::chain(&e)
                ),
                Err(e) => tracing::error!("SIGHUP: the reload task failed: {e}"),
            }
        }
    });
}

/// Waits for SIGINT or SIGTERM. Made (and the handlers installed) before
/// the listening line is printed: a signal sent as soon as a caller reads
/// that line stops sproutd gracefully, never by the default action.
fn shutdown() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let int = signal(SignalKind::interrupt());
    let term = signal(SignalKind::terminate());
    async move {
        let wait = |s: std::io::Result<tokio::signal::unix::Signal>| async move {
            match s {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = wait(int) => {}
            _ = wait(term) => {}
        }
    }
}
