//! `GET /metrics`: Prometheus text format (version 0.0.4). Sandboxes by
//! state (read from the registry at each scrape), HTTP requests by route
//! template, method and status, and histograms of create and exec
//! durations.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Bucket bounds in seconds: a create cold-boots a guest (seconds; tens in
/// the emulated lab), an exec is milliseconds to minutes.
const BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0,
];

pub struct Histogram {
    counts: Vec<AtomicU64>,
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            counts: BUCKETS.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        for (b, c) in BUCKETS.iter().zip(&self.counts) {
            if s <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.sum_us
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        for (b, c) in BUCKETS.iter().zip(&self.counts) {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{b}\"}} {}",
                c.load(Ordering::Relaxed)
            );
        }
        let n = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {n}");
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}");
        let _ = writeln!(out, "{name}_count {n}");
    }
}

#[derive(Default)]
pub struct Metrics {
    /// `POST /schedule`, from the request to its answer (started or failed).
    pub create: Histogram,
    /// Buffered execs, from the request to the exit.
    pub exec: Histogram,
    /// Snapshots written (user, sleep, hibernate, checkpoint, fork), the
    /// write and its verification.
    pub snapshot: Histogram,
    /// Wakes, from the restore's start to a running sandbox.
    pub wake: Histogram,
    /// New sandboxes restored from a snapshot (a fork's children, a
    /// schedule from a snapshot), to a running sandbox.
    pub restore: Histogram,
    /// Forks, from the request to every child's result.
    pub fork: Histogram,
    /// Archives, to the record in the object store.
    pub archive: Histogram,
    /// Unarchives, to a running sandbox.
    pub unarchive: Histogram,
    /// (route template, method, status) -> count.
    requests: Mutex<BTreeMap<(String, String, u16), u64>>,
}

/// A label value, escaped as the text format wants.
fn label(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A request's method as a label: the standard ones by name, any other as
/// `other`. HTTP takes any token as a method, so a client sending a new
/// one each time would otherwise add a series per request, without bound
/// (found by the `http_api` fuzz target).
fn method_label(method: &str) -> &str {
    match method {
        "GET" | "HEAD" | "POST" | "PUT" | "DELETE" | "PATCH" | "OPTIONS" | "CONNECT" | "TRACE" => {
            method
        }
        _ => "other",
    }
}

impl Metrics {
    /// Counts an answer. `route` must be a route template (or a fixed word
    /// such as `unmatched`), never a raw path.
    pub fn request(&self, route: &str, method: &str, status: u16) {
        let mut r = super::lock(&self.requests);
        *r.entry((route.to_owned(), method_label(method).to_owned(), status))
            .or_insert(0) += 1;
    }

    /// The whole exposition, with `by_state` (every state, 0 included).
    pub fn render(&self, by_state: &[(&str, u64)]) -> String {
        let mut out = String::new();
        out.push_str("# HELP sproutd_sandboxes Sandboxes in the registry, by state.\n");
        out.push_str("# TYPE sproutd_sandboxes gauge\n");
        for (state, n) in by_state {
            let _ = writeln!(out, "sproutd_sandboxes{{state=\"{state}\"}} {n}");
        }
        out.push_str("# HELP sproutd_http_requests_total HTTP requests answered.\n");
        out.push_str("# TYPE sproutd_http_requests_total counter\n");
        for ((route, method, status), n) in super::lock(&self.requests).iter() {
            let _ = writeln!(
                out,
                "sproutd_http_requests_total{{route=\"{}\",method=\"{}\",status=\"{status}\"}} {n}",
                label(route),
                label(method)
            );
        }
        // This process's memory, for a bound on what a flood of output or
        // a large file costs the service.
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        for (key, name, help) in [
            (
                "VmRSS:",
                "process_resident_memory_bytes",
                "Resident memory of sproutd.",
            ),
            (
                "VmHWM:",
                "sproutd_peak_resident_memory_bytes",
                "Peak resident memory of sproutd since it started.",
            ),
        ] {
            if let Some(kib) = proc_kib(&status, key) {
                let _ = writeln!(out, "# HELP {name} {help}");
                let _ = writeln!(out, "# TYPE {name} gauge");
                let _ = writeln!(out, "{name} {}", kib * 1024);
            }
        }
        self.create.render(
            "sproutd_create_seconds",
            "Time to create a sandbox (schedule request to answer).",
            &mut out,
        );
        self.exec.render(
            "sproutd_exec_seconds",
            "Time of a buffered exec (request to exit).",
            &mut out,
        );
        for (h, name, help) in [
            (
                &self.snapshot,
                "sproutd_snapshot_seconds",
                "Time to write and verify a snapshot.",
            ),
            (
                &self.wake,
                "sproutd_wake_seconds",
                "Time to wake a sleeping or hibernated sandbox.",
            ),
            (
                &self.restore,
                "sproutd_restore_seconds",
                "Time to start a new sandbox from a snapshot.",
            ),
            (
                &self.fork,
                "sproutd_fork_seconds",
                "Time of a fork, request to every child's result.",
            ),
            (
                &self.archive,
                "sproutd_archive_seconds",
                "Time to archive a sandbox into the object store.",
            ),
            (
                &self.unarchive,
                "sproutd_unarchive_seconds",
                "Time to unarchive a sandbox, to running.",
            ),
        ] {
            h.render(name, help, &mut out);
        }
        out
    }
}

/// `KEY:   123 kB` of a /proc status file, in KiB.
fn proc_kib(status: &str, key: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn methods_a_client_invents_share_one_series() {
        let m = Metrics::default();
        for i in 0..1000 {
            m.request("unmatched", &format!("M{i}"), 404);
        }
        m.request("unmatched", "GET", 404);
        m.request("unmatched", "DELETE", 404);
        let text = m.render(&[]);
        let series: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("sproutd_http_requests_total{"))
            .collect();
        assert_eq!(
            series,
            [
                "sproutd_http_requests_total{route=\"unmatched\",method=\"DELETE\",status=\"404\"} 1",
                "sproutd_http_requests_total{route=\"unmatched\",method=\"GET\",status=\"404\"} 1",
                "sproutd_http_requests_total{route=\"unmatched\",method=\"other\",status=\"404\"} 1000",
            ]
        );
    }

    #[test]
    fn histograms_are_cumulative_and_render_as_the_text_format() {
        let m = Metrics::default();
        m.exec.observe(Duration::from_millis(3));
        m.exec.observe(Duration::from_secs(2));
        m.exec.observe(Duration::from_secs(1000));
        m.request("/v1/health", "GET", 200);
        m.request("/v1/health", "GET", 200);
        m.request("weird\"route", "GET", 404);
        let text = m.render(&[("running", 2), ("failed", 0)]);
        for line in [
            "sproutd_sandboxes{state=\"running\"} 2",
            "sproutd_sandboxes{state=\"failed\"} 0",
            "sproutd_exec_seconds_bucket{le=\"0.001\"} 0",
            "sproutd_exec_seconds_bucket{le=\"0.005\"} 1",
            "sproutd_exec_seconds_bucket{le=\"1\"} 1",
            "sproutd_exec_seconds_bucket{le=\"5\"} 2",
            "sproutd_exec_seconds_bucket{le=\"300\"} 2",
            "sproutd_exec_seconds_bucket{le=\"+Inf\"} 3",
            "sproutd_exec_seconds_count 3",
            "sproutd_exec_seconds_sum 1002.003",
            "sproutd_create_seconds_count 0",
            "sproutd_http_requests_total{route=\"/v1/health\",method=\"GET\",status=\"200\"} 2",
            "sproutd_http_requests_total{route=\"weird\\\"route\",method=\"GET\",status=\"404\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        let rss = text
            .lines()
            .find_map(|l| l.strip_prefix("process_resident_memory_bytes "))
            .and_then(|v| v.parse::<u64>().ok())
            .expect("the RSS gauge");
        assert!(rss > 1 << 20, "{rss}");
        assert!(text.contains("sproutd_peak_resident_memory_bytes "));
        assert_eq!(proc_kib("VmRSS:\t   1234 kB\n", "VmRSS:"), Some(1234));
        assert_eq!(proc_kib("VmRSS: junk\n", "VmRSS:"), None);
    }
}
