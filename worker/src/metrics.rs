//! A worker's Prometheus metrics, in the process's own registry (served at `GET /metrics`).
//!
//! Two kinds of values:
//! - counters that handlers and sinks bump where things happen (prompt tokens prefilled, tokens
//!   generated, requests and their errors by gRPC code);
//! - values read at scrape time from what the worker already keeps ([`LiveValues`]: the engine
//!   snapshot, readiness, and the KV transport's transfer counters per transport), through a
//!   collector that refreshes its gauges and mirrors those counters before they are rendered.
//!
//! Tokens per second are the tokens of the last [`RATE_WINDOW`] divided by that window (or by the
//! time since the worker started, when that is shorter).
//!
//! A worker whose engine speculates also reports its draft tokens (`tandem_worker_spec_*`:
//! proposed, accepted and verifications as counters, the acceptance rate and the mean accepted
//! length as gauges), mirrored from the engine's own cumulative counters at scrape time; a worker
//! that does not speculate has none of these families.
//!
//! A decode or colocated worker with an inter-token latency target reports its step budget
//! (`tandem_worker_step_*`: the target, the calibrated step-cost model and the slowdown factor
//! that follows measured steps, all gauges); a worker without one has none of these families.
//!
//! A worker with LoRA adapter slots reports them (`tandem_worker_lora_*`: adapters held and
//! resident, slots, and sequences waiting for a slot as gauges, slot loads as a counter); a
//! worker started with `--max-loras 0` has none of these families.
//!
//! A worker with a prefix cache reports it (`tandem_worker_prefix_cache_*`: lookups, tokens looked
//! up, hit tokens, evictions and prompt tokens computed as counters, cached blocks as a gauge);
//! a worker started with `--prefix-cache false` has none of these families.
//!
//! Beside them, the gauges and counters that autoscalers and gateway scorers read from vLLM,
//! labelled `model_name` (names, types and labels as vLLM's documentation gives them; the list is
//! `docs/vllm-metrics.txt`): `vllm:num_requests_running` (sequences holding KV blocks),
//! `vllm:num_requests_waiting` (sequences waiting for admission), `vllm:kv_cache_usage_perc` (the
//! fraction of KV blocks in use, 0 to 1, as vLLM's is despite its name), and, with a prefix cache,
//! `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (prompt tokens looked up
//! and found, as vLLM counts them).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus::core::{Collector, Desc};
use prometheus::{
    Counter, CounterVec, Gauge, GaugeVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};
use tandem_engine::kv::{TierCounters, TierStats};
use tandem_engine::scheduler::cost::StepCost;
use tandem_engine::scheduler::{AdapterStats, PrefixStats, TierEngineStats};
use tandem_engine::spec::SpecStats;
use tonic::Status;

use tandem_transport::{TransferCounters, TransportKind};

/// The window of the tokens-per-second gauges.
pub const RATE_WINDOW: Duration = Duration::from_secs(10);

/// Granularity of a [`RateWindow`]'s buckets.
const BUCKET: Duration = Duration::from_millis(250);

/// Counts of events over a sliding window, in buckets of [`BUCKET`].
#[derive(Debug)]
pub struct RateWindow {
    started: Instant,
    window: Duration,
    buckets: Mutex<VecDeque<(Instant, u64)>>,
}

impl RateWindow {
    /// An empty window of length `window` starting at `now`.
    pub fn new(now: Instant, window: Duration) -> RateWindow {
        RateWindow { started: now, window, buckets: Mutex::new(VecDeque::new()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<(Instant, u64)>> {
        self.buckets.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records `n` events at `now`.
    pub fn add(&self, now: Instant, n: u64) {
        let mut b = self.lock();
        match b.back_mut() {
            Some((t, c)) if now.saturating_duration_since(*t) < BUCKET => *c += n,
            _ => b.push_back((now, n)),
        }
        self.expire(&mut b, now);
    }

    fn expire(&self, b: &mut VecDeque<(Instant, u64)>, now: Instant) {
        while b.front().is_some_and(|(t, _)| now.saturating_duration_since(*t) > self.window) {
            b.pop_front();
        }
    }

    /// Events per second over the window ending at `now`.
    pub fn rate(&self, now: Instant) -> f64 {
        let mut b = self.lock();
        self.expire(&mut b, now);
        let n: u64 = b.iter().map(|(_, c)| c).sum();
        let span = now.saturating_duration_since(self.started).min(self.window).max(Duration::from_secs(1));
        n as f64 / span.as_secs_f64()
    }
}

/// What the collector reads at scrape time.
#[derive(Debug, Clone, Default)]
pub struct LiveValues {
    pub kv_used: u64,
    pub kv_free: u64,
    pub kv_capacity: u64,
    pub running: u64,
    pub queue_depth: u64,
    pub reservations: u64,
    pub engine_steps: u64,
    /// The engine's speculation counters; `None` when it does not speculate.
    pub spec: Option<SpecStats>,
    /// The engine's prefix-cache counters; `None` without a prefix cache.
    pub prefix: Option<PrefixStats>,
    /// The KV tiers' counters and the engine's; `None` without tiers.
    pub tiers: Option<(TierStats, TierEngineStats)>,
    /// The engine's step-cost model and inter-token target; `None` without a latency budget.
    pub step_cost: Option<(StepCost, Duration)>,
    /// The engine's LoRA adapter counters; `None` without adapter slots.
    pub adapters: Option<AdapterStats>,
    pub draining: bool,
    pub ready: bool,
    /// Transfer counters of each transport the worker has (sender side on prefill workers,
    /// receiver side on decode workers).
    pub transfers: Vec<(TransportKind, TransferCounters)>,
}

/// Reads [`LiveValues`]; `None` when the worker is gone (the collector then reports nothing).
pub type LiveSource = Box<dyn Fn() -> Option<LiveValues> + Send + Sync>;

/// A worker's metrics.
pub struct WorkerMetrics {
    registry: Registry,
    prefill_tokens: IntCounter,
    decode_tokens: IntCounter,
    prefill_rate: Arc<RateWindow>,
    decode_rate: Arc<RateWindow>,
    requests: IntCounterVec,
    errors: IntCounterVec,
    reserve_refusals: IntCounter,
}

fn must<T>(r: prometheus::Result<T>) -> T {
    // Names and labels are constants of this file; an error here is a bug caught by its tests.
    r.unwrap_or_else(|e| panic!("worker metric definition: {e}"))
}

impl WorkerMetrics {
    /// Fresh metrics in a fresh registry; the gauges and mirrored counters read `live`.
    /// The metrics of a worker serving `model_name` (the vLLM-named metrics' label).
    pub fn new(live: LiveSource, model_name: &str) -> WorkerMetrics {
        let registry = tandem_serve::ops::new_registry();
        let now = Instant::now();
        let prefill_tokens = must(IntCounter::new(
            "tandem_worker_prefill_tokens_total",
            "Prompt tokens prefilled on this worker.",
        ));
        let decode_tokens = must(IntCounter::new(
            "tandem_worker_decode_tokens_total",
            "Tokens generated (decoded) on this worker.",
        ));
        let requests = must(IntCounterVec::new(
            Opts::new(
                "tandem_worker_requests_total",
                "Prefill and Decode requests by outcome (ok or error).",
            ),
            &["outcome"],
        ));
        let errors = must(IntCounterVec::new(
            Opts::new("tandem_worker_errors_total", "Errors the Worker service answered, by gRPC code."),
            &["code"],
        ));
        let reserve_refusals = must(IntCounter::new(
            "tandem_worker_reserve_refusals_total",
            "Reserve calls refused for lack of room (the router waits and asks again); not errors.",
        ));
        for c in ["ok", "error"] {
            requests.with_label_values(&[c]);
        }
        let prefill_rate = Arc::new(RateWindow::new(now, RATE_WINDOW));
        let decode_rate = Arc::new(RateWindow::new(now, RATE_WINDOW));
        for c in [Box::new(prefill_tokens.clone()) as Box<dyn Collector>, Box::new(decode_tokens.clone())] {
            must(registry.register(c));
        }
        must(registry.register(Box::new(requests.clone())));
        must(registry.register(Box::new(errors.clone())));
        must(registry.register(Box::new(reserve_refusals.clone())));
        must(registry.register(Box::new(LiveCollector::new(
            live,
            prefill_rate.clone(),
            decode_rate.clone(),
            model_name,
        ))));
        WorkerMetrics {
            registry,
            prefill_tokens,
            decode_tokens,
            prefill_rate,
            decode_rate,
            requests,
            errors,
            reserve_refusals,
        }
    }

    /// The registry `/metrics` renders.
    pub fn registry(&self) -> Registry {
        self.registry.clone()
    }

    /// `n` prompt tokens were prefilled.
    pub fn prefilled(&self, n: u64) {
        self.prefill_tokens.inc_by(n);
        self.prefill_rate.add(Instant::now(), n);
    }

    /// `n` tokens were generated.
    pub fn decoded(&self, n: u64) {
        self.decode_tokens.inc_by(n);
        self.decode_rate.add(Instant::now(), n);
    }

    /// A Prefill or Decode request ended.
    pub fn request(&self, outcome: Result<(), &Status>) {
        match outcome {
            Ok(()) => self.requests.with_label_values(&["ok"]).inc(),
            Err(st) => {
                self.requests.with_label_values(&["error"]).inc();
                self.error(st);
            }
        }
    }

    /// A Reserve was refused for lack of room: routine back-pressure, counted apart from errors.
    pub fn reserve_refused(&self) {
        self.reserve_refusals.inc();
    }

    /// The Worker service answered `st` (any method).
    pub fn error(&self, st: &Status) {
        self.errors.with_label_values(&[code_name(st.code())]).inc();
    }
}

/// The gRPC code's name as the gRPC specification spells it (`UNAVAILABLE`, ...).
pub fn code_name(c: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match c {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Gauges refreshed, and counters mirrored, from a [`LiveSource`] at every scrape.
struct LiveCollector {
    source: LiveSource,
    prefill_rate: Arc<RateWindow>,
    decode_rate: Arc<RateWindow>,
    /// One scrape at a time: mirroring a counter is a reset and an add.
    scrape: Mutex<()>,
    kv_used: IntGauge,
    kv_free: IntGauge,
    kv_capacity: IntGauge,
    running: IntGauge,
    queue_depth: IntGauge,
    reservations: IntGauge,
    draining: IntGauge,
    ready: IntGauge,
    prefill_tps: Gauge,
    decode_tps: Gauge,
    steps: IntCounter,
    transfers: IntCounterVec,
    transfer_bytes: IntCounterVec,
    transfer_seconds: CounterVec,
    /// vLLM's names for `running`, `queue_depth` and the used fraction of the KV pool.
    vllm_running: IntGauge,
    vllm_waiting: IntGauge,
    vllm_kv_usage: Gauge,
    spec: SpecMetrics,
    prefix: PrefixMetrics,
    tiers: TierMetrics,
    step: StepMetrics,
    lora: LoraMetrics,
    descs: Vec<Desc>,
}

/// Options of a vLLM-named metric, labelled with the served model.
fn vllm_opts(name: &str, help: &str, model_name: &str) -> Opts {
    Opts::new(name, help).const_label("model_name", model_name)
}

/// The KV tier families (label `tier`: host or disk), rendered only by a worker with tiers.
struct TierMetrics {
    capacity: IntGaugeVec,
    bytes: IntGaugeVec,
    blocks: IntGaugeVec,
    hits: IntCounterVec,
    spills: IntCounterVec,
    reloads: IntCounterVec,
    drops: IntCounterVec,
    evictions: IntCounterVec,
    errors: IntCounterVec,
    reload_seconds: CounterVec,
    queued_write_bytes: IntGauge,
    queued_spill_bytes: IntGauge,
    unpinned_pages: IntCounter,
    reloaded_pages: IntCounter,
    waits: IntCounter,
    wait_timeouts: IntCounter,
}

impl TierMetrics {
    fn new() -> TierMetrics {
        let g = |n: &str, h: &str| must(IntGaugeVec::new(Opts::new(n, h), &["tier"]));
        let c = |n: &str, h: &str| must(IntCounterVec::new(Opts::new(n, h), &["tier"]));
        TierMetrics {
            capacity: g("tandem_worker_kv_tier_capacity_bytes", "Capacity of the KV tier in bytes."),
            bytes: g("tandem_worker_kv_tier_bytes", "Bytes of KV pages the tier holds."),
            blocks: g(
                "tandem_worker_kv_tier_blocks",
                "KV pages (one pool block of every layer) the tier holds.",
            ),
            hits: c(
                "tandem_worker_kv_tier_hits_total",
                "Pages the tier handed back to the pool instead of computing them.",
            ),
            spills: c(
                "tandem_worker_kv_tier_spills_total",
                "Pages stored in the tier after the pool evicted them.",
            ),
            reloads: c(
                "tandem_worker_kv_tier_reloads_total",
                "Pages read back from the tier into memory (disk: files read and checked).",
            ),
            drops: c(
                "tandem_worker_kv_tier_drops_total",
                "Pages the tier could not store (write queue full, disk full, I/O error).",
            ),
            evictions: c(
                "tandem_worker_kv_tier_evictions_total",
                "Pages evicted from the tier for capacity, oldest first.",
            ),
            errors: c(
                "tandem_worker_kv_tier_errors_total",
                "I/O errors and rejected pages (bad checksum or header) on reads; those tokens are computed.",
            ),
            reload_seconds: must(CounterVec::new(
                Opts::new(
                    "tandem_worker_kv_tier_reload_seconds_total",
                    "Time spent reading pages back from the tier.",
                ),
                &["tier"],
            )),
            queued_write_bytes: must(IntGauge::new(
                "tandem_worker_kv_tier_queued_write_bytes",
                "Bytes of pages waiting to be written to the disk tier.",
            )),
            queued_spill_bytes: must(IntGauge::new(
                "tandem_worker_kv_tier_queued_spill_bytes",
                "Bytes of evicted pages whose copy out of the KV pool is still in flight, or whose checksum is not yet taken.",
            )),
            unpinned_pages: must(IntCounter::new(
                "tandem_worker_kv_tier_unpinned_pages_total",
                "Pages kept in ordinary heap memory because every slot of the tiers' pinned host memory was in use (GPU workers).",
            )),
            reloaded_pages: must(IntCounter::new(
                "tandem_worker_kv_tier_reloaded_pages_total",
                "Pages written back into the KV pool from a tier (they then serve as prefix-cache hits).",
            )),
            waits: must(IntCounter::new(
                "tandem_worker_kv_tier_waits_total",
                "Times a sequence waited outside the queue for its prefix's pages to be read from disk.",
            )),
            wait_timeouts: must(IntCounter::new(
                "tandem_worker_kv_tier_wait_timeouts_total",
                "Of those, the ones admitted before every page arrived (the rest was computed).",
            )),
        }
    }

    fn update(&self, (t, e): &(TierStats, TierEngineStats)) {
        let i = |x: u64| x.min(i64::MAX as u64) as i64;
        let tiers: [(&str, &Option<TierCounters>); 2] = [("host", &t.host), ("disk", &t.disk)];
        for (name, c) in tiers {
            let Some(c) = c else { continue };
            self.capacity.with_label_values(&[name]).set(i(c.capacity_bytes));
            self.bytes.with_label_values(&[name]).set(i(c.bytes));
            self.blocks.with_label_values(&[name]).set(i(c.blocks));
            mirror_int(&self.hits.with_label_values(&[name]), c.hits);
            mirror_int(&self.spills.with_label_values(&[name]), c.spills);
            mirror_int(&self.reloads.with_label_values(&[name]), c.reloads);
            mirror_int(&self.drops.with_label_values(&[name]), c.drops);
            mirror_int(&self.evictions.with_label_values(&[name]), c.evictions);
            mirror_int(&self.errors.with_label_values(&[name]), c.errors);
            mirror(&self.reload_seconds.with_label_values(&[name]), c.reload_seconds);
        }
        self.queued_write_bytes.set(i(t.queued_write_bytes));
        self.queued_spill_bytes.set(i(t.queued_spill_bytes));
        mirror_int(&self.unpinned_pages, t.unpinned_pages);
        mirror_int(&self.reloaded_pages, e.reloaded_pages);
        mirror_int(&self.waits, e.waits);
        mirror_int(&self.wait_timeouts, e.wait_timeouts);
    }

    fn collectors(&self) -> Vec<&dyn Collector> {
        vec![
            &self.capacity,
            &self.bytes,
            &self.blocks,
            &self.hits,
            &self.spills,
            &self.reloads,
            &self.drops,
            &self.evictions,
            &self.errors,
            &self.reload_seconds,
            &self.queued_write_bytes,
            &self.queued_spill_bytes,
            &self.unpinned_pages,
            &self.reloaded_pages,
            &self.waits,
            &self.wait_timeouts,
        ]
    }
}

/// The prefix-cache families, rendered only by a worker with a prefix cache.
struct PrefixMetrics {
    lookups: IntCounter,
    lookup_tokens: IntCounter,
    hit_tokens: IntCounter,
    evictions: IntCounter,
    computed_prompt_tokens: IntCounter,
    cached_blocks: IntGauge,
    /// vLLM's names for `lookup_tokens` and `hit_tokens` (vLLM counts prefix-cache queries and
    /// hits in tokens).
    vllm_queries: IntCounter,
    vllm_hits: IntCounter,
}

impl PrefixMetrics {
    fn new(model_name: &str) -> PrefixMetrics {
        let c = |n: &str, h: &str| must(IntCounter::new(n, h));
        let vllm = |n: &str, h: &str| must(IntCounter::with_opts(vllm_opts(n, h, model_name)));
        PrefixMetrics {
            vllm_queries: vllm(
                "vllm:prefix_cache_queries_total",
                "Prefix cache queries, in prompt tokens looked up (tandem_worker_prefix_cache_lookup_tokens_total).",
            ),
            vllm_hits: vllm(
                "vllm:prefix_cache_hits_total",
                "Prefix cache hits, in prompt tokens found (tandem_worker_prefix_cache_hit_tokens_total).",
            ),
            lookups: c(
                "tandem_worker_prefix_cache_lookups_total",
                "Prompts looked up in the prefix cache (new sequences and reservations).",
            ),
            lookup_tokens: c("tandem_worker_prefix_cache_lookup_tokens_total", "Prompt tokens looked up in the prefix cache."),
            hit_tokens: c(
                "tandem_worker_prefix_cache_hit_tokens_total",
                "Prompt tokens found in the prefix cache: not computed (or, for a reservation, not transferred).",
            ),
            evictions: c(
                "tandem_worker_prefix_cache_evictions_total",
                "Cached KV blocks evicted (least recently used first) to make room.",
            ),
            computed_prompt_tokens: c(
                "tandem_worker_prefix_cache_computed_prompt_tokens_total",
                "Prompt tokens computed by forward passes (cache hits excluded, recomputation after preemption included).",
            ),
            cached_blocks: must(IntGauge::new(
                "tandem_worker_prefix_cache_blocks",
                "KV blocks cached and held by nobody (evictable; counted neither free nor used).",
            )),
        }
    }

    fn update(&self, s: &PrefixStats) {
        mirror_int(&self.lookups, s.lookups);
        mirror_int(&self.lookup_tokens, s.lookup_tokens);
        mirror_int(&self.hit_tokens, s.hit_tokens);
        mirror_int(&self.evictions, s.evictions);
        mirror_int(&self.computed_prompt_tokens, s.computed_prompt_tokens);
        self.cached_blocks.set(s.cached_blocks.min(i64::MAX as usize) as i64);
        mirror_int(&self.vllm_queries, s.lookup_tokens);
        mirror_int(&self.vllm_hits, s.hit_tokens);
    }

    fn collectors(&self) -> Vec<&dyn Collector> {
        vec![
            &self.lookups,
            &self.lookup_tokens,
            &self.hit_tokens,
            &self.evictions,
            &self.computed_prompt_tokens,
            &self.cached_blocks,
            &self.vllm_queries,
            &self.vllm_hits,
        ]
    }
}

/// The LoRA adapter families, rendered only by a worker with adapter slots.
struct LoraMetrics {
    held: IntGauge,
    resident: IntGauge,
    slots: IntGauge,
    loads: IntCounter,
    waiting: IntGauge,
}

impl LoraMetrics {
    fn new() -> LoraMetrics {
        let g = |n: &str, h: &str| must(IntGauge::new(n, h));
        LoraMetrics {
            held: g("tandem_worker_lora_adapters", "LoRA adapters the worker holds (loaded), resident or not."),
            resident: g(
                "tandem_worker_lora_resident_adapters",
                "LoRA adapters in a backend slot now (ready to run in a pass).",
            ),
            slots: g("tandem_worker_lora_slots", "Backend slots for LoRA adapters (--max-loras)."),
            loads: must(IntCounter::new(
                "tandem_worker_lora_slot_loads_total",
                "Times an adapter was put in a backend slot (first use, or back after another took its slot).",
            )),
            waiting: g(
                "tandem_worker_lora_waiting_sequences",
                "Sequences waiting for their adapter to get a slot (every slot in use by running sequences).",
            ),
        }
    }

    fn update(&self, a: &AdapterStats) {
        let i = |x: usize| x.min(i64::MAX as usize) as i64;
        self.held.set(i(a.held));
        self.resident.set(i(a.resident));
        self.slots.set(i(a.slots));
        mirror_int(&self.loads, a.loads);
        self.waiting.set(i(a.waiting));
    }

    fn collectors(&self) -> Vec<&dyn Collector> {
        vec![&self.held, &self.resident, &self.slots, &self.loads, &self.waiting]
    }
}

/// The step-budget families, rendered only by a worker with an inter-token latency target.
struct StepMetrics {
    target: Gauge,
    cost: GaugeVec,
    slowdown: Gauge,
}

impl StepMetrics {
    fn new() -> StepMetrics {
        StepMetrics {
            target: must(Gauge::new(
                "tandem_worker_step_itl_target_seconds",
                "Inter-token latency target a step that decodes is sized to (--itl-target-ms).",
            )),
            cost: must(GaugeVec::new(
                Opts::new(
                    "tandem_worker_step_cost_seconds",
                    "The step-cost model calibrated at start-up: a pass's fixed cost and the cost of each decode and prompt token.",
                ),
                &["part"],
            )),
            slowdown: must(Gauge::new(
                "tandem_worker_step_slowdown",
                "Measured step time over the calibrated model's prediction, averaged over recent steps (above 1: steps run slower than calibrated, e.g. cores shared).",
            )),
        }
    }

    fn update(&self, cost: &StepCost, target: Duration) {
        self.target.set(target.as_secs_f64());
        for (part, ms) in [
            ("fixed", cost.fixed_ms),
            ("decode_token", cost.per_decode_ms),
            ("prompt_token", cost.per_prefill_ms),
        ] {
            self.cost.with_label_values(&[part]).set(ms / 1e3);
        }
        self.slowdown.set(cost.slowdown);
    }

    fn collectors(&self) -> Vec<&dyn Collector> {
        vec![&self.target, &self.cost, &self.slowdown]
    }
}

/// The speculation families, rendered only by a worker that speculates.
struct SpecMetrics {
    proposed: IntCounter,
    accepted: IntCounter,
    verifications: IntCounter,
    acceptance_rate: Gauge,
    mean_accepted_len: Gauge,
}

impl SpecMetrics {
    fn new() -> SpecMetrics {
        SpecMetrics {
            proposed: must(IntCounter::new(
                "tandem_worker_spec_draft_tokens_proposed_total",
                "Draft tokens proposed by the drafter and verified by the model (speculative decoding).",
            )),
            accepted: must(IntCounter::new(
                "tandem_worker_spec_draft_tokens_accepted_total",
                "Draft tokens the model accepted (speculative decoding).",
            )),
            verifications: must(IntCounter::new(
                "tandem_worker_spec_verifications_total",
                "Verification chunks run: one per speculating sequence per step.",
            )),
            acceptance_rate: must(Gauge::new(
                "tandem_worker_spec_acceptance_rate",
                "Draft tokens accepted over draft tokens proposed since the worker started (0 before any).",
            )),
            mean_accepted_len: must(Gauge::new(
                "tandem_worker_spec_mean_accepted_length",
                "Draft tokens accepted per verification since the worker started; each verification \
                 also yields one token of the model's own.",
            )),
        }
    }

    fn update(&self, s: &SpecStats) {
        mirror_int(&self.proposed, s.proposed);
        mirror_int(&self.accepted, s.accepted);
        mirror_int(&self.verifications, s.verifications);
        self.acceptance_rate.set(s.acceptance_rate());
        self.mean_accepted_len.set(s.mean_accepted_len());
    }

    fn collectors(&self) -> Vec<&dyn Collector> {
        vec![
            &self.proposed,
            &self.accepted,
            &self.verifications,
            &self.acceptance_rate,
            &self.mean_accepted_len,
        ]
    }
}

impl LiveCollector {
    fn new(
        source: LiveSource,
        prefill_rate: Arc<RateWindow>,
        decode_rate: Arc<RateWindow>,
        model_name: &str,
    ) -> LiveCollector {
        let g = |n: &str, h: &str| must(IntGauge::new(n, h));
        let mut c = LiveCollector {
            source,
            prefill_rate,
            decode_rate,
            scrape: Mutex::new(()),
            kv_used: g(
                "tandem_worker_kv_blocks_used",
                "KV-cache blocks in use (sequences and reservations).",
            ),
            kv_free: g(
                "tandem_worker_kv_blocks_free",
                "KV-cache blocks free (cached blocks, which are also allocatable, are counted apart).",
            ),
            kv_capacity: g("tandem_worker_kv_blocks_capacity", "KV-cache blocks in the pool."),
            running: g("tandem_worker_running_sequences", "Sequences holding KV blocks (computing or held)."),
            queue_depth: g("tandem_worker_queue_depth", "Sequences waiting for admission."),
            reservations: g("tandem_worker_reservations", "Outstanding KV reservations."),
            draining: g("tandem_worker_draining", "1 while the worker drains (after SIGTERM/SIGINT)."),
            ready: g("tandem_worker_ready", "1 when the worker is ready for traffic (as GET /ready says)."),
            prefill_tps: must(Gauge::new(
                "tandem_worker_prefill_tokens_per_second",
                "Prompt tokens prefilled per second over the last 10 s.",
            )),
            decode_tps: must(Gauge::new(
                "tandem_worker_decode_tokens_per_second",
                "Tokens generated per second over the last 10 s.",
            )),
            steps: must(IntCounter::new(
                "tandem_worker_engine_steps_total",
                "Engine steps (forward passes) run.",
            )),
            transfers: must(IntCounterVec::new(
                Opts::new(
                    "tandem_worker_kv_transfers_total",
                    "KV transfers by transport and outcome (ok or failed).",
                ),
                &["transport", "outcome"],
            )),
            transfer_bytes: must(IntCounterVec::new(
                Opts::new("tandem_worker_kv_transfer_bytes_total", "KV bytes moved by completed transfers."),
                &["transport"],
            )),
            transfer_seconds: must(CounterVec::new(
                Opts::new(
                    "tandem_worker_kv_transfer_seconds_total",
                    "Seconds spent in completed KV transfers.",
                ),
                &["transport"],
            )),
            vllm_running: must(IntGauge::with_opts(vllm_opts(
                "vllm:num_requests_running",
                "Number of requests in model execution batches (tandem_worker_running_sequences).",
                model_name,
            ))),
            vllm_waiting: must(IntGauge::with_opts(vllm_opts(
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed (tandem_worker_queue_depth).",
                model_name,
            ))),
            vllm_kv_usage: must(Gauge::with_opts(vllm_opts(
                "vllm:kv_cache_usage_perc",
                "KV-cache usage: the fraction of KV blocks in use, 1 meaning all (tandem_worker_kv_blocks_used / capacity).",
                model_name,
            ))),
            spec: SpecMetrics::new(),
            prefix: PrefixMetrics::new(model_name),
            tiers: TierMetrics::new(),
            step: StepMetrics::new(),
            lora: LoraMetrics::new(),
            descs: Vec::new(),
        };
        c.descs = c
            .collectors()
            .into_iter()
            .chain(c.spec.collectors())
            .chain(c.prefix.collectors())
            .chain(c.tiers.collectors())
            .chain(c.step.collectors())
            .chain(c.lora.collectors())
            .flat_map(|m| m.desc().into_iter().cloned())
            .collect();
        c
    }

    fn collectors(&self) -> Vec<&dyn Collector> {
        vec![
            &self.kv_used,
            &self.kv_free,
            &self.kv_capacity,
            &self.running,
            &self.queue_depth,
            &self.reservations,
            &self.draining,
            &self.ready,
            &self.prefill_tps,
            &self.decode_tps,
            &self.steps,
            &self.transfers,
            &self.transfer_bytes,
            &self.transfer_seconds,
            &self.vllm_running,
            &self.vllm_waiting,
            &self.vllm_kv_usage,
        ]
    }
}

fn mirror_int(c: &IntCounter, v: u64) {
    c.reset();
    c.inc_by(v);
}

fn mirror(c: &Counter, v: f64) {
    c.reset();
    c.inc_by(v.max(0.0));
}

impl Collector for LiveCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        let _one = self.scrape.lock().unwrap_or_else(|p| p.into_inner());
        let Some(v) = (self.source)() else {
            return Vec::new();
        };
        let now = Instant::now();
        let i = |x: u64| x.min(i64::MAX as u64) as i64;
        self.kv_used.set(i(v.kv_used));
        self.kv_free.set(i(v.kv_free));
        self.kv_capacity.set(i(v.kv_capacity));
        self.running.set(i(v.running));
        self.queue_depth.set(i(v.queue_depth));
        self.reservations.set(i(v.reservations));
        self.draining.set(v.draining as i64);
        self.ready.set(v.ready as i64);
        self.prefill_tps.set(self.prefill_rate.rate(now));
        self.decode_tps.set(self.decode_rate.rate(now));
        mirror_int(&self.steps, v.engine_steps);
        for (kind, c) in &v.transfers {
            let k = kind.as_str();
            mirror_int(&self.transfers.with_label_values(&[k, "ok"]), c.transfers);
            mirror_int(&self.transfers.with_label_values(&[k, "failed"]), c.failures);
            mirror_int(&self.transfer_bytes.with_label_values(&[k]), c.bytes);
            mirror(&self.transfer_seconds.with_label_values(&[k]), c.seconds);
        }
        self.vllm_running.set(i(v.running));
        self.vllm_waiting.set(i(v.queue_depth));
        let usage = if v.kv_capacity == 0 { 0.0 } else { v.kv_used as f64 / v.kv_capacity as f64 };
        self.vllm_kv_usage.set(usage);
        let mut families: Vec<_> = self.collectors().iter().flat_map(|m| m.collect()).collect();
        if let Some(spec) = &v.spec {
            self.spec.update(spec);
            families.extend(self.spec.collectors().iter().flat_map(|m| m.collect()));
        }
        if let Some(prefix) = &v.prefix {
            self.prefix.update(prefix);
            families.extend(self.prefix.collectors().iter().flat_map(|m| m.collect()));
        }
        if let Some(tiers) = &v.tiers {
            self.tiers.update(tiers);
            families.extend(self.tiers.collectors().iter().flat_map(|m| m.collect()));
        }
        if let Some((cost, target)) = &v.step_cost {
            self.step.update(cost, *target);
            families.extend(self.step.collectors().iter().flat_map(|m| m.collect()));
        }
        if let Some(a) = &v.adapters {
            self.lora.update(a);
            families.extend(self.lora.collectors().iter().flat_map(|m| m.collect()));
        }
        families
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_window_counts_the_last_ten_seconds() {
        let t0 = Instant::now();
        let w = RateWindow::new(t0, RATE_WINDOW);
        assert_eq!(w.rate(t0), 0.0);
        w.add(t0, 100);
        // Younger than a second: divided by one second.
        assert_eq!(w.rate(t0 + Duration::from_millis(500)), 100.0);
        w.add(t0 + Duration::from_secs(4), 100);
        assert_eq!(w.rate(t0 + Duration::from_secs(5)), 40.0);
        // The first 100 leave the window after 10 s.
        assert_eq!(w.rate(t0 + Duration::from_secs(12)), 10.0);
        assert_eq!(w.rate(t0 + Duration::from_secs(30)), 0.0);
    }

    #[test]
    fn every_worker_metric_renders_with_help() {
        let live = LiveValues {
            kv_used: 3,
            kv_free: 13,
            kv_capacity: 16,
            engine_steps: 7,
            ready: true,
            transfers: vec![
                (
                    TransportKind::Tcp,
                    TransferCounters { transfers: 2, bytes: 4096, seconds: 0.5, ..Default::default() },
                ),
                (TransportKind::Shm, TransferCounters { failures: 1, ..Default::default() }),
            ],
            ..Default::default()
        };
        let m = WorkerMetrics::new(Box::new(move || Some(live.clone())), "tiny");
        m.prefilled(12);
        m.decoded(5);
        m.request(Ok(()));
        m.request(Err(&Status::unavailable("draining")));
        m.error(&Status::resource_exhausted("full"));
        m.reserve_refused();
        // Twice: mirrored counters must not add up across scrapes.
        let _ = tandem_serve::ops::render(&m.registry());
        let text = tandem_serve::ops::render(&m.registry());
        for line in [
            "tandem_worker_kv_blocks_used 3",
            "tandem_worker_kv_blocks_free 13",
            "tandem_worker_kv_blocks_capacity 16",
            "tandem_worker_running_sequences 0",
            "tandem_worker_queue_depth 0",
            "tandem_worker_reservations 0",
            "tandem_worker_engine_steps_total 7",
            "tandem_worker_draining 0",
            "tandem_worker_ready 1",
            "tandem_worker_prefill_tokens_total 12",
            "tandem_worker_decode_tokens_total 5",
            "tandem_worker_requests_total{outcome=\"ok\"} 1",
            "tandem_worker_requests_total{outcome=\"error\"} 1",
            "tandem_worker_errors_total{code=\"UNAVAILABLE\"} 1",
            "tandem_worker_errors_total{code=\"RESOURCE_EXHAUSTED\"} 1",
            "tandem_worker_reserve_refusals_total 1",
            "tandem_worker_kv_transfers_total{outcome=\"ok\",transport=\"tcp\"} 2",
            "tandem_worker_kv_transfers_total{outcome=\"failed\",transport=\"shm\"} 1",
            "tandem_worker_kv_transfer_bytes_total{transport=\"tcp\"} 4096",
            "tandem_worker_kv_transfer_seconds_total{transport=\"tcp\"} 0.5",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in:\n{text}");
        }
        for name in ["tandem_worker_prefill_tokens_per_second", "tandem_worker_decode_tokens_per_second"] {
            let v: f64 = text
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")))
                .unwrap_or_else(|| panic!("no {name}"))
                .parse()
                .unwrap();
            assert!(v > 0.0, "{name} {v}");
        }
        // Every family has its HELP line.
        let families: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).collect();
        assert_eq!(families.len(), 19 + 3, "{text}"); // with the three vLLM load gauges
        for f in families {
            let name = f.split(' ').next().unwrap();
            assert!(text.contains(&format!("# HELP {name} ")), "no HELP for {name}");
        }
        // This worker does not speculate: no speculation families at all.
        assert!(!text.contains("tandem_worker_spec_"), "{text}");
        // Nor does it cache prefixes, or have a latency budget.
        assert!(!text.contains("tandem_worker_prefix_cache_"), "{text}");
        assert!(!text.contains("tandem_worker_step_"), "{text}");
        // Nor run adapters.
        assert!(!text.contains("tandem_worker_lora_"), "{text}");
    }

    #[test]
    fn a_worker_with_adapter_slots_reports_them() {
        let a = AdapterStats { held: 5, resident: 2, slots: 2, loads: 7, waiting: 3 };
        let live = LiveValues { adapters: Some(a), ..Default::default() };
        let m = WorkerMetrics::new(Box::new(move || Some(live.clone())), "tiny");
        // Twice: the mirrored counter must not add up across scrapes.
        let _ = tandem_serve::ops::render(&m.registry());
        let text = tandem_serve::ops::render(&m.registry());
        for line in [
            "tandem_worker_lora_adapters 5",
            "tandem_worker_lora_resident_adapters 2",
            "tandem_worker_lora_slots 2",
            "tandem_worker_lora_slot_loads_total 7",
            "tandem_worker_lora_waiting_sequences 3",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in:\n{text}");
        }
        let families: Vec<&str> =
            text.lines().filter_map(|l| l.strip_prefix("# TYPE tandem_worker_lora_")).collect();
        assert_eq!(families.len(), 5, "{text}");
        for f in families {
            let name = format!("tandem_worker_lora_{}", f.split(' ').next().unwrap());
            assert!(text.contains(&format!("# HELP {name} ")), "no HELP for {name}");
        }
    }

    #[test]
    fn a_worker_with_a_latency_budget_reports_its_step_cost() {
        let cost = StepCost { fixed_ms: 2.0, per_decode_ms: 0.5, per_prefill_ms: 0.25, slowdown: 1.5 };
        let live = LiveValues { step_cost: Some((cost, Duration::from_millis(100))), ..Default::default() };
        let m = WorkerMetrics::new(Box::new(move || Some(live.clone())), "tiny");
        let text = tandem_serve::ops::render(&m.registry());
        for line in [
            "tandem_worker_step_itl_target_seconds 0.1",
            "tandem_worker_step_cost_seconds{part=\"fixed\"} 0.002",
            "tandem_worker_step_cost_seconds{part=\"decode_token\"} 0.0005",
            "tandem_worker_step_cost_seconds{part=\"prompt_token\"} 0.00025",
            "tandem_worker_step_slowdown 1.5",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in:\n{text}");
        }
        for name in [
            "tandem_worker_step_itl_target_seconds",
            "tandem_worker_step_cost_seconds",
            "tandem_worker_step_slowdown",
        ] {
            assert!(text.contains(&format!("# HELP {name} ")), "no HELP for {name}");
        }
    }

    #[test]
    fn a_worker_with_a_prefix_cache_reports_it() {
        let live = LiveValues {
            prefix: Some(PrefixStats {
                lookups: 4,
                lookup_tokens: 400,
                hit_tokens: 256,
                evictions: 3,
                cached_blocks: 9,
                computed_prompt_tokens: 144,
            }),
            ..Default::default()
        };
        let m = WorkerMetrics::new(Box::new(move || Some(live.clone())), "tiny");
        // Twice: mirrored counters must not add up across scrapes.
        let _ = tandem_serve::ops::render(&m.registry());
        let text = tandem_serve::ops::render(&m.registry());
        for line in [
            "tandem_worker_prefix_cache_lookups_total 4",
            "tandem_worker_prefix_cache_lookup_tokens_total 400",
            "tandem_worker_prefix_cache_hit_tokens_total 256",
            "tandem_worker_prefix_cache_evictions_total 3",
            "tandem_worker_prefix_cache_computed_prompt_tokens_total 144",
            "tandem_worker_prefix_cache_blocks 9",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in:
{text}"
            );
        }
        let families = text.lines().filter(|l| l.starts_with("# TYPE tandem_worker_prefix_cache_")).count();
        assert_eq!(families, 6, "{text}");
        // The vLLM twins, as docs/vllm-metrics.txt lists them, in tokens as vLLM counts them.
        assert_eq!(tandem_serve::ops::check_vllm_metrics(&text, "worker"), Ok(5), "{text}");
        for line in [
            "vllm:prefix_cache_queries_total{model_name=\"tiny\"} 400",
            "vllm:prefix_cache_hits_total{model_name=\"tiny\"} 256",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in:\n{text}");
        }
    }

    #[test]
    fn the_vllm_load_gauges_follow_the_engine() {
        let live =
            LiveValues { kv_used: 3, kv_capacity: 12, running: 2, queue_depth: 5, ..Default::default() };
        let m = WorkerMetrics::new(Box::new(move || Some(live.clone())), "tiny");
        let text = tandem_serve::ops::render(&m.registry());
        for line in [
            "vllm:num_requests_running{model_name=\"tiny\"} 2",
            "vllm:num_requests_waiting{model_name=\"tiny\"} 5",
            "vllm:kv_cache_usage_perc{model_name=\"tiny\"} 0.25",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in:\n{text}");
        }
        // Without a prefix cache the prefix counters are absent, as the tandem ones are.
        let err = tandem_serve::ops::check_vllm_metrics(&text, "worker").unwrap_err();
        assert!(err.contains("vllm:prefix_cache_queries_total"), "{err}");
    }

    #[test]
    fn a_speculating_worker_reports_its_draft_tokens() {
        let live = LiveValues {
            spec: Some(SpecStats { proposed: 40, accepted: 30, verifications: 12 }),
            ..Default::default()
        };
        let m = WorkerMetrics::new(Box::new(move || Some(live.clone())), "tiny");
        // Twice: mirrored counters must not add up across scrapes.
        let _ = tandem_serve::ops::render(&m.registry());
        let text = tandem_serve::ops::render(&m.registry());
        for line in [
            "tandem_worker_spec_draft_tokens_proposed_total 40",
            "tandem_worker_spec_draft_tokens_accepted_total 30",
            "tandem_worker_spec_verifications_total 12",
            "tandem_worker_spec_acceptance_rate 0.75",
            "tandem_worker_spec_mean_accepted_length 2.5",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in:\n{text}");
        }
        let families = text.lines().filter(|l| l.starts_with("# TYPE tandem_worker_spec_")).count();
        assert_eq!(families, 5, "{text}");
        for name in ["tandem_worker_spec_acceptance_rate", "tandem_worker_spec_draft_tokens_accepted_total"] {
            assert!(text.contains(&format!("# HELP {name} ")), "no HELP for {name}");
        }
    }
}
