//! Running one step: describe the engine to the planner, apply its [`Plan`] to the block
//! allocator (preemptions and allocations, in plan order), run the forward pass, and turn what it
//! gives into tokens and [`SeqEvent`]s.
//!
//! The plan has already counted every block it allocates against the free ones, so an allocation
//! that fails here is an internal error, not a reason to replan. Whatever goes wrong after the
//! allocations, no sequence that leaves the engine keeps a block.

use std::collections::BTreeSet;
use std::time::Instant;

use super::plan::{self, Entry, Idle, Plan, SeqView, StepState};
use super::sequence::{Phase, Picked};
use super::{Engine, SeqEvent};
use crate::backend::{LogitsRequest, SeqChunk};
use crate::error::{EngineError, Result};
use crate::kv::{KvError, SeqId, WriteMode};
use crate::sampler::FinishReason;

impl Engine {
    pub(super) fn schedule_and_run(&mut self) -> Result<Vec<SeqEvent>> {
        let mut events = Vec::new();
        self.stalled = false;
        self.finish_pending(&mut events)?;
        let plan = plan::plan(&self.step_state());
        self.apply(&plan)?;
        match plan.idle {
            None => {}
            Some(Idle::NoWork) => return Ok(events),
            Some(Idle::Stalled) => {
                // Reservations or held sequences own the blocks the waiting ones need: wait for a
                // release (the caller sees `stalled()`).
                self.stalled = true;
                return Ok(events);
            }
            Some(Idle::NoProgress) => {
                return Err(EngineError::Internal(format!(
                    "scheduler made no progress with {} active sequences and {} of {} blocks free",
                    self.seqs.len(),
                    self.alloc.free_blocks(),
                    self.alloc.total_blocks()
                )));
            }
        }
        let mut picked = match self.forward(&plan.batch) {
            Ok(p) => p,
            Err(e) => {
                // The pass failed as a whole: fail every sequence in it, never leave blocks behind.
                for entry in &plan.batch {
                    self.remove(entry.seq)?;
                    events.push(SeqEvent::Failed { seq: entry.seq, error: e.to_string() });
                }
                return Ok(events);
            }
        };
        for (entry, picked) in plan.batch.iter().zip(&mut picked) {
            self.complete(entry, picked, &mut events)?;
        }
        Ok(events)
    }

    /// Finishes adopted sequences that their first token already ended, before anything runs.
    fn finish_pending(&mut self, events: &mut Vec<SeqEvent>) -> Result<()> {
        let done: Vec<(SeqId, FinishReason)> =
            self.seqs.iter().filter_map(|(&id, s)| Some((id, s.finish_pending.clone()?))).collect();
        for (id, reason) in done {
            let text = self.seqs.get_mut(&id).expect("live").closing_text(true);
            events.push(SeqEvent::Finished { seq: id, reason, text });
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
                blocks: self.alloc.block_table(id).map_or(0, <[_]>::len),
            }
        };
        let queued: BTreeSet<SeqId> = self.queue.iter().copied().collect();
        let running = self
            .seqs
            .iter()
            .filter(|(id, s)| s.phase != Phase::Held && !queued.contains(id))
            .map(|(&id, s)| {
                debug_assert!(
                    s.phase == Phase::Generate && s.has_blocks && s.computed + 1 == s.tokens.len(),
                    "sequence {id} is neither queued nor ready to decode"
                );
                view(id)
            })
            .collect();
        StepState {
            max_batch_tokens: self.opts.max_batch_tokens,
            max_num_seqs: self.opts.max_num_seqs,
            block_size: self.alloc.block_size(),
            free_blocks: self.alloc.free_blocks(),
            total_blocks: self.alloc.total_blocks(),
            running,
            queued: self.queue.iter().map(|&id| view(id)).collect(),
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
                    self.alloc.free_blocks()
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
        s.computed = 0;
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
            self.alloc.append(seq, len - have).map(|cow| cow.map(|c| (c.src, c.dst)))
        } else {
            self.alloc.add_sequence(seq, len).map(|_| None)
        };
        match res {
            Ok(cow) => {
                s.has_blocks = true;
                s.started.get_or_insert_with(Instant::now);
                if let Some((src, dst)) = cow {
                    self.backend.copy_block(src, dst)?;
                }
                Ok(true)
            }
            Err(KvError::OutOfBlocks { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Runs the forward pass over the batch: one result per entry, in batch order.
    fn forward(&mut self, batch: &[Entry]) -> Result<Vec<Picked>> {
        let tables: Vec<Vec<u32>> =
            batch.iter().map(|e| self.alloc.block_table(e.seq).unwrap_or(&[]).to_vec()).collect();
        let chunks: Vec<SeqChunk<'_>> = batch
            .iter()
            .zip(&tables)
            .map(|(e, table)| SeqChunk {
                tokens: &self.seqs[&e.seq].tokens[e.start..e.start + e.tokens],
                start_pos: e.start,
                block_table: table,
                logits: if e.samples { LogitsRequest::Last } else { LogitsRequest::None },
                write: WriteMode::Direct,
            })
            .collect();
        // When every sequence that samples this step picks greedily, the backend picks too (on a
        // GPU that saves copying a vocabulary of logits per sequence).
        let greedy = batch.iter().all(|e| !e.samples || self.seqs[&e.seq].sampler.is_plain_greedy());
        if greedy {
            self.backend.forward_greedy(&chunks).map(|v| v.into_iter().map(Picked::Greedy).collect())
        } else {
            self.backend.forward(&chunks).map(|v| v.into_iter().map(Picked::Logits).collect())
        }
    }

    /// Records what the pass computed for one entry and, when it reached the sequence's newest
    /// token, samples, detokenizes and applies the stop rules.
    fn complete(&mut self, entry: &Entry, picked: &mut Picked, events: &mut Vec<SeqEvent>) -> Result<()> {
        let id = entry.seq;
        let s = self.seqs.get_mut(&id).expect("planned sequence is live");
        s.computed = entry.start + entry.tokens;
        if !entry.samples {
            return Ok(()); // more prompt to go
        }
        self.queue.retain(|&q| q != id);
        let Some(sampled) = s.sample(picked) else {
            self.remove(id)?;
            let error = "internal error: the backend returned no token for this sequence".to_string();
            events.push(SeqEvent::Failed { seq: id, error });
            return Ok(());
        };
        if s.phase == Phase::PrefillOnly {
            // Keep the blocks and the prompt's KV for the caller to copy out; no stop rules.
            s.phase = Phase::Held;
            events.push(SeqEvent::Prefilled { seq: id, token: sampled.token, logprob: sampled.logprob });
            return Ok(());
        }
        let (text, finish) = match s.push_token(sampled.token) {
            Ok(t) => t,
            Err(e) => {
                self.remove(id)?;
                events.push(SeqEvent::Failed { seq: id, error: e.to_string() });
                return Ok(());
            }
        };
        let room_left = s.tokens.len() < self.max_sequence_len();
        events.push(SeqEvent::Token { seq: id, token: sampled.token, logprob: sampled.logprob, text });
        let finish = finish.or(if room_left { None } else { Some(FinishReason::Length) });
        if let Some(reason) = finish {
            // Never cut text after a stop string; otherwise release the bytes of a character the
            // stream ended inside.
            let decoder_tail = !matches!(reason, FinishReason::StopString(_));
            let text = self.seqs.get_mut(&id).expect("live").closing_text(decoder_tail);
            events.push(SeqEvent::Finished { seq: id, reason, text });
            self.remove(id)?;
        }
        Ok(())
    }
}
