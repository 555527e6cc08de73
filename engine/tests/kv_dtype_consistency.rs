//! Within one 16-bit KV dtype, where a token's K/V come from never changes the result: the CPU
//! backend rounds fresh K/V to the pool's dtype before attention uses them, so this pass's
//! projections and the pool hold the same values. Hence, bit for bit or token for token:
//! passes of several tokens equal token-by-token decode; speculative verification equals plain
//! decode; a prefix-cache hit equals a miss. (Without the rounding, the first differ in their
//! last bits and the others follow.)
//!
//! Bit-for-bit comparisons use passes of at most `matmul::SMALL_N` tokens, within which the
//! matrix kernels compute every token exactly as alone (larger passes tile differently in f32
//! too; that the greedy tokens still agree is the reference-parity tests' business).

mod sched_common;
use sched_common::{drain, fixture, fixture_engine_with, greedy, run, Setup};

use tandem_engine::backend::{Backend, BackendOptions, LogitsRequest, SeqChunk};
use tandem_engine::cpu::CpuBackend;
use tandem_engine::kv::{BlockAllocator, KvDtype, WriteMode};
use tandem_engine::loader::load_model;
use tandem_engine::scheduler::{Engine, SeqEvent};
use tandem_engine::spec::ngram::NgramDrafter;
use tandem_engine::spec::SpecOptions;

/// The dtypes narrower than the f32 the passes compute in: each rounds fresh K/V as it stores them.
const NARROW: [KvDtype; 3] = [KvDtype::F16, KvDtype::Bf16, KvDtype::Fp8];
const MODELS: [&str; 3] = ["llama-gqa", "qwen3", "mistral-sliding"];

fn backend(model: &str, dtype: KvDtype) -> CpuBackend {
    let m = load_model(&fixture(model)).unwrap();
    let opts = BackendOptions {
        num_blocks: 16,
        block_size: 4,
        max_batch_tokens: 64,
        threads: 1,
        kv_dtype: Some(dtype),
        ..Default::default()
    };
    CpuBackend::new(m.config, m.weights, opts).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// All-position logits of `tokens` run from position 0 in passes of at most `chunk` tokens.
fn logits_in_chunks(be: &mut CpuBackend, tokens: &[u32], chunk: usize) -> Vec<u32> {
    let mut alloc = BlockAllocator::new(16, 4);
    let table = alloc.add_sequence(1, tokens.len()).unwrap().to_vec();
    let mut out = Vec::new();
    for (i, c) in tokens.chunks(chunk).enumerate() {
        let chunk = SeqChunk {
            tokens: c,
            start_pos: i * chunk,
            block_table: &table,
            logits: LogitsRequest::All,
            write: WriteMode::Direct,
            adapter: None,
        };
        out.extend(bits(&be.forward(&[chunk]).unwrap().remove(0)));
    }
    out
}

#[test]
fn passes_of_several_tokens_give_what_token_by_token_decode_does_bit_for_bit() {
    assert_eq!(tandem_engine::cpu::matmul::SMALL_N, 8, "the passes below assume row-independent kernels");
    for model in MODELS {
        for dtype in NARROW {
            let mut be = backend(model, dtype);
            let vocab = be.config().vocab_size as u32;
            let tokens: Vec<u32> = (0..29u32).map(|i| (i * 53 + 7) % vocab).collect();
            let one_by_one = logits_in_chunks(&mut be, &tokens, 1);
            for chunk in [8, 3] {
                let got = logits_in_chunks(&mut be, &tokens, chunk);
                assert!(got == one_by_one, "{model} {dtype}: passes of {chunk} differ from decode");
            }
        }
    }
}

fn spec(e: Engine) -> Engine {
    let o = SpecOptions { max_draft: 4, adaptive: false, ngram_min: 1, ngram_max: 3, sampled_drafts: false };
    e.with_speculation(Box::new(NgramDrafter::new(o.ngram_min, o.ngram_max)), o).unwrap()
}

/// Prompts that repeat themselves, so the n-gram drafter's drafts get accepted.
fn repetitive(n: usize) -> Vec<Vec<u32>> {
    (0..n as u32)
        .map(|i| {
            let base: Vec<u32> = (0..7).map(|j| 3 + (i * 41 + j * 13) % 300).collect();
            base.iter().chain(&base).chain(&base).copied().collect()
        })
        .collect()
}

#[test]
fn speculative_verification_generates_what_plain_decode_does() {
    for model in MODELS {
        for dtype in NARROW {
            let s = Setup { model, blocks: 128, block_size: 4, budget: 128, max_num_seqs: 8 };
            let ps = repetitive(4);
            let params = vec![greedy(40); ps.len()];
            let (want, _) = run(&mut fixture_engine_with(&s, Some(dtype)), &ps, &params);
            let mut e = spec(fixture_engine_with(&s, Some(dtype)));
            assert_eq!(e.backend().kv_layout().dtype, dtype);
            let (got, (proposed, accepted)) = run(&mut e, &ps, &params);
            assert!(
                accepted > 0 && proposed > accepted,
                "{model} {dtype}: {accepted} of {proposed} accepted"
            );
            assert_eq!(got, want, "{model} {dtype}");
        }
    }
}

/// Greedy tokens of `prompt` alone (blocks may stay cached afterwards).
fn solo(e: &mut Engine, prompt: &[u32]) -> Vec<u32> {
    let id = e.add_request(prompt.to_vec(), greedy(24)).unwrap();
    drain(e)
        .into_iter()
        .filter_map(|ev| match ev {
            SeqEvent::Token { seq, token, .. } if seq == id => Some(token),
            _ => None,
        })
        .collect()
}

#[test]
fn a_prefix_cache_hit_generates_what_a_miss_does() {
    for model in MODELS {
        for dtype in NARROW {
            let s = Setup { model, blocks: 64, block_size: 4, budget: 64, max_num_seqs: 4 };
            let prompt: Vec<u32> = (0..23u32).map(|i| 9 + (i * 29) % 250).collect();
            let mut plain = fixture_engine_with(&s, Some(dtype));
            let mut cached = fixture_engine_with(&s, Some(dtype)).with_prefix_cache("fixture");
            let want = solo(&mut plain, &prompt);
            let first = solo(&mut cached, &prompt);
            let before = cached.prefix_stats().hit_tokens;
            let hit = solo(&mut cached, &prompt);
            let served = cached.prefix_stats().hit_tokens - before;
            assert!(served >= 20, "{model} {dtype}: only {served} tokens came from the cache");
            assert_eq!(first, want, "{model} {dtype}: miss");
            assert_eq!(hit, want, "{model} {dtype}: hit");
        }
    }
}
