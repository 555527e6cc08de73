//! LoRA adapters against PEFT (`tests/reference/make_lora_fixtures.py`): adapters made with
//! transformers + PEFT over the tiny reference models, each with all-position logits and greedy
//! continuations recorded under it. On the CPU backend with an f32 KV pool and f32 activations
//! (the reference-parity setting): logits within 2e-3 of PEFT's and the same argmax at every
//! position; greedy tokens through the engine's scheduler equal to PEFT's; a pass mixing
//! adapters (and the base) gives each chunk exactly what it gets alone; the GGUF conversion of
//! an adapter is the same adapter; adapters made for another model are refused; the prefix cache
//! shares nothing across adapters.
//!
//! The fixtures are checked in: a missing one fails these tests (it is not skipped).

use std::path::PathBuf;
use std::sync::Arc;

use tandem_engine::backend::{Activations, Backend, BackendOptions, ComputeDtype, LogitsRequest, SeqChunk};
use tandem_engine::config::ModelConfig;
use tandem_engine::cpu::CpuBackend;
use tandem_engine::gguf::GgufFile;
use tandem_engine::kv::{BlockAllocator, KvDtype, WriteMode};
use tandem_engine::loader::{load_model, LoadedModel};
use tandem_engine::lora::{load::load as load_adapter, LoraAdapter, LoraTarget, Proj};
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SchedulerOptions, SeqEvent};
use tandem_engine::EngineError;

#[path = "../../tests/reference/fixture_reader.rs"]
mod fixture_reader;
use fixture_reader::{argmax, fixture, read_f32, read_reference_all, Prompt};

/// The reference-parity tolerance (reference_parity.rs): f32 against transformers' f32.
const TOL: f32 = 2e-3;
/// Adapter slots of the backends here.
const SLOTS: usize = 4;

fn adapter_dir(base: &str, name: &str) -> PathBuf {
    fixture(&format!("lora/{base}/{name}"))
}

/// The adapter's recorded prompts (the fixture's `reference.json` and `logits.f32`).
fn reference(base: &str, name: &str) -> (usize, Vec<Prompt>) {
    let r = read_reference_all(&format!("lora/{base}/{name}"));
    assert!(!r.1.is_empty(), "{base}/{name}: no prompts recorded");
    r
}

/// The base fixture's recorded prompt with the same ids as `p`.
fn base_prompt(base: &str, p: &Prompt) -> Prompt {
    let (_, all) = read_reference_all(base);
    all.into_iter().find(|b| b.ids == p.ids).unwrap_or_else(|| panic!("{base}: no base prompt {:?}", p.text))
}

fn load(base: &str) -> LoadedModel {
    load_model(&fixture(base)).unwrap_or_else(|e| panic!("loading {base}: {e}"))
}

fn adapter(base: &str, name: &str, c: &ModelConfig) -> LoraAdapter {
    let dir = adapter_dir(base, name);
    load_adapter(name, &dir, c).unwrap_or_else(|e| panic!("loading adapter {}: {e}", dir.display()))
}

fn options(max_batch_tokens: usize) -> BackendOptions {
    BackendOptions {
        num_blocks: 64,
        block_size: 8,
        max_batch_tokens,
        dtype: ComputeDtype::F32,
        // Exact parity needs an exact KV cache and f32 activations (the fixtures' weights are
        // f32/f16/bf16, which the CPU multiplies in f32 whatever this says; it matters for
        // quantized weights only, and is set so the setting is the reference one everywhere).
        kv_dtype: Some(KvDtype::F32),
        activations: Activations::F32,
        max_adapters: SLOTS,
        ..Default::default()
    }
}

fn backend(m: LoadedModel) -> CpuBackend {
    CpuBackend::new(m.config, m.weights, options(512)).unwrap()
}

/// One pass over `chunks` (tokens, adapter slot), each a new sequence from position 0, all
/// positions' logits of each.
fn forward(be: &mut CpuBackend, chunks: &[(&[u32], Option<u16>)]) -> Vec<Vec<f32>> {
    let mut alloc = BlockAllocator::new(64, 8);
    let tables: Vec<Vec<u32>> = chunks
        .iter()
        .enumerate()
        .map(|(i, (t, _))| {
            alloc.add_sequence(i as u64 + 1, t.len()).unwrap();
            alloc.block_table(i as u64 + 1).unwrap().to_vec()
        })
        .collect();
    let batch: Vec<SeqChunk<'_>> = chunks
        .iter()
        .zip(&tables)
        .map(|((tokens, slot), table)| SeqChunk {
            tokens,
            start_pos: 0,
            block_table: table,
            logits: LogitsRequest::All,
            write: WriteMode::Direct,
            adapter: *slot,
        })
        .collect();
    let out = be.forward(&batch).unwrap();
    for i in 0..chunks.len() {
        alloc.free_sequence(i as u64 + 1).unwrap();
    }
    out
}

/// Largest |difference| between `got` and the reference, asserting the shape, the tolerance and
/// the argmax at every position.
fn check_logits(got: &[f32], p: &Prompt, vocab: usize, what: &str) -> f32 {
    assert_eq!(got.len(), p.logits.len(), "{what}: logits shape");
    let mut max_err = 0f32;
    for (pos, (g, r)) in got.chunks(vocab).zip(p.logits.chunks(vocab)).enumerate() {
        assert_eq!(argmax(g), argmax(r), "{what} position {pos}: argmax differs");
        max_err = g.iter().zip(r).fold(max_err, |m, (a, b)| m.max((a - b).abs()));
    }
    assert!(max_err < TOL, "{what}: max abs logit error {max_err} (tolerance {TOL})");
    max_err
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Every recorded prompt of adapter `name` over `base`: logits within tolerance of PEFT's and
/// far from the base model's (so the adapter was applied, not skipped).
fn logits_parity(base: &str, name: &str) {
    let (vocab, prompts) = reference(base, name);
    let m = load(base);
    assert_eq!(m.config.vocab_size, vocab);
    let a = adapter(base, name, &m.config);
    let mut be = backend(m);
    be.set_adapter(2, Some(Arc::new(a))).unwrap();
    let mut worst = 0f32;
    for (pi, p) in prompts.iter().enumerate() {
        let got = forward(&mut be, &[(&p.ids, Some(2))]).remove(0);
        worst = worst.max(check_logits(&got, p, vocab, &format!("{base}/{name} prompt {pi}")));
        let plain = base_prompt(base, p);
        let moved = max_diff(&plain.logits, &p.logits);
        assert!(moved > 100.0 * TOL, "{base}/{name} prompt {pi}: the adapter moves logits by only {moved}");
        let without = forward(&mut be, &[(&p.ids, None)]).remove(0);
        check_logits(&without, &plain, vocab, &format!("{base} prompt {pi} without the adapter"));
    }
    println!("{base}/{name}: max abs logit difference from PEFT {worst:.3e}");
}

#[test]
fn llama_adapters_match_peft_logits() {
    for name in ["a", "b", "c"] {
        logits_parity("llama-gqa", name);
    }
}

/// Phi-3's fused `qkv_proj` and `gate_up_proj`, split into Q/K/V and gate/up deltas.
#[test]
fn phi3_fused_adapter_matches_peft_logits() {
    logits_parity("phi3", "a");
}

/// Gemma 3: GeGLU, q/k norms, sliding-window layers (the second prompt is longer than the window).
#[test]
fn gemma3_adapter_matches_peft_logits() {
    logits_parity("gemma3", "a");
}

fn greedy(p: &Prompt, adapter: &str) -> SamplingParams {
    SamplingParams {
        max_tokens: p.greedy.len(),
        ignore_eos: !p.stopped_at_eos,
        adapter: adapter.into(),
        ..SamplingParams::greedy()
    }
}

fn engine(base: &str, max_batch_tokens: usize, adapters: &[&str]) -> Engine {
    let m = load(base);
    let tok = m.tokenizer.clone();
    let loaded: Vec<LoraAdapter> = adapters.iter().map(|n| adapter(base, n, &m.config)).collect();
    let be = CpuBackend::new(m.config, m.weights, options(max_batch_tokens)).unwrap();
    let mut eng = Engine::new(Box::new(be), tok, SchedulerOptions { max_batch_tokens, max_num_seqs: 16 });
    for a in loaded {
        eng.add_adapter(a).unwrap();
    }
    eng
}

/// Greedy continuations through `Engine::generate`, one request at a time, under each adapter.
#[test]
fn greedy_generation_matches_peft() {
    for (base, names) in [("llama-gqa", &["a", "b", "c"][..]), ("phi3", &["a"][..]), ("gemma3", &["a"][..])] {
        let mut eng = engine(base, 512, names);
        for name in names {
            let (_, prompts) = reference(base, name);
            for (pi, p) in prompts.iter().enumerate() {
                let out = eng.generate(p.ids.clone(), greedy(p, name), |_| {}).unwrap();
                assert_eq!(out.token_ids, p.greedy, "{base}/{name} prompt {pi}: greedy tokens");
                assert_ne!(
                    p.greedy,
                    base_prompt(base, p).greedy,
                    "{base}/{name} prompt {pi}: same as the base"
                );
                eng.check_kv().unwrap();
            }
        }
    }
}

/// Every llama-gqa prompt under a, b, c and the base at once, so that prefill chunks and decode
/// steps mix adapters in one pass (and, with a budget of 7 tokens, prompts are cut into chunks
/// taking the per-row kernels): each sequence gets its solo reference tokens.
#[test]
fn mixed_adapter_batches_generate_each_reference() {
    let base = "llama-gqa";
    for budget in [512, 7] {
        let mut eng = engine(base, budget, &["a", "b", "c"]);
        let mut want = Vec::new();
        for name in ["a", "b", "c", ""] {
            let prompts = if name.is_empty() {
                let (_, a) = reference(base, "a");
                a.iter().map(|p| base_prompt(base, p)).collect()
            } else {
                reference(base, name).1
            };
            for p in prompts {
                let id = eng.add_request(p.ids.clone(), greedy(&p, name)).unwrap();
                want.push((id, name, p.greedy));
            }
        }
        let mut got: Vec<Vec<u32>> = vec![Vec::new(); want.len()];
        let mut finished = 0;
        for _ in 0..10_000 {
            for ev in eng.step().unwrap() {
                match ev {
                    SeqEvent::Token { seq, token, .. } => {
                        got[want.iter().position(|w| w.0 == seq).unwrap()].push(token)
                    }
                    SeqEvent::Finished { .. } => finished += 1,
                    SeqEvent::Failed { error, .. } => panic!("{error}"),
                    other => panic!("unexpected event {other:?}"),
                }
            }
            eng.check_kv().unwrap();
            if finished == want.len() {
                break;
            }
        }
        assert_eq!(finished, want.len(), "budget {budget}: not every sequence finished");
        for ((_, name, tokens), got) in want.iter().zip(&got) {
            assert_eq!(got, tokens, "budget {budget}, adapter {name:?}: greedy tokens");
        }
        let s = eng.kv_stats();
        assert_eq!(s.free, s.total, "budget {budget}: blocks leaked");
    }
}

/// One forward pass whose chunks run adapter a, adapter b, no adapter and adapter c (slots 0, 1,
/// none, 3; the same prompt twice, under a and the base, and another prompt under b and c) gives
/// each chunk exactly, bit for bit, the logits it gets alone, and PEFT's within tolerance.
///
/// Exact, because every chunk here is longer than `cpu::matmul::SMALL_N` (8 tokens), so alone
/// and mixed every product (base and low-rank) takes the tiled kernels, which compute each
/// token's dot products with the same operations whichever tokens share its tiles; attention is
/// per sequence; and the delta of an adapter is added only to its own chunks' rows.
#[test]
fn mixed_pass_gives_each_chunk_its_solo_logits() {
    let base = "llama-gqa";
    let m = load(base);
    let (vocab, ra) = reference(base, "a");
    let (_, rb) = reference(base, "b");
    let (_, rc) = reference(base, "c");
    let mut be = CpuBackend::new(m.config.clone(), m.weights, options(512)).unwrap();
    be.set_adapter(0, Some(Arc::new(adapter(base, "a", &m.config)))).unwrap();
    be.set_adapter(1, Some(Arc::new(adapter(base, "b", &m.config)))).unwrap();
    be.set_adapter(3, Some(Arc::new(adapter(base, "c", &m.config)))).unwrap();
    let plain = base_prompt(base, &ra[0]);
    assert_eq!(rb[1].ids, rc[1].ids);
    let cases: [(&Prompt, Option<u16>, &str); 4] =
        [(&ra[0], Some(0), "a"), (&rb[1], Some(1), "b"), (&plain, None, "base"), (&rc[1], Some(3), "c")];
    for (p, _, what) in &cases {
        assert!(p.ids.len() > 8, "{what}: the prompt must be longer than SMALL_N for exact equality");
    }
    let chunks: Vec<(&[u32], Option<u16>)> = cases.iter().map(|(p, s, _)| (&p.ids[..], *s)).collect();
    let mixed = forward(&mut be, &chunks);
    for (i, (p, slot, what)) in cases.iter().enumerate() {
        let alone = forward(&mut be, &[(&p.ids, *slot)]).remove(0);
        let same = mixed[i].len() == alone.len()
            && mixed[i].iter().zip(&alone).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same,
            "chunk {i} ({what}): mixed logits differ from solo by up to {}",
            max_diff(&mixed[i], &alone)
        );
        check_logits(&mixed[i], p, vocab, &format!("mixed chunk {i} ({what})"));
    }
    // The two chunks of one prompt (a and the base) and of the other (b and c) really differ.
    assert!(max_diff(&mixed[0], &mixed[2]) > 100.0 * TOL);
    assert!(max_diff(&mixed[1], &mixed[3]) > 100.0 * TOL);
}

/// `b.gguf` (adapter b as llama.cpp's converter lays it out: A and B in GGML order, Q and K's B
/// rows interleaved, alpha under llama.cpp's `alpha / r` rule) is the PEFT adapter b: the same
/// deltas and scales, hence the same id (the id hashes targets, ranks, scales and the f32
/// weights; the file is f32, the rows are only permuted, and its alpha, 8 · f32(16/√8), gives
/// exactly PEFT's f32 scale when divided by the rank 8), and the same logits.
#[test]
fn gguf_adapter_is_the_peft_adapter() {
    let base = "llama-gqa";
    let m = load(base);
    let c = m.config.clone();
    let peft = adapter(base, "b", &c);
    let path = fixture("lora/llama-gqa/b.gguf");
    let gguf = load_adapter("b", &path, &c).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(gguf.weights.len(), 7 * c.num_layers);
    assert_eq!(gguf.weights.len(), peft.weights.len());
    for (g, p) in gguf.weights.iter().zip(&peft.weights) {
        let t = p.target;
        assert_eq!(g.target, t);
        assert_eq!((g.rank, g.scale), (p.rank, p.scale), "{} of layer {}: rank and scale", t.proj, t.layer);
        assert!(g.a == p.a, "{} of layer {}: A differs by up to {}", t.proj, t.layer, max_diff(&g.a, &p.a));
        assert!(g.b == p.b, "{} of layer {}: B differs by up to {}", t.proj, t.layer, max_diff(&g.b, &p.b));
    }
    assert_eq!(gguf.id, peft.id);
    assert_eq!(peft.weights[0].scale, (16.0f64 / 8f64.sqrt()) as f32, "rsLoRA scale");

    // The file's Q and K rows are permuted (so the unpermuting above was exercised), V's not.
    let g = GgufFile::open(&path).unwrap();
    let raw = |name: &str| {
        let info = g.tensor(name).unwrap();
        g.bytes()[g.tensor_range(info)]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect::<Vec<f32>>()
    };
    let w = |proj| peft.weight(LoraTarget { layer: 1, proj }).unwrap();
    assert_ne!(raw("blk.1.attn_q.weight.lora_b"), w(Proj::Q).b);
    assert_ne!(raw("blk.1.attn_k.weight.lora_b"), w(Proj::K).b);
    assert_eq!(raw("blk.1.attn_v.weight.lora_b"), w(Proj::V).b);
    assert_eq!(raw("blk.1.attn_q.weight.lora_a"), w(Proj::Q).a);

    let (vocab, prompts) = reference(base, "b");
    let mut be = backend(m);
    be.set_adapter(0, Some(Arc::new(gguf))).unwrap();
    let mut worst = 0f32;
    for (pi, p) in prompts.iter().enumerate() {
        let got = forward(&mut be, &[(&p.ids, Some(0))]).remove(0);
        worst = worst.max(check_logits(&got, p, vocab, &format!("b.gguf prompt {pi}")));
    }
    println!("llama-gqa/b.gguf: max abs logit difference from PEFT {worst:.3e}");
}

fn lora_msg(e: EngineError) -> String {
    match e {
        EngineError::Lora { msg, .. } => msg,
        other => panic!("expected a LoRA error, got {other:?}"),
    }
}

/// Adapters that do not fit, or are not there, are refused by name; so is a request naming an
/// adapter the engine does not hold.
#[test]
fn refusals_name_the_problem() {
    let qwen3 = load("qwen3").config;
    // llama-gqa's q_proj is 64 → 64; qwen3's is 64 → 128 (4 heads of 32).
    let e = lora_msg(load_adapter("a", &adapter_dir("llama-gqa", "a"), &qwen3).unwrap_err());
    assert!(e.contains("q_proj of layer 0") && e.contains("64 → 128"), "{e}");
    let e = lora_msg(load_adapter("b", &fixture("lora/llama-gqa/b.gguf"), &qwen3).unwrap_err());
    assert!(e.contains("architecture \"llama\"") && e.contains("Qwen3"), "{e}");
    // Phi-3's fused adapter on Gemma 3: its gate_up_proj B has 2 × 128 rows, Gemma's gate and up
    // 2 × 160.
    let gemma3 = load("gemma3").config;
    let e = lora_msg(load_adapter("p", &adapter_dir("phi3", "a"), &gemma3).unwrap_err());
    assert!(e.contains("gate_up_proj of layer 0") && e.contains("256 rows") && e.contains("320"), "{e}");

    let llama = load("llama-gqa").config;
    let missing = adapter_dir("llama-gqa", "no-such-adapter");
    let e = lora_msg(load_adapter("x", &missing, &llama).unwrap_err());
    assert!(e.contains("cannot read it"), "{e}");
    // A model directory is not an adapter.
    let e = lora_msg(load_adapter("x", &fixture("llama-gqa"), &llama).unwrap_err());
    assert!(e.contains("no adapter_config.json"), "{e}");

    let mut eng = engine("llama-gqa", 512, &["a"]);
    let (_, prompts) = reference("llama-gqa", "a");
    let p = &prompts[0];
    match eng.add_request(p.ids.clone(), greedy(p, "zzz")) {
        Err(EngineError::UnknownAdapter(n)) => assert_eq!(n, "zzz"),
        other => panic!("expected UnknownAdapter, got {other:?}"),
    }
    match eng.generate(p.ids.clone(), greedy(p, "b"), |_| {}) {
        Err(EngineError::UnknownAdapter(n)) => assert_eq!(n, "b"),
        other => panic!("expected UnknownAdapter, got {other:?}"),
    }
    // The adapter it holds still runs.
    assert_eq!(eng.generate(p.ids.clone(), greedy(p, "a"), |_| {}).unwrap().token_ids, p.greedy);
}

/// Runs one request to the end; returns its tokens and the prompt tokens the prefix cache gave it.
fn run_cached(eng: &mut Engine, p: &Prompt, adapter: &str) -> (Vec<u32>, usize) {
    let id = eng.add_request(p.ids.clone(), greedy(p, adapter)).unwrap();
    let (mut tokens, mut cached, mut done) = (Vec::new(), None, false);
    for _ in 0..1000 {
        for ev in eng.step().unwrap() {
            match ev {
                SeqEvent::Token { seq, token, .. } if seq == id => tokens.push(token),
                SeqEvent::Finished { seq, .. } if seq == id => done = true,
                SeqEvent::Failed { error, .. } => panic!("{error}"),
                other => panic!("unexpected event {other:?}"),
            }
        }
        if cached.is_none() {
            cached = eng.cached_tokens(id);
        }
        if done {
            break;
        }
    }
    assert!(done, "the request did not finish");
    eng.check_kv().unwrap();
    (tokens, cached.expect("cached tokens known after the first step"))
}

/// The prefix cache never serves a prompt's blocks across adapters or between an adapter and
/// the base: the same prompt under a, then b, then the base computes its prompt each time (and
/// gets its own reference tokens); a second run under a reuses a's blocks.
#[test]
fn prefix_cache_is_per_adapter() {
    let base = "llama-gqa";
    let m = load(base);
    let tok = m.tokenizer.clone();
    let (a, b) = (adapter(base, "a", &m.config), adapter(base, "b", &m.config));
    let be = CpuBackend::new(m.config, m.weights, options(512)).unwrap();
    let mut eng =
        Engine::new(Box::new(be), tok, SchedulerOptions { max_batch_tokens: 512, max_num_seqs: 16 })
            .with_prefix_cache("lora-parity");
    eng.add_adapter(a).unwrap();
    eng.add_adapter(b).unwrap();
    let (_, ra) = reference(base, "a");
    let (_, rb) = reference(base, "b");
    // The longest prompt: several full blocks of 8.
    let i = (0..ra.len()).max_by_key(|&i| ra[i].ids.len()).unwrap();
    let (pa, pb) = (&ra[i], &rb[i]);
    assert_eq!(pa.ids, pb.ids);
    assert!(pa.ids.len() >= 16, "the prompt must fill blocks");
    let plain = base_prompt(base, pa);

    let hits = |eng: &Engine| eng.prefix_stats().hit_tokens;
    let (t, cached) = run_cached(&mut eng, pa, "a");
    assert_eq!((t, cached, hits(&eng)), (pa.greedy.clone(), 0, 0), "first run under a");
    let (t, cached) = run_cached(&mut eng, pb, "b");
    assert_eq!((t, cached, hits(&eng)), (pb.greedy.clone(), 0, 0), "b after a");
    let (t, cached) = run_cached(&mut eng, &plain, "");
    assert_eq!((t, cached, hits(&eng)), (plain.greedy.clone(), 0, 0), "the base after a and b");
    let (t, cached) = run_cached(&mut eng, pa, "a");
    assert_eq!(t, pa.greedy, "second run under a");
    let full = (pa.ids.len() - 1) / 8 * 8;
    assert!(cached >= 8 && cached <= full, "second run under a: {cached} tokens cached (at most {full})");
    assert_eq!(hits(&eng), cached as u64);
    let s = eng.kv_stats();
    assert_eq!(s.free + s.cached, s.total, "blocks leaked");
}

/// The adapter files are small and the recorded logits are the fixtures' convention.
#[test]
fn fixtures_are_complete() {
    for (base, name) in
        [("llama-gqa", "a"), ("llama-gqa", "b"), ("llama-gqa", "c"), ("phi3", "a"), ("gemma3", "a")]
    {
        let dir = adapter_dir(base, name);
        for f in ["adapter_config.json", "adapter_model.safetensors", "reference.json", "logits.f32"] {
            assert!(dir.join(f).is_file(), "{}: missing {f}", dir.display());
        }
        let (vocab, prompts) = reference(base, name);
        let n: usize = prompts.iter().map(|p| p.ids.len()).sum();
        assert_eq!(read_f32(&dir.join("logits.f32")).len(), n * vocab, "{base}/{name}: logits.f32 size");
    }
}
