//! Per-request sampling ([`Sampler`]).
//!
//! Invariants:
//! - **Determinism.** A [`Sampler`] owns its RNG (ChaCha20, seeded from [`SamplingParams::seed`] or
//!   from the caller's fallback seed). Every token costs exactly one `u64` draw (none when greedy;
//!   verifying a sampled draft, [`Sampler::sample_against_draft`], costs one more on a rejection),
//!   and the candidate order is a total order (scaled logit descending, token id ascending), so the
//!   same seed and the same logits give the same tokens regardless of thread count, allocation or
//!   hashing. The uniform is built from the raw `u64` by us, not by a `rand` distribution, so a
//!   `rand` upgrade cannot silently change outputs.
//! - **Pipeline order** (temperature > 0): repetition penalty → temperature → top-k → top-p →
//!   min-p → renormalise → one draw. Temperature 0 is greedy argmax (ties → lowest id).
//! - **Log-probabilities are the model's own.** A sampled token's `logprob` and the
//!   `top_logprobs` alternatives are taken from the raw row's log-softmax (temperature 1, before the
//!   repetition penalty, temperature, top-k, top-p and min-p), as vLLM reports them by default: they
//!   say how likely the model found a token, whatever the request's sampling did with it.
//! - **No panics on odd logits.** NaN counts as `-inf` and `+inf` as `f32::MAX`. If every logit is
//!   `-inf`/NaN there is nothing to sample from: the sampler returns the lowest id whose raw logit
//!   is not NaN (the argmax of the raw row, ties → lowest id), or token 0 when all are NaN (or the
//!   row is empty), with logprob `-inf`.
//!
//! Sampling parameters and their validation, and the token rules ([`TokenStop`]), belong to the
//! request and live in `tandem_model` (re-exported here).

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;
use std::cmp::Ordering;

/// Mixed into a request's seed for its draft model's random stream, so that the drafts' draws and
/// the request's own are independent.
const DRAFT_STREAM: u64 = 0x9E37_79B9_7F4A_7C15;

pub use tandem_model::request::{
    choices, SamplingParams, MAX_CHOICES, MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_STOP_STRING_BYTES,
    MAX_STOP_TOKEN_IDS,
};
pub use tandem_model::stop::{FinishReason, TokenStop};

/// One sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The token id.
    pub token: u32,
    /// Its log-probability under the model's own distribution (the raw row's log-softmax, before
    /// any sampling transform).
    pub logprob: f32,
    /// The `logprobs` most likely tokens under that same distribution, most likely first (ties →
    /// lowest id), whether or not the sampling filters would have allowed them. Empty when
    /// `logprobs` is `None`.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// How a draft model samples a sequence's drafts: the request's temperature and filters, and a
/// seed for the drafter's own random stream (distinct from the request's, which verification
/// uses).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftSampling {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
}

/// The distribution a sampled draft token was drawn from: every token with probability above
/// zero, ascending by id, with its probability (in f64; they sum to 1 up to rounding).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DraftDist {
    pub probs: Vec<(u32, f64)>,
}

impl DraftDist {
    /// The probability of `token` (0 for a token outside the distribution).
    pub fn prob(&self, token: u32) -> f64 {
        self.probs.binary_search_by_key(&token, |&(t, _)| t).map_or(0.0, |i| self.probs[i].1)
    }
}

/// What a device needs to draw one row's token exactly as a [`Sampler`] would (see
/// [`Sampler::device_row`]): the request's transforms, the uniform the sampler's next draw would
/// use, and two bitmaps over the row's ids (bit `i % 32` of word `i / 32`).
#[derive(Debug, Clone, PartialEq)]
pub struct RowSampling {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    /// Alternatives asked for (`logprobs`).
    pub logprobs: usize,
    /// The uniform in [0, 1) of the sampler's next draw, peeked: the stream advances only when
    /// the device reports that it used it ([`Sampler::device_drew`]).
    pub uniform: f64,
    /// The ids the repetition penalty applies to; empty when it applies to none.
    pub penalised: Vec<u32>,
    /// The ids a constraint allows; empty without a constraint.
    pub allowed: Vec<u32>,
}

impl RowSampling {
    /// What a device must give for this row, computed on the host: the constraint's mask (and
    /// its lowest allowed id at 0 when no allowed logit is above -inf, as the scheduler masks a
    /// row), then the [`Sampler`]'s rules with [`RowSampling::uniform`] as its one draw, over
    /// `logits` (used as scratch). Returns the token and whether the draw was used. The reference
    /// device samplers are checked against.
    pub fn draw_on_host(&self, logits: &mut [f32]) -> (Sampled, bool) {
        let bit = |bits: &[u32], i: usize| bits.get(i / 32).is_some_and(|w| w >> (i % 32) & 1 == 1);
        if !self.allowed.is_empty() {
            for (i, l) in logits.iter_mut().enumerate() {
                if !bit(&self.allowed, i) {
                    *l = f32::NEG_INFINITY;
                }
            }
            if !logits.iter().any(|&l| l > f32::NEG_INFINITY) {
                if let Some(first) = (0..logits.len()).find(|&i| bit(&self.allowed, i)) {
                    logits[first] = 0.0;
                }
            }
        }
        let history: Vec<u32> =
            (0..self.penalised.len() * 32).filter(|&i| bit(&self.penalised, i)).map(|i| i as u32).collect();
        let params = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            logprobs: Some(self.logprobs),
            ..SamplingParams::greedy()
        };
        let mut s = Sampler::new(&params, 0);
        s.fixed_uniform = Some(self.uniform);
        let sampled = s.sample(logits, &history);
        (sampled, s.fixed_used)
    }
}

/// Samples tokens for one request. Create one per request; it owns the request's RNG.
#[derive(Debug, Clone)]
pub struct Sampler {
    temperature: f32,
    top_k: usize,
    top_p: f32,
    min_p: f32,
    repetition_penalty: f32,
    logprobs: usize,
    rng: ChaCha20Rng,
    /// The seed `rng` started from (a draft model's stream is derived from it).
    seed: u64,
    /// Scratch: surviving candidates as (token, scaled logit), reused across calls.
    cand: Vec<(u32, f32)>,
    /// Scratch: one bit per vocabulary entry, marks tokens already penalised this call.
    seen: Vec<u64>,
    /// Scratch: the row before the repetition penalty changed it (kept only when it does).
    raw: Vec<f32>,
    /// Scratch: a draft distribution by token id (zero outside a rejection).
    q_dense: Vec<f64>,
    /// A uniform given from outside, used instead of the stream's next draw
    /// ([`RowSampling::draw_on_host`]), and whether a pick used it.
    fixed_uniform: Option<f64>,
    fixed_used: bool,
}

/// Total order on candidates: higher scaled logit first, then lower id. Scaled logits are never NaN.
fn by_logit_desc(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

impl Sampler {
    /// A sampler for `params`. Its RNG is seeded from `params.seed`, or from `fallback_seed` when the
    /// request has none (callers pass something per request, e.g. derived from the request id).
    pub fn new(params: &SamplingParams, fallback_seed: u64) -> Self {
        Sampler {
            temperature: params.temperature,
            top_k: params.top_k,
            top_p: params.top_p,
            min_p: params.min_p,
            repetition_penalty: params.repetition_penalty,
            logprobs: params.logprobs.unwrap_or(0),
            rng: ChaCha20Rng::seed_from_u64(params.seed.unwrap_or(fallback_seed)),
            seed: params.seed.unwrap_or(fallback_seed),
            cand: Vec::new(),
            seen: Vec::new(),
            raw: Vec::new(),
            q_dense: Vec::new(),
            fixed_uniform: None,
            fixed_used: false,
        }
    }

    /// The uniform of a pick's one draw: the stream's next, or the one given from outside.
    fn next_uniform(&mut self) -> f64 {
        match self.fixed_uniform {
            Some(u) => {
                self.fixed_used = true;
                u
            }
            None => uniform01(&mut self.rng),
        }
    }

    /// Samples one token from the raw vocabulary row `logits` (used as scratch: it is modified).
    /// `history` is the prompt plus the tokens generated so far, for the repetition penalty.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> Sampled {
        self.sample_by(logits, history, |s, l, fallback| s.pick(l, fallback))
    }

    /// Verifies a sampled draft token at one row: the token emitted there, which is the draft
    /// exactly when the draft was accepted. `draft` was drawn from `q` (the draft model's distribution, [`draft_distribution`]);
    /// the target's distribution `p` is this sampler's (repetition penalty, temperature, top-k,
    /// top-p, min-p over `logits`). The draft is accepted with probability `min(1, p(d)/q(d))`
    /// (one draw); otherwise a second draw picks from `max(p - q, 0)` normalised, which never
    /// yields the draft. The emitted token is then distributed exactly as `p`, whatever `q` is.
    /// Log-probabilities are reported as by [`Sampler::sample`]. A greedy sampler emits its
    /// argmax and accepts the draft when they are equal.
    pub fn sample_against_draft(
        &mut self,
        logits: &mut [f32],
        history: &[u32],
        draft: u32,
        q: &DraftDist,
    ) -> Sampled {
        self.sample_by(logits, history, |s, l, fallback| s.pick_against(l, fallback, draft, q))
    }

    /// [`Sampler::sample`]'s frame around a picking rule: odd logits made safe, the model's own
    /// log-probabilities, the repetition penalty; `pick` chooses from the penalised row.
    fn sample_by(
        &mut self,
        logits: &mut [f32],
        history: &[u32],
        pick: impl FnOnce(&mut Self, &[f32], u32) -> u32,
    ) -> Sampled {
        // The fallback for a row with nothing to sample is decided on the raw row.
        let raw_fallback = logits.iter().position(|x| !x.is_nan()).unwrap_or(0) as u32;
        make_safe(logits);
        // The model's own distribution, before any transform: what the log-probabilities report.
        let Some(log_z) = log_sum_exp(logits) else {
            return Sampled { token: raw_fallback, logprob: f32::NEG_INFINITY, top_logprobs: Vec::new() };
        };
        let top_logprobs = self.top_of(logits, log_z);
        let penalised = self.repetition_penalty != 1.0 && !history.is_empty();
        if penalised {
            self.raw.clear();
            self.raw.extend_from_slice(logits);
        }
        self.apply_repetition_penalty(logits, history);
        let token = pick(self, logits, raw_fallback);
        let raw_logit = if penalised { self.raw[token as usize] } else { logits[token as usize] };
        let logprob = (f64::from(raw_logit) - log_z) as f32;
        Sampled { token, logprob, top_logprobs }
    }

    /// What [`Sampler::pick`] and [`Sampler::pick_against`] share: `Err(token)` when the pick
    /// needs no draw (no finite logit: `raw_fallback`; greedy: the argmax), otherwise the
    /// candidates in `self.cand` and `Ok` with the total of their weights `e^s`.
    fn prepare(&mut self, logits: &[f32], raw_fallback: u32) -> Result<f64, u32> {
        let Some((argmax, max)) = argmax(logits) else {
            return Err(raw_fallback);
        };
        if self.temperature == 0.0 {
            return Err(argmax as u32);
        }
        candidates(&mut self.cand, logits, max, self.temperature, self.top_k, self.top_p, self.min_p);
        if self.cand.is_empty() {
            // Unreachable (the best token always survives), but never worth a panic.
            return Err(argmax as u32);
        }
        Ok(self.cand.iter().map(|&(_, s)| f64::from(s.exp())).sum())
    }

    /// The rejection rule of [`Sampler::sample_against_draft`] over the penalised row.
    fn pick_against(&mut self, logits: &[f32], raw_fallback: u32, draft: u32, q: &DraftDist) -> u32 {
        let total = match self.prepare(logits, raw_fallback) {
            Ok(total) => total,
            Err(token) => return token,
        };
        let first = self.cand[0].0;
        let p = |s: f32| f64::from(s.exp()) / total;
        let p_draft = self.cand.iter().find(|c| c.0 == draft).map_or(0.0, |c| p(c.1));
        let q_draft = q.prob(draft);
        // Accept with probability min(1, p/q): u·q < p.
        if q_draft > 0.0 && uniform01(&mut self.rng) * q_draft < p_draft {
            return draft;
        }
        // The residual max(p - q, 0) over the target's candidates (elsewhere p is 0), with q laid
        // out densely by token id in scratch (cleared again below).
        let dense = &mut self.q_dense;
        if dense.len() < logits.len() {
            dense.resize(logits.len(), 0.0);
        }
        for &(t, pr) in &q.probs {
            if let Some(x) = dense.get_mut(t as usize) {
                *x = pr;
            }
        }
        let q_of = |t: u32| dense[t as usize];
        let residual: f64 = self.cand.iter().map(|&(t, s)| (p(s) - q_of(t)).max(0.0)).sum();
        let token = if residual <= 0.0 {
            // p equals q up to rounding, so a rejection was rounding's doing: draw from p.
            let u = uniform01(&mut self.rng) * total;
            cumulative_pick(self.cand.iter().map(|&(t, s)| (t, f64::from(s.exp()))), u)
        } else {
            let u = uniform01(&mut self.rng) * residual;
            // Only tokens with a positive residual are reachable (after a rejection the draft's is 0).
            cumulative_pick(self.cand.iter().map(|&(t, s)| (t, (p(s) - q_of(t)).max(0.0))), u)
        }
        .unwrap_or(first);
        for &(t, _) in &q.probs {
            if let Some(x) = self.q_dense.get_mut(t as usize) {
                *x = 0.0;
            }
        }
        token
    }

    /// How a draft model should sample this request's drafts ([`DraftSampling`]): its
    /// temperature and filters, with a seed of its own derived from this sampler's; `None` for a
    /// greedy request.
    pub fn draft_sampling(&self) -> Option<DraftSampling> {
        (self.temperature > 0.0).then_some(DraftSampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed ^ DRAFT_STREAM,
        })
    }

    /// The `logprobs` most likely tokens of the raw row, with their log-probabilities.
    fn top_of(&mut self, logits: &[f32], log_z: f64) -> Vec<(u32, f32)> {
        top_k(logits, log_z, self.logprobs, &mut self.cand)
    }

    /// The token the request's sampling picks from the (penalised) row.
    fn pick(&mut self, logits: &[f32], raw_fallback: u32) -> u32 {
        let total = match self.prepare(logits, raw_fallback) {
            Ok(total) => total,
            Err(token) => return token,
        };
        let u = self.next_uniform() * total;
        let first = self.cand[0].0;
        cumulative_pick(self.cand.iter().map(|&(t, s)| (t, f64::from(s.exp()))), u).unwrap_or(first)
    }

    /// Whether this sampler's pick depends on nothing but the logits row's argmax and softmax
    /// (greedy, no repetition penalty, no alternatives asked for): then a backend may pick on
    /// its device ([`crate::backend::Backend::forward_greedy`]).
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature == 0.0 && self.repetition_penalty == 1.0 && self.logprobs == 0
    }

    /// This sampler's next token as a device draws it from a logits row of `vocab` ids: the
    /// transforms, the next uniform (peeked, not taken), and the ids of `history` the repetition
    /// penalty applies to. The caller adds a constraint's allowed ids.
    pub fn device_row(&self, history: &[u32], vocab: usize) -> RowSampling {
        let mut penalised = Vec::new();
        if self.repetition_penalty != 1.0 && !history.is_empty() {
            penalised = vec![0u32; vocab.div_ceil(32)];
            // Ids past the row cannot be penalised, as on the host.
            for &t in history.iter().filter(|&&t| (t as usize) < vocab) {
                penalised[t as usize / 32] |= 1 << (t % 32);
            }
        }
        RowSampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            logprobs: self.logprobs,
            uniform: uniform01(&mut self.rng.clone()),
            penalised,
            allowed: Vec::new(),
        }
    }

    /// Takes the draw a device made with [`RowSampling::uniform`], when it made one, so that the
    /// stream continues as if this sampler had drawn the token itself.
    pub fn device_drew(&mut self, drew: bool) {
        if drew {
            self.rng.next_u64();
        }
    }

    /// Advances the RNG past one token's draw without sampling (nothing when greedy). A decode
    /// worker continuing a sequence whose first token another process sampled with an identical
    /// sampler calls this once, so its later draws are the ones an in-process run would make.
    pub fn skip_draw(&mut self) {
        if self.temperature != 0.0 {
            self.rng.next_u64();
        }
    }

    /// Hugging Face semantics: once per distinct token in `history`, a positive logit is divided by
    /// the penalty and a negative one multiplied, so a penalty > 1 always makes the token less likely.
    fn apply_repetition_penalty(&mut self, logits: &mut [f32], history: &[u32]) {
        let p = self.repetition_penalty;
        if p == 1.0 || history.is_empty() {
            return;
        }
        let words = logits.len().div_ceil(64);
        if self.seen.len() < words {
            self.seen.resize(words, 0);
        }
        for &t in history {
            let i = t as usize;
            if i >= logits.len() {
                continue; // a foreign id cannot be penalised; ignoring it beats panicking
            }
            let (w, bit) = (i / 64, 1u64 << (i % 64));
            if self.seen[w] & bit == 0 {
                self.seen[w] |= bit;
                let l = &mut logits[i];
                *l = if *l < 0.0 { *l * p } else { *l / p };
            }
        }
        // Clear only the bits we set: O(history), not O(vocab).
        for &t in history {
            if let Some(w) = self.seen.get_mut(t as usize / 64) {
                *w = 0;
            }
        }
    }
}

/// Scores `token` against the raw logits row `row` (a prompt token against the position before
/// it): its log-probability under the model's own distribution (log-softmax of the row, NaN as
/// impossible) and the `k` most likely tokens with theirs, most likely first (ties → lower id).
/// An all-impossible row gives `-inf` and no alternatives.
pub fn score(row: &[f32], token: u32, k: usize) -> (f32, Vec<(u32, f32)>) {
    let clean = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x.min(f32::MAX) };
    let cleaned: Vec<f32> = row.iter().map(|&x| clean(x)).collect();
    let Some(log_z) = log_sum_exp(&cleaned) else {
        return (f32::NEG_INFINITY, Vec::new());
    };
    let lp = |l: f32| (f64::from(l) - log_z) as f32;
    let logprob = cleaned.get(token as usize).map_or(f32::NEG_INFINITY, |&l| lp(l));
    (logprob, top_k(&cleaned, log_z, k, &mut Vec::new()))
}

/// The `k` most likely tokens of `logits` (most likely first, ties → lower id) with their
/// log-probabilities (`log_z` is the row's log-sum-exp); `cand` is scratch.
fn top_k(logits: &[f32], log_z: f64, k: usize, cand: &mut Vec<(u32, f32)>) -> Vec<(u32, f32)> {
    let n = k.min(logits.len());
    if n == 0 {
        return Vec::new();
    }
    cand.clear();
    cand.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
    if n < cand.len() {
        cand.select_nth_unstable_by(n - 1, by_logit_desc);
    }
    cand[..n].sort_unstable_by(by_logit_desc);
    cand[..n].iter().map(|&(t, l)| (t, (f64::from(l) - log_z) as f32)).collect()
}

/// `ln Σ exp(l)` over a row (in f64, relative to its maximum); `None` when every entry is `-inf`.
/// The terms are summed 16 at a time where the CPU has AVX-512 ([`crate::vmath`]).
fn log_sum_exp(logits: &[f32]) -> Option<f64> {
    let (_, max) = argmax(logits)?;
    Some(f64::from(max) + crate::vmath::sum_exp_f64(logits, max).ln())
}

/// Index and value of the largest finite-or-`+max` logit, ties → lowest id; `None` when every entry
/// is `-inf`. NaN is never picked.
fn argmax(logits: &[f32]) -> Option<(usize, f32)> {
    let max = crate::vmath::max(logits);
    if max == f32::NEG_INFINITY {
        return None;
    }
    let i = logits.iter().position(|&l| l == max)?;
    Some((i, logits[i]))
}

/// The greedy token of a raw vocabulary row and its log-probability, exactly as a greedy
/// [`Sampler`] without repetition penalty picks it (`logits` is used as scratch).
pub fn greedy_pick(logits: &mut [f32]) -> (u32, f32) {
    let s = Sampler::new(&SamplingParams::greedy(), 0).sample(logits, &[]);
    (s.token, s.logprob)
}

/// NaN to `-inf` and `+inf` to `f32::MAX`, in place: `x - max` then stays finite, so an infinite
/// logit behaves as "certain", not as NaN.
fn make_safe(logits: &mut [f32]) {
    for x in logits.iter_mut() {
        if x.is_nan() {
            *x = f32::NEG_INFINITY;
        } else if *x == f32::INFINITY {
            *x = f32::MAX;
        }
    }
}

/// The candidates of a row whose largest logit is `max`: `(token, (l - max) / t)` for every logit
/// above `-inf`, then top-k, top-p and min-p ([`filter_candidates`]).
fn candidates(
    cand: &mut Vec<(u32, f32)>,
    logits: &[f32],
    max: f32,
    t: f32,
    top_k: usize,
    top_p: f32,
    min_p: f32,
) {
    // Scaled logits relative to the max: the best token is at 0, so exp() never overflows and
    // min-p becomes a fixed threshold. `+ 0.0` turns -0.0 into 0.0 so ties stay ties.
    // Divide rather than multiply by 1/T: for a subnormal T, 1/T is inf and 0 * inf is NaN.
    cand.clear();
    cand.extend(logits.iter().enumerate().filter_map(|(i, &l)| {
        let s = (l - max) / t + 0.0;
        (s > f32::NEG_INFINITY).then_some((i as u32, s))
    }));
    filter_candidates(cand, top_k, top_p, min_p);
}

/// The first token of `weights` (`(token, weight)`, weights `>= 0`), in order, whose cumulative
/// weight exceeds `u`; when rounding leaves `u` past the total, the last token of positive weight
/// (the first token when none has any); `None` for no tokens.
fn cumulative_pick(weights: impl IntoIterator<Item = (u32, f64)>, u: f64) -> Option<u32> {
    let mut acc = 0.0f64;
    let mut last = None;
    for (t, w) in weights {
        if w > 0.0 || last.is_none() {
            last = Some(t);
        }
        acc += w;
        if u < acc {
            return Some(t);
        }
    }
    last
}

/// A draft model's distribution over a raw vocabulary row (used as scratch) under `s`: NaN as
/// `-inf`, `+inf` as `f32::MAX`, then temperature, top-k, top-p and min-p as a request's sampler
/// applies them (no repetition penalty: any distribution the draft is really drawn from keeps
/// verification exact). Empty when every logit is `-inf`.
pub fn draft_distribution(logits: &mut [f32], s: &DraftSampling) -> DraftDist {
    make_safe(logits);
    let Some((_, max)) = argmax(logits) else { return DraftDist::default() };
    let mut cand = Vec::new();
    candidates(&mut cand, logits, max, s.temperature, s.top_k, s.top_p, s.min_p);
    let total: f64 = cand.iter().map(|&(_, x)| f64::from(x.exp())).sum();
    let mut probs: Vec<(u32, f64)> =
        cand.iter().map(|&(t, x)| (t, f64::from(x.exp()) / total)).filter(|&(_, p)| p > 0.0).collect();
    probs.sort_unstable_by_key(|&(t, _)| t);
    DraftDist { probs }
}

/// One token drawn from `dist` with one `u64` of `rng` (`None` for an empty distribution).
pub fn draw_from(dist: &DraftDist, rng: &mut ChaCha20Rng) -> Option<u32> {
    if dist.probs.is_empty() {
        return None;
    }
    let total: f64 = dist.probs.iter().map(|&(_, p)| p).sum();
    cumulative_pick(dist.probs.iter().copied(), uniform01(rng) * total)
}

/// A uniform in [0, 1) from exactly one `u64` draw (53 random bits).
fn uniform01(rng: &mut ChaCha20Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Applies top-k, top-p and min-p, in that order, to candidates holding scaled logits whose maximum
/// is 0. Leaves the survivors in `cand` (never empty if it was not). Avoids sorting the whole
/// vocabulary: top-k selects, top-p grows a selected prefix until it holds enough mass, min-p is a
/// threshold.
fn filter_candidates(cand: &mut Vec<(u32, f32)>, top_k: usize, top_p: f32, min_p: f32) {
    let mut sorted = false;
    if top_k > 0 && top_k < cand.len() {
        cand.select_nth_unstable_by(top_k - 1, by_logit_desc);
        cand.truncate(top_k);
        cand.sort_unstable_by(by_logit_desc);
        sorted = true;
    }
    if top_p < 1.0 && cand.len() > 1 {
        let total: f64 = cand.iter().map(|&(_, s)| f64::from(s.exp())).sum();
        let target = f64::from(top_p) * total;
        if !sorted {
            // Grow a selected prefix until it holds at least `target`; only that prefix is sorted.
            let mut k = 64usize;
            loop {
                if k >= cand.len() {
                    cand.sort_unstable_by(by_logit_desc);
                    break;
                }
                cand.select_nth_unstable_by(k - 1, by_logit_desc);
                let mass: f64 = cand[..k].iter().map(|&(_, s)| f64::from(s.exp())).sum();
                if mass >= target {
                    cand.truncate(k);
                    cand.sort_unstable_by(by_logit_desc);
                    break;
                }
                k = k.saturating_mul(4);
            }
        }
        // Smallest prefix reaching the target; at least one token. If rounding keeps the sum just
        // below the target, everything selected is kept.
        let mut acc = 0.0f64;
        let mut keep = cand.len();
        for (i, &(_, s)) in cand.iter().enumerate() {
            acc += f64::from(s.exp());
            if acc >= target {
                keep = i + 1;
                break;
            }
        }
        cand.truncate(keep);
    }
    if min_p > 0.0 {
        // p_i >= min_p * p_max  <=>  exp(s_i - s_max) >= min_p, and s_max = 0. The best token (s = 0)
        // always survives because min_p <= 1. Ratios are unchanged by top-p's renormalisation.
        cand.retain(|&(_, s)| s.exp() >= min_p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Reference for `filter_candidates`: full sort, then the textbook definitions.
    fn reference_filter(logits: &[f32], top_k: usize, top_p: f32, min_p: f32) -> Vec<u32> {
        let mut c: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
        c.sort_by(by_logit_desc);
        if top_k > 0 {
            c.truncate(top_k);
        }
        let z: f64 = c.iter().map(|&(_, s)| f64::from(s.exp())).sum();
        let mut acc = 0.0;
        let mut keep = c.len();
        for (i, &(_, s)) in c.iter().enumerate() {
            acc += f64::from(s.exp());
            if acc >= f64::from(top_p) * z {
                keep = i + 1;
                break;
            }
        }
        if top_p < 1.0 {
            c.truncate(keep);
        }
        c.retain(|&(_, s)| s.exp() >= min_p);
        let mut ids: Vec<u32> = c.iter().map(|&(t, _)| t).collect();
        ids.sort_unstable();
        ids
    }

    fn run_filter(logits: &[f32], top_k: usize, top_p: f32, min_p: f32) -> Vec<u32> {
        let mut c: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
        filter_candidates(&mut c, top_k, top_p, min_p);
        let mut ids: Vec<u32> = c.iter().map(|&(t, _)| t).collect();
        ids.sort_unstable();
        ids
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        #[test]
        fn filter_matches_reference(
            raw in prop::collection::vec(-8.0f32..8.0, 1..400),
            top_k in 0usize..50,
            top_p in 0.05f32..1.0,
            min_p in 0.0f32..0.5,
        ) {
            // Quantise so ties occur and so the two summation orders cannot disagree by rounding.
            let max = raw.iter().fold(f32::NEG_INFINITY, |a, &b| a.max((b * 4.0).round() / 4.0));
            let logits: Vec<f32> = raw.iter().map(|&x| (x * 4.0).round() / 4.0 - max).collect();
            let got = run_filter(&logits, top_k, top_p, min_p);
            prop_assert!(!got.is_empty());
            prop_assert_eq!(got, reference_filter(&logits, top_k, top_p, min_p));
        }
    }

    #[test]
    fn top_p_on_large_vocab_selects_only_a_prefix() {
        // A vocabulary of 150k with a peaked head: the grown-prefix path must agree with a full sort.
        let n = 150_000;
        let logits: Vec<f32> = (0..n).map(|i| -((i * 7919 % n) as f32) / 2000.0).collect();
        for top_p in [0.1f32, 0.5, 0.9, 0.99] {
            assert_eq!(run_filter(&logits, 0, top_p, 0.0), reference_filter(&logits, 0, top_p, 0.0));
        }
    }

    #[test]
    fn a_device_draw_advances_the_stream_only_when_used() {
        let params = SamplingParams { temperature: 1.0, seed: Some(9), ..SamplingParams::greedy() };
        let (mut host, mut dev) = (Sampler::new(&params, 0), Sampler::new(&params, 0));
        let row = vec![0.5f32, 1.0, -0.2, 0.1, 0.9];
        // A draw the device did not use leaves the stream where it was.
        let first = dev.device_row(&[], row.len()).uniform;
        dev.device_drew(false);
        assert_eq!(dev.device_row(&[], row.len()).uniform, first);
        // A used one moves it as a host draw does: the tokens that follow are the host's.
        for _ in 0..8 {
            let (got, drew) = dev.device_row(&[], row.len()).draw_on_host(&mut row.clone());
            assert!(drew);
            dev.device_drew(drew);
            assert_eq!(got, host.sample(&mut row.clone(), &[]));
        }
        // A row with nothing finite draws nothing, on the device as on the host.
        let (_, drew) = dev.device_row(&[], 3).draw_on_host(&mut [f32::NEG_INFINITY; 3]);
        assert!(!drew);
    }

    #[test]
    fn repetition_penalty_bits_are_cleared_between_calls() {
        let params = SamplingParams { repetition_penalty: 2.0, ..SamplingParams::greedy() };
        let mut s = Sampler::new(&params, 0);
        let mut a = vec![4.0f32, 1.0, -1.0];
        s.sample(&mut a, &[0, 0, 2]);
        assert_eq!(a, vec![2.0, 1.0, -2.0]);
        // A fresh row with a different history: token 0 must not count as seen any more.
        let mut b = vec![4.0f32, 1.0, -1.0];
        s.sample(&mut b, &[1]);
        assert_eq!(b, vec![4.0, 0.5, -1.0]);
    }
}
