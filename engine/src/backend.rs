//! The backend trait: one forward pass over a batch of sequence chunks against a paged KV pool
//! that the backend instance owns on its own device.
//!
//! A batch mixes prefill chunks (many tokens, `start_pos` = tokens already cached) and decode steps
//! (one token). The caller (the scheduler) owns block bookkeeping and passes every chunk's block
//! table explicitly; the backend only reads and writes the blocks it is told about. Every chunk
//! says how its new K/V are written ([`SeqChunk::write`]): the caller chooses, the backend never
//! infers it from token counts. A pass with at least one staged chunk is a *staged pass*: its
//! direct chunks reach the pool as usual, its staged chunks wait for [`Backend::commit_staged`] or
//! [`Backend::discard_staged`].

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::sampler::{RowSampling, Sampled};
use std::sync::Arc;

use crate::kv::groups::{self, KvGroups, NO_PAGE};
use crate::kv::{BlockId, KvDtype, KvLayout, WriteMode};
use crate::kv::{HostMemory, KvBlockSink, KvBlockSource, KvError, Page, SpillCopy};
use crate::Device;

/// Which logits a chunk wants back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsRequest {
    /// None (a non-final prefill chunk).
    None,
    /// Only for the chunk's last token (next-token sampling).
    Last,
    /// For every token of the chunk (scoring, speculative verification, parity tests).
    All,
}

/// One sequence's part of a forward pass.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    /// Tokens to run, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: &'a [u32],
    /// Tokens of this sequence already in the KV cache.
    pub start_pos: usize,
    /// Block table covering at least `start_pos + tokens.len()` positions: with layer groups
    /// ([`Backend::kv_groups`]), one page per group and token block, [`crate::kv::NO_PAGE`] where
    /// a window group gave its page back.
    pub block_table: &'a [BlockId],
    pub logits: LogitsRequest,
    /// How this chunk's new K/V are written: [`WriteMode::Direct`] for prefill and ordinary
    /// decode, [`WriteMode::Staged`] only for a speculative verification chunk.
    pub write: WriteMode,
    /// The adapter slot ([`Backend::set_adapter`]) whose LoRA deltas this chunk runs with;
    /// `None`: the base model.
    pub adapter: Option<u16>,
}

/// Options fixed when a backend instance is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendOptions {
    /// KV blocks in the pool.
    pub num_blocks: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Most tokens in one forward pass (sizes the staging buffer and scratch).
    pub max_batch_tokens: usize,
    /// CPU threads the backend computes with (0: one per core). Each CPU backend instance owns
    /// its own thread pool.
    pub threads: usize,
    /// Keep the KV pool in a shared-memory segment (in `/dev/shm`) that a prefill worker on the
    /// same host can write transferred blocks into (decode workers set it). Default false:
    /// private memory.
    pub kv_shared: bool,
    /// Element type of the matrix operands on a GPU (weights and the activations fed to them).
    /// The CPU backend computes in f32 whatever this says.
    pub dtype: ComputeDtype,
    /// Replay decode steps from captured CUDA graphs (one per batch-size bucket). GPU only.
    pub cuda_graphs: bool,
    /// GPU: passes holding a chunk of several tokens (prompts, speculative verification) run
    /// attention in tiles that share each K/V row among a tile's tokens and heads; false runs
    /// every pass with the per-(token, head) split-K kernel that decode steps use (for
    /// comparison). GPU only.
    pub tiled_attention: bool,
    /// GPU: passes in bf16 with a chunk of several tokens run their tiled attention on the
    /// tensor cores (bf16 products, f32 sums, flash-attention tiling); false keeps them on the
    /// CUDA-core tiled kernel (for comparison). f32 passes always use the CUDA cores. GPU only.
    pub tensor_core_attention: bool,
    /// GPU: bf16 passes of at most 8 tokens (decode steps) run their products in kernels of our
    /// own that fuse the norm before them and the residual add or gated activation after them;
    /// false runs every product in cuBLAS (for comparison). GPU only.
    pub decode_gemv: bool,
    /// GPU: in bf16 passes too large for the decode products, a mixture of experts runs each
    /// expert over the tokens routed to it only (grouped products on the tensor cores); false
    /// runs every expert over every token in cuBLAS (for comparison). GPU only.
    pub moe_routed: bool,
    /// GPU: sampled rows (temperature, top-k, top-p, min-p, penalties, constraints) are drawn
    /// on the device, and only the token and the log-probabilities asked for come back; false
    /// copies every sampled row's logits to the host sampler (for comparison). GPU only.
    pub device_sampling: bool,
    /// GPU: on sm_90 and later, kernels launch with programmatic stream serialization, so each
    /// launch overlaps the tail of the kernel before it (which it waits for before touching
    /// memory); false launches them one after another as usual (for comparison). GPU only.
    pub pdl: bool,
    /// How the CPU backend feeds activations to quantized weight matrices (every GGML type but
    /// Q5_1). CPU only.
    pub activations: Activations,
    /// Element type of the KV pool (`--kv-dtype`); `None`: the device's default
    /// ([`default_kv_dtype`]). Part of the compatibility record: workers that exchange blocks
    /// must agree on it.
    pub kv_dtype: Option<KvDtype>,
    /// CPU: whether attention's products take the AMX bf16 tiles (16-bit KV pools only; an f32
    /// pool never does). `None`: wherever the CPU and the kernel allow them
    /// ([`crate::cpu::attention::default_kernel`]); `Some(true)` where they do not is refused.
    pub attention_amx: Option<bool>,
    /// CPU: give back the KV of sliding-window layers that no later query reaches
    /// ([`crate::kv::groups`]): a model mixing window and global layers (Gemma 2 and 3) gets a
    /// pool of layer groups, and block tables of one page per group and token block. False:
    /// every layer keeps every position (one group), as a GPU pool always does.
    pub windowed_kv: bool,
    /// LoRA adapters that may be resident at once (`--max-loras`): the slots
    /// [`Backend::set_adapter`] fills. 0: the instance runs no adapter.
    pub max_adapters: usize,
}

impl BackendOptions {
    /// The KV dtype a backend on `device` uses with these options.
    pub fn kv_dtype_on(&self, device: Device) -> KvDtype {
        self.kv_dtype.unwrap_or_else(|| default_kv_dtype(device))
    }
}

/// The KV dtype a device uses when `--kv-dtype` is not given. CPU: f16 (half the memory and
/// transfer bytes of f32; `engine/tests/kv_dtype_parity.rs` holds it to f32's greedy tokens
/// within a stated logit tolerance). CUDA: bf16, half the bytes of f32 in a format its kernels
/// store without an f16 conversion's range limit (the GPU's exact mode is `--dtype f32
/// --kv-dtype f32`).
pub fn default_kv_dtype(device: Device) -> KvDtype {
    match device {
        Device::Cpu => KvDtype::F16,
        Device::Cuda(_) => KvDtype::Bf16,
    }
}

/// How the CPU backend feeds activations to its quantized weight matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activations {
    /// Quantized to 16 bits per block of 32 and multiplied with integer dot products
    /// ([`crate::cpu::q8`]): the default. Logits stay within a small stated tolerance of
    /// [`Activations::F32`], and greedy output agrees with it on the reference prompts (see
    /// `docs/benchmarks.md`).
    #[default]
    Q16,
    /// Quantized to 8 bits per block of 32 (what llama.cpp does): the fastest, and furthest from
    /// the reference (greedy output can part from it within a few tokens).
    Q8,
    /// f32 activations against exactly dequantized weights: what Hugging Face transformers
    /// computes, token for token. The reference-parity tests run on it.
    F32,
}

impl std::fmt::Display for Activations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Activations::Q16 => "q16",
            Activations::Q8 => "q8",
            Activations::F32 => "f32",
        })
    }
}

impl std::str::FromStr for Activations {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "q16" | "int16" => Ok(Activations::Q16),
            "q8" | "int8" => Ok(Activations::Q8),
            "f32" | "float32" => Ok(Activations::F32),
            _ => Err(format!("unknown activations mode {s:?} (expected q16, q8 or f32)")),
        }
    }
}

/// Element type of a GPU backend's matrix operands. Accumulation is always f32; the residual
/// stream, attention and the KV cache stay f32 either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ComputeDtype {
    /// bfloat16 weights and matrix inputs (tensor cores): the default.
    #[default]
    Bf16,
    /// f32 throughout: slower, and it matches the CPU backend token for token.
    F32,
}

impl std::fmt::Display for ComputeDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ComputeDtype::Bf16 => "bf16",
            ComputeDtype::F32 => "f32",
        })
    }
}

impl std::str::FromStr for ComputeDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Ok(ComputeDtype::Bf16),
            "f32" | "float32" => Ok(ComputeDtype::F32),
            _ => Err(format!("unknown compute dtype {s:?} (expected bf16 or f32)")),
        }
    }
}

impl Default for BackendOptions {
    fn default() -> Self {
        BackendOptions {
            num_blocks: 1024,
            block_size: 16,
            max_batch_tokens: 2048,
            threads: 0,
            kv_shared: false,
            dtype: ComputeDtype::Bf16,
            cuda_graphs: true,
            tiled_attention: true,
            tensor_core_attention: true,
            decode_gemv: true,
            device_sampling: true,
            moe_routed: true,
            pdl: true,
            activations: Activations::Q16,
            kv_dtype: None,
            attention_amx: None,
            windowed_kv: false,
            max_adapters: 8,
        }
    }
}

/// What [`Backend::forward_sampled`] gives one chunk.
#[derive(Debug, Clone, PartialEq)]
pub enum DevicePick {
    /// The device drew the token; `drew` says whether it used the row's uniform (the host
    /// sampler's stream then advances by one draw, [`crate::sampler::Sampler::device_drew`]).
    Sampled { sampled: Sampled, drew: bool },
    /// The chunk's logits rows (empty for a chunk asking for none), for the host to sample.
    Row(Vec<f32>),
}

/// A compute backend bound to one device, owning its weights, RoPE tables and KV pool.
pub trait Backend: Send {
    /// The device every buffer of this instance lives on.
    fn device(&self) -> Device;
    fn config(&self) -> &ModelConfig;
    /// Layout of the KV pool (part of the compatibility record between workers).
    fn kv_layout(&self) -> KvLayout;
    /// How the model's layers map onto the pool's pages ([`crate::kv::groups`]): block tables
    /// hold one page per group and token block. One group by default.
    fn kv_groups(&self) -> KvGroups {
        KvGroups::single(self.config().num_layers)
    }
    /// Most tokens one forward pass accepts.
    fn max_batch_tokens(&self) -> usize;
    /// Runs one forward pass. Returns, per chunk, its requested logits as `rows × vocab`
    /// (empty for [`LogitsRequest::None`]). The new K/V of chunks marked [`WriteMode::Staged`] stay
    /// in the staging buffer until [`Backend::commit_staged`] or [`Backend::discard_staged`]; a
    /// staged pass still pending refuses a new pass.
    fn forward(&mut self, batch: &[SeqChunk<'_>]) -> Result<Vec<Vec<f32>>>;
    /// Runs a pass like [`Backend::forward`] and returns, for each chunk asking for
    /// [`LogitsRequest::Last`], its greedy next token and that token's log-probability under the
    /// row's softmax (the sampler's greedy rule: ties to the lowest id, NaN as -inf) instead of
    /// the logits row; `None` for chunks asking for none. No chunk may ask for
    /// [`LogitsRequest::All`]. A GPU backend picks on the device and copies back 8 bytes per
    /// sequence instead of a vocabulary of logits; the default picks from [`Backend::forward`]'s
    /// rows with the sampler itself.
    fn forward_greedy(&mut self, batch: &[SeqChunk<'_>]) -> Result<Vec<Option<(u32, f32)>>> {
        if batch.iter().any(|c| c.logits == LogitsRequest::All) {
            return Err(EngineError::Internal("forward_greedy: a chunk asks for all-position logits".into()));
        }
        let rows = self.forward(batch)?;
        Ok(rows
            .into_iter()
            .map(|mut row| (!row.is_empty()).then(|| crate::sampler::greedy_pick(&mut row)))
            .collect())
    }
    /// Whether [`Backend::forward_sampled`] draws tokens on the device; when false it only
    /// returns the rows, and a caller gains nothing by it.
    fn samples_on_device(&self) -> bool {
        false
    }
    /// Runs a pass like [`Backend::forward`] and draws, where it can, each chunk's next token on
    /// the device as [`crate::sampler::Sampler`] would. Once the pass is enqueued it calls
    /// `rows` (while the device computes) for how to sample each chunk, in batch order: `None`
    /// brings that chunk's rows back instead, as do chunks the device cannot sample (a top-k or
    /// top-p prefix too large for it) and chunks asking for [`LogitsRequest::All`] (a
    /// verification, a prompt being scored), whose sampling is ignored. The default samples
    /// nothing: every chunk gets its rows.
    fn forward_sampled(
        &mut self,
        batch: &[SeqChunk<'_>],
        rows: &mut dyn FnMut() -> Vec<Option<RowSampling>>,
    ) -> Result<Vec<DevicePick>> {
        let _ = rows;
        Ok(self.forward(batch)?.into_iter().map(DevicePick::Row).collect())
    }
    /// Writes the accepted prefix (`accepted[i]` tokens of chunk `i` of the staged pass) of every
    /// layer into that layer's cache; the rest is dropped. Direct chunks of the pass are already in
    /// the pool: their entry must be their whole length.
    fn commit_staged(&mut self, accepted: &[usize]) -> Result<()>;
    /// Drops a staged pass; the pool is untouched.
    fn discard_staged(&mut self);
    /// Whether a staged pass waits for [`Backend::commit_staged`] or [`Backend::discard_staged`].
    /// The scheduler checks it is false after every step.
    fn staged_pending(&self) -> bool;
    /// How many adapters may be resident at once ([`Backend::set_adapter`]'s slots).
    fn adapter_slots(&self) -> usize {
        0
    }
    /// For a backend that launches kernels: how many passes it has encoded so far (eagerly or
    /// into a CUDA graph; a graph replay encodes nothing), and the kernel launches and library
    /// calls the last of them enqueued. `None` where the backend does not count them (the CPU).
    fn pass_launches(&self) -> Option<(u64, u64)> {
        None
    }
    /// Makes `adapter` resident in `slot` (replacing what was there), or empties the slot. A chunk
    /// naming an empty slot is refused. The default refuses: a backend without LoRA support.
    fn set_adapter(&mut self, slot: usize, adapter: Option<Arc<crate::lora::LoraAdapter>>) -> Result<()> {
        match adapter {
            None => Ok(()),
            Some(a) => Err(EngineError::Internal(format!(
                "this backend cannot run LoRA adapters (adapter {} for slot {slot})",
                a.name
            ))),
        }
    }
    /// Copies one block (all layers), for copy-on-write.
    fn copy_block(&mut self, src: BlockId, dst: BlockId) -> Result<()>;
    /// The K and V bytes of one block of one layer (transfers, KV-parity checks).
    fn read_block(&self, layer: usize, block: BlockId) -> Result<(Vec<u8>, Vec<u8>)>;
    /// Overwrites one block of one layer with bytes from [`Backend::read_block`] of a peer.
    fn write_block(&mut self, layer: usize, block: BlockId, k: &[u8], v: &[u8]) -> Result<()>;
    /// Copies the K and V bytes of one block of one layer into `k` and `v` (each
    /// [`KvLayout::block_bytes`] long). For a shared-memory transfer these are the destination
    /// pool's mapped blocks, so the bytes are copied once. The default goes through
    /// [`Backend::read_block`].
    fn read_block_into(&self, layer: usize, block: BlockId, k: &mut [u8], v: &mut [u8]) -> Result<()> {
        let (sk, sv) = self.read_block(layer, block)?;
        if sk.len() != k.len() || sv.len() != v.len() {
            return Err(EngineError::Internal(format!(
                "read_block_into: layer {layer} block {block}: buffers of {} and {} bytes for a block of {}",
                k.len(),
                v.len(),
                sk.len()
            )));
        }
        k.copy_from_slice(&sk);
        v.copy_from_slice(&sv);
        Ok(())
    }
    /// [`Backend::read_block_into`], returning `state` continued over the K bytes, then the V
    /// bytes ([`crate::kv::checksum`]). The CPU backend sums while it copies; the default sums
    /// the copy.
    fn read_block_summed(
        &self,
        layer: usize,
        block: BlockId,
        k: &mut [u8],
        v: &mut [u8],
        state: u32,
    ) -> Result<u32> {
        self.read_block_into(layer, block, k, v)?;
        Ok(crate::kv::checksum::update_kv(state, k, v))
    }
    /// Starts copying pool blocks out as KV-tier pages: `blocks[i]` (every storage layer's K,
    /// then V, as [`Backend::read_block_into`] gives them) into `pages[i]`, ordered before
    /// anything this backend later does to the pool (passes, block copies, `write_block`), so a
    /// block the caller then reuses is copied as it was. Returns what to wait for before the
    /// pages are read, or `None` when they are complete on return. The default copies now; a
    /// GPU backend queues the copies on its stream and returns its event.
    ///
    /// # Safety
    /// The pages' memory must stay allocated, and be neither read nor written, until the
    /// returned copy's `wait` has returned. (Moving a [`Page`] does not move its memory.)
    unsafe fn copy_pages_out(
        &self,
        blocks: &[BlockId],
        pages: &mut [Page],
    ) -> Result<Option<Box<dyn SpillCopy>>> {
        let n = self.kv_layout().block_bytes();
        for (&block, page) in blocks.iter().zip(pages.iter_mut()) {
            for (layer, kv) in page.chunks_exact_mut(2 * n).enumerate() {
                let (k, v) = kv.split_at_mut(n);
                self.read_block_into(layer, block, k, v)?;
            }
        }
        Ok(None)
    }
    /// Writes KV-tier pages (as [`Backend::copy_pages_out`] makes them) into `blocks`, complete
    /// on return. The default writes block by block.
    fn write_pages(&mut self, blocks: &[BlockId], pages: &[&[u8]]) -> Result<()> {
        let n = self.kv_layout().block_bytes();
        for (&block, page) in blocks.iter().zip(pages) {
            for (layer, kv) in page.chunks_exact(2 * n).enumerate() {
                let (k, v) = kv.split_at(n);
                self.write_block(layer, block, k, v)?;
            }
        }
        Ok(())
    }
    /// Host memory of `bytes` for the KV tiers' pages that copies to and from the pool need not
    /// stage (a GPU backend's page-locked memory); `None` when ordinary memory serves as well.
    fn host_memory(&self, bytes: usize) -> Option<Result<Box<dyn HostMemory>>> {
        let _ = bytes;
        None
    }
    /// A thread-safe view of the KV pool for a transfer receiver that writes reserved blocks
    /// while the engine runs (see [`KvBlockSink`]); `None` when the backend has none.
    fn kv_sink(&self) -> Option<Arc<dyn KvBlockSink>> {
        None
    }
    /// The KV pool on its GPU, for transports that copy blocks device to device (CUDA IPC,
    /// NCCL); `None` when the pool is in host memory.
    fn device_kv_pool(&self) -> Option<crate::kv::DeviceKvPool> {
        None
    }
}

/// A backend is a source of KV blocks for a transfer sender. Errors that are not about the pool
/// itself (a failed device copy) are reported as device errors of the pool.
impl KvBlockSource for dyn Backend + '_ {
    fn source_layout(&self) -> KvLayout {
        self.kv_layout()
    }
    /// A host pool's memory, through its sink (which shares it).
    fn host_region(&self) -> Option<(usize, usize)> {
        self.kv_sink().and_then(|s| s.host_region())
    }
    fn read_block_into(
        &self,
        layer: usize,
        block: BlockId,
        k: &mut [u8],
        v: &mut [u8],
    ) -> Result<(), KvError> {
        Backend::read_block_into(self, layer, block, k, v).map_err(|e| self.source_error(e))
    }
    fn read_block_summed(
        &self,
        layer: usize,
        block: BlockId,
        k: &mut [u8],
        v: &mut [u8],
        state: u32,
    ) -> Result<u32, KvError> {
        Backend::read_block_summed(self, layer, block, k, v, state).map_err(|e| self.source_error(e))
    }
}

impl dyn Backend + '_ {
    /// An engine error while reading blocks for a sender, as a pool error.
    fn source_error(&self, e: EngineError) -> KvError {
        match e {
            EngineError::Kv(e) => e,
            other => KvError::Device { device: self.device().to_string(), msg: other.to_string() },
        }
    }
}

/// Checks a batch against the model and the pool before a backend touches anything; returns the
/// number of tokens. Shared by every backend so they refuse the same inputs with the same words.
pub(crate) fn validate_batch(
    batch: &[SeqChunk<'_>],
    vocab_size: usize,
    positions: usize,
    opts: &BackendOptions,
    windows: &[Option<usize>],
) -> Result<usize> {
    let bad = |m: String| Err(EngineError::InvalidRequest(m));
    let bs = opts.block_size;
    let g = windows.len().max(1);
    let pages = opts.num_blocks * g;
    let mut total = 0usize;
    for (i, c) in batch.iter().enumerate() {
        if c.tokens.is_empty() {
            return bad(format!("chunk {i} has no tokens"));
        }
        if let Some(&t) = c.tokens.iter().find(|&&t| t as usize >= vocab_size) {
            return bad(format!("token id {t} is outside the vocabulary ({vocab_size})"));
        }
        let end = c.start_pos + c.tokens.len();
        if end > positions {
            return bad(format!(
                "chunk {i} reaches position {end}, beyond the supported context of {positions} tokens"
            ));
        }
        if c.block_table.len() / g * bs < end {
            return Err(EngineError::Internal(format!(
                "chunk {i}: block table of {} blocks ({g} per token block) cannot hold {end} positions",
                c.block_table.len()
            )));
        }
        if let Some(&b) = c.block_table.iter().find(|&&b| b != NO_PAGE && b as usize >= pages) {
            return Err(EngineError::Internal(format!("chunk {i}: block id {b} outside the pool")));
        }
        // Every page a query of the chunk reads (and every one it writes) must be there.
        let reached = |j: usize| groups::kept(windows.get(j % g).copied().flatten(), j / g, c.start_pos, bs);
        if let Some(j) = (0..end.div_ceil(bs) * g).find(|&j| c.block_table[j] == NO_PAGE && reached(j)) {
            return Err(EngineError::Internal(format!(
                "chunk {i}: token block {} of layer group {} was given back, but a query from position {} reads it",
                j / g,
                j % g,
                c.start_pos
            )));
        }
        total += c.tokens.len();
    }
    if total > opts.max_batch_tokens {
        return bad(format!("batch of {total} tokens exceeds max batch tokens {}", opts.max_batch_tokens));
    }
    Ok(total)
}

/// Refuses a batch whose chunks name an adapter slot that `resident` says is empty (shared by
/// the backends, so they refuse with the same words).
pub(crate) fn check_slots(batch: &[SeqChunk<'_>], resident: impl Fn(usize) -> bool) -> Result<()> {
    for (i, c) in batch.iter().enumerate() {
        if let Some(s) = c.adapter {
            if !resident(s as usize) {
                return Err(EngineError::Internal(format!(
                    "chunk {i} runs adapter slot {s}, which is empty"
                )));
            }
        }
    }
    Ok(())
}

/// The token rows of a pass per adapter slot, slots in increasing order, rows in pass order
/// (empty when no chunk runs an adapter).
pub(crate) fn rows_by_slot(batch: &[SeqChunk<'_>]) -> Vec<(u16, Vec<usize>)> {
    let mut out: Vec<(u16, Vec<usize>)> = Vec::new();
    let mut row = 0;
    for c in batch {
        if let Some(s) = c.adapter {
            let at = match out.binary_search_by_key(&s, |e| e.0) {
                Ok(i) => i,
                Err(i) => {
                    out.insert(i, (s, Vec::new()));
                    i
                }
            };
            out[at].1.extend(row..row + c.tokens.len());
        }
        row += c.tokens.len();
    }
    out
}
