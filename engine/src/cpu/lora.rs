//! A resident LoRA adapter on the CPU, and its grouped low-rank products.
//!
//! The deltas are kept in f32 in the exact mode (`--activations f32`) and in bf16 otherwise (half
//! the bytes a step reads: rank 16 over every projection of SmolLM2-135M is 19.5 MB in f32; PEFT
//! adapters are mostly trained and stored in bf16 anyway, and the rounding is 2⁻⁹ of a weight of
//! a delta that is itself small beside the projection), and are multiplied by kernels of their
//! own, sized for them (compiled for AVX-512 where the CPU has it): the products are a few percent of a pass's arithmetic, but there are many of them (one
//! per adapter and projection in each layer), too small for the general matrix kernels to pay
//! their set-up. The pass's token rows are grouped by adapter and cut into tasks of at most
//! [`ROWS_PER_TASK`] rows of one adapter; a task reads its adapter's A and B once for all its
//! rows (`x·Aᵀ`, then `(x·Aᵀ)·Bᵀ` as rank-many axpys over Bᵀ's rows). Each token's sums run in
//! one fixed order, so its result does not depend on the other tokens of its pass.

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

/// `a · b` in a fixed order (sixteen running sums, then the tail, then their sum).
#[inline(always)]
fn dot<W: Weight>(a: &[f32], b: &[W]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i].get();
        }
    }
    let mut s = 0f32;
    for (x, y) in ta.iter().zip(tb) {
        s += x * y.get();
    }
    acc.iter().sum::<f32>() + s
}

/// One delta over `rows` of `x` into `y` (`rows.len() × dout`, zeroed): `mid = scale · x·Aᵀ`,
/// then `y += mid_j · Bᵀ_j` for each j in order.
#[inline(always)]
fn delta_rows<W: Weight>(d: &Delta, a: &[W], bt: &[W], x: &[f32], rows: &[usize], y: &mut [f32]) {
    let (r, cols, width) = (d.rank, d.din, d.dout);
    let mut mid = Vec::with_capacity(rows.len() * r);
    for &t in rows {
        let xt = &x[t * cols..(t + 1) * cols];
        mid.extend(a.chunks_exact(cols).zip(&d.a_scale).map(|(aj, s)| d.scale * s * dot(xt, aj)));
    }
    for (i, yt) in y.chunks_exact_mut(width).enumerate() {
        for (j, bj) in bt.chunks_exact(width).enumerate() {
            let m = mid[i * r + j] * d.bt_scale[j];
            for (o, b) in yt.iter_mut().zip(bj) {
                *o += m * b.get();
            }
        }
    }
}

/// [`delta_rows`] for the stored element type, compiled for AVX-512 where the CPU has it (the
/// same operations in the same order: only the width of the registers differs).
fn run_delta(d: &Delta, x: &[f32], rows: &[usize], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        fn wide(d: &Delta, x: &[f32], rows: &[usize], y: &mut [f32]) {
            match &d.store {
                Store::F32 { a, bt } => delta_rows(d, a, bt, x, rows, y),
                Store::I8 { a, bt } => delta_rows(d, a, bt, x, rows, y),
            }
        }
        if crate::vmath::x86::available() {
            // SAFETY: the CPU has AVX-512F (checked just above).
            return unsafe { wide(d, x, rows, y) };
        }
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
