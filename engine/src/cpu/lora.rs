//! A resident LoRA adapter on the CPU, and its grouped low-rank products.
//!
//! The deltas stay in f32 (an adapter is small next to the base weights: rank 16 over every
//! projection of SmolLM2-135M is 4.7 MB) and go through the f32 matrix kernels: for the rows of
//! one adapter, `X·Aᵀ` (rank columns) then `(X·Aᵀ)·Bᵀ`, each product reading its matrix once for
//! all of the adapter's rows in the pass. The integer kernels would quantize the rank-wide
//! intermediate as well as the input, for a product that is a few percent of the pass.

use std::sync::Arc;

use super::matmul_in_pass;
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::lora::{LoraAdapter, LoraTarget};
use crate::quant::GgmlType;
use crate::weights::{Bytes, Matrix};

/// An adapter made resident: its deltas as matrices the kernels read.
pub(super) struct CpuAdapter {
    adapter: Arc<LoraAdapter>,
    /// `(A, B, scale)` per delta, indexed like `adapter.weights`.
    mats: Vec<(Matrix, Matrix, f32)>,
}

impl CpuAdapter {
    pub(super) fn new(adapter: Arc<LoraAdapter>, c: &ModelConfig) -> Result<CpuAdapter> {
        let mut mats = Vec::with_capacity(adapter.weights.len());
        for w in &adapter.weights {
            let (din, dout) = w.target.proj.dims(c);
            if w.a.len() != w.rank * din || w.b.len() != dout * w.rank {
                return Err(EngineError::Internal(format!(
                    "adapter {}: {} of layer {} does not fit this model",
                    adapter.name, w.target.proj, w.target.layer
                )));
            }
            let m =
                |rows, cols, v: &[f32]| Matrix { rows, cols, dtype: GgmlType::F32, data: Bytes::from_f32(v) };
            mats.push((m(w.rank, din, &w.a), m(dout, w.rank, &w.b), w.scale));
        }
        Ok(CpuAdapter { adapter, mats })
    }

    /// The delta for `target`: `(A, B, scale)`.
    fn delta(&self, target: LoraTarget) -> Option<&(Matrix, Matrix, f32)> {
        let i = self.adapter.weights.binary_search_by_key(&target, |w| w.target).ok()?;
        Some(&self.mats[i])
    }
}

/// Adds one adapter's delta for one projection to `y` (`width` wide) over the pass rows `rows`
/// of `x` (`cols` wide), in a pass of `pass_n` tokens. `gathered` and `mid` are reused scratch.
#[allow(clippy::too_many_arguments)]
pub(super) fn add_delta(
    adapter: &CpuAdapter,
    target: LoraTarget,
    x: &[f32],
    cols: usize,
    rows: &[usize],
    pass_n: usize,
    y: &mut [f32],
    width: usize,
    scratch: &mut (Vec<f32>, Vec<f32>, Vec<f32>),
) -> Result<()> {
    let Some((a, b, scale)) = adapter.delta(target) else { return Ok(()) };
    if a.cols != cols || b.rows != width {
        return Err(EngineError::Internal(format!(
            "adapter {}: {} of layer {} is {}→{} but the pass gives {cols}→{width}",
            adapter.adapter.name, target.proj, target.layer, a.cols, b.rows
        )));
    }
    let (n, r) = (rows.len(), a.rows);
    let (xg, mid, out) = scratch;
    xg.clear();
    for &t in rows {
        xg.extend_from_slice(&x[t * cols..(t + 1) * cols]);
    }
    mid.clear();
    mid.resize(n * r, 0.0);
    matmul_in_pass(a, xg, n, pass_n, mid);
    out.clear();
    out.resize(n * width, 0.0);
    matmul_in_pass(b, mid, n, pass_n, out);
    for (i, &t) in rows.iter().enumerate() {
        let dst = &mut y[t * width..(t + 1) * width];
        for (d, s) in dst.iter_mut().zip(&out[i * width..(i + 1) * width]) {
            *d += scale * s;
        }
    }
    Ok(())
}
