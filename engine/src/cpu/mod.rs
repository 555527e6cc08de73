//! The CPU backend: weights as loaded (f32 or GGML-quantized); Q4_0/Q4_1/Q8_0 matrices also
//! packed for the integer kernels of [`q8`], which take 16- or 8-bit activations
//! ([`BackendOptions::activations`]), every other matrix (and all of them with
//! [`Activations::F32`]) dequantized on the fly inside the f32 kernels of [`mod@matmul`]; a paged KV
//! pool of f32, f16 or bf16
//! ([`BackendOptions::kv_dtype`]; private memory, or a shared-memory segment with
//! [`BackendOptions::kv_shared`]), rayon for all cores.
//!
//! Attention reads the chunk's own new K/V straight from this pass's projections and older
//! positions from the pool through the block table. So the pool write (direct or staged) never
//! has to happen before attention, and a staged pass attends to its draft tokens without them
//! ever touching the pool. With a 16-bit pool the fresh K/V are rounded to the pool's dtype as
//! soon as they are computed, so attention sees a token's K/V identically from this pass and
//! from the pool later: chunking, speculation, prefix-cache hits and transfers change nothing.

pub mod matmul;
pub mod ops;
pub mod q8;

use rayon::prelude::*;

use crate::backend::{Activations, Backend, BackendOptions, LogitsRequest, SeqChunk};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::kv::{BlockId, CpuKvPool, KvDtype, KvLayout, KvSlice, KvWritePath, StagedSegment, WriteMode};
use crate::weights::ModelWeights;
use crate::Device;

use matmul::matmul;
use ops::{attend, rms_norm, rms_norm_inplace, silu_mul, RopeTable};
use q8::{matmul_q8, PackedMatrix, QuantizedRows};

/// CPU implementation of [`Backend`].
pub struct CpuBackend {
    config: ModelConfig,
    weights: ModelWeights,
    opts: BackendOptions,
    rope: RopeTable,
    pool: CpuKvPool,
    write_path: KvWritePath,
    /// This instance's compute threads; every forward pass runs inside it, so the matrix
    /// kernels' parallel loops never pay a hand-off from a foreign thread.
    threads: std::sync::Arc<rayon::ThreadPool>,
    /// With [`Activations::Q16`] or [`Activations::Q8`], every matrix the integer kernels
    /// support, packed for them (per layer in the order q, k, v, o, gate, up, down; then the lm_head). `None` entries take
    /// the f32 kernels.
    packed: Option<PackedWeights>,
    /// Reused quantized activations.
    xq: QuantizedRows,
}

struct PackedWeights {
    layers: Vec<[Option<PackedMatrix>; 7]>,
    lm_head: Option<PackedMatrix>,
}

impl PackedWeights {
    fn new(weights: &ModelWeights, wide: bool) -> PackedWeights {
        let pack = |m: &crate::weights::Matrix| {
            q8::supports(m.dtype)
                .then(|| if wide { PackedMatrix::pack_wide(m) } else { PackedMatrix::pack(m) })
        };
        PackedWeights {
            layers: weights
                .layers
                .iter()
                .map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down].map(pack))
                .collect(),
            lm_head: pack(&weights.lm_head),
        }
    }
}

/// `y = x · Wᵀ` through the integer kernels when `W` is packed (then `xq` must hold `x`
/// quantized), else through the f32 kernels.
fn linear(
    w: &crate::weights::Matrix,
    packed: Option<&PackedMatrix>,
    x: &[f32],
    xq: &QuantizedRows,
    n: usize,
    y: &mut [f32],
) {
    match packed {
        Some(p) => matmul_q8(p, xq, y),
        None => matmul(w, x, n, y),
    }
}

/// [`rms_norm`] of every row, rows spread over the pool (each row's result is the same however
/// they are split).
fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let h = w.len();
    out.par_chunks_mut(h).zip(x.par_chunks(h)).with_min_len(16).for_each(|(o, r)| rms_norm(r, w, eps, o));
}

/// Quantizes `x` into `xq`, at the width the matrices were packed for, when one of the matrices
/// about to take it is packed.
fn quantize_for(xq: &mut QuantizedRows, x: &[f32], n: usize, cols: usize, packed: &[Option<&PackedMatrix>]) {
    match packed.iter().flatten().next() {
        Some(p) if p.wide => xq.quantize_wide(x, n, cols),
        Some(_) => xq.quantize(x, n, cols),
        None => {}
    }
}

/// `x += o`, element-wise, spread over the pool in pieces of at least 16 Ki elements (a decode
/// step stays on one thread; any split gives the same values).
fn add_residual(x: &mut [f32], o: &[f32]) {
    x.par_chunks_mut(1 << 14).zip(o.par_chunks(1 << 14)).for_each(|(x, o)| {
        x.iter_mut().zip(o).for_each(|(a, b)| *a += b);
    });
}

impl CpuBackend {
    /// Builds the backend: RoPE tables for every position the pool can hold (capped by the
    /// model's context length) and a zeroed KV pool.
    pub fn new(config: ModelConfig, weights: ModelWeights, mut opts: BackendOptions) -> Result<CpuBackend> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        if opts.num_blocks == 0 || opts.block_size == 0 || opts.max_batch_tokens == 0 {
            return bad(format!(
                "KV blocks ({}), block size ({}) and max batch tokens ({}) must be positive",
                opts.num_blocks, opts.block_size, opts.max_batch_tokens
            ));
        }
        if opts.num_blocks > u32::MAX as usize {
            return bad(format!(
                "{} KV blocks exceed the block id range (at most {})",
                opts.num_blocks,
                u32::MAX
            ));
        }
        if opts.threads > MAX_THREADS {
            return bad(format!("{} threads requested; at most {MAX_THREADS}", opts.threads));
        }
        let Some(capacity) = opts.num_blocks.checked_mul(opts.block_size) else {
            return bad(format!("{} blocks of {} tokens overflow", opts.num_blocks, opts.block_size));
        };
        // A pass can never hold more tokens than the pool.
        opts.max_batch_tokens = opts.max_batch_tokens.min(capacity);
        let layout = KvLayout {
            num_layers: config.num_layers,
            num_blocks: opts.num_blocks,
            block_size: opts.block_size,
            num_kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            dtype: opts.kv_dtype_on(Device::Cpu),
        };
        // Pool plus staging (f32, same shape per token), checked before anything is allocated, so
        // an impossible size is an error naming the setting instead of an aborted process.
        let stage_token = (2 * layout.num_layers * layout.token_elems() * 4) as u128;
        let needed =
            layout.bytes_per_token() as u128 * capacity as u128 + stage_token * opts.max_batch_tokens as u128;
        if let Some(total) = total_memory_bytes() {
            if needed > total as u128 {
                return bad(format!(
                    "the KV cache needs {:.1} GiB ({} blocks of {} tokens plus staging for {} tokens) but \
                     this machine has {:.1} GiB; lower --kv-blocks or --max-batch-tokens",
                    needed as f64 / GIB,
                    opts.num_blocks,
                    opts.block_size,
                    opts.max_batch_tokens,
                    total as f64 / GIB
                ));
            }
        }
        let positions = config.max_position_embeddings.min(capacity);
        let rope =
            RopeTable::new(config.head_dim, config.rope_theta, config.rope_scaling.as_ref(), positions);
        let threads = rayon::ThreadPoolBuilder::new()
            .num_threads(opts.threads)
            .thread_name(|i| format!("tandem-cpu-{i}"))
            .build()
            .map_err(|e| EngineError::Device {
                device: Device::Cpu,
                msg: format!("cannot start compute threads: {e}"),
            })?;
        if opts.activations == Activations::Q16 && q8::Isa8::best() != q8::Isa8::fastest_possible() {
            // The 16-bit kernels need AVX-512 VNNI; without it the exact f32 kernels are faster.
            tracing::info!("this CPU has no AVX-512 VNNI: using --activations f32 instead of q16");
            opts.activations = Activations::F32;
        }
        let packed = (opts.activations != Activations::F32)
            .then(|| threads.install(|| PackedWeights::new(&weights, opts.activations == Activations::Q16)));
        Ok(CpuBackend {
            packed,
            xq: QuantizedRows::new(),
            threads: std::sync::Arc::new(threads),
            rope,
            pool: if opts.kv_shared {
                CpuKvPool::try_new_shared(layout)?
            } else {
                CpuKvPool::try_new(layout)?
            },
            write_path: KvWritePath::new(layout, opts.max_batch_tokens),
            config,
            weights,
            opts,
        })
    }

    /// The forward pass proper; runs on this instance's thread pool.
    fn forward_in_pool(&mut self, batch: &[SeqChunk<'_>]) -> Result<Vec<Vec<f32>>> {
        let n = self.validate(batch)?;
        if n == 0 {
            return Ok(Vec::new());
        }
        let c = &self.config;
        let (h, hd, nh, nkv) = (c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let bs = self.opts.block_size;
        let eps = c.rms_norm_eps;

        let mut tokens = Vec::with_capacity(n);
        let mut info = Vec::with_capacity(n);
        let mut chunk_base = Vec::with_capacity(batch.len());
        let mut past_slots = Vec::with_capacity(batch.len());
        let mut slots = Vec::with_capacity(n);
        let mut segments = Vec::new();
        let slot_of = |table: &[BlockId], p: usize| table[p / bs] as usize * bs + p % bs;
        for (ci, ch) in batch.iter().enumerate() {
            chunk_base.push(tokens.len());
            // Resolved once here rather than per (layer, head, position): a division by the
            // block size per lookup was a large share of decode attention time.
            past_slots.push((0..ch.start_pos).map(|p| slot_of(ch.block_table, p)).collect::<Vec<_>>());
            let first = slots.len();
            for (j, &t) in ch.tokens.iter().enumerate() {
                let pos = ch.start_pos + j;
                tokens.push(t);
                info.push(TokenInfo { chunk: ci, pos });
                slots.push(slot_of(ch.block_table, pos));
            }
            let (range, chunk_slots) = (first..slots.len(), slots[first..].to_vec());
            segments.push(match ch.write {
                WriteMode::Staged => StagedSegment::new(range, chunk_slots),
                WriteMode::Direct => StagedSegment::direct(range, chunk_slots),
            });
        }
        // A pass is staged exactly when the caller marked a chunk staged; its direct chunks still
        // go straight to the pool.
        let mode = if batch.iter().any(|c| c.write == WriteMode::Staged) {
            WriteMode::Staged
        } else {
            WriteMode::Direct
        };

        // Embedding lookup.
        let mut x = vec![0f32; n * h];
        x.par_chunks_mut(h)
            .zip(&tokens)
            .for_each(|(row, &t)| self.weights.embed.dequantize_row(t as usize, row));

        let mut xn = vec![0f32; n * h];
        let mut q = vec![0f32; n * qd];
        let mut k = vec![0f32; n * kvd];
        let mut v = vec![0f32; n * kvd];
        let mut attn = vec![0f32; n * qd];
        let mut o = vec![0f32; n * h];
        let mut gate = vec![0f32; n * c.intermediate_size];
        let mut up = vec![0f32; n * c.intermediate_size];
        let scale = 1.0 / (hd as f32).sqrt();
        let group = nh / nkv;
        let window = c.sliding_window.unwrap_or(usize::MAX);

        self.write_path.begin_pass(mode, &segments)?;
        let xq = &mut self.xq;
        for (l, lw) in self.weights.layers.iter().enumerate() {
            let pm: [Option<&PackedMatrix>; 7] = match &self.packed {
                Some(p) => p.layers[l].each_ref().map(Option::as_ref),
                None => [None; 7],
            };
            rms_norm_rows(&x, &lw.attn_norm, eps, &mut xn);
            quantize_for(xq, &xn, n, h, &pm[0..3]);
            linear(&lw.wq, pm[0], &xn, xq, n, &mut q);
            linear(&lw.wk, pm[1], &xn, xq, n, &mut k);
            linear(&lw.wv, pm[2], &xn, xq, n, &mut v);
            for (buf, bias, width) in [(&mut q, &lw.bq, qd), (&mut k, &lw.bk, kvd), (&mut v, &lw.bv, kvd)] {
                if let Some(b) = bias {
                    buf.chunks_exact_mut(width)
                        .for_each(|row| row.iter_mut().zip(b).for_each(|(x, b)| *x += b));
                }
            }
            if let Some(w) = &lw.q_norm {
                rms_norm_inplace(&mut q, w, eps);
            }
            if let Some(w) = &lw.k_norm {
                rms_norm_inplace(&mut k, w, eps);
            }
            let rope = &self.rope;
            q.par_chunks_mut(qd).zip(&info).for_each(|(row, ti)| rope.apply(row, ti.pos));
            k.par_chunks_mut(kvd).zip(&info).for_each(|(row, ti)| rope.apply(row, ti.pos));
            // Fresh K/V exactly as the pool will give them back (see the module documentation).
            let kv_dtype = self.pool.layout().dtype;
            if kv_dtype != KvDtype::F32 {
                k.par_chunks_mut(kvd).chain(v.par_chunks_mut(kvd)).for_each(|row| kv_dtype.round(row));
            }

            self.write_path.write(&mut self.pool, l, &k, &v, &slots)?;

            let (pk, pv) = (self.pool.k(l), self.pool.v(l));
            let (kr, vr) = (k.as_slice(), v.as_slice());
            // Attention: one task per (token, head). (Grouping the query heads of a KV head into
            // one task reads K/V once, but leaves too few tasks for the threads at decode time.)
            attn.par_chunks_mut(hd).enumerate().for_each_init(Vec::new, |scores, (idx, out)| {
                let (t, head) = (idx / nh, idx % nh);
                let TokenInfo { chunk, pos } = info[t];
                let ch = &batch[chunk];
                let kvh = head / group;
                let first = (pos + 1).saturating_sub(window);
                let kview = KvView {
                    new: kr,
                    pooled: pk,
                    start_pos: ch.start_pos,
                    base: chunk_base[chunk],
                    past_slots: &past_slots[chunk],
                    stride: kvd,
                    off: kvh * hd,
                    hd,
                };
                let vview = KvView { new: vr, pooled: pv, ..kview };
                attend(
                    &q[t * qd + head * hd..][..hd],
                    pos + 1 - first,
                    move |i| kview.row(first + i),
                    move |i| vview.row(first + i),
                    scale,
                    scores,
                    out,
                );
            });

            quantize_for(xq, &attn, n, qd, &pm[3..4]);
            linear(&lw.wo, pm[3], &attn, xq, n, &mut o);
            add_residual(&mut x, &o);

            rms_norm_rows(&x, &lw.ffn_norm, eps, &mut xn);
            quantize_for(xq, &xn, n, h, &pm[4..6]);
            linear(&lw.w_gate, pm[4], &xn, xq, n, &mut gate);
            linear(&lw.w_up, pm[5], &xn, xq, n, &mut up);
            // Element-wise, spread like `add_residual`.
            gate.par_chunks_mut(1 << 14).zip(up.par_chunks(1 << 14)).for_each(|(g, u)| silu_mul(g, u));
            quantize_for(xq, &gate, n, c.intermediate_size, &pm[6..7]);
            linear(&lw.w_down, pm[6], &gate, xq, n, &mut o);
            add_residual(&mut x, &o);
        }
        self.write_path.end_pass()?;

        // Logits for the rows that asked for them.
        let mut rows = Vec::new();
        for (ci, ch) in batch.iter().enumerate() {
            let base = chunk_base[ci];
            match ch.logits {
                LogitsRequest::None => {}
                LogitsRequest::Last => rows.push(base + ch.tokens.len() - 1),
                LogitsRequest::All => rows.extend(base..base + ch.tokens.len()),
            }
        }
        let vocab = c.vocab_size;
        let mut hsel = vec![0f32; rows.len() * h];
        for (dst, &r) in hsel.chunks_exact_mut(h).zip(&rows) {
            rms_norm(&x[r * h..(r + 1) * h], &self.weights.final_norm, eps, dst);
        }
        let mut logits = vec![0f32; rows.len() * vocab];
        if !rows.is_empty() {
            let lm = self.packed.as_ref().and_then(|p| p.lm_head.as_ref());
            quantize_for(xq, &hsel, rows.len(), h, &[lm]);
            linear(&self.weights.lm_head, lm, &hsel, xq, rows.len(), &mut logits);
        }
        let mut out = Vec::with_capacity(batch.len());
        let mut off = 0;
        for ch in batch {
            let cnt = match ch.logits {
                LogitsRequest::None => 0,
                LogitsRequest::Last => 1,
                LogitsRequest::All => ch.tokens.len(),
            };
            out.push(logits[off * vocab..(off + cnt) * vocab].to_vec());
            off += cnt;
        }
        Ok(out)
    }

    /// Checks a batch against the model and the pool before touching anything.
    fn validate(&self, batch: &[SeqChunk<'_>]) -> Result<usize> {
        crate::backend::validate_batch(batch, self.config.vocab_size, self.rope.positions(), &self.opts)
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

/// Upper bound on compute threads per backend instance.
const MAX_THREADS: usize = 1024;
const GIB: f64 = (1u64 << 30) as f64;

/// Physical memory of this machine, where the platform tells.
fn total_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Per-token bookkeeping for one pass.
struct TokenInfo {
    chunk: usize,
    pos: usize,
}

impl Backend for CpuBackend {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn kv_layout(&self) -> KvLayout {
        self.pool.layout()
    }

    fn max_batch_tokens(&self) -> usize {
        self.opts.max_batch_tokens
    }

    fn forward(&mut self, batch: &[SeqChunk<'_>]) -> Result<Vec<Vec<f32>>> {
        let threads = self.threads.clone();
        let out = threads.install(|| self.forward_in_pool(batch));
        if out.is_err() && self.write_path.mode().is_some() && !self.write_path.is_pending() {
            // A pass that failed half-way must not leave the write path open for the next one.
            self.write_path.discard();
        }
        out
    }

    fn commit_staged(&mut self, accepted: &[usize]) -> Result<()> {
        Ok(self.write_path.commit(&mut self.pool, accepted)?)
    }

    fn discard_staged(&mut self) {
        self.write_path.discard();
    }

    fn staged_pending(&self) -> bool {
        self.write_path.mode().is_some()
    }

    fn copy_block(&mut self, src: BlockId, dst: BlockId) -> Result<()> {
        Ok(self.pool.copy_block(src, dst)?)
    }

    fn read_block(&self, layer: usize, block: BlockId) -> Result<(Vec<u8>, Vec<u8>)> {
        if layer >= self.config.num_layers || block as usize >= self.opts.num_blocks {
            return Err(EngineError::Internal(format!(
                "read_block: layer {layer} block {block} out of range"
            )));
        }
        let (k, v) = self.pool.block_bytes(layer, block);
        Ok((k.to_vec(), v.to_vec()))
    }

    fn read_block_into(&self, layer: usize, block: BlockId, k: &mut [u8], v: &mut [u8]) -> Result<()> {
        Ok(self.pool.read_block_into(layer, block, k, v)?)
    }

    fn kv_sink(&self) -> Option<std::sync::Arc<dyn crate::kv::KvBlockSink>> {
        Some(self.pool.sink())
    }

    fn write_block(&mut self, layer: usize, block: BlockId, k: &[u8], v: &[u8]) -> Result<()> {
        if layer >= self.config.num_layers {
            return Err(EngineError::Internal(format!("write_block: layer {layer} out of range")));
        }
        Ok(self.pool.write_block_bytes(layer, block, k, v)?)
    }
}
