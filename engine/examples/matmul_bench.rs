//! Times `cpu::matmul` on SmolLM2-135M's shapes (576→576, 576→192, 576→1536, 1536→576 in Q4_1 and
//! the 576→49152 Q8_0 lm_head), for one token (decode) and 128 tokens (prefill), then a whole
//! decode token and a whole 128-token prefill over all 30 layers, each through the f32 kernels and
//! the 8-bit activation kernels side by side (and, for the whole model, the 16-bit ones). Uses the real model's weights when
//! the file is present, random blocks otherwise.
//!
//! `cargo run --release -p tandem-engine --example matmul_bench [threads=2] [model.gguf]`
//!
//! `TANDEM_BENCH_ISA=avx2` times the AVX2 kernels on a CPU that has AVX-512 too (what an
//! AVX2-only CPU would run, at this CPU's clocks).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tandem_engine::cpu::matmul::{matmul_with, Isa};
use tandem_engine::cpu::q8::{matmul_q8_with, Isa8, PackedMatrix, QuantizedRows};
use tandem_engine::gguf::{GgufFile, GgufTensors};
use tandem_engine::quant::GgmlType;
use tandem_engine::weights::{Bytes, Matrix};

fn random_matrix(dtype: GgmlType, rows: usize, cols: usize, seed: u64) -> Matrix {
    let mut s = seed | 1;
    let mut bytes = vec![0u8; rows * dtype.row_bytes(cols)];
    for b in bytes.iter_mut() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        *b = s as u8;
    }
    // Finite scales: the f16 fields at the start of every block become 0.01.
    let scale = half::f16::from_f32(0.01).to_bits().to_le_bytes();
    for blk in bytes.chunks_exact_mut(dtype.block_bytes()) {
        blk[0..2].copy_from_slice(&scale);
        if dtype == GgmlType::Q4_1 {
            blk[2..4].copy_from_slice(&scale);
        }
    }
    Matrix { rows, cols, dtype, data: Bytes::copy_from(&bytes) }
}

/// Fastest time of `f` over enough repetitions to fill ~`budget` (the minimum is the least
/// disturbed by other processes on a shared machine).
fn time(budget: Duration, mut f: impl FnMut()) -> Duration {
    f();
    let t0 = Instant::now();
    f();
    let once = t0.elapsed().max(Duration::from_nanos(1));
    let reps = ((budget.as_secs_f64() / once.as_secs_f64()) as usize).clamp(3, 2000);
    let mut v: Vec<Duration> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    v.sort();
    v[0]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let model = args.get(2).map(PathBuf::from).unwrap_or_else(tandem_model::cache::default_model_path);
    // The engine runs its forward pass inside its pool, so the calling thread is a worker too;
    // calling from outside would add a cross-thread wake-up to every matmul.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    pool.install(|| bench(threads, &model));
}

fn bench(threads: usize, model: &Path) {
    let avx2 = std::env::var("TANDEM_BENCH_ISA").is_ok_and(|v| v == "avx2");
    #[cfg(target_arch = "x86_64")]
    let (isa, q8isa) = if avx2 { (Isa::Avx2, Isa8::Avx2) } else { (Isa::best(), Isa8::best()) };
    #[cfg(not(target_arch = "x86_64"))]
    let (isa, q8isa) = (Isa::best(), Isa8::best());
    let _ = avx2;
    println!("threads {threads}, kernels {isa:?}");

    let file = model.exists().then(|| GgufFile::open(model).unwrap());
    let get = |name: &str, dtype, rows, cols, seed| match &file {
        Some(f) => f.matrix(name).unwrap(),
        None => random_matrix(dtype, rows, cols, seed),
    };
    let weights =
        if file.is_some() { model.display().to_string() } else { "random (model file absent)".into() };
    println!("weights: {weights}");

    let layers: Vec<Vec<Matrix>> = (0..30)
        .map(|l| {
            let s = l as u64 * 16;
            let q4 = GgmlType::Q4_1;
            vec![
                get(&format!("blk.{l}.attn_q.weight"), q4, 576, 576, s + 1),
                get(&format!("blk.{l}.attn_k.weight"), q4, 192, 576, s + 2),
                get(&format!("blk.{l}.attn_v.weight"), q4, 192, 576, s + 3),
                get(&format!("blk.{l}.attn_output.weight"), q4, 576, 576, s + 4),
                get(&format!("blk.{l}.ffn_gate.weight"), q4, 1536, 576, s + 5),
                get(&format!("blk.{l}.ffn_up.weight"), q4, 1536, 576, s + 6),
                get(&format!("blk.{l}.ffn_down.weight"), q4, 576, 1536, s + 7),
            ]
        })
        .collect();
    let lm_head = get("token_embd.weight", GgmlType::Q8_0, 49152, 576, 999);

    let x: Vec<f32> = (0..128 * 1536).map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0).collect();
    let mut y = vec![0f32; 128 * 49152];

    // Each shape through the f32 kernels (exact) and the 8-bit activation kernels (the
    // activations' quantization included in the time), side by side.
    println!("8-bit activation kernels {q8isa:?}");
    println!(
        "\n{:<16} {:>4} {:>10} {:>7} {:>7} {:>10} {:>7} {:>7} {:>6}",
        "shape", "n", "f32 time", "GFLOP/s", "GB/s", "q8 time", "GFLOP/s", "GB/s", "ratio"
    );
    let shapes: [(&str, &Matrix); 5] = [
        ("576→576 Q4_1", &layers[0][0]),
        ("576→192 Q4_1", &layers[0][1]),
        ("576→1536 Q4_1", &layers[0][4]),
        ("1536→576 Q4_1", &layers[0][6]),
        ("576→49152 Q8_0", &lm_head),
    ];
    let mut xq = QuantizedRows::new();
    for (label, w) in shapes {
        let packed = PackedMatrix::pack(w);
        for n in [1, 8, 128] {
            let (xs, ys) = (&x[..n * w.cols], &mut y[..n * w.rows]);
            let tf = time(Duration::from_millis(300), || matmul_with(isa, w, xs, n, ys));
            let tq = time(Duration::from_millis(300), || {
                xq.quantize(xs, n, w.cols);
                matmul_q8_with(q8isa, &packed, &xq, ys)
            });
            let flops = 2.0 * (w.rows * w.cols * n) as f64;
            let bytes = (w.rows * w.row_bytes()) as f64;
            let (sf, sq) = (tf.as_secs_f64(), tq.as_secs_f64());
            println!(
                "{label:<16} {n:>4} {:>8.1}µs {:>7.1} {:>7.1} {:>8.1}µs {:>7.1} {:>7.1} {:>5.2}x",
                sf * 1e6,
                flops / sf / 1e9,
                bytes / sf / 1e9,
                sq * 1e6,
                flops / sq / 1e9,
                bytes / sq / 1e9,
                sf / sq
            );
        }
    }

    let bytes: usize = layers.iter().flatten().chain([&lm_head]).map(|w| w.rows * w.row_bytes()).sum();
    let flops: f64 = layers.iter().flatten().map(|w| 2.0 * (w.rows * w.cols * 128) as f64).sum::<f64>()
        + 2.0 * (49152 * 576) as f64;
    let packed: Vec<(&Matrix, PackedMatrix, PackedMatrix)> = layers
        .iter()
        .flatten()
        .chain([&lm_head])
        .map(|w| (w, PackedMatrix::pack(w), PackedMatrix::pack_wide(w)))
        .collect();
    for mode in ["f32", "q16", "q8"] {
        let mut whole = |n: usize, with_lm_head_tokens: usize| {
            for (i, (w, p, pw)) in packed.iter().enumerate() {
                // The last matrix is the lm_head.
                let n = if i + 1 == packed.len() { with_lm_head_tokens } else { n };
                let (xs, ys) = (&x[..n * w.cols], &mut y[..n * w.rows]);
                match mode {
                    "f32" => matmul_with(isa, w, xs, n, ys),
                    "q16" => {
                        xq.quantize_wide(xs, n, w.cols);
                        matmul_q8_with(q8isa, pw, &xq, ys);
                    }
                    _ => {
                        xq.quantize(xs, n, w.cols);
                        matmul_q8_with(q8isa, p, &xq, ys);
                    }
                }
            }
        };
        let path = mode;
        let t = time(Duration::from_secs(2), || whole(1, 1));
        println!(
            "\n{path}: decode token (30 layers + lm_head, n=1): {:.2} ms, {:.1} GB/s of weights",
            t.as_secs_f64() * 1e3,
            bytes as f64 / t.as_secs_f64() / 1e9
        );
        let t = time(Duration::from_secs(3), || whole(128, 1));
        println!(
            "{path}: prefill 128 tokens (30 layers n=128, lm_head for the last token): {:.1} ms, {:.1} GFLOP/s",
            t.as_secs_f64() * 1e3,
            flops / t.as_secs_f64() / 1e9
        );
    }
}
