//! Speculative decoding on a real (tiny) model, at the level of the KV pool: the seed documents'
//! bug classes each get a check that fails if they come back.
//! - *commit never called*, *accepted tokens missing from a layer*, *layer index wrong or
//!   defaulted*, *staging reset per layer*, *all layers committed into one cache*: after a
//!   speculative run, every layer's K and V at every computed position equal those of a run
//!   without speculation (per device, to its tolerance);
//! - *rejected tokens in the pool*: a step writes the pool only at the positions the sequence
//!   kept; every other slot's bytes are unchanged (compared byte for byte);
//! - *prefill treated as speculation*: see `backend_kv.rs` (a prefill chunk in a staged pass is
//!   written direct) and the planner's tests (prefill entries are never verification entries).

use std::path::Path;

use tandem_engine::backend::{BackendOptions, ComputeDtype};
use tandem_engine::factory::create_backend;
use tandem_engine::kv::{KvDtype, SeqId};
use tandem_engine::loader::load_model;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SchedulerOptions, SeqEvent};
use tandem_engine::spec::ngram::NgramDrafter;
use tandem_engine::spec::{DraftAsk, Drafter, SpecMethod, SpecOptions};
use tandem_engine::Device;

#[macro_use]
mod common;
use common::{assert_close, f32s, tolerance};

const BS: usize = 4;

fn engine(device: Device, blocks: usize) -> Engine {
    let m = load_model(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/llama-gqa"))
        .unwrap();
    let tok = m.tokenizer.clone();
    let opts = BackendOptions {
        num_blocks: blocks,
        block_size: BS,
        max_batch_tokens: 128,
        threads: 1,
        dtype: ComputeDtype::F32,
        // The GPU computes a verification pass's K/V a hair apart from a decode step's; a narrower
        // pool could round such a value either way, so the GPU compares in f32 (the CPU's passes
        // agree bit for bit and keep their default pool).
        kv_dtype: (device != Device::Cpu).then_some(KvDtype::F32),
        cuda_graphs: false,
        ..Default::default()
    };
    let be = create_backend(device, m, opts).unwrap_or_else(|e| panic!("{device}: {e}"));
    Engine::new(be, tok, SchedulerOptions { max_batch_tokens: 128, max_num_seqs: 16 })
}

fn params(n: usize) -> SamplingParams {
    SamplingParams { max_tokens: n, ignore_eos: true, ..SamplingParams::greedy() }
}

fn prompts() -> Vec<Vec<u32>> {
    let a: Vec<u32> = (0..7).map(|i| 30 + i * 9).collect();
    vec![a.iter().chain(&a).copied().collect(), (0..12).map(|i| 5 + i % 3).collect(), vec![100, 200, 300]]
}

/// K and V bytes of one position of one layer of a live sequence.
fn kv_at(eng: &Engine, seq: SeqId, layer: usize, pos: usize) -> (Vec<u8>, Vec<u8>) {
    let table = eng.block_table(seq).unwrap();
    let l = eng.backend().kv_layout();
    let row = l.token_bytes();
    let (k, v) = eng.backend().read_block(layer, table[pos / BS]).unwrap();
    let off = (pos % BS) * row;
    (k[off..off + row].to_vec(), v[off..off + row].to_vec())
}

/// Steps until every sequence generated at least `n` tokens (none finishes: max_tokens is larger).
fn run_until(eng: &mut Engine, ids: &[SeqId], n: usize) {
    for _ in 0..10_000 {
        if ids.iter().all(|&id| eng.generated_len(id).unwrap() >= n) {
            return;
        }
        for ev in eng.step().unwrap() {
            if let SeqEvent::Failed { error, .. } = ev {
                panic!("{error}");
            }
        }
        assert!(!eng.backend().staged_pending(), "staged data outlived a step");
        eng.check_kv().unwrap();
    }
    panic!("no progress");
}

fn committed_kv_matches_plain_decoding(device: Device) {
    let tol = tolerance(device);
    let mut plain = engine(device, 64);
    let opts =
        SpecOptions { max_draft: 4, adaptive: false, ngram_min: 1, ngram_max: 3, sampled_drafts: false };
    let mut spec = engine(device, 64).with_speculation(Box::new(NgramDrafter::new(1, 3)), opts).unwrap();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for p in prompts() {
        a.push(plain.add_request(p.clone(), params(100)).unwrap());
        b.push(spec.add_request(p, params(100)).unwrap());
    }
    run_until(&mut plain, &a, 30);
    run_until(&mut spec, &b, 30);
    assert!(spec.spec_stats().accepted > 0, "nothing accepted: the comparison would prove little");
    let layout = plain.backend().kv_layout();
    let layers = layout.num_layers;
    for (&pa, &sb) in a.iter().zip(&b) {
        let upto = plain.computed_len(pa).unwrap().min(spec.computed_len(sb).unwrap());
        assert!(upto >= 30);
        for layer in 0..layers {
            for pos in 0..upto {
                let ((pk, pv), (sk, sv)) = (kv_at(&plain, pa, layer, pos), kv_at(&spec, sb, layer, pos));
                let what = format!("{device}: sequence {sb}, layer {layer}, position {pos}");
                assert_close(
                    &f32s(&layout, &sk),
                    &f32s(&layout, &pk),
                    tol.kv.max(1e-5),
                    &format!("K, {what}"),
                );
                assert_close(
                    &f32s(&layout, &sv),
                    &f32s(&layout, &pv),
                    tol.kv.max(1e-5),
                    &format!("V, {what}"),
                );
            }
        }
    }
}

device_test!(
    committed_kv_in_every_layer_matches_decoding_without_speculation,
    committed_kv_matches_plain_decoding
);

/// Proposes the true continuation (from a run without speculation) with every third token wrong,
/// so verification rejects part way through most runs.
struct Oracle {
    truth: Vec<u32>,
}

impl Drafter for Oracle {
    fn method(&self) -> SpecMethod {
        SpecMethod::Ngram
    }
    fn describe(&self) -> String {
        "oracle".into()
    }
    fn propose(&mut self, asks: &[DraftAsk<'_>]) -> tandem_engine::Result<Vec<Vec<u32>>> {
        Ok(asks
            .iter()
            .map(|a| {
                let from = a.tokens.len();
                (from..(from + a.max).min(self.truth.len()))
                    .map(|p| if p % 3 == 2 { (self.truth[p] + 1) % 448 } else { self.truth[p] })
                    .collect()
            })
            .collect())
    }
    fn forget(&mut self, _seq: SeqId) {}
}

#[test]
fn a_step_writes_the_pool_only_where_the_sequence_kept_tokens() {
    let prompt: Vec<u32> = (0..9).map(|i| 40 + i * 7).collect();
    let mut plain = engine(Device::Cpu, 24);
    let truth = plain.generate(prompt.clone(), params(40), |_| {}).unwrap();
    let mut all = prompt.clone();
    all.extend(&truth.token_ids);

    let opts = SpecOptions { max_draft: 5, adaptive: false, ..Default::default() };
    let mut eng =
        engine(Device::Cpu, 24).with_speculation(Box::new(Oracle { truth: all.clone() }), opts).unwrap();
    let layout = eng.backend().kv_layout();
    let snapshot = |eng: &Engine| -> Vec<(Vec<u8>, Vec<u8>)> {
        (0..layout.num_layers)
            .flat_map(|l| (0..layout.num_blocks as u32).map(move |b| (l, b)))
            .map(|(l, b)| eng.backend().read_block(l, b).unwrap())
            .collect()
    };
    let id = eng.add_request(prompt.clone(), params(40)).unwrap();
    let mut out = Vec::new();
    let mut rejections = 0;
    while eng.num_active() > 0 {
        let before = snapshot(&eng);
        let computed_before = eng.computed_len(id).unwrap_or(0);
        let accepted_before = eng.spec_stats().accepted;
        let proposed_before = eng.spec_stats().proposed;
        for ev in eng.step().unwrap() {
            match ev {
                SeqEvent::Token { token, .. } => out.push(token),
                SeqEvent::Failed { error, .. } => panic!("{error}"),
                _ => {}
            }
        }
        let st = eng.spec_stats();
        if st.proposed - proposed_before > st.accepted - accepted_before {
            rejections += 1;
        }
        let Some(computed) = eng.computed_len(id) else { break };
        // The slots of positions computed this step may change; nothing else may.
        let table = eng.block_table(id).unwrap().to_vec();
        let kept: std::collections::BTreeSet<(u32, usize)> =
            (computed_before..computed).map(|p| (table[p / BS], p % BS)).collect();
        let after = snapshot(&eng);
        let row = layout.token_bytes();
        for l in 0..layout.num_layers {
            for b in 0..layout.num_blocks {
                let i = l * layout.num_blocks + b;
                for off in 0..BS {
                    if kept.contains(&(b as u32, off)) {
                        continue;
                    }
                    let r = off * row..(off + 1) * row;
                    assert_eq!(
                        (&after[i].0[r.clone()], &after[i].1[r.clone()]),
                        (&before[i].0[r.clone()], &before[i].1[r]),
                        "layer {l} block {b} slot {off} changed although the sequence kept no token there"
                    );
                }
            }
        }
    }
    assert_eq!(out, truth.token_ids, "speculative output differs");
    assert!(rejections > 3, "only {rejections} steps rejected a draft: the check saw too little");
}
