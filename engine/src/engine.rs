//! The in-process generation loop: a scheduler over one backend and one block allocator.
//!
//! Every [`Engine::step`] runs one forward pass over a batch that mixes decode steps (one token
//! for every running sequence) and prefill chunks (waiting prompts, chunked under the token
//! budget). Block bookkeeping is the engine's: it allocates before a pass, hands the tables to the
//! backend, and frees a sequence's blocks the moment it finishes, fails or is cancelled. When the
//! pool runs out during decode the newest sequence is preempted (its blocks freed, its tokens
//! recomputed later), so older sequences always make progress.

use std::collections::{BTreeMap, VecDeque};

use crate::backend::{Backend, LogitsRequest, SeqChunk};
use crate::error::{EngineError, Result};
use crate::kv::{BlockAllocator, KvError, KvStats, SeqId, WriteMode};
use crate::sampler::{FinishReason, Sampler, SamplingParams, StopChecker};
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
    /// The sequence ended normally; `text` is any text released at the end.
    Finished { seq: SeqId, reason: FinishReason, text: String },
    /// The sequence was aborted by an error; its blocks are already freed.
    Failed { seq: SeqId, error: String },
}

struct Sequence {
    prompt_len: usize,
    /// Prompt followed by generated tokens.
    tokens: Vec<u32>,
    /// Tokens whose K/V are in the cache.
    computed: usize,
    sampler: Sampler,
    stop: StopChecker,
    decoder: IncrementalDecoder,
    /// The sequence holds blocks in the allocator.
    has_blocks: bool,
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
        }
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
        if self.seqs.is_empty() && s.free != s.total {
            return Err(EngineError::Internal(format!(
                "no sequences but {} of {} blocks in use",
                s.total - s.free,
                s.total
            )));
        }
        Ok(())
    }

    /// Sequences not yet finished.
    pub fn num_active(&self) -> usize {
        self.seqs.len()
    }

    /// Longest sequence (prompt + output) the engine can hold.
    pub fn max_sequence_len(&self) -> usize {
        let cfg = self.backend.config();
        let layout = self.backend.kv_layout();
        cfg.max_position_embeddings.min(layout.num_blocks * layout.block_size)
    }

    /// Queues a request. Refuses it at once if it can never run.
    pub fn add_request(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<SeqId> {
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
                max_len - 1
            )));
        }
        let id = self.next_id;
        self.next_id += 1;
        let seq = Sequence {
            prompt_len: prompt.len(),
            sampler: Sampler::new(&params, id),
            stop: StopChecker::new(&params, self.tokenizer.eos_token_ids()),
            decoder: IncrementalDecoder::new(&self.tokenizer, &prompt, true),
            tokens: prompt,
            computed: 0,
            has_blocks: false,
        };
        self.seqs.insert(id, seq);
        self.queue.push_back(id);
        Ok(id)
    }

    /// Cancels a sequence and frees its blocks. Unknown ids are ignored (already finished).
    pub fn cancel(&mut self, seq: SeqId) -> Result<()> {
        self.remove(seq)
    }

    fn remove(&mut self, seq: SeqId) -> Result<()> {
        self.queue.retain(|&s| s != seq);
        if let Some(s) = self.seqs.remove(&seq) {
            if s.has_blocks {
                self.alloc.free_sequence(seq)?;
            }
        }
        Ok(())
    }

    /// Frees a sequence's blocks so it is recomputed from scratch later.
    fn preempt(&mut self, seq: SeqId) -> Result<()> {
        let s = self.seqs.get_mut(&seq).expect("preempting a live sequence");
        if s.has_blocks {
            self.alloc.free_sequence(seq)?;
            s.has_blocks = false;
        }
        s.computed = 0;
        if !self.queue.contains(&seq) {
            self.queue.push_front(seq);
        }
        tracing::debug!(seq, "preempted: KV blocks exhausted");
        Ok(())
    }

    /// Makes room for `seq` to hold `len` tokens; returns false if the pool is full.
    fn reserve(&mut self, seq: SeqId, len: usize) -> Result<bool> {
        let s = self.seqs.get_mut(&seq).expect("reserving for a live sequence");
        let res = if s.has_blocks {
            let have = self.alloc.seq_len(seq).unwrap_or(0);
            if len <= have {
                return Ok(true);
            }
            self.alloc.append(seq, len - have).map(|cow| cow.map(|c| (c.src, c.dst)))
        } else {
            self.alloc.add_sequence(seq, len).map(|_| None)
        };
        match res {
            Ok(cow) => {
                s.has_blocks = true;
                if let Some((src, dst)) = cow {
                    self.backend.copy_block(src, dst)?;
                }
                Ok(true)
            }
            Err(KvError::OutOfBlocks { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Runs one scheduling step and forward pass. Returns what happened to each sequence.
    /// Whenever the engine becomes idle the allocator's invariants are checked and every block
    /// must be free; a violation is returned as an internal error rather than left to grow.
    pub fn step(&mut self) -> Result<Vec<SeqEvent>> {
        let events = self.schedule_and_run()?;
        if self.seqs.is_empty() {
            self.check_kv()?;
        }
        Ok(events)
    }

    fn schedule_and_run(&mut self) -> Result<Vec<SeqEvent>> {
        let mut events = Vec::new();
        let budget = self.opts.max_batch_tokens;
        let mut plan: Vec<(SeqId, usize, usize)> = Vec::new(); // (seq, start, len)
        let mut used = 0usize;

        // 1. Decode: every running sequence (all but its newest token computed) gets one token.
        //    When the pool is full the newest sequence holding blocks is preempted, which may be
        //    the one asking: older sequences always make progress.
        let running: Vec<SeqId> = self
            .seqs
            .iter()
            .filter(|(id, s)| s.has_blocks && s.computed + 1 == s.tokens.len() && !self.queue.contains(id))
            .map(|(&id, _)| id)
            .collect();
        for id in running {
            if used >= budget {
                break;
            }
            if !self.seqs.get(&id).is_some_and(|s| s.has_blocks) {
                continue; // preempted earlier in this step
            }
            let len = self.seqs[&id].tokens.len();
            loop {
                if self.reserve(id, len)? {
                    plan.push((id, self.seqs[&id].computed, 1));
                    used += 1;
                    break;
                }
                let victim = self
                    .seqs
                    .iter()
                    .rev()
                    .find(|(v, s)| s.has_blocks && !plan.iter().any(|p| p.0 == **v))
                    .map(|(&v, _)| v)
                    .expect("the asking sequence holds blocks");
                self.preempt(victim)?;
                if victim == id {
                    break;
                }
            }
        }

        // 2. Prefill, in arrival order. A sequence is admitted with blocks for its whole prompt at
        //    once, so a half-prefilled sequence never waits for blocks held by another one;
        //    admission stops at the first that does not fit (no overtaking), while sequences
        //    already admitted keep being scheduled.
        let mut admission_open = true;
        let waiting: Vec<SeqId> = self.queue.iter().copied().collect();
        for id in waiting {
            if used >= budget {
                break;
            }
            let (start, total, holds) = {
                let s = &self.seqs[&id];
                (s.computed, s.tokens.len(), s.has_blocks)
            };
            if !holds {
                let active = self.seqs.values().filter(|s| s.has_blocks).count();
                if !admission_open || active >= self.opts.max_num_seqs || !self.reserve(id, total)? {
                    admission_open = false;
                    continue;
                }
            }
            let len = (total - start).min(budget - used);
            plan.push((id, start, len));
            used += len;
        }
        if plan.is_empty() {
            if self.seqs.is_empty() {
                return Ok(events);
            }
            // Cannot happen with a positive budget (see above); never spin silently if it does.
            return Err(EngineError::Internal(format!(
                "scheduler made no progress with {} active sequences and {} of {} blocks free",
                self.seqs.len(),
                self.alloc.free_blocks(),
                self.alloc.total_blocks()
            )));
        }

        let tables: Vec<Vec<u32>> =
            plan.iter().map(|&(id, _, _)| self.alloc.block_table(id).unwrap_or(&[]).to_vec()).collect();
        let chunks: Vec<SeqChunk<'_>> = plan
            .iter()
            .zip(&tables)
            .map(|(&(id, start, len), table)| {
                let s = &self.seqs[&id];
                SeqChunk {
                    tokens: &s.tokens[start..start + len],
                    start_pos: start,
                    block_table: table,
                    logits: if start + len == s.tokens.len() {
                        LogitsRequest::Last
                    } else {
                        LogitsRequest::None
                    },
                }
            })
            .collect();
        let result = self.backend.forward(&chunks, WriteMode::Direct);
        drop(chunks);
        let mut logits = match result {
            Ok(l) => l,
            Err(e) => {
                // The pass failed as a whole: fail every sequence in it, never leave blocks behind.
                for &(id, _, _) in &plan {
                    self.remove(id)?;
                    events.push(SeqEvent::Failed { seq: id, error: e.to_string() });
                }
                return Ok(events);
            }
        };

        for (i, &(id, start, len)) in plan.iter().enumerate() {
            let s = self.seqs.get_mut(&id).expect("planned sequence is live");
            s.computed = start + len;
            if s.computed < s.tokens.len() {
                continue; // more prompt to go
            }
            self.queue.retain(|&q| q != id);
            let sampled = s.sampler.sample(&mut logits[i], &s.tokens);
            s.tokens.push(sampled.token);
            let delta = match s.decoder.push(sampled.token) {
                Ok(d) => d,
                Err(e) => {
                    // A sampled id the tokenizer cannot decode (models whose embedding rows
                    // outnumber the vocabulary): end this sequence only.
                    self.remove(id)?;
                    events.push(SeqEvent::Failed { seq: id, error: e.to_string() });
                    continue;
                }
            };
            let (text, finish) = s.stop.push(sampled.token, &delta);
            let room_left = s.tokens.len() < self.max_sequence_len();
            events.push(SeqEvent::Token { seq: id, token: sampled.token, logprob: sampled.logprob, text });
            let finish = finish.or(if room_left { None } else { Some(FinishReason::Length) });
            if let Some(reason) = finish {
                let s = self.seqs.get_mut(&id).expect("live");
                let mut text = s.stop.flush();
                if !matches!(reason, FinishReason::StopString(_)) {
                    // Bytes of a character the stream ended inside; never cut text after a stop string.
                    text.push_str(&s.decoder.finish().unwrap_or_default());
                }
                events.push(SeqEvent::Finished { seq: id, reason, text });
                self.remove(id)?;
            }
        }
        Ok(events)
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
                    SeqEvent::Finished { seq, reason, text } if *seq == id => {
                        out.text.push_str(text);
                        out.finish_reason = Some(reason.clone());
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
}
