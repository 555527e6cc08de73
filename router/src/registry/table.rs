//! The worker table: registration, load reports (heartbeats), expiry, health and lookup.
//!
//! Pure bookkeeping (no tokio, no tonic): the caller passes the clock in, so heartbeat expiry is
//! unit-tested without a network. Whether a record may join is [`super::admission`]'s decision;
//! which worker takes a request is [`super::scoring`]'s.
//!
//! Invariants:
//! - Workers are keyed by id; one gRPC address belongs to at most one worker (a worker that restarts
//!   on the same address replaces its old entry).
//! - Every worker that leaves the table or turns unhealthy is counted ([`Registry::losses`]), so
//!   that a request streaming from a worker learns that the router gave up on it.
//! - The router's own counts on a worker (requests and prompt tokens in flight) are never below
//!   zero: a request leaving a worker it was never counted on changes nothing.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use tandem_proto::v1::{CacheDigest, Role, WorkerInfo, WorkerLoad, WorkerSummary};

use super::admission::{check_fit, validate_record, AdmitError, OwnModel};
use super::{describe, Target};

/// Dynamically registered workers are dropped after this many missed heartbeats.
pub const MISSED_HEARTBEATS: u32 = 3;

/// Most block hashes kept per worker: a larger digest is cut, and routed prompts stop being
/// added to the set until the next digest replaces it. The tiers' hashes are kept apart, at most
/// as many again.
pub const MAX_CACHE_HASHES: usize = 1 << 20;

/// Where a worker keeps a block outside its KV pool: a tier behind its prefix cache, which
/// reloads the block into the pool when a prompt continues there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// Host memory: a copy back into the pool.
    Host,
    /// Local disk (only): a read, then the copy.
    Disk,
}

/// One known worker.
#[derive(Debug, Clone)]
pub struct WorkerEntry {
    /// Its registration record.
    pub info: WorkerInfo,
    /// Listed on the router's command line (polled with `Stats`, never expired).
    pub is_static: bool,
    /// Its latest load report.
    pub load: WorkerLoad,
    /// When it last reported (heartbeat or answered poll).
    pub last_seen: Instant,
    /// False after a call to it failed, until it reports again.
    pub healthy: bool,
    /// Why it is unhealthy.
    pub unhealthy_reason: Option<String>,
    /// Prompt tokens sent to this (prefill) worker whose `Prefill` has not answered yet.
    pub inflight_prompt_tokens: u64,
    /// Requests the router is running on this worker.
    pub inflight_requests: u32,
    /// Blocks the router asked of this (decode) worker since its last load report.
    pub blocks_since_report: u32,
    /// What its prefix cache holds: the short block hashes of its latest digest, plus those of
    /// the prompts routed to it since. `None`: it reports no cache (no digest, or caching off).
    pub cache: Option<HashSet<u64>>,
    /// What its KV tiers hold outside the pool, by short block hash, as its latest digest said
    /// (routed prompts are never added: they land in the pool). Empty without tiers or a cache.
    pub tiers: HashMap<u64, Tier>,
    /// Which admission this entry came from (the table's count of admissions then): a worker
    /// that registers again, restarted on the same address, gets a new one.
    pub registration: u64,
    /// The version of its adapter set the router last applied (see
    /// `HeartbeatRequest.adapters_version`): a heartbeat's list of a lower one is older than a
    /// load or unload already applied, and is ignored.
    pub adapters_version: u64,
}

impl WorkerEntry {
    pub(super) fn role(&self) -> Role {
        Role::try_from(self.info.role).unwrap_or(Role::Unspecified)
    }

    pub(super) fn usable(&self) -> bool {
        self.healthy && !self.load.draining
    }

    /// `decode worker d-1 (127.0.0.1:5000)`.
    pub fn describe(&self) -> String {
        describe(&self.info)
    }

    /// This registration of the worker (see [`Target::incarnation`]).
    pub fn incarnation(&self) -> String {
        super::incarnation(&self.info.worker_id, &self.info.address)
    }

    /// Whether this entry is the registration `incarnation` (`id@address`), without building its
    /// own (selection asks this of every worker for every request).
    pub(super) fn is(&self, incarnation: &str) -> bool {
        incarnation.strip_prefix(self.info.worker_id.as_str()).and_then(|r| r.strip_prefix('@'))
            == Some(self.info.address.as_str())
    }

    pub(super) fn block_size(&self) -> u32 {
        self.info.compat.as_ref().map_or(0, |c| c.block_size)
    }

    /// Window of each layer group of the worker's KV pool (`[None]` without groups).
    pub(super) fn kv_windows(&self) -> Vec<Option<usize>> {
        match self.info.compat.as_ref().map(|c| c.kv_windows.as_slice()) {
            Some(w) if !w.is_empty() => w.iter().map(|&w| (w > 0).then_some(w as usize)).collect(),
            _ => vec![None],
        }
    }
}

/// How many workers of each role are in each state, for the `tandem_router_workers` gauge.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerCounts {
    /// `[role][state]`: roles prefill, decode, colocated; states serving, draining, unhealthy.
    counts: [[u32; 3]; 3],
}

impl WorkerCounts {
    const ROLES: [&'static str; 3] = ["prefill", "decode", "colocated"];
    const STATES: [&'static str; 3] = ["serving", "draining", "unhealthy"];

    /// Every (role, state, count), zeros included.
    pub fn rows(&self) -> Vec<(&'static str, &'static str, u32)> {
        let mut out = Vec::with_capacity(9);
        for (r, role) in Self::ROLES.iter().enumerate() {
            for (s, state) in Self::STATES.iter().enumerate() {
                out.push((*role, *state, self.counts[r][s]));
            }
        }
        out
    }

    /// The count for one role and state (`None` for an unknown name).
    pub fn get(&self, role: &str, state: &str) -> Option<u32> {
        let r = Self::ROLES.iter().position(|x| *x == role)?;
        let s = Self::STATES.iter().position(|x| *x == state)?;
        Some(self.counts[r][s])
    }
}

/// The worker table.
#[derive(Debug)]
pub struct Registry {
    own: OwnModel,
    heartbeat: Duration,
    pub(super) workers: BTreeMap<String, WorkerEntry>,
    /// How many times a worker left the table or turned unhealthy (see [`Registry::losses`]).
    losses: u64,
    /// `--prefill-fallback decode`: with no usable prefill worker, decode workers compute prompts
    /// themselves (see [`Registry::pick`]).
    pub(super) prefill_fallback: bool,
    /// Admissions so far (see [`WorkerEntry::registration`]).
    registrations: u64,
}

impl Registry {
    /// An empty table for a router serving `own`; workers report every `heartbeat`.
    pub fn new(own: OwnModel, heartbeat: Duration) -> Registry {
        Registry {
            own,
            heartbeat,
            workers: BTreeMap::new(),
            losses: 0,
            prefill_fallback: false,
            registrations: 0,
        }
    }

    /// Whether decode workers compute prompts themselves while no prefill worker is usable
    /// (`--prefill-fallback decode`; off in a new table).
    pub fn set_prefill_fallback(&mut self, on: bool) {
        self.prefill_fallback = on;
    }

    /// The heartbeat interval workers are told to use.
    pub fn heartbeat_interval(&self) -> Duration {
        self.heartbeat
    }

    /// Admits a worker, or says why not. A worker with the same id (or the same gRPC address)
    /// is replaced: it restarted. Returns whether an entry was replaced.
    pub fn admit(&mut self, info: WorkerInfo, is_static: bool, now: Instant) -> Result<bool, AdmitError> {
        validate_record(&info)?;
        check_fit(&self.own, self.workers.values().map(|e| &e.info), &info)?;
        let replaced_ids: Vec<String> = self
            .workers
            .values()
            .filter(|e| e.info.worker_id == info.worker_id || e.info.address == info.address)
            .map(|e| e.info.worker_id.clone())
            .collect();
        let mut was_static = false;
        for id in &replaced_ids {
            if let Some(old) = self.workers.remove(id) {
                was_static |= old.is_static;
                self.losses += 1;
            }
        }
        let cache = info.prefix_cache.then(HashSet::new);
        let load = WorkerLoad {
            total_blocks: info.total_blocks,
            free_blocks: info.total_blocks,
            ..Default::default()
        };
        self.registrations += 1;
        let entry = WorkerEntry {
            registration: self.registrations,
            info,
            is_static: is_static || was_static,
            load,
            last_seen: now,
            healthy: true,
            unhealthy_reason: None,
            inflight_prompt_tokens: 0,
            inflight_requests: 0,
            blocks_since_report: 0,
            cache,
            tiers: HashMap::new(),
            adapters_version: 0,
        };
        let adapters: Vec<String> = entry.info.adapters.iter().map(|a| a.name.clone()).collect();
        self.workers.insert(entry.info.worker_id.clone(), entry);
        self.warn_conflicts(&adapters);
        Ok(!replaced_ids.is_empty())
    }

    /// Records a load report. Returns false for an unknown worker (it must register again).
    pub fn heartbeat(&mut self, worker_id: &str, load: Option<WorkerLoad>, now: Instant) -> bool {
        let Some(e) = self.workers.get_mut(worker_id) else {
            return false;
        };
        if let Some(load) = load {
            e.load = load;
            e.blocks_since_report = 0;
        }
        e.last_seen = now;
        e.healthy = true;
        e.unhealthy_reason = None;
        true
    }

    /// Records a worker's cache digest, sent with its load report: its hashes (pool and tiers)
    /// replace what the router knew. No digest, or a digest of a cache that is off, means the
    /// worker reports no cache: nothing is known to be there, and routed prompts are not added.
    pub fn set_cache(&mut self, worker_id: &str, digest: Option<&CacheDigest>) {
        if let Some(e) = self.workers.get_mut(worker_id) {
            let digest = digest.filter(|d| d.enabled);
            e.cache = digest.map(|d| d.block_hashes.iter().copied().take(MAX_CACHE_HASHES).collect());
            e.tiers = digest.map(tier_map).unwrap_or_default();
        }
    }

    /// The block sizes of the known workers, each once (prompts are hashed for each).
    pub fn block_sizes(&self) -> Vec<u32> {
        let sizes: BTreeSet<u32> = self.workers.values().map(|e| e.block_size()).filter(|&b| b > 0).collect();
        sizes.into_iter().collect()
    }

    /// Removes a worker; returns its entry.
    pub fn remove(&mut self, worker_id: &str) -> Option<WorkerEntry> {
        let e = self.workers.remove(worker_id);
        self.losses += u64::from(e.is_some());
        e
    }

    /// The decode worker refused a reservation for lack of room: rank it as full until its next
    /// load report.
    pub fn no_room(&mut self, worker_id: &str) {
        if let Some(e) = self.workers.get_mut(worker_id) {
            e.blocks_since_report = u32::MAX;
        }
    }

    /// The worker at `address` said it is draining before its load report did: no new work for
    /// it (a registration of the same id at another address is another process).
    pub fn mark_draining(&mut self, worker_id: &str, address: &str) {
        if let Some(e) = registered_at(&mut self.workers, worker_id, address) {
            e.load.draining = true;
        }
    }

    /// A call to the worker at `address` failed: take it out of selection until it reports
    /// again. A worker registered again at another address since (restarted) is not the one
    /// that failed, and stays as it is.
    pub fn mark_unhealthy(&mut self, worker_id: &str, address: &str, why: &str) {
        if let Some(e) = registered_at(&mut self.workers, worker_id, address) {
            self.losses += u64::from(e.healthy);
            e.healthy = false;
            e.unhealthy_reason = Some(why.to_owned());
        }
    }

    /// The router itself did not run for `stalled` (up to `now`): moves every worker's last
    /// report that much later (never past `now`), so that heartbeats it could not read meanwhile
    /// do not count as missed.
    pub fn excuse(&mut self, stalled: Duration, now: Instant) {
        for e in self.workers.values_mut() {
            e.last_seen = (e.last_seen + stalled).min(now);
        }
    }

    /// Drops dynamically registered workers that missed [`MISSED_HEARTBEATS`] heartbeats; returns
    /// their descriptions with the time since their last report.
    pub fn expire(&mut self, now: Instant) -> Vec<(String, Duration)> {
        let limit = self.heartbeat * MISSED_HEARTBEATS;
        let dead: Vec<String> = self
            .workers
            .values()
            .filter(|e| !e.is_static && now.saturating_duration_since(e.last_seen) > limit)
            .map(|e| e.info.worker_id.clone())
            .collect();
        self.losses += dead.len() as u64;
        dead.iter()
            .filter_map(|id| self.workers.remove(id))
            .map(|e| (e.describe(), now.saturating_duration_since(e.last_seen)))
            .collect()
    }

    /// Counts every time a worker left the table (expired, deregistered, replaced by a new
    /// registration) or turned unhealthy. Requests streaming from a worker watch it change and
    /// then ask [`Registry::holds`] whether the router still counts on theirs.
    pub fn losses(&self) -> u64 {
        self.losses
    }

    /// Whether the worker `target` is in the table, at `target`'s address, and healthy (the same
    /// id registered at another address is a restarted process). A draining worker still counts
    /// (it finishes what it runs). A worker that is not is no proof that its sequences are gone:
    /// a worker too busy to heartbeat in time is dropped too, and registers again.
    pub fn holds(&self, target: &Target) -> bool {
        self.workers.get(&target.worker_id).is_some_and(|e| e.healthy && e.info.address == target.address)
    }

    /// Whether the worker incarnation `incarnation` is registered now by another admission than
    /// `registration` (it registered again: restarted on the same address, say).
    pub fn registered_again(&self, incarnation: &str, registration: u64) -> bool {
        self.workers.values().any(|e| e.is(incarnation) && e.registration != registration)
    }

    /// A worker's entry.
    pub fn get(&self, worker_id: &str) -> Option<&WorkerEntry> {
        self.workers.get(worker_id)
    }

    /// Every entry, by id.
    pub fn entries(&self) -> impl Iterator<Item = &WorkerEntry> {
        self.workers.values()
    }

    pub(super) fn usable(&self, role: Role) -> impl Iterator<Item = &WorkerEntry> {
        self.workers.values().filter(move |e| e.role() == role && e.usable())
    }

    /// Whether a request could be served now, and a sentence saying why (not).
    pub fn serving(&self) -> (bool, String) {
        let count = |r| self.usable(r).count();
        let (p, d, c) = (count(Role::Prefill), count(Role::Decode), count(Role::Colocated));
        let fallback = p == 0 && d > 0 && self.prefill_fallback;
        let serving = (p > 0 && d > 0) || c > 0 || fallback;
        let msg = if fallback {
            format!(
                "serving with 0 prefill, {d} decode and {c} colocated workers (the decode workers compute \
                 prompts themselves: --prefill-fallback decode)"
            )
        } else if serving {
            format!("serving with {p} prefill, {d} decode and {c} colocated workers")
        } else if self.workers.is_empty() {
            "no workers registered".to_owned()
        } else if d == 0 && p > 0 {
            format!("no usable decode worker ({p} prefill)")
        } else if p == 0 && d > 0 {
            format!("no usable prefill worker ({d} decode)")
        } else {
            format!("no usable workers ({} registered, none healthy)", self.workers.len())
        };
        (serving, msg)
    }

    /// The prefill worker answered (or the request gave up on it): its prompt is no longer queued.
    /// Counts come off the registration `worker` was counted under only: a worker registered
    /// again (restarted under its id) starts from zero, and what the old process had is not its.
    pub fn prefill_done(&mut self, worker: &Target, prompt_tokens: u64) {
        if let Some(p) = self.counted(worker) {
            p.inflight_prompt_tokens = p.inflight_prompt_tokens.saturating_sub(prompt_tokens);
            p.inflight_requests = p.inflight_requests.saturating_sub(1);
        }
    }

    /// The request is over on this worker (on the registration it was counted under).
    pub fn request_done(&mut self, worker: &Target) {
        if let Some(w) = self.counted(worker) {
            w.inflight_requests = w.inflight_requests.saturating_sub(1);
        }
    }

    /// `worker`'s entry, when it is still the registration `worker` was chosen under.
    fn counted(&mut self, worker: &Target) -> Option<&mut WorkerEntry> {
        self.workers.get_mut(&worker.worker_id).filter(|e| e.registration == worker.registration)
    }

    /// Workers by role and state: unhealthy (a call failed), else draining (its own report),
    /// else serving.
    pub fn counts(&self) -> WorkerCounts {
        let mut c = WorkerCounts::default();
        for e in self.workers.values() {
            let r = match e.role() {
                Role::Prefill => 0,
                Role::Decode => 1,
                Role::Colocated => 2,
                Role::Unspecified => continue,
            };
            let s = if !e.healthy {
                2
            } else if e.load.draining {
                1
            } else {
                0
            };
            c.counts[r][s] += 1;
        }
        c
    }

    /// What `Health` reports about each worker.
    pub fn summaries(&self) -> Vec<WorkerSummary> {
        self.workers
            .values()
            .map(|e| WorkerSummary {
                worker_id: e.info.worker_id.clone(),
                role: e.info.role,
                address: e.info.address.clone(),
                load: Some(e.load),
                healthy: e.healthy,
                speculation: e.info.speculation.clone(),
            })
            .collect()
    }
}

/// A digest's tier hashes as a map, host memory's first (a hash in both lists is memory's), at
/// most [`MAX_CACHE_HASHES`].
fn tier_map(d: &CacheDigest) -> HashMap<u64, Tier> {
    let host = d.host_hashes.iter().map(|&h| (h, Tier::Host));
    let disk = d.disk_hashes.iter().map(|&h| (h, Tier::Disk));
    let mut tiers = HashMap::new();
    for (hash, tier) in host.chain(disk).take(MAX_CACHE_HASHES) {
        tiers.entry(hash).or_insert(tier);
    }
    tiers
}

/// The entry of `worker_id` in `workers` if it is registered at `address` (the same id at another
/// address is another process, restarted since).
fn registered_at<'a>(
    workers: &'a mut BTreeMap<String, WorkerEntry>,
    worker_id: &str,
    address: &str,
) -> Option<&'a mut WorkerEntry> {
    workers.get_mut(worker_id).filter(|e| e.info.address == address)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The address `id` is registered at.
    fn addr(r: &Registry, id: &str) -> String {
        r.get(id).expect("registered").info.address.clone()
    }

    /// The incarnation `id` is registered as.
    fn inc(r: &Registry, id: &str) -> String {
        r.get(id).expect("registered").incarnation()
    }
    use crate::registry::fixtures::*;
    use crate::registry::{Plan, PromptBlocks};

    #[test]
    fn heartbeat_expiry_drops_dynamic_workers_only() {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(worker("d1", Role::Decode, 1, &[("tcp", "")]), false, t0).unwrap();
        r.admit(worker("p1", Role::Prefill, 2, &[("tcp", "")]), true, t0).unwrap();
        assert!(r.serving().0);
        // Two heartbeats late: still there.
        assert!(r.expire(t0 + Duration::from_millis(250)).is_empty());
        assert!(r.heartbeat("d1", Some(load(10, 0)), t0 + Duration::from_millis(250)));
        assert!(r.expire(t0 + Duration::from_millis(500)).is_empty());
        // Three missed heartbeats: gone, and the router no longer serves.
        let gone = r.expire(t0 + Duration::from_millis(600));
        assert_eq!(gone.len(), 1, "{gone:?}");
        assert!(gone[0].0.contains("d1"));
        assert!(r.get("d1").is_none());
        assert!(r.get("p1").is_some(), "static workers are never expired");
        assert!(!r.serving().0);
        assert!(!r.heartbeat("d1", Some(load(10, 0)), t0), "unknown worker must register again");
        assert!(r.pick(&load_only()).is_err());
    }

    #[test]
    fn unhealthy_workers_are_skipped_until_they_report() {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(worker("d1", Role::Decode, 1, &[("tcp", "")]), false, t0).unwrap();
        r.admit(worker("d2", Role::Decode, 2, &[("tcp", "")]), false, t0).unwrap();
        r.admit(worker("p1", Role::Prefill, 3, &[("tcp", "")]), false, t0).unwrap();
        r.heartbeat("d1", Some(load(50, 0)), t0);
        r.heartbeat("d2", Some(load(10, 0)), t0);
        assert_eq!(r.pick(&load_only()).unwrap().decoder().worker_id, "d1", "most free blocks");
        r.mark_unhealthy("d1", &addr(&r, "d1"), "connection refused");
        assert_eq!(r.pick(&load_only()).unwrap().decoder().worker_id, "d2");
        r.mark_unhealthy("p1", &addr(&r, "p1"), "gone");
        let e = r.pick(&load_only()).unwrap_err();
        assert!(e.contains("no worker"), "{e}");
        r.heartbeat("p1", None, t0);
        r.heartbeat("d1", Some(load(50, 0)), t0);
        assert_eq!(r.pick(&load_only()).unwrap().decoder().worker_id, "d1");
        // Draining workers take nothing new.
        r.heartbeat("d1", Some(WorkerLoad { draining: true, ..load(50, 0) }), t0);
        assert_eq!(r.pick(&load_only()).unwrap().decoder().worker_id, "d2");
        let c = r.counts();
        assert_eq!(c.get("decode", "draining"), Some(1));
        assert_eq!(c.get("decode", "serving"), Some(1));
        assert_eq!(c.get("prefill", "serving"), Some(1));
        r.mark_unhealthy("d2", &addr(&r, "d2"), "gone");
        assert_eq!(r.counts().get("decode", "unhealthy"), Some(1));
        assert_eq!(r.counts().rows().iter().map(|x| x.2).sum::<u32>(), 3);
    }

    #[test]
    fn moving_a_request_leaves_no_counts_behind() {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(worker("d1", Role::Decode, 1, &[("tcp", "")]), false, t0).unwrap();
        r.admit(worker("d2", Role::Decode, 2, &[("tcp", "")]), false, t0).unwrap();
        r.admit(worker("p1", Role::Prefill, 3, &[("tcp", "")]), false, t0).unwrap();
        r.heartbeat("d1", Some(load(60, 0)), t0);
        r.heartbeat("d2", Some(load(50, 0)), t0);
        let first = r.pick(&load_only()).unwrap();
        assert_eq!(first.decoder().worker_id, "d1");
        r.begin(&first, &PromptBlocks::unhashed(40));
        // What orchestrate's replan does after d1 refused the Reserve.
        r.no_room("d1");
        let Plan::Split { prefill, .. } = &first else { panic!("split expected") };
        r.prefill_done(prefill, 40);
        r.request_done(first.decoder());
        let second = r.pick(&load_only()).unwrap();
        assert_eq!(second.decoder().worker_id, "d2");
        r.begin(&second, &PromptBlocks::unhashed(40));
        // The request ends (Cleanup): nothing remains counted anywhere.
        let Plan::Split { prefill, .. } = &second else { panic!("split expected") };
        r.prefill_done(prefill, 40);
        r.request_done(second.decoder());
        for id in ["d1", "d2", "p1"] {
            let e = &r.workers[id];
            assert_eq!((e.inflight_requests, e.inflight_prompt_tokens), (0, 0), "{id}");
        }
    }

    #[test]
    fn losses_are_counted_and_lost_workers_can_be_avoided() {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(worker("d1", Role::Decode, 1, &[("tcp", "")]), false, t0).unwrap();
        r.admit(worker("d2", Role::Decode, 2, &[("tcp", "")]), false, t0).unwrap();
        r.admit(worker("p1", Role::Prefill, 3, &[("tcp", "")]), false, t0).unwrap();
        let plan = r.pick(&load_only()).unwrap();
        let held = plan.decoder().clone();
        assert_eq!(held.worker_id, "d1");
        assert!(r.holds(&held));
        // Avoiding d1 gives d2; avoiding both gives nothing.
        assert_eq!(r.pick_avoiding(&load_only(), &[inc(&r, "d1")]).unwrap().decoder().worker_id, "d2");
        assert!(r.pick_avoiding(&load_only(), &[inc(&r, "d1"), inc(&r, "d2")]).is_err());

        // Draining is not a loss: the worker finishes what it runs.
        let before = r.losses();
        r.mark_draining("d1", &addr(&r, "d1"));
        assert!(r.holds(&held));
        assert_eq!(r.losses(), before);
        // Unhealthy is (counted once, however often it is said).
        r.mark_unhealthy("d1", &addr(&r, "d1"), "Release failed");
        r.mark_unhealthy("d1", &addr(&r, "d1"), "Stats failed");
        assert!(!r.holds(&held));
        assert_eq!(r.losses(), before + 1);
        // A heartbeat brings the same admission back.
        r.heartbeat("d1", None, t0);
        assert!(r.holds(&held));
        // Expired: gone; registered again: counted on again.
        let later = t0 + Duration::from_millis(100 * u64::from(MISSED_HEARTBEATS) + 1);
        r.heartbeat("d2", None, later);
        r.heartbeat("p1", None, later);
        assert_eq!(r.expire(later).len(), 1);
        assert!(!r.holds(&held));
        assert_eq!(r.losses(), before + 2);
        r.admit(worker("d1", Role::Decode, 1, &[("tcp", "")]), false, later).unwrap();
        assert!(r.holds(&held));
        // Deregistration is a loss too.
        let d2 = r.pick_avoiding(&load_only(), &[inc(&r, "d1")]).unwrap().decoder().clone();
        assert!(r.holds(&d2));
        r.remove("d2");
        assert!(!r.holds(&d2));
        assert_eq!(r.losses(), before + 3);
    }

    #[test]
    fn colocated_workers_serve_alone_and_restarts_replace_entries() {
        let mut r = registry();
        let t0 = Instant::now();
        assert!(!r.serving().0);
        r.admit(worker("c1", Role::Colocated, 1, &[]), false, t0).unwrap();
        assert!(r.serving().0);
        assert!(matches!(r.pick(&load_only()).unwrap(), Plan::Colocated { .. }));
        // Same address, new id: the old entry goes.
        assert!(r.admit(worker("c2", Role::Colocated, 1, &[]), false, t0).unwrap());
        assert!(r.get("c1").is_none() && r.get("c2").is_some());
    }

    #[test]
    fn a_failure_of_a_workers_old_address_leaves_its_new_registration_alone() {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(worker("d1", Role::Decode, 1, &[("tcp", "")]), false, t0).unwrap();
        r.admit(worker("p1", Role::Prefill, 3, &[("tcp", "")]), false, t0).unwrap();
        let old = r.pick(&load_only()).unwrap().decoder().clone();
        // d1 restarts at another address and registers again before a call to the old one fails.
        r.admit(worker("d1", Role::Decode, 5, &[("tcp", "")]), false, t0).unwrap();
        r.mark_unhealthy("d1", &old.address, "connection refused");
        let now = r.pick(&load_only()).unwrap().decoder().clone();
        assert_ne!(now.address, old.address);
        // A stream from the old process is not held by the new registration.
        assert!(r.holds(&now) && !r.holds(&old));
        r.mark_draining("d1", &old.address);
        assert_eq!(
            r.pick(&load_only()).unwrap().decoder().address,
            now.address,
            "the old one drains, not the new"
        );
        // A request that lost the old one may go to the new one, not to the old one again.
        assert_eq!(r.pick_avoiding(&load_only(), &[old.incarnation()]).unwrap().decoder().worker_id, "d1");
        r.mark_unhealthy("d1", &now.address, "connection refused");
        assert!(r.pick(&load_only()).is_err());
    }

    #[test]
    fn a_router_that_did_not_run_does_not_drop_workers_for_heartbeats_it_could_not_read() {
        let t0 = Instant::now();
        let two = || {
            let mut r = registry();
            r.admit(worker("d1", Role::Decode, 1, &[("tcp", "")]), false, t0).unwrap();
            r.admit(worker("p1", Role::Prefill, 3, &[("tcp", "")]), false, t0).unwrap();
            r
        };
        let limit = Duration::from_millis(100 * u64::from(MISSED_HEARTBEATS));
        // The router was frozen for 5 s right after the last reports.
        let woke = t0 + Duration::from_secs(5);
        assert_eq!(two().expire(woke).len(), 2, "without the excuse both would go");
        let mut r = two();
        r.excuse(Duration::from_secs(5), woke);
        assert!(r.expire(woke).is_empty());
        // Still silent a full heartbeat limit after it woke: gone.
        assert_eq!(r.expire(woke + limit + Duration::from_millis(1)).len(), 2);
    }
}
