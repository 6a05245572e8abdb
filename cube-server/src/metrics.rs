//! Counters for Prometheus (`/metrics` on the admin port), in its text format:
//! sandboxes by state, a histogram of create latency, requests and errors.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the create-latency histogram, seconds.
const CREATE_BUCKETS: [f64; 10] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// The service's counters.
#[derive(Default)]
pub struct Metrics {
    create_buckets: [AtomicU64; CREATE_BUCKETS.len()],
    create_count: AtomicU64,
    create_sum_us: AtomicU64,
    create_failures: AtomicU64,
    requests: AtomicU64,
    client_errors: AtomicU64,
    server_errors: AtomicU64,
    rate_limited: AtomicU64,
    killed_at_timeout: AtomicU64,
    paused_at_timeout: AtomicU64,
}

impl Metrics {
    /// Records one successful create and how long it took.
    pub fn create_done(&self, took: Duration) {
        let secs = took.as_secs_f64();
        for (i, bound) in CREATE_BUCKETS.iter().enumerate() {
            if secs <= *bound {
                self.create_buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.create_count.fetch_add(1, Ordering::Relaxed);
        self.create_sum_us
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
    }

    /// Records a failed create.
    pub fn create_failed(&self) {
        self.create_failures.fetch_add(1, Ordering::Relaxed);
    }

    /// Records a request's answer.
    pub fn request(&self, status: u16) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        match status {
            429 => {
                self.rate_limited.fetch_add(1, Ordering::Relaxed);
                self.client_errors.fetch_add(1, Ordering::Relaxed);
            }
            400..=499 => {
                self.client_errors.fetch_add(1, Ordering::Relaxed);
            }
            500..=599 => {
                self.server_errors.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
    }

    /// Records what the deadline reaper did.
    pub fn timed_out(&self, paused: bool) {
        if paused {
            self.paused_at_timeout.fetch_add(1, Ordering::Relaxed);
        } else {
            self.killed_at_timeout.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The text exposition, with the sandbox counts by state given.
    pub fn render(&self, running: usize, paused: usize) -> String {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut out = String::new();
        let _ = writeln!(out, "# HELP cube_sandboxes Sandboxes served, by state.");
        let _ = writeln!(out, "# TYPE cube_sandboxes gauge");
        let _ = writeln!(out, "cube_sandboxes{{state=\"running\"}} {running}");
        let _ = writeln!(out, "cube_sandboxes{{state=\"paused\"}} {paused}");
        let _ = writeln!(
            out,
            "# HELP cube_create_seconds Time to create a sandbox through the API."
        );
        let _ = writeln!(out, "# TYPE cube_create_seconds histogram");
        for (i, bound) in CREATE_BUCKETS.iter().enumerate() {
            let _ = writeln!(
                out,
                "cube_create_seconds_bucket{{le=\"{bound}\"}} {}",
                get(&self.create_buckets[i])
            );
        }
        let count = get(&self.create_count);
        let _ = writeln!(out, "cube_create_seconds_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(
            out,
            "cube_create_seconds_sum {}",
            get(&self.create_sum_us) as f64 / 1e6
        );
        let _ = writeln!(out, "cube_create_seconds_count {count}");
        for (name, help, value) in [
            (
                "cube_create_failures_total",
                "Creates that failed.",
                &self.create_failures,
            ),
            ("cube_requests_total", "Requests answered.", &self.requests),
            (
                "cube_client_errors_total",
                "Requests answered with a 4xx status.",
                &self.client_errors,
            ),
            (
                "cube_server_errors_total",
                "Requests answered with a 5xx status.",
                &self.server_errors,
            ),
            (
                "cube_rate_limited_total",
                "Requests refused with 429.",
                &self.rate_limited,
            ),
            (
                "cube_killed_at_timeout_total",
                "Sandboxes killed at their end time.",
                &self.killed_at_timeout,
            ),
            (
                "cube_paused_at_timeout_total",
                "Sandboxes paused at their end time.",
                &self.paused_at_timeout,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} counter");
            let _ = writeln!(out, "{name} {}", get(value));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_counts_what_happened() {
        let m = Metrics::default();
        m.create_done(Duration::from_millis(3));
        m.create_done(Duration::from_millis(300));
        m.request(429);
        m.request(500);
        m.request(200);
        let text = m.render(2, 1);
        assert!(text.contains("cube_sandboxes{state=\"running\"} 2"));
        assert!(text.contains("cube_create_seconds_bucket{le=\"0.005\"} 1"));
        assert!(text.contains("cube_create_seconds_bucket{le=\"0.5\"} 2"));
        assert!(text.contains("cube_create_seconds_count 2"));
        assert!(text.contains("cube_rate_limited_total 1"));
        assert!(text.contains("cube_server_errors_total 1"));
        assert!(text.contains("cube_requests_total 3"));
    }
}
