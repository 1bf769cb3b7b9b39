//! `sproutd`'s HTTP surface in-process, with nothing behind it: the real
//! router (every layer: request ids, body limits, the error envelope,
//! caught panics) over a fresh [`App`] that can start no worker. For the
//! HTTP fuzz target (`fuzz/fuzz_targets/http_api.rs`) and for tests that
//! drive the router with `tower::ServiceExt::oneshot`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use super::exec_limits::ExecLimitArgs;
use super::registry::Registry;
use super::supervisor::Supervisor;
use super::{metrics, routes, App, DaemonError, HostMode};

/// The router `sproutd` serves, over an [`App`] on `data_dir` (its own
/// registry there, made if missing) that knows **no images**, so that no
/// request can create a sandbox or start a worker, and runs **no Linux
/// guests** (no KVM probe is made). Everything else answers as `sproutd`
/// does, with its default exec limits. Build and serve it within a tokio runtime (handlers spawn
/// blocking tasks); one router per data directory at a time.
pub fn router(data_dir: &Path) -> Result<axum::Router, DaemonError> {
    std::fs::create_dir_all(data_dir.join("vms"))
        .map_err(|e| DaemonError::DataDir(data_dir.to_owned(), e))?;
    let registry = Registry::open(&data_dir.join("registry.db"))?;
    // Never run: with no images no sandbox is ever booted.
    let cmd = sprout_worker::WorkerCommand::new("sprout-worker");
    let app = Arc::new(App {
        registry: Mutex::new(registry),
        supervisor: Supervisor::new(cmd, data_dir, false),
        images: Vec::new(),
        oci: Arc::new(super::oci_images::Pulls::new(&data_dir.join("cache"))),
        host: HostMode {
            linux_guests: false,
            reason: Some("an in-process router runs no guests".into()),
            lab: false,
        },
        data_dir: data_dir.to_owned(),
        agents: Mutex::new(HashMap::new()),
        children: Mutex::new(HashMap::new()),
        metrics: metrics::Metrics::default(),
        lifecycle: Default::default(),
        templates: true,
        pool: super::pool::Pool::new(data_dir, 0),
        tenants: super::tenants::Tenants::single(),
        slots: Default::default(),
        mirror: None,
        downloads: Default::default(),
        retention: (0, 0),
        network: super::net::Network::off("an in-process router runs no guests"),
    });
    Ok(routes::router(app, &ExecLimitArgs::default()))
}
