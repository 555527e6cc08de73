//! Scoring a prompt (`prompt_logprobs`) on the tiny fixture models: every prompt token after the
//! first gets the log-probability the model gives it at the position before it, with the most
//! likely alternatives there. The reference is the engine's own generation: the first token of a
//! request whose prompt ends at that position is drawn from the same distribution, so its
//! alternatives (and, for a prompt made of greedy tokens, its log-probability) must match.
//! Chunked prefill, a cached prompt, a prefill-only request and a preempted one all score the
//! same.

mod sched_common;
use sched_common::{drain, fixture_engine, Setup};

use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SeqEvent};

const SMALL_BUDGET: Setup =
    Setup { model: "llama-gqa", blocks: 64, block_size: 8, budget: 8, max_num_seqs: 8 };
const ROOMY: Setup = Setup { model: "llama-gqa", blocks: 64, block_size: 8, budget: 512, max_num_seqs: 8 };

type Scores = (Vec<f32>, Vec<Vec<(u32, f32)>>);
/// A generated token: (id, logprob, alternatives).
type Generated = (u32, f32, Vec<(u32, f32)>);

/// Runs `prompt` with `params` to its end; returns the prompt scores and the generated
/// (token, logprob, alternatives).
fn run(e: &mut Engine, prompt: &[u32], params: SamplingParams) -> (Option<Scores>, Vec<Generated>) {
    let id = e.add_request(prompt.to_vec(), params).expect("request");
    let mut scores = None;
    let mut tokens = Vec::new();
    for ev in drain(e) {
        match ev {
            SeqEvent::PromptLogprobs { seq, logprobs, top_logprobs } if seq == id => {
                assert!(tokens.is_empty(), "the scores come before the first token");
                assert!(scores.is_none(), "the prompt is scored once");
                scores = Some((logprobs, top_logprobs));
            }
            SeqEvent::Token { seq, token, logprob, top_logprobs } if seq == id => {
                tokens.push((token, logprob, top_logprobs))
            }
            _ => {}
        }
    }
    (scores, tokens)
}

fn scoring(k: usize, max_tokens: usize) -> SamplingParams {
    SamplingParams { prompt_logprobs: Some(k), max_tokens, ignore_eos: true, ..SamplingParams::greedy() }
}

fn close(a: f32, b: f32) -> bool {
    (a - b).abs() <= 1e-4 * (1.0 + a.abs())
}

/// Scores equal up to float rounding: the same positions computed in other chunks read earlier
/// positions' K/V back from the cache (stored in the pool's dtype) instead of using them as computed.
fn assert_same_scores(got: &Scores, want: &Scores) {
    let close = |a: f32, b: f32| (a - b).abs() <= 2e-3 * (1.0 + a.abs());
    assert_eq!((got.0.len(), got.1.len()), (want.0.len(), want.1.len()));
    for (j, (g, w)) in got.0.iter().zip(&want.0).enumerate() {
        assert!(close(*g, *w), "position {j}: {g} vs {w}");
    }
    for (j, (g, w)) in got.1.iter().zip(&want.1).enumerate() {
        let ids = |v: &[(u32, f32)]| v.iter().map(|t| t.0).collect::<Vec<_>>();
        assert_eq!(ids(g), ids(w), "position {j}");
        assert!(g.iter().zip(w).all(|(a, b)| close(a.1, b.1)), "position {j}: {g:?} vs {w:?}");
    }
}

/// A prompt whose tail is the model's own greedy continuation of `head`, and those tokens'
/// logprobs.
fn greedy_prompt(e: &mut Engine, head: &[u32], extra: usize) -> (Vec<u32>, Vec<f32>) {
    let (_, out) =
        run(e, head, SamplingParams { max_tokens: extra, ignore_eos: true, ..SamplingParams::greedy() });
    let mut prompt = head.to_vec();
    prompt.extend(out.iter().map(|t| t.0));
    (prompt, out.iter().map(|t| t.1).collect())
}

#[test]
fn every_prompt_token_is_scored_under_the_models_own_distribution() {
    let mut reference = fixture_engine(&ROOMY);
    let head: Vec<u32> = (3..10).collect();
    let (prompt, greedy_lps) = greedy_prompt(&mut reference, &head, 14);
    for setup in [SMALL_BUDGET, ROOMY] {
        let mut e = fixture_engine(&setup);
        let (scores, tokens) = run(&mut e, &prompt, scoring(5, 2));
        let (lps, tops) = scores.expect("the prompt was scored");
        assert_eq!(lps.len(), prompt.len() - 1);
        assert_eq!(tops.len(), prompt.len() - 1);
        assert_eq!(tokens.len(), 2, "scoring changes nothing of the generation");
        for j in 1..prompt.len() {
            // The first token of a request ending at position j - 1 comes from the same row.
            let (_, first) =
                run(&mut reference, &prompt[..j], SamplingParams { logprobs: Some(5), ..scoring(0, 1) });
            let want = &first[0].2;
            let got = &tops[j - 1];
            assert_eq!(got.len(), 5);
            for (g, w) in got.iter().zip(want) {
                assert!(g.0 == w.0 && close(g.1, w.1), "position {}: {got:?} vs {want:?}", j - 1);
            }
            assert!(lps[j - 1] <= 0.0 && lps[j - 1] >= got[4].1 || !got.iter().any(|t| t.0 == prompt[j]));
            if j >= head.len() {
                // A greedy token: the most likely there, with the logprob its generation reported.
                assert_eq!(got[0].0, prompt[j], "position {}", j - 1);
                assert!(close(lps[j - 1], greedy_lps[j - head.len()]), "position {}", j - 1);
            }
        }
    }
}

#[test]
fn a_cached_prompt_is_still_scored_whole_and_a_prefill_only_request_scores_too() {
    let prompt: Vec<u32> = (20..60).collect();
    let mut plain = fixture_engine(&ROOMY);
    let (want, _) = run(&mut plain, &prompt, scoring(3, 1));
    let want = want.unwrap();

    let mut cached = fixture_engine(&ROOMY).with_prefix_cache("fixture/llama-gqa");
    for _ in 0..2 {
        let (got, _) = run(
            &mut cached,
            &prompt,
            SamplingParams { max_tokens: 1, ignore_eos: true, ..SamplingParams::greedy() },
        );
        assert!(got.is_none(), "nothing asked, nothing scored");
    }
    let (got, _) = run(&mut cached, &prompt, scoring(3, 1));
    // A cached prompt is computed again to be scored (same chunking: the same numbers).
    assert_eq!(got.unwrap(), want);

    // Prefill-only: the scores come just before Prefilled.
    let mut p = fixture_engine(&SMALL_BUDGET);
    let seq = p.add_prefill_request(prompt.clone(), scoring(3, 4)).unwrap();
    let events = drain(&mut p);
    match &events[..] {
        [SeqEvent::PromptLogprobs { seq: a, logprobs, top_logprobs }, SeqEvent::Prefilled { seq: b, .. }] => {
            assert_eq!((*a, *b), (seq, seq));
            assert_same_scores(&(logprobs.clone(), top_logprobs.clone()), &want);
        }
        other => panic!("unexpected events: {other:?}"),
    }
    p.release_prefilled(seq).unwrap();

    // Asking for more alternatives than allowed is refused, naming the field.
    let e = plain.add_request(prompt.clone(), scoring(21, 1)).unwrap_err().to_string();
    assert!(e.contains("prompt_logprobs"), "{e}");
}

#[test]
fn a_preempted_scoring_request_reports_its_scores_once() {
    // Two long prompts in a pool too small for both to grow: one is preempted and recomputed.
    let tiny = Setup { model: "llama-gqa", blocks: 10, block_size: 8, budget: 16, max_num_seqs: 8 };
    let prompt_a: Vec<u32> = (30..62).collect();
    let prompt_b: Vec<u32> = (100..132).collect();
    let mut reference = fixture_engine(&ROOMY);
    let (want_a, _) = run(&mut reference, &prompt_a, scoring(2, 1));
    let mut e = fixture_engine(&tiny);
    let a = e.add_request(prompt_a.clone(), scoring(2, 30)).unwrap();
    let _b = e
        .add_request(
            prompt_b.clone(),
            SamplingParams { max_tokens: 30, ignore_eos: true, ..SamplingParams::greedy() },
        )
        .unwrap();
    let scored: Vec<_> = drain(&mut e)
        .into_iter()
        .filter_map(|ev| match ev {
            SeqEvent::PromptLogprobs { seq, logprobs, top_logprobs } if seq == a => {
                Some((logprobs, top_logprobs))
            }
            _ => None,
        })
        .collect();
    assert_eq!(scored.len(), 1, "scored once");
    assert_same_scores(&scored[0], &want_a.unwrap());
}

#[test]
fn a_scoring_request_in_the_queue_does_not_stop_cache_lookups_behind_it() {
    let cached_prompt: Vec<u32> = (200..248).collect();
    let mut e = fixture_engine(&ROOMY).with_prefix_cache("fixture/llama-gqa");
    // One token: it ends in the step that computed its prompt, and its blocks stay cached.
    run(
        &mut e,
        &cached_prompt,
        SamplingParams { max_tokens: 1, ignore_eos: true, ..SamplingParams::greedy() },
    );
    assert!(e.prefix_stats().cached_blocks >= 5, "{:?}", e.prefix_stats());
    let before = e.prefix_stats().hit_tokens;
    let scored = e.add_request((300..340).collect(), scoring(1, 1)).unwrap();
    let plain = e
        .add_request(
            cached_prompt.clone(),
            SamplingParams { max_tokens: 1, ignore_eos: true, ..SamplingParams::greedy() },
        )
        .unwrap();
    let events = drain(&mut e);
    assert!(events.iter().any(|ev| matches!(ev, SeqEvent::PromptLogprobs { seq, .. } if *seq == scored)));
    assert!(events.iter().any(|ev| matches!(ev, SeqEvent::Finished { seq, .. } if *seq == plain)));
    let after = e.prefix_stats().hit_tokens;
    assert!(
        after >= before + 40,
        "the request behind the scoring one hit the cache: {before} -> {after}, {:?}",
        e.prefix_stats()
    );
}
