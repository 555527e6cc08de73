//! One forward pass on the CPU: the pass's bookkeeping (tokens, positions, pool slots, logits
//! rows) and the [`Ops`] a model family's pass is written in, over the backend's scratch buffers.
//!
//! Every operation is row-wise (each token's row computed alone, in the same order whatever the
//! batch) except attention, which reads only the token's own sequence, and the mixture of experts,
//! which groups tokens by expert but computes each token's rows with the kernels of the whole
//! pass and adds its experts in a fixed order; so a token's result does not depend on the other
//! tokens of its pass.

use rayon::prelude::*;

use super::attention::{attend_rows, attend_segments, merge_segments, AttendScratch, Partial, SEGMENT};
use super::ops::{gelu_tanh_mul, moe_route, rms_norm, silu_mul, softcap, ScoreRule};
use super::{add_residual, matmul_in_pass, matmul_q8, quantize_for, CpuBackend, PackedMatrix};
use crate::backend::{LogitsRequest, SeqChunk};
use crate::error::{EngineError, Result};
use crate::kv::groups::{dropped, NO_PAGE};
use crate::kv::{BlockId, KvDtype, KvError, KvGroups, KvSlice, StagedSegment, WriteMode};
use crate::models::{Activation, AttnSpec, Buf, MatId, MoeSpec, Ops, RopeId, VecId, WeightStore};
use crate::weights::Matrix;

/// Most consecutive tokens of one chunk whose attention one task computes, with every query head
/// of one KV head: the task's rows read and widen each key and value row once between them.
const ATTEND_TOKENS: usize = 32;

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
    /// Per layer group, per chunk: the pool slot of every cached position (`< start_pos`); where
    /// a window group gave the page back (no query of the pass sees it), a held row in its place.
    past_slots: Vec<Vec<Vec<usize>>>,
    /// Per layer group, per token: the pool slot its K/V belong in.
    slots: Vec<Vec<usize>>,
    /// Token rows that return logits, in the order the pass returns them.
    pub(super) logit_rows: Vec<usize>,
    /// Consecutive token rows of one chunk, at most [`ATTEND_TOKENS`] each, that attend together.
    token_blocks: Vec<(usize, usize)>,
    /// Token rows per resident adapter slot the pass runs ([`crate::backend::rows_by_slot`]).
    adapter_rows: Vec<(u16, Vec<usize>)>,
}

impl PassMeta {
    /// The pass's bookkeeping and its write segments (one per chunk).
    pub(super) fn new(
        batch: &[SeqChunk<'_>],
        bs: usize,
        groups: &KvGroups,
    ) -> (PassMeta, Vec<StagedSegment>) {
        let n: usize = batch.iter().map(|c| c.tokens.len()).sum();
        let g = groups.len();
        let mut m = PassMeta {
            tokens: Vec::with_capacity(n),
            info: Vec::with_capacity(n),
            chunk_base: Vec::with_capacity(batch.len()),
            chunk_start: Vec::with_capacity(batch.len()),
            past_slots: vec![Vec::with_capacity(batch.len()); g],
            slots: vec![Vec::with_capacity(n); g],
            logit_rows: Vec::new(),
            token_blocks: Vec::new(),
            adapter_rows: crate::backend::rows_by_slot(batch),
        };
        let mut segments = Vec::with_capacity(batch.len());
        let slot_of = |table: &[BlockId], p: usize, k: usize| match table[p / bs * g + k] {
            NO_PAGE => usize::MAX,
            b => b as usize * bs + p % bs,
        };
        for (ci, ch) in batch.iter().enumerate() {
            let base = m.tokens.len();
            m.chunk_base.push(base);
            m.chunk_start.push(ch.start_pos);
            // Resolved once here rather than per (layer, head, position): a division by the
            // block size per lookup was a large share of decode attention time. A window group's
            // positions before its first kept block weigh nothing in any row, but a kernel may
            // still touch them (aligned steps, prefetches): they point at a row of the sequence's
            // own that is held, the first kept one (or the chunk's first new one).
            for (k, past) in m.past_slots.iter_mut().enumerate() {
                let first = (dropped(groups.windows()[k], ch.start_pos, bs) * bs).min(ch.start_pos);
                let stand_in = slot_of(ch.block_table, first, k);
                let mut row = vec![stand_in; first];
                row.extend((first..ch.start_pos).map(|p| slot_of(ch.block_table, p, k)));
                past.push(row);
            }
            for (j, &t) in ch.tokens.iter().enumerate() {
                let pos = ch.start_pos + j;
                m.tokens.push(t);
                m.info.push(TokenInfo { chunk: ci, pos });
                for (k, slots) in m.slots.iter_mut().enumerate() {
                    slots.push(slot_of(ch.block_table, pos, k));
                }
            }
            let end = m.tokens.len();
            m.token_blocks
                .extend((base..end).step_by(ATTEND_TOKENS).map(|t| (t, (t + ATTEND_TOKENS).min(end))));
            let range = base..end;
            let chunk_slots: Vec<usize> = m.slots.iter().flat_map(|s| s[base..].iter().copied()).collect();
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
    #[inline]
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

    fn width(&self, b: Buf) -> Result<usize> {
        Ok(self.be.model.scratch()[self.check(b)?].width)
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

/// `y_i = x · W_iᵀ` for `n` rows of `x` (of a pass of `pass_n` tokens) and several matrices
/// sharing the input, which is quantized once when a matrix is packed for the integer kernels;
/// each token's result is what a product over the whole pass would give it
/// ([`matmul_in_pass`]; the integer kernels are batch-independent throughout).
fn multiply(
    store: &WeightStore,
    packed: &[Option<PackedMatrix>],
    xq: &mut super::QuantizedRows,
    x: &[f32],
    n: usize,
    pass_n: usize,
    outs: &mut [(MatId, &mut [f32])],
) -> Result<()> {
    let mut mats: Vec<(&Matrix, Option<&PackedMatrix>)> = Vec::with_capacity(outs.len());
    for (w, y) in outs.iter() {
        let i = w.0 as usize;
        match store.mats.get(i) {
            Some((m, _)) if m.cols * n == x.len() && m.rows * n == y.len() => {
                mats.push((m, packed.get(i).and_then(Option::as_ref)))
            }
            _ => return Err(bad_handle("matrix (or its shape)", i)),
        }
    }
    let cols = mats.first().map_or(0, |(m, _)| m.cols);
    let ps: Vec<Option<&PackedMatrix>> = mats.iter().map(|&(_, p)| p).collect();
    quantize_for(xq, x, n, cols, &ps);
    if let Some(packed) = ps.iter().copied().collect::<Option<Vec<&PackedMatrix>>>() {
        // Every matrix on the integer kernels: one parallel loop over all of them (a layer's
        // Q, K and V, or gate and up, are then one product as far as the threads can tell).
        let mut many: Vec<(&PackedMatrix, &mut [f32])> =
            packed.into_iter().zip(outs.iter_mut()).map(|(p, (_, y))| (p, &mut **y)).collect();
        super::q8::matmul_q8_many(&mut many, xq);
        return Ok(());
    }
    for ((m, p), (_, y)) in mats.into_iter().zip(outs.iter_mut()) {
        match p {
            Some(p) => matmul_q8(p, xq, y),
            None => matmul_in_pass(m, x, n, pass_n, y),
        }
    }
    Ok(())
}

/// `out = act(gate) · up`, element-wise.
fn activate(act: Activation, gate: &[f32], up: &[f32], out: &mut [f32]) {
    match act {
        Activation::Silu => {
            out.copy_from_slice(gate);
            silu_mul(out, up);
        }
        Activation::GeluTanh => gelu_tanh_mul(gate, up, out),
    }
}

impl Ops for CpuPass<'_> {
    fn as_dyn(&mut self) -> &mut dyn Ops {
        self
    }

    fn embed(&mut self, table: MatId, scale: Option<f32>, out: Buf) -> Result<()> {
        let mut o = self.take(out)?;
        let res = match self.be.store.mats.get(table.0 as usize) {
            Some((m, _)) if Some(m.cols) == self.width(out).ok() => {
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
        let cols = self.width(x)?;
        let mut taken = Vec::with_capacity(outs.len());
        for &(_, y) in outs {
            taken.push(self.take(y)?);
        }
        let be = &mut *self.be;
        let xs = &be.scratch[x.0 as usize];
        let n = xs.len() / cols.max(1);
        let mut targets: Vec<(MatId, &mut [f32])> =
            outs.iter().zip(taken.iter_mut()).map(|(&(w, _), y)| (w, y.as_mut_slice())).collect();
        let res = multiply(&be.store, &be.packed, &mut be.xq, xs, n, n, &mut targets);
        for (&(_, y), v) in outs.iter().zip(taken) {
            self.put(y, v);
        }
        res
    }

    fn lora(&mut self, x: Buf, outs: &[(crate::lora::LoraTarget, Buf)]) -> Result<()> {
        if self.meta.adapter_rows.is_empty() {
            return Ok(());
        }
        let mut bufs: Vec<Buf> = outs.iter().map(|o| o.1).collect();
        bufs.push(x);
        self.distinct(&bufs)?;
        let cols = self.width(x)?;
        let targets: Vec<(crate::lora::LoraTarget, usize)> =
            outs.iter().map(|&(t, y)| Ok((t, self.width(y)?))).collect::<Result<_>>()?;
        // Tasks of at most ROWS_PER_TASK rows of one adapter, computed in parallel, then added
        // to the outputs in task order.
        let mut tasks: Vec<(&super::lora::CpuAdapter, &[usize])> = Vec::new();
        for (slot, rows) in &self.meta.adapter_rows {
            let Some(Some(a)) = self.be.adapters.get(*slot as usize) else {
                return Err(bad_handle("adapter slot", *slot as usize));
            };
            tasks.extend(rows.chunks(super::lora::ROWS_PER_TASK).map(|r| (a, r)));
        }
        let xs = &self.be.scratch[x.0 as usize];
        let deltas: Vec<Vec<Option<Vec<f32>>>> = tasks
            .par_iter()
            .map(|&(a, rows)| super::lora::task_deltas(a, &targets, xs, cols, rows))
            .collect::<Result<_>>()?;
        let rows: Vec<&[usize]> = tasks.iter().map(|t| t.1).collect();
        for (k, &(_, y)) in outs.iter().enumerate() {
            let width = targets[k].1;
            let mut ys = self.take(y)?;
            for (task_rows, per_target) in rows.iter().zip(&deltas) {
                let Some(d) = &per_target[k] else { continue };
                for (i, &t) in task_rows.iter().enumerate() {
                    let dst = &mut ys[t * width..(t + 1) * width];
                    dst.iter_mut().zip(&d[i * width..(i + 1) * width]).for_each(|(o, v)| *o += v);
                }
            }
            self.put(y, ys);
        }
        Ok(())
    }

    fn add_bias(&mut self, x: Buf, b: VecId) -> Result<()> {
        let mut xs = self.take(x)?;
        let bs = self.vector(b)?;
        xs.chunks_exact_mut(bs.len()).for_each(|row| row.iter_mut().zip(bs).for_each(|(x, b)| *x += b));
        self.put(x, xs);
        Ok(())
    }

    fn rope(&mut self, x: Buf, rope: RopeId) -> Result<()> {
        let width = self.width(x)?;
        let mut xs = self.take(x)?;
        let res = match self.be.ropes.get(rope.0 as usize) {
            Some(table) => {
                xs.par_chunks_mut(width)
                    .zip(&self.meta.info)
                    .with_min_len(16)
                    .for_each(|(row, ti)| table.apply(row, ti.pos));
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
        let (kv_group, at) = (be.groups.group(l), be.groups.slot(l));
        // A window group holds only what its window reaches: a layer must never look further.
        let res = match be.groups.windows()[kv_group] {
            Some(w) if spec.window.is_none_or(|s| s > w) => Err(KvError::InvalidLayout(format!(
                "layer {l} attends through a window of {:?} positions, but its KV group keeps {w}",
                spec.window
            ))),
            _ => be.write_path.write(&mut be.pool, l, &kb, &vb, &meta.slots[kv_group]),
        };
        if res.is_ok() {
            let started = std::time::Instant::now();
            let qs = &be.scratch[q.0 as usize];
            let (pk, pv) = (be.pool.k(at), be.pool.v(at));
            let (kr, vr) = (kb.as_slice(), vb.as_slice());
            let group = nh / nkv;
            let window = spec.window.unwrap_or(usize::MAX);
            let rule = ScoreRule { scale: spec.scale, softcap: spec.softcap };
            let span_of = |t: usize| {
                let pos = meta.info[t].pos;
                (pos + 1).saturating_sub(window)..pos + 1
            };
            // One task per (block of up to ATTEND_TOKENS consecutive tokens of one chunk, KV
            // head): its rows are each token with each query head of the group, and read each key
            // and value row once between them.
            let tasks: Vec<(usize, usize, usize)> = meta
                .token_blocks
                .iter()
                .flat_map(|&(t0, t1)| (0..nkv).map(move |kvh| (t0, t1, kvh)))
                .collect();
            // Split decode: with fewer than four tasks per thread (a few sequences, or one KV head), a
            // task's context is cut into runs of whole segments computed apart, then merged in
            // segment order, which gives the same bits as one run (see `attention`).
            let threads = rayon::current_num_threads();
            let segs_of = |&(t0, t1, _): &(usize, usize, usize)| {
                let (lo, hi) = (span_of(t0).start, span_of(t1 - 1).end);
                lo / SEGMENT..hi.div_ceil(SEGMENT)
            };
            let pieces_of = |task: &(usize, usize, usize)| {
                if tasks.len() >= 4 * threads {
                    1
                } else {
                    segs_of(task).len().min((2 * threads).div_ceil(tasks.len()))
                }
            };
            let rows_of = |&(t0, t1, _): &(usize, usize, usize)| (t1 - t0) * group;
            let mut results = vec![0f32; attn.len()];
            let split: Vec<usize> = (0..tasks.len()).filter(|&i| pieces_of(&tasks[i]) > 1).collect();
            // Per split task: each (segment, row)'s partial result and weighted values.
            let mut partials: Vec<(Vec<Partial>, Vec<f32>)> = split
                .iter()
                .map(|&i| {
                    let n = segs_of(&tasks[i]).len() * rows_of(&tasks[i]);
                    (vec![Partial::EMPTY; n], vec![0f32; n * hd])
                })
                .collect();
            enum Work<'w> {
                Whole(&'w mut [f32]),
                Piece(std::ops::Range<usize>, &'w mut [Partial], &'w mut [f32]),
            }
            let mut work: Vec<((usize, usize, usize), Work<'_>)> = Vec::with_capacity(tasks.len());
            let mut rest = results.as_mut_slice();
            let mut parts_iter = partials.iter_mut();
            for task in &tasks {
                let (piece, tail) = rest.split_at_mut(rows_of(task) * hd);
                rest = tail;
                let pieces = pieces_of(task);
                if pieces == 1 {
                    work.push((*task, Work::Whole(piece)));
                    continue;
                }
                let (parts, accs) = parts_iter.next().expect("one partial buffer per split task");
                let (segs, rows) = (segs_of(task), rows_of(task));
                let (mut parts, mut accs) = (parts.as_mut_slice(), accs.as_mut_slice());
                let mut from = segs.start;
                for k in 0..pieces {
                    let to = segs.start + segs.len() * (k + 1) / pieces;
                    let (p, pt) = parts.split_at_mut((to - from) * rows);
                    let (a, at) = accs.split_at_mut((to - from) * rows * hd);
                    (parts, accs) = (pt, at);
                    work.push((*task, Work::Piece(from..to, p, a)));
                    from = to;
                }
            }
            work.into_par_iter().for_each_init(
                || (AttendScratch::new(be.attention), Vec::new(), Vec::new()),
                |(scratch, q, spans), ((t0, t1, kvh), out)| {
                    let chunk = meta.info[t0].chunk;
                    let kview = KvView {
                        new: kr,
                        pooled: pk,
                        start_pos: meta.chunk_start[chunk],
                        base: meta.chunk_base[chunk],
                        past_slots: &meta.past_slots[kv_group][chunk],
                        stride: kvd,
                        off: kvh * hd,
                        hd,
                    };
                    let vview = KvView { new: vr, pooled: pv, ..kview };
                    q.clear();
                    spans.clear();
                    for t in t0..t1 {
                        for head in kvh * group..(kvh + 1) * group {
                            q.extend_from_slice(&qs[t * qd + head * hd..][..hd]);
                            spans.push(span_of(t));
                        }
                    }
                    let (k, v) = (|p| kview.row(p), |p| vview.row(p));
                    match out {
                        Work::Whole(o) => attend_rows(q, spans, k, v, rule, scratch, o),
                        Work::Piece(segs, parts, accs) => {
                            attend_segments(q, spans, segs, k, v, rule, scratch, parts, accs)
                        }
                    }
                },
            );
            // The split tasks' segments merged in order.
            let mut starts = Vec::with_capacity(tasks.len());
            let mut at = 0;
            for task in &tasks {
                starts.push(at);
                at += rows_of(task) * hd;
            }
            for (&i, (parts, accs)) in split.iter().zip(&partials) {
                let rows = rows_of(&tasks[i]);
                merge_segments(parts, accs, rows, &mut results[starts[i]..][..rows * hd]);
            }
            // Back to token-major order.
            let mut from = 0;
            for &(t0, t1, kvh) in &tasks {
                for t in t0..t1 {
                    for head in kvh * group..(kvh + 1) * group {
                        attn[t * qd + head * hd..][..hd].copy_from_slice(&results[from..from + hd]);
                        from += hd;
                    }
                }
            }
            super::count_attention(started);
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
        o.par_chunks_mut(PIECE)
            .zip(g.par_chunks(PIECE))
            .zip(u.par_chunks(PIECE))
            .for_each(|((o, g), u)| activate(act, g, u, o));
        self.put(out, o);
        Ok(())
    }

    /// Groups the pass's tokens by expert, so that each expert's matrices are read once per pass:
    /// every token's router logits and routing first ([`moe_route`]), then for each expert in
    /// increasing index the rows routed to it gathered, multiplied through its gate, up and down
    /// matrices, and added, weighted, to their tokens' outputs. So each token's experts are added
    /// in increasing index (as transformers adds them), and its result is what it would be alone
    /// in a pass of the same size.
    fn moe(&mut self, x: Buf, spec: &MoeSpec, out: Buf) -> Result<()> {
        let sc = spec.scratch;
        self.distinct(&[x, out, sc.route, sc.gate, sc.up, sc.act, sc.down])?;
        let (h, n_exp, ff) = (self.width(x)?, self.width(sc.route)?, self.width(sc.gate)?);
        if spec.experts.len() != n_exp
            || !(1..=n_exp).contains(&spec.top_k)
            || self.width(out)? != h
            || self.width(sc.down)? != h
            || self.width(sc.up)? != ff
            || self.width(sc.act)? != ff
        {
            return Err(EngineError::Internal(
                "model pass: mixture of experts does not fit its buffers".into(),
            ));
        }
        let mut o = self.take(out)?;
        let (mut route, mut gate, mut up) = (self.take(sc.route)?, self.take(sc.gate)?, self.take(sc.up)?);
        let (mut act, mut down) = (self.take(sc.act)?, self.take(sc.down)?);
        let be = &mut *self.be;
        let xs = &be.scratch[x.0 as usize];
        let n = xs.len() / h.max(1);
        let res = (|| -> Result<()> {
            multiply(
                &be.store,
                &be.packed,
                &mut be.xq,
                xs,
                n,
                n,
                &mut [(spec.router, &mut route[..n * n_exp])],
            )?;
            // Per expert, its tokens (in pass order) and their weights.
            let mut groups: Vec<Vec<(usize, f32)>> = vec![Vec::new(); n_exp];
            let (mut probs, mut chosen) = (Vec::new(), Vec::new());
            for (t, logits) in route.chunks_exact(n_exp).take(n).enumerate() {
                moe_route(logits, spec.top_k, spec.renormalize, &mut probs, &mut chosen);
                for &(e, w) in &chosen {
                    groups[e].push((t, w));
                }
            }
            o.fill(0.0);
            for (expert, group) in spec.experts.iter().zip(&groups) {
                let g = group.len();
                if g == 0 {
                    continue;
                }
                be.gathered.clear();
                for &(t, _) in group {
                    be.gathered.extend_from_slice(&xs[t * h..(t + 1) * h]);
                }
                let (gate, up, act, down) =
                    (&mut gate[..g * ff], &mut up[..g * ff], &mut act[..g * ff], &mut down[..g * h]);
                let xg = &be.gathered;
                multiply(
                    &be.store,
                    &be.packed,
                    &mut be.xq,
                    xg,
                    g,
                    n,
                    &mut [(expert.gate, gate), (expert.up, up)],
                )?;
                activate(spec.act, gate, up, act);
                multiply(&be.store, &be.packed, &mut be.xq, act, g, n, &mut [(expert.down, down)])?;
                for (&(t, w), y) in group.iter().zip(down.chunks_exact(h)) {
                    o[t * h..(t + 1) * h].iter_mut().zip(y).for_each(|(o, &y)| *o += w * y);
                }
            }
            Ok(())
        })();
        self.put(out, o);
        self.put(sc.route, route);
        self.put(sc.gate, gate);
        self.put(sc.up, up);
        self.put(sc.act, act);
        self.put(sc.down, down);
        res
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
        let w = self.width(x)?;
        let mut o = self.take(out)?;
        let xs = self.buf(x)?;
        for (dst, &r) in o.chunks_exact_mut(w).zip(&self.meta.logit_rows) {
            dst.copy_from_slice(&xs[r * w..(r + 1) * w]);
        }
        self.put(out, o);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Activations, Backend, BackendOptions, SeqChunk};
    use crate::config::{Arch, MlpAct, ModelConfig};
    use crate::models::{
        BufKind, BufSpec, Expert, MatUse, Model, ModelWeights, MoeScratch, RopeSpec, Rows, WeightStore,
    };
    use crate::quant::GgmlType;
    use crate::weights::{Bytes, Matrix};

    /// Hidden width, the experts' width, experts, experts per token. The vocabulary is `H` tokens
    /// (the pass returns the mixture's output rows as its "logits"). Rows this long take
    /// different summation orders in the per-row and the tiled kernels.
    const H: usize = 128;
    const FF: usize = 64;
    const E: usize = 6;
    const K: usize = 2;

    /// A pass that is a mixture: embedding, [`Ops::moe`], the output rows; and an attention over
    /// zeros that feeds nothing, since a pass must write its layer's KV.
    #[derive(Debug)]
    struct MoeOnly {
        embed: MatId,
        spec: MoeSpec,
        x: Buf,
        out: Buf,
        logits: Buf,
        /// q, k, v, attention output.
        attn: [Buf; 4],
        scratch: Vec<BufSpec>,
    }

    impl Model for MoeOnly {
        fn scratch(&self) -> &[BufSpec] {
            &self.scratch
        }
        fn ropes(&self) -> &[RopeSpec] {
            &[]
        }
        fn forward(&self, ops: &mut dyn Ops) -> Result<()> {
            let [q, k, v, o] = self.attn;
            ops.attention(q, k, v, o, &AttnSpec { layer: 0, window: None, scale: 1.0, softcap: None })?;
            ops.embed(self.embed, None, self.x)?;
            ops.moe(self.x, &self.spec, self.out)?;
            ops.gather_logit_rows(self.out, self.logits)
        }
        fn logits(&self) -> Buf {
            self.logits
        }
    }

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> f32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
    }

    fn f32_matrix(rng: &mut Rng, rows: usize, cols: usize, scale: f32) -> Matrix {
        let v: Vec<f32> = (0..rows * cols).map(|_| rng.next() * scale).collect();
        Matrix { rows, cols, dtype: GgmlType::F32, data: Bytes::from_f32(&v) }
    }

    /// Random Q8_0 rows (one scale per 32 values), which the integer kernels pack.
    fn q8_matrix(rng: &mut Rng, rows: usize, cols: usize, scale: f32) -> Matrix {
        let mut b = Vec::new();
        for _ in 0..rows * cols / 32 {
            b.extend(half::f16::from_f32(scale / 127.0 * (1.0 + rng.next().abs())).to_le_bytes());
            b.extend((0..32).map(|_| (rng.next() * 127.0) as i8 as u8));
        }
        Matrix { rows, cols, dtype: GgmlType::Q8_0, data: Bytes::copy_from(&b) }
    }

    /// The backend, the weights and the mixture it runs.
    fn backend(quantized: bool, renormalize: bool) -> (CpuBackend, WeightStore, MoeSpec) {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut s = WeightStore::default();
        let embed = s.mat(f32_matrix(&mut rng, H, H, 1.0), MatUse { table: true, linear: false });
        let router = s.linear(f32_matrix(&mut rng, E, H, 1.0));
        let mut m = |rows, cols| {
            if quantized {
                q8_matrix(&mut rng, rows, cols, 0.5)
            } else {
                f32_matrix(&mut rng, rows, cols, 0.5)
            }
        };
        let mats: Vec<[Matrix; 3]> = (0..E).map(|_| [m(FF, H), m(FF, H), m(H, FF)]).collect();
        let experts = mats
            .into_iter()
            .map(|[g, u, d]| Expert { gate: s.linear(g), up: s.linear(u), down: s.linear(d) })
            .collect();
        let mut sb = crate::models::ScratchBuilder::default();
        let x = sb.mat_in(H);
        let scratch = MoeScratch {
            route: sb.f32(E),
            gate: sb.f32(FF),
            up: sb.f32(FF),
            act: sb.mat_in(FF),
            down: sb.f32(H),
        };
        let out = sb.f32(H);
        let logits = sb.add(H, Rows::Logits, BufKind::F32);
        let attn = [sb.f32(2), sb.f32(2), sb.f32(2), sb.mat_in(2)];
        let spec = MoeSpec { router, experts, top_k: K, renormalize, act: Activation::Silu, scratch };
        let model = MoeOnly { embed, spec: spec.clone(), x, out, logits, attn, scratch: sb.finish() };
        let config = ModelConfig {
            arch: Arch::Qwen3Moe,
            hidden_size: H,
            intermediate_size: FF,
            num_layers: 1,
            num_heads: 1,
            num_kv_heads: 1,
            head_dim: 2,
            vocab_size: H,
            rms_norm_eps: 1e-6,
            rope_theta: 1e4,
            rope_scaling: None,
            max_position_embeddings: 64,
            tie_word_embeddings: false,
            qkv_bias: false,
            qk_norm: false,
            sliding_window: None,
            sliding_layers: None,
            rope_local_theta: None,
            mlp_act: MlpAct::Silu,
            query_pre_attn_scalar: None,
            attn_logit_softcapping: None,
            final_logit_softcapping: None,
            moe: None,
        };
        let weights = ModelWeights { model: std::sync::Arc::new(model), store: s.clone() };
        let opts = BackendOptions {
            num_blocks: 32,
            block_size: 8,
            max_batch_tokens: 64,
            threads: 2,
            activations: if quantized { Activations::Q8 } else { Activations::F32 },
            ..Default::default()
        };
        (CpuBackend::new(config, weights, opts).unwrap(), s, spec)
    }

    /// Every row's mixture output, one pass of `tokens` (each its own sequence of one token).
    fn run(be: &mut CpuBackend, tokens: &[u32]) -> Vec<Vec<f32>> {
        let tables: Vec<[u32; 1]> = (0..tokens.len() as u32).map(|b| [b]).collect();
        let chunks: Vec<SeqChunk<'_>> = tokens
            .chunks(1)
            .zip(&tables)
            .map(|(t, table)| SeqChunk {
                tokens: t,
                start_pos: 0,
                block_table: table,
                logits: LogitsRequest::All,
                write: WriteMode::Direct,
                adapter: None,
            })
            .collect();
        be.forward(&chunks).unwrap()
    }

    /// The mixture of token `t` in f64 from the stored (dequantized) weights, by the op's rule.
    fn reference(store: &WeightStore, spec: &MoeSpec, t: u32) -> Vec<f64> {
        let row = |id: MatId, r: usize| {
            let m = store.matrix(id);
            let mut v = vec![0f32; m.cols];
            m.dequantize_row(r, &mut v);
            v
        };
        let x: Vec<f64> = row(MatId(0), t as usize).into_iter().map(f64::from).collect();
        let dot = |id: MatId, r: usize, v: &[f64]| {
            row(id, r).iter().zip(v).map(|(&w, x)| w as f64 * x).sum::<f64>()
        };
        let logits: Vec<f64> = (0..E).map(|e| dot(spec.router, e, &x)).collect();
        let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = logits.iter().map(|l| (l - max).exp()).sum();
        let mut order: Vec<usize> = (0..E).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let chosen = &order[..K];
        let total: f64 = chosen.iter().map(|&e| (logits[e] - max).exp() / z).sum();
        let mut y = vec![0f64; H];
        for &e in chosen {
            let mut w = (logits[e] - max).exp() / z;
            if spec.renormalize {
                w /= total;
            }
            let ex = spec.experts[e];
            let act: Vec<f64> = (0..FF)
                .map(|j| {
                    let g = dot(ex.gate, j, &x);
                    g / (1.0 + (-g).exp()) * dot(ex.up, j, &x)
                })
                .collect();
            for (i, yi) in y.iter_mut().enumerate() {
                *yi += w * dot(ex.down, i, &act);
            }
        }
        y
    }

    /// The CPU mixture groups a pass's tokens by expert; each token's result must be what it is
    /// alone (bit for bit, for passes of up to `SMALL_N` tokens, which take the per-row kernels),
    /// the same in any other pass of the same size class (bit for bit), and transformers'
    /// arithmetic (against an f64 reference of the same rule).
    #[test]
    fn grouping_by_expert_is_invisible_per_token() {
        for (quantized, renormalize) in [(false, true), (false, false), (true, true)] {
            let (mut be, store, spec) = backend(quantized, renormalize);
            let what = format!("quantized {quantized}, renormalize {renormalize}");
            // Every token of the vocabulary, as a reference and alone.
            let alone: Vec<Vec<f32>> = (0..H as u32).map(|t| run(&mut be, &[t]).remove(0)).collect();
            // 8-bit activations move results by about 1% of their scale.
            let near = |got: &[f32], t: u32, context: &str| {
                let want = reference(&store, &spec, t);
                let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
                let err = got.iter().zip(&want).fold(0f64, |m, (&a, b)| m.max((a as f64 - b).abs()));
                let tol = if quantized { 0.03 * scale + 1e-3 } else { 1e-5 * scale.max(1.0) };
                assert!(err <= tol, "{what}: token {t} {context}: error {err} (scale {scale})");
            };
            for t in 0..H as u32 {
                near(&alone[t as usize], t, "alone");
            }
            // Small passes (per-row kernels): each row equals its token alone, bit for bit.
            let small = [3u32, 17, 3, 30, 8, 21, 12];
            for (row, &t) in run(&mut be, &small).iter().zip(&small) {
                assert_eq!(row, &alone[t as usize], "{what}: token {t} in a pass of {}", small.len());
            }
            // Large passes (tiled kernels): the same token in two different passes of 20.
            let a: Vec<u32> = (0..20).map(|i| (i * 7 + 1) % 40).collect();
            let b: Vec<u32> = (0..20).map(|i| (i * 3 + 1) % 40).collect();
            let (ra, rb) = (run(&mut be, &a), run(&mut be, &b));
            let mut shared = 0;
            for (i, &t) in a.iter().enumerate() {
                if let Some(j) = b.iter().position(|&u| u == t) {
                    assert_eq!(ra[i], rb[j], "{what}: token {t} in two passes of 20");
                    shared += 1;
                }
                near(&ra[i], t, "in a pass of 20");
            }
            assert!(shared >= 5, "the two passes share only {shared} tokens");
            // One token twenty times: its experts' groups hold the whole pass, where in `a` they
            // hold a few tokens; the kernels (chosen by the pass's size) and so the bits agree.
            let c = vec![a[3]; 20];
            for row in run(&mut be, &c) {
                assert_eq!(row, ra[3], "{what}: token {} alone with its copies vs in a mixed pass", a[3]);
            }
        }
    }
}
