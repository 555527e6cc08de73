//! A resident LoRA adapter on the CPU, and its grouped low-rank products.
//!
//! The deltas are kept in f32 in the exact mode (`--activations f32`) and in int8 with one scale
//! per row of A and of Bᵀ otherwise (a quarter of the bytes a step reads: rank 16 over every
//! projection of SmolLM2-135M is 19.5 MB in f32), and are multiplied by kernels of their own,
//! sized for them: the products are a few percent of a pass's arithmetic, but there are many of
//! them (one per adapter and projection in each layer), too small for the general matrix
//! kernels to pay their set-up. The pass's token rows are grouped by adapter and cut into tasks
//! of at most [`ROWS_PER_TASK`] rows of one adapter; a task reads its adapter's A and Bᵀ for its
//! rows (`x·Aᵀ`, then `(x·Aᵀ)·Bᵀ` as a sum over Bᵀ's rows).
//!
//! Each token's sums run in one fixed order, so its result does not depend on the other tokens
//! of its pass: a dot product of `x·Aᵀ` keeps 16 lane sums over the row's 16-wide chunks (the
//! last one padded with zeros), added up as halves, quarters, eighths and pairs; an output of
//! `(x·Aᵀ)·Bᵀ` adds its rank-many products in rank order (each product rounded, then added: no
//! fused multiply-add). Where the CPU has AVX-512 the kernels take eight rows of A at once
//! against each chunk of `x` (eight independent sums, instead of one dependent chain per dot
//! product) and sixteen outputs at once; they compute exactly what the portable loops do
//! (tested bit for bit).

use std::sync::Arc;

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::lora::{LoraAdapter, LoraTarget};

/// Most rows of one adapter one task computes.
pub(super) const ROWS_PER_TASK: usize = 16;

/// A weight as stored: f32, or int8 (scaled per row by the caller).
trait Weight: Copy + Send + Sync {
    fn get(self) -> f32;
}

impl Weight for f32 {
    #[inline(always)]
    fn get(self) -> f32 {
        self
    }
}

impl Weight for i8 {
    #[inline(always)]
    fn get(self) -> f32 {
        self as f32
    }
}

/// `rows` of `width` values as int8 with one scale per row (absmax / 127, round to nearest).
fn int8_rows(v: &[f32], width: usize) -> (Vec<i8>, Vec<f32>) {
    let mut q = Vec::with_capacity(v.len());
    let mut scales = Vec::with_capacity(v.len() / width.max(1));
    for row in v.chunks_exact(width) {
        let max = row.iter().fold(0f32, |m, x| m.max(x.abs()));
        let s = if max > 0.0 { max / 127.0 } else { 1.0 };
        scales.push(s);
        q.extend(row.iter().map(|x| (x / s).round().clamp(-127.0, 127.0) as i8));
    }
    (q, scales)
}

/// A and Bᵀ as stored, with a scale per row of each (ones but for int8).
enum Store {
    F32 { a: Vec<f32>, bt: Vec<f32> },
    I8 { a: Vec<i8>, bt: Vec<i8> },
}

/// One delta, laid out for the kernels: A (`rank × din`) and Bᵀ (`rank × dout`).
struct Delta {
    rank: usize,
    din: usize,
    dout: usize,
    store: Store,
    /// Per row of A and of Bᵀ (`rank` each).
    a_scale: Vec<f32>,
    bt_scale: Vec<f32>,
    scale: f32,
}

/// An adapter made resident: its deltas as the kernels read them.
pub(super) struct CpuAdapter {
    adapter: Arc<LoraAdapter>,
    /// Indexed like `adapter.weights`.
    deltas: Vec<Delta>,
}

impl CpuAdapter {
    /// `adapter` laid out for the kernels, in int8 with a scale per row when `int8` (else f32).
    pub(super) fn new(adapter: Arc<LoraAdapter>, c: &ModelConfig, int8: bool) -> Result<CpuAdapter> {
        let mut deltas = Vec::with_capacity(adapter.weights.len());
        for w in &adapter.weights {
            let (din, dout) = w.target.proj.dims(c);
            let r = w.rank;
            if w.a.len() != r * din || w.b.len() != dout * r {
                return Err(EngineError::Internal(format!(
                    "adapter {}: {} of layer {} does not fit this model",
                    adapter.name, w.target.proj, w.target.layer
                )));
            }
            let mut bt = vec![0f32; r * dout];
            for o in 0..dout {
                for j in 0..r {
                    bt[j * dout + o] = w.b[o * r + j];
                }
            }
            let (store, a_scale, bt_scale) = if int8 {
                let (a, a_scale) = int8_rows(&w.a, din);
                let (bt, bt_scale) = int8_rows(&bt, dout);
                (Store::I8 { a, bt }, a_scale, bt_scale)
            } else {
                (Store::F32 { a: w.a.clone(), bt }, vec![1.0; r], vec![1.0; r])
            };
            deltas.push(Delta { rank: r, din, dout, store, a_scale, bt_scale, scale: w.scale });
        }
        Ok(CpuAdapter { adapter, deltas })
    }

    fn delta(&self, target: LoraTarget) -> Option<&Delta> {
        let i = self.adapter.weights.binary_search_by_key(&target, |w| w.target).ok()?;
        Some(&self.deltas[i])
    }

    pub(super) fn name(&self) -> &str {
        &self.adapter.name
    }
}

/// Lanes of a dot product's partial sums (one AVX-512 register of f32).
const LANES: usize = 16;

/// The 16 lane sums of a dot product added up in the kernels' order: lane i and i + 8, then
/// i and i + 4, i and i + 2, and the last pair.
#[inline(always)]
fn reduce_lanes(mut w: [f32; LANES]) -> f32 {
    let mut n = LANES;
    while n > 1 {
        n /= 2;
        for i in 0..n {
            w[i] += w[i + n];
        }
    }
    w[0]
}

/// `a · b` in the kernels' order: lane sums over 16-wide chunks, the last padded with zeros,
/// then [`reduce_lanes`].
#[inline(always)]
fn dot<W: Weight>(a: &[f32], b: &[W]) -> f32 {
    let mut acc = [0f32; LANES];
    for (x, y) in a.chunks(LANES).zip(b.chunks(LANES)) {
        for i in 0..LANES {
            let (xv, yv) = if i < x.len() { (x[i], y[i].get()) } else { (0.0, 0.0) };
            acc[i] += xv * yv;
        }
    }
    reduce_lanes(acc)
}

/// One delta over `rows` of `x` into `y` (`rows.len() × dout`, zeroed), the portable loops:
/// `mid = scale · x·Aᵀ`, then `y += mid_j · Bᵀ_j` for each j in order.
fn delta_rows<W: Weight>(d: &Delta, a: &[W], bt: &[W], x: &[f32], rows: &[usize], y: &mut [f32]) {
    let (r, cols, width) = (d.rank, d.din, d.dout);
    let mut mid = vec![0f32; r];
    for (&t, yt) in rows.iter().zip(y.chunks_exact_mut(width)) {
        let xt = &x[t * cols..(t + 1) * cols];
        for ((m, aj), s) in mid.iter_mut().zip(a.chunks_exact(cols)).zip(&d.a_scale) {
            *m = d.scale * s * dot(xt, aj);
        }
        for (j, bj) in bt.chunks_exact(width).enumerate() {
            let m = mid[j] * d.bt_scale[j];
            for (o, b) in yt.iter_mut().zip(bj) {
                *o += m * b.get();
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod wide {
    //! The AVX-512 kernels: the portable loops' operations in the same order, on 16 lanes.

    use std::arch::x86_64::*;

    use super::{Delta, Weight, LANES};

    /// A stored weight type the kernels load 16 at a time, widened to f32.
    pub(super) trait Load16: Weight {
        /// Sixteen weights from `p` as f32.
        ///
        /// # Safety
        /// `p` points to 16 readable weights and the CPU has AVX-512F.
        unsafe fn load16(p: *const Self) -> __m512;
    }

    impl Load16 for f32 {
        #[inline(always)]
        unsafe fn load16(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
    }

    impl Load16 for i8 {
        #[inline(always)]
        unsafe fn load16(p: *const i8) -> __m512 {
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())))
        }
    }

    /// The lane sums of `v` added up as [`super::reduce_lanes`] does.
    #[inline(always)]
    unsafe fn reduce(v: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let v8 = _mm256_add_ps(lo, hi);
        let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps::<1>(v8));
        let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
        _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps::<1>(v2, v2)))
    }

    /// `out[n] = xt · A_{j0+n}` for `N` rows of A (`cols` wide) at once: `N` independent lane
    /// sums over each chunk of `xt`.
    #[inline(always)]
    unsafe fn dots<const N: usize, W: Load16>(a: &[W], cols: usize, j0: usize, xt: &[f32], out: &mut [f32]) {
        debug_assert!(a.len() >= (j0 + N) * cols && xt.len() == cols);
        let mut acc = [_mm512_setzero_ps(); N];
        let full = cols / LANES;
        let (xp, ap) = (xt.as_ptr(), a.as_ptr().add(j0 * cols));
        for c in 0..full {
            let xv = _mm512_loadu_ps(xp.add(c * LANES));
            for (n, s) in acc.iter_mut().enumerate() {
                let av = W::load16(ap.add(n * cols + c * LANES));
                *s = _mm512_add_ps(*s, _mm512_mul_ps(xv, av));
            }
        }
        let rem = cols - full * LANES;
        if rem > 0 {
            // The last chunk, padded with zeros as the portable loop pads it.
            let mut xs = [0f32; LANES];
            xs[..rem].copy_from_slice(&xt[full * LANES..]);
            let xv = _mm512_loadu_ps(xs.as_ptr());
            for (n, s) in acc.iter_mut().enumerate() {
                let row = &a[(j0 + n) * cols + full * LANES..(j0 + n + 1) * cols];
                let mut ws = [0f32; LANES];
                for (w, v) in ws.iter_mut().zip(row) {
                    *w = v.get();
                }
                *s = _mm512_add_ps(*s, _mm512_mul_ps(xv, _mm512_loadu_ps(ws.as_ptr())));
            }
        }
        for (n, s) in acc.iter().enumerate() {
            out[n] = reduce(*s);
        }
    }

    /// [`super::delta_rows`] on AVX-512.
    ///
    /// # Safety
    /// The CPU has AVX-512F, and `a`, `bt`, `x`, `rows` and `y` have the sizes `d` and `rows`
    /// give them (checked by the caller).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn delta_rows<W: Load16>(
        d: &Delta,
        a: &[W],
        bt: &[W],
        x: &[f32],
        rows: &[usize],
        y: &mut [f32],
    ) {
        let (r, cols, width) = (d.rank, d.din, d.dout);
        let mut dotv = vec![0f32; r];
        let mut mid = vec![0f32; r];
        for (&t, yt) in rows.iter().zip(y.chunks_exact_mut(width)) {
            let xt = &x[t * cols..(t + 1) * cols];
            let mut j = 0;
            while j + 8 <= r {
                dots::<8, W>(a, cols, j, xt, &mut dotv[j..]);
                j += 8;
            }
            while j + 4 <= r {
                dots::<4, W>(a, cols, j, xt, &mut dotv[j..]);
                j += 4;
            }
            while j < r {
                dots::<1, W>(a, cols, j, xt, &mut dotv[j..]);
                j += 1;
            }
            for j in 0..r {
                mid[j] = d.scale * d.a_scale[j] * dotv[j] * d.bt_scale[j];
            }
            // Sixteen outputs at a time, each summing its rank-many products in rank order.
            let full = width / LANES;
            let bp = bt.as_ptr();
            for c in 0..full {
                let mut acc = _mm512_setzero_ps();
                for (j, &m) in mid.iter().enumerate() {
                    let b = W::load16(bp.add(j * width + c * LANES));
                    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(m), b));
                }
                _mm512_storeu_ps(yt.as_mut_ptr().add(c * LANES), acc);
            }
            for o in full * LANES..width {
                let mut v = 0f32;
                for (j, &m) in mid.iter().enumerate() {
                    v += m * bt[j * width + o].get();
                }
                yt[o] = v;
            }
        }
    }
}

/// [`delta_rows`] for the stored element type, on AVX-512 where the CPU has it (the same
/// operations in the same order: only the width of the registers differs).
fn run_delta(d: &Delta, x: &[f32], rows: &[usize], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::vmath::x86::available() {
        // SAFETY: the CPU has AVX-512F (checked just above); the sizes are the caller's checks
        // (`task_deltas`) and `CpuAdapter::new`'s.
        unsafe {
            match &d.store {
                Store::F32 { a, bt } => wide::delta_rows(d, a, bt, x, rows, y),
                Store::I8 { a, bt } => wide::delta_rows(d, a, bt, x, rows, y),
            }
        }
        return;
    }
    match &d.store {
        Store::F32 { a, bt } => delta_rows(d, a, bt, x, rows, y),
        Store::I8 { a, bt } => delta_rows(d, a, bt, x, rows, y),
    }
}

/// The deltas of one task: for each of `targets` (with its output width), `None` when the
/// adapter does not target it, else `rows.len() × width` values to add to those rows.
pub(super) fn task_deltas(
    adapter: &CpuAdapter,
    targets: &[(LoraTarget, usize)],
    x: &[f32],
    cols: usize,
    rows: &[usize],
) -> Result<Vec<Option<Vec<f32>>>> {
    let mut out = Vec::with_capacity(targets.len());
    for &(target, width) in targets {
        let Some(d) = adapter.delta(target) else {
            out.push(None);
            continue;
        };
        if d.din != cols || d.dout != width {
            return Err(EngineError::Internal(format!(
                "adapter {}: {} of layer {} is {}→{} but the pass gives {cols}→{width}",
                adapter.name(),
                target.proj,
                target.layer,
                d.din,
                d.dout
            )));
        }
        let mut y = vec![0f32; rows.len() * width];
        run_delta(d, x, rows, &mut y);
        out.push(Some(y));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn delta(rank: usize, din: usize, dout: usize, int8: bool) -> Delta {
        let a = values(rank * din, 1 + rank as u64);
        let bt = values(rank * dout, 2 + din as u64);
        let (store, a_scale, bt_scale) = if int8 {
            let (qa, sa) = int8_rows(&a, din);
            let (qb, sb) = int8_rows(&bt, dout);
            (Store::I8 { a: qa, bt: qb }, sa, sb)
        } else {
            (Store::F32 { a, bt }, vec![1.0; rank], vec![1.0; rank])
        };
        Delta { rank, din, dout, store, a_scale, bt_scale, scale: 0.75 }
    }

    /// The AVX-512 kernels compute bit for bit what the portable loops do, for every rank
    /// (blocks of 8, 4 and single rows of A), widths with and without a partial last chunk, and
    /// both stored types; and a row's result is the same whichever rows share its task.
    #[test]
    fn the_wide_kernels_are_the_portable_loops() {
        #[cfg(target_arch = "x86_64")]
        if crate::vmath::x86::available() {
            for int8 in [false, true] {
                for (rank, din, dout) in
                    [(1, 16, 16), (4, 37, 21), (8, 576, 192), (13, 64, 100), (16, 576, 1536), (20, 5, 33)]
                {
                    let d = delta(rank, din, dout, int8);
                    let x = values(5 * din, 7);
                    let rows = [4, 0, 2];
                    let mut want = vec![0f32; rows.len() * dout];
                    let mut got = vec![0f32; rows.len() * dout];
                    match &d.store {
                        Store::F32 { a, bt } => {
                            delta_rows(&d, a, bt, &x, &rows, &mut want);
                            // SAFETY: AVX-512F checked above; sizes as `d` gives them.
                            unsafe { wide::delta_rows(&d, a, bt, &x, &rows, &mut got) }
                        }
                        Store::I8 { a, bt } => {
                            delta_rows(&d, a, bt, &x, &rows, &mut want);
                            // SAFETY: as above.
                            unsafe { wide::delta_rows(&d, a, bt, &x, &rows, &mut got) }
                        }
                    }
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "rank {rank}, {din}→{dout}, int8 {int8}");
                    assert!(want.iter().any(|&v| v != 0.0));
                    // Row 2 alone gives the bits it got beside rows 4 and 0.
                    let mut alone = vec![0f32; dout];
                    run_delta(&d, &x, &[2], &mut alone);
                    assert_eq!(bits(&alone), bits(&got[2 * dout..]), "rank {rank}, {din}→{dout}");
                }
            }
            return;
        }
        assert!(
            std::env::var_os("TANDEM_REQUIRE_EXTERNAL").is_none(),
            "no AVX-512 on this CPU: the wide kernels were not checked"
        );
        eprintln!("skipped: no AVX-512 on this CPU, the wide LoRA kernels were not checked");
    }

    #[test]
    fn lane_sums_add_up_in_the_stated_order() {
        let w: [f32; LANES] = std::array::from_fn(|i| (i as f32 + 1.0) * 0.1);
        let mut v = w.to_vec();
        for n in [8, 4, 2, 1] {
            for i in 0..n {
                v[i] += v[i + n];
            }
        }
        assert_eq!(reduce_lanes(w).to_bits(), v[0].to_bits());
        // A padded tail adds nothing: dot over 5 values is the plain sum of their products.
        let (a, b) = ([1.0f32, 2.0, 3.0, 4.0, 5.0], [1.0f32, 1.0, 1.0, 1.0, 2.0]);
        assert_eq!(dot(&a, &b), 20.0);
    }
}
