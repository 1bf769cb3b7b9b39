//! sproutd's exec concurrency limits: at most `--max-execs-per-vm` execs in
//! flight in one sandbox and `--max-execs` in the whole service. An exec is
//! in flight from the moment it is admitted until its answer is complete: a
//! buffered exec until its output is answered, a streamed one until its
//! stream ends (the exit, an error, or the client going away), a background
//! process only while it starts (it then lives in the agent, bounded there).
//! One more is refused at once, before the agent is asked, with `429
//! too_many_requests` and `Retry-After`: nothing waits in a queue, and no
//! answer can go to another request.
//!
//! Why: each exec holds an agent connection, a task, and up to 2 MiB of
//! buffered output (stdout and stderr, 1 MiB each), so the global limit
//! bounds sproutd's memory; the per-sandbox limit keeps one busy sandbox
//! from taking every slot.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::Serialize;
use uuid::Uuid;

use super::error::{ApiError, Code, DEFAULT_RETRY_AFTER_SECS};

/// The default of `--max-execs-per-vm`.
pub const DEFAULT_PER_VM: u32 = 32;
/// The default of `--max-execs`: with 2 MiB of output each at most, 256 MiB.
pub const DEFAULT_GLOBAL: u32 = 128;

#[derive(Clone, Debug, clap::Args)]
pub struct ExecLimitArgs {
    /// Most execs in flight in one sandbox (buffered and streamed; a
    /// background process counts while it starts); one more is answered
    /// 429 too_many_requests with Retry-After.
    #[arg(long, default_value_t = DEFAULT_PER_VM, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_execs_per_vm: u32,
    /// Most execs in flight in the whole service; one more is answered 429
    /// too_many_requests with Retry-After.
    #[arg(long, default_value_t = DEFAULT_GLOBAL, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_execs: u32,
}

impl ExecLimitArgs {
    /// The same limits as `sproutd` arguments (for the lab's sproutd).
    pub fn to_args(&self) -> Vec<String> {
        vec![
            format!("--max-execs-per-vm={}", self.max_execs_per_vm),
            format!("--max-execs={}", self.max_execs),
        ]
    }
}

impl Default for ExecLimitArgs {
    fn default() -> Self {
        Self {
            max_execs_per_vm: DEFAULT_PER_VM,
            max_execs: DEFAULT_GLOBAL,
        }
    }
}

#[derive(Default)]
struct Counts {
    total: u32,
    by_vm: HashMap<Uuid, u32>,
    by_tenant: HashMap<String, u32>,
}

/// The limits and what is in flight now.
pub struct ExecLimits {
    per_vm: u32,
    global: u32,
    counts: Mutex<Counts>,
    refused_vm: AtomicU64,
    refused_global: AtomicU64,
    refused_tenant: AtomicU64,
}

/// One admitted exec; dropping it frees its place.
#[must_use = "the exec is admitted only while its slot is held"]
pub struct ExecSlot {
    limits: Arc<ExecLimits>,
    vm: Uuid,
    tenant: String,
}

impl Drop for ExecSlot {
    fn drop(&mut self) {
        let mut c = super::lock(&self.limits.counts);
        c.total = c.total.saturating_sub(1);
        if let Some(n) = c.by_vm.get_mut(&self.vm) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                c.by_vm.remove(&self.vm);
            }
        }
        if let Some(n) = c.by_tenant.get_mut(&self.tenant) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                c.by_tenant.remove(&self.tenant);
            }
        }
    }
}

/// The limits as `/v1/info` shows them.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = ExecLimits)]
pub struct ExecLimitsView {
    /// `--max-execs-per-vm`.
    max_execs_per_vm: u32,
    /// `--max-execs`.
    max_execs: u32,
    /// Execs in flight now, in every sandbox (shown to an operator
    /// tenant only, with `--tenants`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    in_flight: Option<u32>,
}

impl ExecLimits {
    pub fn new(args: &ExecLimitArgs) -> Arc<Self> {
        Arc::new(Self {
            per_vm: args.max_execs_per_vm.max(1),
            global: args.max_execs.max(1),
            counts: Mutex::default(),
            refused_vm: AtomicU64::new(0),
            refused_global: AtomicU64::new(0),
            refused_tenant: AtomicU64::new(0),
        })
    }

    /// Admits one exec in `vm` of tenant `tenant` (who may have at most
    /// `tenant_limit` in flight), or refuses it (429 with `Retry-After`).
    pub fn try_acquire(
        self: &Arc<Self>,
        vm: Uuid,
        tenant: &str,
        tenant_limit: Option<u32>,
    ) -> Result<ExecSlot, ApiError> {
        let mut c = super::lock(&self.counts);
        let theirs = c.by_tenant.get(tenant).copied().unwrap_or(0);
        if tenant_limit.is_some_and(|l| theirs >= l) {
            self.refused_tenant.fetch_add(1, Ordering::Relaxed);
            return Err(ApiError::new(
                Code::TooManyRequests,
                format!(
                    "Tenant {tenant:?} has {theirs} execs in flight, its limit (max_execs): \
                     retry after {DEFAULT_RETRY_AFTER_SECS} s"
                ),
            )
            .retry_after(DEFAULT_RETRY_AFTER_SECS));
        }
        let here = c.by_vm.get(&vm).copied().unwrap_or(0);
        if here >= self.per_vm {
            self.refused_vm.fetch_add(1, Ordering::Relaxed);
            return Err(ApiError::new(
                Code::TooManyRequests,
                format!(
                    "Sandbox {vm} has {here} execs in flight, its limit (--max-execs-per-vm): \
                     retry after {DEFAULT_RETRY_AFTER_SECS} s"
                ),
            )
            .retry_after(DEFAULT_RETRY_AFTER_SECS));
        }
        if c.total >= self.global {
            self.refused_global.fetch_add(1, Ordering::Relaxed);
            return Err(ApiError::new(
                Code::TooManyRequests,
                format!(
                    "sproutd has {} execs in flight, its limit (--max-execs): \
                     retry after {DEFAULT_RETRY_AFTER_SECS} s",
                    c.total
                ),
            )
            .retry_after(DEFAULT_RETRY_AFTER_SECS));
        }
        c.total += 1;
        *c.by_vm.entry(vm).or_insert(0) += 1;
        *c.by_tenant.entry(tenant.to_owned()).or_insert(0) += 1;
        Ok(ExecSlot {
            limits: self.clone(),
            vm,
            tenant: tenant.to_owned(),
        })
    }

    /// Execs in flight now.
    pub fn in_flight(&self) -> u32 {
        super::lock(&self.counts).total
    }

    /// Execs of `tenant` in flight now.
    pub fn tenant_in_flight(&self, tenant: &str) -> u32 {
        super::lock(&self.counts)
            .by_tenant
            .get(tenant)
            .copied()
            .unwrap_or(0)
    }

    /// The limits, and (for an operator) the execs in flight.
    pub fn view(&self, operator: bool) -> ExecLimitsView {
        ExecLimitsView {
            max_execs_per_vm: self.per_vm,
            max_execs: self.global,
            in_flight: operator.then(|| self.in_flight()),
        }
    }

    /// The limits' series for `/metrics`.
    pub fn render_metrics(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "# HELP sproutd_execs_in_flight Execs admitted and not yet answered in full."
        );
        let _ = writeln!(out, "# TYPE sproutd_execs_in_flight gauge");
        let _ = writeln!(out, "sproutd_execs_in_flight {}", self.in_flight());
        let _ = writeln!(
            out,
            "# HELP sproutd_execs_refused_total Execs answered 429 by sproutd's limits, by limit."
        );
        let _ = writeln!(out, "# TYPE sproutd_execs_refused_total counter");
        for (limit, n) in [
            ("sandbox", &self.refused_vm),
            ("global", &self.refused_global),
            ("tenant", &self.refused_tenant),
        ] {
            let _ = writeln!(
                out,
                "sproutd_execs_refused_total{{limit=\"{limit}\"}} {}",
                n.load(Ordering::Relaxed)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::extract::{Path, State};
    use axum::response::IntoResponse;
    use std::time::{Duration, Instant};

    fn limits(per_vm: u32, global: u32) -> Arc<ExecLimits> {
        ExecLimits::new(&ExecLimitArgs {
            max_execs_per_vm: per_vm,
            max_execs: global,
        })
    }

    #[test]
    fn a_sandbox_and_the_service_each_have_their_limit_and_slots_free_on_drop() {
        let l = limits(2, 3);
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let a1 = l.try_acquire(a, "t", None).unwrap();
        let a2 = l.try_acquire(a, "t", None).unwrap();
        let e = l.try_acquire(a, "t", None).err().unwrap();
        assert_eq!(e.code, Code::TooManyRequests);
        assert!(e.message.contains("--max-execs-per-vm"), "{}", e.message);
        assert_eq!(e.retry_after, Some(DEFAULT_RETRY_AFTER_SECS));
        let b1 = l.try_acquire(b, "t", None).unwrap();
        let e = l.try_acquire(b, "t", None).err().unwrap();
        assert!(e.message.contains("--max-execs)"), "{}", e.message);
        assert_eq!(l.in_flight(), 3);
        drop(a1);
        assert_eq!(l.in_flight(), 2);
        let b2 = l.try_acquire(b, "t", None).unwrap();
        drop((a2, b1, b2));
        assert_eq!(l.in_flight(), 0);
        assert!(
            crate::daemon::lock(&l.counts).by_vm.is_empty(),
            "no entry left"
        );
        let mut m = String::new();
        l.render_metrics(&mut m);
        assert!(m.contains("sproutd_execs_in_flight 0\n"), "{m}");
        assert!(
            m.contains("sproutd_execs_refused_total{limit=\"sandbox\"} 1\n"),
            "{m}"
        );
        assert!(
            m.contains("sproutd_execs_refused_total{limit=\"global\"} 1\n"),
            "{m}"
        );
    }

    #[test]
    fn a_tenant_has_its_own_limit_across_its_sandboxes() {
        let l = limits(10, 10);
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let t1 = l.try_acquire(a, "t", Some(2)).unwrap();
        let t2 = l.try_acquire(b, "t", Some(2)).unwrap();
        let e = l.try_acquire(a, "t", Some(2)).err().unwrap();
        assert_eq!(e.code, Code::TooManyRequests);
        assert!(e.message.contains("max_execs"), "{}", e.message);
        // Another tenant is not counted against it.
        let u = l.try_acquire(a, "u", Some(1)).unwrap();
        drop(t1);
        let t3 = l.try_acquire(a, "t", Some(2)).unwrap();
        drop((t2, t3, u));
        assert!(crate::daemon::lock(&l.counts).by_tenant.is_empty());
        let mut m = String::new();
        l.render_metrics(&mut m);
        assert!(
            m.contains("sproutd_execs_refused_total{limit=\"tenant\"} 1\n"),
            "{m}"
        );
    }

    /// Held requests: each waits, holding its slot, until `go` says so, then
    /// answers its own token.
    #[derive(Clone)]
    struct Held {
        limits: Arc<ExecLimits>,
        go: tokio::sync::watch::Receiver<bool>,
    }

    async fn hold(
        State(h): State<Held>,
        Path((vm, token)): Path<(Uuid, String)>,
    ) -> Result<axum::response::Response, ApiError> {
        let _slot = h.limits.try_acquire(vm, "t", None)?;
        let mut go = h.go.clone();
        let _ = go.wait_for(|g| *g).await;
        Ok(axum::Json(serde_json::json!({ "token": token })).into_response())
    }

    /// Real HTTP requests held open against the limiter: every answer is
    /// the request's own token or a 429 envelope with `Retry-After`, the
    /// count admitted is exactly what the limits allow, and every slot is
    /// free again after, also when a client goes away mid-request.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_held_open_over_the_limits_get_their_own_answer_or_429() {
        let l = limits(3, 5);
        let (tx, rx) = tokio::sync::watch::channel(false);
        let app = axum::Router::new()
            .route("/hold/{vm}/{token}", axum::routing::get(hold))
            .with_state(Held {
                limits: l.clone(),
                go: rx,
            });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let c = reqwest::Client::new();
        let vms: Vec<Uuid> = (0..3).map(|_| Uuid::new_v4()).collect();
        let mut tasks = Vec::new();
        for i in 0..24 {
            let url = format!("http://{addr}/hold/{}/tok-{i}", vms[i % 3]);
            let c = c.clone();
            tasks.push(tokio::spawn(async move {
                let r = c.get(url).send().await.unwrap();
                let status = r.status().as_u16();
                let retry = r
                    .headers()
                    .get("retry-after")
                    .map(|v| v.to_str().unwrap().to_owned());
                let body: serde_json::Value = r.json().await.unwrap();
                (i, status, retry, body)
            }));
        }
        // The refusals come back while the admitted ones are held.
        let deadline = Instant::now() + Duration::from_secs(30);
        while tasks.iter().filter(|t| t.is_finished()).count() < 24 - 5 {
            assert!(Instant::now() < deadline, "the refusals did not come");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(l.in_flight(), 5);
        tx.send(true).unwrap();
        let (mut ok, mut refused) = (0, 0);
        for t in tasks {
            let (i, status, retry, body) = t.await.unwrap();
            match status {
                200 => {
                    assert_eq!(body, serde_json::json!({ "token": format!("tok-{i}") }));
                    ok += 1;
                }
                429 => {
                    assert_eq!(body["error"]["code"], "too_many_requests", "{body}");
                    assert_eq!(retry.as_deref(), Some("1"), "{body}");
                    refused += 1;
                }
                s => panic!("request {i}: {s} {body}"),
            }
        }
        assert_eq!((ok, refused), (5, 19));
        assert_eq!(l.in_flight(), 0);

        // A client that goes away frees its slot.
        tx.send(false).unwrap();
        let url = format!("http://{addr}/hold/{}/gone", vms[0]);
        let t = tokio::spawn(async move { reqwest::get(url).await });
        let deadline = Instant::now() + Duration::from_secs(30);
        while l.in_flight() == 0 {
            assert!(Instant::now() < deadline, "not admitted");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        t.abort();
        while l.in_flight() != 0 {
            assert!(Instant::now() < deadline, "the slot of a gone client stays");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
