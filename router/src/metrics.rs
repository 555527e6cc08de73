//! The router's Prometheus metrics, registered in the router's own registry (served at
//! `/metrics`).
//!
//! Latencies are measured where the client sees them: TTFT from the moment the router received
//! the request to the moment it handed the first token to the client's stream, inter-token
//! latency between successive token messages (one observation per token, so a message carrying
//! several tokens counts its gap once and the rest as zero-wait tokens), end-to-end latency from
//! receipt to the last message. KV transfer volume comes from the prefill worker's own report, and
//! so do cached prompt tokens (a colocated worker's from its first decode message).
//!
//! Beside the `tandem_router_*` metrics, the ones dashboards, autoscalers and gateway scorers read
//! from vLLM (names, types and labels as vLLM's documentation gives them, each labelled
//! `model_name` with the served model's name): `vllm:prompt_tokens_total`,
//! `vllm:generation_tokens_total`, `vllm:request_success_total{finished_reason}` (`stop`, `length`,
//! `abort`), and the histograms `vllm:time_to_first_token_seconds`,
//! `vllm:inter_token_latency_seconds` and `vllm:e2e_request_latency_seconds`. Each is updated
//! where its `tandem_router_*` twin is, by the same call ([`Twin`]), so the two never disagree.
//! The list lives in `docs/vllm-metrics.txt`, which the tests hold both to.

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

/// A `tandem_router_*` metric and its vLLM-named twin, updated together.
#[derive(Clone)]
pub struct Twin<M> {
    pub tandem: M,
    pub vllm: M,
}

impl Twin<Histogram> {
    pub fn observe(&self, v: f64) {
        self.tandem.observe(v);
        self.vllm.observe(v);
    }
}

impl Twin<IntCounter> {
    pub fn inc_by(&self, n: u64) {
        self.tandem.inc_by(n);
        self.vllm.inc_by(n);
    }
}

/// Every metric the router exports.
pub struct RouterMetrics {
    /// The registry they live in (this router's only; never the process-global one).
    pub registry: Registry,
    /// `tandem_router_requests_total{api,outcome}`.
    pub requests: IntCounterVec,
    /// `tandem_router_errors_total{kind}`.
    pub errors: IntCounterVec,
    /// `tandem_router_ttft_seconds` and `vllm:time_to_first_token_seconds`.
    pub ttft: Twin<Histogram>,
    /// `tandem_router_inter_token_seconds` and `vllm:inter_token_latency_seconds`.
    pub inter_token: Twin<Histogram>,
    /// `tandem_router_e2e_seconds` and `vllm:e2e_request_latency_seconds`.
    pub e2e: Twin<Histogram>,
    /// `tandem_router_requests_in_flight`.
    pub in_flight: IntGauge,
    /// `tandem_router_queue_depth`: accepted requests without a first token yet.
    pub queue_depth: IntGauge,
    /// `tandem_router_prompt_tokens_total` and `vllm:prompt_tokens_total`.
    pub prompt_tokens: Twin<IntCounter>,
    /// `tandem_router_generated_tokens_total` and `vllm:generation_tokens_total`.
    pub generated_tokens: Twin<IntCounter>,
    /// `vllm:request_success_total{model_name,finished_reason}`.
    pub vllm_success: IntCounterVec,
    /// The served model's name, the vLLM metrics' `model_name` label.
    model_name: String,
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
    /// `tandem_router_migrations_total{phase}`: times a request moved to other workers after one
    /// of its own was lost: `prefill` (the prefill worker, before it answered) or `decode` (the
    /// worker holding its sequence).
    pub migrations: IntCounterVec,
    /// `tandem_router_decode_prefills_total{reason}`: prompts a decode worker computed itself
    /// because no prefill worker could (`--prefill-fallback decode`): `no_prefill_worker` (none
    /// usable when the request was placed or moved) or `kv_transfer_failed` (the prefill worker
    /// computed the prompt but its KV never arrived whole, so the decode worker recomputed it).
    pub decode_prefills: IntCounterVec,
    /// `tandem_router_lost_worker_waits_total{outcome}`: requests whose worker was lost before
    /// their first token with no other worker to take them, that waited for one
    /// (`--lost-worker-wait-ms`): `resumed` (one came) or `gave_up`.
    pub lost_worker_waits: IntCounterVec,
    /// Admin API calls by action (load, unload, list) and outcome (`ok`: 2xx, `refused`: 4xx,
    /// `failed`: 5xx).
    pub admin_calls: IntCounterVec,
}

/// Why a decode worker computed a prompt itself (`tandem_router_decode_prefills_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodePrefill {
    /// No prefill worker was usable.
    NoPrefillWorker,
    /// The prompt's KV transfer failed after the prefill worker computed it.
    KvTransferFailed,
}

impl DecodePrefill {
    /// The metric's `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            DecodePrefill::NoPrefillWorker => "no_prefill_worker",
            DecodePrefill::KvTransferFailed => "kv_transfer_failed",
        }
    }
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
    /// Creates and registers every router metric in a fresh registry; `model_name` labels the
    /// vLLM-named ones.
    pub fn new(model_name: &str) -> RouterMetrics {
        let r = tandem_serve::ops::new_registry();
        let hist = |name: &str, help: &str, buckets: &[f64]| {
            register(
                &r,
                Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec())).unwrap(),
            )
        };
        let vllm_hist = |name: &str, help: &str, buckets: &[f64]| {
            let opts = HistogramOpts::new(name, help)
                .buckets(buckets.to_vec())
                .const_label("model_name", model_name);
            register(&r, Histogram::with_opts(opts).unwrap())
        };
        let vllm_counter = |name: &str, help: &str| {
            let opts = Opts::new(name, help).const_label("model_name", model_name);
            register(&r, IntCounter::with_opts(opts).unwrap())
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
            ttft: Twin {
                tandem: hist(
                    "tandem_router_ttft_seconds",
                    "Time from receiving a request to sending its first token.",
                    LATENCY_BUCKETS,
                ),
                vllm: vllm_hist(
                    "vllm:time_to_first_token_seconds",
                    "Histogram of time to first token in seconds (tandem_router_ttft_seconds).",
                    LATENCY_BUCKETS,
                ),
            },
            inter_token: Twin {
                tandem: hist(
                    "tandem_router_inter_token_seconds",
                    "Time between successive tokens sent to a client (one observation per token).",
                    INTER_TOKEN_BUCKETS,
                ),
                vllm: vllm_hist(
                    "vllm:inter_token_latency_seconds",
                    "Histogram of inter-token latency in seconds (tandem_router_inter_token_seconds).",
                    INTER_TOKEN_BUCKETS,
                ),
            },
            e2e: Twin {
                tandem: hist(
                    "tandem_router_e2e_seconds",
                    "Time from receiving a request to its last message.",
                    LATENCY_BUCKETS,
                ),
                vllm: vllm_hist(
                    "vllm:e2e_request_latency_seconds",
                    "Histogram of end-to-end request latency in seconds (tandem_router_e2e_seconds).",
                    LATENCY_BUCKETS,
                ),
            },
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
            prompt_tokens: Twin {
                tandem: register(
                    &r,
                    IntCounter::new("tandem_router_prompt_tokens_total", "Prompt tokens of the requests started.")
                        .unwrap(),
                ),
                vllm: vllm_counter(
                    "vllm:prompt_tokens_total",
                    "Number of prefill tokens processed (tandem_router_prompt_tokens_total).",
                ),
            },
            generated_tokens: Twin {
                tandem: register(
                    &r,
                    IntCounter::new("tandem_router_generated_tokens_total", "Tokens sent to clients.").unwrap(),
                ),
                vllm: vllm_counter(
                    "vllm:generation_tokens_total",
                    "Number of generation tokens processed (tandem_router_generated_tokens_total).",
                ),
            },
            vllm_success: register(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "vllm:request_success_total",
                        "Count of finished requests by finish reason (stop, length, abort).",
                    ),
                    &["model_name", "finished_reason"],
                )
                .unwrap(),
            ),
            model_name: model_name.to_owned(),
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
                IntCounterVec::new(
                    Opts::new(
                        "tandem_router_migrations_total",
                        "Times a request moved to other workers after one of its own was lost, by the phase it was in (prefill or decode).",
                    ),
                    &["phase"],
                )
                .unwrap(),
            ),
            decode_prefills: register(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "tandem_router_decode_prefills_total",
                        "Prompts a decode worker computed itself (--prefill-fallback decode), by reason: no usable prefill worker, or a KV transfer that failed after its prefill.",
                    ),
                    &["reason"],
                )
                .unwrap(),
            ),
            lost_worker_waits: register(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "tandem_router_lost_worker_waits_total",
                        "Requests whose worker was lost before their first token, with no other worker to take them, that waited for one (--lost-worker-wait-ms), by outcome: resumed or gave_up.",
                    ),
                    &["outcome"],
                )
                .unwrap(),
            ),
            admin_calls: register(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "tandem_router_admin_calls_total",
                        "Admin API calls (LoRA adapters), by action (load, unload, list) and outcome: ok (2xx), refused (4xx: the key, the body, an adapter the workers could not read or do not hold), failed (5xx: a worker failed or could not be reached).",
                    ),
                    &["action", "outcome"],
                )
                .unwrap(),
            ),
            registry: r,
        };
        metrics.set_workers(&WorkerCounts::default());
        for phase in ["prefill", "decode"] {
            metrics.migrations.with_label_values(&[phase]); // shown at 0 from the start
        }
        for reason in [DecodePrefill::NoPrefillWorker, DecodePrefill::KvTransferFailed] {
            metrics.decode_prefills.with_label_values(&[reason.label()]);
        }
        for outcome in ["resumed", "gave_up"] {
            metrics.lost_worker_waits.with_label_values(&[outcome]);
        }
        for action in ["load", "unload", "list"] {
            for outcome in ["ok", "refused", "failed"] {
                metrics.admin_calls.with_label_values(&[action, outcome]);
            }
        }
        metrics
    }

    /// Counts an admin call of `action` answered with `status`.
    pub fn admin_call(&self, action: &str, status: u16) {
        let outcome = match status {
            200..=299 => "ok",
            400..=499 => "refused",
            _ => "failed",
        };
        self.admin_calls.with_label_values(&[action, outcome]).inc();
    }

    /// Counts a request that ended (or was refused) on `api`; `error_kind` for failures.
    pub fn finished(&self, api: &str, outcome: Outcome, error_kind: Option<&str>) {
        self.requests.with_label_values(&[api, outcome.label()]).inc();
        if let Some(kind) = error_kind {
            self.errors.with_label_values(&[kind]).inc();
        }
        if outcome == Outcome::Cancelled {
            self.vllm_success.with_label_values(&[&self.model_name, "abort"]).inc();
        }
    }

    /// Counts a request that completed, by its OpenAI finish reason (`stop` or `length`), in
    /// `vllm:request_success_total`.
    pub fn succeeded(&self, finish_reason: &str) {
        self.vllm_success.with_label_values(&[&self.model_name, finish_reason]).inc();
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
        Self::new("")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_renders_with_help() {
        let m = RouterMetrics::new("tiny");
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
            "tandem_router_decode_prefills_total",
            "tandem_router_lost_worker_waits_total",
        ] {
            assert!(text.contains(&format!("# HELP {name} ")), "{name} missing:\n{text}");
        }
        assert!(text.contains("tandem_router_requests_total{api=\"grpc\",outcome=\"error\"} 1"), "{text}");
        assert!(text.contains("tandem_router_kv_transfer_bytes_total{transport=\"tcp\"} 4096"), "{text}");
        assert!(text.contains("tandem_router_workers{role=\"decode\",state=\"serving\"} 0"), "{text}");
        // The vLLM twins move with the tandem ones, labelled with the model.
        assert!(text.contains("vllm:time_to_first_token_seconds_count{model_name=\"tiny\"} 1"), "{text}");
        assert!(text.contains("vllm:e2e_request_latency_seconds_sum{model_name=\"tiny\"} 0.5"), "{text}");
        m.prompt_tokens.inc_by(7);
        m.succeeded("length");
        m.finished("http", Outcome::Cancelled, None);
        let text = tandem_serve::ops::render(&m.registry);
        assert!(text.contains("vllm:prompt_tokens_total{model_name=\"tiny\"} 7"), "{text}");
        assert!(text.contains("tandem_router_prompt_tokens_total 7"), "{text}");
        assert_eq!(tandem_serve::ops::check_vllm_metrics(&text, "router"), Ok(6), "{text}");
        for reason in ["length", "abort"] {
            let line =
                format!("vllm:request_success_total{{finished_reason=\"{reason}\",model_name=\"tiny\"}} 1");
            assert!(text.contains(&line), "{line} missing:\n{text}");
        }
    }
}
