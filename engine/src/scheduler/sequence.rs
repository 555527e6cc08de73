//! One sequence's state between steps, and what becomes of a token the forward pass gives it:
//! sampling and the token rules. The engine makes no text (see [`tandem_model::text`]). The block bookkeeping is the engine's, not the
//! sequence's: `has_blocks` only mirrors whether the allocator holds a table for it.

use std::time::Instant;

use super::PrefixStats;
use crate::kv::prefix::{extend_chain, BlockHash};
use crate::sampler::{FinishReason, Sampled, Sampler, TokenStop};
use crate::spec::depth::SeqDepth;
use crate::spec::SpecCounts;
use tandem_model::grammar::{Grammar, TokenMask};

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
    /// The LoRA adapter it runs under, resolved when it was queued (`None`: the base model).
    pub(super) adapter: Option<std::sync::Arc<crate::lora::LoraAdapter>>,
    /// Prompt followed by generated tokens.
    pub(super) tokens: Vec<u32>,
    /// Tokens whose K/V are in the cache.
    pub(super) computed: usize,
    pub(super) sampler: Sampler,
    pub(super) stop: TokenStop,
    /// The sequence holds blocks in the allocator.
    pub(super) has_blocks: bool,
    /// It holds blocks for all its tokens (admitted by the planner), not just a cached prefix.
    pub(super) admitted: bool,
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
    /// The distributions this step's drafts were sampled from, one per draft (sampled drafts);
    /// empty for deterministic drafts.
    pub(super) draft_dists: Vec<crate::spec::DraftDist>,
    /// Prefix-cache state (`None` without a prefix cache).
    pub(super) prefix: Option<SeqPrefix>,
    /// Structured output: the constraint's state after the sequence's generated tokens, and the
    /// masks computed for this step (`None` without a constraint).
    pub(super) grammar: Option<SeqGrammar>,
    /// Scoring the prompt (`prompt_logprobs`): what the computed positions gave so far (`None`
    /// unless asked for).
    pub(super) prompt_scores: Option<PromptScores>,
}

/// A prompt's scores as its positions are computed: entry `j` scores prompt token `j + 1`.
pub(super) struct PromptScores {
    /// Alternatives asked for per position.
    k: usize,
    pub(super) logprobs: Vec<f32>,
    pub(super) top_logprobs: Vec<Vec<(u32, f32)>>,
    /// The scores went out ([`super::SeqEvent::PromptLogprobs`]); a recomputation after a
    /// preemption adds nothing.
    pub(super) sent: bool,
}

impl PromptScores {
    pub(super) fn new(k: usize) -> PromptScores {
        PromptScores { k, logprobs: Vec::new(), top_logprobs: Vec::new(), sent: false }
    }

    /// Scores the positions `start..start + rows.len() / vocab` of `prompt` from their logits
    /// rows; positions already scored (a recomputation) and the last prompt position (it scores
    /// no prompt token) are skipped.
    pub(super) fn add(&mut self, prompt: &[u32], start: usize, rows: &[f32], vocab: usize) {
        for (i, row) in rows.chunks_exact(vocab).enumerate() {
            let pos = start + i;
            if self.sent || pos != self.logprobs.len() || pos + 1 >= prompt.len() {
                continue;
            }
            let (lp, top) = crate::sampler::score(row, prompt[pos + 1], self.k);
            self.logprobs.push(lp);
            self.top_logprobs.push(top);
        }
    }
}

/// A sequence's constraint state and this step's masks.
pub(super) struct SeqGrammar {
    pub(super) state: Box<Grammar>,
    /// The masks for this step's sampled positions, computed beside the forward pass: one for a
    /// plain step, `drafts + 1` for a verification (the mask after each accepted draft). Empty
    /// outside a step; an error when the constraint engine failed.
    pub(super) masks: std::result::Result<Vec<TokenMask>, String>,
}

impl SeqGrammar {
    pub(super) fn new(state: Grammar) -> SeqGrammar {
        SeqGrammar { state: Box::new(state), masks: Ok(Vec::new()) }
    }

    /// Computes this step's masks: at the current state, then after each of `drafts` (a
    /// verification step). Runs on the mask thread while the forward pass runs.
    pub(super) fn prepare(&mut self, drafts: &[u32]) {
        self.masks = self.state.masks_along(drafts);
    }
}

/// A sequence's names for its full blocks, and what the prefix cache gave it.
pub(super) struct SeqPrefix {
    /// The chain's root: model identity and the request's salt.
    pub(super) root: BlockHash,
    /// Hashes of the sequence's first full blocks (computed lazily, never for draft tokens).
    pub(super) hashes: Vec<BlockHash>,
    /// Leading blocks of the table already registered with the allocator (or found there).
    pub(super) registered: usize,
    /// Prompt tokens the cache supplied when the sequence first got blocks.
    pub(super) cached_tokens: usize,
    /// The sequence has been looked up since it last lost its blocks (counted once).
    pub(super) looked_up: bool,
    /// When its waits out of the queue for pages read from a disk tier end, once it has waited
    /// ([`super::RELOAD_WAIT`] after the first).
    pub(super) tier_wait_until: Option<std::time::Instant>,
}

impl SeqPrefix {
    pub(super) fn new(root: BlockHash) -> SeqPrefix {
        SeqPrefix {
            root,
            hashes: Vec::new(),
            registered: 0,
            cached_tokens: 0,
            looked_up: false,
            tier_wait_until: None,
        }
    }

    /// Counts this sequence's lookup of its `tokens` tokens, once until it loses its blocks.
    pub(super) fn count_lookup(&mut self, stats: &mut PrefixStats, tokens: usize) {
        if !std::mem::replace(&mut self.looked_up, true) {
            stats.looked_up(tokens);
        }
    }

    /// The hashes of the full blocks among `tokens` (committed tokens only).
    pub(super) fn hashes_for(&mut self, tokens: &[u32], block_size: usize) -> &[BlockHash] {
        extend_chain(self.root, &mut self.hashes, tokens, block_size);
        &self.hashes[..tokens.len() / block_size]
    }
}

/// What a forward pass gave one batch entry: its logits row, the backend's greedy pick, or a
/// token the backend drew with this sequence's sampler's next draw ([`Sampler::device_row`];
/// `drew`: whether it used it).
pub(super) enum Picked {
    Logits(Vec<f32>),
    Greedy(Option<(u32, f32)>),
    Device { sampled: Sampled, drew: bool },
}

impl From<crate::backend::DevicePick> for Picked {
    fn from(p: crate::backend::DevicePick) -> Picked {
        match p {
            crate::backend::DevicePick::Sampled { sampled, drew } => Picked::Device { sampled, drew },
            crate::backend::DevicePick::Row(row) => Picked::Logits(row),
        }
    }
}

impl Sequence {
    /// The next token, drawn from what the pass gave; `None` when the backend gave no token.
    /// Under a constraint the row is first masked with this step's first mask. An error is the
    /// constraint engine's.
    pub(super) fn sample(&mut self, picked: &mut Picked) -> std::result::Result<Option<Sampled>, String> {
        Ok(match picked {
            Picked::Logits(row) => Some(self.sample_row(row, 0)?),
            Picked::Greedy(Some((token, logprob))) => {
                Some(Sampled { token: *token, logprob: *logprob, top_logprobs: Vec::new() })
            }
            Picked::Greedy(None) => None,
            Picked::Device { sampled, drew } => {
                self.sampler.device_drew(*drew);
                Some(sampled.clone())
            }
        })
    }

    /// Draws the next token from one logits row; under a constraint the row is masked first with
    /// this step's mask number `position` (so log-probabilities are those of the allowed tokens, as
    /// the constraint makes every other token impossible).
    pub(super) fn sample_row(
        &mut self,
        row: &mut [f32],
        position: usize,
    ) -> std::result::Result<Sampled, String> {
        self.mask_row(row, position)?;
        Ok(self.sampler.sample(row, &self.tokens))
    }

    /// [`Sequence::sample_row`] for a row whose draft `draft` was sampled from `q`: the target's
    /// token by rejection sampling ([`crate::sampler::Sampler::sample_against_draft`]).
    pub(super) fn sample_row_against(
        &mut self,
        row: &mut [f32],
        position: usize,
        draft: u32,
        q: &crate::spec::DraftDist,
    ) -> std::result::Result<Sampled, String> {
        self.mask_row(row, position)?;
        Ok(self.sampler.sample_against_draft(row, &self.tokens, draft, q))
    }

    /// Applies the constraint's mask for `position` of this step to a logits row.
    fn mask_row(&self, row: &mut [f32], position: usize) -> std::result::Result<(), String> {
        if let Some(g) = &self.grammar {
            let masks = g.masks.as_ref().map_err(Clone::clone)?;
            let mask = masks.get(position).ok_or_else(|| {
                format!("structured output: no token mask for position {position} of this step")
            })?;
            mask.apply(row);
            if !row.iter().any(|&l| l > f32::NEG_INFINITY) {
                // The model gives every allowed token probability 0; the grammar still decides.
                let t =
                    mask.first_allowed().ok_or("structured output: the constraint allows no token here")?;
                row[t as usize] = 0.0;
            }
        }
        Ok(())
    }

    /// Moves the constraint past `token`, a token this sequence just emitted.
    pub(super) fn advance_grammar(&mut self, token: u32) -> std::result::Result<(), String> {
        match &mut self.grammar {
            Some(g) => g.state.advance(token),
            None => Ok(()),
        }
    }

    /// Whether the sequence's next pass is a decode step: it generates, holds blocks, and every
    /// token but its newest is computed.
    pub(super) fn decodes_next(&self) -> bool {
        self.phase == Phase::Generate && self.has_blocks && self.computed + 1 == self.tokens.len()
    }

    /// Whether the backend may pick this sequence's token on its own (see
    /// [`Sampler::is_plain_greedy`]); never under a constraint, whose mask the backend does not see.
    pub(super) fn backend_may_pick(&self) -> bool {
        // A prompt being scored needs every row; once scored, the backend may pick again.
        self.grammar.is_none()
            && self.prompt_scores.as_ref().is_none_or(|p| p.sent)
            && self.sampler.is_plain_greedy()
    }

    /// Whether this step's chunk from `start` needs the logits of every position: the prompt is
    /// being scored and the chunk holds positions not scored yet.
    pub(super) fn scores_from(&self, start: usize) -> bool {
        self.prompt_scores.as_ref().is_some_and(|p| !p.sent && start < self.prompt_len)
    }

    /// Appends a sampled token; what ends the sequence with it, if anything: a token rule, or
    /// the sequence reaching `max_len` tokens.
    pub(super) fn push_token(&mut self, token: u32, max_len: usize) -> Option<FinishReason> {
        self.tokens.push(token);
        ends_with(&mut self.stop, token, self.tokens.len(), max_len)
    }

    /// What would end the sequence with `token` as its next token, without appending it (a
    /// prefill-only sequence reports this for the caller that continues it).
    pub(super) fn next_token_ends(&mut self, token: u32, max_len: usize) -> Option<FinishReason> {
        ends_with(&mut self.stop, token, self.tokens.len() + 1, max_len)
    }
}

/// The token rules applied to `token`, which makes the sequence `len` tokens long, and the
/// context limit: at `max_len` tokens there is no room for another.
pub(super) fn ends_with(
    stop: &mut TokenStop,
    token: u32,
    len: usize,
    max_len: usize,
) -> Option<FinishReason> {
    stop.push(token).or((len >= max_len).then_some(FinishReason::Length))
}
