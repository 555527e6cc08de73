//! Sliding-window KV (`kv::groups`): a pool whose window layers give back the pages no later
//! query reaches generates exactly what a pool keeping every position generates, on the tiny
//! Gemma 3 and Gemma 2 fixtures (window and global layers mixed, windows of 16 tokens) and the
//! Mistral one (every layer windowed), while holding fewer pages. Each test runs the same
//! requests on a windowed engine and on a full one and compares tokens; the allocator's
//! invariants (which count the given-back pages) are checked after every step, and at the end
//! every page is free or cached.
//!
//! Covered: chunked prefill past the window, decoding far past it, seeded sampling, the prefix
//! cache (hits whose window pages were given back, and hits that keep them), n-gram
//! speculation (staged KV and its truncation), choices of one request (`n` > 1) forked before
//! and after the parent passed its window, and the disaggregated path, where only the pages a
//! sequence keeps are reserved and moved. Then the real Gemma 3 270M: an 8k-token sequence
//! holds at most 40 MiB of KV, counted on the pool, where a full pool holds 144 MiB.

mod sched_common;
use sched_common::{copy_blocks, fixture_backend_with, greedy, Setup};

use std::collections::HashMap;

use tandem_engine::backend::BackendOptions;
use tandem_engine::cpu::CpuBackend;
use tandem_engine::kv::groups::{kept_count, kept_pages};
use tandem_engine::kv::{SeqId, NO_PAGE};
use tandem_engine::loader::load_model;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SchedulerOptions, SeqEvent};
use tandem_engine::spec::ngram::NgramDrafter;
use tandem_engine::spec::SpecOptions;
use tandem_test_support::cached_model_for_test;

const MODELS: [&str; 3] = ["gemma3", "gemma2", "mistral-sliding"];

const SETUP: Setup = Setup { model: "gemma3", blocks: 96, block_size: 4, budget: 12, max_num_seqs: 8 };

fn engine(s: Setup, windowed: bool, cache: bool) -> Engine {
    let (be, tokenizer) = fixture_backend_with(&s, None, windowed);
    let opts = SchedulerOptions { max_batch_tokens: s.budget, max_num_seqs: s.max_num_seqs };
    let e = Engine::new(Box::new(be), tokenizer, opts);
    assert_eq!(e.kv_groups() > 1 || e.kv_windows()[0].is_some(), windowed, "{}: windowed pool", s.model);
    if cache {
        e.with_prefix_cache(&format!("fixture/{}", s.model))
    } else {
        e
    }
}

fn with_ngram(e: Engine) -> Engine {
    let o = SpecOptions { max_draft: 4, adaptive: false, ngram_min: 1, ngram_max: 3, sampled_drafts: false };
    e.with_speculation(Box::new(NgramDrafter::new(o.ngram_min, o.ngram_max)), o).expect("speculation")
}

/// Tokens in the fixtures' vocabulary, a little repetitive so that n-gram drafts get accepted.
fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 3 + (seed * 31 + (i % 11) * 17 + i / 5) % 400).collect()
}

fn seeded(n: usize, seed: u64) -> SamplingParams {
    SamplingParams { temperature: 0.8, top_k: 40, seed: Some(seed), ..greedy(n) }
}

/// Bytes of KV one pool page holds: `per_page` layers' K and V of one block.
fn page_bytes(e: &Engine) -> usize {
    let l = e.backend().kv_layout();
    2 * l.num_layers * l.block_bytes()
}

/// What a run gave: each request's tokens, and the most KV bytes held at once after a step.
struct Run {
    out: Vec<Vec<u32>>,
    peak_bytes: usize,
}

/// Runs `reqs` on `e` (all at once), checking the allocator after every step and that nothing
/// is held at the end.
fn run(e: &mut Engine, reqs: &[(Vec<u32>, SamplingParams)]) -> Run {
    let ids: Vec<SeqId> = reqs.iter().map(|(p, sp)| e.add_request(p.clone(), sp.clone()).unwrap()).collect();
    let mut out: HashMap<SeqId, Vec<u32>> = HashMap::new();
    let mut peak = 0;
    let mut steps = 0;
    while e.num_active() > 0 {
        steps += 1;
        assert!(steps < 20_000, "no progress");
        step(e, &mut out);
        peak = peak.max(e.kv_stats().used * page_bytes(e));
    }
    let s = e.kv_stats();
    assert_eq!((s.used, s.free + s.cached), (0, s.total), "pages left held");
    Run { out: ids.iter().map(|id| out.remove(id).unwrap_or_default()).collect(), peak_bytes: peak }
}

/// One step of `e`, collecting every sequence's tokens in `out`; fails on a failed sequence or a
/// broken allocator invariant.
fn step(e: &mut Engine, out: &mut HashMap<SeqId, Vec<u32>>) {
    for ev in e.step().expect("step") {
        match ev {
            SeqEvent::Token { seq, token, .. } => out.entry(seq).or_default().push(token),
            SeqEvent::Failed { error, .. } => panic!("{error}"),
            _ => {}
        }
    }
    e.check_kv().expect("allocator invariants");
}

fn requests(seed: u32) -> Vec<(Vec<u32>, SamplingParams)> {
    vec![
        (tokens(seed, 3), greedy(45)),
        (tokens(seed + 1, 21), greedy(40)),
        (tokens(seed + 2, 47), seeded(30, 7)),
        (tokens(seed + 3, 70), greedy(36)),
    ]
}

#[test]
fn a_windowed_pool_generates_what_a_full_pool_does_and_holds_less() {
    for model in MODELS {
        let s = Setup { model, ..SETUP };
        let reqs = requests(1);
        let full = run(&mut engine(s, false, false), &reqs);
        let windowed = run(&mut engine(s, true, false), &reqs);
        assert_eq!(windowed.out, full.out, "{model}");
        assert!(full.out.iter().all(|o| !o.is_empty()));
        assert!(
            windowed.peak_bytes < full.peak_bytes,
            "{model}: windowed peak {} B, full {} B",
            windowed.peak_bytes,
            full.peak_bytes
        );
    }
}

#[test]
fn the_prefix_cache_and_speculation_on_a_windowed_pool_generate_the_same() {
    let mut accepted = 0;
    for model in MODELS {
        let s = Setup { model, ..SETUP };
        // A shared prefix far past the window, then prompts that continue it; twice, so that the
        // second round hits what the first cached (the window pages near each prompt's end).
        let shared = tokens(40, 60);
        let reqs: Vec<(Vec<u32>, SamplingParams)> = (0..3u32)
            .map(|i| ([shared.clone(), tokens(50 + i, 5 + 7 * i as usize)].concat(), greedy(30)))
            .collect();
        let mut full = engine(s, false, false);
        let want: Vec<Vec<u32>> =
            reqs.iter().map(|r| run(&mut full, std::slice::from_ref(r)).out.remove(0)).collect();
        let mut cached = engine(s, true, true);
        for round in 0..2 {
            for (r, w) in reqs.iter().zip(&want) {
                assert_eq!(&run(&mut cached, std::slice::from_ref(r)).out[0], w, "{model} round {round}");
            }
        }
        let stats = cached.prefix_stats();
        assert!(stats.hit_tokens > 0, "{model}: the cache served nothing");
        // All at once, with n-gram speculation and the cache.
        let mut spec = with_ngram(engine(s, true, true));
        assert_eq!(run(&mut spec, &reqs).out, want, "{model} with speculation");
        let st = spec.spec_stats();
        assert!(st.proposed > 0, "{model}: nothing was verified");
        accepted += st.accepted;
    }
    assert!(accepted > 0, "no draft was accepted on any model");
}

/// Steps `e` until `seq` has generated `n` tokens, collecting every sequence's tokens in `out`.
fn generate(e: &mut Engine, seq: SeqId, n: usize, out: &mut HashMap<SeqId, Vec<u32>>) {
    while out.get(&seq).map_or(0, Vec::len) < n {
        step(e, out);
    }
}

#[test]
fn choices_forked_before_and_after_the_window_match_their_own_requests() {
    for model in MODELS {
        let s = Setup { model, ..SETUP };
        let prompt = tokens(70, 30);
        let mut full = engine(s, false, false);
        let want_a = run(&mut full, &[(prompt.clone(), seeded(25, 11))]).out.remove(0);
        let want_b = run(&mut full, &[(prompt.clone(), seeded(25, 12))]).out.remove(0);

        let mut e = engine(s, true, false);
        let parent = e.add_request(prompt.clone(), greedy(60)).unwrap();
        let mut out: HashMap<SeqId, Vec<u32>> = HashMap::new();
        generate(&mut e, parent, 1, &mut out);
        // Right after the prompt: the choice shares the parent's pages.
        let used = e.kv_stats().used;
        let a = e.fork_prompt(parent, seeded(25, 11)).expect("fork");
        assert!(e.kv_stats().used <= used + e.kv_groups(), "{model}: a fork shares the prompt's pages");
        // Far past the window: the parent gave back what the last prompt token reads, so the
        // choice computes its prompt itself.
        generate(&mut e, parent, 24, &mut out);
        let b = e.fork_prompt(parent, seeded(25, 12)).expect("fork past the window");
        while e.num_active() > 0 {
            step(&mut e, &mut out);
        }
        assert_eq!(out[&a], want_a, "{model}: forked at the prompt");
        assert_eq!(out[&b], want_b, "{model}: forked past the window");
    }
}

// ---- disaggregation in process ----

/// Prefills `prompt` on `p`, moves what the decode side `d` reserved, and decodes there.
/// Returns the request's tokens, the leading blocks the decode side had cached, and the tokens of
/// a second choice forked on the decode side (seed 5).
fn disaggregated(
    p: &mut Engine,
    d: &mut Engine,
    prompt: &[u32],
    params: &SamplingParams,
) -> (Vec<u32>, usize, Vec<u32>) {
    let bs = p.backend().kv_layout().block_size;
    let r = d.reserve_prompt(prompt, "").expect("reserve");
    let windows = d.kv_windows().to_vec();
    assert_eq!(r.blocks.len(), kept_count(&windows, prompt.len(), r.cached_blocks, bs), "reserved pages");
    let seq = p.add_prefill_request(prompt.to_vec(), params.clone()).expect("prefill request");
    let mut first = None;
    while p.has_work() {
        for ev in p.step().expect("prefill step") {
            if let SeqEvent::Prefilled { token, .. } = ev {
                first = Some(token);
            }
        }
        p.check_kv().expect("prefill invariants");
    }
    let first = first.expect("Prefilled");
    let table = p.block_table(seq).expect("held sequence").to_vec();
    let src =
        kept_pages(&table, &windows, prompt.len(), r.cached_blocks, bs).expect("the kept pages are held");
    assert!(!src.contains(&NO_PAGE));
    copy_blocks(p, &src, d, r.id, &r.blocks);
    p.release_prefilled(seq).unwrap();
    let seq = d.add_prefilled(r.id, prompt.to_vec(), first, params.clone()).expect("adopt");
    // A second choice forks from the adopted sequence: it must find the pages its last prompt
    // token reads.
    let choice = d.fork_prompt(seq, seeded(params.max_tokens, 5)).expect("fork after adopt");
    let mut out = vec![first];
    let mut choice_out = Vec::new();
    while d.has_work() {
        for ev in d.step().expect("decode step") {
            match ev {
                SeqEvent::Token { seq: s, token, .. } if s == seq => out.push(token),
                SeqEvent::Token { seq: s, token, .. } if s == choice => choice_out.push(token),
                SeqEvent::Failed { error, .. } => panic!("{error}"),
                _ => {}
            }
        }
        d.check_kv().expect("decode invariants");
    }
    (out, r.cached_blocks, choice_out)
}

#[test]
fn a_transfer_reserves_and_moves_only_the_kept_pages() {
    // Prompt lengths of every residue modulo the block size: where the window of the last
    // prompt token starts on a block boundary, the page before it is still moved.
    for (model, tail) in MODELS.iter().flat_map(|&m| (9..13).map(move |t| (m, t))) {
        let s = Setup { model, ..SETUP };
        let params = greedy(20);
        let long = tokens(80, 44);
        let first = [long.clone(), tokens(81, tail)].concat();
        let second = [long.clone(), tokens(82, tail + 4)].concat();
        let mut full = engine(s, false, false);
        let want1 = run(&mut full, &[(first.clone(), params.clone())]).out.remove(0);
        let want2 = run(&mut full, &[(second.clone(), params.clone())]).out.remove(0);
        let choice1 = run(&mut full, &[(first.clone(), seeded(20, 5))]).out.remove(0);

        let mut p = engine(s, true, true);
        let mut d = engine(s, true, true);
        let bs = s.block_size;
        // Fewer pages than a full pool's blocks: the window groups' early pages are not moved.
        let windows = d.kv_windows().to_vec();
        assert!(kept_count(&windows, first.len(), 0, bs) < first.len().div_ceil(bs) * windows.len());
        let (got1, cached1, forked1) = disaggregated(&mut p, &mut d, &first, &params);
        assert_eq!(got1, want1, "{model}: first transfer");
        // Nothing is cached yet; but where every layer has a window, the blocks before the
        // window of the last prompt token need no KV on the decode side at all, cached or not.
        let global = windows.contains(&None);
        assert!(cached1 == 0 || !global, "{model}: {cached1} blocks found in an empty cache");
        assert_eq!(forked1, choice1, "{model}: a choice forked after the transfer");
        let (got2, cached2, _) = disaggregated(&mut p, &mut d, &second, &params);
        assert_eq!(got2, want2, "{model}: second transfer");
        assert!(cached2 > 0, "{model}: the decode side's cache served the shared prefix");
        let st = d.kv_stats();
        assert_eq!((st.used, st.raw_reserved), (0, 0), "{model}: decode pool at rest");
    }
}

/// The real Gemma 3 270M (18 layers, 15 of them with a 512-token window, one KV head of 256):
/// while an 8k-token sequence decodes, its pool holds at most 40 MiB of f16 KV (its 3 global
/// layers' 24 MiB, and the window's pages), where a pool without groups holds 144 MiB.
#[test]
fn gemma3_270m_at_8k_tokens_holds_at_most_40_mib() {
    let Some(path) = cached_model_for_test("gemma3_270m_at_8k_tokens", "gemma-3-270m-q4_k_m.gguf") else {
        return;
    };
    let m = load_model(&path).expect("Gemma 3 270M loads");
    let (blocks, bs, budget) = (520, 16, 2048);
    let opts = BackendOptions {
        num_blocks: blocks,
        block_size: bs,
        max_batch_tokens: budget,
        windowed_kv: true,
        ..Default::default()
    };
    let be = CpuBackend::new(m.config, m.weights, opts).expect("backend");
    let mut e = Engine::new(
        Box::new(be),
        m.tokenizer,
        SchedulerOptions { max_batch_tokens: budget, max_num_seqs: 4 },
    );
    assert_eq!(
        (e.kv_groups(), e.backend().kv_layout().num_layers),
        (6, 3),
        "1 global and 5 window groups of 3 layers"
    );
    let full_bytes_per_token = 18 * 2 * e.backend().kv_layout().token_bytes();
    let prompt: Vec<u32> = (0..8180u32).map(|i| 2 + (i * 7919) % 200_000).collect();
    let seq = e.add_request(prompt.clone(), greedy(12)).unwrap();
    let mut held = Vec::new();
    while e.num_active() > 0 {
        let ev = e.step().expect("step");
        assert!(!ev.iter().any(|x| matches!(x, SeqEvent::Failed { .. })), "{ev:?}");
        if e.computed_len(seq).is_some_and(|c| c >= prompt.len()) {
            held.push(e.kv_stats().used * page_bytes(&e));
        }
        e.check_kv().expect("allocator invariants");
    }
    let most = *held.iter().max().expect("decode steps ran");
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let full = full_bytes_per_token * 8192;
    eprintln!(
        "Gemma 3 270M at 8k tokens: {:.1} MiB of KV held (a full pool: {:.1} MiB)",
        mib(most),
        mib(full)
    );
    assert!(most <= 40 << 20, "{:.1} MiB held", mib(most));
    assert!(mib(full) > 140.0);
}
