//! Speculative decoding with a draft model: output identical with and without it (greedy and
//! seeded sampling; a model drafting for itself and tiny models drafting for each other; depths 1
//! to 8, adaptive or fixed; chunked prefill, preemption and tiny draft pools), proposals equal to
//! the draft model's own greedy continuation whatever happened to the sequence in between,
//! incompatible vocabularies refused by name, and no draft block left behind.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

#[macro_use]
mod sched_common;
use sched_common::{fixture, greedy, run};

use tandem_engine::backend::{Backend, BackendOptions, SeqChunk};
use tandem_engine::cpu::CpuBackend;
use tandem_engine::loader::load_model;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SchedulerOptions};
use tandem_engine::spec::draft_model::{check_compatible, DraftModelDrafter};
use tandem_engine::spec::{DraftAsk, Drafter, SpecOptions};
use tandem_engine::tokenizer::Tokenizer;
use tandem_engine::EngineError;
use tandem_test_support::default_model_for_test;

const FIXTURES: [&str; 6] =
    ["llama-gqa", "llama3-rope-scaled", "mistral", "mistral-sliding", "qwen2-mqa", "qwen3"];

/// A KV pool and batch limit.
#[derive(Debug, Clone, Copy)]
struct Pool {
    blocks: usize,
    block_size: usize,
    budget: usize,
}

const ROOMY: Pool = Pool { blocks: 256, block_size: 4, budget: 256 };

fn backend(path: &Path, pool: Pool) -> (CpuBackend, Tokenizer) {
    let m = load_model(path).unwrap();
    let opts = BackendOptions {
        num_blocks: pool.blocks,
        block_size: pool.block_size,
        max_batch_tokens: pool.budget,
        threads: 1,
        ..Default::default()
    };
    (CpuBackend::new(m.config, m.weights, opts).unwrap(), m.tokenizer)
}

fn drafter(target: &Tokenizer, target_vocab: usize, draft: &Path, pool: Pool) -> DraftModelDrafter {
    let (be, tok) = backend(draft, pool);
    DraftModelDrafter::new(target, target_vocab, Box::new(be), &tok, draft.display().to_string()).unwrap()
}

/// An engine over `target`; with `spec`, the model at the given path drafts with the given pool.
fn engine(target: &Path, pool: Pool, spec: Option<(&Path, Pool, SpecOptions)>) -> Engine {
    let (be, tok) = backend(target, pool);
    let vocab = be.config().vocab_size;
    let eng = Engine::new(
        Box::new(be),
        tok.clone(),
        SchedulerOptions { max_batch_tokens: pool.budget, max_num_seqs: 64 },
    );
    match spec {
        None => eng,
        Some((draft, draft_pool, o)) => {
            eng.with_speculation(Box::new(drafter(&tok, vocab, draft, draft_pool)), o).unwrap()
        }
    }
}

fn spec(k: usize, adaptive: bool) -> SpecOptions {
    SpecOptions { max_draft: k, adaptive, ..Default::default() }
}

/// Prompts of assorted lengths, some repetitive.
fn prompts(n: usize) -> Vec<Vec<u32>> {
    (0..n as u32)
        .map(|i| {
            let len = 5 + (i * 7) % 19;
            if i % 4 == 3 {
                (0..len).map(|j| 10 + j % 3).collect()
            } else {
                (0..len).map(|j| 3 + (i * 53 + j * 29 + j * j) % 440).collect()
            }
        })
        .collect()
}

#[test]
fn a_model_drafting_for_itself_changes_nothing_and_is_almost_always_right() {
    let model = fixture("llama-gqa");
    let ps = prompts(6);
    let params = vec![greedy(32); ps.len()];
    let (want, _) = run(&mut engine(&model, ROOMY, None), &ps, &params);
    for (k, adaptive) in [(1, false), (1, true), (3, true), (8, false), (8, true)] {
        let mut eng = engine(&model, ROOMY, Some((&model, ROOMY, spec(k, adaptive))));
        let (got, (proposed, accepted)) = run(&mut eng, &ps, &params);
        assert_eq!(got, want, "k = {k}, adaptive = {adaptive}");
        assert!(proposed > 0, "k = {k}, adaptive = {adaptive}: nothing proposed");
        let rate = accepted as f64 / proposed as f64;
        assert!(rate > 0.9, "k = {k}, adaptive = {adaptive}: {accepted} of {proposed} accepted");
    }
}

#[test]
fn every_fixture_pair_shares_one_vocabulary() {
    let toks: Vec<(String, Tokenizer, usize)> = FIXTURES
        .iter()
        .map(|n| {
            let m = load_model(&fixture(n)).unwrap();
            (n.to_string(), m.tokenizer, m.config.vocab_size)
        })
        .collect();
    for (tn, t, tv) in &toks {
        for (dn, d, dv) in &toks {
            if let Err(e) = check_compatible(t, *tv, d, *dv) {
                panic!("{dn} drafting for {tn}: {e}");
            }
        }
    }
}

#[test]
fn other_models_drafting_change_nothing() {
    let ps = prompts(6);
    let params = vec![greedy(32); ps.len()];
    // Tiny models with other weights rarely agree: this mostly exercises rejected drafts, which
    // the draft must truncate away; a model drafting for itself covers accepted ones.
    for (target, draft) in [
        ("qwen3", "mistral"),
        ("mistral", "qwen3"),
        ("llama3-rope-scaled", "llama-gqa"),
        ("llama-gqa", "qwen2-mqa"),
    ] {
        let (target, draft) = (fixture(target), fixture(draft));
        let (want, _) = run(&mut engine(&target, ROOMY, None), &ps, &params);
        for (k, adaptive) in [(1, false), (8, false), (8, true)] {
            let mut eng = engine(&target, ROOMY, Some((&draft, ROOMY, spec(k, adaptive))));
            let (got, (proposed, _)) = run(&mut eng, &ps, &params);
            let what =
                format!("{} for {}, k = {k}, adaptive = {adaptive}", draft.display(), target.display());
            assert_eq!(got, want, "{what}");
            assert!(proposed > 0, "{what}: nothing proposed");
        }
    }
}

#[test]
fn chunked_prefill_preemption_and_tiny_draft_pools_change_nothing() {
    let ps = prompts(8);
    let params = vec![greedy(40); ps.len()];
    // A 7-token budget chunks every prompt; 24 blocks of 4 cannot hold 8 sequences of up to 63
    // tokens, so the target preempts and recomputes. The draft's 5-token budget chunks its
    // catch-up, and its 12 blocks hold few sequences, so it evicts and skips.
    let tight = Pool { blocks: 24, block_size: 4, budget: 7 };
    let tiny = Pool { blocks: 12, block_size: 4, budget: 5 };
    for (target, draft) in [("mistral", "mistral"), ("qwen3", "mistral-sliding")] {
        let (target, draft) = (fixture(target), fixture(draft));
        let (want, _) = run(&mut engine(&target, ROOMY, None), &ps, &params);
        for (draft_pool, adaptive) in [(ROOMY, false), (tiny, true), (tiny, false)] {
            let mut eng = engine(&target, tight, Some((&draft, draft_pool, spec(4, adaptive))));
            let (got, (proposed, _)) = run(&mut eng, &ps, &params);
            assert_eq!(got, want, "{} for {}, {draft_pool:?}", draft.display(), target.display());
            assert!(proposed > 0);
        }
    }
}

#[test]
fn many_concurrent_sequences_decode_identically() {
    let model = fixture("qwen2-mqa");
    let draft = fixture("qwen3");
    let ps = prompts(24);
    let params = vec![greedy(20); ps.len()];
    let (want, _) = run(&mut engine(&model, ROOMY, None), &ps, &params);
    let (got, (proposed, _)) =
        run(&mut engine(&model, ROOMY, Some((&draft, ROOMY, spec(4, true)))), &ps, &params);
    assert_eq!(got, want);
    assert!(proposed > 0);
}

#[test]
fn seeded_sampling_gives_the_same_tokens_with_and_without_a_draft_model() {
    let ps = prompts(6);
    let params: Vec<SamplingParams> = (0..ps.len())
        .map(|i| SamplingParams {
            // The tiny models' distributions are nearly flat: a small top-k gives drafts a chance.
            temperature: 0.7,
            top_k: if i % 2 == 0 { 3 } else { 8 },
            top_p: if i % 3 == 1 { 0.8 } else { 1.0 },
            min_p: 0.01,
            repetition_penalty: if i % 3 == 0 { 1.15 } else { 1.0 },
            seed: Some(77 + i as u64),
            max_tokens: 32,
            ignore_eos: true,
            ..Default::default()
        })
        .collect();
    let target = fixture("qwen3");
    let (want, _) = run(&mut engine(&target, ROOMY, None), &ps, &params);
    for (draft, adaptive) in [("qwen3", false), ("qwen3", true), ("mistral", false)] {
        let draft = fixture(draft);
        let mut eng = engine(&target, ROOMY, Some((&draft, ROOMY, spec(5, adaptive))));
        let (got, (proposed, accepted)) = run(&mut eng, &ps, &params);
        assert_eq!(got, want, "{}, adaptive = {adaptive}", draft.display());
        assert!(proposed > 0, "{}: nothing proposed", draft.display());
        if draft == target {
            assert!(accepted > 0, "drafting for itself, no sampled token matched a draft");
        }
    }
}

#[test]
fn sampled_drafts_of_a_model_drafting_for_itself_are_all_accepted() {
    // With sampled drafts the draft's distribution q is the target's own p (the same model, passes
    // computing each token's logits alike, the same rule), so min(1, p/q) = 1 and every draft is
    // accepted; greedy drafts at the same temperature match the sampled token far less often.
    let ps = prompts(6);
    let params: Vec<SamplingParams> = (0..ps.len())
        .map(|i| SamplingParams {
            temperature: 0.9,
            top_k: if i % 2 == 0 { 4 } else { 0 },
            top_p: if i % 3 == 1 { 0.9 } else { 1.0 },
            seed: Some(5 + i as u64),
            max_tokens: 32,
            ignore_eos: true,
            ..Default::default()
        })
        .collect();
    let model = fixture("qwen3");
    let sampled = SpecOptions { sampled_drafts: true, ..spec(4, false) };
    let (got, (proposed, accepted)) =
        run(&mut engine(&model, ROOMY, Some((&model, ROOMY, sampled))), &ps, &params);
    assert!(proposed > 0, "nothing proposed");
    assert_eq!(accepted, proposed, "sampled drafts from the target's own distribution");
    assert!(got.iter().all(|g| g.len() == 32), "every request ran to max_tokens");
    let (_, (g_proposed, g_accepted)) =
        run(&mut engine(&model, ROOMY, Some((&model, ROOMY, spec(4, false)))), &ps, &params);
    assert!(
        (g_accepted as f64) < 0.8 * g_proposed as f64,
        "greedy drafts at temperature 0.9 were accepted {g_accepted} of {g_proposed} times"
    );
    // Another model's sampled drafts are verified by the same rule; a greedy request is untouched.
    let other = fixture("mistral");
    let mut eng = engine(&model, ROOMY, Some((&other, ROOMY, sampled)));
    let (_, (proposed, accepted)) = run(&mut eng, &ps, &params);
    assert!(proposed > 0 && accepted < proposed, "{accepted} of {proposed}");
    let greedy_params = vec![greedy(24); ps.len()];
    let (want, _) = run(&mut engine(&model, ROOMY, None), &ps, &greedy_params);
    let (got, _) = run(&mut engine(&model, ROOMY, Some((&other, ROOMY, sampled))), &ps, &greedy_params);
    assert_eq!(got, want, "greedy requests draft greedily even with sampled drafts on");
}

/// A copy of a fixture's tokenizer files in a scratch directory, with `edit` applied to each
/// file's JSON (by file name).
fn edited_tokenizer(fixture_name: &str, tag: &str, edit: impl Fn(&str, &mut serde_json::Value)) -> Tokenizer {
    let dir = std::env::temp_dir().join(format!("tandem-draft-vocab-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        let text = std::fs::read_to_string(fixture(fixture_name).join(f)).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        edit(f, &mut v);
        std::fs::write(dir.join(f), serde_json::to_string(&v).unwrap()).unwrap();
    }
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    tok
}

fn message(r: Result<(), EngineError>) -> String {
    match r {
        Err(EngineError::InvalidRequest(m)) => m,
        other => panic!("expected an invalid-request error, got {other:?}"),
    }
}

#[test]
fn incompatible_vocabularies_are_refused_by_name() {
    let m = load_model(&fixture("llama-gqa")).unwrap();
    let target = m.tokenizer;

    // A draft embedding smaller than the target's: the target could emit ids the draft lacks.
    let msg = message(check_compatible(&target, 448, &target, 300));
    assert!(
        msg.contains("not compatible with the target") && msg.contains("vocabulary sizes 448 vs 300"),
        "{msg}"
    );
    // A larger one is fine.
    check_compatible(&target, 448, &target, 512).unwrap();

    // Two tokens trade ids.
    let swapped = edited_tokenizer("llama-gqa", "swap", |f, v| {
        if f == "tokenizer.json" {
            let vocab = v["model"]["vocab"].as_object_mut().unwrap();
            let a = vocab.iter().find(|(_, id)| id.as_u64() == Some(300)).unwrap().0.clone();
            let b = vocab.iter().find(|(_, id)| id.as_u64() == Some(301)).unwrap().0.clone();
            vocab.insert(a, 301.into());
            vocab.insert(b, 300.into());
        }
    });
    let (t300, t301) = (target.token_text(300).unwrap(), target.token_text(301).unwrap());
    assert_ne!(t300, t301);
    let msg = message(check_compatible(&target, 448, &swapped, 448));
    assert!(msg.contains(&format!("token 300 is {t300:?} in the target and {t301:?} in the draft")), "{msg}");

    // Another BOS.
    let other_bos = edited_tokenizer("llama-gqa", "bos", |f, v| match f {
        "tokenizer_config.json" => v["bos_token"] = "<|im_start|>".into(),
        "generation_config.json" => v["bos_token_id"] = 1.into(),
        _ => {}
    });
    assert_ne!(other_bos.bos_token_id(), target.bos_token_id());
    let msg = message(check_compatible(&target, 448, &other_bos, 448));
    assert!(msg.contains("BOS id 0 in the target and"), "{msg}");

    // A draft tokenizer without the target's last token (its merge removed with it).
    let shorter = edited_tokenizer("llama-gqa", "short", |f, v| {
        if f == "tokenizer.json" {
            let model = v["model"].as_object_mut().unwrap();
            model["vocab"].as_object_mut().unwrap().remove("dre").unwrap();
            let merges = model["merges"].as_array_mut().unwrap();
            assert_eq!(merges.pop().unwrap(), serde_json::json!(["d", "re"]));
        }
    });
    assert_eq!(shorter.vocab_size(), 447);
    let msg = message(check_compatible(&target, 448, &shorter, 448));
    assert!(msg.contains("token 447 is \"dre\" in the target and missing in the draft"), "{msg}");

    // `new` refuses with the draft's name and keeps nothing.
    let (be, _) = backend(&fixture("mistral"), ROOMY);
    let err =
        DraftModelDrafter::new(&target, 448, Box::new(be), &swapped, "tiny-swapped".into()).err().unwrap();
    let msg = err.to_string();
    assert!(
        msg.contains("draft model tiny-swapped is not compatible with the target: token 300 is"),
        "{msg}"
    );
}

/// The draft model's own greedy continuation of `tokens`, from a plain engine.
fn continuation(reference: &mut Engine, tokens: &[u32], n: usize) -> Vec<u32> {
    reference.generate(tokens.to_vec(), greedy(n), |_| {}).unwrap().token_ids
}

fn ask(seq: u64, tokens: &[u32], max: usize) -> DraftAsk<'_> {
    DraftAsk { seq, tokens, max, sampling: None }
}

/// Proposes for `asks` and checks each proposal against the reference and the drafter's KV.
fn propose_checked(d: &mut DraftModelDrafter, reference: &mut Engine, asks: &[DraftAsk<'_>], lens: &[usize]) {
    let got = d.propose(asks).unwrap();
    d.check_kv().unwrap();
    for ((a, g), &n) in asks.iter().zip(&got).zip(lens) {
        assert_eq!(g.len(), n, "sequence {}: {} tokens", a.seq, a.tokens.len());
        if n > 0 {
            assert_eq!(*g, continuation(reference, a.tokens, n), "sequence {}", a.seq);
        }
    }
}

#[test]
fn proposals_follow_the_tokens_given_and_no_block_leaks() {
    let model = fixture("llama-gqa");
    let mut reference = engine(&model, Pool { blocks: 512, block_size: 4, budget: 512 }, None);
    let target = load_model(&model).unwrap().tokenizer;
    // A 5-token budget chunks every catch-up; 64 blocks of 4 hold 256 positions.
    let mut d = drafter(&target, 448, &model, Pool { blocks: 64, block_size: 4, budget: 5 });
    let ps = prompts(3);
    let (pa, pb) = (ps[1].clone(), ps[2].clone());
    let ga = continuation(&mut reference, &pa, 9);
    let gb = continuation(&mut reference, &pb, 3);

    propose_checked(&mut d, &mut reference, &[ask(1, &pa, 4), ask(2, &pb, 3)], &[4, 3]);
    assert_eq!(d.num_sequences(), 2);

    // 1: every draft accepted plus the bonus token. 2: its second draft rejected. 3: new.
    let a2: Vec<u32> = pa.iter().chain(&ga[..5]).copied().collect();
    let wrong = if gb[1] == 7 { 8 } else { 7 };
    let b2: Vec<u32> = pb.iter().copied().chain([gb[0], wrong]).collect();
    let c = vec![5, 6, 7];
    propose_checked(&mut d, &mut reference, &[ask(1, &a2, 4), ask(2, &b2, 3), ask(3, &c, 1)], &[4, 3, 1]);

    // 1: nothing happened since (the step ran no verification). 2: preempted and recomputed
    // with other tokens (a shorter, diverging list). 3: not asked; it keeps its blocks.
    let b3: Vec<u32> = pb[..5].iter().copied().chain([9, 9]).collect();
    propose_checked(&mut d, &mut reference, &[ask(1, &a2, 2), ask(2, &b3, 5)], &[2, 5]);
    assert_eq!(d.num_sequences(), 3);

    let held = d.kv_in_use();
    d.forget(3);
    d.check_kv().unwrap();
    assert_eq!(d.kv_in_use(), held - 1, "sequence 3 held one block");

    // Near the end of the draft's 256 positions the depth shrinks, and the sequences not asked
    // give their blocks up to make room; beyond the end nothing is drafted and nothing kept.
    let long: Vec<u32> = (0..254).map(|i| 3 + (i * 13) % 400).collect();
    propose_checked(&mut d, &mut reference, &[ask(4, &long, 8)], &[3]);
    assert_eq!((d.num_sequences(), d.kv_in_use()), (1, 64));
    let too_long: Vec<u32> = (0..257).map(|i| 3 + (i * 13) % 400).collect();
    assert_eq!(d.propose(&[ask(4, &too_long, 8)]).unwrap(), vec![Vec::<u32>::new()]);
    d.check_kv().unwrap();
    assert_eq!(d.kv_in_use(), 0);

    propose_checked(&mut d, &mut reference, &[ask(1, &a2, 3), ask(2, &b3, 3)], &[3, 3]);
    assert!(d.kv_in_use() > 0);
    for seq in [2, 1, 4, 99] {
        d.forget(seq);
        d.check_kv().unwrap();
    }
    assert_eq!(d.kv_in_use(), 0, "draft blocks left behind");
    assert_eq!(d.num_sequences(), 0);
}

#[test]
fn a_full_draft_pool_evicts_idle_sequences_and_skips_what_does_not_fit() {
    let model = fixture("mistral");
    let mut reference = engine(&model, ROOMY, None);
    let target = load_model(&model).unwrap().tokenizer;
    // 6 blocks of 4: 24 positions.
    let mut d = drafter(&target, 448, &model, Pool { blocks: 6, block_size: 4, budget: 64 });
    let a: Vec<u32> = (0..20).map(|i| 3 + i * 7).collect();
    let b: Vec<u32> = (0..17).map(|i| 5 + i * 11).collect();
    // 20 tokens and 8 drafts need 27 positions: the depth shrinks to what fits.
    propose_checked(&mut d, &mut reference, &[ask(1, &a, 8)], &[5]);
    assert_eq!(d.kv_in_use(), 6);
    // 1 is idle this call: it gives its blocks up.
    propose_checked(&mut d, &mut reference, &[ask(2, &b, 3)], &[3]);
    assert_eq!(d.num_sequences(), 1);
    // Both asking: the first takes what it needs, the second does not fit and holds nothing.
    propose_checked(&mut d, &mut reference, &[ask(2, &b, 2), ask(1, &a, 1)], &[2, 0]);
    assert_eq!(d.num_sequences(), 1);
    d.forget(2);
    d.check_kv().unwrap();
    assert_eq!(d.kv_in_use(), 0);
}

/// A CPU backend whose forward passes fail once `left` reaches zero.
struct Flaky {
    inner: CpuBackend,
    left: Arc<AtomicUsize>,
}

impl Backend for Flaky {
    delegate_backend!();
    fn forward(&mut self, batch: &[SeqChunk<'_>]) -> tandem_engine::Result<Vec<Vec<f32>>> {
        if self.left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_err() {
            return Err(EngineError::Internal("injected failure".into()));
        }
        self.inner.forward(batch)
    }
}

#[test]
fn a_failed_pass_drops_the_state_it_touched_and_the_next_call_recovers() {
    let model = fixture("qwen3");
    let mut reference = engine(&model, ROOMY, None);
    let (inner, tok) = backend(&model, ROOMY);
    let left = Arc::new(AtomicUsize::new(usize::MAX));
    let flaky = Flaky { inner, left: left.clone() };
    let mut d = DraftModelDrafter::new(&tok, 448, Box::new(flaky), &tok, "flaky".into()).unwrap();
    let ps = prompts(3);
    propose_checked(
        &mut d,
        &mut reference,
        &[ask(1, &ps[0], 3), ask(2, &ps[1], 3), ask(3, &ps[2], 2)],
        &[3, 3, 2],
    );
    // Fail in the first round, then in a later one; sequence 3 is not asked and keeps its state.
    for passes_before_failure in [0, 2] {
        left.store(passes_before_failure, Ordering::SeqCst);
        let a: Vec<u32> = ps[0].iter().copied().chain([4, 4]).collect();
        assert!(d.propose(&[ask(1, &a, 4), ask(2, &ps[1], 4)]).is_err());
        d.check_kv().unwrap();
        assert_eq!(d.num_sequences(), 1, "the failed call's sequences keep no state");
        left.store(usize::MAX, Ordering::SeqCst);
        propose_checked(&mut d, &mut reference, &[ask(1, &a, 4), ask(2, &ps[1], 4)], &[4, 4]);
        assert_eq!(d.num_sequences(), 3);
    }
    for seq in 1..=3 {
        d.forget(seq);
    }
    d.check_kv().unwrap();
    assert_eq!(d.kv_in_use(), 0);
}

#[test]
fn smollm2_drafting_for_itself_changes_nothing() {
    let Some(path) = default_model_for_test("smollm2_drafting_for_itself_changes_nothing") else { return };
    let pool = Pool { blocks: 64, block_size: 16, budget: 256 };
    let (be, tok) = backend(&path, pool);
    let ps: Vec<Vec<u32>> = ["The capital of France is", "Write a list of three fruits:"]
        .iter()
        .map(|t| tok.encode(t, true).unwrap())
        .collect();
    let params = vec![greedy(24); ps.len()];
    let mut plain =
        Engine::new(Box::new(be), tok, SchedulerOptions { max_batch_tokens: 256, max_num_seqs: 8 });
    let (want, _) = run(&mut plain, &ps, &params);
    drop(plain);
    let mut eng = engine(&path, pool, Some((&path, pool, spec(4, true))));
    let (got, (proposed, accepted)) = run(&mut eng, &ps, &params);
    assert_eq!(got, want);
    assert!(proposed > 0);
    let rate = accepted as f64 / proposed as f64;
    assert!(rate > 0.9, "{accepted} of {proposed} accepted");
}
