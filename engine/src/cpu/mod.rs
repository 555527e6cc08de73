//! The CPU backend: weights as loaded (f32 or GGML-quantized); quantized matrices (every GGML type
//! but Q5_1) also packed for the integer kernels of [`q8`] (and of `kq` for the k-quants), which take 16- or 8-bit activations
//! ([`BackendOptions::activations`]), every other matrix (and all of them with
//! [`Activations::F32`]) dequantized on the fly inside the f32 kernels of [`mod@matmul`]; a paged KV
//! pool of f32, f16, bf16 or fp8
//! ([`BackendOptions::kv_dtype`]; private memory, or a shared-memory segment with
//! [`BackendOptions::kv_shared`]), rayon for all cores.
//!
//! Attention reads the chunk's own new K/V straight from this pass's projections and older
//! positions from the pool through the block table. So the pool write (direct or staged) never
//! has to happen before attention, and a staged pass attends to its draft tokens without them
//! ever touching the pool. With a 16-bit pool the fresh K/V are rounded to the pool's dtype as
//! soon as they are computed, so attention sees a token's K/V identically from this pass and
//! from the pool later: chunking, speculation, prefix-cache hits and transfers change nothing.

pub mod attention;
mod lora;
pub mod matmul;
pub mod ops;
mod pass;
pub mod q8;

use pass::{CpuPass, PassMeta};

use rayon::prelude::*;

use crate::backend::{Activations, Backend, BackendOptions, LogitsRequest, SeqChunk};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::kv::{BlockId, CpuKvPool, KvGroups, KvLayout, KvWritePath, WriteMode};
use crate::models::{Model, ModelWeights, Rows, WeightStore};
use crate::Device;

use matmul::matmul_in_pass;
use ops::RopeTable;
use q8::{matmul_q8, PackedMatrix, QuantizedRows};

/// Time the CPU backends of this process have spent computing attention (the KV write excluded),
/// in nanoseconds. A process-wide counter, read by `tandem bench` for attention's share of a
/// prompt's time.
static ATTENTION_NANOS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Total time the CPU backends of this process have spent computing attention so far.
pub fn attention_time() -> std::time::Duration {
    std::time::Duration::from_nanos(ATTENTION_NANOS.load(std::sync::atomic::Ordering::Relaxed))
}

fn count_attention(since: std::time::Instant) {
    let ns = since.elapsed().as_nanos().min(u64::MAX as u128) as u64;
    ATTENTION_NANOS.fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
}

/// CPU implementation of [`Backend`].
pub struct CpuBackend {
    config: ModelConfig,
    /// The family whose forward pass runs here.
    model: std::sync::Arc<dyn Model>,
    store: WeightStore,
    opts: BackendOptions,
    /// One per [`Model::ropes`] entry.
    ropes: Vec<RopeTable>,
    /// Positions a pass may reach: the model's context, capped by the pool.
    positions: usize,
    pool: CpuKvPool,
    /// Which pages hold which layer ([`crate::kv::groups`]): one group unless
    /// [`BackendOptions::windowed_kv`] and the model mixes window and global layers.
    groups: KvGroups,
    write_path: KvWritePath,
    /// This instance's compute threads; every forward pass runs inside it, so the matrix
    /// kernels' parallel loops never pay a hand-off from a foreign thread.
    threads: std::sync::Arc<rayon::ThreadPool>,
    /// With [`Activations::Q16`] or [`Activations::Q8`], every matrix the forward pass multiplies
    /// and the integer kernels support, packed for them (indexed like the store's matrices);
    /// `None` entries take the f32 kernels.
    packed: Vec<Option<PackedMatrix>>,
    /// Reused quantized activations.
    xq: QuantizedRows,
    /// Reused rows of a pass gathered for one expert of a mixture.
    gathered: Vec<f32>,
    /// The pass's scratch buffers, indexed like [`Model::scratch`].
    scratch: Vec<Vec<f32>>,
    /// The kernel every attention row of this instance takes (one for all rows, so a token's
    /// attention is the same bits however its pass was made up).
    attention: attention::Kernel,
    /// Resident LoRA adapters by slot ([`BackendOptions::max_adapters`] of them).
    adapters: Vec<Option<lora::CpuAdapter>>,
}

/// Packs every matrix the pass multiplies that the integer kernels support.
fn pack_weights(store: &WeightStore, wide: bool) -> Vec<Option<PackedMatrix>> {
    store
        .mats
        .iter()
        .map(|(m, usage)| {
            (usage.linear && q8::supports(m.dtype)).then(|| {
                if wide {
                    PackedMatrix::pack_wide(m)
                } else {
                    PackedMatrix::pack(m)
                }
            })
        })
        .collect()
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
        let ModelWeights { model, store } = weights;
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
        // With layer groups the pool holds `groups` pages of `per_page` layers for each of the
        // `num_blocks` token blocks asked for: the same bytes, handed out a group at a time.
        let groups = KvGroups::new(&config.layer_windows(), opts.windowed_kv);
        let Some(pages) = opts.num_blocks.checked_mul(groups.len()).filter(|&p| p < u32::MAX as usize) else {
            return bad(format!(
                "{} KV blocks of {} layer groups exceed the block id range",
                opts.num_blocks,
                groups.len()
            ));
        };
        let layout = KvLayout {
            num_layers: groups.per_page(),
            num_blocks: pages,
            block_size: opts.block_size,
            num_kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            dtype: opts.kv_dtype_on(Device::Cpu),
        };
        // Pool plus staging (f32, same shape per token), checked before anything is allocated, so
        // an impossible size is an error naming the setting instead of an aborted process.
        let stage_token = (2 * config.num_layers * layout.token_elems() * 4) as u128;
        let needed = layout.bytes_per_token() as u128 * layout.num_slots() as u128
            + stage_token * opts.max_batch_tokens as u128;
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
        let ropes = model
            .ropes()
            .iter()
            .map(|r| RopeTable::new(r.dims, r.theta, r.scaling.as_ref(), positions))
            .collect();
        let threads = rayon::ThreadPoolBuilder::new()
            .num_threads(opts.threads)
            .thread_name(|i| format!("tandem-cpu-{i}"))
            .build()
            .map_err(|e| EngineError::Device {
                device: Device::Cpu,
                msg: format!("cannot start compute threads: {e}"),
            })?;
        if opts.activations == Activations::Q16 && q8::Isa8::best() == q8::Isa8::Portable {
            // The 16-bit kernels need AVX2 (AVX-512 VNNI at best); in portable code the exact
            // f32 kernels are faster.
            tracing::info!("this CPU has no AVX2 integer kernels: using --activations f32 instead of q16");
            opts.activations = Activations::F32;
        }
        let packed = match opts.activations {
            Activations::F32 => vec![None; store.mats.len()],
            a => threads.install(|| pack_weights(&store, a == Activations::Q16)),
        };
        // Whether prompt chunks and large batches of the packed matrices take the AMX tiles,
        // decided (timed on a thread of its own, and logged) once per process, here rather than
        // in a pass.
        #[cfg(target_arch = "x86_64")]
        if packed.iter().any(Option::is_some) {
            q8::amx::choice();
        }
        // One attention kernel for every row of this instance.
        let (attention, _) =
            attention::choose(layout.dtype, opts.attention_amx).map_err(EngineError::InvalidRequest)?;
        let scratch = vec![Vec::new(); model.scratch().len()];
        Ok(CpuBackend {
            attention,
            packed,
            xq: QuantizedRows::new(),
            gathered: Vec::new(),
            threads: std::sync::Arc::new(threads),
            ropes,
            positions,
            pool: if opts.kv_shared {
                CpuKvPool::try_new_shared(layout)?
            } else {
                CpuKvPool::try_new(layout)?
            },
            write_path: KvWritePath::with_groups(layout, groups.clone(), opts.max_batch_tokens),
            groups,
            config,
            model,
            store,
            adapters: (0..opts.max_adapters).map(|_| None).collect(),
            opts,
            scratch,
        })
    }

    /// The forward pass proper; runs on this instance's thread pool.
    fn forward_in_pool(&mut self, batch: &[SeqChunk<'_>]) -> Result<Vec<Vec<f32>>> {
        let n = self.validate(batch)?;
        if n == 0 {
            return Ok(Vec::new());
        }
        let (meta, segments) = PassMeta::new(batch, self.opts.block_size, &self.groups);
        // A pass is staged exactly when the caller marked a chunk staged; its direct chunks still
        // go straight to the pool.
        let mode = if batch.iter().any(|c| c.write == WriteMode::Staged) {
            WriteMode::Staged
        } else {
            WriteMode::Direct
        };
        for (buf, spec) in self.scratch.iter_mut().zip(self.model.scratch()) {
            let rows = match spec.rows {
                Rows::Tokens => n,
                Rows::Logits => meta.logit_rows.len(),
            };
            buf.clear();
            buf.resize(rows * spec.width, 0.0);
        }
        self.write_path.begin_pass(mode, &segments)?;
        let model = self.model.clone();
        let mut pass = CpuPass { be: self, meta: &meta };
        model.forward(&mut pass)?;
        self.write_path.end_pass()?;

        let vocab = self.config.vocab_size;
        let logits = &self.scratch[model.logits().0 as usize];
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
        crate::backend::check_slots(batch, |s| self.adapters.get(s).is_some_and(Option::is_some))?;
        crate::backend::validate_batch(
            batch,
            self.config.vocab_size,
            self.positions,
            &self.opts,
            self.groups.windows(),
        )
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

    fn kv_groups(&self) -> KvGroups {
        self.groups.clone()
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

    fn adapter_slots(&self) -> usize {
        self.adapters.len()
    }

    fn set_adapter(
        &mut self,
        slot: usize,
        adapter: Option<std::sync::Arc<crate::lora::LoraAdapter>>,
    ) -> Result<()> {
        let Some(entry) = self.adapters.get_mut(slot) else {
            return Err(EngineError::Internal(format!(
                "adapter slot {slot}: this backend has {} slots",
                self.adapters.len()
            )));
        };
        *entry = match adapter {
            Some(a) => {
                Some(lora::CpuAdapter::new(a, &self.config, self.opts.activations != Activations::F32)?)
            }
            None => None,
        };
        Ok(())
    }

    fn copy_block(&mut self, src: BlockId, dst: BlockId) -> Result<()> {
        Ok(self.pool.copy_block(src, dst)?)
    }

    fn read_block(&self, layer: usize, block: BlockId) -> Result<(Vec<u8>, Vec<u8>)> {
        // `layer` is a storage layer of the pool's pages, `block` a page (see `kv_groups`).
        let (k, v) = self.pool.try_block_bytes(layer, block)?;
        Ok((k.to_vec(), v.to_vec()))
    }

    fn read_block_into(&self, layer: usize, block: BlockId, k: &mut [u8], v: &mut [u8]) -> Result<()> {
        Ok(self.pool.read_block_into(layer, block, k, v)?)
    }

    fn read_block_summed(
        &self,
        layer: usize,
        block: BlockId,
        k: &mut [u8],
        v: &mut [u8],
        state: u32,
    ) -> Result<u32> {
        Ok(self.pool.read_block_summed(layer, block, k, v, state)?)
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
