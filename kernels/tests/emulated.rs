//! Runs the forward-pass kernels (kernels/cuda/model.cu) on the CPU: the CUDA C source is compiled
//! as C++ together with a small stand-in for CUDA's thread model (`emulated/shim.h`: one OS thread
//! per CUDA thread, barriers for `__syncthreads` and warp shuffles) and a harness
//! (`emulated/harness.cpp`) that checks each kernel against a double-precision reference: RMSNorm,
//! q/k norm, RoPE, SwiGLU, GeGLU (tanh GELU, f32 and bf16 out, saturated gates), bias, embedding
//! (bf16 and f32 tables, unscaled and scaled by sqrt(hidden)), row gather, soft-capping, paged
//! attention (in-pass and pooled K/V, GQA, sliding window, split-K, soft-capped scores; f32, bf16
//! and fp8 pools; the tensor-core prompt kernel, with `mma.m16n8k16` emulated from PTX's fragment
//! layout, for head dimensions 16 to 256 zero-padded into its variants), KV write and commit on every pool dtype, fp8 E4M3's conversions against the
//! format's definition, the fused decode kernels against the unfused ones bit for bit
//! (`add_rms_norm`, the gated activations over a fused gate/up product, `qkv_split` with and
//! without the KV write), the decode products (`gemv_*`: against double precision, and their norm
//! prologue and residual and gated epilogues against the unfused kernels bit for bit), the
//! decode products straight from Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K blocks (`qgemv_*`, against the engine's own
//! dequantization of the same bytes), a decode step's mixture of experts over routed experts only (against one expert at a time, bit for bit), a
//! prompt's mixture over routed tokens only (the grouped tensor-core products, against double precision), the greedy pick's NaN/inf/tie rules, the device sampler against the engine's own sampler (same seed, same token, log-probability and alternatives; rows it leaves to the host only where its sorted list cannot hold them), a mixture of experts' routing (softmax,
//! top-k with ties to the lower index, renormalization) and weighted accumulation, and LoRA's
//! grouped shrink and expand (several adapters and ranks in one pass, f32 and bf16 inputs, tokens
//! without an adapter or whose adapter lacks the target left untouched).
//!
//! This checks the kernels' index math and arithmetic without a GPU; it cannot catch what only a
//! GPU shows (memory model, launch limits, speed). Needs a C++20 compiler (`g++`, or `$CXX`);
//! without one the test is skipped with a message, unless TANDEM_REQUIRE_EXTERNAL=1.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

fn compiler() -> Option<String> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    Command::new(&cxx).arg("--version").output().ok().filter(|o| o.status.success()).map(|_| cxx)
}

/// The harness, compiled once per test run (both tests use it); `None` without a C++ compiler.
fn harness() -> Option<&'static Path> {
    static HARNESS: OnceLock<Option<PathBuf>> = OnceLock::new();
    HARNESS.get_or_init(|| compiler().map(|cxx| build(&cxx))).as_deref()
}

/// Where the harness and its input and output files live.
fn work_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("emulated-kernels")
}

fn build(cxx: &str) -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let work = work_dir();
    std::fs::create_dir_all(&work).unwrap();

    // The one CUDA-only construct the shim cannot define away: dynamic shared memory.
    let src = tandem_kernels::source("model").expect("the model kernels").source;
    let decl = "extern __shared__ u32x4 sm_dyn[];";
    assert_eq!(src.matches(decl).count(), 1, "model.cu should declare its dynamic shared memory once");
    let emulated = work.join("model_emulated.cu");
    std::fs::write(&emulated, src.replace(decl, "#define sm_dyn ((u32x4*)g_dyn_shared.data())")).unwrap();

    let exe = work.join("harness");
    let out = Command::new(cxx)
        .args(["-std=c++20", "-O1", "-fno-strict-aliasing", "-pthread", "-Wno-unknown-pragmas"])
        .arg(format!("-I{}", here.join("tests/emulated").display()))
        .arg(format!("-DMODEL_CU=\"{}\"", emulated.display()))
        .arg(here.join("tests/emulated/harness.cpp"))
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap();
    assert!(out.status.success(), "compiling the harness failed:\n{}", String::from_utf8_lossy(&out.stderr));
    exe
}

fn no_compiler(test: &str) {
    common::skip_external(
        test,
        "no C++ compiler (g++ or $CXX) to run the kernels on the CPU",
        "install g++ or set CXX",
    );
}

#[test]
fn kernels_match_double_precision_references_on_the_cpu() {
    let Some(exe) = harness() else {
        return no_compiler("kernels_match_double_precision_references_on_the_cpu");
    };
    let run = Command::new(exe).output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    eprintln!("{stdout}");
    assert!(
        run.status.success(),
        "kernel checks failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let checks = stdout.lines().filter(|l| l.starts_with("ok ")).count();
    assert!(checks >= 30, "only {checks} checks ran:\n{stdout}");
    assert!(stdout.contains("0 failed"), "{stdout}");
}

/// Runs the harness in `mode` on `input` (written to `name.in`) and returns what it wrote (`name.out`).
fn run_mode(exe: &Path, mode: &str, name: &str, input: &[u8]) -> Vec<u8> {
    let work = work_dir();
    let (i, o) = (work.join(format!("{name}.in")), work.join(format!("{name}.out")));
    std::fs::write(&i, input).unwrap();
    let run = Command::new(exe).arg(mode).arg(&i).arg(&o).output().unwrap();
    assert!(run.status.success(), "the harness failed ({mode}): {}", String::from_utf8_lossy(&run.stderr));
    std::fs::read(&o).unwrap()
}

/// SplitMix64: the test's own deterministic stream.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
}

/// One row for `sample_rows` and what the engine's sampler makes of it.
struct SampleCase {
    logits: Vec<f32>,
    params: tandem_engine::sampler::SamplingParams,
    history: Vec<u32>,
    allowed: Option<Vec<bool>>,
    /// The device may leave this row to the host (a top-k past its list, or a top-p prefix).
    may_defer: bool,
    /// The device must leave it to the host (a prefix far past its list).
    must_defer: bool,
}

/// The kernel's list of sorted candidates (`SAMPLE_LIST` in model.cu).
const SAMPLE_LIST: usize = 4096;

fn sample_case(rng: &mut Rng, vocab: usize) -> SampleCase {
    use tandem_engine::sampler::SamplingParams;
    let shape = rng.below(7);
    let mut logits: Vec<f32> = (0..vocab)
        .map(|_| {
            let g = (0..4).map(|_| rng.unit()).sum::<f32>() - 2.0; // roughly normal
            match shape {
                1 => (g * 6.0).round() / 2.0, // ties
                3 => 0.25,                    // flat
                4 => f32::NEG_INFINITY,
                5 => g * 12.0, // peaked
                _ => g * 4.0,
            }
        })
        .collect();
    if shape == 2 || shape == 4 {
        for _ in 0..1 + vocab / 50 {
            let i = rng.below(vocab);
            logits[i] = rng.pick(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::NAN]);
        }
    }
    let params = SamplingParams {
        temperature: rng.pick(&[0.0, 0.3, 0.8, 1.0, 1.0, 1.7]),
        top_k: rng.pick(&[0, 0, 0, 1, 3, 50, vocab / 2, SAMPLE_LIST + 1]),
        top_p: rng.pick(&[1.0, 1.0, 0.95, 0.8, 0.3]),
        min_p: rng.pick(&[0.0, 0.0, 0.02, 0.2]),
        repetition_penalty: rng.pick(&[1.0, 1.0, 1.5, 0.8]),
        logprobs: rng.pick(&[None, Some(0), Some(2), Some(20)]),
        seed: Some(rng.next()),
        ..SamplingParams::greedy()
    };
    let history: Vec<u32> = (0..rng.below(40)).map(|_| rng.below(vocab + 10) as u32).collect();
    let allowed = (rng.below(4) == 0).then(|| {
        let only_impossible = rng.below(3) == 0;
        let mut a: Vec<bool> = (0..vocab).map(|_| rng.below(10) < 3).collect();
        if only_impossible {
            // Allowed ids whose logits are all -inf: the constraint's lowest allowed id gets 0.
            for (i, ok) in a.iter_mut().enumerate() {
                if *ok {
                    logits[i] = f32::NEG_INFINITY;
                }
            }
        }
        a[rng.below(vocab)] = true;
        a
    });
    let may_defer = params.top_k > SAMPLE_LIST || params.top_p < 1.0;
    SampleCase { logits, params, history, allowed, may_defer, must_defer: false }
}

/// `sample_rows` in the emulator draws the engine sampler's token for the same seed, reports the
/// same log-probability and alternatives, and says whether it used the sampler's draw; rows it
/// cannot hold are left to the host, and only those.
#[test]
fn device_sampling_draws_the_engine_samplers_tokens() {
    use tandem_engine::sampler::{Sampler, SamplingParams};
    let Some(exe) = harness() else {
        return no_compiler("device_sampling_draws_the_engine_samplers_tokens");
    };
    let mut rng = Rng(42);
    let (mut decided, mut total) = (0usize, 0usize);
    for (vocab, count) in [(37usize, 120usize), (700, 120), (6000, 40)] {
        let mut cases: Vec<SampleCase> = (0..count).map(|_| sample_case(&mut rng, vocab)).collect();
        if vocab > SAMPLE_LIST {
            // A flat row under top-p 0.999: its prefix is nearly the whole row, past the list.
            let params =
                SamplingParams { temperature: 1.0, top_p: 0.999, seed: Some(5), ..SamplingParams::greedy() };
            let flat = vec![1.0f32; vocab];
            cases.push(SampleCase {
                logits: flat,
                params,
                history: Vec::new(),
                allowed: None,
                may_defer: true,
                must_defer: true,
            });
        }
        let words = vocab.div_ceil(32);
        let (mut fpar, mut ipar, mut uni, mut bits, mut logits) = (vec![], vec![], vec![], vec![], vec![]);
        let mut expected = Vec::new();
        for c in &cases {
            let mut sampler = Sampler::new(&c.params, 0);
            let mut row_params = sampler.device_row(&c.history, vocab);
            let mut row = c.logits.clone();
            let mut allow_at = -1i32;
            if let Some(a) = &c.allowed {
                // The host's masking (the scheduler's `mask_row`): forbidden ids -inf, and the
                // lowest allowed id 0 when no allowed logit is above -inf.
                for (l, &ok) in row.iter_mut().zip(a) {
                    if !ok {
                        *l = f32::NEG_INFINITY;
                    }
                }
                if !row.iter().any(|&l| l > f32::NEG_INFINITY) {
                    row[a.iter().position(|&ok| ok).unwrap()] = 0.0;
                }
                row_params.allowed = vec![0u32; words];
                for (i, _) in a.iter().enumerate().filter(|(_, &ok)| ok) {
                    row_params.allowed[i / 32] |= 1 << (i % 32);
                }
                allow_at = bits.len() as i32;
                bits.extend_from_slice(&row_params.allowed);
            }
            let pen_at = if row_params.penalised.is_empty() {
                -1
            } else {
                let at = bits.len() as i32;
                bits.extend_from_slice(&row_params.penalised);
                at
            };
            fpar.extend([
                row_params.temperature,
                row_params.top_p,
                row_params.min_p,
                row_params.repetition_penalty,
            ]);
            ipar.extend([
                row_params.top_k.min(i32::MAX as usize) as i32,
                row_params.logprobs as i32,
                allow_at,
                pen_at,
            ]);
            uni.push(row_params.uniform);
            logits.extend_from_slice(&c.logits);
            let sampled = sampler.sample(&mut row, &c.history);
            let drew = sampler.device_row(&[], vocab).uniform != row_params.uniform;
            expected.push((sampled, drew));
        }
        let mut bytes = Vec::new();
        for x in [cases.len() as i32, vocab as i32, bits.len() as i32, 256] {
            bytes.extend_from_slice(&x.to_le_bytes());
        }
        logits.iter().for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
        fpar.iter().for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
        ipar.iter().for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
        uni.iter().for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
        bits.iter().for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
        let out = run_mode(exe, "sample", &format!("sample-{vocab}"), &bytes);
        let word = |k: usize| <[u8; 4]>::try_from(&out[k * 4..k * 4 + 4]).unwrap();
        let (ni, nf) = (4 + 20, 1 + 20);
        let oi = |r: usize, j: usize| i32::from_le_bytes(word(r * ni + j));
        let of = |r: usize, j: usize| f32::from_le_bytes(word(cases.len() * ni + r * nf + j));
        let close = |a: f32, b: f32| (a == b) || (a - b).abs() <= 1e-5 * (1.0 + b.abs());
        for (r, (c, (want, drew))) in cases.iter().zip(&expected).enumerate() {
            let what = format!(
                "vocab {vocab}, row {r}: {:?}, history {}, constrained {}",
                c.params,
                c.history.len(),
                c.allowed.is_some()
            );
            total += 1;
            match oi(r, 0) {
                0 => {
                    assert!(!c.must_defer, "{what}: a prefix past the list was drawn on the device");
                    decided += 1;
                    assert_eq!(oi(r, 1) as u32, want.token, "{what}: token");
                    assert_eq!(oi(r, 2) == 1, *drew, "{what}: whether the draw was used");
                    assert!(
                        close(of(r, 0), want.logprob),
                        "{what}: logprob {} vs {}",
                        of(r, 0),
                        want.logprob
                    );
                    assert_eq!(oi(r, 3) as usize, want.top_logprobs.len(), "{what}: alternatives");
                    for (k, &(id, lp)) in want.top_logprobs.iter().enumerate() {
                        assert_eq!(oi(r, 4 + k) as u32, id, "{what}: alternative {k}");
                        assert!(close(of(r, 1 + k), lp), "{what}: alternative {k}: {} vs {lp}", of(r, 1 + k));
                    }
                }
                1 => assert!(c.may_defer, "{what}: left to the host, though its candidates fit the list"),
                s => panic!("{what}: status {s}"),
            }
        }
    }
    eprintln!("device sampling: {decided} of {total} rows drawn on the device, the rest left to the host");
    assert!(decided * 10 >= total * 8, "only {decided} of {total} rows were drawn on the device");
}

/// The decode products over GGUF blocks kept quantized (`qgemv_q8_0`, `qgemv_q4_0`,
/// `qgemv_q4_1`, and the k-quants' `qgemv_q4_k`, `qgemv_q5_k`, `qgemv_q6_k`) against the
/// engine's own dequantization of the same bytes, dotted in double precision with the same bf16
/// inputs: within 1e-5 of the sum of |products| (the kernel sums in f32, in its own order).
/// Scales cover zero, subnormal (both signs), negative and large f16 values; row lengths cover
/// fewer sub-blocks than a warp's lanes and more (some lanes take two, others one).
/// `blocks` blocks of `dtype` of random bytes, with f16 scales drawn to cover zero, subnormals of
/// both signs, negative and large values.
fn random_blocks(rng: &mut Rng, dtype: tandem_engine::quant::GgmlType, blocks: usize) -> Vec<u8> {
    use tandem_engine::quant::GgmlType;
    let mut w = vec![0u8; blocks * dtype.block_bytes()];
    for b in w.iter_mut() {
        *b = rng.next() as u8;
    }
    for blk in w.chunks_exact_mut(dtype.block_bytes()) {
        let mut scale = || -> [u8; 2] {
            let v = match rng.below(8) {
                0 => 0.0,
                1 => 3.0e-6,  // subnormal in f16
                2 => -3.0e-6, // and negative
                3 => (rng.unit() - 0.5) * 16.0,
                _ => (rng.unit() - 0.5) * 0.1,
            };
            half::f16::from_f32(v).to_bits().to_le_bytes()
        };
        match dtype {
            GgmlType::Q6_K => blk[208..210].copy_from_slice(&scale()),
            GgmlType::Q3_K => blk[108..110].copy_from_slice(&scale()),
            GgmlType::Q2_K => {
                blk[80..82].copy_from_slice(&scale());
                blk[82..84].copy_from_slice(&scale());
            }
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => {
                blk[0..2].copy_from_slice(&scale());
                blk[2..4].copy_from_slice(&scale());
            }
            _ => blk[0..2].copy_from_slice(&scale()),
        }
    }
    w
}

/// The quantized types as model.cu numbers them.
const QTYPES: [(tandem_engine::quant::GgmlType, i32); 10] = {
    use tandem_engine::quant::GgmlType;
    [
        (GgmlType::Q8_0, 8),
        (GgmlType::Q4_0, 0),
        (GgmlType::Q4_1, 1),
        (GgmlType::Q5_0, 6),
        (GgmlType::Q5_1, 7),
        (GgmlType::Q2_K, 10),
        (GgmlType::Q3_K, 11),
        (GgmlType::Q4_K, 12),
        (GgmlType::Q5_K, 13),
        (GgmlType::Q6_K, 14),
    ]
};

#[test]
fn quantized_weights_expand_to_the_bf16_of_the_engines_dequantization() {
    use tandem_engine::quant::dequantize;
    let Some(exe) = harness() else {
        return no_compiler("quantized_weights_expand_to_the_bf16_of_the_engines_dequantization");
    };
    let mut rng = Rng(0x5eed_00de);
    let mut checked = 0;
    for (dtype, qt) in QTYPES {
        // Blocks of 32 or super-blocks of 256; fewer sub-blocks than threads, and more than the
        // grid's threads (a second lap of the grid-stride loop).
        for (blocks, grid) in [(1usize, 1i32), (3, 2), (41, 1)] {
            let w = random_blocks(&mut rng, dtype, blocks);
            let weights = blocks * dtype.block_len();
            let mut want = vec![0f32; weights];
            dequantize(dtype, &w, &mut want).unwrap();
            let mut bytes = Vec::new();
            for v in [qt, (weights / 32) as i32, grid] {
                bytes.extend_from_slice(&v.to_le_bytes());
            }
            bytes.extend_from_slice(&w);
            let got: Vec<u16> = run_mode(exe, "qdequant", "qdequant", &bytes)
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect();
            assert_eq!(got.len(), weights);
            for (i, (&g, &f)) in got.iter().zip(&want).enumerate() {
                let w16 = half::bf16::from_f32(f).to_bits();
                assert_eq!(g, w16, "{dtype} blocks={blocks} weight {i}: {g:#06x} vs {w16:#06x} (f32 {f})");
                checked += 1;
            }
        }
    }
    eprintln!("quantized weights to bf16: {checked} weights checked");
}

#[test]
fn quantized_decode_products_match_the_engines_dequantized_weights() {
    use tandem_engine::quant::dequantize;
    let Some(exe) = harness() else {
        return no_compiler("quantized_decode_products_match_the_engines_dequantized_weights");
    };
    let mut rng = Rng(0x5eed_0047);
    let mut checked = 0;
    let simple: &[(usize, usize, usize, i32)] =
        &[(37, 96, 1, 2), (20, 1056, 3, 1), (9, 64, 8, 3), (16, 2048, 5, 2)];
    // (37, 512, 2, 1): more rows than the block's 8 warps, so warps take a second row.
    let k_shapes: &[(usize, usize, usize, i32)] =
        &[(5, 256, 1, 1), (7, 1280, 3, 2), (4, 2048, 8, 1), (37, 512, 2, 1)];
    for (dtype, qt) in QTYPES {
        for &(rows, cols, n, grid) in if qt >= 10 { k_shapes } else { simple } {
            let w = random_blocks(&mut rng, dtype, rows * cols / dtype.block_len());
            let x: Vec<half::bf16> =
                (0..n * cols).map(|_| half::bf16::from_f32((rng.unit() - 0.5) * 4.0)).collect();
            let mut wf = vec![0f32; rows * cols];
            dequantize(dtype, &w, &mut wf).unwrap();

            let mut bytes = Vec::new();
            for v in [qt, rows as i32, cols as i32, n as i32, grid] {
                bytes.extend_from_slice(&v.to_le_bytes());
            }
            bytes.extend_from_slice(&w);
            x.iter().for_each(|v| bytes.extend_from_slice(&v.to_bits().to_le_bytes()));
            let y: Vec<f32> = run_mode(exe, "qgemv", "qgemv", &bytes)
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            assert_eq!(y.len(), n * rows);
            for t in 0..n {
                for r in 0..rows {
                    let (mut want, mut mag) = (0f64, 0f64);
                    for c in 0..cols {
                        let xv = x[t * cols + c].to_f64();
                        let p = wf[r * cols + c] as f64 * xv;
                        want += p;
                        mag += p.abs();
                    }
                    let got = y[t * rows + r] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * mag + 1e-30,
                        "{dtype} rows={rows} cols={cols} n={n} t={t} r={r}: {got} vs {want} (sum of |products| {mag})"
                    );
                    checked += 1;
                }
            }
        }
    }
    eprintln!("quantized decode products: {checked} outputs checked");
}
