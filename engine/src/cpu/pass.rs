//! One forward pass on the CPU: the pass's bookkeeping (tokens, positions, pool slots, logits
//! rows) and the [`Ops`] a model family's pass is written in, over the backend's scratch buffers.
//!
//! Every operation is row-wise (each token's row computed alone, in the same order whatever the
//! batch) except attention, which reads only the token's own sequence; so a token's result does
//! not depend on the other tokens of its pass.

use rayon::prelude::*;

use super::ops::{attend, gelu_tanh_mul, rms_norm, silu_mul, softcap, ScoreRule};
use super::{add_residual, matmul, matmul_q8, quantize_for, CpuBackend};
use crate::backend::{LogitsRequest, SeqChunk};
use crate::error::{EngineError, Result};
use crate::kv::{BlockId, KvDtype, KvSlice, StagedSegment, WriteMode};
use crate::models::{Activation, AttnSpec, Buf, MatId, Ops, RopeId, VecId};

/// Per-token bookkeeping for one pass.
pub(super) struct TokenInfo {
    chunk: usize,
    pos: usize,
}

/// Everything about a pass's batch the operations need, resolved once.
pub(super) struct PassMeta {
    tokens: Vec<u32>,
    info: Vec<TokenInfo>,
    /// Per chunk: its first token's row, and how many tokens it already has in the cache.
    chunk_base: Vec<usize>,
    chunk_start: Vec<usize>,
    /// Per chunk: the pool slot of every cached position (`< start_pos`).
    past_slots: Vec<Vec<usize>>,
    /// Per token: the pool slot its K/V belong in.
    slots: Vec<usize>,
    /// Token rows that return logits, in the order the pass returns them.
    pub(super) logit_rows: Vec<usize>,
}

impl PassMeta {
    /// The pass's bookkeeping and its write segments (one per chunk).
    pub(super) fn new(batch: &[SeqChunk<'_>], bs: usize) -> (PassMeta, Vec<StagedSegment>) {
        let n: usize = batch.iter().map(|c| c.tokens.len()).sum();
        let mut m = PassMeta {
            tokens: Vec::with_capacity(n),
            info: Vec::with_capacity(n),
            chunk_base: Vec::with_capacity(batch.len()),
            chunk_start: Vec::with_capacity(batch.len()),
            past_slots: Vec::with_capacity(batch.len()),
            slots: Vec::with_capacity(n),
            logit_rows: Vec::new(),
        };
        let mut segments = Vec::with_capacity(batch.len());
        let slot_of = |table: &[BlockId], p: usize| table[p / bs] as usize * bs + p % bs;
        for (ci, ch) in batch.iter().enumerate() {
            let base = m.tokens.len();
            m.chunk_base.push(base);
            m.chunk_start.push(ch.start_pos);
            // Resolved once here rather than per (layer, head, position): a division by the
            // block size per lookup was a large share of decode attention time.
            m.past_slots.push((0..ch.start_pos).map(|p| slot_of(ch.block_table, p)).collect());
            for (j, &t) in ch.tokens.iter().enumerate() {
                let pos = ch.start_pos + j;
                m.tokens.push(t);
                m.info.push(TokenInfo { chunk: ci, pos });
                m.slots.push(slot_of(ch.block_table, pos));
            }
            let (range, chunk_slots) = (base..m.slots.len(), m.slots[base..].to_vec());
            segments.push(match ch.write {
                WriteMode::Staged => StagedSegment::new(range, chunk_slots),
                WriteMode::Direct => StagedSegment::direct(range, chunk_slots),
            });
            match ch.logits {
                LogitsRequest::None => {}
                LogitsRequest::Last => m.logit_rows.push(base + ch.tokens.len() - 1),
                LogitsRequest::All => m.logit_rows.extend(base..base + ch.tokens.len()),
            }
        }
        (m, segments)
    }
}

/// Where one KV head's rows live for one chunk: positions before `start_pos` in the pool (slots
/// resolved through the block table once per pass), later ones in this pass's fresh projections.
#[derive(Clone, Copy)]
struct KvView<'a> {
    new: &'a [f32],
    pooled: KvSlice<'a>,
    start_pos: usize,
    base: usize,
    /// Pool slot of every cached position (`< start_pos`).
    past_slots: &'a [usize],
    stride: usize,
    off: usize,
    hd: usize,
}

impl<'a> KvView<'a> {
    fn row(&self, p: usize) -> KvSlice<'a> {
        if p >= self.start_pos {
            let at = (self.base + p - self.start_pos) * self.stride + self.off;
            KvSlice::F32(&self.new[at..at + self.hd])
        } else {
            self.pooled.sub(self.past_slots[p] * self.stride + self.off, self.hd)
        }
    }
}

/// The CPU backend during one pass.
pub(super) struct CpuPass<'a> {
    pub(super) be: &'a mut CpuBackend,
    pub(super) meta: &'a PassMeta,
}

fn bad_handle(what: &str, i: usize) -> EngineError {
    EngineError::Internal(format!("model pass: {what} {i} is not declared"))
}

impl CpuPass<'_> {
    fn check(&self, b: Buf) -> Result<usize> {
        let i = b.0 as usize;
        (i < self.be.scratch.len()).then_some(i).ok_or_else(|| bad_handle("buffer", i))
    }

    /// Takes a buffer out of the scratch list (put back with [`CpuPass::put`]), so that one
    /// operation can read some buffers while writing another.
    fn take(&mut self, b: Buf) -> Result<Vec<f32>> {
        let i = self.check(b)?;
        Ok(std::mem::take(&mut self.be.scratch[i]))
    }

    fn put(&mut self, b: Buf, v: Vec<f32>) {
        self.be.scratch[b.0 as usize] = v;
    }

    fn buf(&self, b: Buf) -> Result<&[f32]> {
        Ok(&self.be.scratch[self.check(b)?])
    }

    fn vector(&self, w: VecId) -> Result<&[f32]> {
        self.be
            .store
            .vecs
            .get(w.0 as usize)
            .map(Vec::as_slice)
            .ok_or_else(|| bad_handle("vector", w.0 as usize))
    }

    fn width(&self, b: Buf) -> usize {
        self.be.model.scratch()[b.0 as usize].width
    }

    fn distinct(&self, bufs: &[Buf]) -> Result<()> {
        for (i, a) in bufs.iter().enumerate() {
            if bufs[i + 1..].contains(a) {
                return Err(EngineError::Internal(format!(
                    "model pass: buffer {} used twice in one operation",
                    a.0
                )));
            }
        }
        Ok(())
    }
}

impl Ops for CpuPass<'_> {
    fn embed(&mut self, table: MatId, scale: Option<f32>, out: Buf) -> Result<()> {
        let mut o = self.take(out)?;
        let res = match self.be.store.mats.get(table.0 as usize) {
            Some((m, _)) if m.cols == self.width(out) => {
                o.par_chunks_mut(m.cols).zip(&self.meta.tokens).for_each(|(row, &t)| {
                    m.dequantize_row(t as usize, row);
                    if let Some(s) = scale {
                        row.iter_mut().for_each(|v| *v *= s);
                    }
                });
                Ok(())
            }
            Some(_) => Err(EngineError::Internal("model pass: embedding width".into())),
            None => Err(bad_handle("matrix", table.0 as usize)),
        };
        self.put(out, o);
        res
    }

    fn rms_norm(&mut self, x: Buf, w: VecId, eps: f32, out: Buf) -> Result<()> {
        self.distinct(&[x, out])?;
        let mut o = self.take(out)?;
        let (xs, ws) = (self.buf(x)?, self.vector(w)?);
        let h = ws.len();
        o.par_chunks_mut(h).zip(xs.par_chunks(h)).with_min_len(16).for_each(|(o, r)| rms_norm(r, ws, eps, o));
        self.put(out, o);
        Ok(())
    }

    fn head_rms_norm(&mut self, x: Buf, w: VecId, head_dim: usize, eps: f32) -> Result<()> {
        let mut xs = self.take(x)?;
        let ws = self.vector(w)?;
        let res = if ws.len() == head_dim {
            super::ops::rms_norm_inplace(&mut xs, ws, eps);
            Ok(())
        } else {
            Err(EngineError::Internal("model pass: head norm width".into()))
        };
        self.put(x, xs);
        res
    }

    fn linear(&mut self, x: Buf, outs: &[(MatId, Buf)]) -> Result<()> {
        let mut bufs: Vec<Buf> = outs.iter().map(|o| o.1).collect();
        bufs.push(x);
        self.distinct(&bufs)?;
        let cols = self.width(x);
        let mut taken = Vec::with_capacity(outs.len());
        for &(_, y) in outs {
            taken.push(self.take(y)?);
        }
        let be = &mut *self.be;
        let xs = &be.scratch[x.0 as usize];
        let n = xs.len() / cols.max(1);
        let mut res = Ok(());
        let mats: Vec<_> =
            outs.iter().map(|&(w, _)| (w.0 as usize, be.store.mats.get(w.0 as usize))).collect();
        if let Some((i, _)) = mats.iter().find(|(_, m)| m.is_none_or(|(m, _)| m.cols != cols)) {
            res = Err(bad_handle("matrix (or its width)", *i));
        } else {
            let packed: Vec<Option<&super::PackedMatrix>> =
                mats.iter().map(|&(i, _)| be.packed.get(i).and_then(Option::as_ref)).collect();
            quantize_for(&mut be.xq, xs, n, cols, &packed);
            for ((&(_, m), p), y) in mats.iter().zip(&packed).zip(taken.iter_mut()) {
                match p {
                    Some(p) => matmul_q8(p, &be.xq, y),
                    None => matmul(&m.expect("checked above").0, xs, n, y),
                }
            }
        }
        for (&(_, y), v) in outs.iter().zip(taken) {
            self.put(y, v);
        }
        res
    }

    fn add_bias(&mut self, x: Buf, b: VecId) -> Result<()> {
        let mut xs = self.take(x)?;
        let bs = self.vector(b)?;
        xs.chunks_exact_mut(bs.len()).for_each(|row| row.iter_mut().zip(bs).for_each(|(x, b)| *x += b));
        self.put(x, xs);
        Ok(())
    }

    fn rope(&mut self, x: Buf, rope: RopeId) -> Result<()> {
        let width = self.width(x);
        let mut xs = self.take(x)?;
        let res = match self.be.ropes.get(rope.0 as usize) {
            Some(table) => {
                xs.par_chunks_mut(width).zip(&self.meta.info).for_each(|(row, ti)| table.apply(row, ti.pos));
                Ok(())
            }
            None => Err(bad_handle("rope table", rope.0 as usize)),
        };
        self.put(x, xs);
        res
    }

    fn attention(&mut self, q: Buf, k: Buf, v: Buf, out: Buf, spec: &AttnSpec) -> Result<()> {
        self.distinct(&[q, k, v, out])?;
        let c = &self.be.config;
        let (hd, nh, nkv) = (c.head_dim, c.num_heads, c.num_kv_heads);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let l = spec.layer;
        let mut attn = self.take(out)?;
        let (mut kb, mut vb) = (self.take(k)?, self.take(v)?);
        let meta = self.meta;
        let be = &mut *self.be;
        // Fresh K/V exactly as the pool will give them back (see the backend's documentation).
        let kv_dtype = be.pool.layout().dtype;
        if kv_dtype != KvDtype::F32 {
            kb.par_chunks_mut(kvd).chain(vb.par_chunks_mut(kvd)).for_each(|row| kv_dtype.round(row));
        }
        let res = be.write_path.write(&mut be.pool, l, &kb, &vb, &meta.slots);
        if res.is_ok() {
            let qs = &be.scratch[q.0 as usize];
            let (pk, pv) = (be.pool.k(l), be.pool.v(l));
            let (kr, vr) = (kb.as_slice(), vb.as_slice());
            let group = nh / nkv;
            let window = spec.window.unwrap_or(usize::MAX);
            let rule = ScoreRule { scale: spec.scale, softcap: spec.softcap };
            // One task per (token, head). (Grouping the query heads of a KV head into one task
            // reads K/V once, but leaves too few tasks for the threads at decode time.)
            attn.par_chunks_mut(hd).enumerate().for_each_init(Vec::new, |scores, (idx, o)| {
                let (t, head) = (idx / nh, idx % nh);
                let TokenInfo { chunk, pos } = meta.info[t];
                let kvh = head / group;
                let first = (pos + 1).saturating_sub(window);
                let kview = KvView {
                    new: kr,
                    pooled: pk,
                    start_pos: meta.chunk_start[chunk],
                    base: meta.chunk_base[chunk],
                    past_slots: &meta.past_slots[chunk],
                    stride: kvd,
                    off: kvh * hd,
                    hd,
                };
                let vview = KvView { new: vr, pooled: pv, ..kview };
                attend(
                    &qs[t * qd + head * hd..][..hd],
                    pos + 1 - first,
                    move |i| kview.row(first + i),
                    move |i| vview.row(first + i),
                    rule,
                    scores,
                    o,
                );
            });
        }
        self.put(k, kb);
        self.put(v, vb);
        self.put(out, attn);
        Ok(res?)
    }

    fn gated_act(&mut self, gate: Buf, up: Buf, act: Activation, out: Buf) -> Result<()> {
        self.distinct(&[gate, up, out])?;
        let mut o = self.take(out)?;
        let (g, u) = (self.buf(gate)?, self.buf(up)?);
        // Element-wise, spread like `add_residual`.
        const PIECE: usize = 1 << 14;
        o.par_chunks_mut(PIECE).zip(g.par_chunks(PIECE)).zip(u.par_chunks(PIECE)).for_each(|((o, g), u)| {
            match act {
                Activation::Silu => {
                    o.copy_from_slice(g);
                    silu_mul(o, u);
                }
                Activation::GeluTanh => gelu_tanh_mul(g, u, o),
            }
        });
        self.put(out, o);
        Ok(())
    }

    fn add(&mut self, x: Buf, y: Buf) -> Result<()> {
        self.distinct(&[x, y])?;
        let mut xs = self.take(x)?;
        add_residual(&mut xs, self.buf(y)?);
        self.put(x, xs);
        Ok(())
    }

    fn softcap(&mut self, x: Buf, cap: f32) -> Result<()> {
        let mut xs = self.take(x)?;
        xs.par_chunks_mut(1 << 14).for_each(|p| softcap(p, cap));
        self.put(x, xs);
        Ok(())
    }

    fn gather_logit_rows(&mut self, x: Buf, out: Buf) -> Result<()> {
        self.distinct(&[x, out])?;
        let w = self.width(x);
        let mut o = self.take(out)?;
        let xs = self.buf(x)?;
        for (dst, &r) in o.chunks_exact_mut(w).zip(&self.meta.logit_rows) {
            dst.copy_from_slice(&xs[r * w..(r + 1) * w]);
        }
        self.put(out, o);
        Ok(())
    }
}
