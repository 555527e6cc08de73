//! A token's logits do not depend on how its prompt was cut (docs/engine.md, attention): one
//! pass, chunks of many sizes (some crossing attention's 256-position segments), a cached prefix
//! continued by a later pass, and one-token steps at depth (decode, whose context is split across
//! threads) all give the same bits, in the default mode (16-bit activations, f16 KV), with 1, 2
//! and 4 threads, with attention on the vector units and (where usable) on the AMX tiles.
//!
//! On the real quantized models (SmolLM2 Q4_1; Gemma 3 270M Q4_K_M, past its 512-token window)
//! every cut is checked. On the tiny f32 fixtures (a sliding window of 16, GQA, q/k norms) every
//! chunk is longer than `cpu::matmul::SMALL_N`: f32 weights are multiplied by per-row kernels in
//! passes of up to 8 tokens and by tiles in longer ones, which agree only to rounding.
//!
//! The real models are skipped with a `SKIPPED` line when not in the model cache, and fail
//! instead under `TANDEM_REQUIRE_MODEL=1`.

use std::path::Path;

use tandem_engine::backend::{Backend, BackendOptions, LogitsRequest, SeqChunk};
use tandem_engine::cpu::CpuBackend;
use tandem_engine::kv::{BlockAllocator, WriteMode};
use tandem_engine::loader::load_model;
use tandem_test_support::{cached_model_for_test, default_model_for_test};

const BLOCKS: usize = 64;

/// The attention kernels to check: the vector units, and the AMX tiles where they are usable.
/// (The unit tests in `cpu/attention` fail where the CPU lists AMX but the tiles are unusable.)
fn kernels() -> Vec<bool> {
    match tandem_engine::cpu::attention::amx_usable() {
        Ok(()) => vec![false, true],
        Err(why) => {
            println!("AMX attention not checked here: {why}");
            vec![false]
        }
    }
}

fn backend(path: &Path, threads: usize, n: usize, amx: bool) -> CpuBackend {
    let m = load_model(path).unwrap();
    let options = BackendOptions {
        num_blocks: BLOCKS,
        block_size: 16,
        max_batch_tokens: n,
        threads,
        attention_amx: Some(amx),
        ..Default::default()
    };
    CpuBackend::new(m.config, m.weights, options).unwrap()
}

/// Logits (as bits) by position when the prompt is computed in chunks of the given sizes: every
/// position's with `all`, else each chunk's last.
fn logits(be: &mut CpuBackend, prompt: &[u32], cuts: &[usize], all: bool) -> Vec<(usize, Vec<u32>)> {
    assert_eq!(cuts.iter().sum::<usize>(), prompt.len());
    let vocab = be.config().vocab_size;
    let mut alloc = BlockAllocator::new(BLOCKS, 16);
    alloc.add_sequence(1, prompt.len()).unwrap();
    let table = alloc.block_table(1).unwrap().to_vec();
    let mut rows = Vec::new();
    let mut start = 0;
    for &n in cuts {
        let chunk = SeqChunk {
            tokens: &prompt[start..start + n],
            start_pos: start,
            block_table: &table,
            logits: if all { LogitsRequest::All } else { LogitsRequest::Last },
            write: WriteMode::Direct,
            adapter: None,
        };
        let out = be.forward(&[chunk]).unwrap().remove(0);
        let first = if all { start } else { start + n - 1 };
        // One vocabulary-wide row after another.
        assert_eq!(out.len(), if all { n } else { 1 } * vocab);
        rows.extend(
            out.chunks_exact(vocab)
                .enumerate()
                .map(|(i, r)| (first + i, r.iter().map(|x| x.to_bits()).collect())),
        );
        start += n;
    }
    rows
}

/// Cuts of an `n`-token prompt: with `short`, also one-token chunks (decode steps).
fn cuts(n: usize, short: bool) -> Vec<(&'static str, Vec<usize>)> {
    let mut c = vec![
        ("two chunks at a segment boundary", vec![256, n - 256]),
        (
            "chunks of 33",
            std::iter::repeat_n(33, n / 33).chain([n % 33].into_iter().filter(|&r| r > 0)).collect(),
        ),
        ("a block-aligned cached prefix, then the rest", vec![48, 208, 20, n - 276]),
        ("odd chunks across segments", vec![17, 250, 13, 100, n - 380]),
    ];
    if short {
        c.push(("a cached prefix, one-token steps, then the rest", vec![48, 1, 1, 1, 1, 207, 3, n - 262]));
        c.push((
            "a prompt then one-token steps at depth",
            std::iter::once(n - 40).chain(std::iter::repeat_n(1, 40)).collect(),
        ));
    }
    c
}

/// Checks every cut of an `n`-token prompt against one pass. `quantized`: the model's matrices
/// are quantized, so a pass's size does not change a token's bits and one-token chunks are cut
/// too; each chunk returns only its last position's logits (a large vocabulary's rows for every
/// position would cost more than the passes).
fn check(what: &str, path: &Path, n: usize, quantized: bool) {
    let vocab = load_model(path).unwrap().config.vocab_size as u32;
    let prompt: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    for amx in kernels() {
        let kernel = if amx { "AMX attention" } else { "vector attention" };
        let want = logits(&mut backend(path, 2, n, amx), &prompt, &[n], true);
        assert_eq!(want.len(), n);
        for threads in [1, 2, 4] {
            let mut be = backend(path, threads, n, amx);
            for (how, cut) in cuts(n, quantized) {
                let got = logits(&mut be, &prompt, &cut, !quantized);
                assert_eq!(got.len(), if quantized { cut.len() } else { n });
                for (p, g) in &got {
                    assert!(
                        *g == want[*p].1,
                        "{what}, {kernel}, {threads} threads, {how}: position {p}'s logits differ from one \
                         pass's"
                    );
                }
            }
        }
    }
}

#[test]
fn tiny_models_logits_do_not_depend_on_how_the_prompt_was_cut() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures");
    for model in ["llama-gqa", "gemma3", "mistral-sliding", "qwen3"] {
        check(model, &fixtures.join(model), 420, false);
    }
}

#[test]
fn smollm2_logits_do_not_depend_on_how_the_prompt_was_cut() {
    let Some(path) = default_model_for_test("smollm2_logits_do_not_depend_on_how_the_prompt_was_cut") else {
        return;
    };
    check("SmolLM2 Q4_1", &path, 700, true);
}

#[test]
fn gemma3_270m_logits_do_not_depend_on_how_the_prompt_was_cut() {
    const TEST: &str = "gemma3_270m_logits_do_not_depend_on_how_the_prompt_was_cut";
    let Some(path) = cached_model_for_test(TEST, "gemma-3-270m-q4_k_m.gguf") else { return };
    check("Gemma 3 270M Q4_K_M", &path, 700, true);
}
