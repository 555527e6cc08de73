//! Running one step: describe the engine to the planner, apply its [`Plan`] to the block
//! allocator (preemptions and allocations, in plan order), run the forward pass, and turn what it
//! gives into tokens and [`SeqEvent`]s.
//!
//! The plan has already counted every block it allocates against the free ones, so an allocation
//! that fails here is an internal error, not a reason to replan. Whatever goes wrong after the
//! allocations, no sequence that leaves the engine keeps a block.
//!
//! With speculation, a step also asks the drafter for tokens before planning, and a pass with
//! verification entries ends, on every path, in exactly one of: `commit_staged` with the accepted
//! prefix of each verification chunk (nothing for a sequence that finished or failed), or
//! `discard_staged`. Then each surviving sequence's blocks are truncated to the tokens it kept.

use std::collections::BTreeSet;
use std::sync::PoisonError;
use std::time::Instant;

use super::plan::{self, Entry, EntryKind, Idle, Plan, SeqView, StepState};
use super::sequence::{Phase, Picked, SeqGrammar};
use super::{Engine, SeqEvent};
use crate::backend::{LogitsRequest, SeqChunk};
use crate::error::{EngineError, Result};
use crate::kv::{KvError, SeqId, WriteMode};
use crate::sampler::FinishReason;
use crate::spec::verify::{verify, Drawn};
use crate::spec::DraftAsk;

impl Engine {
    pub(super) fn schedule_and_run(&mut self) -> Result<Vec<SeqEvent>> {
        // A step is an inter-token gap from here: drafting counts.
        let started = Instant::now();
        let mut events = Vec::new();
        self.stalled = false;
        self.finish_pending(&mut events)?;
        self.propose_drafts();
        self.poll_loading();
        self.attach_cached_prefixes()?;
        self.slide_windows()?;
        for (seq, error) in self.place_adapters()? {
            self.remove(seq)?;
            events.push(SeqEvent::Failed { seq, error });
        }
        let mut plan = plan::plan(&self.step_state());
        if matches!(plan.idle, Some(Idle::Stalled | Idle::NoProgress)) && self.detach_unadmitted()? {
            // The cached prefixes held for waiting sequences may be what blocks them.
            plan = plan::plan(&self.step_state());
        }
        let result = self.run_plan(&plan, &mut events);
        if plan.idle.is_none() {
            self.step_started(started);
            self.step_took(&plan, started.elapsed());
        }
        // Drafts live for one step.
        for s in self.seqs.values_mut() {
            s.drafts.clear();
            s.draft_dists.clear();
        }
        result?;
        self.register_all()?;
        // What the step's queries left behind goes back now, not at the next step.
        self.slide_windows()?;
        Ok(events)
    }

    /// Gives back the pages of window layer groups that no later query of a sequence reaches:
    /// every sequence's next pass starts at its computed length (a verification too, at its
    /// newest token), so nothing before `computed + 1 - window` is read again. A prefilled
    /// sequence held for its transfer keeps what its last prompt token reads: the pages a
    /// transfer moves ([`crate::kv::groups::transfer_from`]). Without window groups it changes
    /// nothing.
    fn slide_windows(&mut self) -> Result<()> {
        if self.alloc.windows().iter().all(Option::is_none) {
            return Ok(());
        }
        for (&id, s) in &self.seqs {
            if s.has_blocks {
                let from = match s.phase {
                    Phase::Held => crate::kv::groups::transfer_from(s.computed),
                    _ => s.computed,
                };
                self.alloc.slide(id, from)?;
            }
        }
        Ok(())
    }

    fn run_plan(&mut self, plan: &Plan, events: &mut Vec<SeqEvent>) -> Result<()> {
        self.apply(plan)?;
        match plan.idle {
            None => {}
            Some(Idle::NoWork) => return Ok(()),
            Some(Idle::Stalled) => {
                // Reservations or held sequences own the blocks the waiting ones need: wait for a
                // release (the caller sees `stalled()`).
                self.stalled = true;
                return Ok(());
            }
            Some(Idle::NoProgress) => {
                return Err(EngineError::Internal(format!(
                    "scheduler made no progress with {} active sequences and {} of {} blocks free",
                    self.seqs.len(),
                    self.alloc.available_blocks(),
                    self.alloc.total_blocks()
                )));
            }
        }
        let staged = plan.batch.iter().any(|e| e.kind == EntryKind::Verify);
        let mut picked = match self.forward(&plan.batch) {
            Ok(p) => p,
            Err(e) => {
                // The pass failed as a whole: drop anything it staged, fail every sequence in it,
                // never leave blocks behind.
                self.backend.discard_staged();
                for entry in &plan.batch {
                    self.remove(entry.seq)?;
                    events.push(SeqEvent::Failed { seq: entry.seq, error: e.to_string() });
                }
                return Ok(());
            }
        };
        // Per chunk, the tokens to commit: direct chunks are in the pool already (whole), a
        // verification chunk keeps what was accepted.
        let mut keep = Vec::with_capacity(plan.batch.len());
        let mut outcome = Ok(());
        for (entry, picked) in plan.batch.iter().zip(&mut picked) {
            let kept = if outcome.is_err() {
                0
            } else if entry.kind == EntryKind::Verify {
                match self.complete_verify(entry, picked, events) {
                    Ok(k) => k,
                    Err(e) => {
                        outcome = Err(e);
                        0
                    }
                }
            } else {
                match self.complete(entry, picked, events) {
                    Ok(()) => entry.tokens,
                    Err(e) => {
                        outcome = Err(e);
                        entry.tokens
                    }
                }
            };
            keep.push(if entry.kind == EntryKind::Verify { kept } else { entry.tokens });
        }
        if staged {
            self.settle_staged(&plan.batch, &keep, events, outcome.is_ok())?;
        }
        outcome
    }

    /// Ends a staged pass: commits what each verification chunk kept and truncates its sequence's
    /// blocks to its tokens, or (when the step already failed, or the commit does) discards the
    /// pass and fails the sequences that were verifying.
    fn settle_staged(
        &mut self,
        batch: &[Entry],
        keep: &[usize],
        events: &mut Vec<SeqEvent>,
        ok: bool,
    ) -> Result<()> {
        let committed = if ok { self.backend.commit_staged(keep) } else { Ok(()) };
        if !ok || committed.is_err() {
            self.backend.discard_staged();
            let error = match committed {
                Err(e) => format!("internal error: committing verified KV failed: {e}"),
                Ok(()) => "internal error: the step failed during verification".to_string(),
            };
            // Every verifying sequence leaves, even if removing one fails; the first error wins.
            let mut first_err = Ok(());
            for e in batch.iter().filter(|e| e.kind == EntryKind::Verify) {
                if self.seqs.contains_key(&e.seq) {
                    let removed = self.remove(e.seq);
                    events.push(SeqEvent::Failed { seq: e.seq, error: error.clone() });
                    first_err = first_err.and(removed);
                }
            }
            return first_err;
        }
        let mut first_err = Ok(());
        for e in batch.iter().filter(|e| e.kind == EntryKind::Verify) {
            // Blocks for the computed tokens, as after a decode step; rejected positions go back.
            let Some(s) = self.seqs.get(&e.seq) else { continue };
            if self.alloc.seq_len(e.seq).is_some_and(|held| held > s.computed) {
                first_err = first_err.and(self.alloc.truncate(e.seq, s.computed).map_err(Into::into));
            }
        }
        first_err
    }

    /// Asks the drafter for this step's draft tokens: for every sequence ready to decode, as many
    /// as its depth wants, never more than `max_tokens` or the context leave room for. A drafter
    /// error means no drafts this step, never a failed request.
    fn propose_drafts(&mut self) {
        let max_len = self.max_sequence_len();
        let Some(spec) = &mut self.spec else { return };
        let vocab = self.backend.config().vocab_size;
        let queued: BTreeSet<SeqId> = self.queue.iter().copied().collect();
        let ready: Vec<SeqId> = self
            .seqs
            .iter()
            .filter(|(id, s)| s.decodes_next() && s.finish_pending.is_none() && !queued.contains(id))
            .map(|(&id, _)| id)
            .collect();
        let running = ready.len();
        let mut wants = Vec::with_capacity(running);
        for id in ready {
            let s = self.seqs.get_mut(&id).expect("ready sequence is live");
            let want = s
                .depth
                .want(&spec.opts, running)
                .min(s.stop.tokens_left().saturating_sub(1))
                .min(max_len.saturating_sub(s.tokens.len() + 1));
            if want > 0 {
                wants.push((id, want));
            }
        }
        if wants.is_empty() {
            return;
        }
        let sampled = spec.opts.sampled_drafts;
        let asks: Vec<DraftAsk<'_>> = wants
            .iter()
            .map(|&(seq, max)| {
                let s = &self.seqs[&seq];
                // Under a constraint drafts stay greedy: a sampled draft the grammar forbids would
                // be cut from the draft by its value, which biases rejection sampling.
                let sampling = if sampled && s.grammar.is_none() { s.sampler.draft_sampling() } else { None };
                DraftAsk { seq, tokens: &s.tokens, max, sampling }
            })
            .collect();
        let proposals = match spec.drafter.propose(&asks) {
            Ok(p) if p.len() == asks.len() => p,
            Ok(p) => {
                tracing::warn!(
                    asks = asks.len(),
                    answers = p.len(),
                    "drafter answered the wrong number of asks; no drafts this step"
                );
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "drafter failed; no drafts this step");
                return;
            }
        };
        drop(asks);
        for ((id, want), mut d) in wants.into_iter().zip(proposals) {
            let s = self.seqs.get_mut(&id).expect("live");
            // Never more than asked, never a token the model cannot take, and nothing past a
            // token that would end the sequence (verifying it could never be used).
            let mut valid = d.iter().take(want).take_while(|&&t| (t as usize) < vocab).count();
            if let Some(stop) = d[..valid].iter().position(|&t| s.stop.is_stop_token(t)) {
                valid = stop + 1;
            }
            // Under a constraint, a draft token the grammar forbids ends the draft: it could never
            // be accepted, and the masks are computed along the draft.
            if let Some(g) = &mut s.grammar {
                valid = match g.state.accepted_prefix(&d[..valid]) {
                    Ok(n) => n,
                    Err(e) => {
                        tracing::warn!(seq = id, error = %e, "constraint engine refused a draft; no drafts");
                        0
                    }
                };
            }
            d.truncate(valid);
            // Sampled drafts come with their distributions; without one per token, the drafts
            // cannot be verified by rejection sampling and are dropped.
            s.draft_dists = spec.drafter.take_dists(id).unwrap_or_default();
            if !s.draft_dists.is_empty() {
                if s.draft_dists.len() < valid {
                    tracing::warn!(seq = id, "drafter sampled drafts without their distributions; no drafts");
                    d.clear();
                    s.draft_dists.clear();
                }
                s.draft_dists.truncate(d.len());
            }
            s.drafts = d;
        }
    }

    /// Finishes adopted sequences that their first token already ended, before anything runs.
    fn finish_pending(&mut self, events: &mut Vec<SeqEvent>) -> Result<()> {
        let done: Vec<(SeqId, FinishReason)> =
            self.seqs.iter().filter_map(|(&id, s)| Some((id, s.finish_pending.clone()?))).collect();
        for (id, reason) in done {
            let s = &self.seqs[&id];
            events.push(SeqEvent::Finished { seq: id, reason, speculation: s.spec });
            self.remove(id)?;
        }
        Ok(())
    }

    /// The planner's view of the engine. Held sequences are left out: they never run, and their
    /// blocks are simply not free.
    fn step_state(&self) -> StepState {
        let view = |id: SeqId| {
            let s = &self.seqs[&id];
            SeqView {
                id,
                len: s.tokens.len(),
                computed: s.computed,
                blocks: self.alloc.held(id),
                shared: self.alloc.shared_blocks(id),
                draft: s.drafts.len(),
            }
        };
        let queued: BTreeSet<SeqId> = self.queue.iter().copied().collect();
        let running = self
            .seqs
            .iter()
            .filter(|(&id, s)| {
                s.phase != Phase::Held
                    && !queued.contains(&id)
                    && !self.is_loading(id)
                    // An adopted sequence whose adapter found no slot waits for one.
                    && !self.adapters.waiting.contains(&id)
            })
            .map(|(&id, s)| {
                debug_assert!(s.decodes_next(), "sequence {id} is neither queued nor ready to decode");
                view(id)
            })
            .collect::<Vec<_>>();
        StepState {
            max_batch_tokens: self.opts.max_batch_tokens,
            prefill_limit: self.prefill_limit(running.len()),
            max_num_seqs: self.opts.max_num_seqs,
            block_size: self.alloc.block_size(),
            windows: self.alloc.windows().to_vec(),
            free_blocks: self.alloc.available_blocks(),
            total_blocks: self.alloc.total_blocks(),
            running,
            // A queued sequence whose adapter found no slot waits, in its place.
            queued: self
                .queue
                .iter()
                .filter(|id| !self.adapters.waiting.contains(id))
                .map(|&id| view(id))
                .collect(),
        }
    }

    /// Applies a plan's preemptions and allocations to the allocator, in the plan's order (so
    /// blocks go where they went when planning and applying were one loop).
    fn apply(&mut self, plan: &Plan) -> Result<()> {
        let mut preemptions = plan.preempted.iter().peekable();
        for (i, entry) in plan.batch.iter().enumerate() {
            while let Some(p) = preemptions.next_if(|p| p.before <= i) {
                self.preempt(p.seq)?;
            }
            if !self.grow(entry.seq, entry.kv_len)? {
                return Err(EngineError::Internal(format!(
                    "the step's plan gives sequence {} more KV blocks than are free ({} free)",
                    entry.seq,
                    self.alloc.available_blocks()
                )));
            }
        }
        for p in preemptions {
            self.preempt(p.seq)?;
        }
        Ok(())
    }

    /// Frees a sequence's blocks so it is recomputed from scratch later.
    fn preempt(&mut self, seq: SeqId) -> Result<()> {
        let s = self.seqs.get_mut(&seq).expect("preempting a live sequence");
        debug_assert!(s.phase != Phase::Held, "held sequences are never preempted");
        if s.has_blocks {
            self.alloc.free_sequence(seq)?;
            s.has_blocks = false;
        }
        s.admitted = false;
        s.computed = 0;
        if let Some(p) = &mut s.prefix {
            // Its registered blocks stay cached; it looks them up again when it comes back.
            p.registered = 0;
            p.looked_up = false;
        }
        if !self.queue.contains(&seq) {
            self.queue.push_front(seq);
        }
        tracing::debug!(seq, "preempted: KV blocks exhausted");
        Ok(())
    }

    /// Makes room for `seq` to hold `len` tokens; returns false if the pool is full.
    fn grow(&mut self, seq: SeqId, len: usize) -> Result<bool> {
        let s = self.seqs.get_mut(&seq).expect("growing a live sequence");
        let res = if s.has_blocks {
            let have = self.alloc.seq_len(seq).unwrap_or(0);
            if len <= have {
                return Ok(true);
            }
            self.alloc.append(seq, len - have)
        } else {
            self.alloc.add_sequence(seq, len).map(|_| Vec::new())
        };
        match res {
            Ok(cow) => {
                s.has_blocks = true;
                if !s.admitted {
                    s.admitted = true;
                    if let (Some(p), Some(cache)) = (&mut s.prefix, &mut self.prefix) {
                        // Admitted without a lookup (none fitted before planning): a miss.
                        p.count_lookup(&mut cache.stats, s.tokens.len());
                    }
                }
                s.started.get_or_insert_with(Instant::now);
                // The pages this took from the cache leave before anything writes them.
                self.spill_evicted()?;
                for c in cow {
                    self.backend.copy_block(c.src, c.dst)?;
                }
                Ok(true)
            }
            Err(KvError::OutOfBlocks { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Runs the forward pass over the batch: one result per entry, in batch order. Verification
    /// entries run `[newest, drafts..]` staged, with logits at every position; every other chunk
    /// is written direct.
    fn forward(&mut self, batch: &[Entry]) -> Result<Vec<Picked>> {
        self.check_spilled()?;
        // When every sequence that samples this step picks greedily, the backend picks too (on a
        // GPU that saves copying a vocabulary of logits per sequence); verification needs every
        // position's row.
        // Scoring a prompt needs the row of every position of its chunks.
        let scores = |e: &Entry| e.kind == EntryKind::Prefill && self.seqs[&e.seq].scores_from(e.start);
        let greedy = batch.iter().all(|e| {
            e.kind != EntryKind::Verify && !scores(e) && (!e.samples || self.seqs[&e.seq].backend_may_pick())
        });
        // A backend that samples on its device draws every sampled row there (verification and
        // prompt scoring get their rows back): the rows' parameters, the samplers' next draws and
        // the constraints' masks, are built while the pass runs, once the masks are ready.
        let device = !greedy && self.backend.samples_on_device();
        let all_rows: Vec<bool> = batch.iter().map(scores).collect();
        // Structured output: each constrained sequence's masks for this step are computed on
        // another thread while the pass runs (the state they need is known before the pass).
        // Verification runs the sequence's adapter, as every other chunk of it does.
        let slots: Vec<Option<u16>> =
            batch.iter().map(|e| self.adapter_slot(e.seq)).collect::<Result<_>>()?;
        let mut grammars: Vec<(SeqId, SeqGrammar, Vec<u32>)> = Vec::new();
        for e in batch.iter().filter(|e| e.samples || e.kind == EntryKind::Verify) {
            if let Some(s) = self.seqs.get_mut(&e.seq) {
                if let Some(g) = s.grammar.take() {
                    let drafts = if e.kind == EntryKind::Verify {
                        s.drafts[..e.drafts()].to_vec()
                    } else {
                        Vec::new()
                    };
                    grammars.push((e.seq, g, drafts));
                }
            }
        }
        let tables: Vec<Vec<u32>> =
            batch.iter().map(|e| self.alloc.block_table(e.seq).unwrap_or(&[]).to_vec()).collect();
        let verify_tokens: Vec<Vec<u32>> = batch
            .iter()
            .map(|e| {
                if e.kind != EntryKind::Verify {
                    return Vec::new();
                }
                let s = &self.seqs[&e.seq];
                let mut t = Vec::with_capacity(e.tokens);
                t.push(s.tokens[e.start]);
                t.extend_from_slice(&s.drafts[..e.drafts()]);
                t
            })
            .collect();
        let chunks: Vec<SeqChunk<'_>> = batch
            .iter()
            .zip(&tables)
            .zip(&verify_tokens)
            .zip(all_rows.iter().zip(&slots))
            .map(|(((e, table), vt), (&all_rows, &adapter))| match e.kind {
                EntryKind::Verify => SeqChunk {
                    tokens: vt,
                    start_pos: e.start,
                    block_table: table,
                    logits: LogitsRequest::All,
                    write: WriteMode::Staged,
                    adapter,
                },
                EntryKind::Decode | EntryKind::Prefill => SeqChunk {
                    tokens: &self.seqs[&e.seq].tokens[e.start..e.start + e.tokens],
                    start_pos: e.start,
                    block_table: table,
                    logits: if all_rows {
                        LogitsRequest::All
                    } else if e.samples {
                        LogitsRequest::Last
                    } else {
                        LogitsRequest::None
                    },
                    write: WriteMode::Direct,
                    adapter,
                },
            })
            .collect();
        let vocab = self.backend.config().vocab_size;
        let any_jobs = !grammars.is_empty();
        let jobs = std::sync::Mutex::new(grammars);
        let (out, joined, exposed) = std::thread::scope(|scope| {
            // The constraint engine prepares each constrained sequence's masks beside the pass.
            let mut masks = any_jobs.then(|| {
                scope.spawn(|| {
                    let t0 = Instant::now();
                    let mut jobs = jobs.lock().unwrap_or_else(PoisonError::into_inner);
                    let mut n = 0;
                    for (_, g, drafts) in jobs.iter_mut() {
                        g.prepare(drafts);
                        n += drafts.len() as u64 + 1;
                    }
                    (n, t0.elapsed())
                })
            });
            let mut joined = None;
            let mut exposed = std::time::Duration::ZERO;
            let out = if device {
                let (seqs, jobs, masks, joined, exposed) =
                    (&self.seqs, &jobs, &mut masks, &mut joined, &mut exposed);
                self.backend
                    .forward_sampled(&chunks, &mut || {
                        join_masks(masks, joined, exposed);
                        let masks_ok = !matches!(joined, Some(Err(_)));
                        let jobs = jobs.lock().unwrap_or_else(PoisonError::into_inner);
                        batch
                            .iter()
                            .zip(all_rows.iter())
                            .map(|(e, &all)| {
                                // A verification or a prompt being scored gets its rows back.
                                let back = all || e.kind == EntryKind::Verify;
                                if back {
                                    None
                                } else {
                                    device_row(e, seqs, &jobs, masks_ok, vocab)
                                }
                            })
                            .collect()
                    })
                    .map(|v| v.into_iter().map(Picked::from).collect())
            } else if greedy {
                self.backend.forward_greedy(&chunks).map(|v| v.into_iter().map(Picked::Greedy).collect())
            } else {
                self.backend.forward(&chunks).map(|v| v.into_iter().map(Picked::Logits).collect())
            };
            join_masks(&mut masks, &mut joined, &mut exposed);
            (out, joined, exposed)
        });
        let mut grammars = jobs.into_inner().unwrap_or_else(PoisonError::into_inner);
        match joined {
            Some(Ok((n, took))) => {
                self.structured.masks += n;
                self.structured.mask_seconds += took.as_secs_f64();
                self.structured.exposed_seconds += exposed.as_secs_f64();
            }
            Some(Err(_)) => {
                for (_, g, _) in &mut grammars {
                    g.masks = Err("structured output: the constraint engine panicked".into());
                }
            }
            None => {}
        }
        for (id, g, _) in grammars {
            if let Some(s) = self.seqs.get_mut(&id) {
                s.grammar = Some(g);
            }
        }
        out
    }

    /// Records what the pass computed for one entry and, when it reached the sequence's newest
    /// token, samples and applies the token rules.
    fn complete(&mut self, entry: &Entry, picked: &mut Picked, events: &mut Vec<SeqEvent>) -> Result<()> {
        let id = entry.seq;
        let max_len = self.max_sequence_len();
        let vocab = self.backend.config().vocab_size;
        let s = self.seqs.get_mut(&id).expect("planned sequence is live");
        if entry.kind == EntryKind::Prefill && s.scores_from(entry.start) {
            // Every row of the chunk came back: score the prompt, and sample from the last row.
            if let (Picked::Logits(rows), Some(scores)) = (&mut *picked, &mut s.prompt_scores) {
                scores.add(&s.tokens[..s.prompt_len], entry.start, rows, vocab);
                if entry.samples && rows.len() >= vocab {
                    let last = rows.split_off(rows.len() - vocab);
                    *rows = last;
                }
            }
        }
        s.computed = entry.start + entry.tokens;
        if let Some(cache) = &mut self.prefix {
            if entry.kind == EntryKind::Prefill && entry.start < s.prompt_len {
                cache.stats.computed_prompt_tokens += (s.computed.min(s.prompt_len) - entry.start) as u64;
            }
        }
        if !entry.samples {
            return Ok(()); // more prompt to go
        }
        if let Some(scores) = s.prompt_scores.as_mut().filter(|p| !p.sent) {
            scores.sent = true;
            let (logprobs, top_logprobs) =
                (std::mem::take(&mut scores.logprobs), std::mem::take(&mut scores.top_logprobs));
            events.push(SeqEvent::PromptLogprobs { seq: id, logprobs, top_logprobs });
        }
        self.queue.retain(|&q| q != id);
        let sampled = match s.sample(picked) {
            Ok(Some(sampled)) => sampled,
            Ok(None) => {
                self.remove(id)?;
                let error = "internal error: the backend returned no token for this sequence".to_string();
                events.push(SeqEvent::Failed { seq: id, error });
                return Ok(());
            }
            Err(error) => {
                self.remove(id)?;
                events.push(SeqEvent::Failed { seq: id, error });
                return Ok(());
            }
        };
        if s.phase == Phase::PrefillOnly {
            // Keep the blocks and the prompt's KV for the caller to copy out, and say whether the
            // token already ends the sequence (then nobody continues it).
            s.phase = Phase::Held;
            let finish = s.next_token_ends(sampled.token, max_len);
            let (token, logprob, top_logprobs) = (sampled.token, sampled.logprob, sampled.top_logprobs);
            events.push(SeqEvent::Prefilled { seq: id, token, logprob, top_logprobs, finish });
            return Ok(());
        }
        let finish = s.push_token(sampled.token, max_len);
        let advanced = s.advance_grammar(sampled.token);
        let (token, logprob, top_logprobs) = (sampled.token, sampled.logprob, sampled.top_logprobs);
        events.push(SeqEvent::Token { seq: id, token, logprob, top_logprobs });
        if let Err(error) = advanced {
            self.remove(id)?;
            events.push(SeqEvent::Failed { seq: id, error });
            return Ok(());
        }
        if let Some(reason) = finish {
            self.finish(id, reason, events)?;
        }
        Ok(())
    }

    /// Ends a live sequence that a token rule or the length limit stopped: emits
    /// [`SeqEvent::Finished`] and frees its blocks.
    fn finish(&mut self, id: SeqId, reason: FinishReason, events: &mut Vec<SeqEvent>) -> Result<()> {
        // Its computed blocks stay cached (a sequence that ends in the step that computed its
        // prompt, `max_tokens` 1, would otherwise leave nothing behind).
        self.register_blocks(id)?;
        let s = &self.seqs[&id];
        events.push(SeqEvent::Finished { seq: id, reason, speculation: s.spec });
        self.remove(id)
    }

    /// Verifies one sequence's drafts against the pass's rows (see [`crate::spec::verify`]):
    /// emits the accepted tokens and the target's own next one, stopping where a stop rule or
    /// the length limit says. Returns how many of the chunk's tokens to commit (0 when the
    /// sequence ended here and left the engine).
    fn complete_verify(
        &mut self,
        entry: &Entry,
        picked: &mut Picked,
        events: &mut Vec<SeqEvent>,
    ) -> Result<usize> {
        let id = entry.seq;
        let k = entry.drafts();
        let vocab = self.backend.config().vocab_size;
        let max_len = self.max_sequence_len();
        let rows = match picked {
            Picked::Logits(rows) if rows.len() == (k + 1) * vocab => rows,
            _ => {
                self.remove(id)?;
                let error = "internal error: the backend returned no verification logits".to_string();
                events.push(SeqEvent::Failed { seq: id, error });
                return Ok(0);
            }
        };
        let s = self.seqs.get_mut(&id).expect("planned sequence is live");
        let drafts = std::mem::take(&mut s.drafts);
        let dists = std::mem::take(&mut s.draft_dists);
        let mut finish = None;
        let outcome = verify(&drafts[..k], |i| {
            let row = &mut rows[i * vocab..(i + 1) * vocab];
            // A sampled draft is accepted with probability min(1, p/q); a deterministic one (and
            // the bonus row) by drawing the target's token and comparing.
            let sampled = match dists.get(i).filter(|_| i < k) {
                Some(q) => s.sample_row_against(row, i, drafts[i], q),
                None => s.sample_row(row, i),
            }
            .map_err(EngineError::Internal)?;
            finish = s.push_token(sampled.token, max_len);
            s.advance_grammar(sampled.token).map_err(EngineError::Internal)?;
            let token = sampled.token;
            events.push(SeqEvent::Token {
                seq: id,
                token,
                logprob: sampled.logprob,
                top_logprobs: sampled.top_logprobs,
            });
            Ok::<_, EngineError>(Drawn { token, stop: finish.is_some() })
        });
        let outcome = match outcome {
            Ok(o) => o,
            Err(e) => {
                self.remove(id)?;
                events.push(SeqEvent::Failed { seq: id, error: e.to_string() });
                return Ok(0);
            }
        };
        s.computed = entry.start + outcome.emitted;
        s.spec.proposed += k as u64;
        s.spec.accepted += outcome.accepted as u64;
        s.depth.observe(k, outcome.accepted);
        if let Some(spec) = &mut self.spec {
            spec.stats.proposed += k as u64;
            spec.stats.accepted += outcome.accepted as u64;
            spec.stats.verifications += 1;
        }
        if let Some(reason) = finish {
            self.finish(id, reason, events)?;
            return Ok(0);
        }
        Ok(outcome.emitted)
    }
}

/// How the device draws entry `e`'s token ([`crate::backend::Backend::forward_sampled`]): its
/// sampler's next draw, with the constraint's first mask of this step when it has one (`jobs`
/// holds the constrained sequences' states). `None` brings the row to the host: an entry that
/// samples nothing, or a constraint whose masks failed or allow nothing (the host reports it).
fn device_row(
    e: &Entry,
    seqs: &std::collections::BTreeMap<SeqId, super::sequence::Sequence>,
    jobs: &[(SeqId, SeqGrammar, Vec<u32>)],
    masks_ok: bool,
    vocab: usize,
) -> Option<crate::sampler::RowSampling> {
    if !e.samples {
        return None;
    }
    let s = seqs.get(&e.seq)?;
    let mut row = s.sampler.device_row(&s.tokens, vocab);
    if let Some((_, g, _)) = jobs.iter().find(|(id, ..)| *id == e.seq) {
        let mask = g.masks.as_ref().ok().filter(|_| masks_ok)?.first()?;
        row.allowed = mask.words(vocab);
        if row.allowed.iter().all(|&w| w == 0) {
            return None; // nothing allowed within the row: the host says so
        }
    }
    Some(row)
}

/// Waits for the mask thread if it still runs: its result into `joined`, the wait into `exposed`.
fn join_masks<T>(
    masks: &mut Option<std::thread::ScopedJoinHandle<'_, T>>,
    joined: &mut Option<std::thread::Result<T>>,
    exposed: &mut std::time::Duration,
) {
    if let Some(h) = masks.take() {
        let waited = Instant::now();
        *joined = Some(h.join());
        *exposed = waited.elapsed();
    }
}
