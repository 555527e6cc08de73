//! The router's Prometheus metrics, registered in the router's own registry (served at
//! `/metrics`).
//!
//! Latencies are measured where the client sees them: TTFT from the moment the router received
//! the request to the moment it handed the first token to the client's stream, inter-token
//! latency between successive token messages (one observation per token, so a message carrying
//! several tokens counts its gap once and the rest as zero-wait tokens), end-to-end latency from
//! receipt to the last message. KV transfer volume comes from the prefill worker's own report, and
//! so do cached prompt tokens (a colocated worker's from its first decode message).

use prometheus::{
    Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use crate::registry::WorkerCounts;

/// Histogram buckets for request latencies, in seconds: 5 ms to 60 s, roughly doubling.
const LATENCY_BUCKETS: &[f64] =
    &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0];

/// Histogram buckets for the gap between tokens, in seconds: 1 ms to 10 s.
const INTER_TOKEN_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Every metric the router exports.
pub struct RouterMetrics {
    /// The registry they live in (this router's only; never the process-global one).
    pub registry: Registry,
    /// `tandem_router_requests_total{api,outcome}`.
    pub requests: IntCounterVec,
    /// `tandem_router_errors_total{kind}`.
    pub errors: IntCounterVec,
    /// `tandem_router_ttft_seconds`.
    pub ttft: Histogram,
    /// `tandem_router_inter_token_seconds`.
    pub inter_token: Histogram,
    /// `tandem_router_e2e_seconds`.
    pub e2e: Histogram,
    /// `tandem_router_requests_in_flight`.
    pub in_flight: IntGauge,
    /// `tandem_router_queue_depth`: accepted requests without a first token yet.
    pub queue_depth: IntGauge,
    /// `tandem_router_prompt_tokens_total`.
    pub prompt_tokens: IntCounter,
    /// `tandem_router_generated_tokens_total`.
    pub generated_tokens: IntCounter,
    /// `tandem_router_workers{role,state}`.
    pub workers: IntGaugeVec,
    /// `tandem_router_kv_transfer_bytes_total{transport}`.
    pub kv_transfer_bytes: IntCounterVec,
    /// `tandem_router_kv_transfer_seconds_total{transport}`.
    pub kv_transfer_seconds: prometheus::CounterVec,
    /// `tandem_router_draining`: 1 once shutdown has begun.
    pub draining: IntGauge,
    /// `tandem_router_kv_waits_total`: `Reserve` calls refused for lack of free KV blocks, each
    /// followed by a pause and another try.
    pub kv_waits: IntCounter,
    /// `tandem_router_kv_waiting`: requests in the line for KV blocks now.
    pub kv_waiting: IntGauge,
    /// `tandem_router_cached_prompt_tokens_total`: prompt tokens a worker took from its prefix
    /// cache instead of computing them (what `Usage.cached_tokens` reports).
    pub cached_prompt_tokens: IntCounter,
    /// `tandem_router_cache_routed_requests_total`: requests sent to a worker whose cache digest
    /// held at least the first block of their prompt.
    pub cache_routed: IntCounter,
    /// `tandem_router_migrations_total`: times a request moved to another worker after the one
    /// holding its sequence was lost.
    pub migrations: IntCounter,
}

/// How a request ended, as `tandem_router_requests_total` labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    Error,
    Cancelled,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Error => "error",
            Outcome::Cancelled => "cancelled",
        }
    }
}

fn register<C: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: C) -> C {
    r.register(Box::new(c.clone())).expect("metric names are unique within the router");
    c
}

impl RouterMetrics {
    /// Creates and registers every router metric in a fresh registry.
    pub fn new() -> RouterMetrics {
        let r = tandem_serve::ops::new_registry();
        let hist = |name: &str, help: &str, buckets: &[f64]| {
            register(
                &r,
                Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec())).unwrap(),
            )
        };
        let metrics = RouterMetrics {
            requests: register(
                &r,
                IntCounterVec::new(
                    Opts::new("tandem_router_requests_total", "Client requests by API and how they ended."),
                    &["api", "outcome"],
                )
                .unwrap(),
            ),
            errors: register(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "tandem_router_errors_total",
                        "Failed or refused client requests by error kind.",
                    ),
                    &["kind"],
                )
                .unwrap(),
            ),
            ttft: hist(
                "tandem_router_ttft_seconds",
                "Time from receiving a request to sending its first token.",
                LATENCY_BUCKETS,
            ),
            inter_token: hist(
                "tandem_router_inter_token_seconds",
                "Time between successive tokens sent to a client (one observation per token).",
                INTER_TOKEN_BUCKETS,
            ),
            e2e: hist(
                "tandem_router_e2e_seconds",
                "Time from receiving a request to its last message.",
                LATENCY_BUCKETS,
            ),
            in_flight: register(
                &r,
                IntGauge::new("tandem_router_requests_in_flight", "Requests accepted and not yet finished.")
                    .unwrap(),
            ),
            queue_depth: register(
                &r,
                IntGauge::new("tandem_router_queue_depth", "Requests accepted that have no first token yet.")
                    .unwrap(),
            ),
            prompt_tokens: register(
                &r,
                IntCounter::new(
                    "tandem_router_prompt_tokens_total",
                    "Prompt tokens of the requests started.",
                )
                .unwrap(),
            ),
            generated_tokens: register(
                &r,
                IntCounter::new("tandem_router_generated_tokens_total", "Tokens sent to clients.").unwrap(),
            ),
            workers: register(
                &r,
                IntGaugeVec::new(
                    Opts::new("tandem_router_workers", "Workers known to the router by role and state."),
                    &["role", "state"],
                )
                .unwrap(),
            ),
            kv_transfer_bytes: register(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "tandem_router_kv_transfer_bytes_total",
                        "KV bytes moved from prefill to decode workers, as the prefill workers report them.",
                    ),
                    &["transport"],
                )
                .unwrap(),
            ),
            kv_transfer_seconds: register(
                &r,
                prometheus::CounterVec::new(
                    Opts::new(
                        "tandem_router_kv_transfer_seconds_total",
                        "Time prefill workers spent moving KV blocks, as they report it.",
                    ),
                    &["transport"],
                )
                .unwrap(),
            ),
            draining: register(
                &r,
                IntGauge::new("tandem_router_draining", "1 while the router drains before exiting, else 0.")
                    .unwrap(),
            ),
            kv_waiting: register(
                &r,
                IntGauge::new(
                    "tandem_router_kv_waiting",
                    "Requests waiting in line for free KV blocks on a decode worker.",
                )
                .unwrap(),
            ),
            kv_waits: register(
                &r,
                IntCounter::new(
                    "tandem_router_kv_waits_total",
                    "Reserve calls a decode worker refused for lack of free KV blocks; the request paused and tried again.",
                )
                .unwrap(),
            ),
            cached_prompt_tokens: register(
                &r,
                IntCounter::new(
                    "tandem_router_cached_prompt_tokens_total",
                    "Prompt tokens workers took from their prefix cache instead of computing them.",
                )
                .unwrap(),
            ),
            cache_routed: register(
                &r,
                IntCounter::new(
                    "tandem_router_cache_routed_requests_total",
                    "Requests routed to a worker whose cache digest held the start of their prompt.",
                )
                .unwrap(),
            ),
            migrations: register(
                &r,
                IntCounter::new(
                    "tandem_router_migrations_total",
                    "Times a request moved to another decode worker after the one holding its sequence was lost.",
                )
                .unwrap(),
            ),
            registry: r,
        };
        metrics.set_workers(&WorkerCounts::default());
        metrics
    }

    /// Counts a request that ended (or was refused) on `api`; `error_kind` for failures.
    pub fn finished(&self, api: &str, outcome: Outcome, error_kind: Option<&str>) {
        self.requests.with_label_values(&[api, outcome.label()]).inc();
        if let Some(kind) = error_kind {
            self.errors.with_label_values(&[kind]).inc();
        }
    }

    /// Publishes the worker table's counts (every role/state pair, zeros included).
    pub fn set_workers(&self, counts: &WorkerCounts) {
        for (role, state, n) in counts.rows() {
            self.workers.with_label_values(&[role, state]).set(n as i64);
        }
    }

    /// Records one KV transfer as a prefill worker reported it.
    pub fn kv_transfer(&self, transport: &str, bytes: u64, seconds: f64) {
        self.kv_transfer_bytes.with_label_values(&[transport]).inc_by(bytes);
        if seconds.is_finite() && seconds >= 0.0 {
            self.kv_transfer_seconds.with_label_values(&[transport]).inc_by(seconds);
        }
    }
}

impl Default for RouterMetrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_renders_with_help() {
        let m = RouterMetrics::new();
        m.finished("grpc", Outcome::Error, Some("invalid_argument"));
        m.kv_transfer("tcp", 4096, 0.002);
        m.ttft.observe(0.03);
        m.inter_token.observe(0.01);
        m.e2e.observe(0.5);
        let text = tandem_serve::ops::render(&m.registry);
        for name in [
            "tandem_router_requests_total",
            "tandem_router_errors_total",
            "tandem_router_ttft_seconds",
            "tandem_router_inter_token_seconds",
            "tandem_router_e2e_seconds",
            "tandem_router_requests_in_flight",
            "tandem_router_queue_depth",
            "tandem_router_prompt_tokens_total",
            "tandem_router_generated_tokens_total",
            "tandem_router_workers",
            "tandem_router_kv_transfer_bytes_total",
            "tandem_router_kv_transfer_seconds_total",
            "tandem_router_draining",
            "tandem_router_kv_waits_total",
            "tandem_router_kv_waiting",
            "tandem_router_cached_prompt_tokens_total",
            "tandem_router_cache_routed_requests_total",
            "tandem_router_migrations_total",
        ] {
            assert!(text.contains(&format!("# HELP {name} ")), "{name} missing:\n{text}");
        }
        assert!(text.contains("tandem_router_requests_total{api=\"grpc\",outcome=\"error\"} 1"), "{text}");
        assert!(text.contains("tandem_router_kv_transfer_bytes_total{transport=\"tcp\"} 4096"), "{text}");
        assert!(text.contains("tandem_router_workers{role=\"decode\",state=\"serving\"} 0"), "{text}");
    }
}
