//! Speculative decoding in process: output identical with and without speculation (greedy, and
//! seeded sampling), for every depth, adaptive or fixed, under chunked prefill, preemption and
//! many concurrent sequences; allocator invariants at every step; nothing staged between steps.

mod sched_common;
use sched_common::{fixture, fixture_engine, greedy, run, Setup};

use tandem_engine::backend::BackendOptions;
use tandem_engine::cpu::CpuBackend;
use tandem_engine::loader::load_model;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SchedulerOptions, SeqEvent};
use tandem_engine::spec::ngram::NgramDrafter;
use tandem_engine::spec::SpecOptions;

const ROOMY: Setup = Setup { model: "llama-gqa", blocks: 256, block_size: 4, budget: 256, max_num_seqs: 64 };

fn engine(s: &Setup, spec: Option<SpecOptions>) -> Engine {
    let eng = fixture_engine(s);
    match spec {
        None => eng,
        Some(o) => eng.with_speculation(Box::new(NgramDrafter::new(o.ngram_min, o.ngram_max)), o).unwrap(),
    }
}

/// Prompts with repeats in them (so the n-gram drafter finds matches) and without.
fn prompts(n: usize) -> Vec<Vec<u32>> {
    (0..n)
        .map(|i| {
            let i = i as u32;
            let base: Vec<u32> = (0..6 + i % 5).map(|j| 3 + (i * 37 + j * 11) % 400).collect();
            match i % 3 {
                0 => base.iter().chain(&base).chain(&base[..3]).copied().collect(),
                1 => base,
                _ => (0..20 + i).map(|j| 5 + (j % 4)).collect(),
            }
        })
        .collect()
}

#[test]
fn greedy_output_is_identical_for_every_depth_adaptive_or_not() {
    let ps = prompts(6);
    let params = vec![greedy(40); ps.len()];
    let (want, _) = run(&mut engine(&ROOMY, None), &ps, &params);
    let mut accepted_any = false;
    for k in 1..=8 {
        for adaptive in [false, true] {
            let o = SpecOptions { max_draft: k, adaptive, ngram_min: 1, ngram_max: 3, sampled_drafts: false };
            let (got, (proposed, accepted)) = run(&mut engine(&ROOMY, Some(o)), &ps, &params);
            assert_eq!(got, want, "k = {k}, adaptive = {adaptive}");
            assert!(proposed > 0, "k = {k}, adaptive = {adaptive}: nothing was proposed");
            accepted_any |= accepted > 0;
        }
    }
    assert!(accepted_any, "no draft was ever accepted: the test would not notice a broken commit");
}

#[test]
fn greedy_output_is_identical_under_chunked_prefill_and_preemption() {
    let ps = prompts(8);
    let params = vec![greedy(48); ps.len()];
    let (want, _) = run(&mut engine(&ROOMY, None), &ps, &params);
    // A 7-token budget chunks every prompt; 24 blocks of 4 tokens cannot hold 8 sequences of up to
    // 80 tokens, so sequences are preempted and recomputed.
    let tight = Setup { blocks: 24, budget: 7, ..ROOMY };
    for adaptive in [false, true] {
        let o = SpecOptions { max_draft: 4, adaptive, ngram_min: 1, ngram_max: 3, sampled_drafts: false };
        let (got, (proposed, _)) = run(&mut engine(&tight, Some(o)), &ps, &params);
        assert_eq!(got, want, "adaptive = {adaptive}");
        assert!(proposed > 0);
    }
}

#[test]
fn thirty_two_concurrent_sequences_decode_identically() {
    let ps = prompts(32);
    let params = vec![greedy(24); ps.len()];
    let (want, _) = run(&mut engine(&ROOMY, None), &ps, &params);
    let o = SpecOptions { max_draft: 4, adaptive: true, ngram_min: 1, ngram_max: 3, sampled_drafts: false };
    let (got, (proposed, _)) = run(&mut engine(&ROOMY, Some(o)), &ps, &params);
    assert_eq!(got, want);
    assert!(proposed > 0);
}

#[test]
fn seeded_sampling_gives_the_same_tokens_with_and_without_speculation() {
    let ps = prompts(6);
    let params: Vec<SamplingParams> = (0..ps.len())
        .map(|i| SamplingParams {
            temperature: 0.8,
            top_k: if i % 2 == 0 { 20 } else { 0 },
            top_p: 0.95,
            min_p: 0.02,
            repetition_penalty: if i % 3 == 0 { 1.2 } else { 1.0 },
            seed: Some(1000 + i as u64),
            max_tokens: 40,
            ignore_eos: true,
            ..Default::default()
        })
        .collect();
    let (want, _) = run(&mut engine(&ROOMY, None), &ps, &params);
    let o = SpecOptions { max_draft: 5, adaptive: false, ngram_min: 1, ngram_max: 3, sampled_drafts: false };
    let (got, (proposed, accepted)) = run(&mut engine(&ROOMY, Some(o)), &ps, &params);
    assert_eq!(got, want);
    assert!(proposed > 0 && accepted > 0, "proposed {proposed}, accepted {accepted}");
}

#[test]
fn allocator_invariants_hold_through_an_adaptive_run_with_cancellations() {
    let ps = prompts(16);
    let mut eng = engine(
        &Setup { blocks: 48, budget: 24, ..ROOMY },
        Some(SpecOptions { max_draft: 6, adaptive: true, ngram_min: 1, ngram_max: 3, sampled_drafts: false }),
    );
    let ids: Vec<_> = ps.iter().map(|p| eng.add_request(p.clone(), greedy(30)).unwrap()).collect();
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut cancelled = 0;
    let mut steps = 0;
    while eng.num_active() > 0 {
        steps += 1;
        assert!(steps < 5_000, "no progress");
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        if rng.is_multiple_of(5) {
            let id = ids[(rng >> 8) as usize % ids.len()];
            if eng.generated_len(id).is_some() {
                eng.cancel(id).unwrap();
                cancelled += 1;
                eng.check_kv().unwrap();
            }
        }
        for ev in eng.step().unwrap() {
            if let SeqEvent::Failed { error, .. } = ev {
                panic!("{error}");
            }
        }
        eng.check_kv().unwrap();
        assert!(!eng.backend().staged_pending());
    }
    assert!(cancelled >= 3, "only {cancelled} cancellations");
    assert!(eng.spec_stats().verifications > 0);
    let s = eng.kv_stats();
    assert_eq!(s.free, s.total);
}

#[test]
fn smollm2_greedy_output_is_identical_with_ngram_speculation() {
    let Some(path) = tandem_test_support::default_model_for_test(
        "smollm2_greedy_output_is_identical_with_ngram_speculation",
    ) else {
        return;
    };
    let build = |spec: bool| {
        let m = load_model(&path).unwrap();
        let opts =
            BackendOptions { num_blocks: 64, block_size: 16, max_batch_tokens: 256, ..Default::default() };
        let be = CpuBackend::new(m.config, m.weights, opts).unwrap();
        let eng = Engine::new(
            Box::new(be),
            m.tokenizer,
            SchedulerOptions { max_batch_tokens: 256, max_num_seqs: 8 },
        );
        if spec {
            let o = SpecOptions::default();
            eng.with_speculation(Box::new(NgramDrafter::new(o.ngram_min, o.ngram_max)), o).unwrap()
        } else {
            eng
        }
    };
    let mut plain = build(false);
    let texts = [
        "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
        "List the numbers from one to twenty, separated by commas.",
    ];
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| plain.tokenizer().encode(t, true).unwrap()).collect();
    let params = vec![greedy(32); prompts.len()];
    let (want, _) = run(&mut plain, &prompts, &params);
    let (got, (proposed, accepted)) = run(&mut build(true), &prompts, &params);
    assert_eq!(got, want);
    assert!(proposed > 0 && accepted > 0, "proposed {proposed}, accepted {accepted}");
}

/// Proposes the model's EOS token followed by two more tokens, every time.
struct EosDrafter(u32);

impl tandem_engine::spec::Drafter for EosDrafter {
    fn method(&self) -> tandem_engine::spec::SpecMethod {
        tandem_engine::spec::SpecMethod::Ngram
    }
    fn describe(&self) -> String {
        "eos".into()
    }
    fn propose(
        &mut self,
        asks: &[tandem_engine::spec::DraftAsk<'_>],
    ) -> tandem_engine::Result<Vec<Vec<u32>>> {
        Ok(asks.iter().map(|_| vec![self.0, 5, 6]).collect())
    }
    fn forget(&mut self, _seq: u64) {}
}

#[test]
fn drafts_past_a_token_that_ends_the_sequence_are_not_verified() {
    for ignore_eos in [false, true] {
        let m = load_model(&fixture("llama-gqa")).unwrap();
        let eos = m.tokenizer.eos_token_ids()[0];
        let mut eng = engine(&ROOMY, None)
            .with_speculation(
                Box::new(EosDrafter(eos)),
                SpecOptions { adaptive: false, ..Default::default() },
            )
            .unwrap();
        let params = SamplingParams { max_tokens: 12, ignore_eos, ..SamplingParams::greedy() };
        let (out, _) = run(&mut eng, &[vec![3, 4, 5]], &[params]);
        let st = eng.spec_stats();
        assert!(st.verifications > 0);
        if ignore_eos {
            // EOS is an ordinary token then; only max_tokens trims the last drafts.
            assert!(st.proposed > 2 * st.verifications, "{st:?}, output {out:?}");
        } else {
            assert_eq!(st.proposed, st.verifications, "one draft (EOS) per pass: {st:?}, output {out:?}");
        }
    }
}

#[test]
fn every_reference_model_decodes_identically_with_ngram_speculation() {
    let ps = prompts(5);
    let params = vec![greedy(32); ps.len()];
    for model in ["llama-gqa", "llama3-rope-scaled", "mistral", "mistral-sliding", "qwen2-mqa", "qwen3"] {
        let setup = Setup { model, ..ROOMY };
        let (want, _) = run(&mut engine(&setup, None), &ps, &params);
        for (k, adaptive) in [(1, false), (4, true), (8, false)] {
            let o = SpecOptions { max_draft: k, adaptive, ngram_min: 1, ngram_max: 3, sampled_drafts: false };
            let (got, (proposed, _)) = run(&mut engine(&setup, Some(o)), &ps, &params);
            assert_eq!(got, want, "{model}, k = {k}, adaptive = {adaptive}");
            assert!(proposed > 0, "{model}: nothing proposed");
        }
    }
}

/// Stop strings, stop tokens and `max_tokens` end a sequence at the same token, with the same
/// text and reason, whether or not the token came out of an accepted run of drafts.
#[test]
fn stop_rules_cut_an_accepted_run_at_the_right_token() {
    let prompt: Vec<u32> = (0..6).flat_map(|_| [7u32, 8, 9]).collect();
    let finish = |eng: &mut Engine, params: SamplingParams| {
        let g = eng.generate(prompt.clone(), params, |_| {}).unwrap();
        (g.token_ids, g.text, g.finish_reason)
    };
    let o = SpecOptions { max_draft: 8, adaptive: false, ngram_min: 1, ngram_max: 3, sampled_drafts: false };
    let mut plain = engine(&ROOMY, None);
    let (free_run, text, _) = finish(&mut plain, greedy(40));
    assert!(text.chars().count() > 12, "too little text to cut: {text:?}");
    // A stop string from the middle of the text, a stop token from the middle of the run, and
    // max_tokens, each alone.
    let mid: String = text.chars().skip(text.chars().count() / 2).take(3).collect();
    let cases = [
        SamplingParams { stop_strings: vec![mid.clone()], ..greedy(40) },
        SamplingParams { stop_token_ids: vec![free_run[free_run.len() / 2]], ..greedy(40) },
        greedy(17),
    ];
    let mut spec = engine(&ROOMY, Some(o));
    for params in cases {
        let want = finish(&mut plain, params.clone());
        let got = finish(&mut spec, params.clone());
        assert_eq!(got, want, "{params:?}");
        assert!(want.0.len() < 40, "the rule never fired: {params:?}");
    }
    assert!(spec.spec_stats().accepted > 0, "no run of drafts was accepted");
    let s = spec.kv_stats();
    assert_eq!(s.free, s.total);
}

/// Remembers every sequence it drafted for and (deliberately) never forgets one.
struct LeakyDrafter(std::collections::BTreeSet<u64>);

impl tandem_engine::spec::Drafter for LeakyDrafter {
    fn method(&self) -> tandem_engine::spec::SpecMethod {
        tandem_engine::spec::SpecMethod::Draft
    }
    fn describe(&self) -> String {
        "leaky".into()
    }
    fn propose(
        &mut self,
        asks: &[tandem_engine::spec::DraftAsk<'_>],
    ) -> tandem_engine::Result<Vec<Vec<u32>>> {
        self.0.extend(asks.iter().map(|a| a.seq));
        Ok(asks.iter().map(|_| vec![5]).collect())
    }
    fn forget(&mut self, _seq: u64) {}
    fn check_kv(&self, idle: bool) -> tandem_engine::Result<()> {
        if idle && !self.0.is_empty() {
            return Err(tandem_engine::EngineError::Internal(format!(
                "{} sequences still held",
                self.0.len()
            )));
        }
        Ok(())
    }
}

#[test]
fn the_engines_quiescence_check_covers_the_drafters_memory() {
    let mut eng = engine(&ROOMY, None)
        .with_speculation(Box::new(LeakyDrafter(Default::default())), SpecOptions::default())
        .unwrap();
    let id = eng.add_request(vec![3, 4, 5], greedy(6)).unwrap();
    let mut result = Ok(Vec::new());
    while eng.num_active() > 0 && result.is_ok() {
        result = eng.step();
    }
    assert!(eng.generated_len(id).is_none(), "the request should have finished");
    let err = result.err().or_else(|| eng.check_kv().err()).expect("the leak went unnoticed");
    assert!(err.to_string().contains("still held"), "{err}");
}
