//! CPU matrix kernels: `y = x · Wᵀ` for weights in any supported [`GgmlType`], activations in f32.
//!
//! Invariant: the result equals "dequantize W exactly (as [`crate::quant::dequantize`] does), then
//! an f32 dot product" up to the rounding of a different summation order. Activations are never
//! quantized: greedy output is compared token for token against Hugging Face transformers, which
//! dequantizes GGUF weights to f32. Each weight value is rebuilt with the reference operation order
//! (`d * q + m` as a rounded product then a rounded sum, never a fused multiply-add) before it
//! meets the activation.
//!
//! Three shapes of work:
//! - `n == 1` (decode): a fused dequantize-and-dot per weight row, rows split over rayon tasks.
//!   Memory-bound; the kernels only need to keep up with the weight stream.
//! - `2 <= n <= `[`SMALL_N`] (batched decode, speculative verification, short chunks): the same
//!   per-row kernels, each weight block rebuilt once and multiplied into every token's
//!   accumulators (or, for types without such a kernel, the single-token kernel once per token
//!   while the row is in L1). Every token's dot product takes exactly the operations of the
//!   `n == 1` kernel in the same order, so **a token's result does not depend on the other tokens
//!   of a pass of up to `SMALL_N`**: a verification pass computes bit for bit what decode steps
//!   would, and a batched decode step what solo steps would.
//! - `n > SMALL_N` (prefill): for each tile of [`ROW_TILE`] weight rows, dequantize the
//!   rows once into a per-thread f32 scratch (it stays in L1/L2), then run a register-blocked
//!   micro-kernel computing a `tokens × rows` tile of dot products over all tokens.
//!
//! SIMD: AVX-512F+VL and AVX2+FMA (both with F16C) via `std::arch`, chosen at run time; a portable
//! path (also used on non-x86 targets) otherwise, and forced by [`matmul_scalar`] in tests.

use rayon::prelude::*;

use crate::quant::{self, GgmlType};
use crate::weights::Matrix;

/// Weight rows per micro-kernel tile (and per dequantized panel).
const ROW_TILE: usize = 6;
/// Tokens per micro-kernel tile.
const TOK_TILE: usize = 4;
/// Most tokens computed with the per-row (decode) kernels; larger passes use the tiles.
pub const SMALL_N: usize = 8;
/// Decode tasks are at least this many weight bytes, so scheduling stays a small fraction of work.
const MIN_TASK_BYTES: usize = 32 * 1024;

/// Instruction set used by the kernels (exposed for tests and benchmarks; see [`matmul_with`]).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    /// Every kernel set this CPU can run, portable first.
    pub fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            let base = is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            if base && is_x86_feature_detected!("avx2") {
                v.push(Isa::Avx2);
            }
            if base && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl") {
                v.push(Isa::Avx512);
            }
        }
        v
    }

    /// The kernel set [`matmul`] uses on this CPU.
    pub fn best() -> Isa {
        detect()
    }
}

fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        let base = is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
        // VL lets 128/256-bit operations (horizontal sums) use zmm16..31; without it the
        // compiler confines accumulators to 16 registers and spills.
        if base && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl") {
            return Isa::Avx512;
        }
        if base && is_x86_feature_detected!("avx2") {
            return Isa::Avx2;
        }
    }
    Isa::Portable
}

/// `y[t * w.rows + r] = Σ_c x[t * w.cols + c] · W[r][c]` for `t in 0..n`, in parallel on rayon's
/// current pool, with the fastest instruction set this CPU has.
///
/// Call it from inside the pool (`pool.install(..)` around the forward pass): from any other
/// thread every call pays a hand-off to the pool's workers and back, which costs more than a
/// small decode matmul itself.
///
/// # Panics
/// If `x.len() != n * w.cols`, `y.len() != n * w.rows`, `w.cols` is not a whole number of blocks
/// or `w.data` does not hold `w.rows` rows. Callers are internal and size everything from the
/// model config, so a mismatch is a bug, not bad input.
pub fn matmul(w: &Matrix, x: &[f32], n: usize, y: &mut [f32]) {
    run(detect(), w, x, n, y)
}

/// [`matmul`] over `n` of the `pass_n` tokens of a pass (a mixture of experts multiplies each
/// expert with the tokens routed to it): with the kernels [`matmul`] takes for `pass_n` tokens,
/// so each token's result is bit for bit what a multiplication over the whole pass would give it
/// (see the module documentation), whichever tokens it is grouped with.
///
/// # Panics
/// As [`matmul`], and if `n > pass_n`.
pub fn matmul_in_pass(w: &Matrix, x: &[f32], n: usize, pass_n: usize, y: &mut [f32]) {
    assert!(n <= pass_n, "matmul_in_pass: {n} tokens of a pass of {pass_n}");
    run_as(detect(), w, x, n, pass_n, y)
}

/// [`matmul`] with the portable kernels only, whatever the CPU supports (for tests and
/// comparisons).
#[doc(hidden)]
pub fn matmul_scalar(w: &Matrix, x: &[f32], n: usize, y: &mut [f32]) {
    run(Isa::Portable, w, x, n, y)
}

/// [`matmul`] with a chosen kernel set (tests compare them all).
///
/// # Panics
/// As [`matmul`], and if this CPU cannot run `isa` (it must come from [`Isa::available`]).
#[doc(hidden)]
pub fn matmul_with(isa: Isa, w: &Matrix, x: &[f32], n: usize, y: &mut [f32]) {
    assert!(Isa::available().contains(&isa), "matmul_with: {isa:?} is not supported by this CPU");
    run(isa, w, x, n, y)
}

fn run(isa: Isa, w: &Matrix, x: &[f32], n: usize, y: &mut [f32]) {
    run_as(isa, w, x, n, n, y)
}

/// `n` tokens through the kernels chosen for `pass_n >= n` tokens.
fn run_as(isa: Isa, w: &Matrix, x: &[f32], n: usize, pass_n: usize, y: &mut [f32]) {
    assert_eq!(w.cols % w.dtype.block_len(), 0, "matmul: cols not a whole number of blocks");
    assert_eq!(x.len(), n * w.cols, "matmul: x must be n × cols");
    assert_eq!(y.len(), n * w.rows, "matmul: y must be n × rows");
    assert!(w.data.len() >= w.rows * w.row_bytes(), "matmul: weight data shorter than rows × row_bytes");
    if n == 0 || w.rows == 0 {
        return;
    }
    if w.cols == 0 {
        y.fill(0.0);
        return;
    }
    if pass_n > SMALL_N {
        gemm(isa, w, x, n, y);
    } else if n == 1 {
        gemv(isa, w, x, y);
    } else {
        gemv_multi(isa, w, x, n, y);
    }
}

/// `2 <= n <= SMALL_N` tokens through the per-row kernels (see the module documentation).
fn gemv_multi(isa: Isa, w: &Matrix, x: &[f32], n: usize, y: &mut [f32]) {
    let rows = w.rows;
    let chunk = rows_per_task(w, 1);
    let rb = w.row_bytes();
    let data: &[u8] = &w.data;
    let out = SharedOut(y.as_mut_ptr());
    let n_tasks = rows.div_ceil(chunk);
    let task = move |t: usize| {
        let out = out;
        let r0 = t * chunk;
        let r1 = (r0 + chunk).min(rows);
        let xs: Vec<&[f32]> = x.chunks_exact(w.cols).collect();
        let mut dots = [0f32; SMALL_N];
        for r in r0..r1 {
            multi_dot_row(isa, w.dtype, &data[r * rb..(r + 1) * rb], &xs, &mut dots[..n]);
            for (ti, &v) in dots[..n].iter().enumerate() {
                // SAFETY: ti < n and r < rows, so the index is inside `y` (n × rows); this task
                // alone owns row r (see `SharedOut`).
                unsafe { *out.0.add(ti * rows + r) = v };
            }
        }
    };
    if n_tasks == 1 {
        task(0);
    } else {
        (0..n_tasks).into_par_iter().for_each(task);
    }
}

/// `out[t] = dot(row, xs[t])` for every token, each exactly as the single-token kernel of `isa`
/// computes it.
fn multi_dot_row(isa: Isa, dtype: GgmlType, row: &[u8], xs: &[&[f32]], out: &mut [f32]) {
    match isa {
        Isa::Portable => {
            for (o, x) in out.iter_mut().zip(xs) {
                *o = portable::dot_row(dtype, row, x);
            }
        }
        // SAFETY: `detect` (or `Isa::available` for `matmul_with`) saw these features.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::multi_dot_row_avx2(dtype, row, xs, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::multi_dot_row_avx512(dtype, row, xs, out) },
    }
}

/// Rows per parallel task: enough tasks to balance the pool, each big enough to be worth a task.
fn rows_per_task(w: &Matrix, multiple: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let by_balance = w.rows.div_ceil(threads * 4);
    let by_size = MIN_TASK_BYTES.div_ceil(w.row_bytes().max(1));
    by_balance.max(by_size).max(1).div_ceil(multiple) * multiple
}

fn gemv(isa: Isa, w: &Matrix, x: &[f32], y: &mut [f32]) {
    let chunk = rows_per_task(w, 1);
    let rb = w.row_bytes();
    let data: &[u8] = &w.data;
    if chunk >= w.rows {
        // One task: run it here rather than paying a hand-off to the pool.
        return gemv_rows(isa, w.dtype, &data[..w.rows * rb], rb, x, y);
    }
    y.par_chunks_mut(chunk).enumerate().for_each(|(i, ys)| {
        let r0 = i * chunk;
        let bytes = &data[r0 * rb..(r0 + ys.len()) * rb];
        gemv_rows(isa, w.dtype, bytes, rb, x, ys);
    });
}

/// `ys[i] = dot(row i of bytes, x)` for consecutive rows of `rb` bytes.
fn gemv_rows(isa: Isa, dtype: GgmlType, bytes: &[u8], rb: usize, x: &[f32], ys: &mut [f32]) {
    match isa {
        Isa::Portable => {
            for (yv, row) in ys.iter_mut().zip(bytes.chunks_exact(rb)) {
                *yv = portable::dot_row(dtype, row, x);
            }
        }
        // SAFETY: `detect` saw these features on this CPU before choosing the ISA; the kernels
        // only read `rb`-byte rows inside `bytes` and `x.len()` elements of `x`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::gemv_rows_avx2(dtype, bytes, rb, x, ys) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::gemv_rows_avx512(dtype, bytes, rb, x, ys) },
    }
}

/// A raw output pointer shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: tasks only write `y[t * rows + r]` for the rows `r` of their own range, and the ranges
// are disjoint, so no element is written by two threads; `y` outlives the parallel loop.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

thread_local! {
    /// Per-thread panel of dequantized weight rows, reused across calls to avoid page faults.
    static PANEL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn gemm(isa: Isa, w: &Matrix, x: &[f32], n: usize, y: &mut [f32]) {
    let rows = w.rows;
    let chunk = rows_per_task(w, ROW_TILE);
    let out = SharedOut(y.as_mut_ptr());
    let n_tasks = rows.div_ceil(chunk);
    (0..n_tasks).into_par_iter().for_each(move |task| {
        let out = out;
        let r_begin = task * chunk;
        let r_end = (r_begin + chunk).min(rows);
        PANEL.with(|panel| {
            let mut panel = panel.borrow_mut();
            gemm_rows(isa, w, x, n, r_begin..r_end, out, &mut panel);
        });
    });
}

fn gemm_rows(
    isa: Isa,
    w: &Matrix,
    x: &[f32],
    n: usize,
    rows: std::ops::Range<usize>,
    out: SharedOut,
    panel: &mut Vec<f32>,
) {
    let k = w.cols;
    let f32_rows = if w.dtype == GgmlType::F32 { w.data.as_f32() } else { None };
    if f32_rows.is_none() && panel.len() < ROW_TILE * k {
        panel.resize(ROW_TILE * k, 0.0);
    }
    let mut r0 = rows.start;
    while r0 < rows.end {
        let nr = (rows.end - r0).min(ROW_TILE);
        // Row pointers of this tile; missing rows repeat the last one and their results are dropped.
        let mut wp = [std::ptr::null::<f32>(); ROW_TILE];
        match f32_rows {
            Some(all) => {
                for (i, p) in wp.iter_mut().enumerate() {
                    *p = all[(r0 + i.min(nr - 1)) * k..].as_ptr();
                }
            }
            None => {
                for i in 0..nr {
                    dequant_row(isa, w.dtype, w.row(r0 + i), &mut panel[i * k..(i + 1) * k]);
                }
                for (i, p) in wp.iter_mut().enumerate() {
                    *p = panel[i.min(nr - 1) * k..].as_ptr();
                }
            }
        }
        let mut t0 = 0;
        while t0 < n {
            let nt = (n - t0).min(TOK_TILE);
            let mut xp = [std::ptr::null::<f32>(); TOK_TILE];
            for (i, p) in xp.iter_mut().enumerate() {
                *p = x[(t0 + i.min(nt - 1)) * k..].as_ptr();
            }
            let mut acc = [[0f32; ROW_TILE]; TOK_TILE];
            // SAFETY: every pointer in `xp` and `wp` addresses `k` readable f32s (rows of `x`,
            // of the F32 weight data, or of the panel, all checked above), and the ISA was detected.
            unsafe { tile(isa, nt, &xp, &wp, k, &mut acc) };
            for (ti, accs) in acc.iter().enumerate().take(nt) {
                for (ri, &v) in accs.iter().enumerate().take(nr) {
                    // SAFETY: t0 + ti < n and r0 + ri < rows.end <= w.rows, so the index is inside
                    // `y` (n × rows), and this task alone owns row r0 + ri (see `SharedOut`).
                    unsafe { *out.0.add((t0 + ti) * w.rows + r0 + ri) = v };
                }
            }
            t0 += nt;
        }
        r0 += nr;
    }
}

/// Dequantizes one row with the fastest exact kernel for `isa`.
fn dequant_row(isa: Isa, dtype: GgmlType, row: &[u8], out: &mut [f32]) {
    match isa {
        Isa::Portable => quant::dequantize_unchecked(dtype, row, out),
        // SAFETY: the ISA was detected on this CPU; `row` holds `out.len()` elements of `dtype`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::dequant_row_avx2(dtype, row, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::dequant_row_avx512(dtype, row, out) },
    }
}

/// One `nt × ROW_TILE` tile of dot products of length `k`.
///
/// # Safety
/// `xp` and `wp` must each point at `k` readable f32s (entries past `nt` repeat a valid
/// pointer); `isa` must be supported by the CPU.
unsafe fn tile(
    isa: Isa,
    nt: usize,
    xp: &[*const f32; TOK_TILE],
    wp: &[*const f32; ROW_TILE],
    k: usize,
    acc: &mut [[f32; ROW_TILE]; TOK_TILE],
) {
    macro_rules! dispatch {
        ($($f:ident)::+) => {
            match nt {
                1 => $($f)::+::<1>(xp, wp, k, acc),
                2 => $($f)::+::<2>(xp, wp, k, acc),
                3 => $($f)::+::<3>(xp, wp, k, acc),
                _ => $($f)::+::<4>(xp, wp, k, acc),
            }
        };
    }
    match isa {
        Isa::Portable => dispatch!(portable::tile),
        // The SIMD tiles always compute all TOK_TILE tokens (missing ones repeat the last
        // token's pointer and are dropped by the caller): one straight-line kernel each.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86::tile_avx2(xp, wp, k, acc),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => x86::tile_avx512(xp, wp, k, acc),
    }
}

/// Portable kernels: plain Rust the compiler can vectorize for the baseline target.
mod portable {
    use super::*;

    /// Independent partial sums, so the compiler may vectorize and the dependency chain is short.
    const LANES: usize = 8;

    pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0f32; LANES];
        let mut ca = a.chunks_exact(LANES);
        let mut cb = b.chunks_exact(LANES);
        for (x, y) in (&mut ca).zip(&mut cb) {
            for l in 0..LANES {
                acc[l] += x[l] * y[l];
            }
        }
        let mut s: f32 = acc.iter().sum();
        for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
            s += x * y;
        }
        s
    }

    pub(super) fn dot_row(dtype: GgmlType, row: &[u8], x: &[f32]) -> f32 {
        if dtype == GgmlType::F32 {
            if let Ok(w) = bytemuck::try_cast_slice::<u8, f32>(row) {
                return dot(w, x);
            }
        }
        // Dequantize a block at a time into a stack buffer (256 = the largest block length).
        let bl = dtype.block_len().max(64);
        let per = bl / dtype.block_len();
        let bb = dtype.block_bytes() * per;
        let mut buf = [0f32; 256];
        let mut s = 0f32;
        for (i, chunk) in row.chunks(bb).enumerate() {
            let len = chunk.len() / dtype.block_bytes() * dtype.block_len();
            let xs = &x[i * bl..i * bl + len];
            quant::dequantize_unchecked(dtype, chunk, &mut buf[..len]);
            s += dot(&buf[..len], xs);
        }
        s
    }

    /// # Safety
    /// As [`super::tile`].
    pub(super) unsafe fn tile<const T: usize>(
        xp: &[*const f32; TOK_TILE],
        wp: &[*const f32; ROW_TILE],
        k: usize,
        acc: &mut [[f32; ROW_TILE]; TOK_TILE],
    ) {
        for t in 0..T {
            // SAFETY: the caller guarantees `k` readable f32s behind each pointer.
            let xs = unsafe { std::slice::from_raw_parts(xp[t], k) };
            for r in 0..ROW_TILE {
                let ws = unsafe { std::slice::from_raw_parts(wp[r], k) };
                acc[t][r] = dot(xs, ws);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    // ---- AVX-512 -------------------------------------------------------------------------------

    /// Both halves of a little-endian f16 pair `[a, b]` as f32 (exact).
    #[inline]
    #[target_feature(enable = "f16c")]
    fn f16x2(p: &[u8]) -> (f32, f32) {
        let bits = u32::from_le_bytes([p[0], p[1], p[2], p[3]]);
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
    }

    #[inline]
    #[target_feature(enable = "f16c")]
    fn f16x1(p: &[u8]) -> f32 {
        let bits = u16::from_le_bytes([p[0], p[1]]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// The 32 weights of a Q4_0/Q4_1/Q8_0 block as two vectors of 16 (elements 0..16, 16..32),
    /// rebuilt with the reference operation order.
    const Q4_0: u8 = GgmlType::Q4_0 as u8;
    const Q4_1: u8 = GgmlType::Q4_1 as u8;
    const Q8_0: u8 = GgmlType::Q8_0 as u8;

    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,f16c")]
    fn block32_avx512<const Q: u8>(b: &[u8]) -> (__m512, __m512) {
        match Q {
            Q4_1 => {
                let (d, m) = f16x2(&b[0..4]);
                let (d, m) = (_mm512_set1_ps(d), _mm512_set1_ps(m));
                // SAFETY: b[4..20] is in bounds (checked by the slice) and loadu is unaligned.
                let qs = unsafe { _mm_loadu_si128(b[4..20].as_ptr() as *const __m128i) };
                let q = _mm512_cvtepu8_epi32(qs);
                let lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0x0F)));
                let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(q));
                (_mm512_add_ps(_mm512_mul_ps(d, lo), m), _mm512_add_ps(_mm512_mul_ps(d, hi), m))
            }
            Q4_0 => {
                let d = _mm512_set1_ps(f16x1(&b[0..2]));
                // SAFETY: b[2..18] is in bounds.
                let qs = unsafe { _mm_loadu_si128(b[2..18].as_ptr() as *const __m128i) };
                let q = _mm512_cvtepu8_epi32(qs);
                let eight = _mm512_set1_epi32(8);
                let lo = _mm512_sub_epi32(_mm512_and_si512(q, _mm512_set1_epi32(0x0F)), eight);
                let hi = _mm512_sub_epi32(_mm512_srli_epi32::<4>(q), eight);
                (_mm512_mul_ps(_mm512_cvtepi32_ps(lo), d), _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d))
            }
            _ => {
                // Q8_0
                let d = _mm512_set1_ps(f16x1(&b[0..2]));
                let q = &b[2..34];
                // SAFETY: q[0..16] and q[16..32] are in bounds.
                let (q0, q1) = unsafe {
                    (
                        _mm_loadu_si128(q[0..16].as_ptr() as *const __m128i),
                        _mm_loadu_si128(q[16..32].as_ptr() as *const __m128i),
                    )
                };
                (
                    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d),
                    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d),
                )
            }
        }
    }

    /// 16 f16/bf16 values at `p` widened to f32.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,f16c")]
    unsafe fn half16_avx512(dtype: GgmlType, p: *const u8) -> __m512 {
        let v = _mm256_loadu_si256(p as *const __m256i);
        if dtype == GgmlType::F16 {
            _mm512_cvtph_ps(v)
        } else {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(v)))
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512vl")]
    fn dot_f32_avx512(a: &[f32], b: &[f32]) -> f32 {
        let k = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: every load reads inside a[..k] and b[..k]; the tail uses a masked load.
        unsafe {
            while i + 64 <= k {
                for (j, s) in acc.iter_mut().enumerate() {
                    let o = i + 16 * j;
                    *s = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(o)), _mm512_loadu_ps(pb.add(o)), *s);
                }
                i += 64;
            }
            while i + 16 <= k {
                acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc[0]);
                i += 16;
            }
            if i < k {
                let m: __mmask16 = (1u16 << (k - i)) - 1;
                acc[1] = _mm512_fmadd_ps(
                    _mm512_maskz_loadu_ps(m, pa.add(i)),
                    _mm512_maskz_loadu_ps(m, pb.add(i)),
                    acc[1],
                );
            }
        }
        let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        _mm512_reduce_add_ps(s)
    }

    /// Dot of one row of 32-element blocks (type `Q`) with `x`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,fma,f16c")]
    fn dot_q32_avx512<const Q: u8>(row: &[u8], x: &[f32]) -> f32 {
        let bb = GgmlType::from_ggml_id(Q as u32).map_or(1, |t| t.block_bytes());
        let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        for (b, xs) in row.chunks_exact(bb).zip(x.chunks_exact(32)) {
            let (w0, w1) = block32_avx512::<Q>(b);
            // SAFETY: xs has 32 elements.
            let (x0, x1) = unsafe { (_mm512_loadu_ps(xs.as_ptr()), _mm512_loadu_ps(xs.as_ptr().add(16))) };
            a0 = _mm512_fmadd_ps(w0, x0, a0);
            a1 = _mm512_fmadd_ps(w1, x1, a1);
        }
        _mm512_reduce_add_ps(_mm512_add_ps(a0, a1))
    }

    /// Dot of one Q4_0 / Q4_1 row with `x`, through a per-block table: a 4-bit quant has only 16
    /// possible weights, so the block's 16 weights are computed once (`d * q + m` or `(q - 8) * d`,
    /// the reference operations) and the 32 elements are picked with a lane permute, which
    /// ignores the high bits of its index. This takes fewer 512-bit operations per block than
    /// converting each element (those share two ports and bound this loop).
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,fma,f16c")]
    fn dot_q4_avx512<const Q: u8>(row: &[u8], x: &[f32]) -> f32 {
        let bb = if Q == Q4_1 { 20 } else { 18 };
        let iota = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
        let iota_m8 = _mm512_sub_ps(iota, _mm512_set1_ps(8.0));
        let (mut a0, mut a1, mut a2, mut a3) =
            (_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps());
        let step = |b: &[u8], xb: &[f32], a: &mut __m512, c: &mut __m512| {
            let lut = if Q == Q4_1 {
                let (d, m) = f16x2(&b[0..4]);
                _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(d), iota), _mm512_set1_ps(m))
            } else {
                _mm512_mul_ps(iota_m8, _mm512_set1_ps(f16x1(&b[0..2])))
            };
            let qs = &b[bb - 16..bb];
            // SAFETY: qs has 16 bytes and xb 32 f32s (both slices are bounds-checked).
            let (q, x0, x1) = unsafe {
                (
                    _mm512_cvtepu8_epi32(_mm_loadu_si128(qs.as_ptr() as *const __m128i)),
                    _mm512_loadu_ps(xb.as_ptr()),
                    _mm512_loadu_ps(xb[16..32].as_ptr()),
                )
            };
            *a = _mm512_fmadd_ps(_mm512_permutexvar_ps(q, lut), x0, *a);
            *c = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), lut), x1, *c);
        };
        let mut pairs = row.chunks_exact(2 * bb).zip(x.chunks_exact(64));
        for (b, xb) in &mut pairs {
            step(&b[..bb], &xb[..32], &mut a0, &mut a1);
            step(&b[bb..], &xb[32..], &mut a2, &mut a3);
        }
        let nb = row.len() / bb;
        if nb % 2 == 1 {
            step(&row[(nb - 1) * bb..nb * bb], &x[(nb - 1) * 32..nb * 32], &mut a0, &mut a1);
        }
        _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,fma,f16c")]
    fn dot_row_avx512(dtype: GgmlType, row: &[u8], x: &[f32]) -> f32 {
        match dtype {
            GgmlType::F32 => match bytemuck::try_cast_slice::<u8, f32>(row) {
                Ok(w) => dot_f32_avx512(w, x),
                Err(_) => portable::dot_row(dtype, row, x),
            },
            GgmlType::Q4_0 => dot_q4_avx512::<Q4_0>(row, x),
            GgmlType::Q4_1 => dot_q4_avx512::<Q4_1>(row, x),
            GgmlType::Q8_0 => dot_q32_avx512::<Q8_0>(row, x),
            GgmlType::F16 | GgmlType::BF16 => {
                let k = x.len().min(row.len() / 2);
                let mut acc = [_mm512_setzero_ps(); 2];
                let mut i = 0;
                // SAFETY: each 16-element load reads row[2i..2i+32] and x[i..i+16], inside k.
                unsafe {
                    while i + 16 <= k {
                        let w = half16_avx512(dtype, row.as_ptr().add(2 * i));
                        let s = &mut acc[(i / 16) & 1];
                        *s = _mm512_fmadd_ps(w, _mm512_loadu_ps(x.as_ptr().add(i)), *s);
                        i += 16;
                    }
                }
                let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
                if i < k {
                    s += portable::dot_row(dtype, &row[2 * i..2 * k], &x[i..k]);
                }
                s
            }
            // No dedicated kernel: each block is dequantized exactly into a stack buffer, then
            // multiplied in. Block lengths (32 or 256) are multiples of the vector width.
            GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K => {
                let bl = dtype.block_len();
                let mut buf = [0f32; 256];
                let buf = &mut buf[..bl];
                let mut acc = _mm512_setzero_ps();
                for (b, xs) in row.chunks_exact(dtype.block_bytes()).zip(x.chunks_exact(bl)) {
                    quant::dequantize_block(dtype, b, buf);
                    for j in (0..bl).step_by(16) {
                        // SAFETY: j + 16 <= bl for both buffers.
                        unsafe {
                            acc = _mm512_fmadd_ps(
                                _mm512_loadu_ps(buf.as_ptr().add(j)),
                                _mm512_loadu_ps(xs.as_ptr().add(j)),
                                acc,
                            );
                        }
                    }
                }
                _mm512_reduce_add_ps(acc)
            }
        }
    }

    /// [`dot_q32_avx512`] for `T` tokens at once: each block is rebuilt once, and each token's
    /// accumulators see exactly the single-token kernel's operations.
    ///
    /// # Safety
    /// Every `xs[t]` holds `32 × (row.len() / block bytes)` f32s; AVX-512F/VL, FMA, F16C.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,fma,f16c")]
    unsafe fn dot_q32_multi_avx512<const Q: u8, const T: usize>(row: &[u8], xs: &[&[f32]], out: &mut [f32]) {
        let bb = GgmlType::from_ggml_id(Q as u32).map_or(1, |t| t.block_bytes());
        let xp: [*const f32; T] = std::array::from_fn(|t| xs[t].as_ptr());
        let mut a0 = [_mm512_setzero_ps(); T];
        let mut a1 = [_mm512_setzero_ps(); T];
        for (i, b) in row.chunks_exact(bb).enumerate() {
            let (w0, w1) = block32_avx512::<Q>(b);
            for t in 0..T {
                // SAFETY: block i of every token's activations is in bounds (see above).
                let (x0, x1) =
                    unsafe { (_mm512_loadu_ps(xp[t].add(i * 32)), _mm512_loadu_ps(xp[t].add(i * 32 + 16))) };
                a0[t] = _mm512_fmadd_ps(w0, x0, a0[t]);
                a1[t] = _mm512_fmadd_ps(w1, x1, a1[t]);
            }
        }
        for t in 0..T {
            out[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
        }
    }

    /// [`dot_q4_avx512`] for `T` tokens at once: each block's table and weights are built once,
    /// and each token's four accumulators see exactly the single-token kernel's operations (blocks
    /// in pairs, the first of a pair into accumulators 0 and 1, the second into 2 and 3, a last
    /// unpaired block into 0 and 1).
    ///
    /// # Safety
    /// Every `xs[t]` holds `32 × (row.len() / block bytes)` f32s; AVX-512F/VL, FMA, F16C.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,fma,f16c")]
    unsafe fn dot_q4_multi_avx512<const Q: u8, const T: usize>(row: &[u8], xs: &[&[f32]], out: &mut [f32]) {
        let bb = if Q == Q4_1 { 20 } else { 18 };
        let iota = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
        let iota_m8 = _mm512_sub_ps(iota, _mm512_set1_ps(8.0));
        let xp: [*const f32; T] = std::array::from_fn(|t| xs[t].as_ptr());
        let weights = |b: &[u8]| {
            let lut = if Q == Q4_1 {
                let (d, m) = f16x2(&b[0..4]);
                _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(d), iota), _mm512_set1_ps(m))
            } else {
                _mm512_mul_ps(iota_m8, _mm512_set1_ps(f16x1(&b[0..2])))
            };
            let qs = &b[bb - 16..bb];
            // SAFETY: qs has 16 bytes.
            let q = unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(qs.as_ptr() as *const __m128i)) };
            (_mm512_permutexvar_ps(q, lut), _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), lut))
        };
        let mut a0 = [_mm512_setzero_ps(); T];
        let mut a1 = [_mm512_setzero_ps(); T];
        let mut a2 = [_mm512_setzero_ps(); T];
        let mut a3 = [_mm512_setzero_ps(); T];
        let nb = row.len() / bb;
        let mut i = 0;
        while i + 2 <= nb {
            let (w0, w1) = weights(&row[i * bb..(i + 1) * bb]);
            let (w2, w3) = weights(&row[(i + 1) * bb..(i + 2) * bb]);
            for t in 0..T {
                // SAFETY: blocks i and i + 1 of every token's activations are in bounds.
                unsafe {
                    let x = xp[t].add(i * 32);
                    a0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), a0[t]);
                    a1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x.add(16)), a1[t]);
                    a2[t] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(x.add(32)), a2[t]);
                    a3[t] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(x.add(48)), a3[t]);
                }
            }
            i += 2;
        }
        if i < nb {
            let (w0, w1) = weights(&row[i * bb..(i + 1) * bb]);
            for t in 0..T {
                // SAFETY: block i of every token's activations is in bounds.
                unsafe {
                    let x = xp[t].add(i * 32);
                    a0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), a0[t]);
                    a1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x.add(16)), a1[t]);
                }
            }
        }
        for t in 0..T {
            out[t] =
                _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0[t], a1[t]), _mm512_add_ps(a2[t], a3[t])));
        }
    }

    /// `out[t] = dot_row_avx512(dtype, row, xs[t])`, bit for bit, with the block-quantized types
    /// rebuilding each block once per group of tokens.
    ///
    /// # Safety
    /// The CPU must support AVX-512F/VL, FMA and F16C.
    #[target_feature(enable = "avx512f,avx512vl,fma,f16c")]
    pub(super) unsafe fn multi_dot_row_avx512(dtype: GgmlType, row: &[u8], xs: &[&[f32]], out: &mut [f32]) {
        // Tokens per group: as many as the accumulators let stay in registers (four per token for
        // Q4, two for Q8), split evenly so no group is left with one token.
        macro_rules! grouped {
            ($f:ident, $q:expr, $most:expr) => {{
                let groups = xs.len().div_ceil($most);
                let size = xs.len().div_ceil(groups);
                for (xg, og) in xs.chunks(size).zip(out.chunks_mut(size)) {
                    // SAFETY: the caller passes activations of `cols` elements, a whole number of
                    // blocks of `row`; the features are enabled on this function.
                    unsafe {
                        match xg.len() {
                            1 => $f::<$q, 1>(row, xg, og),
                            2 => $f::<$q, 2>(row, xg, og),
                            3 => $f::<$q, 3>(row, xg, og),
                            4 => $f::<$q, 4>(row, xg, og),
                            5 => $f::<$q, 5>(row, xg, og),
                            6 => $f::<$q, 6>(row, xg, og),
                            7 => $f::<$q, 7>(row, xg, og),
                            _ => $f::<$q, 8>(row, xg, og),
                        }
                    }
                }
            }};
        }
        match dtype {
            GgmlType::Q4_0 => grouped!(dot_q4_multi_avx512, Q4_0, 5),
            GgmlType::Q4_1 => grouped!(dot_q4_multi_avx512, Q4_1, 5),
            GgmlType::Q8_0 => grouped!(dot_q32_multi_avx512, Q8_0, SMALL_N),
            _ => {
                for (o, x) in out.iter_mut().zip(xs) {
                    *o = dot_row_avx512(dtype, row, x);
                }
            }
        }
    }

    /// # Safety
    /// The CPU must support AVX-512F/VL, FMA and F16C.
    #[target_feature(enable = "avx512f,avx512vl,fma,f16c")]
    pub(super) unsafe fn gemv_rows_avx512(
        dtype: GgmlType,
        bytes: &[u8],
        rb: usize,
        x: &[f32],
        ys: &mut [f32],
    ) {
        for (yv, row) in ys.iter_mut().zip(bytes.chunks_exact(rb)) {
            *yv = dot_row_avx512(dtype, row, x);
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,f16c")]
    fn dequant_q32_avx512<const Q: u8>(row: &[u8], out: &mut [f32]) {
        let bb = GgmlType::from_ggml_id(Q as u32).map_or(1, |t| t.block_bytes());
        for (b, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(32)) {
            let (w0, w1) = block32_avx512::<Q>(b);
            // SAFETY: o has 32 elements.
            unsafe {
                _mm512_storeu_ps(o.as_mut_ptr(), w0);
                _mm512_storeu_ps(o.as_mut_ptr().add(16), w1);
            }
        }
    }

    /// # Safety
    /// The CPU must support AVX-512F/VL and F16C.
    #[target_feature(enable = "avx512f,avx512vl,f16c")]
    pub(super) unsafe fn dequant_row_avx512(dtype: GgmlType, row: &[u8], out: &mut [f32]) {
        match dtype {
            GgmlType::Q4_0 => dequant_q32_avx512::<Q4_0>(row, out),
            GgmlType::Q4_1 => dequant_q32_avx512::<Q4_1>(row, out),
            GgmlType::Q8_0 => dequant_q32_avx512::<Q8_0>(row, out),
            GgmlType::F16 | GgmlType::BF16 => {
                let k = out.len().min(row.len() / 2);
                let mut i = 0;
                while i + 16 <= k {
                    // SAFETY: reads row[2i..2i+32], writes out[i..i+16], both inside k.
                    unsafe {
                        _mm512_storeu_ps(
                            out.as_mut_ptr().add(i),
                            half16_avx512(dtype, row.as_ptr().add(2 * i)),
                        )
                    };
                    i += 16;
                }
                quant::dequantize_unchecked(dtype, &row[2 * i..2 * k], &mut out[i..k]);
            }
            _ => quant::dequantize_unchecked(dtype, row, out),
        }
    }

    /// # Safety
    /// As [`super::tile`] with all `TOK_TILE` token pointers valid, AVX-512F and FMA available.
    #[target_feature(enable = "avx512f,avx512vl,fma")]
    pub(super) unsafe fn tile_avx512(
        xp: &[*const f32; TOK_TILE],
        wp: &[*const f32; ROW_TILE],
        k: usize,
        out: &mut [[f32; ROW_TILE]; TOK_TILE],
    ) {
        // 24 named accumulators (4 tokens × 6 rows) + 4 activations + 1 weight = 29 of the 32
        // zmm registers; named variables rather than arrays so nothing is spilled to the stack.
        let z = _mm512_setzero_ps();
        let (mut c00, mut c01, mut c02, mut c03, mut c04, mut c05) = (z, z, z, z, z, z);
        let (mut c10, mut c11, mut c12, mut c13, mut c14, mut c15) = (z, z, z, z, z, z);
        let (mut c20, mut c21, mut c22, mut c23, mut c24, mut c25) = (z, z, z, z, z, z);
        let (mut c30, mut c31, mut c32, mut c33, mut c34, mut c35) = (z, z, z, z, z, z);
        macro_rules! step {
            ($ld:expr) => {{
                let ld = $ld;
                let (x0, x1, x2, x3) = (ld(xp[0]), ld(xp[1]), ld(xp[2]), ld(xp[3]));
                macro_rules! row {
                    ($r:expr, $a:ident, $b:ident, $c:ident, $d:ident) => {
                        let w = ld(wp[$r]);
                        $a = _mm512_fmadd_ps(x0, w, $a);
                        $b = _mm512_fmadd_ps(x1, w, $b);
                        $c = _mm512_fmadd_ps(x2, w, $c);
                        $d = _mm512_fmadd_ps(x3, w, $d);
                    };
                }
                row!(0, c00, c10, c20, c30);
                row!(1, c01, c11, c21, c31);
                row!(2, c02, c12, c22, c32);
                row!(3, c03, c13, c23, c33);
                row!(4, c04, c14, c24, c34);
                row!(5, c05, c15, c25, c35);
            }};
        }
        let mut i = 0;
        while i + 16 <= k {
            // SAFETY: i + 16 <= k elements behind each pointer (caller's contract).
            step!(|p: *const f32| unsafe { _mm512_loadu_ps(p.add(i)) });
            i += 16;
        }
        if i < k {
            // A masked load reads only the k - i valid elements and zero-fills the rest, which
            // adds nothing to the sums.
            let m: __mmask16 = (1u16 << (k - i)) - 1;
            // SAFETY: the mask limits every load to the first k elements behind each pointer.
            step!(|p: *const f32| unsafe { _mm512_maskz_loadu_ps(m, p.add(i)) });
        }
        let acc = [
            [c00, c01, c02, c03, c04, c05],
            [c10, c11, c12, c13, c14, c15],
            [c20, c21, c22, c23, c24, c25],
            [c30, c31, c32, c33, c34, c35],
        ];
        for (o, a) in out.iter_mut().zip(&acc) {
            for (v, c) in o.iter_mut().zip(a) {
                *v = _mm512_reduce_add_ps(*c);
            }
        }
    }

    // ---- AVX2 ----------------------------------------------------------------------------------

    #[inline]
    #[target_feature(enable = "avx2")]
    fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// The 32 weights of a Q4_0/Q4_1/Q8_0 block as four vectors of 8, reference operation order.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn block32_avx2(dtype: GgmlType, b: &[u8]) -> [__m256; 4] {
        let widen = |v: __m128i| -> [__m256i; 2] {
            [_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(v))]
        };
        match dtype {
            GgmlType::Q4_0 | GgmlType::Q4_1 => {
                let off = if dtype == GgmlType::Q4_1 { 4 } else { 2 };
                // SAFETY: the 16 quant bytes are in bounds.
                let qs = unsafe { _mm_loadu_si128(b[off..off + 16].as_ptr() as *const __m128i) };
                let mask = _mm_set1_epi8(0x0F);
                let lo = widen(_mm_and_si128(qs, mask));
                let hi = widen(_mm_and_si128(_mm_srli_epi16::<4>(qs), mask));
                let q = [lo[0], lo[1], hi[0], hi[1]];
                if dtype == GgmlType::Q4_1 {
                    let (d, m) = f16x2(&b[0..4]);
                    let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
                    q.map(|v| _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(v)), m))
                } else {
                    let d = _mm256_set1_ps(f16x1(&b[0..2]));
                    let eight = _mm256_set1_epi32(8);
                    q.map(|v| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v, eight)), d))
                }
            }
            _ => {
                let d = _mm256_set1_ps(f16x1(&b[0..2]));
                let q = &b[2..34];
                let mut out = [_mm256_setzero_ps(); 4];
                for (j, o) in out.iter_mut().enumerate() {
                    // SAFETY: q[8j..8j+8] is in bounds (8-byte load).
                    let v = unsafe { _mm_loadl_epi64(q[8 * j..8 * j + 8].as_ptr() as *const __m128i) };
                    *o = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d);
                }
                out
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn half8_avx2(dtype: GgmlType, p: *const u8) -> __m256 {
        let v = _mm_loadu_si128(p as *const __m128i);
        if dtype == GgmlType::F16 {
            _mm256_cvtph_ps(v)
        } else {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v)))
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn dot_f32_avx2(a: &[f32], b: &[f32]) -> f32 {
        let k = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: all loads are inside a[..k] and b[..k].
        unsafe {
            while i + 32 <= k {
                for (j, s) in acc.iter_mut().enumerate() {
                    let o = i + 8 * j;
                    *s = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(o)), _mm256_loadu_ps(pb.add(o)), *s);
                }
                i += 32;
            }
            while i + 8 <= k {
                acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc[0]);
                i += 8;
            }
        }
        let mut s = hsum256(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
        for j in i..k {
            s += a[j] * b[j];
        }
        s
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_row_avx2(dtype: GgmlType, row: &[u8], x: &[f32]) -> f32 {
        match dtype {
            GgmlType::F32 => match bytemuck::try_cast_slice::<u8, f32>(row) {
                Ok(w) => dot_f32_avx2(w, x),
                Err(_) => portable::dot_row(dtype, row, x),
            },
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => {
                let mut acc = [_mm256_setzero_ps(); 4];
                for (b, xs) in row.chunks_exact(dtype.block_bytes()).zip(x.chunks_exact(32)) {
                    let w = block32_avx2(dtype, b);
                    for j in 0..4 {
                        // SAFETY: xs has 32 elements.
                        let xv = unsafe { _mm256_loadu_ps(xs.as_ptr().add(8 * j)) };
                        acc[j] = _mm256_fmadd_ps(w[j], xv, acc[j]);
                    }
                }
                hsum256(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])))
            }
            GgmlType::F16 | GgmlType::BF16 => {
                let k = x.len().min(row.len() / 2);
                let mut acc = _mm256_setzero_ps();
                let mut i = 0;
                while i + 8 <= k {
                    // SAFETY: reads row[2i..2i+16] and x[i..i+8], inside k.
                    unsafe {
                        let w = half8_avx2(dtype, row.as_ptr().add(2 * i));
                        acc = _mm256_fmadd_ps(w, _mm256_loadu_ps(x.as_ptr().add(i)), acc);
                    }
                    i += 8;
                }
                let mut s = hsum256(acc);
                if i < k {
                    s += portable::dot_row(dtype, &row[2 * i..2 * k], &x[i..k]);
                }
                s
            }
            // No dedicated kernel: each block is dequantized exactly into a stack buffer, then
            // multiplied in.
            GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K => {
                let bl = dtype.block_len();
                let mut buf = [0f32; 256];
                let buf = &mut buf[..bl];
                let mut s = 0f32;
                for (b, xs) in row.chunks_exact(dtype.block_bytes()).zip(x.chunks_exact(bl)) {
                    quant::dequantize_block(dtype, b, buf);
                    s += dot_f32_avx2(buf, xs);
                }
                s
            }
        }
    }

    /// `out[t] = dot_row_avx2(dtype, row, xs[t])`: the single-token kernel once per token while
    /// the row is in L1 (bit for bit what `n == 1` computes).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn multi_dot_row_avx2(dtype: GgmlType, row: &[u8], xs: &[&[f32]], out: &mut [f32]) {
        for (o, x) in out.iter_mut().zip(xs) {
            *o = dot_row_avx2(dtype, row, x);
        }
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemv_rows_avx2(dtype: GgmlType, bytes: &[u8], rb: usize, x: &[f32], ys: &mut [f32]) {
        for (yv, row) in ys.iter_mut().zip(bytes.chunks_exact(rb)) {
            *yv = dot_row_avx2(dtype, row, x);
        }
    }

    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn dequant_row_avx2(dtype: GgmlType, row: &[u8], out: &mut [f32]) {
        match dtype {
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => {
                for (b, o) in row.chunks_exact(dtype.block_bytes()).zip(out.chunks_exact_mut(32)) {
                    let w = block32_avx2(dtype, b);
                    for (j, v) in w.iter().enumerate() {
                        // SAFETY: o has 32 elements.
                        unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(8 * j), *v) };
                    }
                }
            }
            GgmlType::F16 | GgmlType::BF16 => {
                let k = out.len().min(row.len() / 2);
                let mut i = 0;
                while i + 8 <= k {
                    // SAFETY: reads row[2i..2i+16], writes out[i..i+8], inside k.
                    unsafe {
                        _mm256_storeu_ps(out.as_mut_ptr().add(i), half8_avx2(dtype, row.as_ptr().add(2 * i)))
                    };
                    i += 8;
                }
                quant::dequantize_unchecked(dtype, &row[2 * i..2 * k], &mut out[i..k]);
            }
            _ => quant::dequantize_unchecked(dtype, row, out),
        }
    }

    /// # Safety
    /// As [`super::tile`] with all `TOK_TILE` token pointers valid, AVX2 and FMA available.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile_avx2(
        xp: &[*const f32; TOK_TILE],
        wp: &[*const f32; ROW_TILE],
        k: usize,
        out: &mut [[f32; ROW_TILE]; TOK_TILE],
    ) {
        // 16 ymm registers: two passes of 2 tokens × 6 rows (12 accumulators + 2 activations +
        // 1 weight), named so nothing is spilled.
        for pair in 0..TOK_TILE / 2 {
            let (p0, p1) = (xp[2 * pair], xp[2 * pair + 1]);
            let z = _mm256_setzero_ps();
            let (mut a0, mut a1, mut a2, mut a3, mut a4, mut a5) = (z, z, z, z, z, z);
            let (mut b0, mut b1, mut b2, mut b3, mut b4, mut b5) = (z, z, z, z, z, z);
            let mut i = 0;
            while i + 8 <= k {
                // SAFETY: i + 8 <= k elements behind each pointer (caller's contract).
                let ld = |p: *const f32| unsafe { _mm256_loadu_ps(p.add(i)) };
                let (x0, x1) = (ld(p0), ld(p1));
                macro_rules! row {
                    ($r:expr, $a:ident, $b:ident) => {
                        let w = ld(wp[$r]);
                        $a = _mm256_fmadd_ps(x0, w, $a);
                        $b = _mm256_fmadd_ps(x1, w, $b);
                    };
                }
                row!(0, a0, b0);
                row!(1, a1, b1);
                row!(2, a2, b2);
                row!(3, a3, b3);
                row!(4, a4, b4);
                row!(5, a5, b5);
                i += 8;
            }
            let acc = [[a0, a1, a2, a3, a4, a5], [b0, b1, b2, b3, b4, b5]];
            for (t, a) in acc.iter().enumerate() {
                let xt = xp[2 * pair + t];
                for (r, c) in a.iter().enumerate() {
                    let mut s = hsum256(*c);
                    for j in i..k {
                        // SAFETY: j < k.
                        s += unsafe { *xt.add(j) * *wp[r].add(j) };
                    }
                    out[2 * pair + t][r] = s;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::Bytes;

    fn values(seed: &mut u64, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// A subset of a pass's tokens through [`matmul_in_pass`] gets, bit for bit, the rows a
    /// product over the whole pass gives them, for passes taking either kind of kernel.
    #[test]
    fn a_subset_of_a_pass_gets_the_whole_pass_rows() {
        let (rows, cols, mut seed) = (13usize, 256usize, 7u64);
        let f = values(&mut seed, rows * cols);
        let f16: Vec<u8> = f.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
        let mut q8 = Vec::new();
        for block in f.chunks_exact(32) {
            q8.extend(half::f16::from_f32(0.01).to_le_bytes());
            q8.extend(block.iter().map(|&v| (v * 127.0) as i8 as u8));
        }
        let mats = [
            Matrix { rows, cols, dtype: GgmlType::F32, data: Bytes::from_f32(&f) },
            Matrix { rows, cols, dtype: GgmlType::F16, data: Bytes::copy_from(&f16) },
            Matrix { rows, cols, dtype: GgmlType::Q8_0, data: Bytes::copy_from(&q8) },
        ];
        let mut differs = 0;
        for w in &mats {
            for pass_n in [5usize, 20] {
                let x = values(&mut seed, pass_n * cols);
                let mut whole = vec![0f32; pass_n * rows];
                matmul(w, &x, pass_n, &mut whole);
                let picked = [1usize, 3, 4];
                let sub: Vec<f32> =
                    picked.iter().flat_map(|&t| x[t * cols..(t + 1) * cols].to_vec()).collect();
                let mut got = vec![0f32; picked.len() * rows];
                matmul_in_pass(w, &sub, picked.len(), pass_n, &mut got);
                for (i, &t) in picked.iter().enumerate() {
                    assert_eq!(
                        got[i * rows..(i + 1) * rows],
                        whole[t * rows..(t + 1) * rows],
                        "{:?}, token {t} of a pass of {pass_n}",
                        w.dtype
                    );
                }
                let mut alone = vec![0f32; picked.len() * rows];
                matmul(w, &sub, picked.len(), &mut alone);
                differs += usize::from(alone != got);
            }
        }
        println!("{differs} of 6 subsets differ when multiplied as a pass of their own");
    }
}
