//! LoRA adapters in the scheduler: more adapters than backend slots (sequences wait for a slot,
//! never fail), each sequence's tokens independent of the others sharing its passes, requests
//! naming an unknown adapter or another adapter's id refused by name, an adapter unloaded while
//! a sequence runs it, and speculation under an adapter. The adapters are random, made here, so
//! they change the model's output visibly; parity with PEFT itself is `lora_parity.rs`'s.

use std::sync::Arc;

use std::sync::atomic::{AtomicUsize, Ordering};

use tandem_engine::backend::{Backend, BackendOptions, SeqChunk};
use tandem_engine::config::ModelConfig;
use tandem_engine::cpu::CpuBackend;
use tandem_engine::error::EngineError;
use tandem_engine::loader::load_model;
use tandem_engine::lora::{LoraAdapter, LoraTarget, LoraWeight, Proj};
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SchedulerOptions, SeqEvent};
use tandem_engine::spec::ngram::NgramDrafter;
use tandem_engine::spec::SpecOptions;

#[macro_use]
mod sched_common;
use sched_common::{fixture, greedy, run};

const MODEL: &str = "llama-gqa";

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// A random adapter of rank `rank` over `projs` of every layer.
fn adapter(c: &ModelConfig, name: &str, seed: u64, rank: usize, projs: &[Proj]) -> LoraAdapter {
    let mut rng = Rng(seed);
    let mut weights = Vec::new();
    for layer in 0..c.num_layers {
        for &proj in projs {
            let (din, dout) = proj.dims(c);
            weights.push(LoraWeight {
                target: LoraTarget { layer: layer as u32, proj },
                rank,
                a: (0..rank * din).map(|_| 0.3 * rng.next()).collect(),
                b: (0..dout * rank).map(|_| 0.3 * rng.next()).collect(),
                scale: 2.0 / rank as f32,
            });
        }
    }
    LoraAdapter::new(name, std::path::Path::new(name), weights, c).expect("a valid adapter")
}

fn engine(max_adapters: usize, max_num_seqs: usize) -> (Engine, ModelConfig) {
    engine_with(max_adapters, max_num_seqs, |be| Box::new(be))
}

/// [`engine`] over the CPU backend as `wrap` wraps it.
fn engine_with(
    max_adapters: usize,
    max_num_seqs: usize,
    wrap: impl FnOnce(CpuBackend) -> Box<dyn Backend>,
) -> (Engine, ModelConfig) {
    let m = load_model(&fixture(MODEL)).expect("fixture model loads");
    let c = m.config.clone();
    let opts = BackendOptions {
        num_blocks: 256,
        block_size: 8,
        max_batch_tokens: 256,
        threads: 1,
        max_adapters,
        ..Default::default()
    };
    let be = CpuBackend::new(m.config, m.weights, opts).expect("backend");
    (Engine::new(wrap(be), m.tokenizer, SchedulerOptions { max_batch_tokens: 256, max_num_seqs }), c)
}

fn adapters(c: &ModelConfig) -> Vec<LoraAdapter> {
    vec![
        adapter(c, "a", 1, 4, &[Proj::Q, Proj::V]),
        adapter(c, "b", 2, 8, &Proj::ALL),
        adapter(c, "c", 3, 16, &[Proj::O, Proj::Gate, Proj::Up, Proj::Down]),
        adapter(c, "d", 4, 2, &[Proj::K, Proj::Down]),
    ]
}

fn under(name: &str, n: usize) -> SamplingParams {
    SamplingParams { adapter: name.into(), ..greedy(n) }
}

/// A prompt that repeats itself (so an n-gram drafter finds matches).
fn prompt(i: usize) -> Vec<u32> {
    let motif: Vec<u32> = (0..4 + i % 3).map(|j| ((i * 37 + j * 11) % 400 + 3) as u32).collect();
    motif.iter().cycle().take(12 + i % 5).copied().collect()
}

/// Each request's tokens run alone, on an engine with every adapter resident.
fn alone(names: &[&str]) -> Vec<Vec<u32>> {
    let (mut e, c) = engine(8, 1);
    for a in adapters(&c) {
        e.add_adapter(a).unwrap();
    }
    names.iter().enumerate().map(|(i, n)| run(&mut e, &[prompt(i)], &[under(n, 10)]).0.remove(0)).collect()
}

/// 16 sequences over four adapters and the base, on two slots: every sequence finishes with the
/// tokens it gets alone, adapters are swapped in and out (more loads than slots), and nothing is
/// left held.
#[test]
fn more_adapters_than_slots_wait_their_turn() {
    let names: Vec<&str> = (0..16).map(|i| ["a", "b", "", "c", "d"][i % 5]).collect();
    let want = alone(&names);
    // Each adapter changes what the base model says.
    for (i, n) in names.iter().enumerate() {
        if !n.is_empty() {
            let base = alone(&[""; 16])[i].clone();
            assert_ne!(want[i], base, "adapter {n} changes nothing for prompt {i}");
            break;
        }
    }
    let (mut e, c) = engine(2, 16);
    for a in adapters(&c) {
        e.add_adapter(a).unwrap();
    }
    let prompts: Vec<Vec<u32>> = (0..16).map(prompt).collect();
    let params: Vec<SamplingParams> = names.iter().map(|n| under(n, 10)).collect();
    let (got, _) = run(&mut e, &prompts, &params);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "sequence {i} (adapter '{}') differs from its run alone", names[i]);
    }
    assert!(e.adapter_loads() > 2, "four adapters on two slots loaded only {} times", e.adapter_loads());
    assert_eq!(e.adapters().iter().filter(|a| a.resident).count(), 2);
    assert!(e.adapters().iter().all(|a| a.sequences == 0));
    assert!(!e.has_work());
    let stats = e.adapter_stats().expect("an engine with slots has adapter stats");
    assert_eq!(
        (stats.held, stats.resident, stats.slots, stats.loads, stats.waiting),
        (4, 2, 2, e.adapter_loads(), 0)
    );
    assert!(engine(0, 1).0.adapter_stats().is_none(), "no slots, no stats");
}

/// Different adapters give the same prompt different tokens, and the base its own.
#[test]
fn the_same_prompt_under_each_adapter_gets_its_own_output() {
    let out = alone(&["a", "b", "c", "d", ""]);
    for i in 0..out.len() {
        for j in i + 1..out.len() {
            assert_ne!(out[i], out[j], "runs {i} and {j} agree");
        }
    }
}

#[test]
fn unknown_adapters_and_other_ids_are_refused_by_name() {
    let (mut e, c) = engine(2, 4);
    let a = adapter(&c, "a", 1, 4, &[Proj::Q]);
    let id = a.id.clone();
    e.add_adapter(a).unwrap();
    match e.add_request(prompt(0), under("nope", 4)) {
        Err(EngineError::UnknownAdapter(n)) => assert_eq!(n, "nope"),
        other => panic!("an unknown adapter was not refused: {other:?}"),
    }
    let wrong = SamplingParams { adapter_id: "0".repeat(32), ..under("a", 4) };
    match e.add_request(prompt(0), wrong) {
        Err(EngineError::AdapterMismatch { name, have, .. }) => {
            assert_eq!((name.as_str(), have), ("a", id.clone()))
        }
        other => panic!("another id was not refused: {other:?}"),
    }
    let right = SamplingParams { adapter_id: id, ..under("a", 4) };
    assert!(e.add_request(prompt(0), right).is_ok());
    // A second adapter under a held name with other weights is refused; the same one is not.
    let other = adapter(&c, "a", 9, 4, &[Proj::Q]);
    let err = e.add_adapter(other).unwrap_err().to_string();
    assert!(err.contains("'a'") && err.contains("unload"), "{err}");
    assert!(e.add_adapter(adapter(&c, "a", 1, 4, &[Proj::Q])).is_ok());
}

/// An adapter unloaded while a sequence runs it: the sequence finishes with the adapter's tokens;
/// new requests naming it are refused.
#[test]
fn unloading_lets_running_sequences_finish() {
    let want = alone(&["b"]).remove(0);
    let (mut e, c) = engine(2, 4);
    e.add_adapter(adapters(&c).remove(1)).unwrap();
    let id = e.add_request(prompt(0), under("b", 10)).unwrap();
    e.step().unwrap();
    e.step().unwrap();
    assert!(e.remove_adapter("b"));
    assert!(!e.remove_adapter("b"));
    assert!(matches!(e.add_request(prompt(1), under("b", 4)), Err(EngineError::UnknownAdapter(_))));
    let mut got = Vec::new();
    let mut steps = 0;
    // The two steps above produced the first tokens; collect from the start again instead.
    while e.has_work() {
        steps += 1;
        assert!(steps < 1000);
        for ev in e.step().unwrap() {
            if let tandem_engine::scheduler::SeqEvent::Token { seq, token, .. } = ev {
                if seq == id {
                    got.push(token);
                }
            }
        }
    }
    assert_eq!(got[..], want[want.len() - got.len()..], "the tail of its tokens differs");
    assert!(got.len() >= 7, "only {} tokens after the unload", got.len());
    assert!(e.adapters().is_empty());
    // Its slot is given back at the first step after nothing runs it: loaded again, it is made
    // resident again.
    e.step().unwrap();
    let loads = e.adapter_loads();
    e.add_adapter(adapters(&c).remove(1)).unwrap();
    assert!(!e.adapters()[0].resident, "the unloaded adapter kept its slot");
    run(&mut e, &[prompt(2)], &[under("b", 2)]);
    assert_eq!(e.adapter_loads(), loads + 1);
}

/// Speculation verifies under the sequence's adapter: n-gram drafts change nothing in the
/// greedy tokens.
#[test]
fn speculation_verifies_under_the_adapter() {
    let names = ["a", "b", "", "c"];
    let want = alone(&names);
    let (e, c) = engine(4, 4);
    let o = SpecOptions { max_draft: 4, adaptive: false, ngram_min: 1, ngram_max: 3, sampled_drafts: false };
    let mut e = e.with_speculation(Box::new(NgramDrafter::new(1, 3)), o).unwrap();
    for a in adapters(&c) {
        e.add_adapter(a).unwrap();
    }
    let prompts: Vec<Vec<u32>> = (0..4).map(prompt).collect();
    let params: Vec<SamplingParams> = names.iter().map(|n| under(n, 10)).collect();
    let (got, (proposed, _)) = run(&mut e, &prompts, &params);
    assert_eq!(got, want);
    assert!(proposed > 0, "the drafter proposed nothing: the test verified no draft");
}

/// A sequence keeps the adapter it was queued with: an `Arc` outlives the registry entry.
#[test]
fn adapter_ids_name_weights_not_names() {
    let (_, c) = engine(1, 1);
    let a = adapter(&c, "x", 5, 4, &[Proj::Q]);
    let b = adapter(&c, "y", 5, 4, &[Proj::Q]);
    let d = adapter(&c, "x", 6, 4, &[Proj::Q]);
    assert_eq!(a.id, b.id, "the same weights under two names are one adapter");
    assert_ne!(a.id, d.id, "other weights under one name are another");
    let _ = Arc::new(a);
}

/// A sequence adopted from a reservation (a decode worker's path: it never passes through the
/// queue) gets its adapter placed, and waits, holding its blocks, while every slot is in use.
#[test]
fn adopted_sequences_get_their_adapter_placed() {
    use tandem_engine::scheduler::SeqEvent;
    let (mut p, c) = engine(2, 4);
    let (mut d, _) = engine(1, 4);
    for a in adapters(&c) {
        p.add_adapter(a.clone()).unwrap();
        d.add_adapter(a).unwrap();
    }
    let want = alone(&["a", "b"]);
    // One sequence under `c` occupies the decode engine's only slot while two adopted sequences
    // (under `a` and `b`) arrive: they wait their turn, then finish with their own tokens.
    let busy = d.add_request(prompt(7), under("c", 30)).unwrap();
    let early = d.step().unwrap().iter().filter(|e| matches!(e, SeqEvent::Token { .. })).count();
    let mut adopted = Vec::new();
    for (i, name) in ["a", "b"].iter().enumerate() {
        let params = under(name, 10);
        let seq = p.add_prefill_request(prompt(i), params.clone()).unwrap();
        let mut first = None;
        while first.is_none() {
            for ev in p.step().unwrap() {
                if let SeqEvent::Prefilled { token, .. } = ev {
                    first = Some(token);
                }
            }
        }
        let first = first.unwrap();
        let (res, dst) = d.reserve(prompt(i).len()).unwrap();
        let src = p.block_table(seq).unwrap().to_vec();
        sched_common::copy_blocks(&p, &src, &mut d, res, &dst);
        p.release_prefilled(seq).unwrap();
        adopted.push((d.add_prefilled(res, prompt(i), first, params).unwrap(), first));
    }
    let mut out: std::collections::HashMap<u64, Vec<u32>> = Default::default();
    for &(s, first) in &adopted {
        out.insert(s, vec![first]);
    }
    let mut steps = 0;
    while d.has_work() {
        steps += 1;
        assert!(steps < 2000, "no progress");
        for ev in d.step().unwrap() {
            match ev {
                SeqEvent::Token { seq, token, .. } => out.entry(seq).or_default().push(token),
                SeqEvent::Failed { error, .. } => panic!("{error}"),
                _ => {}
            }
        }
        d.check_kv().unwrap();
    }
    for (i, (s, _)) in adopted.iter().enumerate() {
        assert_eq!(out[s], want[i], "adopted sequence {i} differs from its run alone");
    }
    assert_eq!(early + out[&busy].len(), 30);
    assert!(d.adapter_loads() >= 3, "one slot, three adapters: {} loads", d.adapter_loads());
}

/// The default mode keeps adapters' deltas in int8 with a scale per row (the exact mode in f32):
/// its logits stay within a stated tolerance of the exact ones, with the same argmax.
#[test]
fn int8_deltas_stay_within_tolerance_of_exact_ones() {
    use tandem_engine::backend::{Activations, Backend, LogitsRequest, SeqChunk};
    use tandem_engine::kv::WriteMode;
    let logits = |activations: Activations| -> Vec<f32> {
        let m = load_model(&fixture(MODEL)).expect("fixture model loads");
        let c = m.config.clone();
        let opts = BackendOptions {
            num_blocks: 64,
            block_size: 8,
            max_batch_tokens: 256,
            threads: 1,
            activations,
            kv_dtype: Some(tandem_engine::kv::KvDtype::F32),
            ..Default::default()
        };
        let mut be = CpuBackend::new(m.config, m.weights, opts).expect("backend");
        be.set_adapter(0, Some(Arc::new(adapters(&c).remove(1)))).unwrap();
        let p = prompt(3);
        let table: Vec<u32> = (0..p.len().div_ceil(8) as u32).collect();
        let chunk = SeqChunk {
            tokens: &p,
            start_pos: 0,
            block_table: &table,
            logits: LogitsRequest::All,
            write: WriteMode::Direct,
            adapter: Some(0),
        };
        be.forward(&[chunk]).unwrap().remove(0)
    };
    let (exact, fast) = (logits(Activations::F32), logits(Activations::Q16));
    let vocab = exact.len() / prompt(3).len();
    let max_diff = exact.iter().zip(&fast).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let scale = exact.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(max_diff > 0.0, "the default mode computed the exact deltas: the test checks nothing");
    assert!(max_diff <= 1e-2 * scale, "logits differ by {max_diff} (largest logit {scale})");
    let argmax = |r: &[f32]| r.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
    for (i, (e, f)) in exact.chunks(vocab).zip(fast.chunks(vocab)).enumerate() {
        assert_eq!(argmax(e), argmax(f), "position {i}");
    }
    eprintln!("int8 deltas: max logit difference {max_diff:.2e} (largest logit {scale:.2})");
}

fn small_engine(blocks: usize, budget: usize) -> (Engine, ModelConfig) {
    let m = load_model(&fixture(MODEL)).expect("fixture model loads");
    let c = m.config.clone();
    let opts = BackendOptions {
        num_blocks: blocks,
        block_size: 8,
        max_batch_tokens: budget,
        threads: 1,
        max_adapters: 1,
        ..Default::default()
    };
    let be = CpuBackend::new(m.config, m.weights, opts).expect("backend");
    (
        Engine::new(
            Box::new(be),
            m.tokenizer,
            SchedulerOptions { max_batch_tokens: budget, max_num_seqs: 4 },
        ),
        c,
    )
}

/// One slot, a small pool and a small step budget: long prompts under two adapters, queued behind
/// a running sequence, are prefilled in chunks while they contend for the slot; every sequence
/// finishes with the tokens it gets alone, and nothing stalls.
#[test]
fn chunked_prompts_contending_for_one_slot_get_their_own_tokens() {
    let long = |i: usize| -> Vec<u32> { (0..72).map(|j| ((i * 31 + j * 7) % 400 + 3) as u32).collect() };
    let want = {
        let (mut e, c) = small_engine(64, 256);
        for a in adapters(&c) {
            e.add_adapter(a).unwrap();
        }
        vec![
            run(&mut e, &[prompt(0)], &[under("a", 24)]).0.remove(0),
            run(&mut e, &[long(1)], &[under("b", 8)]).0.remove(0),
            run(&mut e, &[long(2)], &[under("a", 8)]).0.remove(0),
        ]
    };
    let (mut e, c) = small_engine(20, 16);
    for a in adapters(&c) {
        e.add_adapter(a).unwrap();
    }
    let r = e.add_request(prompt(0), under("a", 24)).unwrap();
    let mut out: std::collections::HashMap<u64, Vec<u32>> = Default::default();
    let collect = |e: &mut Engine, out: &mut std::collections::HashMap<u64, Vec<u32>>| {
        for ev in e.step().unwrap() {
            match ev {
                tandem_engine::scheduler::SeqEvent::Token { seq, token, .. } => {
                    out.entry(seq).or_default().push(token)
                }
                tandem_engine::scheduler::SeqEvent::Failed { error, .. } => panic!("{error}"),
                _ => {}
            }
        }
        e.check_kv().unwrap();
    };
    collect(&mut e, &mut out);
    collect(&mut e, &mut out);
    let p = e.add_request(long(1), under("b", 8)).unwrap();
    let q = e.add_request(long(2), under("a", 8)).unwrap();
    let mut steps = 0;
    while e.has_work() {
        steps += 1;
        assert!(steps < 3000, "stalled: {} sequences left", e.num_active());
        collect(&mut e, &mut out);
    }
    assert_eq!(out[&r], want[0]);
    assert_eq!(out[&p], want[1]);
    assert_eq!(out[&q], want[2]);
}

/// A salt with a NUL could name an adapter's namespace from a base request: refused.
#[test]
fn salts_with_a_nul_are_refused() {
    let (mut e, c) = engine(2, 4);
    let a = adapter(&c, "a", 1, 4, &[Proj::Q]);
    let forged = format!("\0lora:{}", a.id);
    e.add_adapter(a).unwrap();
    let err = e.add_request(prompt(0), SamplingParams { cache_salt: forged, ..greedy(4) }).unwrap_err();
    assert!(err.to_string().contains("cache_salt"), "{err}");
}

/// A CPU backend that refuses to make the adapter named `refused` resident (as a GPU out of
/// memory would), and counts how many times it was asked.
struct Refusing {
    inner: CpuBackend,
    refused: &'static str,
    asked: Arc<AtomicUsize>,
}

impl Backend for Refusing {
    delegate_backend!();
    fn forward(&mut self, batch: &[SeqChunk<'_>]) -> tandem_engine::Result<Vec<Vec<f32>>> {
        self.inner.forward(batch)
    }
    fn adapter_slots(&self) -> usize {
        self.inner.adapter_slots()
    }
    fn set_adapter(&mut self, slot: usize, adapter: Option<Arc<LoraAdapter>>) -> tandem_engine::Result<()> {
        if adapter.as_ref().is_some_and(|a| a.name == self.refused) {
            self.asked.fetch_add(1, Ordering::SeqCst);
            return Err(EngineError::Internal("out of device memory for the adapter's weights".into()));
        }
        self.inner.set_adapter(slot, adapter)
    }
}

/// An adapter the backend cannot make resident fails only the sequences that run it, each with
/// an error naming the adapter and the backend's reason; sequences of other adapters and of the
/// base in the same steps get their own tokens, and no block is left held.
#[test]
fn an_adapter_the_backend_refuses_fails_only_its_sequences() {
    // Two sequences under the refused adapter among three others.
    let names = ["a", "c", "", "c", "b"];
    let want: Vec<Vec<u32>> = {
        let (mut e, c) = engine(8, 1);
        for a in adapters(&c) {
            e.add_adapter(a).unwrap();
        }
        let mut want = Vec::new();
        for (i, n) in names.iter().enumerate().filter(|(_, n)| **n != "c") {
            want.push(run(&mut e, &[prompt(i)], &[under(n, 10)]).0.remove(0));
        }
        want
    };
    let asked = Arc::new(AtomicUsize::new(0));
    let counter = asked.clone();
    let (mut e, c) =
        engine_with(2, 8, move |inner| Box::new(Refusing { inner, refused: "c", asked: counter }));
    for a in adapters(&c) {
        e.add_adapter(a).unwrap();
    }
    let ids: Vec<_> =
        names.iter().enumerate().map(|(i, n)| e.add_request(prompt(i), under(n, 10)).unwrap()).collect();
    let mut tokens: std::collections::HashMap<u64, Vec<u32>> = Default::default();
    let mut failed: std::collections::HashMap<u64, String> = Default::default();
    let mut steps = 0;
    while e.has_work() {
        steps += 1;
        assert!(steps < 3000, "stalled: {} sequences left", e.num_active());
        for ev in e.step().unwrap() {
            match ev {
                SeqEvent::Token { seq, token, .. } => tokens.entry(seq).or_default().push(token),
                SeqEvent::Failed { seq, error } => assert!(failed.insert(seq, error).is_none()),
                _ => {}
            }
        }
        e.check_kv().unwrap();
    }
    let mut k = 0;
    for (i, (&id, n)) in ids.iter().zip(names).enumerate() {
        if n == "c" {
            let err = failed.get(&id).unwrap_or_else(|| panic!("sequence {i} under the refused adapter ran"));
            assert!(err.contains("adapter c") && err.contains("out of device memory"), "{err}");
            assert!(!tokens.contains_key(&id), "sequence {i} produced tokens");
        } else {
            assert!(!failed.contains_key(&id), "sequence {i} ({n:?}) failed: {:?}", failed.get(&id));
            assert_eq!(tokens[&id], want[k], "sequence {i} ({n:?}) differs from its tokens alone");
            k += 1;
        }
    }
    let s = e.kv_stats();
    assert_eq!((s.used, s.free + s.cached), (0, s.total), "blocks left held");
    // Asked once for both sequences (the second failed with the first, in the same step), and
    // again for a later request (the failure may have been transient); the adapter stays held.
    assert_eq!(asked.load(Ordering::SeqCst), 1);
    let id = e.add_request(prompt(1), under("c", 4)).unwrap();
    let events = e.step().unwrap();
    assert!(events.iter().any(|ev| matches!(ev, SeqEvent::Failed { seq, .. } if *seq == id)), "{events:?}");
    assert_eq!(asked.load(Ordering::SeqCst), 2);
    assert!(e.adapters().iter().any(|a| a.name == "c"));
    e.check_kv().unwrap();
}
