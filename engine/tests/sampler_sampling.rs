//! Behaviour of `Sampler`: greedy, seeding, the filters, the repetition penalty, odd logits and the
//! empirical distribution of seeded draws.

use tandem_engine::sampler::{Sampler, SamplingParams};

fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams { seed: Some(1234), ..SamplingParams::default() };
    f(&mut p);
    p
}

/// Deterministic pseudo-random logits (a small LCG) so tests need no RNG of their own.
fn pseudo_logits(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect()
}

fn softmax(logits: &[f32], temperature: f32) -> Vec<f64> {
    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f64> = logits.iter().map(|&l| (f64::from(l - m) / f64::from(temperature)).exp()).collect();
    let z: f64 = w.iter().sum();
    w.into_iter().map(|x| x / z).collect()
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn draw(sampler: &mut Sampler, logits: &[f32], history: &[u32]) -> u32 {
    sampler.sample(&mut logits.to_vec(), history).token
}

fn counts(p: &SamplingParams, logits: &[f32], draws: usize) -> Vec<usize> {
    let mut s = Sampler::new(p, 0);
    let mut c = vec![0usize; logits.len()];
    for _ in 0..draws {
        c[draw(&mut s, logits, &[]) as usize] += 1;
    }
    c
}

/// Pearson's chi-square statistic of observed counts against expected probabilities (zero-probability
/// bins must be empty).
fn chi_square(observed: &[usize], expected: &[f64]) -> f64 {
    let n: usize = observed.iter().sum();
    observed
        .iter()
        .zip(expected)
        .map(|(&o, &p)| {
            if p == 0.0 {
                assert_eq!(o, 0, "a token with probability 0 was drawn");
                0.0
            } else {
                let e = p * n as f64;
                (o as f64 - e).powi(2) / e
            }
        })
        .sum()
}

#[test]
fn greedy_is_argmax_with_ties_to_lowest_id() {
    let mut s = Sampler::new(&SamplingParams::greedy(), 0);
    for seed in 0..20 {
        let logits = pseudo_logits(500, seed, 10.0);
        assert_eq!(draw(&mut s, &logits, &[]), argmax(&logits));
    }
    let tied = [0.5f32, 3.0, -1.0, 3.0, 3.0];
    assert_eq!(draw(&mut s, &tied, &[]), 1);
}

#[test]
fn greedy_logprob_is_temperature_one_log_softmax() {
    let p = SamplingParams { logprobs: Some(3), ..SamplingParams::greedy() };
    let mut s = Sampler::new(&p, 0);
    let logits = pseudo_logits(100, 7, 6.0);
    let out = s.sample(&mut logits.clone(), &[]);
    let probs = softmax(&logits, 1.0);
    assert!((f64::from(out.logprob) - probs[out.token as usize].ln()).abs() < 1e-4);
    assert_eq!(out.top_logprobs.len(), 3);
    assert_eq!(out.top_logprobs[0].0, out.token);
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    for (k, &(t, lp)) in out.top_logprobs.iter().enumerate() {
        assert_eq!(t as usize, order[k]);
        assert!((f64::from(lp) - probs[t as usize].ln()).abs() < 1e-4);
    }
}

#[test]
fn same_seed_same_tokens_and_different_seeds_differ() {
    let flat = vec![0.0f32; 1000];
    let run = |seed: u64| {
        let mut s = Sampler::new(&params(|p| p.seed = Some(seed)), 0);
        (0..64).map(|_| draw(&mut s, &flat, &[])).collect::<Vec<u32>>()
    };
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));
    // Without a request seed the caller's fallback seed is used, and it matters.
    let fallback = |f: u64| {
        let mut s = Sampler::new(&params(|p| p.seed = None), f);
        (0..64).map(|_| draw(&mut s, &flat, &[])).collect::<Vec<u32>>()
    };
    assert_eq!(fallback(42), run(42));
    assert_ne!(fallback(42), fallback(7));
}

#[test]
fn top_k_one_and_tiny_top_p_are_greedy() {
    let mut k1 = Sampler::new(&params(|p| p.top_k = 1), 0);
    let mut p_tiny = Sampler::new(&params(|p| p.top_p = 1e-6), 0);
    let mut min_p_one = Sampler::new(&params(|p| p.min_p = 1.0), 0);
    for seed in 0..50 {
        let logits = pseudo_logits(2000, seed, 4.0);
        let want = argmax(&logits);
        let out = k1.sample(&mut logits.clone(), &[]);
        assert_eq!(out.token, want);
        // The model's own probability of the token, not the filtered distribution's 1.
        let lp = softmax(&logits, 1.0)[want as usize].ln();
        assert!((f64::from(out.logprob) - lp).abs() < 1e-4, "{} vs {lp}", out.logprob);
        assert_eq!(draw(&mut p_tiny, &logits, &[]), want);
        assert_eq!(draw(&mut min_p_one, &logits, &[]), want);
    }
}

#[test]
fn sampled_frequencies_match_softmax() {
    // Seeded, so the statistic is a fixed number; the bound is chi-square(7 dof) at p = 0.001.
    let logits = [1.0f32, 0.2, -0.5, 2.0, 0.0, -2.0, 1.5, 0.7];
    for temperature in [0.7f32, 1.0, 1.8] {
        let p = params(|p| p.temperature = temperature);
        let c = counts(&p, &logits, 20_000);
        let stat = chi_square(&c, &softmax(&logits, temperature));
        assert!(stat < 24.3, "temperature {temperature}: chi-square {stat}, counts {c:?}");
    }
}

#[test]
fn top_k_frequencies_match_renormalised_softmax() {
    let logits = [1.0f32, 0.2, -0.5, 2.0, 0.0, -2.0, 1.5, 0.7];
    let c = counts(&params(|p| p.top_k = 3), &logits, 20_000);
    let top3 = [0usize, 3, 6];
    let kept: Vec<f32> = top3.iter().map(|&i| logits[i]).collect();
    let sm = softmax(&kept, 1.0);
    let mut expected = vec![0.0; logits.len()];
    for (k, &i) in top3.iter().enumerate() {
        expected[i] = sm[k];
    }
    let stat = chi_square(&c, &expected);
    assert!(stat < 13.8, "chi-square(2 dof) {stat}, counts {c:?}");
}

#[test]
fn top_p_keeps_smallest_set_reaching_the_mass() {
    // Probabilities 0.5, 0.3, 0.15, 0.05: top-p 0.75 keeps the first two.
    let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
    let c = counts(&params(|p| p.top_p = 0.75), &logits, 10_000);
    let stat = chi_square(&c, &[0.625, 0.375, 0.0, 0.0]);
    assert!(stat < 10.8, "chi-square(1 dof) {stat}, counts {c:?}");
    // 0.85 needs the third token as well.
    let c = counts(&params(|p| p.top_p = 0.85), &logits, 10_000);
    assert!(c[2] > 0 && c[3] == 0, "{c:?}");
}

#[test]
fn min_p_drops_tokens_below_fraction_of_best() {
    // p_max = 0.5, min-p 0.4 → threshold 0.2: tokens 2 (0.15) and 3 (0.05) go.
    let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
    let p = params(|p| {
        p.min_p = 0.4;
        p.logprobs = Some(4);
    });
    let mut s = Sampler::new(&p, 0);
    let out = s.sample(&mut logits.clone(), &[]);
    // The alternatives are the model's: all four, with their own probabilities, filtered or not.
    let want: Vec<(u32, f32)> =
        [0.5f32, 0.3, 0.15, 0.05].iter().enumerate().map(|(i, p)| (i as u32, p.ln())).collect();
    assert_eq!(out.top_logprobs.len(), 4, "{:?}", out.top_logprobs);
    for ((t, lp), (wt, wlp)) in out.top_logprobs.iter().zip(&want) {
        assert_eq!(t, wt);
        assert!((lp - wlp).abs() < 1e-5, "{:?}", out.top_logprobs);
    }
    let c = counts(&p, &logits, 10_000);
    assert!(chi_square(&c, &[0.625, 0.375, 0.0, 0.0]) < 10.8, "{c:?}");
}

#[test]
fn logprob_is_the_models_own_whatever_the_sampling() {
    let logits = [2.0f32, 1.0, 0.0, -1.0];
    let p = params(|p| {
        p.top_k = 2;
        p.temperature = 0.5;
        p.logprobs = Some(3);
    });
    let mut s = Sampler::new(&p, 0);
    let own = softmax(&logits, 1.0);
    for _ in 0..50 {
        let out = s.sample(&mut logits.to_vec(), &[]);
        assert!(out.token < 2, "top-k still decides what is drawn");
        assert!((f64::from(out.logprob) - own[out.token as usize].ln()).abs() < 1e-5);
        let ids: Vec<u32> = out.top_logprobs.iter().map(|&(t, _)| t).collect();
        assert_eq!(ids, [0, 1, 2], "the model's three most likely, most likely first");
        assert!(out.top_logprobs.iter().all(|&(t, lp)| (f64::from(lp) - own[t as usize].ln()).abs() < 1e-5));
    }
}

#[test]
fn repetition_penalty_lowers_positive_and_negative_logits() {
    let p = SamplingParams { repetition_penalty: 1.2, ..SamplingParams::greedy() };
    let mut s = Sampler::new(&p, 0);
    // Positive: 2.0 / 1.2 = 1.67 < 1.9.
    assert_eq!(draw(&mut s, &[2.0, 1.9, -3.0], &[]), 0);
    assert_eq!(draw(&mut s, &[2.0, 1.9, -3.0], &[0]), 1);
    // Negative: -1.0 * 1.2 = -1.2 < -1.1.
    assert_eq!(draw(&mut s, &[-1.0, -1.1, -3.0], &[]), 0);
    assert_eq!(draw(&mut s, &[-1.0, -1.1, -3.0], &[0]), 1);
    // Once per distinct token: three occurrences are penalised like one (2.0 / 1.2 > 1.6).
    let mut row = vec![2.0f32, 1.6, -3.0];
    assert_eq!(s.sample(&mut row, &[0, 0, 0]).token, 0);
    assert!((row[0] - 2.0 / 1.2).abs() < 1e-6);
    // Ids outside the vocabulary are ignored rather than crashing.
    assert_eq!(draw(&mut s, &[2.0, 1.9, -3.0], &[99, 1_000_000]), 0);
}

#[test]
fn the_repetition_penalty_picks_but_the_logprob_is_the_models() {
    let p = SamplingParams { repetition_penalty: 2.0, logprobs: Some(1), ..SamplingParams::greedy() };
    let mut s = Sampler::new(&p, 0);
    let out = s.sample(&mut [2.0, 1.5, 0.0], &[0]);
    assert_eq!(out.token, 1, "the penalty moved the pick");
    let own = softmax(&[2.0, 1.5, 0.0], 1.0);
    assert!((f64::from(out.logprob) - own[1].ln()).abs() < 1e-5);
    assert_eq!(out.top_logprobs[0].0, 0, "the model's favourite, penalised or not");
}

#[test]
fn nan_and_infinite_logits_do_not_crash() {
    let nan = f32::NAN;
    let mut s = Sampler::new(&params(|_| {}), 0);
    for _ in 0..200 {
        let t = draw(&mut s, &[nan, 0.0, nan, 0.5, f32::NEG_INFINITY], &[]);
        assert!(t == 1 || t == 3, "NaN or -inf token drawn: {t}");
    }
    // +inf dominates.
    assert_eq!(draw(&mut s, &[0.0, f32::INFINITY, 3.0], &[]), 1);
    // Nothing to sample: the first non-NaN raw entry, else token 0; logprob -inf.
    let out = s.sample(&mut [nan, f32::NEG_INFINITY, f32::NEG_INFINITY], &[]);
    assert_eq!(out.token, 1);
    assert_eq!(out.logprob, f32::NEG_INFINITY);
    assert_eq!(draw(&mut s, &[nan, nan], &[]), 0);
    assert_eq!(draw(&mut s, &[], &[]), 0);
    let mut g = Sampler::new(&SamplingParams::greedy(), 0);
    assert_eq!(draw(&mut g, &[nan, -1.0, nan, 2.0], &[]), 3);
    assert_eq!(draw(&mut g, &[nan, nan, nan], &[]), 0);
}

#[test]
fn extreme_temperatures_are_well_behaved() {
    let logits = pseudo_logits(300, 5, 8.0);
    // A subnormal temperature is as good as greedy.
    let own = softmax(&logits, 1.0);
    let mut cold = Sampler::new(&params(|p| p.temperature = 1e-45), 0);
    for _ in 0..20 {
        let out = cold.sample(&mut logits.clone(), &[]);
        assert_eq!(out.token, argmax(&logits));
        assert!((f64::from(out.logprob) - own[out.token as usize].ln()).abs() < 1e-4, "{}", out.logprob);
    }
    // A huge temperature flattens what is drawn, not the reported log-probabilities.
    let mut hot = Sampler::new(&params(|p| p.temperature = 1e30), 0);
    let mut tokens = std::collections::HashSet::new();
    for _ in 0..50 {
        let out = hot.sample(&mut logits.clone(), &[]);
        assert!(out.logprob.is_finite() && out.logprob <= 0.0, "{}", out.logprob);
        assert!((f64::from(out.logprob) - own[out.token as usize].ln()).abs() < 1e-3, "{}", out.logprob);
        tokens.insert(out.token);
    }
    assert!(tokens.len() > 20, "a huge temperature draws widely: {} tokens", tokens.len());
}

#[test]
fn large_vocab_with_all_filters_is_reproducible() {
    let logits = pseudo_logits(150_000, 99, 12.0);
    let p = params(|p| {
        p.temperature = 0.8;
        p.top_k = 40;
        p.top_p = 0.9;
        p.min_p = 0.05;
        p.repetition_penalty = 1.1;
        p.logprobs = Some(5);
    });
    let history: Vec<u32> = (0..300).map(|i| i * 431 % 150_000).collect();
    let run = || {
        let mut s = Sampler::new(&p, 0);
        (0..10).map(|_| s.sample(&mut logits.clone(), &history)).collect::<Vec<_>>()
    };
    let a = run();
    assert_eq!(a, run());
    // The candidates top-k can leave: the 40 best logits after the penalty (done by hand here).
    let mut penalised = logits.clone();
    for &t in &history {
        let l = logits[t as usize];
        penalised[t as usize] = if l < 0.0 { l * 1.1 } else { l / 1.1 };
    }
    let mut order: Vec<u32> = (0..150_000).collect();
    order.sort_by(|&x, &y| penalised[y as usize].total_cmp(&penalised[x as usize]));
    for out in &a {
        assert!(order[..40].contains(&out.token), "token {} is not in the top 40", out.token);
        assert!(out.top_logprobs.windows(2).all(|w| w[0].1 >= w[1].1));
        // The alternatives are the raw row's five best (before the penalty).
        let mut raw: Vec<u32> = (0..150_000).collect();
        raw.sort_by(|&x, &y| logits[y as usize].total_cmp(&logits[x as usize]).then(x.cmp(&y)));
        let ids: Vec<u32> = out.top_logprobs.iter().map(|&(t, _)| t).collect();
        assert_eq!(ids, raw[..5]);
        assert!(out.logprob <= 0.0);
        if let Some(&(_, lp)) = out.top_logprobs.iter().find(|(t, _)| *t == out.token) {
            assert_eq!(lp, out.logprob);
        } else {
            assert!(out.logprob <= out.top_logprobs[4].1);
        }
    }
}

/// The pick a backend makes for plain-greedy sequences (`greedy_pick`) must be the greedy
/// sampler's, including its conventions for NaN, infinities and ties.
#[test]
fn greedy_pick_matches_a_greedy_sampler() {
    let nan = f32::NAN;
    let rows: Vec<Vec<f32>> = vec![
        vec![0.5, 2.0, -1.0, 2.0],
        vec![nan, 1.0, f32::INFINITY, 3.0, f32::INFINITY],
        vec![f32::NEG_INFINITY, nan, f32::NEG_INFINITY],
        vec![nan, nan],
        vec![-3.0, -2.5, -2.5, -7.0],
    ];
    for (i, row) in rows.iter().enumerate() {
        let want = Sampler::new(&SamplingParams::greedy(), 9).sample(&mut row.clone(), &[]);
        let (token, logprob) = tandem_engine::sampler::greedy_pick(&mut row.clone());
        assert_eq!(token, want.token, "row {i}");
        assert!(logprob == want.logprob || (logprob.is_nan() && want.logprob.is_nan()), "row {i}: {logprob}");
    }
    assert_eq!(
        tandem_engine::sampler::greedy_pick(&mut [0.5, 2.0, -1.0, 2.0]).0,
        1,
        "ties go to the lowest id"
    );
    assert!(Sampler::new(&SamplingParams::greedy(), 0).is_plain_greedy());
    for p in [
        SamplingParams { repetition_penalty: 1.2, ..SamplingParams::greedy() },
        SamplingParams { logprobs: Some(2), ..SamplingParams::greedy() },
        SamplingParams { temperature: 0.7, ..Default::default() },
    ] {
        assert!(!Sampler::new(&p, 0).is_plain_greedy(), "{p:?}");
    }
}
