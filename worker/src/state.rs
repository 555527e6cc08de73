//! What every handler of a worker shares ([`WorkerState`]): its registration record, the engine
//! handle, the drain flag and in-flight count, readiness and liveness, load and stats reports,
//! and its metrics.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tandem_engine::kv::TierKind;
use tandem_proto::v1::{AdapterInfo, KvCounters, PrefixCacheCounters, StatsResponse, WorkerInfo, WorkerLoad};
use tandem_transport::{TransferCounters, TransportKind};
use tonic::Status;

use crate::engine_thread::{prefix_stats, spec_stats, EngineHandle};
use crate::kv_wire::counters_to_wire;
use crate::metrics::{LiveValues, WorkerMetrics};
use crate::readiness::{readiness, ReadinessOptions, ReadyInputs};
use crate::requests::InflightGuard;

/// Most block hashes a cache digest carries (8 bytes each): the most recently used ones.
pub const CACHE_DIGEST_LIMIT: usize = 16_384;

/// Where a worker's transfer counters come from (the KV sender or receiver): the totals for
/// `None`, one transport's for `Some`.
pub type TransferSource = Box<dyn Fn(Option<TransportKind>) -> TransferCounters + Send + Sync>;

/// The LoRA adapters a worker holds, as last read from its engine.
pub type AdapterCache = Arc<Mutex<AdapterSet>>;

/// The adapters a worker holds, and the version of that set: it starts at the process's start
/// time in microseconds since the Unix epoch and grows by one per load or unload, so that a
/// router that applied one at once can tell a heartbeat read before it (a lower version) and
/// keep its own update, and a restarted worker's lists are always newer than its old process's
/// (whose late answers cannot hold back the new one's).
#[derive(Debug, Clone, Default)]
pub struct AdapterSet {
    pub version: u64,
    pub list: Vec<AdapterInfo>,
}

impl AdapterSet {
    /// The version a process starts at: its start time in microseconds since the Unix epoch
    /// (at least 1).
    pub fn first_version() -> u64 {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        (now.as_micros() as u64).max(1)
    }

    /// A load or unload changed the set to `list`: returns the new version.
    pub fn changed(&mut self, list: Vec<AdapterInfo>) -> u64 {
        self.version += 1;
        self.list = list;
        self.version
    }
}

/// State every handler of a worker shares.
pub struct WorkerState {
    /// The worker's registration record as it started (its `adapters` are those it started
    /// with; [`WorkerState::registration_info`] and [`WorkerState::current_info`] have the
    /// current ones).
    pub info: WorkerInfo,
    /// The adapters the engine holds, as last read: written only by jobs on the engine thread
    /// (which run in order), so a later read never loses to an earlier one.
    adapters: AdapterCache,
    pub engine: EngineHandle,
    draining: AtomicBool,
    inflight: Arc<AtomicUsize>,
    finished: AtomicU64,
    failed: AtomicU64,
    transfers: TransferSource,
    /// Outstanding reservations the role tracks outside the engine (decode), for the drain.
    pending: Box<dyn Fn() -> usize + Send + Sync>,
    /// The servers are up (the model was loaded before).
    serving: AtomicBool,
    /// The router accepted the registration (and still knows this worker).
    /// One bit per router (`--router A,B,..`, at most 64) that has accepted this worker.
    registered: std::sync::atomic::AtomicU64,
    readiness: ReadinessOptions,
    /// The worker's metrics (its own registry).
    pub metrics: WorkerMetrics,
}

impl WorkerState {
    /// Shared state of a worker with registration record `info`; `transfers` reports the KV
    /// transport's counters and `pending` the work a drain waits for besides requests in flight.
    pub fn new(
        info: WorkerInfo,
        engine: EngineHandle,
        transfers: TransferSource,
        pending: Box<dyn Fn() -> usize + Send + Sync>,
        readiness: ReadinessOptions,
    ) -> Arc<WorkerState> {
        let model_name = info.compat.as_ref().map_or_else(String::new, |c| c.model_name.clone());
        Arc::new_cyclic(|me: &std::sync::Weak<WorkerState>| {
            let me = me.clone();
            WorkerState {
                adapters: Arc::new(Mutex::new(AdapterSet {
                    version: AdapterSet::first_version(),
                    list: info.adapters.clone(),
                })),
                info,
                engine,
                draining: AtomicBool::new(false),
                inflight: Arc::new(AtomicUsize::new(0)),
                finished: AtomicU64::new(0),
                failed: AtomicU64::new(0),
                transfers,
                pending,
                serving: AtomicBool::new(false),
                registered: std::sync::atomic::AtomicU64::new(0),
                readiness,
                metrics: WorkerMetrics::new(
                    Box::new(move || me.upgrade().map(|s| s.live_values())),
                    &model_name,
                ),
            }
        })
    }

    /// The cache of the engine's adapters, for a job on the engine thread that changes them to
    /// write ([`crate::convert::adapters_wire`]).
    pub fn adapter_cache(&self) -> AdapterCache {
        self.adapters.clone()
    }

    /// The adapters as last read from the engine, with their version.
    pub fn cached_adapters(&self) -> AdapterSet {
        self.adapters.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Reads the engine's adapters (and refreshes the cache with them) on the engine thread,
    /// with the version of the set they are (loads and unloads run on that thread too, in order).
    pub async fn refresh_adapters(&self) -> Result<AdapterSet, Status> {
        let cache = self.adapter_cache();
        self.engine
            .call(move |core| {
                let now = crate::convert::adapters_wire(&core.engine);
                let mut c = cache.lock().unwrap_or_else(|p| p.into_inner());
                c.list = now;
                c.clone()
            })
            .await
    }

    /// The adapters now: read from the engine if it answers within `wait` (it may be in a long
    /// step), else as last read.
    pub async fn adapters_within(&self, wait: Duration) -> AdapterSet {
        match tokio::time::timeout(wait, self.refresh_adapters()).await {
            Ok(Ok(now)) => now,
            _ => self.cached_adapters(),
        }
    }

    /// The registration record with the adapters as last read (registering never waits for the
    /// engine).
    pub fn registration_info(&self) -> WorkerInfo {
        WorkerInfo { adapters: self.cached_adapters().list, ..self.info.clone() }
    }

    /// The registration record with the adapters now (the `Info` call).
    pub async fn current_info(&self) -> WorkerInfo {
        WorkerInfo { adapters: self.adapters_within(Duration::from_secs(1)).await.list, ..self.info.clone() }
    }

    /// The servers are up: with no router to register with, the worker is ready from now on.
    pub fn set_serving(&self) {
        self.serving.store(true, Ordering::SeqCst);
    }

    /// Whether router number `router` (in `--router`'s list) has accepted this worker (and
    /// still knows it). The worker is registered while any router knows it.
    pub fn set_registered(&self, router: usize, yes: bool) {
        let bit = 1u64 << (router % 64);
        if yes {
            self.registered.fetch_or(bit, Ordering::SeqCst);
        } else {
            self.registered.fetch_and(!bit, Ordering::SeqCst);
        }
    }

    /// Whether a router other than number `router` has this worker registered now.
    pub fn registered_elsewhere(&self, router: usize) -> bool {
        self.registered.load(Ordering::SeqCst) & !(1u64 << (router % 64)) != 0
    }

    /// Whether the engine has work but finished no step for the readiness stall limit
    /// (`--ready-stall-ms`): wedged. Such a worker stops heartbeating, so routers drop it.
    pub fn wedged(&self) -> bool {
        let snap = self.engine.snapshot();
        snap.has_work && snap.progress_at.elapsed() > self.readiness.stall
    }

    /// Readiness now (see [`readiness`]).
    pub fn ready(&self) -> Result<(), String> {
        let snap = self.engine.snapshot();
        readiness(&ReadyInputs {
            serving: self.serving.load(Ordering::SeqCst),
            registered: !self.readiness.needs_registration || self.registered.load(Ordering::SeqCst) != 0,
            draining: self.draining(),
            has_work: snap.has_work,
            since_progress: snap.progress_at.elapsed(),
            stall: self.readiness.stall,
        })
    }

    /// Liveness now: the engine thread runs (or was told to stop).
    pub fn live(&self) -> Result<(), String> {
        self.engine.alive()
    }

    /// What the metrics read at scrape time.
    fn live_values(&self) -> LiveValues {
        let s = self.engine.snapshot();
        LiveValues {
            kv_used: s.kv.used as u64,
            kv_free: s.kv.free as u64,
            kv_capacity: s.kv.total as u64,
            running: (s.load.running + s.load.held) as u64,
            queue_depth: s.load.waiting as u64,
            reservations: s.load.reservations as u64,
            engine_steps: s.steps,
            spec: s.spec,
            prefix: s.prefix,
            tiers: s.tiers,
            step_cost: s.step_cost,
            adapters: s.adapters,
            draining: self.draining(),
            ready: self.ready().is_ok(),
            transfers: TransportKind::ALL
                .iter()
                .filter(|k| self.info.transports.iter().any(|o| o.kind == k.as_str()))
                .map(|&k| (k, (self.transfers)(Some(k))))
                .collect(),
        }
    }

    /// Counts an error answered by any method of the Worker service, and passes the result on.
    pub fn answered<T>(&self, r: Result<T, Status>) -> Result<T, Status> {
        if let Err(st) = &r {
            self.metrics.error(st);
        }
        r
    }

    /// Stops taking new work: readiness turns off, and new requests answer UNAVAILABLE.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// What a drain waits for: requests in flight, and work the role tracks outside them
    /// (a decode worker's reservations).
    pub fn busy(&self) -> usize {
        self.inflight_count() + (self.pending)()
    }

    /// Whether the worker is draining.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// UNAVAILABLE when draining: new work is not taken.
    pub fn check_accepting(&self) -> Result<(), Status> {
        if self.draining() {
            return Err(Status::unavailable(format!(
                "worker {} is draining (shutting down) and takes no new work",
                self.info.worker_id
            )));
        }
        Ok(())
    }

    /// Counts a request in flight until the guard drops.
    pub fn inflight(&self) -> InflightGuard {
        InflightGuard::new(self.inflight.clone())
    }

    /// Requests in flight.
    pub fn inflight_count(&self) -> usize {
        self.inflight.load(Ordering::SeqCst)
    }

    /// Records a request's outcome for `Stats`.
    pub fn record(&self, ok: bool) {
        if ok {
            self.finished.fetch_add(1, Ordering::Relaxed);
        } else {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// What the prefix cache holds, for cache-aware routing, and what the KV tiers hold outside
    /// the pool (`None` without a prefix cache, or when the engine thread is gone).
    pub async fn cache_digest(&self) -> Option<tandem_proto::v1::CacheDigest> {
        if !self.info.prefix_cache {
            return None;
        }
        let (hashes, tiered, tiers_more) = self
            .engine
            .call(|core| {
                let names = core.engine.cache_names(CACHE_DIGEST_LIMIT + 1);
                let pool: Vec<u64> = names.iter().map(|h| h.short()).collect();
                // A pool of layer groups (sliding windows): only the names a prompt can match.
                // Enough names that the limit is still reached once the pool's are left out.
                let groups = core.engine.kv_windows().len().max(1);
                let (tiered, more) = core.engine.kv_tiers().map_or_else(
                    || (Vec::new(), false),
                    |t| {
                        let (names, more) = t.root_names(CACHE_DIGEST_LIMIT + pool.len() + 1, groups, &names);
                        (names.into_iter().map(|(name, kind)| (name.short(), kind)).collect::<Vec<_>>(), more)
                    },
                );
                (pool, tiered, more)
            })
            .await
            .ok()?;
        let mut block_hashes = hashes;
        let mut cut = block_hashes.len() > CACHE_DIGEST_LIMIT;
        block_hashes.truncate(CACHE_DIGEST_LIMIT);
        let (host_hashes, disk_hashes, tiers_cut) = tier_hashes(&block_hashes, &tiered, CACHE_DIGEST_LIMIT);
        cut |= tiers_cut || tiers_more;
        Some(tandem_proto::v1::CacheDigest {
            enabled: true,
            block_hashes,
            limit: if cut { CACHE_DIGEST_LIMIT as u32 } else { 0 },
            host_hashes,
            disk_hashes,
        })
    }

    /// The load report for heartbeats and `Stats`.
    pub fn load(&self) -> WorkerLoad {
        let s = self.engine.snapshot();
        // In token blocks, as the router counts prompts: a pool of layer groups holds one page
        // per group and token block.
        let g = self.engine.kv_windows().len().max(1);
        WorkerLoad {
            total_blocks: (s.kv.total / g) as u32,
            // Cached blocks are allocatable too: what a new request can count on.
            free_blocks: ((s.kv.free + s.kv.cached) / g) as u32,
            running: (s.load.running + s.load.held) as u32,
            queued: s.load.waiting as u32,
            queued_prompt_tokens: s.load.waiting_prompt_tokens as u64,
            reservations: s.load.reservations as u32,
            draining: self.draining(),
            growth_blocks: s.load.growth_blocks.div_ceil(g) as u32,
        }
    }

    /// The `Stats` answer; with `check_invariants` the engine thread runs the allocator checker.
    pub async fn stats(&self, check_invariants: bool) -> Result<StatsResponse, Status> {
        let (kv, check, steps, spec, prefix) = if check_invariants {
            self.engine
                .call(|core| {
                    let r = core.engine.check_kv().map_err(|e| e.to_string());
                    (
                        core.engine.kv_stats(),
                        Some(r),
                        core.steps(),
                        spec_stats(&core.engine),
                        prefix_stats(&core.engine),
                    )
                })
                .await?
        } else {
            let s = self.engine.snapshot();
            (s.kv, None, s.steps, s.spec, s.prefix)
        };
        Ok(StatsResponse {
            load: Some(self.load()),
            kv: Some(KvCounters {
                total: kv.total as u32,
                free: kv.free as u32,
                used: kv.used as u32,
                sequences: kv.sequences as u32,
                raw_reserved: kv.raw_reserved as u32,
                cached: kv.cached as u32,
            }),
            invariants_checked: check.is_some(),
            invariants_ok: matches!(check, Some(Ok(()))),
            invariant_error: match check {
                Some(Err(e)) => e,
                _ => String::new(),
            },
            transfers: Some(counters_to_wire(&(self.transfers)(None))),
            steps,
            requests_finished: self.finished.load(Ordering::Relaxed),
            requests_failed: self.failed.load(Ordering::Relaxed),
            speculation: spec.map(crate::speculation::counters),
            prefix_cache: prefix.map(|p| PrefixCacheCounters {
                enabled: true,
                lookups: p.lookups,
                lookup_tokens: p.lookup_tokens,
                hit_tokens: p.hit_tokens,
                evictions: p.evictions,
                cached_blocks: p.cached_blocks as u32,
                computed_prompt_tokens: p.computed_prompt_tokens,
            }),
            cache: self.cache_digest().await,
            kv_dtype: self.info.compat.as_ref().map(|c| c.kv_dtype.clone()).unwrap_or_default(),
        })
    }
}

/// A digest's tier lists from the tiers' names (short hashes, most recently used first): those
/// not in `pool`, each once, host memory's first and then the disk's, at most `limit` together;
/// and whether some were left out. A name in memory and on disk is listed as memory's.
fn tier_hashes(pool: &[u64], tiered: &[(u64, TierKind)], limit: usize) -> (Vec<u64>, Vec<u64>, bool) {
    let mut seen: HashSet<u64> = pool.iter().copied().collect();
    let (mut host, mut disk) = (Vec::new(), Vec::new());
    for &(hash, kind) in tiered {
        if seen.insert(hash) {
            match kind {
                TierKind::Host => host.push(hash),
                TierKind::Disk => disk.push(hash),
            }
        }
    }
    let cut = host.len() + disk.len() > limit;
    host.truncate(limit);
    disk.truncate(limit - host.len());
    (host, disk, cut)
}

#[cfg(test)]
mod tests {
    use super::*;
    use TierKind::{Disk, Host};

    #[test]
    fn tier_lists_leave_out_the_pool_and_keep_host_before_disk_within_the_limit() {
        let tiered = [(1, Disk), (2, Host), (3, Host), (4, Disk), (5, Host), (2, Host)];
        // 3 is in the pool (reloaded, still kept in the tier): listed there only; 2 once.
        assert_eq!(tier_hashes(&[3, 9], &tiered, 10), (vec![2, 5], vec![1, 4], false));
        // Over the limit: the host names first, then the most recent disk names.
        assert_eq!(tier_hashes(&[3], &tiered, 3), (vec![2, 5], vec![1], true));
        assert_eq!(tier_hashes(&[], &tiered, 2), (vec![2, 3], vec![], true));
        assert_eq!(tier_hashes(&[], &tiered, 5), (vec![2, 3, 5], vec![1, 4], false));
        // No tiers: nothing.
        assert_eq!(tier_hashes(&[1, 2], &[], 10), (vec![], vec![], false));
    }
}
