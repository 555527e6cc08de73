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
//! - *reservations* ([`Engine::reserve`]): raw blocks a decode worker sets aside for a transfer,
//!   granted by the rule of [`plan::check_reservation`]; [`Engine::add_prefilled`] turns one into
//!   a running sequence whose prompt is already cached and whose first token was sampled by the
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

mod execute;
pub mod plan;
mod sequence;

use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

use self::plan::{ReservationAsk, ReservationRefusal};
use self::sequence::{Phase, Sequence};
use crate::backend::Backend;
use crate::error::{EngineError, Result};
use crate::kv::{BlockAllocator, BlockId, KvStats, SeqId};
use crate::sampler::{FinishReason, Sampler, SamplingParams, StopChecker};
use crate::spec::depth::SeqDepth;
use crate::spec::{Drafter, SpecCounts, SpecMethod, SpecOptions, SpecStats};
use crate::tokenizer::{IncrementalDecoder, Tokenizer};

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
    /// A new token, with the text that is now safe to show (may be empty).
    Token { seq: SeqId, token: u32, logprob: f32, text: String },
    /// The sequence ended normally; `text` is any text released at the end. `speculation` counts
    /// its draft tokens proposed and accepted (zero without speculation).
    Finished { seq: SeqId, reason: FinishReason, text: String, speculation: SpecCounts },
    /// The sequence was aborted by an error; its blocks are already freed.
    Failed { seq: SeqId, error: String },
    /// A prefill-only request computed its prompt and sampled its first token. Its blocks stay
    /// allocated (see [`Engine::block_table`]) until [`Engine::release_prefilled`].
    Prefilled { seq: SeqId, token: u32, logprob: f32 },
}

/// Identifier of a raw KV reservation ([`Engine::reserve`]); never 0.
pub type ReservationId = u64;

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
    /// Raw reservations and their blocks (in table order).
    reservations: BTreeMap<ReservationId, Vec<BlockId>>,
    next_reservation: ReservationId,
    /// The last step planned nothing although sequences were waiting (blocks held elsewhere).
    stalled: bool,
    /// Speculative decoding, when on.
    spec: Option<Speculation>,
}

impl Engine {
    /// Wraps a backend; the allocator mirrors the backend's KV pool, and a step never holds
    /// more tokens than the backend accepts.
    pub fn new(backend: Box<dyn Backend>, tokenizer: Tokenizer, mut opts: SchedulerOptions) -> Engine {
        let layout = backend.kv_layout();
        opts.max_batch_tokens = opts.max_batch_tokens.min(backend.max_batch_tokens()).max(1);
        opts.max_num_seqs = opts.max_num_seqs.max(1);
        Engine {
            alloc: BlockAllocator::new(layout.num_blocks, layout.block_size),
            backend,
            tokenizer,
            opts,
            seqs: BTreeMap::new(),
            queue: VecDeque::new(),
            next_id: 1,
            reservations: BTreeMap::new(),
            next_reservation: 1,
            stalled: false,
            spec: None,
        }
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
        let reserved: usize = self.reservations.values().map(Vec::len).sum();
        if s.raw_reserved != reserved {
            return Err(EngineError::Internal(format!(
                "{} raw-reserved blocks in the allocator but {reserved} in {} reservations",
                s.raw_reserved,
                self.reservations.len()
            )));
        }
        if let Some(spec) = &self.spec {
            spec.drafter.check_kv(self.seqs.is_empty())?;
        }
        if self.seqs.is_empty() && s.free + reserved != s.total {
            return Err(EngineError::Internal(format!(
                "no sequences but {} of {} blocks in use ({reserved} reserved)",
                s.total - s.free,
                s.total
            )));
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
        let mut l = EngineLoad { reservations: self.reservations.len(), ..Default::default() };
        for s in self.seqs.values() {
            match s.phase {
                Phase::Held => l.held += 1,
                _ if s.has_blocks => l.running += 1,
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
        let layout = self.backend.kv_layout();
        cfg.max_position_embeddings.min(layout.num_blocks * layout.block_size)
    }

    /// Queues a request. Refuses it at once if it can never run.
    pub fn add_request(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<SeqId> {
        self.validate_request(&prompt, &params)?;
        Ok(self.insert_queued(prompt, &params, Phase::Generate))
    }

    /// Queues a prefill-only request: once its prompt is computed and its first token sampled,
    /// the engine emits [`SeqEvent::Prefilled`] and keeps the sequence's blocks (and the KV in
    /// them) until [`Self::release_prefilled`]. No stop condition applies to it. Refused at once if
    /// the prompt could never be continued here (same limits as [`Self::add_request`]).
    pub fn add_prefill_request(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<SeqId> {
        self.validate_request(&prompt, &params)?;
        Ok(self.insert_queued(prompt, &params, Phase::PrefillOnly))
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
    /// sequence waits to be scheduled (preempted, or a queued prompt), and it must leave one free
    /// block per running sequence and per outstanding reservation so that each can grow
    /// ([`plan::check_reservation`] says why). With nothing running or reserved, any prompt that
    /// fits the pool is taken, so a reservation is never refused forever.
    ///
    /// Errors: [`EngineError::InvalidRequest`] when such a prompt could never run here,
    /// [`KvError::OutOfBlocks`](crate::kv::KvError::OutOfBlocks) (as [`EngineError::Kv`]) when
    /// the blocks are not free now, and [`EngineError::Busy`] when they are but are owed to the
    /// sequences above.
    pub fn reserve(&mut self, n_tokens: usize) -> Result<(ReservationId, Vec<BlockId>)> {
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
        let needed = self.alloc.blocks_for(n_tokens);
        let free = self.alloc.free_blocks();
        // The same counts the worker reports, from which the router estimates room.
        let load = self.load();
        let ask = ReservationAsk {
            needed,
            free,
            waiting: load.waiting,
            running: load.running,
            reservations: load.reservations,
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
        let blocks = self.alloc.alloc_blocks(needed)?;
        let id = self.next_reservation;
        self.next_reservation += 1;
        self.reservations.insert(id, blocks.clone());
        self.stalled = false;
        Ok((id, blocks))
    }

    /// Frees a reservation's blocks (lease expired, transfer failed, request cancelled). Returns
    /// false for an unknown id (already released or adopted).
    pub fn release_reservation(&mut self, id: ReservationId) -> Result<bool> {
        let Some(blocks) = self.reservations.get(&id) else {
            return Ok(false);
        };
        self.alloc.release_blocks(blocks)?;
        self.reservations.remove(&id);
        self.stalled = false;
        Ok(true)
    }

    /// The blocks of an outstanding reservation.
    pub fn reservation_blocks(&self, id: ReservationId) -> Option<&[BlockId]> {
        self.reservations.get(&id).map(Vec::as_slice)
    }

    /// Overwrites one layer of one reserved block with K/V bytes read from a peer's pool (an
    /// in-process transfer; workers fill reservations through their transport instead). Only
    /// blocks of reservation `id` can be written this way.
    pub fn write_reserved_block(
        &mut self,
        id: ReservationId,
        layer: usize,
        block: BlockId,
        k: &[u8],
        v: &[u8],
    ) -> Result<()> {
        let blocks = self
            .reservations
            .get(&id)
            .ok_or_else(|| EngineError::InvalidRequest(format!("reservation {id} is unknown")))?;
        if !blocks.contains(&block) {
            return Err(EngineError::InvalidRequest(format!("block {block} is not in reservation {id}")));
        }
        self.backend.write_block(layer, block, k, v)
    }

    /// Turns a filled reservation into a running sequence: its blocks hold the K/V of `prompt`, and
    /// `first_token` is the token the prefill worker sampled after it. The sampler, stop checker and
    /// detokenizer continue as if this engine had produced `first_token` itself (the sampler skips
    /// the draw that token cost), so the output equals an in-process run with the same seed. If the
    /// first token already ends the sequence (EOS, stop token, `max_tokens` 1, context full), the
    /// next step emits [`SeqEvent::Finished`] without computing anything.
    ///
    /// Errors leave the reservation in place: unknown reservation, a block count that does not
    /// match `prompt.len()`, or an invalid request.
    pub fn add_prefilled(
        &mut self,
        id: ReservationId,
        prompt: Vec<u32>,
        first_token: u32,
        params: SamplingParams,
    ) -> Result<SeqId> {
        self.validate_request(&prompt, &params)?;
        let vocab = self.backend.config().vocab_size;
        if first_token as usize >= vocab {
            return Err(EngineError::InvalidRequest(format!(
                "first token id {first_token} is outside the vocabulary ({vocab})"
            )));
        }
        let blocks = self
            .reservations
            .get(&id)
            .ok_or_else(|| EngineError::InvalidRequest(format!("reservation {id} is unknown")))?;
        let expected = self.alloc.blocks_for(prompt.len());
        if blocks.len() != expected {
            return Err(EngineError::InvalidRequest(format!(
                "reservation {id} holds {} blocks but a prompt of {} tokens needs {expected}",
                blocks.len(),
                prompt.len()
            )));
        }
        let seq_id = self.next_id;
        self.alloc.adopt(seq_id, blocks, prompt.len())?;
        self.reservations.remove(&id);
        self.next_id += 1;

        let mut sampler = Sampler::new(&params, seq_id);
        sampler.skip_draw();
        let mut decoder = IncrementalDecoder::new(&self.tokenizer, &prompt, true);
        let mut stop = StopChecker::new(&params, self.tokenizer.eos_token_ids());
        // A token the tokenizer cannot decode still counts for the stop rules; its text is empty.
        let delta = decoder.push(first_token).unwrap_or_default();
        let (_, finish) = stop.push(first_token, &delta);
        let prompt_len = prompt.len();
        let mut tokens = prompt;
        tokens.push(first_token);
        let finish = finish.or((tokens.len() >= self.max_sequence_len()).then_some(FinishReason::Length));
        self.seqs.insert(
            seq_id,
            Sequence {
                prompt_len,
                tokens,
                computed: prompt_len,
                sampler,
                stop,
                decoder,
                has_blocks: true,
                phase: Phase::Generate,
                finish_pending: finish,
                started: Some(Instant::now()),
                depth: SeqDepth::default(),
                spec: SpecCounts::default(),
                drafts: Vec::new(),
            },
        );
        self.stalled = false;
        Ok(seq_id)
    }

    /// Checks a prompt and its parameters against the model and the pool.
    fn validate_request(&self, prompt: &[u32], params: &SamplingParams) -> Result<()> {
        let vocab = self.backend.config().vocab_size;
        params.validate(vocab)?;
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest("prompt is empty (no tokens)".into()));
        }
        if let Some(&t) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "prompt token id {t} is outside the vocabulary ({vocab})"
            )));
        }
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

    fn insert_queued(&mut self, prompt: Vec<u32>, params: &SamplingParams, phase: Phase) -> SeqId {
        let id = self.next_id;
        self.next_id += 1;
        let seq = Sequence {
            prompt_len: prompt.len(),
            sampler: Sampler::new(params, id),
            stop: StopChecker::new(params, self.tokenizer.eos_token_ids()),
            decoder: IncrementalDecoder::new(&self.tokenizer, &prompt, true),
            tokens: prompt,
            computed: 0,
            has_blocks: false,
            phase,
            finish_pending: None,
            started: None,
            depth: SeqDepth::default(),
            spec: SpecCounts::default(),
            drafts: Vec::new(),
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
        if let Some(spec) = &mut self.spec {
            spec.drafter.forget(seq);
        }
        if let Some(s) = self.seqs.remove(&seq) {
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

    /// Runs one request to completion, calling `on_event` for each of its events. On error the
    /// request is cancelled, so no blocks stay behind.
    pub fn generate(
        &mut self,
        prompt: Vec<u32>,
        params: SamplingParams,
        mut on_event: impl FnMut(&SeqEvent),
    ) -> Result<Generation> {
        let id = self.add_request(prompt.clone(), params)?;
        let mut out = Generation {
            prompt_token_ids: prompt,
            token_ids: Vec::new(),
            text: String::new(),
            finish_reason: None,
            speculation: None,
        };
        loop {
            let events = match self.step() {
                Ok(ev) => ev,
                Err(e) => {
                    self.cancel(id)?;
                    return Err(e);
                }
            };
            if events.is_empty() && !self.seqs.contains_key(&id) {
                return Err(EngineError::Internal("sequence vanished without an event".into()));
            }
            for ev in events {
                match &ev {
                    SeqEvent::Token { seq, token, text, .. } if *seq == id => {
                        out.token_ids.push(*token);
                        out.text.push_str(text);
                    }
                    SeqEvent::Finished { seq, reason, text, speculation } if *seq == id => {
                        out.text.push_str(text);
                        out.finish_reason = Some(reason.clone());
                        out.speculation = self.spec.is_some().then_some(*speculation);
                    }
                    SeqEvent::Failed { seq, error } if *seq == id => {
                        on_event(&ev);
                        return Err(EngineError::Internal(error.clone()));
                    }
                    _ => {}
                }
                on_event(&ev);
            }
            if out.finish_reason.is_some() {
                return Ok(out);
            }
        }
    }
}

/// A finished single-request generation.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Generation {
    pub prompt_token_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub text: String,
    #[serde(skip)]
    pub finish_reason: Option<FinishReason>,
    /// Draft tokens proposed and accepted, when the engine speculates.
    #[serde(skip)]
    pub speculation: Option<SpecCounts>,
}
