//! The real Gemma 3 270M (GGUF, Q4_K_M: Q5_0, Q8_0, Q4_K and Q6_K tensors, a SentencePiece
//! vocabulary) against llama.cpp on the same file (`tests/reference/fixtures/gemma3-270m-q4_k_m.json`,
//! recorded by `scripts/llamacpp-reference.sh`): from llama.cpp's prompt ids, the engine's greedy
//! tokens follow llama.cpp's, and its log-probabilities of llama.cpp's top-5 candidates at every
//! step stay within a stated tolerance, in the exact mode and in the default one. One prompt is
//! 739 tokens long, past the 512-token window of the model's local layers.
//!
//! The two engines do not compute alike: llama.cpp quantizes activations to 8 bits for its dot
//! products, the exact mode does not. So the test allows a greedy choice to part from
//! llama.cpp's only where llama.cpp itself had a near tie (its top two within `TIE`), the engine
//! chose llama.cpp's runner-up or another of its top five, and the rest of that continuation is
//! then not compared. It fails if too few tokens match overall.
//!
//! Skipped with a `SKIPPED` line when the model is not in the cache (`scripts/fetch-gemma.sh`),
//! failed instead under `TANDEM_REQUIRE_MODEL=1`.

use serde_json::Value;
use tandem_engine::backend::{Activations, Backend, BackendOptions, ComputeDtype, LogitsRequest, SeqChunk};
use tandem_engine::factory::create_backend;
use tandem_engine::kv::{BlockAllocator, KvDtype, WriteMode};
use tandem_engine::loader::load_model;
use tandem_engine::Device;
use tandem_test_support::cached_model_for_test;

#[macro_use]
mod common;

/// Largest difference allowed between the engine's and llama.cpp's log-probability of one of
/// llama.cpp's top-5 tokens that llama.cpp gives at least e⁻⁴ (measured: at most 0.59 in both
/// modes; transformers' reading of the same file differs from llama.cpp's by up to 0.26 at the
/// first step, and differences grow along a continuation). Rarer candidates' log-probabilities
/// are too small to compare this way; their probabilities are held by `PROB_TOL`.
const LOGPROB_TOL: f32 = 0.8;
/// Largest difference allowed between the two probabilities of any top-5 token (measured: 0.077).
const PROB_TOL: f32 = 0.12;
/// A greedy choice may differ from llama.cpp's where llama.cpp's top two are this close.
const TIE: f32 = 0.35;

fn fixture() -> Value {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/reference/fixtures/gemma3-270m-q4_k_m.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn log_softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&x| ((x - max) as f64).exp()).sum();
    let lse = max + sum.ln() as f32;
    row.iter().map(|&x| x - lse).collect()
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy continuation of `prompt` for `n` tokens, with each step's log-probabilities.
fn greedy(be: &mut dyn Backend, prompt: &[u32], n: usize) -> Vec<(u32, Vec<f32>)> {
    let mut alloc = BlockAllocator::new(64, 16);
    alloc.add_sequence(1, prompt.len() + n).unwrap();
    let table = alloc.block_table(1).unwrap().to_vec();
    let mut out = Vec::new();
    let mut fed = prompt.to_vec();
    let mut start = 0;
    for _ in 0..n {
        let chunk = SeqChunk {
            tokens: &fed[start..],
            start_pos: start,
            block_table: &table,
            logits: LogitsRequest::Last,
            write: WriteMode::Direct,
            adapter: None,
        };
        let row = be.forward(&[chunk]).unwrap().remove(0);
        let t = argmax(&row);
        start = fed.len();
        fed.push(t);
        out.push((t, log_softmax(&row)));
    }
    out
}

struct Tally {
    compared: usize,
    matched: usize,
    worst_logprob: f32,
}

fn compare(name: &str, case: &Value, got: &[(u32, Vec<f32>)], tally: &mut Tally) {
    let want = ids(&case["greedy_ids"]);
    let top5 = case["top5_logprobs"].as_array().unwrap();
    for (step, ((t, lp), &w)) in got.iter().zip(&want).enumerate() {
        let cands: Vec<(u32, f32)> = top5[step]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (c[0].as_u64().unwrap() as u32, c[1].as_f64().unwrap() as f32))
            .collect();
        for &(id, theirs) in &cands {
            let ours = lp[id as usize];
            let prob = (ours.exp() - theirs.exp()).abs();
            assert!(
                prob <= PROB_TOL,
                "{name} step {step}: token {id} has probability {} here, {} in llama.cpp",
                ours.exp(),
                theirs.exp()
            );
            if theirs >= -4.0 {
                let diff = (ours - theirs).abs();
                tally.worst_logprob = tally.worst_logprob.max(diff);
                assert!(
                    diff <= LOGPROB_TOL,
                    "{name} step {step}: log-probability of token {id} is {ours} here, {theirs} in llama.cpp"
                );
            }
        }
        tally.compared += 1;
        if *t == w {
            tally.matched += 1;
            continue;
        }
        let gap = cands[0].1 - cands[1].1;
        assert!(
            gap <= TIE && cands.iter().any(|c| c.0 == *t),
            "{name} step {step}: chose {t}, llama.cpp chose {w} with a margin of {gap} (top five {cands:?})"
        );
        eprintln!("{name}: parts from llama.cpp at step {step} on a near tie (margin {gap:.3})");
        return;
    }
}

/// On `device` (a GPU computes in f32 here: its bf16 mode is held to its own tolerance by the
/// tiny-model parity tests).
fn parity(device: Device, activations: Activations, min_matched: f64) {
    const TEST: &str = "gemma3_270m_follows_llama_cpp";
    let Some(path) = cached_model_for_test(TEST, "gemma-3-270m-q4_k_m.gguf") else { return };
    let m = load_model(&path).unwrap();
    assert_eq!(m.config.arch, tandem_engine::config::Arch::Gemma3);
    let opts = BackendOptions {
        num_blocks: 64,
        block_size: 16,
        max_batch_tokens: 1024,
        activations,
        kv_dtype: Some(KvDtype::F32),
        dtype: ComputeDtype::F32,
        cuda_graphs: false,
        ..Default::default()
    };
    let mut be = create_backend(device, m, opts).unwrap();
    let r = fixture();
    let mut tally = Tally { compared: 0, matched: 0, worst_logprob: 0.0 };
    let cases = r["prompts"].as_array().unwrap().iter().chain(r["chats"].as_array().unwrap());
    for (i, case) in cases.enumerate() {
        let prompt = ids(&case["prompt_ids"]);
        let want = ids(&case["greedy_ids"]);
        let got = greedy(be.as_mut(), &prompt, want.len());
        compare(&format!("case {i} ({} prompt tokens)", prompt.len()), case, &got, &mut tally);
    }
    let share = tally.matched as f64 / tally.compared as f64;
    eprintln!(
        "{device} {activations}: {} of {} compared tokens equal llama.cpp's; largest log-probability difference {:.3} \
         (tokens above e^-4)",
        tally.matched, tally.compared, tally.worst_logprob
    );
    assert!(tally.compared >= 150 && share >= min_matched, "only {share:.2} of the greedy tokens match");
}

fn exact_mode(device: Device) {
    parity(device, Activations::F32, 0.9);
}

device_test!(gemma3_270m_follows_llama_cpp_exact_mode, exact_mode);

#[test]
fn gemma3_270m_follows_llama_cpp_default_mode() {
    parity(Device::Cpu, Activations::Q16, 0.9);
}
