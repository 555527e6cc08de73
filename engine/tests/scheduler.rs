//! Scheduler liveness and fairness under tight limits: tiny pools, one-token budgets and
//! chunked prefill must still finish every request with exactly its solo greedy output, and
//! leave every block free.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use tandem_engine::backend::BackendOptions;
use tandem_engine::cpu::CpuBackend;
use tandem_engine::loader::load_model;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::cost::MIN_PREFILL_CHUNK;
use tandem_engine::scheduler::{Engine, SchedulerOptions, SeqEvent};

fn engine(blocks: usize, block_size: usize, budget: usize, max_num_seqs: usize) -> Engine {
    let m = load_model(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/llama-gqa"))
        .unwrap();
    let opts =
        BackendOptions { num_blocks: blocks, block_size, max_batch_tokens: budget, ..Default::default() };
    let be = CpuBackend::new(m.config, m.weights, opts).unwrap();
    Engine::new(Box::new(be), m.tokenizer, SchedulerOptions { max_batch_tokens: budget, max_num_seqs })
}

fn params(n: usize) -> SamplingParams {
    SamplingParams { max_tokens: n, ignore_eos: true, ..SamplingParams::greedy() }
}

/// Runs all prompts concurrently; returns each one's tokens. Fails on any stall.
fn run_all(eng: &mut Engine, prompts: &[Vec<u32>], new_tokens: usize) -> Vec<Vec<u32>> {
    let ids: Vec<_> =
        prompts.iter().map(|p| eng.add_request(p.clone(), params(new_tokens)).unwrap()).collect();
    let mut out: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut steps = 0;
    while eng.num_active() > 0 {
        steps += 1;
        assert!(steps < 5_000, "no progress: {} sequences still active", eng.num_active());
        for ev in eng.step().unwrap() {
            match ev {
                SeqEvent::Token { seq, token, .. } => out.entry(seq).or_default().push(token),
                SeqEvent::Failed { error, .. } => panic!("{error}"),
                SeqEvent::Finished { .. } => {}
                SeqEvent::Prefilled { .. } | SeqEvent::PromptLogprobs { .. } => {
                    panic!("no prefill-only or scoring requests here")
                }
            }
        }
        eng.check_kv().unwrap();
    }
    let s = eng.kv_stats();
    assert_eq!(s.free, s.total);
    ids.iter().map(|id| out.remove(id).unwrap_or_default()).collect()
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        (0..10).map(|i| 3 + i * 7).collect(),
        (0..10).map(|i| 200 + i * 3).collect(),
        vec![5, 6, 7],
        (1..30).collect(),
    ]
}

fn solo(new_tokens: usize) -> Vec<Vec<u32>> {
    let mut eng = engine(64, 16, 512, 16);
    prompts().iter().map(|p| run_all(&mut eng, std::slice::from_ref(p), new_tokens).remove(0)).collect()
}

#[test]
fn tiny_pool_with_chunked_prefill_does_not_deadlock() {
    // 6 blocks of 4 tokens, 4-token steps: two 10-token prompts plus 20 new tokens each cannot
    // both be resident; the scheduler must preempt rather than wait forever. A sequence cannot
    // outgrow the pool (24 tokens), so each ends at length 24 with 14 new tokens.
    let want = solo(20);
    let mut eng = engine(6, 4, 4, 16);
    let got = run_all(&mut eng, &prompts()[..2], 20);
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.as_slice(), &w[..14]);
    }
}

#[test]
fn one_token_budget_and_single_slot_still_finish_everything() {
    let want = solo(12);
    for (budget, max_seqs) in [(1, 16), (3, 1), (5, 2)] {
        let mut eng = engine(40, 2, budget, max_seqs);
        assert_eq!(run_all(&mut eng, &prompts(), 12), want, "budget {budget}, max_num_seqs {max_seqs}");
    }
}

#[test]
fn cancelling_at_any_step_frees_everything() {
    for cancel_at in 0..12 {
        let mut eng = engine(12, 4, 6, 16);
        let ids: Vec<_> = prompts().iter().map(|p| eng.add_request(p.clone(), params(10)).unwrap()).collect();
        for step in 0..200 {
            if step == cancel_at {
                for &id in ids.iter().step_by(2) {
                    eng.cancel(id).unwrap();
                }
            }
            if eng.num_active() == 0 {
                break;
            }
            eng.step().unwrap();
            eng.check_kv().unwrap();
        }
        assert_eq!(eng.num_active(), 0, "cancel at step {cancel_at}: stalled");
        let s = eng.kv_stats();
        assert_eq!(s.free, s.total, "cancel at step {cancel_at}: leaked blocks");
    }
}

/// A long prompt arriving while others decode: with an inter-token target, each step that
/// decodes computes at most the budget's prompt tokens ([`MIN_PREFILL_CHUNK`] with a target of
/// zero), and every output is still the solo greedy output.
#[test]
fn an_itl_target_chunks_prompts_beside_decodes_and_changes_no_output() {
    let long: Vec<u32> = (0..150).map(|i| 7 + (i * 13) % 250).collect();
    let mut all = prompts();
    all.push(long.clone());
    let mut solo_eng = engine(128, 4, 512, 16);
    let want: Vec<Vec<u32>> =
        all.iter().map(|p| run_all(&mut solo_eng, std::slice::from_ref(p), 12).remove(0)).collect();

    let mut eng = engine(128, 4, 256, 16).with_itl_target(Duration::ZERO, false).unwrap();
    let (cost, target) = eng.step_cost().expect("the engine has a latency budget");
    assert_eq!(target, Duration::ZERO);
    assert!(cost.per_prefill_ms > 0.0 && cost.per_decode_ms > 0.0 && cost.fixed_ms >= 0.0, "{cost:?}");

    let mut out: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut ids: Vec<u64> =
        all[..4].iter().map(|p| eng.add_request(p.clone(), params(12)).unwrap()).collect();
    let mut limited_steps = 0;
    for step in 0..5_000 {
        if step == 3 {
            ids.push(eng.add_request(long.clone(), params(12)).unwrap());
        }
        if eng.num_active() == 0 {
            break;
        }
        let before = eng.load();
        let events = eng.step().unwrap();
        let after = eng.load();
        let computed = before.waiting_prompt_tokens - after.waiting_prompt_tokens;
        let decoded = events.iter().filter(|e| matches!(e, SeqEvent::Token { .. })).count();
        if decoded > 0 && before.waiting_prompt_tokens >= 100 {
            limited_steps += 1;
            assert!(computed <= MIN_PREFILL_CHUNK, "step {step}: {computed} prompt tokens beside decodes");
        }
        for ev in events {
            match ev {
                SeqEvent::Token { seq, token, .. } => out.entry(seq).or_default().push(token),
                SeqEvent::Failed { error, .. } => panic!("{error}"),
                _ => {}
            }
        }
        eng.check_kv().unwrap();
    }
    assert_eq!(eng.num_active(), 0, "stalled");
    assert!(limited_steps >= 2, "the long prompt never ran beside decodes ({limited_steps} steps)");
    let got: Vec<Vec<u32>> = ids.iter().map(|id| out.remove(id).unwrap_or_default()).collect();
    assert_eq!(got, want);
    let s = eng.kv_stats();
    assert_eq!(s.free, s.total);
}

#[test]
fn the_step_cost_is_calibrated_before_requests_only_and_needs_a_pool() {
    let mut eng = engine(40, 4, 64, 16);
    eng.add_request(vec![1, 2, 3], params(2)).unwrap();
    let e = eng.calibrate_step_cost().expect_err("a sequence is live");
    assert!(e.to_string().contains("before the engine takes requests"), "{e}");

    // One block cannot hold a prompt and a decode token: no budget, and the engine still works.
    let mut tiny = engine(1, 4, 64, 16).with_itl_target(Duration::from_millis(50), false).unwrap();
    assert!(tiny.step_cost().is_none());
    let e = tiny.calibrate_step_cost().unwrap_err();
    assert!(e.to_string().contains("at least 2 free KV blocks"), "{e}");
    assert_eq!(run_all(&mut tiny, &[vec![1, 2]], 1).len(), 1);

    // A token budget smaller than a block, and a reservation outstanding.
    let eng = engine(40, 16, 4, 16).with_itl_target(Duration::from_millis(50), false).unwrap();
    assert!(eng.step_cost().is_some(), "a 4-token budget with 16-token blocks calibrates");
    let mut eng2 = engine(40, 4, 64, 16);
    eng2.reserve(8).unwrap();
    let e = eng2.calibrate_step_cost().expect_err("a reservation is outstanding");
    assert!(e.to_string().contains("before the engine takes requests"), "{e}");
    assert_eq!(eng.kv_stats().free, eng.kv_stats().total);

    // Calibrating leaves the pool as it found it.
    let mut eng = engine(40, 4, 64, 16);
    eng.calibrate_step_cost().unwrap();
    let s = eng.kv_stats();
    assert_eq!(s.free, s.total);
    eng.check_kv().unwrap();
}

/// Pacing waits only while sequences decode and a reservation is outstanding (a prompt for this
/// engine is being computed elsewhere), and never longer than the target after the last step.
#[test]
fn pacing_waits_only_for_prompts_computed_elsewhere() {
    let target = Duration::from_secs(30);
    let mut eng = engine(40, 4, 64, 16).with_itl_target(target, true).unwrap();
    assert_eq!(eng.pace_until(), None, "nothing ran yet");
    eng.add_request(vec![1, 2, 3], params(20)).unwrap();
    let t0 = std::time::Instant::now();
    eng.step().unwrap();
    assert_eq!(eng.pace_until(), None, "no reservation: decode at full speed");
    let (res, _) = eng.reserve(8).unwrap();
    let until = eng.pace_until().expect("a reservation is outstanding while a sequence decodes");
    assert!(until > t0 && until <= std::time::Instant::now() + target, "{until:?}");
    eng.release_reservation(res).unwrap();
    assert_eq!(eng.pace_until(), None);

    let mut unpaced = engine(40, 4, 64, 16).with_itl_target(target, false).unwrap();
    unpaced.add_request(vec![1, 2, 3], params(20)).unwrap();
    unpaced.step().unwrap();
    unpaced.reserve(8).unwrap();
    assert_eq!(unpaced.pace_until(), None, "pacing is off");
}
