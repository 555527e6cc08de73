//! The prefix cache in the engine, on the tiny fixture models: it changes what is computed, never
//! what is generated. Every test runs the same requests on an engine with the cache and on one
//! without it (same model, same options) and asserts the tokens are equal, and that the cache
//! actually served something, so that equal outputs mean something. The allocator's invariants
//! are checked after every step, and at the end nothing is held: every block is free or cached.
//!
//! Covered: full, partial and missed lookups on every fixture model; the counters; chunked
//! prefill; concurrent sequences sharing a prefix; cancellation of a sharer; a small pool with
//! preemption and eviction; salts and model identity in the hash chain; n-gram speculation; and
//! the disaggregated path, where a decode engine's reservation pins the cached prefix and only
//! the rest is transferred.

mod sched_common;
use sched_common::{copy_blocks, drain, fixture_engine, greedy, Setup};

use std::collections::HashMap;

use tandem_engine::kv::prefix::{block_hashes, chain_root, reusable_blocks};
use tandem_engine::kv::SeqId;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, PrefixStats, SeqEvent};
use tandem_engine::spec::ngram::NgramDrafter;
use tandem_engine::spec::SpecOptions;
use tandem_engine::EngineError;

const MODELS: [&str; 6] =
    ["llama-gqa", "llama3-rope-scaled", "mistral", "mistral-sliding", "qwen2-mqa", "qwen3"];

const ROOMY: Setup = Setup { model: "llama-gqa", blocks: 128, block_size: 8, budget: 256, max_num_seqs: 16 };

/// The identity a cached engine of `model` hashes under, unless a test names another.
fn identity(model: &str) -> String {
    format!("fixture/{model}")
}

fn engine_with(s: Setup, cache: Option<&str>) -> Engine {
    let e = fixture_engine(&s);
    match cache {
        Some(id) => e.with_prefix_cache(id),
        None => e,
    }
}

/// An engine with the prefix cache (`cache`) or without it, otherwise the same.
fn engine(s: Setup, cache: bool) -> Engine {
    let id = identity(s.model);
    let e = engine_with(s, cache.then_some(id.as_str()));
    assert_eq!(e.prefix_cache(), cache);
    e
}

fn with_ngram(e: Engine) -> Engine {
    let o = SpecOptions { max_draft: 4, adaptive: true, ngram_min: 1, ngram_max: 3, sampled_drafts: false };
    e.with_speculation(Box::new(NgramDrafter::new(o.ngram_min, o.ngram_max)), o).expect("speculation")
}

fn salted(n: usize, salt: &str) -> SamplingParams {
    SamplingParams { cache_salt: salt.to_owned(), ..greedy(n) }
}

/// `n` deterministic token ids in 3..403, different for different seeds.
fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|j| 3 + (seed * 131 + j * 29 + j * j * 7 + seed * seed * 17) % 400).collect()
}

fn cat(a: &[u32], b: &[u32]) -> Vec<u32> {
    a.iter().chain(b).copied().collect()
}

/// A request and the step count at which it is added (0: before the first step).
#[derive(Debug, Clone)]
struct Arrival {
    at: usize,
    prompt: Vec<u32>,
    params: SamplingParams,
}

fn now(prompt: &[u32], params: SamplingParams) -> Arrival {
    Arrival { at: 0, prompt: prompt.to_vec(), params }
}

/// What a run did, as the step hook and the caller see it.
#[derive(Debug, Default)]
struct Run {
    /// The sequence of each request, once added.
    ids: Vec<Option<SeqId>>,
    /// Each request's generated tokens so far.
    out: Vec<Vec<u32>>,
    steps: usize,
    /// Times a sequence that had generated tokens lost its computed KV (it was preempted).
    preemptions: usize,
}

impl Run {
    fn id(&self, i: usize) -> Option<SeqId> {
        self.ids[i]
    }
}

/// Runs `reqs` (each added at its step), checking the allocator after every step and calling
/// `hook` after it; at the end nothing may be running or held.
fn run_hooked(e: &mut Engine, reqs: &[Arrival], mut hook: impl FnMut(&mut Engine, &Run)) -> Run {
    let mut r = Run { ids: vec![None; reqs.len()], out: vec![Vec::new(); reqs.len()], ..Run::default() };
    let mut index: HashMap<SeqId, usize> = HashMap::new();
    let mut computed: HashMap<SeqId, usize> = HashMap::new();
    loop {
        for (i, q) in reqs.iter().enumerate() {
            if r.ids[i].is_none() && q.at <= r.steps {
                let id = e.add_request(q.prompt.clone(), q.params.clone()).expect("request accepted");
                r.ids[i] = Some(id);
                index.insert(id, i);
            }
        }
        if r.ids.iter().all(Option::is_some) && e.num_active() == 0 {
            break;
        }
        r.steps += 1;
        assert!(r.steps < 20_000, "no progress: {} sequences still active", e.num_active());
        for ev in e.step().expect("step") {
            match ev {
                SeqEvent::Token { seq, token, .. } => r.out[index[&seq]].push(token),
                SeqEvent::Failed { seq, error } => panic!("sequence {seq} failed: {error}"),
                SeqEvent::Prefilled { seq, .. } => panic!("sequence {seq} is not prefill-only"),
                SeqEvent::Finished { .. } | SeqEvent::PromptLogprobs { .. } => {}
            }
        }
        assert!(!e.stalled(), "stalled without reservations or held sequences");
        e.check_kv().expect("KV invariants after a step");
        assert!(!e.backend().staged_pending(), "staged data outlived a step");
        for (&id, last) in computed.iter_mut() {
            let Some(now) = e.computed_len(id) else { continue };
            if now < *last && e.generated_len(id).unwrap_or(0) > 0 {
                r.preemptions += 1;
            }
            *last = now;
        }
        for &id in index.keys() {
            if let Some(c) = e.computed_len(id) {
                computed.entry(id).or_insert(c);
            }
        }
        hook(e, &r);
    }
    assert_quiescent(e);
    r
}

fn run(e: &mut Engine, reqs: &[Arrival]) -> Run {
    run_hooked(e, reqs, |_, _| {})
}

/// Runs one request alone to the end; its generated tokens.
fn solo(e: &mut Engine, prompt: &[u32], params: SamplingParams) -> Vec<u32> {
    run(e, &[now(prompt, params)]).out.remove(0)
}

/// Nothing runs and nothing is held: every block is free or cached, and the counts agree.
fn assert_quiescent(e: &Engine) {
    e.check_kv().expect("KV invariants at rest");
    let s = e.kv_stats();
    assert_eq!(e.num_active(), 0, "sequences left");
    assert_eq!(s.used, 0, "blocks left in use: {s:?}");
    assert_eq!(s.free + s.cached, s.total, "{s:?}");
    assert_eq!((s.pinned, s.raw_reserved), (0, 0), "{s:?}");
    if e.prefix_cache() {
        assert_eq!(e.prefix_stats().cached_blocks, s.cached);
    } else {
        assert_eq!(s.cached, 0, "an engine without the cache caches nothing: {s:?}");
    }
}

/// Counter differences between two snapshots.
fn delta(before: PrefixStats, after: PrefixStats) -> PrefixStats {
    PrefixStats {
        lookups: after.lookups - before.lookups,
        lookup_tokens: after.lookup_tokens - before.lookup_tokens,
        hit_tokens: after.hit_tokens - before.hit_tokens,
        evictions: after.evictions - before.evictions,
        cached_blocks: after.cached_blocks,
        computed_prompt_tokens: after.computed_prompt_tokens - before.computed_prompt_tokens,
    }
}

#[test]
fn every_fixture_model_generates_the_same_on_a_hit_a_partial_hit_and_a_miss() {
    // Block size 8: the 29-token prompt again reuses 3 blocks; the partial prompt shares 12 tokens
    // (one full block, then diverges in the middle of the second); the miss shares nothing.
    let base = tokens(1, 29);
    let partial = cat(&base[..12], &tokens(2, 15));
    let miss = tokens(3, 25);
    let cases =
        [("first", &base, 0usize), ("full hit", &base, 24), ("partial hit", &partial, 8), ("miss", &miss, 0)];
    for model in MODELS {
        let setup = Setup { model, ..ROOMY };
        let mut plain = engine(setup, false);
        let mut cached = engine(setup, true);
        for (name, prompt, hit) in cases {
            let want = solo(&mut plain, prompt, greedy(16));
            let before = cached.prefix_stats();
            let got = solo(&mut cached, prompt, greedy(16));
            let d = delta(before, cached.prefix_stats());
            assert_eq!(d.hit_tokens, hit as u64, "{model}, {name}: {d:?}");
            assert_eq!(d.computed_prompt_tokens, (prompt.len() - hit) as u64, "{model}, {name}: {d:?}");
            assert_eq!(got, want, "{model}, {name}");
        }
    }
}

#[test]
fn counters_say_what_was_computed_and_what_came_from_the_cache() {
    let mut e = engine(ROOMY, true);
    assert_eq!(e.prefix_stats(), PrefixStats::default());
    let prompt = tokens(10, 40);

    // First time: a lookup that finds nothing; all 40 prompt tokens computed.
    let s0 = e.prefix_stats();
    run(&mut e, &[now(&prompt, greedy(4))]);
    let d = delta(s0, e.prefix_stats());
    assert_eq!((d.lookups, d.lookup_tokens, d.hit_tokens, d.computed_prompt_tokens), (1, 40, 0, 40), "{d:?}");
    // 40 prompt tokens and 3 computed generated ones: 5 full blocks, cached once released.
    assert_eq!(d.cached_blocks, 5, "{d:?}");

    // Again: four blocks come from the cache; the block of the last token is computed.
    let s1 = e.prefix_stats();
    let mut seen = Vec::new();
    run_hooked(&mut e, &[now(&prompt, greedy(4))], |e, r| {
        if let Some(c) = r.id(0).and_then(|id| e.cached_tokens(id)) {
            seen.push(c);
        }
    });
    let d = delta(s1, e.prefix_stats());
    assert_eq!((d.lookups, d.lookup_tokens, d.hit_tokens, d.computed_prompt_tokens), (1, 40, 32, 8), "{d:?}");
    assert!(!seen.is_empty() && seen.iter().all(|&c| c == 32), "cached_tokens while running: {seen:?}");

    // A different prompt of the same length misses and computes everything.
    let s2 = e.prefix_stats();
    run(&mut e, &[now(&tokens(11, 40), greedy(4))]);
    let d = delta(s2, e.prefix_stats());
    assert_eq!((d.hit_tokens, d.computed_prompt_tokens), (0, 40), "{d:?}");

    // A prompt of exactly one block never hits, however often it runs: its only block holds
    // the last prompt token. One token more and the first block is reused.
    let one = tokens(12, 8);
    for round in 0..2 {
        let s = e.prefix_stats();
        let mut seen = Vec::new();
        run_hooked(&mut e, &[now(&one, greedy(3))], |e, r| {
            seen.extend(r.id(0).and_then(|id| e.cached_tokens(id)));
        });
        let d = delta(s, e.prefix_stats());
        assert_eq!((d.hit_tokens, d.computed_prompt_tokens), (0, 8), "round {round}: {d:?}");
        assert!(seen.iter().all(|&c| c == 0), "{seen:?}");
    }
    let s3 = e.prefix_stats();
    run(&mut e, &[now(&cat(&one, &[77]), greedy(3))]);
    let d = delta(s3, e.prefix_stats());
    assert_eq!((d.hit_tokens, d.computed_prompt_tokens), (8, 1), "{d:?}");

    // Without the cache every counter stays zero.
    let mut plain = engine(ROOMY, false);
    run(&mut plain, &[now(&prompt, greedy(4)), now(&prompt, greedy(4))]);
    assert_eq!(plain.prefix_stats(), PrefixStats::default());
    assert!(plain.cache_digest(100).is_empty());
}

#[test]
fn chunked_prefill_with_hits_generates_the_same() {
    // A 7-token budget: every prompt is computed in chunks, hits or not.
    let setup = Setup { budget: 7, ..ROOMY };
    let base = tokens(20, 40);
    let prompts =
        [base.clone(), base.clone(), cat(&base[..21], &tokens(21, 9)), cat(&base[..33], &tokens(22, 4))];
    let mut plain = engine(setup, false);
    let mut cached = engine(setup, true);
    // One after another, then all at once (the later ones attach what the first ones cached).
    for (i, p) in prompts.iter().enumerate() {
        let want = solo(&mut plain, p, greedy(10));
        assert_eq!(solo(&mut cached, p, greedy(10)), want, "prompt {i}");
    }
    let hits = cached.prefix_stats().hit_tokens;
    // 32 + 16 + 32 tokens reused by the second, third and fourth prompt.
    assert_eq!(hits, 80);
    let reqs: Vec<Arrival> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Arrival { at: 2 * i, prompt: p.clone(), params: greedy(10) })
        .collect();
    let want = run(&mut plain, &reqs).out;
    let got = run(&mut cached, &reqs).out;
    assert_eq!(got, want);
    assert!(cached.prefix_stats().hit_tokens > hits, "the concurrent round never hit");
}

#[test]
fn eight_sequences_sharing_a_prefix_run_at_once_and_generate_the_same() {
    // A 3-block prefix and suffixes of 3 to 17 tokens (some end mid-block). The first three arrive
    // together and each computes the prefix; the later ones find it cached.
    let prefix = tokens(30, 24);
    let at = [0, 0, 0, 1, 3, 5, 8, 12];
    let reqs: Vec<Arrival> = (0..8)
        .map(|i| Arrival {
            at: at[i],
            prompt: cat(&prefix, &tokens(31 + i as u32, 3 + 2 * i)),
            params: greedy(12),
        })
        .collect();
    let want = run(&mut engine(ROOMY, false), &reqs).out;
    let mut cached = engine(ROOMY, true);
    let mut most_cached = [0usize; 8];
    let got = run_hooked(&mut cached, &reqs, |e, r| {
        for (i, m) in most_cached.iter_mut().enumerate() {
            if let Some(c) = r.id(i).and_then(|id| e.cached_tokens(id)) {
                *m = (*m).max(c);
            }
        }
    });
    assert_eq!(got.out, want);
    for (i, &m) in most_cached.iter().enumerate() {
        let expect = if at[i] == 0 { 0 } else { 24 };
        assert_eq!(m, expect, "request {i} (arriving at step {})", at[i]);
    }
    // Each solo run agrees too: sharing changed nothing.
    let mut plain = engine(ROOMY, false);
    for (i, q) in reqs.iter().enumerate() {
        assert_eq!(solo(&mut plain, &q.prompt, q.params.clone()), want[i], "request {i} alone");
    }
}

#[test]
fn cancelling_one_sharer_leaves_the_other_intact() {
    let prefix = tokens(40, 20);
    let a = cat(&prefix, &tokens(41, 6));
    let b = cat(&prefix, &tokens(42, 9));
    let want_b = solo(&mut engine(ROOMY, false), &b, greedy(20));
    // Warm: both attach blocks an earlier request left cached. Cold: b attaches a's blocks.
    for warm in [true, false] {
        let mut e = engine(ROOMY, true);
        if warm {
            solo(&mut e, &cat(&prefix, &tokens(43, 5)), greedy(4));
        }
        let reqs = [now(&a, greedy(20)), Arrival { at: if warm { 0 } else { 2 }, ..now(&b, greedy(20)) }];
        let mut cancelled = false;
        let r = run_hooked(&mut e, &reqs, |e, r| {
            let (Some(ia), Some(ib)) = (r.id(0), r.id(1)) else { return };
            if cancelled || e.generated_len(ia).unwrap_or(0) < 4 || e.generated_len(ib).unwrap_or(0) < 1 {
                return;
            }
            let (ta, tb) = (e.block_table(ia).unwrap().to_vec(), e.block_table(ib).unwrap().to_vec());
            assert_eq!(ta[..2], tb[..2], "warm = {warm}: the prefix blocks are shared");
            assert_eq!(e.cached_tokens(ib), Some(16), "warm = {warm}");
            assert_eq!(e.cached_tokens(ia), Some(if warm { 16 } else { 0 }), "warm = {warm}");
            e.cancel(ia).unwrap();
            cancelled = true;
            e.check_kv().expect("KV invariants after a cancellation");
            assert_eq!(e.block_table(ib).unwrap(), tb.as_slice(), "the other's table is untouched");
        });
        assert!(cancelled, "warm = {warm}: never cancelled");
        assert!(r.out[0].len() < 20, "a was cut short");
        assert_eq!(r.out[1], want_b, "warm = {warm}");
        // The cancelled sequence's prefix stays cached: b's prompt hits it again.
        let s = e.prefix_stats();
        assert_eq!(solo(&mut e, &b, greedy(20)), want_b);
        assert_eq!(delta(s, e.prefix_stats()).hit_tokens, 24, "warm = {warm}");
    }
}

#[test]
fn a_small_pool_preempts_and_evicts_and_generates_the_same() {
    // 20 blocks of 4 tokens; up to 8 sequences of up to 39 tokens (10 blocks) each: sequences are
    // preempted, and cached blocks of finished ones evicted to make room.
    let setup = Setup { blocks: 20, block_size: 4, budget: 32, max_num_seqs: 8, ..ROOMY };
    let prefixes = [tokens(50, 12), tokens(51, 12), tokens(52, 12)];
    let reqs: Vec<Arrival> = (0..12)
        .map(|i| Arrival {
            at: 2 * i,
            prompt: cat(&prefixes[i % 3], &tokens(60 + i as u32, 2 + i % 6)),
            params: greedy(20),
        })
        .collect();
    let mut plain = engine(setup, false);
    let want = run(&mut plain, &reqs);
    let mut cached = engine(setup, true);
    let got = run(&mut cached, &reqs);
    assert_eq!(got.out, want.out);
    let st = cached.prefix_stats();
    assert!(got.preemptions > 0, "no sequence was preempted: the pool is not small enough");
    assert!(st.evictions > 0, "nothing was evicted: {st:?}");
    assert!(st.hit_tokens > 0, "nothing was reused: {st:?}");
    // A second round on the same engine, over what the first left cached.
    let again = run(&mut cached, &reqs);
    assert_eq!(again.out, want.out);
    assert!(cached.prefix_stats().hit_tokens > st.hit_tokens);
}

#[test]
fn salts_separate_tenants_and_identity_separates_models() {
    let prompt = tokens(70, 30);
    let mut plain = engine(ROOMY, false);
    let want = solo(&mut plain, &prompt, greedy(6));
    let mut e = engine(ROOMY, true);
    // (salt, prompt tokens expected from the cache)
    for (salt, hit) in [("a", 0usize), ("b", 0), ("a", 24), ("", 0), ("b", 24)] {
        let s = e.prefix_stats();
        let mut seen = Vec::new();
        let r = run_hooked(&mut e, &[now(&prompt, salted(6, salt))], |e, r| {
            seen.extend(r.id(0).and_then(|id| e.cached_tokens(id)));
        });
        assert_eq!(r.out[0], want, "salt {salt:?}");
        assert_eq!(delta(s, e.prefix_stats()).hit_tokens, hit as u64, "salt {salt:?}");
        assert!(!seen.is_empty() && seen.iter().all(|&c| c == hit), "salt {salt:?}: {seen:?}");
    }

    // The digest names the blocks under the engine's identity (and the request's salt) only.
    let mut one = engine_with(ROOMY, Some("model-one"));
    solo(&mut one, &prompt, greedy(6));
    let other = tokens(71, 20);
    solo(&mut one, &other, salted(6, "t"));
    let digest = one.cache_digest(usize::MAX);
    let bs = ROOMY.block_size;
    let names = |identity: &str, salt: &str, p: &[u32]| -> Vec<u64> {
        block_hashes(chain_root(identity, salt), p, bs).into_iter().map(|h| h.short()).collect()
    };
    let ours = names("model-one", "", &prompt);
    assert_eq!(ours.len(), 3);
    assert!(ours.iter().all(|h| digest.contains(h)), "{ours:x?} not all in {digest:x?}");
    let salted_ours = names("model-one", "t", &other);
    assert_eq!(salted_ours.len(), 2);
    assert!(salted_ours.iter().all(|h| digest.contains(h)));
    for (identity, salt, p) in
        [("model-two", "", &prompt), ("model-one", "", &other), ("model-one", "t", &prompt)]
    {
        let theirs = names(identity, salt, p);
        assert!(!theirs.is_empty());
        assert!(
            theirs.iter().all(|h| !digest.contains(h)),
            "{identity}/{salt:?}: {theirs:x?} in {digest:x?}"
        );
    }
    assert_eq!(one.cache_digest(2).len(), 2, "the limit holds");
}

#[test]
fn ngram_speculation_with_the_cache_generates_the_same() {
    // Prompts with repeats (the drafter finds matches) behind a shared prefix.
    let prefix = tokens(80, 16);
    let prompts: Vec<Vec<u32>> = (0..5u32)
        .map(|i| {
            let motif = tokens(81 + i, 3 + i as usize);
            let rep: Vec<u32> = motif.iter().cycle().take(12 + 2 * i as usize).copied().collect();
            cat(&prefix, &rep)
        })
        .collect();
    let mut plain = engine(ROOMY, false);
    let mut spec = with_ngram(engine(ROOMY, true));
    // All at once, the same again (every prompt hits), then staggered.
    let together: Vec<Arrival> = prompts.iter().map(|p| now(p, greedy(24))).collect();
    let staggered: Vec<Arrival> =
        prompts.iter().enumerate().map(|(i, p)| Arrival { at: 3 * i, ..now(p, greedy(24)) }).collect();
    let mut outs = Vec::new();
    for (name, reqs) in [("together", &together), ("again", &together), ("staggered", &staggered)] {
        let want = run(&mut plain, reqs).out;
        let s = spec.prefix_stats();
        let got = run(&mut spec, reqs).out;
        assert_eq!(got, want, "{name}");
        let d = delta(s, spec.prefix_stats());
        if name == "again" {
            let reusable: usize = prompts.iter().map(|p| reusable_blocks(p.len(), 8) * 8).sum();
            assert_eq!(d.hit_tokens as usize, reusable, "{name}: {d:?}");
        }
        outs = got;
    }
    let st = spec.spec_stats();
    assert!(st.proposed > 0 && st.accepted > 0, "{st:?}");

    // Blocks of generated tokens (accepted drafts among them) were cached with the right K/V: a
    // prompt that continues an earlier output reuses them and still generates the same.
    for (p, out) in prompts.iter().zip(&outs) {
        let next = cat(p, &out[..16]);
        let want = solo(&mut plain, &next, greedy(8));
        let s = spec.prefix_stats();
        assert_eq!(solo(&mut spec, &next, greedy(8)), want);
        let hit = delta(s, spec.prefix_stats()).hit_tokens as usize;
        assert_eq!(hit, reusable_blocks(next.len(), 8) * 8, "continuation of {} tokens", next.len());
        assert!(hit > p.len(), "blocks of generated tokens were reused ({hit} tokens)");
    }
}

// ---- disaggregation in process ----

/// A prefill-only run on `p`: the held sequence and its first token.
fn prefill(p: &mut Engine, prompt: &[u32], params: &SamplingParams) -> (SeqId, u32) {
    let seq = p.add_prefill_request(prompt.to_vec(), params.clone()).expect("prefill request");
    let mut first = None;
    for ev in drain(p) {
        match ev {
            SeqEvent::Prefilled { seq: s, token, .. } if s == seq => first = Some(token),
            other => panic!("unexpected event during prefill: {other:?}"),
        }
    }
    (seq, first.expect("Prefilled event"))
}

/// Decodes an adopted sequence on `d` to the end: its tokens after `first`.
fn decode(d: &mut Engine, seq: SeqId, first: u32) -> Vec<u32> {
    let mut out = vec![first];
    let mut finished = false;
    for ev in drain(d) {
        match ev {
            SeqEvent::Token { seq: s, token, .. } if s == seq => out.push(token),
            SeqEvent::Finished { seq: s, .. } if s == seq => finished = true,
            other => panic!("unexpected event: {other:?}"),
        }
    }
    assert!(finished);
    assert_quiescent(d);
    out
}

#[test]
fn a_decode_engine_reuses_its_cache_for_transferred_prompts() {
    let setup = Setup { blocks: 32, budget: 16, ..ROOMY };
    let params = greedy(10);
    let long = tokens(90, 27); // 3 full blocks and 3 tokens
    let first_prompt = cat(&long, &tokens(91, 6)); // 33 tokens, 5 blocks
    let second_prompt = cat(&long, &tokens(92, 10)); // 37 tokens, 5 blocks, the first 3 shared
    let mut reference = engine(setup, false);
    let want1 = solo(&mut reference, &first_prompt, params.clone());
    let want2 = solo(&mut reference, &second_prompt, params.clone());
    let mut p = engine(setup, true);
    let mut d = engine(setup, true);

    // First request: nothing cached on D; every block is transferred.
    let r1 = d.reserve_prompt(&first_prompt, "").expect("reserve");
    assert_eq!((r1.cached_blocks, r1.blocks.len()), (0, 5));
    let (pseq, first) = prefill(&mut p, &first_prompt, &params);
    let src = p.block_table(pseq).unwrap().to_vec();
    copy_blocks(&p, &src, &mut d, r1.id, &r1.blocks);
    p.release_prefilled(pseq).unwrap();
    assert_quiescent(&p);
    let seq = d.add_prefilled(r1.id, first_prompt.clone(), first, params.clone()).expect("add_prefilled");
    assert_eq!(d.cached_tokens(seq), Some(0));
    assert_eq!(decode(&mut d, seq, first), want1);

    // Second request: D holds the shared prefix (in the blocks the first transfer filled) and
    // pins it; only the last two blocks are transferred.
    let s = d.prefix_stats();
    let r2 = d.reserve_prompt(&second_prompt, "").expect("reserve");
    assert_eq!((r2.cached_blocks, r2.blocks.len()), (3, 2));
    assert_eq!(delta(s, d.prefix_stats()).hit_tokens, 24);
    assert_eq!(d.reservation_blocks(r2.id), Some(r2.blocks.clone()));
    assert_eq!(d.kv_stats().pinned, 3);
    let pinned = &r1.blocks[..3];
    assert!(r2.blocks.iter().all(|b| !pinned.contains(b)));
    d.check_kv().expect("a reservation with pins is a live owner");

    // Misuse: a cached (pinned) block cannot be written; another prompt or salt cannot adopt it
    // once filled.
    let (k, v) = p.backend().read_block(0, 0).unwrap();
    let err = d.write_reserved_block(r2.id, 0, pinned[0], &k, &v).unwrap_err();
    assert!(matches!(err, EngineError::InvalidRequest(ref m) if m.contains("not a block")), "{err}");
    let (pseq, first) = prefill(&mut p, &second_prompt, &params);
    let src = p.block_table(pseq).unwrap().to_vec();
    assert_eq!(src.len(), 5);
    copy_blocks(&p, &src[r2.cached_blocks..], &mut d, r2.id, &r2.blocks);
    p.release_prefilled(pseq).unwrap();
    let mut other = second_prompt.clone();
    other[3] = if other[3] == 5 { 6 } else { 5 };
    let err = d.add_prefilled(r2.id, other, 7, params.clone()).unwrap_err();
    assert!(matches!(err, EngineError::InvalidRequest(ref m) if m.contains("another prompt")), "{err}");
    let err = d.add_prefilled(r2.id, second_prompt.clone(), 7, salted(10, "x")).unwrap_err();
    assert!(matches!(err, EngineError::InvalidRequest(ref m) if m.contains("another prompt")), "{err}");
    assert_eq!(d.reservation_blocks(r2.id), Some(r2.blocks.clone()), "refusals keep the reservation");
    assert_eq!(d.kv_stats().pinned, 3);
    d.check_kv().unwrap();

    let seq = d.add_prefilled(r2.id, second_prompt.clone(), first, params.clone()).expect("add_prefilled");
    assert_eq!(d.cached_tokens(seq), Some(24));
    assert_eq!(d.kv_stats().pinned, 0, "adopted pins become holds");
    assert_eq!(decode(&mut d, seq, first), want2);

    // Released unused, a reservation's pins go back to the cache and nothing stays in use.
    let cached_before = d.kv_stats().cached;
    let r3 = d.reserve_prompt(&second_prompt, "").expect("reserve");
    assert_eq!((r3.cached_blocks, r3.blocks.len()), (4, 1));
    let s = d.kv_stats();
    assert_eq!((s.pinned, s.raw_reserved), (4, 1));
    assert_eq!(s.used, 5, "{s:?}");
    assert!(d.release_reservation(r3.id).unwrap());
    assert_quiescent(&d);
    assert_eq!(d.kv_stats().cached, cached_before);

    // A prompt of one block pins nothing: its only block holds the last token.
    let r4 = d.reserve_prompt(&second_prompt[..8], "").expect("reserve");
    assert_eq!((r4.cached_blocks, r4.blocks.len()), (0, 1));
    assert!(d.release_reservation(r4.id).unwrap());
    assert_quiescent(&d);
}
