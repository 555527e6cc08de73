//! Who takes a request: the decode (or colocated) worker by cached prefix and free blocks, then
//! the prefill worker by cached prefix and queued prompt tokens.
//!
//! Pure (no tokio, no tonic): the choice reads the table's entries and the request's named prompt
//! blocks, and [`Registry::begin`] counts the request on the workers it got.
//!
//! Worker choice is cache-aware: each worker's latest cache digest (the short hashes of the full
//! KV blocks its prefix cache holds, and of those its KV tiers keep in host memory or on disk) is
//! kept as a set and a map, and a request goes where the leading blocks of its prompt already are
//! unless that worker lacks room (see [`Registry::pick`]); a block in a tier counts for less than
//! one in the pool ([`HOST_WEIGHT`], [`DISK_WEIGHT`]). A digest is a hint, never a promise: the
//! decode worker's `Reserve` answer says what it really holds. Without digests (or for prompts
//! shorter than one block) the choice is by load alone.
//!
//! Invariants:
//! - Draining and unhealthy workers are never chosen; a decode worker is chosen only when some
//!   prefill worker can feed it, and then with a prefill worker that shares a transport with it,
//!   or, with no prefill worker usable and `--prefill-fallback decode`, to compute the prompt
//!   itself ([`Plan::Colocated`] on a decode worker).
//! - Without digests (or with no overlap anywhere) the choice is the load-only rule: most free
//!   blocks, then fewest requests in flight, then the lowest id.

use tandem_model::prefix;
use tandem_proto::v1::Role;

use super::adapters::AdapterKey;
use super::admission::common_transport;
use super::table::{Registry, Tier, WorkerEntry, MAX_CACHE_HASHES};
use super::{Plan, Target};

/// What one prompt block a decode-capable worker lacks costs, in blocks of load (free blocks).
/// A block the worker already holds saves its transfer (or, colocated, its computation) and the
/// pool block a fresh copy would take, so it is worth more than one free block elsewhere; 2 lets
/// a worker holding 4 of the prompt's blocks win against one with up to 7 more free blocks, while
/// a worker near full still loses to an idle one (and an overloaded one is never preferred).
pub const CACHE_WEIGHT: i64 = 2;

/// What a leading prompt block in a worker's pool counts for in its weighted overlap: one block,
/// as four quarters. The tier weights below are in quarters too, so that the arithmetic stays
/// integer (costs are compared in quarters of a block, or of a token).
pub const POOL_WEIGHT: u64 = 4;

/// What a leading prompt block the worker keeps only in its host-memory tier counts for: 3/4 of
/// a pool block. Reloading it saves computing (or transferring) the block as a pool hit does,
/// but the copy takes a pool block (pushing out a cached one) and a memory copy on the engine
/// thread before the prompt runs.
pub const HOST_WEIGHT: u64 = 3;

/// What a leading prompt block the worker keeps only on its disk tier counts for: 1/2 of a pool
/// block. The same pool block and copy as from host memory, plus a disk read the sequence waits
/// for (bounded: a page not read in time, or unreadable, is computed after all).
pub const DISK_WEIGHT: u64 = 2;

impl WorkerEntry {
    /// Blocks a new request could reserve now, as the router estimates them: the reported free
    /// blocks less those a decode worker keeps for its own sequences (the output they will still
    /// generate, as it reports it, else one block per running sequence and outstanding
    /// reservation; none at all while some of its sequences wait for blocks, as it then refuses
    /// reservations) and less what the router asked of it since the report.
    fn free_estimate(&self) -> u32 {
        if self.role() == Role::Decode && self.load.queued > 0 {
            return 0;
        }
        let kept = match self.role() {
            Role::Decode if self.load.growth_blocks > 0 => self.load.growth_blocks,
            Role::Decode => self.load.running + self.load.reservations,
            _ => 0,
        };
        self.load.free_blocks.saturating_sub(kept).saturating_sub(self.blocks_since_report)
    }

    /// Prompt tokens waiting on this prefill worker as the router estimates them now.
    fn queued_estimate(&self) -> u64 {
        self.load.queued_prompt_tokens.max(self.inflight_prompt_tokens)
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

    /// Leading blocks of `prompt` this worker holds as far as the router knows: each in its
    /// pool, else its host-memory tier, else its disk tier; the first block held nowhere ends the
    /// count (only reusable blocks are named, so never the last one).
    fn overlap(&self, prompt: &PromptBlocks) -> Overlap {
        let Some(cache) = &self.cache else {
            return Overlap::default();
        };
        let hashes = prompt.reusable(self.block_size());
        let pool = hashes.iter().take_while(|h| cache.contains(h)).count();
        let weighted = hashes
            .iter()
            .map_while(|h| {
                if cache.contains(h) {
                    return Some(POOL_WEIGHT);
                }
                match self.tiers.get(h)? {
                    Tier::Host => Some(HOST_WEIGHT),
                    Tier::Disk => Some(DISK_WEIGHT),
                }
            })
            .sum();
        Overlap { pool: pool as u32, weighted }
    }

    /// How this decode-capable worker ranks for `prompt`; lower is better.
    fn decode_rank(&self, prompt: &PromptBlocks) -> DecodeRank {
        let overlap = self.overlap(prompt);
        let blocks = prompt.blocks(self.block_size());
        // Room: a block reloaded from a tier takes a pool block as a missing one does.
        let needed = i64::from(blocks.saturating_sub(overlap.pool));
        // Cost, in quarters of a block: what a block held anywhere saves, by its weight.
        let missing = (u64::from(blocks) * POOL_WEIGHT).saturating_sub(overlap.weighted) as i64;
        let free = i64::from(self.free_estimate());
        let overloaded = free < needed;
        DecodeRank {
            overloaded,
            // Overloaded workers (chosen only when all are) go by free blocks alone.
            cost: if overloaded { -free } else { CACHE_WEIGHT * missing - free * POOL_WEIGHT as i64 },
            inflight: self.inflight_requests,
            overlap: overlap.pool,
        }
    }

    /// What this prefill worker would compute for `prompt` (tokens held nowhere, tier blocks
    /// counted by their weight) on top of what it has queued, in quarters of a token, and its
    /// pool overlap.
    fn prefill_cost(&self, prompt: &PromptBlocks) -> (u64, u32) {
        let overlap = self.overlap(prompt);
        let cached = overlap.weighted * u64::from(self.block_size());
        let tokens = prompt.tokens as u64 * POOL_WEIGHT;
        let cost = tokens.saturating_sub(cached).saturating_add(self.queued_estimate() * POOL_WEIGHT);
        (cost, overlap.pool)
    }
}

/// How much of a prompt's start a worker holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Overlap {
    /// Leading blocks in its pool: what a plan reports ([`Target::overlap`]) and a reservation
    /// pins instead of taking free blocks.
    pool: u32,
    /// Leading blocks held in the pool or a tier, each by its weight ([`POOL_WEIGHT`],
    /// [`HOST_WEIGHT`], [`DISK_WEIGHT`]), in quarters of a block.
    weighted: u64,
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

/// A request's prompt as worker choice sees it: its length, the short hashes of its reusable
/// full blocks (all but the block of the last token), for each block size among the workers
/// (colocated workers may use a block size of their own), and the LoRA adapter it runs under
/// (only workers holding it may take it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PromptBlocks {
    tokens: usize,
    hashes: Vec<(u32, Vec<u64>)>,
    adapter: Option<AdapterKey>,
}

impl PromptBlocks {
    /// A prompt of `tokens` tokens whose blocks are not named: it is routed by load alone.
    pub fn unhashed(tokens: usize) -> PromptBlocks {
        PromptBlocks { tokens, hashes: Vec::new(), adapter: None }
    }

    /// Names the reusable blocks of `prompt` for each of `block_sizes`, in the namespace of the
    /// model `model_id` and the cache salt `salt`, as workers name the blocks they cache.
    pub fn new(prompt: &[u32], model_id: &str, salt: &str, block_sizes: &[u32]) -> PromptBlocks {
        PromptBlocks::under(prompt, model_id, salt, None, block_sizes)
    }

    /// [`PromptBlocks::new`] for a request under the LoRA adapter `adapter` (None: the base
    /// model): its blocks are named in the adapter's namespace, as the workers' prefix caches name
    /// them (the salt followed by the adapter's id, [`prefix::adapter_salt`]), and only workers holding
    /// the adapter may take it.
    pub fn under(
        prompt: &[u32],
        model_id: &str,
        salt: &str,
        adapter: Option<AdapterKey>,
        block_sizes: &[u32],
    ) -> PromptBlocks {
        let root = match &adapter {
            None => prefix::chain_root(model_id, salt),
            Some(a) => prefix::chain_root(model_id, &prefix::adapter_salt(salt, Some(&a.id))),
        };
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
        PromptBlocks { tokens: prompt.len(), hashes, adapter }
    }

    /// The same prompt, to run under `adapter` (its blocks keep the names they have).
    pub fn with_adapter(mut self, adapter: Option<AdapterKey>) -> PromptBlocks {
        self.adapter = adapter;
        self
    }

    /// The LoRA adapter the request runs under (None: the base model).
    pub fn adapter(&self) -> Option<&AdapterKey> {
        self.adapter.as_ref()
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

impl Registry {
    /// Chooses where a request for `prompt` runs; draining and unhealthy workers are skipped.
    ///
    /// The decode-capable worker first (decode workers only when a prefill worker can feed them,
    /// or, with the prefill fallback on and no prefill worker usable, to run the whole request
    /// as a colocated worker would).
    /// For each, `overlap` is how many leading prompt blocks it holds, each counted by where:
    /// 1 in its pool, [`HOST_WEIGHT`]/4 in its host-memory tier, [`DISK_WEIGHT`]/4 on its disk
    /// tier (stopping at the first block held nowhere), and `missing = prompt_blocks - overlap`.
    /// A worker whose estimated free blocks are fewer than the blocks it must newly take (prompt
    /// blocks less those in its pool: a reloaded block takes one too) is overloaded; among the
    /// others the lowest `CACHE_WEIGHT * missing - free` wins (the load term is the blocks in
    /// use, counted as free blocks so that pools of different sizes compare as the load-only
    /// rule does). When every worker is overloaded, the one with the most free blocks. Ties go to
    /// fewer requests in flight, then the lowest id. With no overlap anywhere this is the
    /// load-only rule: most free blocks.
    ///
    /// Then the prefill worker sharing a transport with it whose
    /// `prompt_tokens - overlap * block_size + queued_prompt_tokens` is lowest, with the same
    /// weighted overlap (ties: fewer requests in flight, lowest id).
    ///
    /// The plan's [`Target::overlap`] is the pool's count alone.
    ///
    /// A request under a LoRA adapter ([`PromptBlocks::adapter`]) is taken only by workers that
    /// hold it (its name under its id), in both roles; among them those where it is resident (in
    /// a backend slot) come first, then the rule above (an overloaded worker still comes last).
    pub fn pick(&self, prompt: &PromptBlocks) -> Result<Plan, String> {
        self.pick_avoiding(prompt, &[])
    }

    /// [`Registry::pick`] with the worker incarnations in `avoid` (`id@address`: those a request
    /// already lost, in either role) never chosen. A worker restarted under the same id at
    /// another address may be chosen again.
    pub fn pick_avoiding(&self, prompt: &PromptBlocks, avoid: &[String]) -> Result<Plan, String> {
        let key = prompt.adapter();
        // Whether the worker may take the request, and whether its adapter is resident (always,
        // for the base model: the usual request never looks at adapters).
        let holds = |e: &WorkerEntry| match key {
            None => Some(true),
            Some(k) => e.holding(k),
        };
        let avoided = |e: &WorkerEntry| avoid.iter().any(|a| e.is(a)) || holds(e).is_none();
        let prefills = || self.usable(Role::Prefill).filter(|p| !avoided(p));
        let have_prefill = prefills().next().is_some();
        // With no prefill worker left, a decode worker computes the prompt itself (a plan like a
        // colocated worker's) when the fallback policy allows it.
        let decode_prefills = !have_prefill && self.prefill_fallback;
        let (decoder, rank) = self
            .workers
            .values()
            .filter(|e| e.usable() && !avoided(e))
            .filter(|e| {
                e.role() == Role::Colocated || (e.role() == Role::Decode && (have_prefill || decode_prefills))
            })
            .map(|e| (e, e.decode_rank(prompt), holds(e) != Some(true)))
            .min_by(|(a, ra, cold_a), (b, rb, cold_b)| {
                (ra.overloaded, cold_a, ra.cost, ra.inflight)
                    .cmp(&(rb.overloaded, cold_b, rb.cost, rb.inflight))
                    .then(a.info.worker_id.cmp(&b.info.worker_id))
            })
            .map(|(e, rank, _)| (e, rank))
            .ok_or_else(|| match key {
                Some(k) if self.serving().0 => self.no_holder(k, &|e| avoid.iter().any(|a| e.is(a))),
                _ => format!("no worker can take the request: {}", self.serving().1),
            })?;
        if decoder.role() == Role::Colocated || !have_prefill {
            return Ok(Plan::Colocated { worker: Target::of(decoder, rank.overlap) });
        }
        let (prefill, transport, (_, overlap)) = prefills()
            .filter_map(|p| common_transport(&p.info, &decoder.info).map(|t| (p, t, p.prefill_cost(prompt))))
            .min_by(|(a, _, ca), (b, _, cb)| {
                (holds(a) != Some(true))
                    .cmp(&(holds(b) != Some(true)))
                    .then(ca.0.cmp(&cb.0))
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::fixtures::*;
    use std::time::Instant;
    use tandem_proto::v1::{CacheDigest, WorkerLoad};

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
        // What it reports its sequences will grow into counts instead, when it reports it.
        r.heartbeat(
            "d1",
            Some(WorkerLoad { running: 8, reservations: 4, growth_blocks: 5, ..load(30, 0) }),
            t0,
        );
        assert_eq!(r.pick(&load_only()).unwrap().decoder().worker_id, "d1", "25 against 20");
        r.heartbeat("d1", Some(WorkerLoad { running: 2, growth_blocks: 11, ..load(30, 0) }), t0);
        assert_eq!(r.pick(&load_only()).unwrap().decoder().worker_id, "d2", "19 against 20");
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
        r.mark_draining("d1", &r.get("d1").unwrap().info.address.clone());
        assert_eq!(r.pick(&load_only()).unwrap().decoder().worker_id, "d2");
        // A lone full worker is still chosen: the request waits for it.
        r.mark_unhealthy("d1", &r.get("d1").unwrap().info.address.clone(), "gone");
        r.no_room("d2");
        assert_eq!(r.pick(&load_only()).unwrap().decoder().worker_id, "d2");
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
        r.prefill_done(&target(&r, "p1"), 100);
        let Plan::Split { prefill, .. } = r.pick(&load_only()).unwrap() else { panic!("split expected") };
        assert_eq!(prefill.worker_id, "p1");
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
        r.prefill_done(&target(&r, "p1"), 80);
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

    #[test]
    fn a_block_in_the_pool_beats_one_in_host_memory_which_beats_one_on_disk_which_beats_none() {
        let mut r = registry();
        let t0 = Instant::now();
        // The better the holder, the higher its id: ties would go the other way.
        for (i, id) in ["d1", "d2", "d3", "d4"].into_iter().enumerate() {
            r.admit(caching(id, Role::Decode, 1 + i as u16), false, t0).unwrap();
            r.heartbeat(id, Some(load(30, 0)), t0);
        }
        for (i, id) in ["p1", "p2", "p3", "p4"].into_iter().enumerate() {
            r.admit(caching(id, Role::Prefill, 11 + i as u16), false, t0).unwrap();
            r.heartbeat(id, Some(load(64, 0)), t0);
        }
        let ask = prompt(0, 80, "");
        let h = ask.reusable(16);
        for (d, p, digest) in [("d2", "p2", tiered(&[], &[], h)), ("d3", "p3", tiered(&[], h, &[]))] {
            r.set_cache(d, Some(&digest));
            r.set_cache(p, Some(&digest));
        }
        r.set_cache("d4", Some(&digest(h)));
        r.set_cache("p4", Some(&digest(h)));
        r.set_cache("d1", Some(&digest(&[])));
        r.set_cache("p1", Some(&digest(&[])));
        // Weighted overlaps (quarters) 16, 12, 8, 0; costs 2*4 - 4*30, 2*8 - 120, 2*12 - 120, 2*20 - 120.
        for (decode, prefill) in [("d4", "p4"), ("d3", "p3"), ("d2", "p2"), ("d1", "p1")] {
            let Plan::Split { prefill: p, decode: d, .. } = r.pick(&ask).unwrap() else {
                panic!("split expected")
            };
            assert_eq!((d.worker_id.as_str(), p.worker_id.as_str()), (decode, prefill));
            // The plan's overlap is the pool's: what a reservation pins.
            let pool = if decode == "d4" { 4 } else { 0 };
            assert_eq!((d.overlap, p.overlap), (pool, pool), "{decode}");
            r.set_cache(decode, Some(&digest(&[])));
            r.set_cache(prefill, Some(&digest(&[])));
        }
    }

    #[test]
    fn a_tier_overlap_loses_to_far_more_free_blocks_elsewhere_and_needs_room_in_the_pool() {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(caching("d1", Role::Decode, 1), false, t0).unwrap();
        r.admit(caching("d2", Role::Decode, 2), false, t0).unwrap();
        r.admit(worker("p1", Role::Prefill, 3, &[("tcp", "")]), false, t0).unwrap();
        let ask = prompt(0, 80, ""); // 5 blocks, 4 reusable
        let h = ask.reusable(16);
        r.heartbeat("d1", Some(load(30, 0)), t0);
        let pick_against = |r: &mut Registry, free: u32| {
            r.heartbeat("d2", Some(load(free, 0)), t0);
            r.pick(&ask).unwrap().decoder().worker_id.clone()
        };
        // In host memory: 2*(20 - 12) - 4*30 = -104 against 2*20 - 4*free.
        r.set_cache("d1", Some(&tiered(&[], h, &[])));
        assert_eq!(pick_against(&mut r, 35), "d1", "-104 < -100");
        assert_eq!(pick_against(&mut r, 37), "d2", "-104 > -108");
        // On disk: 2*(20 - 8) - 4*30 = -96.
        r.set_cache("d1", Some(&tiered(&[], &[], h)));
        assert_eq!(pick_against(&mut r, 33), "d1", "-96 < -92");
        assert_eq!(pick_against(&mut r, 35), "d2", "-96 > -100");
        // In the pool it would still win against 37 (2*4 - 120 = -112).
        r.set_cache("d1", Some(&digest(h)));
        assert_eq!(pick_against(&mut r, 37), "d1");
        // A tier block is reloaded into a pool block: 4 free blocks are no room for 5 blocks.
        r.heartbeat("d1", Some(load(4, 0)), t0);
        assert_eq!(pick_against(&mut r, 5), "d1", "in the pool: 1 block to take, 4 free");
        r.set_cache("d1", Some(&tiered(&[], h, &[])));
        assert_eq!(pick_against(&mut r, 5), "d2", "d1 overloaded holding the prompt in memory only");
        r.set_cache("d1", Some(&tiered(&h[..3], &h[3..], &[])));
        assert_eq!(pick_against(&mut r, 5), "d1", "3 blocks in the pool: 2 to take, 4 free");
    }

    #[test]
    fn tier_blocks_count_only_up_to_the_first_block_held_nowhere() {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(caching("d1", Role::Decode, 1), false, t0).unwrap();
        r.admit(caching("d2", Role::Decode, 2), false, t0).unwrap();
        r.admit(worker("p1", Role::Prefill, 3, &[("tcp", "")]), false, t0).unwrap();
        let ask = prompt(0, 80, "");
        let h = ask.reusable(16).to_vec();
        let overlap = |r: &Registry| r.workers["d1"].overlap(&ask);
        r.heartbeat("d1", Some(load(30, 0)), t0);
        r.heartbeat("d2", Some(load(31, 0)), t0);
        r.set_cache("d2", Some(&digest(&h[..1])));
        // Block 1 held nowhere: blocks 2 and 3 in memory are of no use.
        r.set_cache("d1", Some(&tiered(&h[..1], &h[2..], &[])));
        assert_eq!(overlap(&r), Overlap { pool: 1, weighted: 4 });
        assert_eq!(r.pick(&ask).unwrap().decoder().worker_id, "d2", "same overlap, one more free block");
        // Nor is anything without the first block.
        r.set_cache("d1", Some(&tiered(&[], &h[1..], &h[1..])));
        assert_eq!(overlap(&r), Overlap::default());
        // Each block counts where it is held; the pool's count stops at the first block not there.
        r.set_cache("d1", Some(&tiered(&[h[0], h[2]], &[h[1]], &[h[3]])));
        assert_eq!(overlap(&r), Overlap { pool: 1, weighted: 4 + 3 + 4 + 2 });
        let plan = r.pick(&ask).unwrap();
        assert_eq!((plan.decoder().worker_id.as_str(), plan.decoder().overlap), ("d1", 1));
        // A hash in both tiers is memory's; the next digest replaces the tiers too.
        r.set_cache("d1", Some(&tiered(&[], &h, &h)));
        assert_eq!(overlap(&r), Overlap { pool: 0, weighted: 4 * 3 });
        r.set_cache("d1", Some(&digest(&h[..1])));
        assert_eq!(overlap(&r), Overlap { pool: 1, weighted: 4 });
        assert!(r.workers["d1"].tiers.is_empty());
        // Routed prompts are remembered in the pool, not the tiers.
        r.set_cache("d1", Some(&tiered(&[], &h, &[])));
        let plan = r.pick(&ask).unwrap();
        assert_eq!(plan.decoder().worker_id, "d1");
        r.begin(&plan, &ask);
        assert_eq!(overlap(&r), Overlap { pool: 4, weighted: 16 });
        // A disabled cache knows nothing of its tiers either.
        r.set_cache("d1", Some(&CacheDigest { enabled: false, ..tiered(&[], &h, &h) }));
        assert_eq!(overlap(&r), Overlap::default());
    }
}
