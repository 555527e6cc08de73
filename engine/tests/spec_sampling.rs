//! Speculative sampling keeps the target's distribution, checked statistically: many seeded runs
//! of verification (a fixed deterministic draft, as our drafters propose) against a small
//! vocabulary, whose two-token outcomes a chi-square test compares with the target's own joint
//! distribution. Also: with the same seed, speculative sampling yields the very tokens plain
//! sampling does.
//!
//! The verifier sees what a real verification pass computes: row `i` holds the target's logits
//! after the prompt *and the first `i` draft tokens*, computed before anything is drawn. A row past
//! a rejected draft token is conditioned on a token the sequence does not have, so a verifier that
//! draws from it (one that does not stop at the first mismatch) breaks both checks; two tests
//! run such a verifier, and a biased one, to show that the checks catch them.
//!
//! Sampled drafts (a draft model's tokens drawn from its own distribution q) are verified by
//! accepting each with probability min(1, p/q): the same chi-square check, the acceptance rate
//! theory gives (Σ min(p, q)), a draft drawn from p itself always accepted, and a verifier that
//! takes every sampled draft as it is caught.

use rand_chacha::rand_core::SeedableRng;
use rand_chacha::ChaCha20Rng;
use tandem_engine::sampler::{draft_distribution, draw_from, Sampler, SamplingParams};
use tandem_engine::spec::verify::{verify, Drawn, Outcome};
use tandem_engine::spec::{DraftDist, DraftSampling};

const V: usize = 6;
const TRIALS: u64 = 30_000;
/// Chi-square critical value for 35 degrees of freedom at p = 0.001.
const CRITICAL_35: f64 = 66.62;

/// The target's logits for the next token after `history` (only the last token matters).
fn logits(history: &[u32]) -> Vec<f32> {
    let last = history.last().copied().unwrap_or(0) as usize;
    (0..V).map(|t| ((t * 7 + last * 3) % 11) as f32 * 0.35 - (t as f32) * 0.1).collect()
}

fn params(seed: u64, top_k: usize) -> SamplingParams {
    SamplingParams { temperature: 0.9, top_k, seed: Some(seed), ..Default::default() }
}

/// The distribution the sampler draws from for `history`: softmax(logits / T), top-k applied.
fn target(history: &[u32], top_k: usize) -> Vec<f64> {
    let l = logits(history);
    let mut idx: Vec<usize> = (0..V).collect();
    idx.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
    let keep = if top_k == 0 { V } else { top_k };
    let mut p = [0.0; V];
    for &i in &idx[..keep] {
        p[i] = (f64::from(l[i]) / 0.9).exp();
    }
    let z: f64 = p.iter().sum();
    p.iter().map(|x| x / z).collect()
}

/// The rows one verification pass computes for `draft` after `history`: row `i` is the target's
/// logits after `history` and `draft[..i]`, for `i` in `0..=draft.len()`.
fn pass(history: &[u32], draft: &[u32]) -> Vec<Vec<f32>> {
    (0..=draft.len()).map(|i| logits(&[history, &draft[..i]].concat())).collect()
}

/// A verifier: walks the rows of a pass through `next`, as `verify` does.
type Verifier = fn(&[u32], &mut dyn FnMut(usize) -> Result<Drawn, ()>) -> Result<Outcome, ()>;

fn real_verifier(draft: &[u32], next: &mut dyn FnMut(usize) -> Result<Drawn, ()>) -> Result<Outcome, ()> {
    verify(draft, next)
}

/// A broken verifier that does not stop at the first mismatch: it draws from every row.
fn verifier_without_stop(
    draft: &[u32],
    next: &mut dyn FnMut(usize) -> Result<Drawn, ()>,
) -> Result<Outcome, ()> {
    let mut accepted = 0;
    for i in 0..=draft.len() {
        let drawn = next(i)?;
        accepted += usize::from(draft.get(i) == Some(&drawn.token));
        if drawn.stop {
            return Ok(Outcome { emitted: i + 1, accepted });
        }
    }
    Ok(Outcome { emitted: draft.len() + 1, accepted })
}

/// Verifies `draft` after `history` with `verifier`, drawing each token with `s` from the pass's
/// rows; the emitted tokens are appended to `history`.
fn verify_pass(verifier: Verifier, s: &mut Sampler, history: &mut Vec<u32>, draft: &[u32]) {
    let rows = pass(history, draft);
    verifier(draft, &mut |i| {
        let t = s.sample(&mut rows[i].clone(), history).token;
        history.push(t);
        Ok(Drawn { token: t, stop: false })
    })
    .unwrap();
}

/// The first two tokens after `prompt` with the draft verified speculatively (then, if verification
/// emitted only one token, one more plainly sampled).
fn speculative_pair(
    verifier: Verifier,
    seed: u64,
    top_k: usize,
    prompt: &[u32],
    draft: &[u32],
) -> (u32, u32) {
    let mut s = Sampler::new(&params(seed, top_k), 0);
    let mut history = prompt.to_vec();
    verify_pass(verifier, &mut s, &mut history, draft);
    while history.len() < prompt.len() + 2 {
        let t = s.sample(&mut logits(&history), &history).token;
        history.push(t);
    }
    (history[prompt.len()], history[prompt.len() + 1])
}

/// A broken verifier: accepts the draft with probability p(d), but on rejection draws again from
/// the full target distribution (which may give the draft a second chance) instead of from the
/// target with the draft excluded.
fn biased_pair(seed: u64, top_k: usize, prompt: &[u32], draft: &[u32]) -> (u32, u32) {
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut uniform = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut history = prompt.to_vec();
    let draw = |p: &[f64], u: f64| {
        let mut acc = 0.0;
        for (t, &q) in p.iter().enumerate() {
            acc += q;
            if u < acc {
                return t as u32;
            }
        }
        (V - 1) as u32
    };
    for &d in draft {
        let p = target(&history, top_k);
        let t = if uniform() < p[d as usize] { d } else { draw(&p, uniform()) };
        history.push(t);
        if t != d || history.len() >= prompt.len() + 2 {
            break;
        }
    }
    while history.len() < prompt.len() + 2 {
        let p = target(&history, top_k);
        history.push(draw(&p, uniform()));
    }
    (history[prompt.len()], history[prompt.len() + 1])
}

/// Chi-square statistic of the observed two-token outcomes against the target's joint law.
fn chi_square(pairs: impl Iterator<Item = (u32, u32)>, prompt: &[u32], top_k: usize) -> f64 {
    let mut observed = [[0u64; V]; V];
    for (a, b) in pairs {
        observed[a as usize][b as usize] += 1;
    }
    let p1 = target(prompt, top_k);
    let mut chi = 0.0;
    for a in 0..V {
        let mut h = prompt.to_vec();
        h.push(a as u32);
        let p2 = target(&h, top_k);
        for b in 0..V {
            let expected = TRIALS as f64 * p1[a] * p2[b];
            let o = observed[a][b] as f64;
            if expected == 0.0 {
                assert_eq!(o, 0.0, "outcome ({a}, {b}) has probability 0 but was drawn");
                continue;
            }
            chi += (o - expected).powi(2) / expected;
        }
    }
    chi
}

#[test]
fn speculative_sampling_matches_the_target_distribution() {
    let prompt = [2u32];
    // Drafts of likely, unlikely and impossible-under-top-k tokens, one and two long.
    for (draft, top_k) in [(vec![1u32, 3], 0), (vec![4], 0), (vec![0, 0], 3), (vec![5, 2], 3)] {
        let chi = chi_square(
            (0..TRIALS).map(|s| speculative_pair(real_verifier, s, top_k, &prompt, &draft)),
            &prompt,
            top_k,
        );
        assert!(chi < CRITICAL_35, "draft {draft:?}, top-k {top_k}: chi-square {chi:.1} >= {CRITICAL_35}");
    }
}

#[test]
fn the_test_detects_a_biased_verifier() {
    let prompt = [2u32];
    let draft = [1u32, 3];
    let chi = chi_square((0..TRIALS).map(|s| biased_pair(s, 0, &prompt, &draft)), &prompt, 0);
    assert!(chi > CRITICAL_35, "a biased verifier passed: chi-square {chi:.1}");
}

#[test]
fn the_test_detects_a_verifier_that_does_not_stop_at_a_mismatch() {
    let prompt = [2u32];
    let draft = [1u32, 3];
    let chi = chi_square(
        (0..TRIALS).map(|s| speculative_pair(verifier_without_stop, s, 0, &prompt, &draft)),
        &prompt,
        0,
    );
    assert!(chi > CRITICAL_35, "a verifier that does not stop at a mismatch passed: chi-square {chi:.1}");
    let differ = (0..200).filter(|&seed| !same_tokens_as_plain(verifier_without_stop, seed)).count();
    assert!(differ > 0, "a verifier that does not stop at a mismatch drew the plain run's tokens every time");
}

/// Whether speculative sampling with `verifier` and `seed` draws the tokens plain sampling does,
/// with drafts that agree with the plain run for a while and then (one seed in three) differ.
fn same_tokens_as_plain(verifier: Verifier, seed: u64) -> bool {
    let prompt = [3u32, 1];
    let mut plain = Sampler::new(&params(seed, 0), 0);
    let mut h = prompt.to_vec();
    for _ in 0..6 {
        let t = plain.sample(&mut logits(&h), &h).token;
        h.push(t);
    }
    let draft: Vec<u32> =
        h[2..5].iter().map(|&t| if seed % 3 == 0 { (t + 1) % V as u32 } else { t }).collect();
    let mut s = Sampler::new(&params(seed, 0), 0);
    let mut got = prompt.to_vec();
    while got.len() < h.len() {
        let d: Vec<u32> = draft.iter().copied().take(h.len() - got.len() - 1).collect();
        verify_pass(verifier, &mut s, &mut got, &d);
    }
    got[..h.len()] == h[..]
}

#[test]
fn seeded_speculative_sampling_draws_the_same_tokens_as_plain_sampling() {
    for seed in 0..200 {
        assert!(same_tokens_as_plain(real_verifier, seed), "seed {seed}");
    }
}

// ---- Sampled drafts: a draft drawn from q, accepted with probability min(1, p/q) ---------------

/// A draft model's logits after `history`: related to the target's but not equal.
fn draft_logits(history: &[u32]) -> Vec<f32> {
    let last = history.last().copied().unwrap_or(0) as usize;
    (0..V).map(|t| ((t * 5 + last) % 7) as f32 * 0.4 + if t == 4 { 0.8 } else { 0.0 }).collect()
}

fn draft_rule(seed: u64, temperature: f32, top_k: usize) -> DraftSampling {
    DraftSampling { temperature, top_k, top_p: 1.0, min_p: 0.0, seed }
}

/// `k` drafts sampled after `history` from `logits_of` under `rule`, each with the distribution it
/// was drawn from (as the draft model computes them, one round per token).
fn sampled_drafts(
    history: &[u32],
    k: usize,
    rule: &DraftSampling,
    logits_of: fn(&[u32]) -> Vec<f32>,
    rng: &mut ChaCha20Rng,
) -> (Vec<u32>, Vec<DraftDist>) {
    let (mut drafts, mut dists) = (Vec::new(), Vec::new());
    let mut h = history.to_vec();
    for _ in 0..k {
        let q = draft_distribution(&mut logits_of(&h), rule);
        let d = draw_from(&q, rng).expect("a non-empty draft distribution");
        drafts.push(d);
        dists.push(q);
        h.push(d);
    }
    (drafts, dists)
}

/// The first two tokens after `prompt` with `k` sampled drafts verified by rejection sampling as
/// the scheduler does (the draft rows against their draft distributions, the bonus row plainly),
/// then plain sampling up to two tokens. Also whether the first draft was accepted.
fn sampled_draft_pair(
    seed: u64,
    top_k: usize,
    prompt: &[u32],
    k: usize,
    rule: DraftSampling,
    logits_of: fn(&[u32]) -> Vec<f32>,
    accept_all: bool,
) -> ((u32, u32), bool) {
    let mut s = Sampler::new(&params(seed, top_k), 0);
    let mut rng = ChaCha20Rng::seed_from_u64(rule.seed ^ seed);
    let (drafts, dists) = sampled_drafts(prompt, k, &rule, logits_of, &mut rng);
    let rows = pass(prompt, &drafts);
    let mut history = prompt.to_vec();
    let out = verify::<()>(&drafts, |i| {
        let mut row = rows[i].clone();
        let t = match dists.get(i) {
            // A broken verifier for the check below: every sampled draft is taken as it is.
            Some(_) if accept_all => drafts[i],
            Some(q) => s.sample_against_draft(&mut row, &history, drafts[i], q).token,
            None => s.sample(&mut row, &history).token,
        };
        history.push(t);
        Ok(Drawn { token: t, stop: history.len() >= prompt.len() + 2 })
    })
    .unwrap();
    while history.len() < prompt.len() + 2 {
        let t = s.sample(&mut logits(&history), &history).token;
        history.push(t);
    }
    ((history[prompt.len()], history[prompt.len() + 1]), out.accepted > 0)
}

#[test]
fn sampled_drafts_keep_the_target_distribution_and_accept_at_the_rate_theory_gives() {
    let prompt = [2u32];
    // Draft rules hotter and colder than the target's, a top-k the target does not share, and
    // drafts of one and two tokens.
    let cases = [(0, 1, draft_rule(1, 1.3, 0)), (0, 2, draft_rule(2, 0.6, 0)), (3, 2, draft_rule(3, 1.0, 2))];
    for (top_k, k, rule) in cases {
        let runs: Vec<((u32, u32), bool)> = (0..TRIALS)
            .map(|seed| sampled_draft_pair(seed, top_k, &prompt, k, rule, draft_logits, false))
            .collect();
        let chi = chi_square(runs.iter().map(|r| r.0), &prompt, top_k);
        assert!(
            chi < CRITICAL_35,
            "top-k {top_k}, {k} drafts, {rule:?}: chi-square {chi:.1} >= {CRITICAL_35}"
        );
        // The first draft is accepted with probability Σ_t min(p(t), q(t)).
        let p = target(&prompt, top_k);
        let q = draft_distribution(&mut draft_logits(&prompt), &rule);
        let rate: f64 = (0..V).map(|t| p[t].min(q.prob(t as u32))).sum();
        let got = runs.iter().filter(|r| r.1).count() as f64 / TRIALS as f64;
        let sigma = (rate * (1.0 - rate) / TRIALS as f64).sqrt();
        assert!((got - rate).abs() < 4.0 * sigma, "{rule:?}: acceptance {got:.4}, theory {rate:.4}");
    }
}

#[test]
fn the_test_detects_sampled_drafts_taken_without_the_ratio() {
    let prompt = [2u32];
    let chi = chi_square(
        (0..TRIALS)
            .map(|s| sampled_draft_pair(s, 0, &prompt, 2, draft_rule(1, 1.3, 0), draft_logits, true).0),
        &prompt,
        0,
    );
    assert!(chi > CRITICAL_35, "drafts accepted without the ratio passed: chi-square {chi:.1}");
}

#[test]
fn a_draft_sampled_from_the_targets_own_distribution_is_always_accepted() {
    // q = p exactly (the same logits under the same rule), so min(1, p/q) = 1 at every draft.
    let prompt = [2u32];
    for top_k in [0, 3] {
        let rule = draft_rule(9, 0.9, top_k);
        for seed in 0..2_000 {
            let mut s = Sampler::new(&params(seed, top_k), 0);
            let mut rng = ChaCha20Rng::seed_from_u64(seed);
            let (drafts, dists) = sampled_drafts(&prompt, 3, &rule, logits, &mut rng);
            let rows = pass(&prompt, &drafts);
            let mut history = prompt.to_vec();
            let out = verify::<()>(&drafts, |i| {
                let t = match dists.get(i) {
                    Some(q) => s.sample_against_draft(&mut rows[i].clone(), &history, drafts[i], q).token,
                    None => s.sample(&mut rows[i].clone(), &history).token,
                };
                history.push(t);
                Ok(Drawn { token: t, stop: false })
            })
            .unwrap();
            assert_eq!(out, Outcome { emitted: 4, accepted: 3 }, "seed {seed}, top-k {top_k}");
        }
    }
}
