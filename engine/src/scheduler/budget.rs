//! The engine's inter-token latency budget: calibrating the step-cost model at start-up, the
//! prefill limit each step plans with, what each step teaches the model, and when a decode step
//! should wait to leave the cores to a prefill worker on the same host. The model and its rules
//! are in [`super::cost`].

use std::time::{Duration, Instant};

use super::cost::{Calibration, StepCost, CALIBRATION_DECODES};
use super::plan::{EntryKind, Plan};
use super::Engine;
use crate::backend::{LogitsRequest, SeqChunk};
use crate::error::{EngineError, Result};
use crate::kv::{BlockId, WriteMode};

/// Prompt tokens of the calibration's prefill pass, at most.
const CALIBRATION_PROMPT: usize = 256;
/// Timed repetitions of each calibration pass (the median counts).
const CALIBRATION_REPEATS: usize = 3;

/// The latency budget of an engine that has one.
#[derive(Debug, Clone, Copy)]
pub(super) struct LatencyBudget {
    pub target: Duration,
    pub cost: StepCost,
    /// Steps wait to start until `target` after the previous one started, while they decode and
    /// prompts are being computed elsewhere for this engine (reservations outstanding).
    pub pace: bool,
    /// When the last step started.
    pub last_start: Option<Instant>,
}

impl Engine {
    /// Sizes each step's prompt chunks so that a step that decodes stays within `target` (its
    /// inter-token latency), after measuring what a step costs on this machine
    /// ([`Engine::calibrate_step_cost`]). With `pace`, a step that decodes while prompts for this
    /// engine are computed elsewhere (reservations are outstanding) starts no sooner than
    /// `target` after the previous one ([`Engine::pace_until`]), leaving the rest of the
    /// interval's CPU to a prefill worker on the same cores. Call before adding requests. A pool
    /// of fewer than 2 blocks or a context of fewer than 2 tokens cannot be calibrated: the
    /// engine then runs without a budget and logs a warning saying so.
    pub fn with_itl_target(mut self, target: Duration, pace: bool) -> Result<Engine> {
        self.check_idle_for_calibration()?;
        let Some(shape) = self.calibration_shape() else {
            tracing::warn!(
                blocks = self.alloc.available_blocks(),
                max_batch_tokens = self.opts.max_batch_tokens,
                "no step budget: the KV pool or the context is too small to calibrate the step cost"
            );
            return Ok(self);
        };
        let cost = self.calibrate(shape)?;
        tracing::info!(
            itl_target_ms = target.as_secs_f64() * 1e3,
            pace,
            fixed_ms = format!("{:.2}", cost.fixed_ms),
            per_decode_ms = format!("{:.3}", cost.per_decode_ms),
            per_prefill_ms = format!("{:.3}", cost.per_prefill_ms),
            "step budget calibrated"
        );
        self.budget = Some(LatencyBudget { target, cost, pace, last_start: None });
        Ok(self)
    }

    /// The step-cost model and the inter-token target, when the engine has a latency budget.
    pub fn step_cost(&self) -> Option<(StepCost, Duration)> {
        self.budget.map(|b| (b.cost, b.target))
    }

    /// Times forward passes on blocks nobody holds — one decode token, several decode tokens of
    /// separate sequences after a shared prompt, and one prompt chunk — and returns the step-cost
    /// model they imply. Needs an engine with no sequences and no reservations (at start-up), a
    /// pool of at least 2 blocks and a context of at least 2 tokens; the blocks it writes are
    /// free again when it returns and nothing reads what it wrote.
    pub fn calibrate_step_cost(&mut self) -> Result<StepCost> {
        self.check_idle_for_calibration()?;
        let Some(shape) = self.calibration_shape() else {
            return Err(EngineError::InvalidRequest(format!(
                "calibrating the step cost needs at least 2 free KV blocks and a context of 2 tokens; \
                 the pool has {} free blocks and the context is {} tokens",
                self.alloc.available_blocks(),
                self.max_sequence_len()
            )));
        };
        self.calibrate(shape)
    }

    /// Runs the calibration passes of `(prompt_len, decodes)` ([`Self::calibration_shape`]) on
    /// blocks taken for them and given back.
    fn calibrate(&mut self, (prompt_len, decodes): (usize, usize)) -> Result<StepCost> {
        let g = self.alloc.groups();
        let blocks = self.alloc.alloc_blocks((prompt_len.div_ceil(self.alloc.block_size()) + decodes) * g)?;
        let timed = self.spill_evicted().and_then(|()| self.time_calibration(&blocks, prompt_len, decodes));
        self.alloc.release_blocks(&blocks)?;
        Ok(StepCost::from_calibration(&timed?))
    }

    fn check_idle_for_calibration(&self) -> Result<()> {
        if !self.seqs.is_empty() || !self.reservations.lock().is_empty() {
            return Err(EngineError::InvalidRequest(
                "the step cost is calibrated before the engine takes requests".into(),
            ));
        }
        Ok(())
    }

    /// The calibration's prompt length and decode tokens: a prompt of at most
    /// [`CALIBRATION_PROMPT`] tokens, the token budget and what leaves room in the context for a
    /// token after it; up to [`CALIBRATION_DECODES`] decode tokens, one block each. `None` when
    /// the pool or the context cannot hold both.
    fn calibration_shape(&self) -> Option<(usize, usize)> {
        let (bs, total) = (self.alloc.block_size(), self.alloc.available_blocks());
        let budget = self.opts.max_batch_tokens;
        // Token blocks: one page per layer group each.
        let total = total / self.alloc.groups();
        let decodes = CALIBRATION_DECODES.min(budget).min(total.saturating_sub(1));
        let prompt_len = CALIBRATION_PROMPT
            .min(budget)
            .min(self.max_sequence_len().saturating_sub(1))
            .min(total.saturating_sub(decodes) * bs);
        (decodes > 0 && prompt_len > 0).then_some((prompt_len, decodes))
    }

    fn time_calibration(
        &mut self,
        blocks: &[BlockId],
        prompt_len: usize,
        decodes: usize,
    ) -> Result<Calibration> {
        let bs = self.alloc.block_size();
        let vocab = self.backend.config().vocab_size.max(1) as u64;
        // Arbitrary ids spread over the vocabulary; the numbers computed do not matter.
        let tokens: Vec<u32> = (0..prompt_len as u64 + 1).map(|i| ((i * 7919 + 11) % vocab) as u32).collect();
        // Tables hold one page per layer group and token block.
        let g = self.alloc.groups();
        let (prompt_table, own) = blocks.split_at(prompt_len.div_ceil(bs) * g);
        // Each decode token attends to the prompt's whole blocks (read only) and writes a block
        // of its own, so no two chunks of a pass write one slot.
        let context = (prompt_len / bs) * bs;
        let tables: Vec<Vec<BlockId>> = own
            .chunks(g)
            .map(|b| prompt_table[..context / bs * g].iter().chain(b).copied().collect())
            .collect();
        let prefill = [SeqChunk {
            tokens: &tokens[..prompt_len],
            start_pos: 0,
            block_table: prompt_table,
            logits: LogitsRequest::Last,
            write: WriteMode::Direct,
            adapter: None,
        }];
        let decode_chunks = |n: usize| -> Vec<SeqChunk<'_>> {
            tables[..n]
                .iter()
                .map(|t| SeqChunk {
                    tokens: &tokens[prompt_len..],
                    start_pos: context,
                    block_table: t,
                    logits: LogitsRequest::Last,
                    write: WriteMode::Direct,
                    adapter: None,
                })
                .collect()
        };
        let one = decode_chunks(1);
        let many = decode_chunks(decodes);
        let mut time = |batch: &[SeqChunk<'_>]| -> Result<Duration> {
            // One untimed pass first (caches, lazily built kernels or graphs of this shape).
            self.backend.forward(batch)?;
            let mut runs = Vec::with_capacity(CALIBRATION_REPEATS);
            for _ in 0..CALIBRATION_REPEATS {
                let t0 = Instant::now();
                self.backend.forward(batch)?;
                runs.push(t0.elapsed());
            }
            runs.sort_unstable();
            Ok(runs[runs.len() / 2])
        };
        // The prompt first: the decode passes attend to it.
        let prefill = time(&prefill)?;
        let one_decode = time(&one)?;
        let many = time(&many)?;
        Ok(Calibration {
            one_decode,
            decodes: many,
            decode_tokens: decodes,
            prefill,
            prefill_tokens: prompt_len,
        })
    }

    /// Most prompt and draft tokens the next step may compute beside its decodes.
    pub(super) fn prefill_limit(&self, decodes: usize) -> Option<usize> {
        let b = self.budget.as_ref()?;
        b.cost.prefill_limit(b.target, decodes)
    }

    /// A step is starting.
    pub(super) fn step_started(&mut self, at: Instant) {
        if let Some(b) = &mut self.budget {
            b.last_start = Some(at);
        }
    }

    /// Teaches the cost model what a step of `plan` took.
    pub(super) fn step_took(&mut self, plan: &Plan, took: Duration) {
        let Some(b) = &mut self.budget else { return };
        let (mut decode, mut prefill) = (0, 0);
        for e in &plan.batch {
            match e.kind {
                EntryKind::Prefill => prefill += e.tokens,
                EntryKind::Decode | EntryKind::Verify => decode += e.tokens,
            }
        }
        b.cost.observe(decode, prefill, took);
    }

    /// With pacing on: the moment the next step should start, when sequences decode while
    /// prompts are computed elsewhere for this engine (reservations outstanding) and the previous
    /// step started less than the target ago. `None`: step now.
    pub fn pace_until(&self) -> Option<Instant> {
        let b = self.budget.as_ref().filter(|b| b.pace)?;
        let at = b.last_start? + b.target;
        let decoding = self.seqs.values().any(|s| s.decodes_next());
        (decoding && !self.reservations.lock().is_empty() && Instant::now() < at).then_some(at)
    }
}
