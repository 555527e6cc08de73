//! Speculative decoding: who proposes draft tokens, how many, and what came of them.
//!
//! A [`Drafter`] proposes up to k tokens that continue a sequence: [`ngram::NgramDrafter`] looks
//! the sequence's newest tokens up earlier in the sequence (prompt lookup), and
//! [`draft_model::DraftModelDrafter`] runs a smaller model with the target's vocabulary on its own
//! backend and KV pool. Proposals are deterministic by default (a lookup, or the draft model's
//! greedy token), which is what lets verification keep the output exactly the target's, token for
//! token (see [`verify`]). With [`SpecOptions::sampled_drafts`] a draft model samples its drafts
//! from its own distribution at the request's temperature ([`DraftSampling`]) and reports that
//! distribution ([`DraftDist`], [`Drafter::take_dists`]); verification then accepts each draft with
//! probability `min(1, p/q)`, which keeps the target's distribution but not its exact tokens.
//!
//! The scheduler owns everything else: it asks [`depth`] how many tokens each sequence should
//! draft this step, asks the drafter, lets the planner cut the drafts down to what the token
//! budget and the free KV blocks allow, runs one staged verification chunk `[last, d1..dk]` per
//! speculating sequence in the same pass as ordinary decode and prefill chunks, and then, in the
//! same step and on every path, commits the accepted prefix or discards the pass.

pub mod depth;
pub mod draft_model;
pub mod ngram;
pub mod verify;

use crate::error::{EngineError, Result};
use crate::kv::SeqId;
pub use crate::sampler::{DraftDist, DraftSampling};

/// Most draft tokens a sequence may propose per step (`--spec-tokens`).
pub const MAX_SPEC_TOKENS: usize = 16;

/// How a worker speculates (`--speculate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SpecMethod {
    /// No speculation: one token per sequence per step.
    #[default]
    Off,
    /// Prompt lookup: the continuation of the longest earlier match of the newest tokens.
    Ngram,
    /// A draft model sharing the target's vocabulary.
    Draft,
}

impl std::fmt::Display for SpecMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SpecMethod::Off => "off",
            SpecMethod::Ngram => "ngram",
            SpecMethod::Draft => "draft",
        })
    }
}

impl std::str::FromStr for SpecMethod {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" | "none" => Ok(SpecMethod::Off),
            "ngram" => Ok(SpecMethod::Ngram),
            "draft" => Ok(SpecMethod::Draft),
            _ => Err(format!("unknown speculation method {s:?} (expected off, ngram or draft)")),
        }
    }
}

/// Speculation settings of one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SpecOptions {
    /// Most draft tokens per sequence per step (k), 1..=[`MAX_SPEC_TOKENS`]. Default 4.
    pub max_draft: usize,
    /// Adapt the depth per sequence (acceptance rate) and per step (batch size, free blocks);
    /// otherwise every sequence drafts `max_draft` tokens whenever budget and blocks allow.
    /// Default true.
    pub adaptive: bool,
    /// Shortest suffix the n-gram drafter looks up. Default 2.
    pub ngram_min: usize,
    /// Longest suffix the n-gram drafter looks up (it tries the longest first). Default 4.
    pub ngram_max: usize,
    /// A draft model samples its drafts for requests with temperature > 0 (at the request's
    /// temperature, top-k, top-p and min-p) and verification accepts each with probability
    /// `min(1, p/q)`. Output keeps the target's distribution, but a seeded request no longer gives
    /// the same tokens as without speculation. Default false: greedy drafts for every request.
    #[serde(default)]
    pub sampled_drafts: bool,
}

impl Default for SpecOptions {
    fn default() -> Self {
        SpecOptions { max_draft: 4, adaptive: true, ngram_min: 2, ngram_max: 4, sampled_drafts: false }
    }
}

impl SpecOptions {
    /// Checks the settings; the error names the flag.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        if self.max_draft == 0 || self.max_draft > MAX_SPEC_TOKENS {
            return bad(format!(
                "--spec-tokens must be between 1 and {MAX_SPEC_TOKENS}, got {}",
                self.max_draft
            ));
        }
        if self.ngram_min == 0 || self.ngram_min > self.ngram_max || self.ngram_max > 64 {
            return bad(format!(
                "the n-gram range must satisfy 1 <= min <= max <= 64, got {}..{}",
                self.ngram_min, self.ngram_max
            ));
        }
        Ok(())
    }
}

/// One sequence's request for draft tokens.
#[derive(Debug, Clone, Copy)]
pub struct DraftAsk<'a> {
    pub seq: SeqId,
    /// Every token of the sequence (prompt and generated), the newest last. Its KV is computed in
    /// the target up to the newest token, which is not computed yet.
    pub tokens: &'a [u32],
    /// Most tokens to propose (at least 1).
    pub max: usize,
    /// Sample the drafts from this distribution's rule instead of picking them deterministically
    /// (only with [`SpecOptions::sampled_drafts`], for a request with temperature > 0). Drafters
    /// that cannot sample ignore it.
    pub sampling: Option<DraftSampling>,
}

/// Proposes draft tokens. Implementations keep whatever per-sequence state they need (a draft
/// model's KV) and must cope with a sequence whose tokens changed since the last call (a rejected
/// draft, a preempted and recomputed sequence): the tokens given are the truth.
pub trait Drafter: Send {
    /// Which method this is.
    fn method(&self) -> SpecMethod;
    /// A short description for logs and registration records (e.g. `ngram 2..4`).
    fn describe(&self) -> String;
    /// Proposes, per ask, up to `max` tokens (possibly none). An error means no drafts this
    /// step; the scheduler logs it and decodes normally.
    fn propose(&mut self, asks: &[DraftAsk<'_>]) -> Result<Vec<Vec<u32>>>;
    /// The sequence is gone (finished, failed, cancelled): drop its state.
    fn forget(&mut self, seq: SeqId);
    /// The distributions the tokens of the newest proposal for `seq` were sampled from, one per
    /// token, when they were sampled ([`DraftAsk::sampling`]); `None` for deterministic drafts.
    /// Taking them clears them.
    fn take_dists(&mut self, seq: SeqId) -> Option<Vec<DraftDist>> {
        let _ = seq;
        None
    }
    /// Checks the drafter's own KV bookkeeping (a draft model's pool); `idle` says no sequence
    /// is live, when it must hold nothing. Drafters without memory have nothing to check.
    fn check_kv(&self, idle: bool) -> Result<()> {
        let _ = idle;
        Ok(())
    }
}

/// Draft tokens proposed to and accepted by verification, for one sequence or a whole engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SpecCounts {
    pub proposed: u64,
    pub accepted: u64,
}

/// An engine's speculation counters since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SpecStats {
    /// Draft tokens verified.
    pub proposed: u64,
    /// Draft tokens accepted.
    pub accepted: u64,
    /// Verification chunks run (one per speculating sequence per step).
    pub verifications: u64,
}

impl SpecStats {
    /// Accepted over proposed draft tokens (0 when nothing was proposed).
    pub fn acceptance_rate(&self) -> f64 {
        if self.proposed == 0 {
            0.0
        } else {
            self.accepted as f64 / self.proposed as f64
        }
    }

    /// Draft tokens accepted per verification chunk (0 when none ran). Each verification also
    /// yields one token of the target's own, so it advances a sequence by this plus one.
    pub fn mean_accepted_len(&self) -> f64 {
        if self.verifications == 0 {
            0.0
        } else {
            self.accepted as f64 / self.verifications as f64
        }
    }
}
