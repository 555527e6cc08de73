//! The in-process generation loop: a scheduler over one backend and one block allocator.
//!
//! Every [`Engine::step`] runs one forward pass over a batch that mixes decode steps (one token
//! for every running sequence) and prefill chunks (waiting prompts, chunked under the token
//! budget). A step is split in two:
//! - [`plan`] *decides*: from plain numbers (sequence lengths, tokens already cached, blocks held
//!   and free, the token budget, `max_num_seqs`) a pure function returns a [`plan::Plan`] — which
//!   sequences run, how many tokens each, which are preempted and in what order. It is tested
//!   without a model.
//! - `execute` *does*: it applies the plan's preemptions and allocations to the allocator in the
//!   plan's order, runs the backend, samples, detokenizes, checks stop rules and emits
//!   [`SeqEvent`]s (`sequence` holds the per-sequence part of that).
//!
//! Invariants of a step: the batch never holds more than `max_batch_tokens` tokens; allocations
//! never exceed the free blocks (the plan counts them, the allocator confirms); when the pool runs
//! out during decode the newest sequence holding blocks is preempted (its blocks freed, its tokens
//! recomputed later), so older sequences always make progress; a new prompt is admitted only with
//! blocks for all its tokens, in arrival order, and never by preempting anything. Block
//! bookkeeping is the engine's: it allocates before a pass, hands the tables to the backend, and
//! frees a sequence's blocks the moment it finishes, fails or is cancelled.
//!
//! Disaggregated serving adds two kinds of KV owners besides ordinary requests:
//! - *reservations* ([`Engine::reserve`]): blocks a decode worker sets aside for a transfer,
//!   granted by the rule of [`plan::check_reservation`] and owned by the engine's one
//!   [`ReservationTable`] (state, lease and blocks together; see [`crate::kv::reservation`]).
//!   The table is shared ([`Engine::reservations`]) so that a transfer's receiver can move a
//!   reservation through reserved → filling → filled, or end it, without waiting for a step;
//!   blocks of reservations ended that way go back to the allocator at the next step or
//!   [`Engine::reclaim_reservations`]. [`Engine::add_prefilled`] turns a filled one into a
//!   running sequence whose prompt is already cached and whose first token was sampled by the
//!   prefill worker;
//! - *prefill-only requests* ([`Engine::add_prefill_request`]): they stop after sampling their
//!   first token ([`SeqEvent::Prefilled`]) and then *hold* their blocks, without running, until
//!   [`Engine::release_prefilled`] (the prefill worker copies the blocks out in between).
//!
//! Held sequences and reservations are live owners for [`Engine::check_kv`], are never preempted,
//! and may keep the pool busy while nothing can run: a step then plans nothing and the engine is
//! [`Engine::stalled`] until a release, which is not an error.
//!
//! **Speculative decoding** ([`Engine::with_speculation`]). Before planning, each running sequence
//! asks for a depth ([`crate::spec::depth`]) and the drafter proposes that many tokens at most; the
//! planner turns decode entries into verification entries with what budget and blocks allow. The
//! pass stages exactly the verification chunks (prefill and decode chunks are written direct), and
//! before the step returns, on every path, the engine either commits the accepted prefix of each
//! verification chunk or discards the pass, then truncates each sequence's blocks to what it kept.
//! No staged data ever outlives a step ([`Backend::staged_pending`] is checked after each).
//!
//! **Prefix cache** ([`Engine::with_prefix_cache`]). After every step each sequence registers
//! its newly completed full blocks of committed tokens (never draft tokens) under their hash
//! chain ([`crate::kv::prefix`]); a finished, cancelled or preempted sequence's registered blocks
//! stay cached in the allocator until evicted. Before planning, a queued sequence that holds
//! nothing looks its tokens up and, when leading blocks are cached, *attaches* them: it holds
//! them (shared with anyone else using them) and starts computing after them; the block of its
//! last token is always computed. Attaching is done in queue order and only while the blocks the
//! attached sequences still need, plus one per running sequence, stay available, so the planner
//! then admits them as usual; a step that would stall with attached sequences detaches them and
//! plans again. A decode worker's reservation ([`Engine::reserve_prompt`]) pins the cached prefix
//! of the incoming prompt and reserves raw blocks only for the rest.

mod adapters;
mod budget;
pub mod cost;
mod execute;
mod generate;
pub mod plan;
mod prefix;
mod sequence;
mod tiers;

pub use adapters::{AdapterStats, AdapterStatus};
pub use tiers::{TierEngineStats, RELOAD_WAIT};

use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

pub use crate::kv::reservation::{ReservationId, ReservationState, Reserved};

use self::plan::{ReservationAsk, ReservationRefusal};
use self::sequence::{Phase, PromptScores, SeqGrammar, SeqPrefix, Sequence};
use crate::backend::Backend;
use crate::error::{EngineError, Result};
use crate::kv::prefix::{chain_root, reusable_blocks, BlockHash};
use crate::kv::reservation::{ReservationError, ReservationTable, SharedReservations};
use crate::kv::{BlockAllocator, BlockId, KvStats, SeqId};
use crate::sampler::{FinishReason, Sampler, SamplingParams, TokenStop};
use crate::spec::depth::SeqDepth;
use crate::spec::{Drafter, SpecCounts, SpecMethod, SpecOptions, SpecStats};
use crate::tokenizer::Tokenizer;
use tandem_model::request::Request;

/// Scheduler limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerOptions {
    /// Most tokens in one forward pass (decode tokens plus prefill chunks).
    pub max_batch_tokens: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
}

impl Default for SchedulerOptions {
    fn default() -> Self {
        SchedulerOptions { max_batch_tokens: 512, max_num_seqs: 64 }
    }
}

/// Something that happened to a sequence during a step.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqEvent {
    /// A new token. The engine makes no text: tokens become text where they are shown
    /// ([`tandem_model::text::TextOutput`]: the router, or [`Engine::generate`] in process).
    /// `logprob` and `top_logprobs` (the request's `logprobs` most likely alternatives, empty
    /// unless asked for) are under the model's own distribution ([`crate::sampler`]).
    Token { seq: SeqId, token: u32, logprob: f32, top_logprobs: Vec<(u32, f32)> },
    /// A token rule ended the sequence (`max_tokens`, an EOS or stop token, the context limit);
    /// the token that ended it was the sequence's last [`SeqEvent::Token`]. `speculation` counts
    /// its draft tokens proposed and accepted (zero without speculation).
    Finished { seq: SeqId, reason: FinishReason, speculation: SpecCounts },
    /// The sequence was aborted by an error; its blocks are already freed.
    Failed { seq: SeqId, error: String },
    /// A prefill-only request computed its prompt and sampled its first token; `finish` says
    /// whether that token already ends the sequence by a token rule (then no decode follows).
    /// Its blocks stay allocated (see [`Engine::block_table`]) until [`Engine::release_prefilled`].
    Prefilled {
        seq: SeqId,
        token: u32,
        logprob: f32,
        top_logprobs: Vec<(u32, f32)>,
        finish: Option<FinishReason>,
    },
    /// A request that asked for `prompt_logprobs` computed its prompt: the log-probability of
    /// each prompt token after the first under the model's own distribution at the position
    /// before it, and that many most likely alternatives there. Comes in the step of, and just
    /// before, the sequence's first [`SeqEvent::Token`] or [`SeqEvent::Prefilled`].
    PromptLogprobs { seq: SeqId, logprobs: Vec<f32>, top_logprobs: Vec<Vec<(u32, f32)>> },
}

/// What the engine holds and waits for, for load reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineLoad {
    /// Sequences holding blocks and computing (prefilling or decoding).
    pub running: usize,
    /// Sequences waiting for admission (no blocks yet, or preempted).
    pub waiting: usize,
    /// Prompt tokens not yet computed, over every sequence that has some left.
    pub waiting_prompt_tokens: usize,
    /// Prefilled sequences holding their blocks until released.
    pub held: usize,
    /// Outstanding raw reservations.
    pub reservations: usize,
    /// Blocks the running sequences and outstanding reservations will still grow into (what
    /// admitting a reservation keeps free; see [`plan::check_reservation`]).
    pub growth_blocks: usize,
}

/// Prefix-cache counters since the engine started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Prompts looked up: sequences getting blocks, and reservations with their prompt.
    pub lookups: u64,
    /// Tokens of those prompts.
    pub lookup_tokens: u64,
    /// Tokens found cached (not computed here, or for a reservation not transferred).
    pub hit_tokens: u64,
    /// Cached blocks evicted to make room.
    pub evictions: u64,
    /// Blocks cached now and held by nobody.
    pub cached_blocks: usize,
    /// Prompt tokens computed by forward passes (cache hits excluded, recomputation included).
    pub computed_prompt_tokens: u64,
}

impl PrefixStats {
    /// Counts one prompt of `tokens` tokens looked up.
    fn looked_up(&mut self, tokens: usize) {
        self.lookups += 1;
        self.lookup_tokens += tokens as u64;
    }
}

/// The prefix cache's settings and counters.
struct PrefixCache {
    /// The model identity every chain starts from.
    identity: String,
    stats: PrefixStats,
}

/// A drafter, its settings and what it achieved.
struct Speculation {
    drafter: Box<dyn Drafter>,
    opts: SpecOptions,
    stats: SpecStats,
}

/// A batch-serving engine over one backend.
pub struct Engine {
    backend: Box<dyn Backend>,
    alloc: BlockAllocator,
    tokenizer: Tokenizer,
    opts: SchedulerOptions,
    seqs: BTreeMap<SeqId, Sequence>,
    /// Admission order; sequences stay here while they have prompt tokens left to compute.
    queue: VecDeque<SeqId>,
    next_id: SeqId,
    /// The reservation table: the one owner of every reservation and its blocks. Shared with a
    /// decode worker's transfer gate; only the engine, holding the allocator, moves blocks.
    reservations: SharedReservations,
    /// The last step planned nothing although sequences were waiting (blocks held elsewhere).
    stalled: bool,
    /// Speculative decoding, when on.
    spec: Option<Speculation>,
    /// The prefix cache, when on.
    prefix: Option<PrefixCache>,
    /// Cached prompt tokens of the sequences that left during the last step (for reports made
    /// after their last event).
    left_cached: BTreeMap<SeqId, usize>,
    /// What structured output cost since the engine started.
    structured: StructuredStats,
    /// The inter-token latency budget, when set ([`Engine::with_itl_target`]).
    budget: Option<budget::LatencyBudget>,
    /// The KV tiers behind the pool, when on ([`Engine::with_kv_tiers`]).
    tiers: Option<tiers::Tiers>,
    /// LoRA adapters held and resident ([`adapters`]).
    adapters: adapters::Adapters,
}

/// The cost of structured output since the engine started: token masks computed (one per
/// constrained position sampled, or verified), the time spent computing them (on the mask thread,
/// beside the forward pass), and the part of it the step waited for after its pass was done.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StructuredStats {
    pub masks: u64,
    pub mask_seconds: f64,
    /// Time a step waited for masks after its forward pass finished (on a backend that samples
    /// on its device, after the pass was enqueued, while the device may still be computing it):
    /// the cost a constrained request adds to every request's step.
    pub exposed_seconds: f64,
}

impl Engine {
    /// Wraps a backend; the allocator mirrors the backend's KV pool, and a step never holds
    /// more tokens than the backend accepts.
    pub fn new(backend: Box<dyn Backend>, tokenizer: Tokenizer, mut opts: SchedulerOptions) -> Engine {
        let layout = backend.kv_layout();
        opts.max_batch_tokens = opts.max_batch_tokens.min(backend.max_batch_tokens()).max(1);
        opts.max_num_seqs = opts.max_num_seqs.max(1);
        let backend_slots = backend.adapter_slots();
        Engine {
            alloc: BlockAllocator::with_windows(
                layout.num_blocks,
                layout.block_size,
                backend.kv_groups().windows(),
            )
            .expect("a backend's pool has valid layer groups"),
            backend,
            tokenizer,
            opts,
            seqs: BTreeMap::new(),
            queue: VecDeque::new(),
            next_id: 1,
            reservations: SharedReservations::new(ReservationTable::default()),
            stalled: false,
            spec: None,
            prefix: None,
            left_cached: BTreeMap::new(),
            structured: StructuredStats::default(),
            budget: None,
            tiers: None,
            adapters: adapters::Adapters::new(backend_slots),
        }
    }

    /// What structured output cost since the engine started ([`StructuredStats`]).
    pub fn structured_stats(&self) -> StructuredStats {
        self.structured
    }

    /// Turns the prefix cache on: full blocks of committed tokens are named by a hash chain
    /// rooted in `model_identity` (use the model id every worker of a cluster shares, so that
    /// routers and peers compute the same names) and each request's
    /// [`SamplingParams::cache_salt`], and reused by later sequences that start with the same
    /// tokens. It changes speed and KV usage, never output. Call before adding requests.
    pub fn with_prefix_cache(mut self, model_identity: &str) -> Engine {
        self.alloc.set_caching(true);
        self.prefix =
            Some(PrefixCache { identity: model_identity.to_owned(), stats: PrefixStats::default() });
        tracing::info!(model_identity, "prefix cache on");
        self
    }

    /// Whether the prefix cache is on.
    pub fn prefix_cache(&self) -> bool {
        self.prefix.is_some()
    }

    /// Prefix-cache counters (zeros when off).
    pub fn prefix_stats(&self) -> PrefixStats {
        let Some(p) = &self.prefix else { return PrefixStats::default() };
        let kv = self.alloc.stats();
        PrefixStats { evictions: kv.evictions, cached_blocks: kv.cached, ..p.stats }
    }

    /// The first 64 bits of the hash of every block the prefix cache can serve (in use first,
    /// then cached, most recently released first), at most `limit`; empty when off.
    pub fn cache_digest(&self, limit: usize) -> Vec<u64> {
        self.cache_names(limit).into_iter().map(BlockHash::short).collect()
    }

    /// [`Engine::cache_digest`]'s blocks by their whole names.
    pub fn cache_names(&self, limit: usize) -> Vec<BlockHash> {
        if self.prefix.is_none() {
            return Vec::new();
        }
        self.alloc.registered_hashes(limit)
    }

    /// Prompt tokens of a sequence that the prefix cache supplied instead of computing them (0
    /// without a prefix cache): for a live sequence, or one that left during the last step.
    pub fn cached_tokens(&self, seq: SeqId) -> Option<usize> {
        match self.seqs.get(&seq) {
            Some(s) => Some(s.prefix.as_ref().map_or(0, |p| p.cached_tokens)),
            None => self.left_cached.get(&seq).copied(),
        }
    }

    /// The chain root for a request's salt, when the prefix cache is on.
    fn prefix_root(&self, salt: &str) -> Option<BlockHash> {
        self.prefix.as_ref().map(|p| chain_root(&p.identity, salt))
    }

    /// Turns speculative decoding on: `drafter` proposes draft tokens for running sequences, which
    /// one staged verification pass per step checks against this engine's model. Greedy output and
    /// seeded sampled output are the same as without it; only the speed changes.
    pub fn with_speculation(mut self, drafter: Box<dyn Drafter>, opts: SpecOptions) -> Result<Engine> {
        opts.validate()?;
        if drafter.method() == SpecMethod::Off {
            return Err(EngineError::InvalidRequest("a drafter must speculate (ngram or draft)".into()));
        }
        tracing::info!(drafter = %drafter.describe(), k = opts.max_draft, adaptive = opts.adaptive, "speculative decoding on");
        self.spec = Some(Speculation { drafter, opts, stats: SpecStats::default() });
        Ok(self)
    }

    /// How this engine speculates: [`SpecMethod::Off`] without a drafter.
    pub fn spec_method(&self) -> SpecMethod {
        self.spec.as_ref().map_or(SpecMethod::Off, |s| s.drafter.method())
    }

    /// The speculation settings and the drafter's description, when on.
    pub fn spec_config(&self) -> Option<(SpecOptions, String)> {
        self.spec.as_ref().map(|s| (s.opts, s.drafter.describe()))
    }

    /// Draft tokens proposed and accepted since the engine started (zeros when off).
    pub fn spec_stats(&self) -> SpecStats {
        self.spec.as_ref().map(|s| s.stats).unwrap_or_default()
    }

    /// Draft tokens proposed and accepted for a live sequence.
    pub fn spec_counts(&self, seq: SeqId) -> Option<SpecCounts> {
        self.seqs.get(&seq).map(|s| s.spec)
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    /// Allocator counters.
    pub fn kv_stats(&self) -> KvStats {
        self.alloc.stats()
    }

    /// Pages per token block: the KV pool's layer groups ([`crate::kv::groups`]; 1 without).
    /// [`Self::kv_stats`] counts pages.
    pub fn kv_groups(&self) -> usize {
        self.alloc.groups()
    }

    /// Window of each layer group of the KV pool (`[None]` without groups).
    pub fn kv_windows(&self) -> &[Option<usize>] {
        self.alloc.windows()
    }

    /// Runs the allocator's invariant checker, and at quiescence also checks nothing is held.
    pub fn check_kv(&self) -> Result<()> {
        self.alloc
            .check_invariants()
            .map_err(|v| EngineError::Internal(format!("KV allocator invariant violated: {v}")))?;
        for owner in self.alloc.sequences() {
            if !self.seqs.get(&owner).is_some_and(|s| s.has_blocks) {
                return Err(EngineError::Internal(format!(
                    "sequence {owner} owns KV blocks but is not live"
                )));
            }
        }
        if let Some((id, _)) =
            self.seqs.iter().find(|(id, s)| s.has_blocks && self.alloc.seq_len(**id).is_none())
        {
            return Err(EngineError::Internal(format!("sequence {id} thinks it holds blocks but owns none")));
        }
        let s = self.alloc.stats();
        // One lock for both checks: the table cannot change between them.
        let table = self.reservations.lock();
        table
            .check(&self.alloc)
            .map_err(|v| EngineError::Internal(format!("reservation table and allocator disagree: {v}")))?;
        if let Some(spec) = &self.spec {
            spec.drafter.check_kv(self.seqs.is_empty())?;
        }
        if self.seqs.is_empty() {
            // Every block is free or cached, except those reservations (live or ended) hold.
            let held = table.held_blocks();
            if s.used != held.len() {
                return Err(EngineError::Internal(format!(
                    "no sequences but {} of {} blocks in use ({} held by reservations)",
                    s.used,
                    s.total,
                    held.len()
                )));
            }
        }
        Ok(())
    }

    /// Sequences not yet finished (held prefilled sequences included).
    pub fn num_active(&self) -> usize {
        self.seqs.len()
    }

    /// Whether a step has anything to do: a sequence that is not held waiting for its release.
    /// A worker steps while this is true and [`Self::stalled`] is false, and sleeps otherwise.
    pub fn has_work(&self) -> bool {
        self.seqs.values().any(|s| s.phase != Phase::Held)
    }

    /// The last step could run nothing because every block it needed is held by reservations or
    /// held sequences; stepping again before one of those is released is pointless.
    pub fn stalled(&self) -> bool {
        self.stalled
    }

    /// Counts for load reports.
    pub fn load(&self) -> EngineLoad {
        let (reservations, reserved_growth) = {
            let table = self.reservations.lock();
            (table.len(), table.growth())
        };
        let mut l = EngineLoad {
            reservations,
            growth_blocks: self.running_growth() + reserved_growth,
            ..Default::default()
        };
        for s in self.seqs.values() {
            match s.phase {
                Phase::Held => l.held += 1,
                _ if s.admitted => l.running += 1,
                _ => l.waiting += 1,
            }
            if s.phase != Phase::Held && s.computed < s.prompt_len {
                l.waiting_prompt_tokens += s.prompt_len - s.computed;
            }
        }
        l
    }

    /// When `seq` first got KV blocks, i.e. left the queue and started computing.
    pub fn started_at(&self, seq: SeqId) -> Option<Instant> {
        self.seqs.get(&seq).and_then(|s| s.started)
    }

    /// The block table of a live sequence (for a held prefilled one: the blocks to copy out, in
    /// order, covering exactly its prompt).
    pub fn block_table(&self, seq: SeqId) -> Option<&[BlockId]> {
        self.alloc.block_table(seq)
    }

    /// Longest sequence (prompt + output) the engine can hold.
    pub fn max_sequence_len(&self) -> usize {
        let cfg = self.backend.config();
        // Token blocks: one page per layer group each.
        let blocks = self.alloc.total_blocks() / self.alloc.groups();
        cfg.max_position_embeddings.min(blocks * self.alloc.block_size())
    }

    /// Blocks the running sequences will grow into within [`plan::GROWTH_HORIZON`] tokens each:
    /// what admitting a reservation keeps free for them.
    fn running_growth(&self) -> usize {
        let (max_len, bs) = (self.max_sequence_len(), self.alloc.block_size());
        self.seqs
            .iter()
            .filter(|(_, s)| s.phase == Phase::Generate && s.admitted && s.has_blocks)
            .map(|(&id, s)| {
                let held = self.alloc.held(id);
                let windows = self.alloc.windows();
                plan::growth_blocks(s.tokens.len(), held, Some(s.stop.tokens_left()), max_len, bs, windows)
            })
            .sum()
    }

    /// Checks `prompt` and `params` against this engine's model: the one validation, for callers
    /// that hold unchecked parameters (in process). A worker decodes its wire request into a
    /// [`Request`] itself and calls [`Self::add`] and its siblings.
    pub fn request(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<Request> {
        Ok(Request::new(prompt, params, self.backend.config().vocab_size)?)
    }

    /// Queues a request. Refuses it at once if it can never run.
    pub fn add_request(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<SeqId> {
        let req = self.request(prompt, params)?;
        self.add(req)
    }

    /// Queues a validated request. Refuses it at once if it can never run here (the prompt
    /// against the context length and the KV pool).
    pub fn add(&mut self, req: Request) -> Result<SeqId> {
        self.check_fits(&req)?;
        let grammar = self.compile_constraint(&req)?;
        Ok(self.insert_queued(req, Phase::Generate, grammar))
    }

    /// Queues a prefill-only request: once its prompt is computed and its first token sampled,
    /// the engine emits [`SeqEvent::Prefilled`] (saying whether that token already ends the
    /// sequence by a token rule) and keeps the sequence's blocks (and the KV in them) until
    /// [`Self::release_prefilled`]. Refused at once if the prompt could never be continued here
    /// (same limits as [`Self::add_request`]).
    pub fn add_prefill_request(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<SeqId> {
        let req = self.request(prompt, params)?;
        self.add_prefill(req)
    }

    /// [`Self::add_prefill_request`] of a validated request.
    pub fn add_prefill(&mut self, req: Request) -> Result<SeqId> {
        self.check_fits(&req)?;
        let grammar = self.compile_constraint(&req)?;
        Ok(self.insert_queued(req, Phase::PrefillOnly, grammar))
    }

    /// The request's structured-output constraint compiled against this model's vocabulary, at
    /// the start of the output; `None` without one. A constraint the engine cannot compile is an
    /// invalid request naming the problem.
    fn compile_constraint(&self, req: &Request) -> Result<Option<SeqGrammar>> {
        let Some(c) = &req.params().constraint else { return Ok(None) };
        let env = self.tokenizer.grammar()?;
        let mut g = env
            .compile(c)
            .map_err(|e| EngineError::InvalidRequest(format!("constraint: invalid {}: {e}", c.kind())))?;
        // A continuation: the prompt ends with tokens already written under the constraint.
        let prompt = req.prompt();
        let written = &prompt[prompt.len() - req.params().constraint_generated..];
        for &t in written {
            if !g.allows_next(t).map_err(EngineError::Internal)? {
                return Err(EngineError::InvalidRequest(
                    "constraint_generated: the prompt's last tokens are not allowed by the constraint".into(),
                ));
            }
            g.advance(t).map_err(EngineError::Internal)?;
        }
        Ok(Some(SeqGrammar::new(g)))
    }

    /// Frees the blocks of a prefilled sequence (after its KV was copied out) and forgets it.
    /// Errors if `seq` is unknown (already released) or has not emitted [`SeqEvent::Prefilled`];
    /// use [`Self::cancel`] to drop a prefill that is still queued or running.
    pub fn release_prefilled(&mut self, seq: SeqId) -> Result<()> {
        match self.seqs.get(&seq) {
            Some(s) if s.phase == Phase::Held => self.remove(seq),
            Some(_) => Err(EngineError::InvalidRequest(format!(
                "sequence {seq} is not a prefilled sequence waiting for release"
            ))),
            None => Err(EngineError::InvalidRequest(format!(
                "sequence {seq} is unknown (never prefilled, or already released)"
            ))),
        }
    }

    /// Reserves raw KV blocks for `n_tokens` prompt tokens that a transfer will fill. The blocks
    /// belong to the reservation until [`Self::add_prefilled`] adopts them or
    /// [`Self::release_reservation`] frees them.
    ///
    /// Sequences already here come first, as a new prompt would: a reservation is refused while a
    /// sequence waits to be scheduled (preempted, or a queued prompt), and it must leave free the
    /// blocks the running sequences and outstanding reservations will grow into (one block for a
    /// reservation of unknown output, such as this one; see [`Self::reserve_for`] and
    /// [`plan::check_reservation`]). With nothing running or reserved, any prompt that fits the
    /// pool is taken, so a reservation is never refused forever.
    ///
    /// Errors: [`EngineError::InvalidRequest`] when such a prompt could never run here,
    /// [`KvError::OutOfBlocks`](crate::kv::KvError::OutOfBlocks) (as [`EngineError::Kv`]) when
    /// the blocks are not free now, and [`EngineError::Busy`] when they are but are owed to the
    /// sequences above.
    pub fn reserve(&mut self, n_tokens: usize) -> Result<(ReservationId, Vec<BlockId>)> {
        let r = self.reserve_for("", n_tokens, &[], "", 0)?;
        Ok((r.id, r.blocks))
    }

    /// Like [`Self::reserve`] for the prompt `prompt` with the prefix-cache salt `salt`: when the
    /// prefix cache holds the prompt's leading blocks, the reservation pins them and reserves raw
    /// blocks only for the rest ([`Reserved::blocks`]), which is all a transfer has to fill. The
    /// block of the last prompt token is always reserved raw. Without a prefix cache it is
    /// [`Self::reserve`] of `prompt.len()` tokens. Same errors.
    pub fn reserve_prompt(&mut self, prompt: &[u32], salt: &str) -> Result<Reserved> {
        self.reserve_for("", prompt.len(), prompt, salt, 0)
    }

    /// What a decode worker's `Reserve` does: [`Self::reserve_prompt`] of `prompt` for request
    /// `request_id`, or, with an empty `prompt`, [`Self::reserve`] of `n_tokens` tokens. The
    /// reservation remembers `request_id` (so a release by request id finds it and only that
    /// request adopts it), and is refused with
    /// [`ReservationError::ReleasedEarly`](crate::kv::reservation::ReservationError::ReleasedEarly)
    /// (as [`EngineError::Reservation`]) when the request was released before it landed.
    /// `max_new_tokens` (0: not said) is how many tokens the request may generate: admission
    /// keeps free the blocks that output will need within [`plan::GROWTH_HORIZON`] tokens, besides
    /// those of the sequences and reservations already here.
    pub fn reserve_for(
        &mut self,
        request_id: &str,
        n_tokens: usize,
        prompt: &[u32],
        salt: &str,
        max_new_tokens: usize,
    ) -> Result<Reserved> {
        if !prompt.is_empty() && prompt.len() != n_tokens {
            return Err(EngineError::InvalidRequest(format!(
                "a prompt of {} tokens cannot fill a reservation of {n_tokens}",
                prompt.len()
            )));
        }
        // Blocks of reservations ended off this thread count as free for the decision below.
        self.reclaim_reservations()?;
        let bs = self.alloc.block_size();
        let hits = match self.prefix_root(salt) {
            Some(root) if !prompt.is_empty() => {
                let n = reusable_blocks(prompt.len(), bs);
                let hashes = crate::kv::prefix::block_hashes(root, &prompt[..n * bs], bs);
                // Pages in a tier's memory come back now; a prefill worker supplies the rest.
                self.reload_prefix(&hashes)?;
                self.alloc.lookup_table(&hashes, Some(n_tokens))
            }
            _ => Vec::new(),
        };
        // The hit as token blocks, and the pages to pin (window groups need none for some).
        let hit_blocks = hits.len() / self.alloc.groups();
        let pinned: Vec<BlockId> = hits.into_iter().filter(|&b| b != crate::kv::NO_PAGE).collect();
        let hit_tokens = hit_blocks * bs;
        let mut r = self.reserve_with(request_id, n_tokens, pinned, max_new_tokens)?;
        r.cached_blocks = hit_blocks;
        if let Some(p) = &mut self.prefix {
            if !prompt.is_empty() {
                p.stats.looked_up(prompt.len());
                p.stats.hit_tokens += hit_tokens as u64;
            }
        }
        Ok(r)
    }

    /// Reserves blocks for `n_tokens` tokens of `request_id` whose first `pinned.len()` blocks
    /// are the cached blocks `pinned` (already checked against the prompt's hashes).
    fn reserve_with(
        &mut self,
        request_id: &str,
        n_tokens: usize,
        pinned: Vec<BlockId>,
        max_new_tokens: usize,
    ) -> Result<Reserved> {
        if n_tokens == 0 {
            return Err(EngineError::InvalidRequest("cannot reserve KV blocks for 0 tokens".into()));
        }
        let max_len = self.max_sequence_len();
        if n_tokens >= max_len {
            return Err(EngineError::InvalidRequest(format!(
                "a prompt of {n_tokens} tokens can never run here: the limit is {} (context length and KV pool), leaving room for at least one generated token",
                max_len.saturating_sub(1)
            )));
        }
        let raw_needed = self.alloc.kept_pages(n_tokens, 0) - pinned.len();
        // Pinning a cached block nobody holds takes it from the available ones too.
        let needed = raw_needed + self.alloc.unreferenced(&pinned);
        let free = self.alloc.available_blocks();
        // The same counts the worker reports, from which the router estimates room.
        let load = self.load();
        let bs = self.alloc.block_size();
        // Once it runs, the sequence holds the prompt's blocks, its next pass covers the prompt
        // and the first token (sampled by the prefill worker), and it may generate the rest.
        let own_growth = if max_new_tokens == 0 {
            0
        } else {
            let left = Some(max_new_tokens - 1);
            let held = self.alloc.kept_pages(n_tokens, 0);
            plan::growth_blocks(n_tokens + 1, held, left, max_len, bs, self.alloc.windows())
        };
        let ask = ReservationAsk {
            needed,
            free,
            waiting: load.waiting,
            running: load.running,
            reservations: load.reservations,
            growth: load.growth_blocks,
            own_growth,
        };
        match plan::check_reservation(ask) {
            Ok(()) => {}
            Err(ReservationRefusal::Waiting { waiting }) => {
                return Err(EngineError::Busy(format!(
                    "{waiting} sequence(s) here are waiting to be scheduled (preempted or queued) and go first ({needed} blocks needed, {free} free)"
                )));
            }
            Err(ReservationRefusal::KeptForGrowth { kept }) => {
                return Err(EngineError::Busy(format!(
                    "{needed} KV blocks needed and {free} free, but {kept} are kept for the running and reserved sequences to grow"
                )));
            }
            // The allocator refuses with the counts.
            Err(ReservationRefusal::OutOfBlocks) => {}
        }
        let r = {
            let mut table = self.reservations.lock();
            let r = table.reserve(&mut self.alloc, request_id, pinned, raw_needed, Instant::now())?;
            // Without a stated output, the table's one block stands for it (one token block: a
            // page per layer group).
            if max_new_tokens > 0 {
                table.set_growth(r.id, own_growth);
            } else if self.alloc.groups() > 1 {
                table.set_growth(r.id, self.alloc.groups());
            }
            r
        };
        // A transfer writes the raw blocks once they are handed out, outside the backend's order:
        // what they held is copied out first, completely.
        if let Err(e) = self.spill_evicted_then(true) {
            self.release_reservation(r.id)?;
            return Err(e);
        }
        self.stalled = false;
        Ok(r)
    }

    /// Releases a reservation (request cancelled, decode refused): its blocks go back at once,
    /// cached prefix blocks it pinned to the cache, unless a transfer is filling it, in which case
    /// it is marked and ends with the transfer. Returns false for an unknown id (already released,
    /// expired or adopted).
    pub fn release_reservation(&mut self, id: ReservationId) -> Result<bool> {
        let found = self.reservations.lock().release(id, "", Instant::now()).found();
        self.reclaim_reservations()?;
        Ok(found)
    }

    /// Gives the blocks of reservations that ended off the engine thread (released, expired,
    /// transfer failed) back to the allocator; returns how many reservations' blocks went back.
    /// Every step does it first; a decode worker also asks for it after ending one, so that an
    /// idle or stalled engine sees the room at once.
    pub fn reclaim_reservations(&mut self) -> Result<usize> {
        let n = self.reservations.lock().reclaim(&mut self.alloc)?;
        if n > 0 {
            self.stalled = false;
        }
        Ok(n)
    }

    /// The reservation table, shared: state-only transitions (a transfer beginning, completing or
    /// failing, a release, lease expiry) may run on any thread through it; blocks move only in
    /// the engine's own methods.
    pub fn reservations(&self) -> SharedReservations {
        self.reservations.clone()
    }

    /// The blocks a transfer fills for an outstanding reservation (not the cached prefix it pinned).
    pub fn reservation_blocks(&self, id: ReservationId) -> Option<Vec<BlockId>> {
        self.reservations.lock().blocks(id).map(|b| b.raw.clone())
    }

    /// Overwrites one layer of one reserved block with K/V bytes read from a peer's pool (an
    /// in-process transfer; workers fill reservations through their transport instead). Only
    /// the raw blocks of reservation `id` can be written this way, never cached prefix blocks.
    pub fn write_reserved_block(
        &mut self,
        id: ReservationId,
        layer: usize,
        block: BlockId,
        k: &[u8],
        v: &[u8],
    ) -> Result<()> {
        let fills = match self.reservations.lock().blocks(id) {
            Some(b) => b.raw.contains(&block),
            None => return Err(ReservationError::Unknown(id).into()),
        };
        if !fills {
            return Err(EngineError::InvalidRequest(format!(
                "block {block} is not a block reservation {id} fills"
            )));
        }
        self.backend.write_block(layer, block, k, v)
    }

    /// Turns a filled reservation into a running sequence: its blocks (the cached prefix it
    /// pinned, then the raw ones the transfer filled) hold the K/V of `prompt`, and
    /// `first_token` is the token the prefill worker sampled after it. The sampler, stop checker and
    /// detokenizer continue as if this engine had produced `first_token` itself (the sampler skips
    /// the draw that token cost), so the output equals an in-process run with the same seed. If the
    /// first token already ends the sequence (EOS, stop token, `max_tokens` 1, context full), the
    /// next step emits [`SeqEvent::Finished`] without computing anything.
    ///
    /// The reservation must be Filled (a transfer completed into it). Errors leave the reservation
    /// in place: an unknown or unfilled reservation ([`EngineError::Reservation`]), a block count
    /// that does not match `prompt.len()`, or an invalid request.
    pub fn add_prefilled(
        &mut self,
        id: ReservationId,
        prompt: Vec<u32>,
        first_token: u32,
        params: SamplingParams,
    ) -> Result<SeqId> {
        self.add_prefilled_for(id, "", prompt, first_token, params)
    }

    /// [`Self::add_prefilled`] for request `request_id`: a reservation made for another request
    /// is refused (empty: no check).
    pub fn add_prefilled_for(
        &mut self,
        id: ReservationId,
        request_id: &str,
        prompt: Vec<u32>,
        first_token: u32,
        params: SamplingParams,
    ) -> Result<SeqId> {
        let req = self.request(prompt, params)?;
        self.adopt(id, request_id, req, first_token)
    }

    /// [`Self::add_prefilled_for`] of a validated request.
    pub fn adopt(
        &mut self,
        id: ReservationId,
        request_id: &str,
        req: Request,
        first_token: u32,
    ) -> Result<SeqId> {
        self.check_fits(&req)?;
        let mut grammar = self.compile_constraint(&req)?;
        let (prompt, params) = req.into_parts();
        let vocab = self.backend.config().vocab_size;
        if first_token as usize >= vocab {
            return Err(EngineError::InvalidRequest(format!(
                "first token id {first_token} is outside the vocabulary ({vocab})"
            )));
        }
        if let Some(g) = &mut grammar {
            // Continue from the state the prefill worker's first token left the constraint in.
            if !g.state.allows_next(first_token).map_err(EngineError::Internal)? {
                return Err(EngineError::InvalidRequest(format!(
                    "first token id {first_token} is not allowed by the request's constraint"
                )));
            }
            g.state.advance(first_token).map_err(EngineError::Internal)?;
        }
        let shared = self.reservations.clone();
        let mut table = shared.lock();
        let r = table.filled(id, request_id)?.clone();
        let expected = self.alloc.kept_pages(prompt.len(), 0);
        let pinned_blocks = self.alloc.pinned_token_blocks(r.pinned.len(), prompt.len());
        if r.pinned.len() + r.raw.len() != expected || pinned_blocks.is_none() {
            return Err(EngineError::InvalidRequest(format!(
                "reservation {id} holds {} blocks but a prompt of {} tokens needs {expected}",
                r.pinned.len() + r.raw.len(),
                prompt.len()
            )));
        }
        let adapter = self.resolve_adapter(&params)?;
        let mut prefix = self
            .prefix_root(&crate::lora::salted(&params.cache_salt, adapter.as_deref()))
            .map(SeqPrefix::new);
        if let Some(p) = &mut prefix {
            // The pinned blocks were found under this prompt's hashes with this salt; a prompt or
            // salt that differs from the reservation's would adopt K/V of other tokens.
            let (bs, h) = (self.alloc.block_size(), pinned_blocks.unwrap_or(0));
            let names = self.alloc.kept_hashes(p.hashes_for(&prompt[..h * bs], bs), prompt.len());
            if names.len() != r.pinned.len()
                || r.pinned.iter().zip(names).any(|(&b, h)| self.alloc.block_hash(b) != Some(h))
            {
                return Err(EngineError::InvalidRequest(format!(
                    "reservation {id} was made for another prompt or cache salt"
                )));
            }
            p.registered = h;
            p.cached_tokens = h * bs;
            p.looked_up = true;
        } else if !r.pinned.is_empty() {
            return Err(EngineError::Internal(format!(
                "reservation {id} pinned cached blocks without a prefix cache"
            )));
        }
        let seq_id = self.next_id;
        table.adopt(&mut self.alloc, id, request_id, seq_id, prompt.len())?;
        drop(table);
        self.next_id += 1;

        let mut sampler = Sampler::new(&params, seq_id);
        sampler.skip_draw();
        let mut stop = TokenStop::new(&params, self.tokenizer.eos_token_ids());
        let prompt_len = prompt.len();
        let mut tokens = prompt;
        tokens.push(first_token);
        let finish = sequence::ends_with(&mut stop, first_token, tokens.len(), self.max_sequence_len());
        self.seqs.insert(
            seq_id,
            Sequence {
                adapter,
                prompt_len,
                tokens,
                computed: prompt_len,
                sampler,
                stop,
                has_blocks: true,
                admitted: true,
                phase: Phase::Generate,
                finish_pending: finish,
                started: Some(Instant::now()),
                depth: SeqDepth::default(),
                spec: SpecCounts::default(),
                drafts: Vec::new(),
                draft_dists: Vec::new(),
                prefix,
                grammar,
                prompt_scores: None,
            },
        );
        self.register_blocks(seq_id)?;
        self.stalled = false;
        Ok(seq_id)
    }

    /// A new sequence that completes `parent`'s prompt on its own, with `params` (another seed):
    /// one more choice of the same request (`n` > 1). It shares the parent's prompt blocks (a
    /// block either writes into is copied first), recomputes the last prompt token and draws its
    /// own first token from it, so it costs one token of compute, not a prompt. With a seed, its
    /// tokens are those a request of its own with that seed gets.
    ///
    /// The parent must be a running sequence whose prompt is computed (an adopted one, or one
    /// past its first token); it may have generated tokens since. Errors change nothing: an
    /// unknown parent or one still computing its prompt ([`EngineError::InvalidRequest`]), or
    /// parameters the request checks refuse.
    pub fn fork_prompt(&mut self, parent: SeqId, params: SamplingParams) -> Result<SeqId> {
        let (prompt, root, adapter) = match self.seqs.get(&parent) {
            Some(p) if p.phase == Phase::Generate && p.has_blocks && p.computed >= p.prompt_len => {
                (p.tokens[..p.prompt_len].to_vec(), p.prefix.as_ref().map(|x| x.root), p.adapter.clone())
            }
            _ => {
                return Err(EngineError::InvalidRequest(format!(
                    "sequence {parent} cannot be forked: it is not running with its prompt computed"
                )))
            }
        };
        // A choice runs its parent's adapter, whatever `params` say.
        let mut params = params;
        params.adapter = adapter.as_ref().map(|a| a.name.clone()).unwrap_or_default();
        params.adapter_id = adapter.as_ref().map(|a| a.id.clone()).unwrap_or_default();
        let req = self.request(prompt, params)?;
        self.check_fits(&req)?;
        let grammar = self.compile_constraint(&req)?;
        if req.prompt().len() == 1 || !self.alloc.holds_from(parent, req.prompt().len() - 1) {
            // Nothing to share: the one prompt token is all there is to compute. Or the parent's
            // window layers have given back KV its last prompt token reads (it has decoded past
            // their window): the choice computes its prompt itself.
            return Ok(self.insert_queued(req, Phase::Generate, grammar));
        }
        let (prompt, params) = req.into_parts();
        let prompt_len = prompt.len();
        let seq_id = self.next_id;
        self.alloc.fork(parent, seq_id)?;
        // Everything but the last prompt token is shared. The block that token goes in is made
        // the fork's own now (a copy when it is shared and holds earlier tokens), so that no later
        // write, the fork's or the parent's, lands in a shared block the step did not plan for.
        let cow = self.alloc.truncate(seq_id, prompt_len - 1).and_then(|()| self.alloc.append(seq_id, 1));
        let copied = match cow {
            Ok(cows) => self
                .spill_evicted()
                .and_then(|()| cows.iter().try_for_each(|c| self.backend.copy_block(c.src, c.dst))),
            Err(e) => Err(e.into()),
        };
        if let Err(e) = copied {
            let _ = self.alloc.free_sequence(seq_id);
            return Err(e);
        }
        self.next_id += 1;
        // The prompt's blocks are the parent's: registered under the same names, so the cache
        // counts none of them as this sequence's lookup.
        let prefix = root.map(|root| {
            let mut p = SeqPrefix::new(root);
            p.looked_up = true;
            p
        });
        self.seqs.insert(
            seq_id,
            Sequence {
                adapter,
                prompt_len,
                sampler: Sampler::new(&params, seq_id),
                stop: TokenStop::new(&params, self.tokenizer.eos_token_ids()),
                tokens: prompt,
                computed: prompt_len - 1,
                has_blocks: true,
                admitted: true,
                phase: Phase::Generate,
                finish_pending: None,
                started: Some(Instant::now()),
                depth: SeqDepth::default(),
                spec: SpecCounts::default(),
                drafts: Vec::new(),
                draft_dists: Vec::new(),
                prefix,
                grammar,
                prompt_scores: None,
            },
        );
        self.stalled = false;
        Ok(seq_id)
    }

    /// Checks what depends on this engine, not on the request: that the request was checked
    /// against this model's vocabulary, and that its prompt leaves room for a generated token
    /// (context length and KV pool).
    fn check_fits(&self, req: &Request) -> Result<()> {
        self.resolve_adapter(req.params())?;
        let vocab = self.backend.config().vocab_size;
        if req.vocab_size() != vocab {
            return Err(EngineError::InvalidRequest(format!(
                "the request was checked against a vocabulary of {} tokens; this model has {vocab}",
                req.vocab_size()
            )));
        }
        let prompt = req.prompt();
        let max_len = self.max_sequence_len();
        if prompt.len() >= max_len {
            return Err(EngineError::InvalidRequest(format!(
                "prompt has {} tokens; the limit is {} (context length and KV pool), leaving room for at least one generated token",
                prompt.len(),
                max_len.saturating_sub(1)
            )));
        }
        Ok(())
    }

    fn insert_queued(&mut self, req: Request, phase: Phase, grammar: Option<SeqGrammar>) -> SeqId {
        let id = self.next_id;
        self.next_id += 1;
        let (prompt, params) = req.into_parts();
        let params = &params;
        // Scoring the prompt needs every position computed: no prefix-cache hit (and no entry).
        // Resolved by `check_fits` before the request got here.
        let adapter = self.resolve_adapter(params).ok().flatten();
        let salt = crate::lora::salted(&params.cache_salt, adapter.as_deref());
        let prefix = match params.prompt_logprobs {
            Some(_) => None,
            None => self.prefix_root(&salt).map(SeqPrefix::new),
        };
        let prompt_scores = params.prompt_logprobs.map(PromptScores::new);
        let seq = Sequence {
            adapter,
            prompt_len: prompt.len(),
            sampler: Sampler::new(params, id),
            stop: TokenStop::new(params, self.tokenizer.eos_token_ids()),
            tokens: prompt,
            computed: 0,
            has_blocks: false,
            admitted: false,
            phase,
            finish_pending: None,
            started: None,
            depth: SeqDepth::default(),
            spec: SpecCounts::default(),
            drafts: Vec::new(),
            draft_dists: Vec::new(),
            prefix,
            grammar,
            prompt_scores,
        };
        self.seqs.insert(id, seq);
        self.queue.push_back(id);
        self.stalled = false;
        id
    }

    /// Cancels a sequence and frees its blocks. Unknown ids are ignored (already finished).
    pub fn cancel(&mut self, seq: SeqId) -> Result<()> {
        self.remove(seq)
    }

    fn remove(&mut self, seq: SeqId) -> Result<()> {
        self.queue.retain(|&s| s != seq);
        self.forget_loading(seq);
        if let Some(spec) = &mut self.spec {
            spec.drafter.forget(seq);
        }
        if let Some(s) = self.seqs.remove(&seq) {
            if let Some(p) = &s.prefix {
                if self.left_cached.len() >= 4096 {
                    // Cancellations while idle (no step clears it): keep it bounded.
                    self.left_cached.clear();
                }
                self.left_cached.insert(seq, p.cached_tokens);
            }
            if s.has_blocks {
                self.alloc.free_sequence(seq)?;
                self.stalled = false;
            }
        }
        Ok(())
    }

    /// Runs one scheduling step and forward pass. Returns what happened to each sequence.
    /// Whenever the engine becomes idle the allocator's invariants are checked and every block
    /// must be free; a violation is returned as an internal error rather than left to grow.
    pub fn step(&mut self) -> Result<Vec<SeqEvent>> {
        self.left_cached.clear();
        self.reclaim_reservations()?;
        let events = self.schedule_and_run();
        if self.backend.staged_pending() {
            // Unreachable by construction (every path commits or discards); never let staged data
            // leak into the next step if it happens.
            self.backend.discard_staged();
            return Err(EngineError::Internal("a staged pass outlived its step; it was discarded".into()));
        }
        let events = events?;
        if self.seqs.is_empty() {
            self.check_kv()?;
        }
        Ok(events)
    }

    /// Tokens of a live sequence whose K/V are in the cache (0 while it waits for blocks).
    pub fn computed_len(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(&seq).map(|s| s.computed)
    }

    /// Number of generated tokens of a live sequence.
    pub fn generated_len(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(&seq).map(|s| s.tokens.len() - s.prompt_len)
    }
}

pub use generate::Generation;
