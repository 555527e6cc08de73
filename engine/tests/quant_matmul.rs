//! `cpu::matmul` equals "dequantize, then dot" for every weight type, on the SIMD path the CPU
//! selects and on the forced portable path, for odd token counts and row counts that are not a
//! multiple of the kernels' tiles.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tandem_engine::cpu::matmul::{matmul, matmul_scalar, matmul_with, Isa};
use tandem_engine::quant::{dequantize, GgmlType};
use tandem_engine::weights::{Bytes, Matrix};

const TYPES: [GgmlType; GgmlType::ALL.len()] = GgmlType::ALL;

fn f16_bytes(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// Random bytes forming valid blocks: quants are arbitrary, scales finite and modest.
fn random_matrix(rng: &mut ChaCha8Rng, dtype: GgmlType, rows: usize, cols: usize) -> Matrix {
    let n_blocks = rows * cols / dtype.block_len();
    let mut bytes = vec![0u8; n_blocks * dtype.block_bytes()];
    rng.fill(&mut bytes[..]);
    for b in bytes.chunks_exact_mut(dtype.block_bytes()) {
        let mut scale = || f16_bytes(rng.random_range(-0.05f32..0.05));
        match dtype {
            GgmlType::F32 => b.copy_from_slice(&rng.random_range(-1.0f32..1.0).to_le_bytes()),
            GgmlType::F16 => b.copy_from_slice(&f16_bytes(rng.random_range(-1.0f32..1.0))),
            GgmlType::BF16 => {
                let v = rng.random_range(-1.0f32..1.0).to_bits() >> 16;
                b.copy_from_slice(&(v as u16).to_le_bytes());
            }
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => b[0..2].copy_from_slice(&scale()),
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => {
                b[0..2].copy_from_slice(&scale());
                b[2..4].copy_from_slice(&scale());
            }
            GgmlType::Q2_K => {
                b[80..82].copy_from_slice(&scale());
                b[82..84].copy_from_slice(&scale());
            }
            GgmlType::Q3_K => b[108..110].copy_from_slice(&scale()),
            GgmlType::Q6_K => b[208..210].copy_from_slice(&scale()),
        }
    }
    Matrix { rows, cols, dtype, data: Bytes::copy_from(&bytes) }
}

fn dequantized(w: &Matrix) -> Vec<f32> {
    let mut out = vec![0f32; w.rows * w.cols];
    dequantize(w.dtype, &w.data, &mut out).unwrap();
    out
}

/// Every kernel set this CPU runs (portable, and AVX2 / AVX-512 where present), plus the
/// automatic choice.
type Kernel = Box<dyn Fn(&Matrix, &[f32], usize, &mut [f32])>;

fn paths() -> Vec<(String, Kernel)> {
    let mut v: Vec<(String, Kernel)> =
        vec![("dispatch".into(), Box::new(matmul)), ("portable".into(), Box::new(matmul_scalar))];
    for isa in Isa::available() {
        v.push((
            format!("{isa:?}"),
            Box::new(move |w: &Matrix, x: &[f32], n, y: &mut [f32]| matmul_with(isa, w, x, n, y)),
        ));
    }
    v
}

#[test]
fn matches_f64_reference_for_every_type_and_shape() {
    let paths = paths();
    println!("kernel sets: {:?}", paths.iter().map(|p| &p.0).collect::<Vec<_>>());
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for dtype in TYPES {
        let mut col_options = vec![dtype.block_len() * 2, 512];
        if dtype.block_len() == 1 {
            col_options.extend([1, 37, 95]); // exercise the vector tails
        }
        for &cols in &col_options {
            for rows in [1, 5, 7, 13, 67] {
                let w = random_matrix(&mut rng, dtype, rows, cols);
                let wf = dequantized(&w);
                for n in [1, 2, 3, 5, 9] {
                    let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-2.0f32..2.0)).collect();
                    for (path, f) in &paths {
                        let mut y = vec![f32::NAN; n * rows];
                        f(&w, &x, n, &mut y);
                        for t in 0..n {
                            for r in 0..rows {
                                let (mut exact, mut mag) = (0f64, 0f64);
                                for c in 0..cols {
                                    let p = x[t * cols + c] as f64 * wf[r * cols + c] as f64;
                                    exact += p;
                                    mag += p.abs();
                                }
                                let got = y[t * rows + r] as f64;
                                // f32 accumulation over `cols` terms in any order.
                                let tol = 1e-6 * (cols as f64).sqrt() * mag + 1e-30;
                                assert!(
                                    (got - exact).abs() <= tol,
                                    "{path} {dtype} rows={rows} cols={cols} n={n} t={t} r={r}: {got} vs {exact} (tol {tol:e})"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// In passes of up to `SMALL_N` tokens, every token's outputs are bit for bit what a pass of that
/// token alone gives, on every kernel set and for every type: speculative verification and
/// batched decode compute exactly what single decode steps would.
#[test]
fn small_passes_compute_each_token_exactly_as_alone() {
    use tandem_engine::cpu::matmul::SMALL_N;
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for dtype in TYPES {
        for cols in [dtype.block_len().max(32) * 3, 512] {
            if cols % dtype.block_len() != 0 {
                continue;
            }
            // Row counts that split over several tasks and ones that do not.
            for rows in [7, 300] {
                let w = random_matrix(&mut rng, dtype, rows, cols);
                for n in 2..=SMALL_N {
                    let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-2.0f32..2.0)).collect();
                    for (path, f) in &paths() {
                        let mut y = vec![f32::NAN; n * rows];
                        f(&w, &x, n, &mut y);
                        for t in 0..n {
                            let mut alone = vec![f32::NAN; rows];
                            f(&w, &x[t * cols..(t + 1) * cols], 1, &mut alone);
                            let got: Vec<u32> =
                                y[t * rows..(t + 1) * rows].iter().map(|v| v.to_bits()).collect();
                            let want: Vec<u32> = alone.iter().map(|v| v.to_bits()).collect();
                            assert!(got == want, "{path} {dtype} rows={rows} cols={cols} n={n} token {t} differs from a pass of its own");
                        }
                    }
                }
            }
        }
    }
}

/// With one-hot activations every output is a single weight, so the weights the kernels rebuild
/// must equal `dequantize`'s exactly (a fused multiply-add in the rebuild would show here). Values
/// are compared with `==` because the sum of a weight of -0.0 with the other +0.0 products is +0.0.
#[test]
fn kernels_rebuild_weights_exactly() {
    let paths = paths();
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for dtype in TYPES {
        let (rows, cols) = (9, dtype.block_len().max(32) * 2);
        let w = random_matrix(&mut rng, dtype, rows, cols);
        let wf = dequantized(&w);
        // n = cols tokens, token t one-hot at column t (the prefill path) ...
        let mut x = vec![0f32; cols * cols];
        for t in 0..cols {
            x[t * cols + t] = 1.0;
        }
        for (path, f) in &paths {
            let mut y = vec![0f32; cols * rows];
            f(&w, &x, cols, &mut y);
            for t in 0..cols {
                for r in 0..rows {
                    assert_eq!(y[t * rows + r], wf[r * cols + t], "{path} {dtype} prefill r={r} c={t}");
                }
            }
            // ... and one token at a time (the decode path).
            for t in (0..cols).step_by(7) {
                let mut y1 = vec![0f32; rows];
                f(&w, &x[t * cols..(t + 1) * cols], 1, &mut y1);
                for r in 0..rows {
                    assert_eq!(y1[r], wf[r * cols + t], "{path} {dtype} decode r={r} c={t}");
                }
            }
        }
    }
}

#[test]
fn large_shapes_split_across_tasks_agree_with_portable() {
    // Big enough that rows are split over several rayon tasks.
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for dtype in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::F32] {
        let (rows, cols) = (1000, 576);
        let w = random_matrix(&mut rng, dtype, rows, cols);
        for n in [1, 6] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let (mut a, mut b) = (vec![0f32; n * rows], vec![0f32; n * rows]);
            matmul(&w, &x, n, &mut a);
            matmul_scalar(&w, &x, n, &mut b);
            for (i, (p, q)) in a.iter().zip(&b).enumerate() {
                assert!((p - q).abs() <= 1e-4 * (1.0 + q.abs()), "{dtype} n={n} i={i}: {p} vs {q}");
            }
        }
    }
}

#[test]
#[should_panic]
fn wrong_activation_length_panics() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let w = random_matrix(&mut rng, GgmlType::Q4_1, 4, 64);
    let mut y = vec![0f32; 4];
    matmul(&w, &[0.0; 63], 1, &mut y);
}

// ---- the 8-bit activation path ------------------------------------------------------------------

use tandem_engine::cpu::q8::{
    self, matmul_q8_with, quantized_reference, Isa8, PackedMatrix, QuantizedRows, QBLOCK,
};

const Q8_TYPES: [GgmlType; 9] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::Q5_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// Widths to try for a type: odd and even block counts, and for k-quants (blocks of 256) one,
/// two and three super-blocks.
fn q8_cols(dtype: GgmlType) -> &'static [usize] {
    if dtype.block_len() == 256 {
        &[256, 512, 768]
    } else {
        &[32, 96, 160, 576]
    }
}

/// A small and a large shape (the large one splits over tasks).
fn q8_shapes(dtype: GgmlType) -> [(usize, usize); 2] {
    if dtype.block_len() == 256 {
        [(7, 256), (300, 512)]
    } else {
        [(7, 96), (300, 576)]
    }
}

fn random_acts(rng: &mut ChaCha8Rng, n: usize, cols: usize) -> Vec<f32> {
    let mut x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    // A zero block, a block with one huge value and one of tiny values: the scale's edge cases.
    if cols >= 3 * QBLOCK {
        x[..QBLOCK].fill(0.0);
        x[QBLOCK + 5] = 1e4;
        x[2 * QBLOCK..3 * QBLOCK].iter_mut().for_each(|v| *v *= 1e-6);
    }
    x
}

/// 8-bit (`wide == false`) or 16-bit quantization.
fn quantize(x: &[f32], n: usize, cols: usize, wide: bool) -> QuantizedRows {
    let mut xq = QuantizedRows::new();
    if wide {
        xq.quantize_wide(x, n, cols);
    } else {
        xq.quantize(x, n, cols);
    }
    assert_eq!(xq.is_wide(), wide);
    xq
}

/// Each block's quants reconstruct it within half a step, stay in `-top..=top` (127 or 32767),
/// and the largest magnitude maps to ±top; a zero block has scale 0 and zero quants.
#[test]
fn q8_quantization_is_within_half_a_step() {
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    for (n, cols, wide) in [(1, 96, false), (3, 576, false), (9, 160, false), (1, 96, true), (9, 160, true)] {
        let top = if wide { 32767 } else { 127 };
        let x = random_acts(&mut rng, n, cols);
        let xq = quantize(&x, n, cols, wide);
        assert_eq!((xq.n(), xq.cols()), (n, cols));
        for t in 0..n {
            let (qs, d) = xq.row(t);
            for (b, (xb, qb)) in x[t * cols..(t + 1) * cols].chunks(QBLOCK).zip(qs.chunks(QBLOCK)).enumerate()
            {
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                if amax == 0.0 {
                    assert_eq!(d[b], 0.0);
                    assert!(qb.iter().all(|&q| q == 0));
                    continue;
                }
                assert!(qb.iter().any(|&q| q.abs() == top), "t={t} b={b}: no quant at ±{top}");
                for (&v, &q) in xb.iter().zip(qb) {
                    assert!((-top..=top).contains(&q));
                    let err = (v - d[b] * q as f32).abs();
                    // Half a step, plus the f32 rounding of `x · top / a` (a few ulps of `top`).
                    assert!(
                        err <= d[b] * (0.5 + top as f32 * 5e-7),
                        "t={t} b={b}: {v} vs {q}·{} (err {err})",
                        d[b]
                    );
                }
            }
        }
    }
    // Non-finite input never panics or wraps.
    let mut xq = QuantizedRows::new();
    let mut x = vec![1.0f32; 32];
    x[3] = f32::NAN;
    x[4] = f32::INFINITY;
    xq.quantize(&x, 1, 32);
    assert!(xq.row(0).0.iter().all(|q| (-127..=127).contains(q)));
}

/// Every integer kernel set equals the module's formula computed in f64, for every type, block
/// counts odd and even, token counts below, at and above one kernel group, and row counts that
/// split over tasks or not.
#[test]
fn q8_kernels_match_f64_reference() {
    let isas = Isa8::available();
    println!("integer kernel sets: {isas:?}");
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    for dtype in Q8_TYPES {
        for &cols in q8_cols(dtype) {
            for rows in [1, 7, 300] {
                let w = random_matrix(&mut rng, dtype, rows, cols);
                let wf = dequantized(&w);
                let (narrow, widep) = (PackedMatrix::pack(&w), PackedMatrix::pack_wide(&w));
                for (n, wide) in [
                    (1, false),
                    (3, false),
                    (8, false),
                    (9, false),
                    (17, false),
                    (1, true),
                    (9, true),
                    (17, true),
                ] {
                    let x = random_acts(&mut rng, n, cols);
                    let xq = quantize(&x, n, cols, wide);
                    let packed = if wide { &widep } else { &narrow };
                    for &isa in &isas {
                        let mut y = vec![f32::NAN; n * rows];
                        matmul_q8_with(isa, packed, &xq, &mut y);
                        for t in 0..n {
                            let (qs, d) = xq.row(t);
                            for r in 0..rows {
                                let want = quantized_reference(&w, &xq, r, t);
                                let mag: f64 = (0..cols)
                                    .map(|c| {
                                        (wf[r * cols + c] as f64 * d[c / QBLOCK] as f64 * qs[c] as f64).abs()
                                    })
                                    .sum();
                                let got = y[t * rows + r] as f64;
                                let tol = 1e-6 * (cols as f64).sqrt() * mag + 1e-30;
                                assert!(
                                    (got - want).abs() <= tol,
                                    "{isa:?} {dtype} wide={wide} rows={rows} cols={cols} n={n} t={t} r={r}: {got} vs {want} (tol {tol:e})"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Whatever the other tokens of a call and however many, a token's outputs are bit for bit those
/// of a call with that token alone, on every integer kernel set.
#[test]
fn q8_each_token_computes_exactly_as_alone() {
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    for dtype in Q8_TYPES {
        for (rows, cols) in q8_shapes(dtype) {
            let w = random_matrix(&mut rng, dtype, rows, cols);
            for (n, wide) in [(2, false), (5, false), (8, false), (13, false), (3, true), (13, true)] {
                let x = random_acts(&mut rng, n, cols);
                let xq = quantize(&x, n, cols, wide);
                let packed = if wide { PackedMatrix::pack_wide(&w) } else { PackedMatrix::pack(&w) };
                for isa in Isa8::available() {
                    let mut y = vec![f32::NAN; n * rows];
                    matmul_q8_with(isa, &packed, &xq, &mut y);
                    for t in 0..n {
                        let one = quantize(&x[t * cols..(t + 1) * cols], 1, cols, wide);
                        let mut alone = vec![f32::NAN; rows];
                        matmul_q8_with(isa, &packed, &one, &mut alone);
                        let got: Vec<u32> = y[t * rows..(t + 1) * rows].iter().map(|v| v.to_bits()).collect();
                        let want: Vec<u32> = alone.iter().map(|v| v.to_bits()).collect();
                        assert!(got == want, "{isa:?} {dtype} wide={wide} rows={rows} n={n}: token {t} differs from a call of its own");
                    }
                }
            }
        }
    }
}

/// The vector kernel sets compute the same bits: the AVX2 kernels (8 rows a vector) and the
/// AVX-512 VNNI ones (16) take the same exact integer sums and apply the scales with the same
/// float operations in the same order, at 8 and 16 bits, for every type, for token counts below,
/// at and above either kernel's group. A CPU without AVX-512 has one vector set and nothing to
/// compare it with (the f64 reference test still checks it); this test then says so.
#[cfg(target_arch = "x86_64")]
#[test]
fn avx2_kernels_give_the_avx512_bits() {
    let isas = Isa8::available();
    if !(isas.contains(&Isa8::Avx2) && isas.contains(&Isa8::Avx512Vnni)) {
        println!(
            "avx2_kernels_give_the_avx512_bits: one vector kernel set here ({isas:?}), nothing to compare"
        );
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(24);
    let mut checked = 0;
    for dtype in Q8_TYPES {
        for (rows, cols) in q8_shapes(dtype) {
            let w = random_matrix(&mut rng, dtype, rows, cols);
            for wide in [true, false] {
                let packed = if wide { PackedMatrix::pack_wide(&w) } else { PackedMatrix::pack(&w) };
                for n in [1, 2, 3, 4, 5, 8, 9, 13] {
                    let x = random_acts(&mut rng, n, cols);
                    let xq = quantize(&x, n, cols, wide);
                    let (mut a, mut b) = (vec![f32::NAN; n * rows], vec![f32::NAN; n * rows]);
                    matmul_q8_with(Isa8::Avx2, &packed, &xq, &mut a);
                    matmul_q8_with(Isa8::Avx512Vnni, &packed, &xq, &mut b);
                    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                        assert!(
                            x.to_bits() == y.to_bits(),
                            "{} {rows}×{cols} wide={wide} n={n}: token {} row {}: AVX2 {x}, AVX-512 {y}",
                            dtype.name(),
                            i / rows,
                            i % rows
                        );
                    }
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, Q8_TYPES.len() * 2 * 2 * 8, "every type, shape, width and count was checked");
}

/// Several products over one input in one parallel loop (a layer's Q, K and V; gate and up):
/// each output is the bits a call of its own gives, with mixed types (as in a Q4_K_M file, whose
/// V matrices are often Q6_K), for decode, small passes and prompt-sized passes (the AMX tiles,
/// where the CPU has them, take those one matrix at a time).
#[test]
fn several_products_in_one_loop_equal_each_alone() {
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    let cols = 512;
    let shapes = [(GgmlType::Q4_K, 300), (GgmlType::Q6_K, 64), (GgmlType::Q8_0, 17), (GgmlType::Q4_1, 129)];
    for wide in [true, false] {
        let ws: Vec<PackedMatrix> = shapes
            .iter()
            .map(|&(d, rows)| {
                let m = random_matrix(&mut rng, d, rows, cols);
                if wide {
                    PackedMatrix::pack_wide(&m)
                } else {
                    PackedMatrix::pack(&m)
                }
            })
            .collect();
        for n in [1, 3, 9, 64] {
            let x = random_acts(&mut rng, n, cols);
            let xq = quantize(&x, n, cols, wide);
            let mut ys: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; n * w.rows]).collect();
            {
                let mut many: Vec<(&PackedMatrix, &mut [f32])> =
                    ws.iter().zip(ys.iter_mut()).map(|(w, y)| (w, y.as_mut_slice())).collect();
                q8::matmul_q8_many(&mut many, &xq);
            }
            for (w, y) in ws.iter().zip(&ys) {
                let mut alone = vec![f32::NAN; n * w.rows];
                q8::matmul_q8(w, &xq, &mut alone);
                let got: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
                let want: Vec<u32> = alone.iter().map(|v| v.to_bits()).collect();
                assert!(
                    got == want,
                    "{:?} rows={} n={n} wide={wide}: differs from its own call",
                    w.dtype,
                    w.rows
                );
            }
        }
    }
}

/// The integer path stays within the error the activation quantization allows of the exact f32
/// product: per element at most half a step of its block's scale.
#[test]
fn q8_path_is_close_to_f32_path() {
    let mut rng = ChaCha8Rng::seed_from_u64(24);
    for dtype in Q8_TYPES {
        assert!(q8::supports(dtype));
        let (rows, cols, n) = (64, q8_shapes(dtype)[1].1, 3);
        let w = random_matrix(&mut rng, dtype, rows, cols);
        let wf = dequantized(&w);
        let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        let mut yf = vec![0f32; n * rows];
        matmul(&w, &x, n, &mut yf);
        for wide in [false, true] {
            let xq = quantize(&x, n, cols, wide);
            let mut yq = vec![0f32; n * rows];
            let packed = if wide { PackedMatrix::pack_wide(&w) } else { PackedMatrix::pack(&w) };
            q8::matmul_q8(&packed, &xq, &mut yq);
            for t in 0..n {
                let (_, d) = xq.row(t);
                for r in 0..rows {
                    let bound: f32 =
                        (0..cols).map(|c| wf[r * cols + c].abs() * d[c / QBLOCK] * 0.5).sum::<f32>() * 1.001
                            + 1e-5;
                    let diff = (yq[t * rows + r] - yf[t * rows + r]).abs();
                    assert!(
                        diff <= bound,
                        "{dtype} wide={wide} t={t} r={r}: {} vs {} (bound {bound})",
                        yq[t * rows + r],
                        yf[t * rows + r]
                    );
                }
            }
        }
    }
    for dtype in GgmlType::ALL.into_iter().filter(|t| !Q8_TYPES.contains(t)) {
        assert!(!q8::supports(dtype), "{dtype}");
    }
}

/// Q5_0 reaches the integer kernels as the Q8_0 it converts to, which dequantizes to the same
/// values bit for bit.
#[test]
fn q5_0_converts_to_q8_0_exactly() {
    let mut rng = ChaCha8Rng::seed_from_u64(25);
    let w = random_matrix(&mut rng, GgmlType::Q5_0, 48, 256);
    let q8 = q8::q5_0_as_q8_0(&w);
    assert_eq!((q8.dtype, q8.rows, q8.cols), (GgmlType::Q8_0, 48, 256));
    let (a, b) = (dequantized(&w), dequantized(&q8));
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "values differ");
    assert!(a.iter().any(|&x| x != 0.0) && a.iter().any(|&x| x < 0.0), "the sample exercises little");
    assert_eq!(PackedMatrix::pack(&w).dtype, GgmlType::Q8_0);
}

/// Quantization rounds to the nearest integer with ties to even, like `f32::round_ties_even`.
#[test]
fn q8_quantization_rounds_ties_to_even() {
    // Block maximum 127 makes the scale exactly 1, so quants are the rounded inputs.
    let mut x = vec![0f32; 32];
    x[0] = 127.0;
    let cases = [0.5f32, 1.5, 2.5, -0.5, -1.5, -2.5, 2.4999998, 3.5000002, -126.5, 126.5];
    x[1..1 + cases.len()].copy_from_slice(&cases);
    let mut xq = QuantizedRows::new();
    xq.quantize(&x, 1, 32);
    let (qs, d) = xq.row(0);
    assert_eq!(d[0], 1.0);
    for (i, &v) in cases.iter().enumerate() {
        assert_eq!(qs[1 + i] as f32, v.round_ties_even(), "{v}");
    }
}

// ---- AMX tiles ------------------------------------------------------------------------------------

/// The AMX tiles compute bit for bit what the AVX-512 VNNI kernels compute (the same integer sums,
/// then the same float steps), for every packed type (the k-quants with one, two and three
/// super-blocks), 8- and 16-bit activations, token counts
/// below, at and past a tile of 16 (and a partial last tile), and row counts that split over tasks
/// or end in a partial group. On a CPU without AMX the test prints `SKIPPED`; on one that lists AMX
/// but cannot use it, it fails under `TANDEM_REQUIRE_EXTERNAL=1`.
#[cfg(target_arch = "x86_64")]
#[test]
fn amx_tiles_match_vnni_kernels_bit_for_bit() {
    use tandem_engine::cpu::q8::{amx, matmul_q8_amx};
    if let Err(why) = amx::usable() {
        let required = std::env::var("TANDEM_REQUIRE_EXTERNAL").is_ok_and(|v| v == "1");
        if amx::listed() && required {
            panic!(
                "this CPU lists AMX-INT8 but the tiles cannot be used ({why}), and TANDEM_REQUIRE_EXTERNAL=1"
            );
        }
        println!("SKIPPED amx_tiles_match_vnni_kernels_bit_for_bit: {why}");
        return;
    }
    println!("{}", amx::choice().why);
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    let mut checked = 0;
    for dtype in Q8_TYPES {
        let shapes = if dtype.block_len() == 256 {
            [(16, 256), (7, 512), (37, 768), (300, 512)]
        } else {
            [(16, 32), (7, 96), (37, 160), (300, 576)]
        };
        for (rows, cols) in shapes {
            let w = random_matrix(&mut rng, dtype, rows, cols);
            for wide in [false, true] {
                let p = if wide { PackedMatrix::pack_wide(&w) } else { PackedMatrix::pack(&w) };
                for n in [1, 5, 16, 17, 40] {
                    let x = random_acts(&mut rng, n, cols);
                    let xq = quantize(&x, n, cols, wide);
                    let (mut tiles, mut vnni) = (vec![f32::NAN; n * rows], vec![f32::NAN; n * rows]);
                    matmul_q8_amx(&p, &xq, &mut tiles);
                    matmul_q8_with(Isa8::Avx512Vnni, &p, &xq, &mut vnni);
                    for (i, (a, b)) in tiles.iter().zip(&vnni).enumerate() {
                        assert!(
                            a.to_bits() == b.to_bits(),
                            "{} {rows}×{cols} wide={wide} n={n}: token {} row {}: tiles {a}, VNNI {b}",
                            dtype.name(),
                            i / rows,
                            i % rows
                        );
                    }
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, Q8_TYPES.len() * 4 * 2 * 5, "every packed type was checked");
}
