//! The router's table of workers: who may join, who is alive, and who takes the next request.
//!
//! Pure bookkeeping (no tokio, no tonic): the caller passes the clock in, so admission, heartbeat
//! expiry and selection are unit-tested without a network.
//!
//! Invariants:
//! - Every registered worker serves the router's model (same protocol version and model id).
//! - Any two registered prefill/decode workers agree on every KV field of the compatibility record,
//!   and every prefill worker shares a usable transport with every decode worker. A worker that would
//!   break this is refused at registration, never discovered on a request.
//! - Workers are keyed by id; one gRPC address belongs to at most one worker (a worker that restarts
//!   on the same address replaces its old entry).
//! - Every worker that leaves the table or turns unhealthy is counted ([`Registry::losses`]), so
//!   that a request streaming from a worker learns that the router gave up on it.
//! - A worker's speculation record is kept and listed as it registered; it is no compatibility
//!   field (speculation changes speed, never output), but a prefill worker that claims to
//!   speculate has a malformed record.
//!
//! Worker choice is cache-aware: each worker's latest cache digest (the short hashes of the full
//! KV blocks its prefix cache holds) is kept as a set, and a request goes where the leading blocks
//! of its prompt already are unless that worker lacks room (see [`Registry::pick`]). A digest is a
//! hint, never a promise: the decode worker's `Reserve` answer says what it really holds. Without
//! digests (or for prompts shorter than one block) the choice is by load alone.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::{Duration, Instant};

use tandem_model::prefix;
use tandem_proto::v1::{CacheDigest, Role, TransportOffer, WorkerInfo, WorkerLoad, WorkerSummary};

use tandem_serve::identity::compat_mismatch;

/// Dynamically registered workers are dropped after this many missed heartbeats.
pub const MISSED_HEARTBEATS: u32 = 3;

/// What one prompt block a decode-capable worker lacks costs, in blocks of load (free blocks).
/// A block the worker already holds saves its transfer (or, colocated, its computation) and the
/// pool block a fresh copy would take, so it is worth more than one free block elsewhere; 2 lets
/// a worker holding 4 of the prompt's blocks win against one with up to 7 more free blocks, while
/// a worker near full still loses to an idle one (and an overloaded one is never preferred).
pub const CACHE_WEIGHT: i64 = 2;

/// Most block hashes kept per worker: a larger digest is cut, and routed prompts stop being
/// added to the set until the next digest replaces it.
pub const MAX_CACHE_HASHES: usize = 1 << 20;

/// Why a worker was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// The record itself is malformed (missing id, role or address).
    #[error("{0}")]
    Invalid(String),
    /// The record is well-formed but does not fit the cluster.
    #[error("{0}")]
    Mismatch(String),
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
}

impl WorkerEntry {
    fn role(&self) -> Role {
        Role::try_from(self.info.role).unwrap_or(Role::Unspecified)
    }

    fn usable(&self) -> bool {
        self.healthy && !self.load.draining
    }

    /// `decode worker d-1 (127.0.0.1:5000)`.
    pub fn describe(&self) -> String {
        describe(&self.info)
    }

    /// Blocks a new request could reserve now, as the router estimates them: the reported free
    /// blocks less those a decode worker keeps for its own sequences (one per running sequence
    /// and outstanding reservation; none at all while some of its sequences wait for blocks, as
    /// it then refuses reservations) and less what the router asked of it since the report.
    fn free_estimate(&self) -> u32 {
        if self.role() == Role::Decode && self.load.queued > 0 {
            return 0;
        }
        let kept = if self.role() == Role::Decode { self.load.running + self.load.reservations } else { 0 };
        self.load.free_blocks.saturating_sub(kept).saturating_sub(self.blocks_since_report)
    }

    /// Prompt tokens waiting on this prefill worker as the router estimates them now.
    fn queued_estimate(&self) -> u64 {
        self.load.queued_prompt_tokens.max(self.inflight_prompt_tokens)
    }

    fn block_size(&self) -> u32 {
        self.info.compat.as_ref().map_or(0, |c| c.block_size)
    }

    /// Adds `prompt`'s reusable blocks to what this worker's cache holds (when it reports one).
    fn remember(&mut self, prompt: &PromptBlocks) {
        let hashes = prompt.reusable(self.block_size());
        if let Some(cache) = &mut self.cache {
            if cache.len() + hashes.len() <= MAX_CACHE_HASHES {
                cache.extend(hashes);
            }
        }
    }

    /// Leading blocks of `prompt` this worker's cache holds as far as the router knows (the first
    /// block it lacks ends the count; only reusable blocks are named, so never the last one).
    fn overlap(&self, prompt: &PromptBlocks) -> u32 {
        let Some(cache) = &self.cache else {
            return 0;
        };
        prompt.reusable(self.block_size()).iter().take_while(|h| cache.contains(h)).count() as u32
    }

    /// How this decode-capable worker ranks for `prompt`; lower is better.
    fn decode_rank(&self, prompt: &PromptBlocks) -> DecodeRank {
        let overlap = self.overlap(prompt);
        let missing = i64::from(prompt.blocks(self.block_size()).saturating_sub(overlap));
        let free = i64::from(self.free_estimate());
        let overloaded = free < missing;
        DecodeRank {
            overloaded,
            // Overloaded workers (chosen only when all are) go by free blocks alone.
            cost: if overloaded { -free } else { CACHE_WEIGHT * missing - free },
            inflight: self.inflight_requests,
            overlap,
        }
    }

    /// What this prefill worker would compute for `prompt` (tokens not in its cache) on top of
    /// what it has queued, and its overlap.
    fn prefill_cost(&self, prompt: &PromptBlocks) -> (u64, u32) {
        let overlap = self.overlap(prompt);
        let cached = u64::from(overlap) * u64::from(self.block_size());
        ((prompt.tokens as u64).saturating_sub(cached).saturating_add(self.queued_estimate()), overlap)
    }
}

/// A decode-capable worker's place in the choice: workers with room for the prompt's missing
/// blocks first, then by cost, then fewer requests in flight (the worker id breaks the last tie).
#[derive(Debug, Clone, Copy)]
struct DecodeRank {
    overloaded: bool,
    cost: i64,
    inflight: u32,
    overlap: u32,
}

/// A request's prompt as worker choice sees it: its length and the short hashes of its reusable
/// full blocks (all but the block of the last token), for each block size among the workers
/// (colocated workers may use a block size of their own).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PromptBlocks {
    tokens: usize,
    hashes: Vec<(u32, Vec<u64>)>,
}

impl PromptBlocks {
    /// A prompt of `tokens` tokens whose blocks are not named: it is routed by load alone.
    pub fn unhashed(tokens: usize) -> PromptBlocks {
        PromptBlocks { tokens, hashes: Vec::new() }
    }

    /// Names the reusable blocks of `prompt` for each of `block_sizes`, in the namespace of the
    /// model `model_id` and the cache salt `salt`, as workers name the blocks they cache.
    pub fn new(prompt: &[u32], model_id: &str, salt: &str, block_sizes: &[u32]) -> PromptBlocks {
        let root = prefix::chain_root(model_id, salt);
        let hashes = block_sizes
            .iter()
            .filter(|&&bs| bs > 0)
            .map(|&bs| {
                let bs_usize = bs as usize;
                let n = prefix::reusable_blocks(prompt.len(), bs_usize);
                let named = prefix::block_hashes(root, &prompt[..n * bs_usize], bs_usize);
                (bs, named.into_iter().map(|h| h.short()).collect())
            })
            .collect();
        PromptBlocks { tokens: prompt.len(), hashes }
    }

    /// Prompt tokens.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The short hashes of the reusable blocks at `block_size` (empty when not named).
    pub fn reusable(&self, block_size: u32) -> &[u64] {
        self.hashes.iter().find(|(bs, _)| *bs == block_size).map_or(&[], |(_, h)| h.as_slice())
    }

    /// Blocks the whole prompt takes at `block_size`.
    fn blocks(&self, block_size: u32) -> u32 {
        u32::try_from(self.tokens.div_ceil(block_size.max(1) as usize)).unwrap_or(u32::MAX)
    }
}

/// The worker a request runs on, as far as the request needs to know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub worker_id: String,
    /// gRPC address.
    pub address: String,
    pub role: Role,
    pub max_sequence_len: u32,
    pub block_size: u32,
    /// Leading prompt blocks this worker's cache held, as far as the router knew when it chose
    /// the worker (0: none known).
    pub overlap: u32,
}

impl Target {
    fn of(e: &WorkerEntry, overlap: u32) -> Target {
        Target {
            worker_id: e.info.worker_id.clone(),
            address: e.info.address.clone(),
            role: e.role(),
            max_sequence_len: e.info.max_sequence_len,
            block_size: e.block_size(),
            overlap,
        }
    }

    /// `prefill worker p-1 (127.0.0.1:5000)`.
    pub fn describe(&self) -> String {
        format!("{} worker {} ({})", role_name(self.role), self.worker_id, self.address)
    }
}

/// Where a request runs.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// Prefill on one worker, decode on another; KV moves over `transport` (the decode worker's offer).
    Split { prefill: Target, decode: Target, transport: Box<TransportOffer> },
    /// One colocated worker runs the whole request.
    Colocated { worker: Target },
}

impl Plan {
    /// Longest sequence every chosen worker can hold.
    pub fn max_sequence_len(&self) -> u32 {
        match self {
            Plan::Split { prefill, decode, .. } => prefill.max_sequence_len.min(decode.max_sequence_len),
            Plan::Colocated { worker } => worker.max_sequence_len,
        }
    }

    /// The worker that holds the whole sequence while it generates.
    pub fn decoder(&self) -> &Target {
        match self {
            Plan::Split { decode, .. } => decode,
            Plan::Colocated { worker } => worker,
        }
    }
}

/// What the router itself serves.
#[derive(Debug, Clone)]
pub struct OwnModel {
    pub model_id: String,
    pub model_name: String,
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
    workers: BTreeMap<String, WorkerEntry>,
    /// How many times a worker left the table or turned unhealthy (see [`Registry::losses`]).
    losses: u64,
}

/// "prefill", "decode", "colocated".
pub fn role_name(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Colocated => "colocated",
        Role::Unspecified => "unspecified",
    }
}

fn role_of(info: &WorkerInfo) -> Role {
    Role::try_from(info.role).unwrap_or(Role::Unspecified)
}

/// `decode worker d-1 (127.0.0.1:5000)`.
pub fn describe(info: &WorkerInfo) -> String {
    format!("{} worker {} ({})", role_name(role_of(info)), info.worker_id, info.address)
}

fn describe_offers(offers: &[TransportOffer]) -> String {
    if offers.is_empty() {
        return "none".into();
    }
    let short = |s: &str, skip: usize| -> String {
        let s: String = s.chars().skip(skip).take(8).collect();
        if s.is_empty() {
            "?".into()
        } else {
            s
        }
    };
    offers
        .iter()
        .map(|o| match o.kind.as_str() {
            "shm" => format!("shm (host {})", short(&o.host_id, 0)),
            "cuda-ipc" => {
                format!("cuda-ipc (host {}, GPU {})", short(&o.host_id, 0), short(&o.device_uuid, 4))
            }
            "nccl" => format!("nccl (GPU {})", short(&o.device_uuid, 4)),
            _ => o.kind.clone(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The transport a prefill worker and a decode worker can use, as the decode worker offers it,
/// fastest first: `cuda-ipc` when both offer it on the same host and the decode worker's GPU is
/// one the prefill worker can write (its own, or one it has peer access to); `nccl` when both offer it on
/// different GPUs (NCCL cannot put both ranks of a pair on one GPU); `shm` when both offer it on
/// the same host; else `tcp` when both offer it.
pub fn common_transport(prefill: &WorkerInfo, decode: &WorkerInfo) -> Option<TransportOffer> {
    let p_has = |kind: &str, ok: &dyn Fn(&TransportOffer) -> bool| {
        prefill.transports.iter().any(|p| p.kind == kind && ok(p))
    };
    let same_host = |d: &TransportOffer| !d.host_id.is_empty() && p_has(&d.kind, &|p| p.host_id == d.host_id);
    let pairs = |d: &TransportOffer| match d.kind.as_str() {
        "cuda-ipc" => {
            same_host(d)
                && p_has("cuda-ipc", &|p| p.host_id == d.host_id && p.writable_gpus.contains(&d.device_uuid))
        }
        "shm" => same_host(d),
        "nccl" => p_has("nccl", &|p| p.device_uuid.is_empty() || p.device_uuid != d.device_uuid),
        "tcp" => p_has("tcp", &|_| true),
        _ => false,
    };
    ["cuda-ipc", "nccl", "shm", "tcp"]
        .into_iter()
        .find_map(|kind| decode.transports.iter().find(|d| d.kind == kind && pairs(d)))
        .cloned()
}

/// Why two workers share no transport.
fn transport_mismatch(prefill: &WorkerInfo, decode: &WorkerInfo) -> String {
    let both = |kind: &str| {
        prefill.transports.iter().any(|o| o.kind == kind) && decode.transports.iter().any(|o| o.kind == kind)
    };
    let mut why = Vec::new();
    if both("shm") {
        why.push("shm needs both on the same host (equal host_id)");
    }
    if both("cuda-ipc") {
        why.push(
            "cuda-ipc needs both on the same host (equal host_id) and the decode worker on a GPU the \
             prefill worker can write (its own, or one it has peer access to)",
        );
    }
    if both("nccl") {
        why.push("nccl needs the two workers on different GPUs (NCCL cannot put both ranks on one GPU)");
    }
    format!(
        "{} and {} share no KV transport: the prefill worker offers [{}], the decode worker offers [{}]{}",
        describe(prefill),
        describe(decode),
        describe_offers(&prefill.transports),
        describe_offers(&decode.transports),
        why.iter().map(|w| format!("; {w}")).collect::<String>()
    )
}

fn validate_record(info: &WorkerInfo) -> Result<(), AdmitError> {
    let invalid = |m: String| Err(AdmitError::Invalid(m));
    if info.worker_id.trim().is_empty() {
        return invalid(format!("worker_id is empty (worker at {:?})", info.address));
    }
    let role = role_of(info);
    if role == Role::Unspecified {
        return invalid(format!("worker {}: role is unspecified (role {})", info.worker_id, info.role));
    }
    if info.address.trim().is_empty() {
        return invalid(format!("{}: address is empty", describe(info)));
    }
    if info.compat.is_none() {
        return invalid(format!("{}: compat record is missing", describe(info)));
    }
    if info.max_sequence_len == 0 {
        return invalid(format!("{}: max_sequence_len is 0", describe(info)));
    }
    if role == Role::Prefill && info.speculation.is_some() {
        return invalid(format!(
            "{}: a prefill worker never speculates, yet its record says it does",
            describe(info)
        ));
    }
    match role {
        Role::Prefill | Role::Decode if info.transports.is_empty() => {
            return invalid(format!("{}: offers no KV transport", describe(info)));
        }
        Role::Decode => {
            if let Some(o) = info.transports.iter().find(|o| o.address.is_empty()) {
                return invalid(format!("{}: its {} offer has no address", describe(info), o.kind));
            }
            if let Some(o) = info.transports.iter().find(|o| o.kind == "cuda-ipc") {
                if o.ipc_handle.len() != 64 || o.pool_blocks == 0 || o.host_id.is_empty() {
                    return invalid(format!(
                        "{}: its cuda-ipc offer lacks the pool's IPC handle (64 bytes, got {}), its block \
                         count or its host id",
                        describe(info),
                        o.ipc_handle.len()
                    ));
                }
            }
        }
        _ => {}
    }
    Ok(())
}

impl Registry {
    /// An empty table for a router serving `own`; workers report every `heartbeat`.
    pub fn new(own: OwnModel, heartbeat: Duration) -> Registry {
        Registry { own, heartbeat, workers: BTreeMap::new(), losses: 0 }
    }

    /// The heartbeat interval workers are told to use.
    pub fn heartbeat_interval(&self) -> Duration {
        self.heartbeat
    }

    /// Admits a worker, or says why not. A worker with the same id (or the same gRPC address)
    /// is replaced: it restarted. Returns whether an entry was replaced.
    pub fn admit(&mut self, info: WorkerInfo, is_static: bool, now: Instant) -> Result<bool, AdmitError> {
        validate_record(&info)?;
        self.check_fit(&info)?;
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
        let entry = WorkerEntry {
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
        };
        self.workers.insert(entry.info.worker_id.clone(), entry);
        Ok(!replaced_ids.is_empty())
    }

    /// Checks `info` against the router's model and every other registered worker.
    fn check_fit(&self, info: &WorkerInfo) -> Result<(), AdmitError> {
        let mismatch = |m: String| Err(AdmitError::Mismatch(m));
        let compat = info.compat.as_ref().ok_or_else(|| AdmitError::Invalid("compat missing".into()))?;
        if compat.protocol_version != tandem_proto::PROTOCOL_VERSION {
            return mismatch(format!(
                "{} speaks protocol version {}, the router speaks {}",
                describe(info),
                compat.protocol_version,
                tandem_proto::PROTOCOL_VERSION
            ));
        }
        if compat.model_id != self.own.model_id {
            return mismatch(format!(
                "{} serves a different model: model_id {} ({}) vs the router's {} ({})",
                describe(info),
                compat.model_id,
                compat.model_name,
                self.own.model_id,
                self.own.model_name
            ));
        }
        let role = role_of(info);
        if role == Role::Colocated {
            return Ok(()); // moves no KV: only the model must match
        }
        for other in self.workers.values() {
            if other.info.worker_id == info.worker_id || other.info.address == info.address {
                continue; // being replaced
            }
            let other_role = other.role();
            if other_role == Role::Colocated {
                continue;
            }
            if let Some(other_compat) = &other.info.compat {
                if let Some(diff) = compat_mismatch(other_compat, compat) {
                    return mismatch(format!(
                        "{} does not match {}: {diff} (registered vs new)",
                        describe(info),
                        other.describe()
                    ));
                }
            }
            let pair = match (role, other_role) {
                (Role::Prefill, Role::Decode) => Some((info, &other.info)),
                (Role::Decode, Role::Prefill) => Some((&other.info, info)),
                _ => None,
            };
            if let Some((p, d)) = pair {
                if common_transport(p, d).is_none() {
                    return mismatch(transport_mismatch(p, d));
                }
            }
        }
        Ok(())
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

    /// Records a worker's cache digest, sent with its load report: its hashes replace what the
    /// router knew. No digest, or a digest of a cache that is off, means the worker reports no
    /// cache: nothing is known to be there, and routed prompts are not added.
    pub fn set_cache(&mut self, worker_id: &str, digest: Option<&CacheDigest>) {
        if let Some(e) = self.workers.get_mut(worker_id) {
            e.cache = digest
                .filter(|d| d.enabled)
                .map(|d| d.block_hashes.iter().copied().take(MAX_CACHE_HASHES).collect());
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

    /// The worker said it is draining before its load report did: no new work for it.
    pub fn mark_draining(&mut self, worker_id: &str) {
        if let Some(e) = self.workers.get_mut(worker_id) {
            e.load.draining = true;
        }
    }

    /// A call to the worker failed: take it out of selection until it reports again.
    pub fn mark_unhealthy(&mut self, worker_id: &str, why: &str) {
        if let Some(e) = self.workers.get_mut(worker_id) {
            self.losses += u64::from(e.healthy);
            e.healthy = false;
            e.unhealthy_reason = Some(why.to_owned());
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

    /// Whether the worker `target` is in the table and healthy. A draining worker still counts
    /// (it finishes what it runs). A worker that is not is no proof that its sequences are gone:
    /// a worker too busy to heartbeat in time is dropped too, and registers again.
    pub fn holds(&self, target: &Target) -> bool {
        self.workers.get(&target.worker_id).is_some_and(|e| e.healthy)
    }

    /// A worker's entry.
    pub fn get(&self, worker_id: &str) -> Option<&WorkerEntry> {
        self.workers.get(worker_id)
    }

    /// Every entry, by id.
    pub fn entries(&self) -> impl Iterator<Item = &WorkerEntry> {
        self.workers.values()
    }

    fn usable(&self, role: Role) -> impl Iterator<Item = &WorkerEntry> {
        self.workers.values().filter(move |e| e.role() == role && e.usable())
    }

    /// Whether a request could be served now, and a sentence saying why (not).
    pub fn serving(&self) -> (bool, String) {
        let count = |r| self.usable(r).count();
        let (p, d, c) = (count(Role::Prefill), count(Role::Decode), count(Role::Colocated));
        let serving = (p > 0 && d > 0) || c > 0;
        let msg = if serving {
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

    /// Chooses where a request for `prompt` runs; draining and unhealthy workers are skipped.
    ///
    /// The decode-capable worker first (decode workers only when a prefill worker can feed them).
    /// For each, `overlap` is how many leading prompt blocks its cache holds and
    /// `missing = prompt_blocks - overlap` the blocks it must newly hold. A worker whose estimated
    /// free blocks are fewer than `missing` is overloaded; among the others the lowest
    /// `CACHE_WEIGHT * missing - free` wins (the load term is the blocks in use, counted as
    /// free blocks so that pools of different sizes compare as the load-only rule does). When
    /// every worker is overloaded, the one with the most free blocks. Ties go to fewer requests
    /// in flight, then the lowest id. With no overlap anywhere this is the load-only rule: most
    /// free blocks.
    ///
    /// Then the prefill worker sharing a transport with it whose
    /// `prompt_tokens - overlap * block_size + queued_prompt_tokens` is lowest (ties: fewer
    /// requests in flight, lowest id).
    pub fn pick(&self, prompt: &PromptBlocks) -> Result<Plan, String> {
        self.pick_avoiding(prompt, &[])
    }

    /// [`Registry::pick`] with the workers named in `avoid` never chosen to hold the sequence
    /// (the decode or colocated workers a request already lost); prefill workers are not avoided.
    pub fn pick_avoiding(&self, prompt: &PromptBlocks, avoid: &[String]) -> Result<Plan, String> {
        let have_prefill = self.usable(Role::Prefill).next().is_some();
        let (decoder, rank) = self
            .workers
            .values()
            .filter(|e| e.usable() && !avoid.contains(&e.info.worker_id))
            .filter(|e| e.role() == Role::Colocated || (e.role() == Role::Decode && have_prefill))
            .map(|e| (e, e.decode_rank(prompt)))
            .min_by(|(a, ra), (b, rb)| {
                (ra.overloaded, ra.cost, ra.inflight)
                    .cmp(&(rb.overloaded, rb.cost, rb.inflight))
                    .then(a.info.worker_id.cmp(&b.info.worker_id))
            })
            .ok_or_else(|| format!("no worker can take the request: {}", self.serving().1))?;
        if decoder.role() == Role::Colocated {
            return Ok(Plan::Colocated { worker: Target::of(decoder, rank.overlap) });
        }
        let (prefill, transport, (_, overlap)) = self
            .usable(Role::Prefill)
            .filter_map(|p| common_transport(&p.info, &decoder.info).map(|t| (p, t, p.prefill_cost(prompt))))
            .min_by(|(a, _, ca), (b, _, cb)| {
                ca.0.cmp(&cb.0)
                    .then(a.inflight_requests.cmp(&b.inflight_requests))
                    .then(a.info.worker_id.cmp(&b.info.worker_id))
            })
            .ok_or_else(|| {
                // Clients see the reason, not the worker: the log names it.
                tracing::warn!("no prefill worker shares a KV transport with {}", decoder.describe());
                "no prefill worker shares a KV transport with the chosen decode worker".to_owned()
            })?;
        Ok(Plan::Split {
            prefill: Target::of(prefill, overlap),
            decode: Target::of(decoder, rank.overlap),
            transport: Box::new(transport),
        })
    }

    /// A request for `prompt` starts on `plan`: count it (and its prompt) against the workers,
    /// and take the prompt's reusable blocks as cached on them from now on (each keeps a finished
    /// sequence's blocks), so that the next request with the same prefix follows it before the
    /// next digest says so.
    pub fn begin(&mut self, plan: &Plan, prompt: &PromptBlocks) {
        let prompt_tokens = prompt.tokens() as u64;
        let (prefill, holder) = match plan {
            Plan::Split { prefill, decode, .. } => (Some(prefill), decode),
            Plan::Colocated { worker } => (None, worker),
        };
        if let Some(t) = prefill {
            if let Some(p) = self.workers.get_mut(&t.worker_id) {
                p.inflight_requests += 1;
                p.inflight_prompt_tokens += prompt_tokens;
                p.remember(prompt);
            }
        }
        if let Some(d) = self.workers.get_mut(&holder.worker_id) {
            d.inflight_requests += 1;
            // Blocks its cache holds are pinned, not taken from the free ones.
            let blocks = prompt.blocks(holder.block_size).saturating_sub(holder.overlap);
            d.blocks_since_report = d.blocks_since_report.saturating_add(blocks);
            d.remember(prompt);
        }
    }

    /// The prefill worker answered (or the request gave up on it): its prompt is no longer queued.
    pub fn prefill_done(&mut self, worker_id: &str, prompt_tokens: u64) {
        if let Some(p) = self.workers.get_mut(worker_id) {
            p.inflight_prompt_tokens = p.inflight_prompt_tokens.saturating_sub(prompt_tokens);
            p.inflight_requests = p.inflight_requests.saturating_sub(1);
        }
    }

    /// The request is over on this worker.
    pub fn request_done(&mut self, worker_id: &str) {
        if let Some(w) = self.workers.get_mut(worker_id) {
            w.inflight_requests = w.inflight_requests.saturating_sub(1);
        }
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

/// A compatibility record for tests and examples.
#[cfg(test)]
fn test_compat(model_id: &str, block_size: u32) -> tandem_proto::v1::CompatRecord {
    tandem_proto::v1::CompatRecord {
        protocol_version: tandem_proto::PROTOCOL_VERSION,
        model_id: model_id.into(),
        model_name: "tiny".into(),
        kv_dtype: "f32".into(),
        block_size,
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 8,
        kv_layout: "blocks".into(),
        vocab_size: 256,
        max_position_embeddings: 512,
        kv_token_stride: 64,
        kv_block_stride: 1024,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODEL: &str = "sha256:aaaa";

    fn registry() -> Registry {
        Registry::new(
            OwnModel { model_id: MODEL.into(), model_name: "tiny".into() },
            Duration::from_millis(100),
        )
    }

    fn offer(kind: &str, host: &str, decode: bool) -> TransportOffer {
        TransportOffer {
            kind: kind.into(),
            address: if decode { "127.0.0.1:7000".into() } else { String::new() },
            segment_path: if decode && kind == "shm" { "/dev/shm/x".into() } else { String::new() },
            host_id: if kind == "shm" || kind == "cuda-ipc" { host.into() } else { String::new() },
            ipc_handle: if decode && kind == "cuda-ipc" { vec![7; 64] } else { Vec::new() },
            pool_blocks: if decode && kind == "cuda-ipc" { 64 } else { 0 },
            device_uuid: if kind == "nccl" || kind == "cuda-ipc" {
                format!("GPU-{host}")
            } else {
                String::new()
            },
            writable_gpus: if !decode && kind == "cuda-ipc" {
                vec![format!("GPU-{host}")]
            } else {
                Vec::new()
            },
        }
    }

    fn worker(id: &str, role: Role, port: u16, offers: &[(&str, &str)]) -> WorkerInfo {
        let decode = role == Role::Decode;
        WorkerInfo {
            worker_id: id.into(),
            role: role as i32,
            address: format!("127.0.0.1:{port}"),
            compat: Some(test_compat(MODEL, 16)),
            transports: offers.iter().map(|(k, h)| offer(k, h, decode)).collect(),
            device: "cpu".into(),
            total_blocks: 64,
            max_sequence_len: 512,
            speculation: None,
            prefix_cache: false,
        }
    }

    /// A prompt with no named blocks: the choice is by load alone, as before caching.
    fn load_only() -> PromptBlocks {
        PromptBlocks::unhashed(20)
    }

    fn load(free: u32, queued_prompt_tokens: u64) -> WorkerLoad {
        WorkerLoad { total_blocks: 64, free_blocks: free, queued_prompt_tokens, ..Default::default() }
    }

    #[test]
    fn refuses_other_model_and_other_block_size_naming_both() {
        let mut r = registry();
        let now = Instant::now();
        r.admit(worker("d1", Role::Decode, 1, &[("tcp", "")]), false, now).unwrap();

        let mut other_model = worker("p1", Role::Prefill, 2, &[("tcp", "")]);
        other_model.compat = Some(test_compat("sha256:bbbb", 16));
        let e = r.admit(other_model, false, now).unwrap_err();
        let m = e.to_string();
        assert!(matches!(e, AdmitError::Mismatch(_)));
        assert!(m.contains("p1") && m.contains("sha256:bbbb") && m.contains(MODEL), "{m}");

        let mut other_blocks = worker("p2", Role::Prefill, 3, &[("tcp", "")]);
        other_blocks.compat = Some(test_compat(MODEL, 32));
        let m = r.admit(other_blocks, false, now).unwrap_err().to_string();
        assert!(m.contains("p2") && m.contains("d1") && m.contains("block_size: 16 vs 32"), "{m}");

        let mut other_dtype = worker("p3", Role::Prefill, 4, &[("tcp", "")]);
        let c = other_dtype.compat.as_mut().unwrap();
        c.kv_dtype = "f16".into();
        let m = r.admit(other_dtype, false, now).unwrap_err().to_string();
        assert!(m.contains("p3") && m.contains(r#"kv_dtype: "f32" vs "f16""#), "{m}");
        assert_eq!(r.entries().count(), 1);
    }

    #[test]
    fn refuses_pairs_without_a_common_transport() {
        let mut r = registry();
        let now = Instant::now();
        r.admit(worker("d1", Role::Decode, 1, &[("shm", "host-a")]), false, now).unwrap();
        let m = r.admit(worker("p1", Role::Prefill, 2, &[("shm", "host-b")]), false, now).unwrap_err();
        let m = m.to_string();
        assert!(m.contains("p1") && m.contains("d1") && m.contains("share no KV transport"), "{m}");
        assert!(m.contains("host_id"), "{m}");
        let m = r.admit(worker("p2", Role::Prefill, 3, &[("tcp", "")]), false, now).unwrap_err();
        assert!(m.to_string().contains("offers [tcp]"), "{m}");
        // Same host: fine, and shm is chosen.
        r.admit(worker("p3", Role::Prefill, 4, &[("tcp", ""), ("shm", "host-a")]), false, now).unwrap();
        // The other direction: a decode worker that no registered prefill worker can reach.
        let m = r.admit(worker("d2", Role::Decode, 5, &[("shm", "host-c")]), false, now).unwrap_err();
        assert!(m.to_string().contains("p3") && m.to_string().contains("d2"), "{m}");
        match r.pick(&load_only()).unwrap() {
            Plan::Split { prefill, decode, transport } => {
                assert_eq!((prefill.worker_id.as_str(), decode.worker_id.as_str()), ("p3", "d1"));
                assert_eq!(transport.kind, "shm");
                assert_eq!(transport.segment_path, "/dev/shm/x");
            }
            other => panic!("expected a split plan, got {other:?}"),
        }
    }

    #[test]
    fn tcp_when_hosts_differ() {
        let p = worker("p", Role::Prefill, 1, &[("shm", "a"), ("tcp", "")]);
        let d = worker("d", Role::Decode, 2, &[("shm", "b"), ("tcp", "")]);
        assert_eq!(common_transport(&p, &d).unwrap().kind, "tcp");
        let d_same = worker("d", Role::Decode, 2, &[("tcp", ""), ("shm", "a")]);
        assert_eq!(common_transport(&p, &d_same).unwrap().kind, "shm");
    }

    /// `--transport auto` on GPUs: cuda-ipc on one host, nccl between different GPUs elsewhere,
    /// tcp otherwise; a CPU worker never gets a GPU transport. (The offers' second field is the
    /// host for shm and cuda-ipc, the GPU for nccl.)
    #[test]
    fn gpu_transports_are_preferred_where_they_can_work() {
        let gpu_p = |host: &str, gpu: &str| {
            worker("p", Role::Prefill, 1, &[("cuda-ipc", host), ("nccl", gpu), ("shm", host), ("tcp", "")])
        };
        let gpu_d = |host: &str, gpu: &str| {
            worker("d", Role::Decode, 2, &[("cuda-ipc", host), ("nccl", gpu), ("tcp", "")])
        };
        // Same host: cuda-ipc, whatever the GPUs; the destination carries the pool's handle.
        let t = common_transport(&gpu_p("h", "g0"), &gpu_d("h", "g1")).unwrap();
        assert_eq!((t.kind.as_str(), t.ipc_handle.len(), t.pool_blocks), ("cuda-ipc", 64, 64));
        assert_eq!(common_transport(&gpu_p("h", "g0"), &gpu_d("h", "g0")).unwrap().kind, "cuda-ipc");
        // The same host, but the decode worker's GPU is not one the prefill worker can write (no
        // peer access, or not visible to it): nccl between the two GPUs instead.
        let mut no_peer = gpu_p("h", "g0");
        no_peer.transports[0].writable_gpus = vec!["GPU-other".into()];
        assert_eq!(common_transport(&no_peer, &gpu_d("h", "g1")).unwrap().kind, "nccl");
        // Other hosts: nccl between different GPUs.
        assert_eq!(common_transport(&gpu_p("h1", "g0"), &gpu_d("h2", "g1")).unwrap().kind, "nccl");
        // The same GPU on another host cannot happen, but a record saying so gets tcp, not nccl.
        assert_eq!(common_transport(&gpu_p("h1", "g0"), &gpu_d("h2", "g0")).unwrap().kind, "tcp");
        // A CPU prefill worker (shm, tcp) and a GPU decode worker on one host: tcp.
        let cpu_p = worker("p", Role::Prefill, 1, &[("shm", "h"), ("tcp", "")]);
        assert_eq!(common_transport(&cpu_p, &gpu_d("h", "g1")).unwrap().kind, "tcp");
        // Forced GPU transports that cannot pair are refused at registration, naming why.
        let mut r = registry();
        let now = Instant::now();
        r.admit(worker("d1", Role::Decode, 3, &[("nccl", "g0")]), false, now).unwrap();
        let m =
            r.admit(worker("p1", Role::Prefill, 4, &[("nccl", "g0")]), false, now).unwrap_err().to_string();
        assert!(m.contains("share no KV transport") && m.contains("cannot put both ranks on one GPU"), "{m}");
        let mut r = registry();
        r.admit(worker("d1", Role::Decode, 3, &[("cuda-ipc", "h1")]), false, now).unwrap();
        let m = r
            .admit(worker("p1", Role::Prefill, 4, &[("cuda-ipc", "h2")]), false, now)
            .unwrap_err()
            .to_string();
        assert!(m.contains("cuda-ipc needs both on the same host") && m.contains("cuda-ipc (host h1"), "{m}");
        // A cuda-ipc offer without the pool's handle is malformed.
        let mut d = worker("d2", Role::Decode, 5, &[("cuda-ipc", "h1")]);
        d.transports[0].ipc_handle.clear();
        let m = r.admit(d, false, now).unwrap_err();
        assert!(matches!(&m, AdmitError::Invalid(s) if s.contains("IPC handle")), "{m}");
    }

    #[test]
    fn malformed_records_are_invalid() {
        let mut r = registry();
        let now = Instant::now();
        let mut w = worker("", Role::Decode, 1, &[("tcp", "")]);
        assert!(
            matches!(r.admit(w.clone(), false, now), Err(AdmitError::Invalid(m)) if m.contains("worker_id"))
        );
        w.worker_id = "d".into();
        w.role = 0;
        assert!(matches!(r.admit(w.clone(), false, now), Err(AdmitError::Invalid(m)) if m.contains("role")));
        w.role = Role::Decode as i32;
        w.transports.clear();
        assert!(
            matches!(r.admit(w.clone(), false, now), Err(AdmitError::Invalid(m)) if m.contains("transport"))
        );
    }

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
        r.mark_unhealthy("d1", "connection refused");
        assert_eq!(r.pick(&load_only()).unwrap().decoder().worker_id, "d2");
        r.mark_unhealthy("p1", "gone");
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
        r.mark_unhealthy("d2", "gone");
        assert_eq!(r.counts().get("decode", "unhealthy"), Some(1));
        assert_eq!(r.counts().rows().iter().map(|x| x.2).sum::<u32>(), 3);
    }

    #[test]
    fn decode_choice_counts_blocks_the_worker_keeps_and_refusals() {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(worker("d1", Role::Decode, 1, &[("tcp", "")]), false, t0).unwrap();
        r.admit(worker("d2", Role::Decode, 2, &[("tcp", "")]), false, t0).unwrap();
        r.admit(worker("p1", Role::Prefill, 3, &[("tcp", "")]), false, t0).unwrap();
        // d1 has more free blocks, but keeps 12 for its running sequences and reservations.
        r.heartbeat("d1", Some(WorkerLoad { running: 8, reservations: 4, ..load(30, 0) }), t0);
        r.heartbeat("d2", Some(load(20, 0)), t0);
        assert_eq!(r.pick(&load_only()).unwrap().decoder().worker_id, "d2");
        // A worker with sequences waiting for blocks refuses reservations: ranked last.
        r.heartbeat("d1", Some(load(60, 0)), t0);
        assert_eq!(r.pick(&load_only()).unwrap().decoder().worker_id, "d1");
        r.heartbeat("d1", Some(WorkerLoad { queued: 1, ..load(60, 0) }), t0);
        assert_eq!(r.pick(&load_only()).unwrap().decoder().worker_id, "d2");
        // A refusal ranks a worker as full until its next report.
        r.heartbeat("d1", Some(load(60, 0)), t0);
        r.no_room("d1");
        assert_eq!(r.pick(&load_only()).unwrap().decoder().worker_id, "d2");
        r.heartbeat("d1", Some(load(60, 0)), t0);
        assert_eq!(r.pick(&load_only()).unwrap().decoder().worker_id, "d1");
        // Draining, as a refused call says before the next report: out of selection.
        r.mark_draining("d1");
        assert_eq!(r.pick(&load_only()).unwrap().decoder().worker_id, "d2");
        // A lone full worker is still chosen: the request waits for it.
        r.mark_unhealthy("d1", "gone");
        r.no_room("d2");
        assert_eq!(r.pick(&load_only()).unwrap().decoder().worker_id, "d2");
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
        r.prefill_done(&prefill.worker_id, 40);
        r.request_done(&first.decoder().worker_id);
        let second = r.pick(&load_only()).unwrap();
        assert_eq!(second.decoder().worker_id, "d2");
        r.begin(&second, &PromptBlocks::unhashed(40));
        // The request ends (Cleanup): nothing remains counted anywhere.
        let Plan::Split { prefill, .. } = &second else { panic!("split expected") };
        r.prefill_done(&prefill.worker_id, 40);
        r.request_done(&second.decoder().worker_id);
        for id in ["d1", "d2", "p1"] {
            let e = &r.workers[id];
            assert_eq!((e.inflight_requests, e.inflight_prompt_tokens), (0, 0), "{id}");
        }
    }

    #[test]
    fn prefill_choice_counts_the_routers_own_inflight_prompts() {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(worker("d1", Role::Decode, 1, &[("tcp", "")]), false, t0).unwrap();
        r.admit(worker("p1", Role::Prefill, 2, &[("tcp", "")]), false, t0).unwrap();
        r.admit(worker("p2", Role::Prefill, 3, &[("tcp", "")]), false, t0).unwrap();
        let first = r.pick(&load_only()).unwrap();
        let Plan::Split { prefill, .. } = &first else { panic!("split expected") };
        assert_eq!(prefill.worker_id, "p1");
        r.begin(&first, &PromptBlocks::unhashed(100));
        let Plan::Split { prefill, .. } = r.pick(&load_only()).unwrap() else { panic!("split expected") };
        assert_eq!(prefill.worker_id, "p2", "p1 has 100 prompt tokens in flight");
        r.prefill_done("p1", 100);
        let Plan::Split { prefill, .. } = r.pick(&load_only()).unwrap() else { panic!("split expected") };
        assert_eq!(prefill.worker_id, "p1");
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
        assert_eq!(r.pick_avoiding(&load_only(), &["d1".into()]).unwrap().decoder().worker_id, "d2");
        assert!(r.pick_avoiding(&load_only(), &["d1".into(), "d2".into()]).is_err());

        // Draining is not a loss: the worker finishes what it runs.
        let before = r.losses();
        r.mark_draining("d1");
        assert!(r.holds(&held));
        assert_eq!(r.losses(), before);
        // Unhealthy is (counted once, however often it is said).
        r.mark_unhealthy("d1", "Release failed");
        r.mark_unhealthy("d1", "Stats failed");
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
        let d2 = r.pick_avoiding(&load_only(), &["d1".into()]).unwrap().decoder().clone();
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
    fn speculation_records_are_listed_and_pair_with_plain_workers() {
        let mut r = registry();
        let now = Instant::now();
        let spec = tandem_proto::v1::SpeculationInfo {
            method: "ngram".into(),
            max_draft: 4,
            adaptive: true,
            drafter: "ngram 2..4".into(),
        };
        let mut d1 = worker("d1", Role::Decode, 1, &[("tcp", "")]);
        d1.speculation = Some(spec.clone());
        r.admit(d1, false, now).unwrap();
        // A decode worker without speculation, and a prefill worker, pair with it as before.
        r.admit(worker("d2", Role::Decode, 2, &[("tcp", "")]), false, now).unwrap();
        r.admit(worker("p1", Role::Prefill, 3, &[("tcp", "")]), false, now).unwrap();
        let listed: Vec<_> = r.summaries().into_iter().map(|s| (s.worker_id, s.speculation)).collect();
        assert_eq!(listed, vec![("d1".into(), Some(spec.clone())), ("d2".into(), None), ("p1".into(), None)]);
        // A prefill worker that claims to speculate has a malformed record.
        let mut p2 = worker("p2", Role::Prefill, 4, &[("tcp", "")]);
        p2.speculation = Some(spec);
        let e = r.admit(p2, false, now).unwrap_err();
        assert!(
            matches!(&e, AdmitError::Invalid(m) if m.contains("p2") && m.contains("never speculates")),
            "{e}"
        );
    }

    fn digest(hashes: &[u64]) -> CacheDigest {
        CacheDigest { enabled: true, block_hashes: hashes.to_vec(), limit: 0 }
    }

    /// The blocks of a prompt of the tokens `from..to` in the namespace of `salt`, at block size 16.
    fn prompt(from: u32, to: u32, salt: &str) -> PromptBlocks {
        PromptBlocks::new(&(from..to).collect::<Vec<_>>(), MODEL, salt, &[16])
    }

    fn caching(id: &str, role: Role, port: u16) -> WorkerInfo {
        WorkerInfo { prefix_cache: true, ..worker(id, role, port, &[("tcp", "")]) }
    }

    #[test]
    fn prompts_are_named_per_salt_and_only_up_to_the_last_tokens_block() {
        let a = prompt(0, 80, "");
        assert_eq!(a.tokens(), 80);
        assert_eq!(a.reusable(16).len(), 4, "5 blocks, the last token's never reused");
        let longer = prompt(0, 81, "");
        assert_eq!(longer.reusable(16).len(), 5, "81 tokens: the last token has a block of its own");
        assert_eq!(&longer.reusable(16)[..4], a.reusable(16), "a chain: same start, same names");
        assert!(a.reusable(32).is_empty(), "not named at a block size no worker has");
        assert!(prompt(0, 16, "").reusable(16).is_empty(), "one block holding the last token");
        let b = prompt(0, 80, "tenant-b");
        assert!(a.reusable(16).iter().all(|h| !b.reusable(16).contains(h)), "salts never share names");
        // The same hashes the workers compute.
        let root = prefix::chain_root(MODEL, "");
        let tokens: Vec<u32> = (0..64).collect();
        let want: Vec<u64> = prefix::block_hashes(root, &tokens, 16).iter().map(|h| h.short()).collect();
        assert_eq!(a.reusable(16), want.as_slice());
    }

    #[test]
    fn a_decode_worker_holding_the_prefix_wins_over_more_free_blocks_unless_overloaded() {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(caching("d1", Role::Decode, 1), false, t0).unwrap();
        r.admit(caching("d2", Role::Decode, 2), false, t0).unwrap();
        r.admit(worker("p1", Role::Prefill, 3, &[("tcp", "")]), false, t0).unwrap();
        let ask = prompt(0, 80, ""); // 5 blocks, 4 reusable
        r.heartbeat("d1", Some(load(30, 0)), t0);
        r.heartbeat("d2", Some(load(36, 0)), t0);
        // Without digests: most free blocks.
        assert_eq!(r.pick(&ask).unwrap().decoder().worker_id, "d2");
        assert_eq!(r.pick(&ask).unwrap().decoder().overlap, 0);
        // d1 holds the prompt's leading blocks: 2*1 - 30 beats 2*5 - 36.
        r.set_cache("d1", Some(&digest(ask.reusable(16))));
        let plan = r.pick(&ask).unwrap();
        assert_eq!((plan.decoder().worker_id.as_str(), plan.decoder().overlap), ("d1", 4));
        // Far more free blocks elsewhere outweigh the overlap.
        r.heartbeat("d2", Some(load(40, 0)), t0);
        assert_eq!(r.pick(&ask).unwrap().decoder().worker_id, "d2", "2*1 - 30 > 2*5 - 40");
        r.heartbeat("d2", Some(load(36, 0)), t0);
        // Exactly room for the one missing block: not overloaded, still chosen.
        r.heartbeat("d1", Some(load(1, 0)), t0);
        r.heartbeat("d2", Some(load(5, 0)), t0);
        assert_eq!(r.pick(&ask).unwrap().decoder().worker_id, "d1", "2*1 - 1 < 2*5 - 5");
        // Overloaded (no room even for the missing block): the worker with room wins.
        r.heartbeat("d1", Some(load(0, 0)), t0);
        assert_eq!(r.pick(&ask).unwrap().decoder().worker_id, "d2");
        r.heartbeat("d1", Some(WorkerLoad { queued: 1, ..load(50, 0) }), t0);
        assert_eq!(r.pick(&ask).unwrap().decoder().worker_id, "d2", "it refuses reservations");
        // Every worker overloaded: the most free blocks, as without caching (by cost, d1 would
        // win: 2*3 - 2 < 2*5 - 4).
        r.set_cache("d1", Some(&digest(&ask.reusable(16)[..2])));
        r.heartbeat("d1", Some(load(2, 0)), t0);
        r.heartbeat("d2", Some(load(4, 0)), t0);
        assert_eq!(r.pick(&ask).unwrap().decoder().worker_id, "d2");
        r.heartbeat("d2", Some(load(1, 0)), t0);
        assert_eq!(r.pick(&ask).unwrap().decoder().worker_id, "d1");
    }

    #[test]
    fn overlap_counts_leading_blocks_only_and_needs_an_enabled_digest() {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(caching("d1", Role::Decode, 1), false, t0).unwrap();
        r.admit(caching("d2", Role::Decode, 2), false, t0).unwrap();
        r.admit(worker("p1", Role::Prefill, 3, &[("tcp", "")]), false, t0).unwrap();
        let ask = prompt(0, 80, "");
        let h = ask.reusable(16).to_vec();
        r.heartbeat("d1", Some(load(30, 0)), t0);
        r.heartbeat("d2", Some(load(32, 0)), t0);
        // Blocks 0, 1 and 3: the count stops at the first block missing.
        r.set_cache("d1", Some(&digest(&[h[3], h[1], h[0]])));
        assert_eq!(r.pick(&ask).unwrap().decoder().overlap, 2);
        // Later blocks without the first are of no use.
        r.set_cache("d1", Some(&digest(&h[1..])));
        let plan = r.pick(&ask).unwrap();
        assert_eq!((plan.decoder().worker_id.as_str(), plan.decoder().overlap), ("d2", 0));
        // A disabled cache, or no digest, knows nothing.
        r.set_cache("d1", Some(&CacheDigest { enabled: false, ..digest(&h) }));
        assert_eq!(r.pick(&ask).unwrap().decoder().worker_id, "d2");
        r.set_cache("d1", Some(&digest(&h)));
        assert_eq!(r.pick(&ask).unwrap().decoder().worker_id, "d1");
        r.set_cache("d1", None);
        assert_eq!(r.pick(&ask).unwrap().decoder().worker_id, "d2");
        // A prompt within one block names nothing: load only, whatever the digests hold.
        r.set_cache("d1", Some(&digest(&h)));
        let short = prompt(0, 16, "");
        assert_eq!(r.pick(&short).unwrap().decoder().worker_id, "d2");
    }

    #[test]
    fn a_digest_for_one_salt_does_not_attract_another() {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(caching("d1", Role::Decode, 1), false, t0).unwrap();
        r.admit(caching("d2", Role::Decode, 2), false, t0).unwrap();
        r.admit(worker("p1", Role::Prefill, 3, &[("tcp", "")]), false, t0).unwrap();
        r.heartbeat("d1", Some(load(30, 0)), t0);
        r.heartbeat("d2", Some(load(32, 0)), t0);
        let a = prompt(0, 80, "tenant-a");
        let b = prompt(0, 80, "tenant-b");
        r.set_cache("d1", Some(&digest(a.reusable(16))));
        assert_eq!(r.pick(&a).unwrap().decoder().worker_id, "d1");
        let plan = r.pick(&b).unwrap();
        assert_eq!((plan.decoder().worker_id.as_str(), plan.decoder().overlap), ("d2", 0));
        assert_eq!(r.pick(&prompt(0, 80, "")).unwrap().decoder().worker_id, "d2", "nor the shared one");
    }

    #[test]
    fn the_choice_equals_the_load_only_one_without_digests() {
        // Many load mixes: a named prompt with no digests anywhere goes where an unnamed one goes.
        let t0 = Instant::now();
        let frees = [0u32, 1, 3, 5, 6, 20, 64];
        for f1 in frees {
            for f2 in frees {
                for inflight in 0..2u32 {
                    let mut r = registry();
                    r.admit(caching("d1", Role::Decode, 1), false, t0).unwrap();
                    r.admit(caching("d2", Role::Decode, 2), false, t0).unwrap();
                    r.admit(worker("p1", Role::Prefill, 3, &[("tcp", "")]), false, t0).unwrap();
                    r.heartbeat("d1", Some(load(f1, 0)), t0);
                    r.heartbeat("d2", Some(load(f2, 0)), t0);
                    r.workers.get_mut("d1").unwrap().inflight_requests = inflight;
                    let named = r.pick(&prompt(0, 80, "")).unwrap();
                    let unnamed = r.pick(&PromptBlocks::unhashed(80)).unwrap();
                    assert_eq!(named, unnamed, "free {f1}/{f2}, d1 running {inflight}");
                    // Most free blocks, then fewer requests in flight, then the lowest id.
                    let want = if f2 > f1 || (f2 == f1 && inflight > 0) { "d2" } else { "d1" };
                    assert_eq!(named.decoder().worker_id, want, "free {f1}/{f2}, d1 running {inflight}");
                }
            }
        }
    }

    #[test]
    fn a_prefill_worker_holding_the_prefix_wins_unless_its_queue_outweighs_it() {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(worker("d1", Role::Decode, 1, &[("tcp", "")]), false, t0).unwrap();
        r.admit(caching("p1", Role::Prefill, 2), false, t0).unwrap();
        r.admit(caching("p2", Role::Prefill, 3), false, t0).unwrap();
        let ask = prompt(0, 80, "");
        r.heartbeat("p1", Some(load(64, 0)), t0);
        r.heartbeat("p2", Some(load(64, 40)), t0);
        r.set_cache("p2", Some(&digest(ask.reusable(16))));
        // p2 computes 16 tokens after 40 queued; p1 all 80.
        let Plan::Split { prefill, .. } = r.pick(&ask).unwrap() else { panic!("split expected") };
        assert_eq!((prefill.worker_id.as_str(), prefill.overlap), ("p2", 4));
        r.heartbeat("p2", Some(load(64, 70)), t0);
        let Plan::Split { prefill, .. } = r.pick(&ask).unwrap() else { panic!("split expected") };
        assert_eq!((prefill.worker_id.as_str(), prefill.overlap), ("p1", 0), "16 + 70 > 80");
    }

    #[test]
    fn a_routed_prompt_counts_as_cached_until_the_next_digest() {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(caching("d1", Role::Decode, 1), false, t0).unwrap();
        r.admit(caching("d2", Role::Decode, 2), false, t0).unwrap();
        r.admit(caching("p1", Role::Prefill, 3), false, t0).unwrap();
        r.admit(caching("p2", Role::Prefill, 4), false, t0).unwrap();
        let ask = prompt(0, 80, "");
        let first = r.pick(&ask).unwrap();
        let Plan::Split { prefill, decode, .. } = &first else { panic!("split expected") };
        assert_eq!((prefill.worker_id.as_str(), decode.worker_id.as_str()), ("p1", "d1"), "equal load");
        r.begin(&first, &ask);
        // d1 now has 5 blocks fewer free, yet holds the prefix: the same prompt follows.
        let second = r.pick(&ask).unwrap();
        assert_eq!((second.decoder().worker_id.as_str(), second.decoder().overlap), ("d1", 4));
        // Another prompt goes by load: to d2.
        assert_eq!(r.pick(&prompt(1000, 1080, "")).unwrap().decoder().worker_id, "d2");
        // Once p1 is done with the first prompt, it also holds its blocks.
        r.prefill_done("p1", 80);
        let Plan::Split { prefill, .. } = r.pick(&ask).unwrap() else { panic!("split expected") };
        assert_eq!((prefill.worker_id.as_str(), prefill.overlap), ("p1", 4));
        // The pinned blocks were not counted against d1's free blocks: 64 - (5 - 0) for the first.
        assert_eq!(r.workers["d1"].free_estimate(), 59);
        r.begin(&second, &ask);
        assert_eq!(r.workers["d1"].free_estimate(), 58, "only the one missing block");
        // The next digest replaces the set: d1 says it holds nothing.
        r.heartbeat("d1", Some(load(58, 0)), t0);
        r.set_cache("d1", Some(&digest(&[])));
        assert_eq!(r.pick(&ask).unwrap().decoder().worker_id, "d2");
        // Workers without a cache are never taken to hold anything.
        let mut r = registry();
        r.admit(worker("c1", Role::Colocated, 1, &[]), false, t0).unwrap();
        r.admit(worker("c2", Role::Colocated, 2, &[]), false, t0).unwrap();
        let first = r.pick(&ask).unwrap();
        r.begin(&first, &ask);
        assert!(r.workers["c1"].cache.is_none());
        assert_eq!(r.pick(&ask).unwrap().decoder().worker_id, "c2");
    }
}
