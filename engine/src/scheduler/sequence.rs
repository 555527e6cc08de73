//! One sequence's state between steps, and what becomes of a token the forward pass gives it:
//! sampling, detokenization, stop rules. The block bookkeeping is the engine's, not the
//! sequence's: `has_blocks` only mirrors whether the allocator holds a table for it.

use std::time::Instant;

use crate::error::Result;
use crate::sampler::{FinishReason, Sampled, Sampler, StopChecker};
use crate::spec::depth::SeqDepth;
use crate::spec::SpecCounts;
use crate::tokenizer::IncrementalDecoder;

/// Where a sequence is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// An ordinary request (or an adopted one): runs until a stop condition.
    Generate,
    /// A prefill-only request whose first token is not sampled yet.
    PrefillOnly,
    /// A prefill-only request that emitted `SeqEvent::Prefilled`: holds its blocks, never runs.
    Held,
}

pub(super) struct Sequence {
    pub(super) prompt_len: usize,
    /// Prompt followed by generated tokens.
    pub(super) tokens: Vec<u32>,
    /// Tokens whose K/V are in the cache.
    pub(super) computed: usize,
    pub(super) sampler: Sampler,
    pub(super) stop: StopChecker,
    pub(super) decoder: IncrementalDecoder,
    /// The sequence holds blocks in the allocator.
    pub(super) has_blocks: bool,
    pub(super) phase: Phase,
    /// An adopted sequence whose first token already ended it: finished at the next step.
    pub(super) finish_pending: Option<FinishReason>,
    /// When the sequence first got blocks (started computing).
    pub(super) started: Option<Instant>,
    /// Speculation depth state (acceptance rate).
    pub(super) depth: SeqDepth,
    /// Draft tokens proposed and accepted so far.
    pub(super) spec: SpecCounts,
    /// This step's draft tokens (empty outside a step, and without speculation).
    pub(super) drafts: Vec<u32>,
}

/// What a forward pass gave one batch entry: its logits row, or the backend's greedy pick.
pub(super) enum Picked {
    Logits(Vec<f32>),
    Greedy(Option<(u32, f32)>),
}

impl Sequence {
    /// The next token, drawn from what the pass gave; `None` when the backend gave no token.
    pub(super) fn sample(&mut self, picked: &mut Picked) -> Option<Sampled> {
        match picked {
            Picked::Logits(row) => Some(self.sampler.sample(row, &self.tokens)),
            Picked::Greedy(Some((token, logprob))) => {
                Some(Sampled { token: *token, logprob: *logprob, top_logprobs: Vec::new() })
            }
            Picked::Greedy(None) => None,
        }
    }

    /// Appends a sampled token. Returns the text now safe to show and the stop rule it
    /// triggered, if any; an error when the tokenizer cannot decode the id (models whose
    /// embedding rows outnumber the vocabulary).
    pub(super) fn push_token(&mut self, token: u32) -> Result<(String, Option<FinishReason>)> {
        self.tokens.push(token);
        let delta = self.decoder.push(token)?;
        Ok(self.stop.push(token, &delta))
    }

    /// The text held back until the end: the stop checker's pending text and, with
    /// `decoder_tail`, the bytes of a character the stream ended inside.
    pub(super) fn closing_text(&mut self, decoder_tail: bool) -> String {
        let mut text = self.stop.flush();
        if decoder_tail {
            text.push_str(&self.decoder.finish().unwrap_or_default());
        }
        text
    }
}
