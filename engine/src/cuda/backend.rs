//! [`CudaBackend`]: the forward pass on one GPU.
//!
//! The backend implements the [`Ops`] a model family's pass is written in (`engine/src/models`):
//! each operation is one or two kernel launches or cuBLAS GEMMs over the family's scratch buffers,
//! which live on the device for the largest pass. So a pass is a fixed sequence of launches whose per-token inputs
//! (token ids, positions, pool slots, block tables, logit rows) live in one device metadata buffer
//! at fixed offsets. The host rewrites that buffer before each pass, so a decode step captured as a
//! CUDA graph (one per batch-size bucket, padded tokens write nowhere) replays correctly.
//!
//! LoRA adapters live in numbered slots ([`Backend::set_adapter`]): their A and Bᵀ matrices (f32)
//! in device memory of their own, and per (slot, target) the matrices' addresses, rank and scale
//! in a device table at a fixed address. Each token's slot is a metadata region, so the two LoRA
//! kernels of a projection serve every adapter of a pass, and decode graphs captured with them
//! replay correctly whatever the slots hold by then (see [`PassLora`]).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaContext, CudaFunction, CudaGraph, CudaModule, CudaStream, LaunchConfig};
use rayon::prelude::*;

use super::mem::DevBuf;
use super::sink::{CudaKvSink, KvPoolAccess};
use super::{check_device, check_libraries, describe, driver_error, dtype_bytes, DeviceInfo};
use crate::backend::{
    validate_batch, Backend, BackendOptions, ComputeDtype, DevicePick, LogitsRequest, SeqChunk,
};
use crate::config::ModelConfig;
use crate::cpu::ops::RopeTable;
use crate::error::{EngineError, Result};
use crate::kv::{BlockId, KvDtype, KvError, KvLayout, WriteMode};
use crate::lora::{LoraAdapter, LoraTarget, Proj};
use crate::models::{
    attn_inputs_unfused, gated_ffn_unfused, Activation, AttnInputs, AttnSpec, Buf, BufKind, BufSpec,
    GatedFfn, MatId, Model, ModelWeights, MoeSpec, Ops, RopeId, Rows, VecId, WeightStore,
};
use crate::sampler::{RowSampling, Sampled};
use crate::weights::Matrix;
use crate::Device;

/// Launches a kernel function of the instance's module (`$f`: a `&CudaFunction`, chosen at run
/// time where a kernel comes in variants) with raw arguments: device addresses as `u64`, integers
/// and floats by value, in the kernel's parameter order. `$what` names it in errors. A grid with
/// no blocks (an operation on the logits rows of a pass that returns none) launches nothing: the
/// driver would refuse it. See [`launch_raw`] for how.
macro_rules! launch_fn {
    ($be:expr, $f:expr, $what:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        let cfg: LaunchConfig = $cfg;
        if cfg.grid_dim.0 == 0 || cfg.grid_dim.1 == 0 || cfg.grid_dim.2 == 0 {
            Ok(())
        } else {
            $be.launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            // Each argument in an 8-byte slot on the stack, whose address the launch passes.
            let mut slots = [0u64; MAX_KERNEL_ARGS];
            let mut count = 0usize;
            $( slots[count] = arg_slot($arg); count += 1; )*
            let mut params = [std::ptr::null_mut::<c_void>(); MAX_KERNEL_ARGS];
            for (p, s) in params.iter_mut().zip(slots.iter_mut()).take(count) {
                *p = (s as *mut u64).cast();
            }
            // SAFETY: the argument list matches the kernel's signature in kernels/cuda/model.cu
            // (pointers are live allocations of this instance sized for the pass); the launch is
            // on this instance's stream with its context current; `slots` outlives the call.
            unsafe { launch_raw(&$be, $f, cfg, &mut params[..count]) }
                .map_err(|e| driver_error($be.ordinal, $what, e))
        }
    }};
    ($be:expr, $f:expr, $cfg:expr; $($arg:expr),* $(,)?) => {
        launch_fn!($be, $f, "launching a kernel", $cfg; $($arg),*)
    };
}

/// Most arguments a kernel of model.cu takes (attention's take 24).
const MAX_KERNEL_ARGS: usize = 32;

/// A kernel argument as the launch passes it: a plain value of at most 8 bytes (a device
/// address, an integer, a float) in the first bytes of an 8-byte slot.
fn arg_slot<T: Copy + 'static>(v: T) -> u64 {
    const { assert!(std::mem::size_of::<T>() <= 8 && std::mem::align_of::<T>() <= 8) };
    let mut slot = 0u64;
    // SAFETY: `T` fits in the slot with its alignment (checked at compile time) and is plain
    // data (`Copy`), so writing it over the slot's first bytes is sound.
    unsafe { std::ptr::write((&mut slot as *mut u64).cast::<T>(), v) };
    slot
}

/// Launches `f` on the instance's stream with `params` (one pointer per kernel argument), through
/// `cuLaunchKernelEx`: with programmatic stream serialization where the instance uses
/// programmatic dependent launch ([`CudaBackend::pdl`]: sm_90 and later, not turned off), so the
/// launch overlaps the tail of the kernel before it, which every model kernel waits for before
/// touching memory (`grid_dep_wait` in model.cu); otherwise an ordinary launch.
///
/// # Safety
/// `params` must match the kernel's parameters, and point at live values.
unsafe fn launch_raw(
    be: &CudaBackend,
    f: &CudaFunction,
    cfg: LaunchConfig,
    params: &mut [*mut c_void],
) -> std::result::Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys;
    // SAFETY: an all-zero launch attribute is a valid value of the C struct (plain data).
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: be.stream.cu_stream(),
        attrs: if be.pdl { &mut attr } else { std::ptr::null_mut() },
        numAttrs: u32::from(be.pdl),
    };
    // SAFETY: the caller vouches for `params`; the config and the attribute outlive the call.
    unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
        .result()
}

/// Launches the kernel `$func` of the instance's [`Kernels`] (see [`launch_fn!`]).
macro_rules! launch {
    ($self:expr, $func:ident, $cfg:expr; $($arg:expr),* $(,)?) => {
        launch_fn!($self, &$self.k.$func, concat!("launching ", stringify!($func)), $cfg; $($arg),*)
    };
}

/// Largest head dimension the attention kernel holds in registers (`MAX_HD_REGS * 32`).
const MAX_HEAD_DIM: usize = 256;
/// Most slices one (token, head) of attention is split into.
const MAX_SPLITS: usize = 32;
/// Threads per attention block (4 warps).
const ATTN_THREADS: u32 = 128;
/// Decode batch sizes that get a CUDA graph; a step of `n` sequences replays the smallest bucket
/// that holds it.
const GRAPH_BUCKETS: &[usize] = &[1, 2, 4, 8, 16, 32, 64, 128, 256];
/// cuBLAS workspace, set explicitly so that GEMMs inside graph capture never allocate.
const CUBLAS_WORKSPACE: usize = 32 << 20;
/// Device sampling's results per row (`SAMPLE_OUT_I` i32s and `SAMPLE_OUT_F` f32s in model.cu),
/// and the most alternatives it reports (`SAMPLE_MAX_TOP`).
const SAMPLE_MAX_TOP: usize = 20;
const SAMPLE_OUT_I: usize = 4 + SAMPLE_MAX_TOP;
const SAMPLE_OUT_F: usize = 1 + SAMPLE_MAX_TOP;
/// Metadata regions (i32 each, `cap_tokens` long) before the block tables.
const META_REGIONS: usize = 10;

/// Rows (token, query head) of one tiled-attention block, and its threads (`AT_ROWS` and
/// `AT_THREADS` in model.cu); the largest head dimension it takes (`AT_MAX_HD`).
const TILE_ROWS: usize = 16;
const TILE_THREADS: u32 = 256;
const TILE_MAX_HEAD_DIM: usize = 256;
/// Tensor-core attention (`attn_mma_*` in model.cu): rows (token, query head) of one block
/// (`AM_ROWS`), its threads (`AM_THREADS`), and the head dimensions its variants are compiled
/// for (a model's heads take the smallest that holds them, zero-padded).
const MMA_ROWS: usize = 64;
const MMA_THREADS: u32 = 128;
const MMA_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Decode products of our own (`gemv_*` in model.cu): most tokens a pass may have
/// (`GV_MAX_N`) and threads per block (`GV_THREADS`, one output row per warp at a time). The
/// tokens' inputs sit in dynamic shared memory (bf16, `n × cols × 2` bytes), as much as the
/// device lets a block opt in to beside the kernel's static shared memory
/// ([`Kernels::gemv_shared`]).
const GEMV_MAX_N: usize = 8;
const GEMV_THREADS: u32 = 256;

/// The decode products' kernels (bf16 passes only): input as a matrix input or normalized from
/// the residual stream, output stored, added into the residual stream, or through a gated
/// activation.
struct GemvKernels {
    mat: CudaFunction,
    mat_add: CudaFunction,
    norm: CudaFunction,
    mat_silu: CudaFunction,
    mat_gelu: CudaFunction,
    norm_silu: CudaFunction,
    norm_gelu: CudaFunction,
}

/// A decode step's mixture of experts over the experts its tokens are routed to
/// (`moe_gemv_*`, `moe_combine` in model.cu; bf16 passes only).
struct MoeKernels {
    silu: CudaFunction,
    gelu: CudaFunction,
    down: CudaFunction,
    combine: CudaFunction,
}

/// Per mixture (by its router matrix): the device addresses of its experts' gate, up and down
/// matrices, `3 × experts` u64s in that order, for the decode-step mixture kernels.
struct MoeTable {
    buf: DevBuf,
    experts: usize,
}

impl MoeTable {
    /// The addresses of the gate, up and down tables (one device address per expert each).
    fn tables(&self) -> (CUdeviceptr, CUdeviceptr, CUdeviceptr) {
        let (tab, step) = (self.buf.ptr(), 8 * self.experts as u64);
        (tab, tab + step, tab + 2 * step)
    }
}

/// An RMSNorm whose launch waits for the next operation: a decode product reading `out` takes
/// it as its prologue; anything else launches it first.
#[derive(Clone, Copy, Debug)]
struct PendingNorm {
    x: Buf,
    w: VecId,
    eps: f32,
    out: Buf,
}

/// A decode product (one matrix into an f32 buffer) whose launch waits for the next operation: a
/// residual add of `y` takes it as its epilogue; anything else launches it first.
struct PendingLinear {
    x: Buf,
    m: DevMatrix,
    y: Buf,
}

/// A decode product's input: a matrix-input buffer, or the residual stream through a pending
/// norm.
enum GemvIn {
    Mat(Buf),
    Norm(PendingNorm),
}

/// A decode product's output: stored (f32), stored and added into the residual stream, or the
/// gated activation of a fused gate/up product (the matrix input of the down projection).
enum GemvOut {
    Store(CUdeviceptr),
    AddInto { y: Buf, res: Buf },
    Gated { act: Activation, out: Buf },
}

/// The kernel that runs attention for passes holding a chunk of several tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TileKernel {
    /// `attn_tiled_*`: f32 products on the CUDA cores, 16 rows per block.
    CudaCores,
    /// `attn_mma_*`: bf16 products on the tensor cores, 64 rows per block (bf16 passes).
    TensorCores,
}

/// How a pass with prompt chunks cuts its attention into blocks: `heads` query heads sharing one
/// KV head times `tokens` consecutive tokens of one chunk (a tile) make a block's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Tiling {
    kernel: TileKernel,
    heads: usize,
    tokens: usize,
}

/// The tiling of passes with prompt chunks for a model and options; `None` where neither tiled
/// kernel applies (turned off, or heads wider than they take), so every pass runs split-K.
/// Passes in bf16 take the tensor cores unless `tensor_core_attention` is off; f32 passes keep
/// the CUDA-core kernel, whose f32 products match the CPU backend.
fn tiling(c: &ModelConfig, opts: &BackendOptions) -> Option<Tiling> {
    if !opts.tiled_attention || c.head_dim > TILE_MAX_HEAD_DIM || c.num_kv_heads == 0 {
        return None;
    }
    let (kernel, rows) = if opts.tensor_core_attention && opts.dtype == ComputeDtype::Bf16 {
        (TileKernel::TensorCores, MMA_ROWS)
    } else {
        (TileKernel::CudaCores, TILE_ROWS)
    };
    let per_kv = c.num_heads / c.num_kv_heads;
    let heads = (1..=per_kv.min(rows)).rev().find(|g| per_kv.is_multiple_of(*g))?;
    Some(Tiling { kernel, heads, tokens: rows / heads })
}

/// The tensor-core attention variant for heads of `head_dim`: the smallest that holds them.
fn mma_head_dim(head_dim: usize) -> Option<usize> {
    MMA_HEAD_DIMS.into_iter().find(|&d| head_dim <= d)
}
/// Most experts per token the routing kernel keeps (`MOE_MAX_TOPK` in model.cu).
const MOE_MAX_TOPK: usize = 32;
/// LoRA kernels (model.cu): consecutive tokens per block (`LORA_TILE`), ranks per shrink block
/// (`LORA_RANKS`, one per warp), projections per launch (`LORA_MAX_OUTS`), bytes of a table entry
/// (`LoraEntry`: A's address, Bᵀ's address, rank as i32, scale as f32).
const LORA_TILE: usize = 8;
const LORA_RANKS: usize = 8;
const LORA_MAX_OUTS: usize = 3;
const LORA_ENTRY_BYTES: usize = 24;
/// Smallest row stride (floats) of the LoRA intermediate; it grows to hold the largest rank.
const LORA_MIN_STRIDE: usize = 16;

/// The functions of the `model` kernel module.
/// Kernels that write a buffer come twice: `_f32` for an f32 buffer, `_mat` for a matrix input
/// (the compute dtype; the same function as `_f32` when computing in f32). Kernels that read or
/// write the KV pool are the variants of the pool's dtype.
struct Kernels {
    embed: CudaFunction,
    gather_rows: CudaFunction,
    rms_norm_f32: CudaFunction,
    rms_norm_mat: CudaFunction,
    add_rms_norm_f32: CudaFunction,
    add_rms_norm_mat: CudaFunction,
    head_rms_norm: CudaFunction,
    add_bias: CudaFunction,
    add_inplace: CudaFunction,
    silu_mul_f32: CudaFunction,
    silu_mul_mat: CudaFunction,
    gelu_tanh_mul_f32: CudaFunction,
    gelu_tanh_mul_mat: CudaFunction,
    silu_mul_fused_f32: CudaFunction,
    silu_mul_fused_mat: CudaFunction,
    gelu_tanh_mul_fused_f32: CudaFunction,
    gelu_tanh_mul_fused_mat: CudaFunction,
    /// `qkv_split` with the KV write into a pool of the instance's dtype.
    qkv_split: CudaFunction,
    softcap: CudaFunction,
    rope: CudaFunction,
    kv_write: CudaFunction,
    kv_commit: CudaFunction,
    attn_partial: CudaFunction,
    attn_tiled_f32: CudaFunction,
    attn_tiled_mat: CudaFunction,
    /// Tensor-core attention for the model's head dimension (bf16 passes only).
    attn_mma: Option<CudaFunction>,
    /// Decode products of our own (bf16 passes only).
    gemv: Option<GemvKernels>,
    moe_gemv: Option<MoeKernels>,
    /// Dynamic shared memory every decode-product and decode-mixture kernel may take: the
    /// device's opt-in limit per block less the most static shared memory among them (each
    /// kernel is opted in to it at load); 0 without them.
    gemv_shared: usize,
    greedy_rows: CudaFunction,
    sample_rows: CudaFunction,
    moe_route: CudaFunction,
    moe_accumulate: CudaFunction,
    moe_sort: CudaFunction,
    moe_gemm_silu: CudaFunction,
    moe_gemm_gelu: CudaFunction,
    moe_gemm_down: CudaFunction,
    moe_gather: CudaFunction,
    lora_shrink_f32: CudaFunction,
    lora_shrink_mat: CudaFunction,
    lora_expand: CudaFunction,
}

impl Kernels {
    fn load(
        module: &Arc<CudaModule>,
        dtype: ComputeDtype,
        kv: KvDtype,
        head_dim: usize,
        shared_optin: usize,
        ordinal: usize,
    ) -> Result<Kernels> {
        let sfx = match dtype {
            ComputeDtype::Bf16 => "bf16",
            ComputeDtype::F32 => "f32",
        };
        let kv = kv_kernel_suffix(kv).ok_or_else(|| {
            EngineError::Internal(format!("no CUDA kernels for a {kv} KV pool (refused at start-up)"))
        })?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| driver_error(ordinal, &format!("loading kernel {name}"), e))
        };
        let mut k = Kernels {
            embed: f(&format!("embed_{sfx}"))?,
            gather_rows: f("gather_rows")?,
            rms_norm_f32: f("rms_norm_f32")?,
            rms_norm_mat: f(&format!("rms_norm_{sfx}"))?,
            add_rms_norm_f32: f("add_rms_norm_f32")?,
            add_rms_norm_mat: f(&format!("add_rms_norm_{sfx}"))?,
            head_rms_norm: f("head_rms_norm")?,
            add_bias: f("add_bias")?,
            add_inplace: f("add_inplace")?,
            silu_mul_f32: f("silu_mul_f32")?,
            silu_mul_mat: f(&format!("silu_mul_{sfx}"))?,
            gelu_tanh_mul_f32: f("gelu_tanh_mul_f32")?,
            gelu_tanh_mul_mat: f(&format!("gelu_tanh_mul_{sfx}"))?,
            silu_mul_fused_f32: f("silu_mul_fused_f32")?,
            silu_mul_fused_mat: f(&format!("silu_mul_fused_{sfx}"))?,
            gelu_tanh_mul_fused_f32: f("gelu_tanh_mul_fused_f32")?,
            gelu_tanh_mul_fused_mat: f(&format!("gelu_tanh_mul_fused_{sfx}"))?,
            qkv_split: f(&format!("qkv_split_{kv}"))?,
            softcap: f("softcap")?,
            rope: f("rope")?,
            kv_write: f(&format!("kv_write_{kv}"))?,
            kv_commit: f(&format!("kv_commit_{kv}"))?,
            attn_partial: f(&format!("attn_partial_{kv}"))?,
            attn_tiled_f32: f(&format!("attn_tiled_f32_kv{kv}"))?,
            attn_tiled_mat: f(&format!("attn_tiled_{sfx}_kv{kv}"))?,
            attn_mma: match (dtype, mma_head_dim(head_dim)) {
                (ComputeDtype::Bf16, Some(hd)) => Some(f(&format!("attn_mma_hd{hd}_kv{kv}"))?),
                _ => None,
            },
            gemv: match dtype {
                ComputeDtype::Bf16 => Some(GemvKernels {
                    mat: f("gemv_mat")?,
                    mat_add: f("gemv_mat_add")?,
                    norm: f("gemv_norm")?,
                    mat_silu: f("gemv_mat_silu")?,
                    mat_gelu: f("gemv_mat_gelu")?,
                    norm_silu: f("gemv_norm_silu")?,
                    norm_gelu: f("gemv_norm_gelu")?,
                }),
                ComputeDtype::F32 => None,
            },
            moe_gemv: match dtype {
                ComputeDtype::Bf16 => Some(MoeKernels {
                    silu: f("moe_gemv_silu")?,
                    gelu: f("moe_gemv_gelu")?,
                    down: f("moe_gemv_down")?,
                    combine: f("moe_combine")?,
                }),
                ComputeDtype::F32 => None,
            },
            greedy_rows: f("greedy_rows")?,
            sample_rows: f("sample_rows")?,
            moe_route: f("moe_route")?,
            moe_accumulate: f("moe_accumulate")?,
            moe_sort: f("moe_sort")?,
            moe_gemm_silu: f("moe_gemm_silu")?,
            moe_gemm_gelu: f("moe_gemm_gelu")?,
            moe_gemm_down: f("moe_gemm_down")?,
            moe_gather: f("moe_gather")?,
            lora_shrink_f32: f("lora_shrink_f32")?,
            lora_shrink_mat: f(&format!("lora_shrink_{sfx}"))?,
            lora_expand: f("lora_expand")?,
            gemv_shared: 0,
        };
        k.gemv_shared = k.opt_in_gemv_shared(shared_optin, ordinal)?;
        Ok(k)
    }

    /// Opts every decode-product and decode-mixture kernel in to the dynamic shared memory they
    /// may all take (the device's opt-in limit less the largest static shared memory among them)
    /// and returns it; 0 when there are none.
    fn opt_in_gemv_shared(&self, shared_optin: usize, ordinal: usize) -> Result<usize> {
        use cudarc::driver::sys::CUfunction_attribute_enum as A;
        let mut fs: Vec<&CudaFunction> = Vec::new();
        if let Some(g) = &self.gemv {
            fs.extend([&g.mat, &g.mat_add, &g.norm, &g.mat_silu, &g.mat_gelu, &g.norm_silu, &g.norm_gelu]);
        }
        if let Some(m) = &self.moe_gemv {
            fs.extend([&m.silu, &m.gelu, &m.down]);
        }
        if fs.is_empty() {
            return Ok(0);
        }
        let err = |e| driver_error(ordinal, "sizing the decode products' shared memory", e);
        let mut most_static = 0usize;
        for f in &fs {
            most_static = most_static.max(f.shared_size_bytes().map_err(err)?.max(0) as usize);
        }
        let dynamic = shared_optin.saturating_sub(most_static);
        for f in &fs {
            f.set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic as i32)
                .map_err(err)?;
        }
        Ok(dynamic)
    }
}

/// The suffix of the kernels for a pool of `kv` (`None`: the kernels do not store that dtype).
fn kv_kernel_suffix(kv: KvDtype) -> Option<&'static str> {
    match kv {
        KvDtype::F32 => Some("f32"),
        KvDtype::Bf16 => Some("bf16"),
        KvDtype::Fp8 => Some("fp8"),
        KvDtype::F16 => None,
    }
}

/// A weight matrix on the device, row-major `rows × cols` in the compute dtype, at `offset`
/// bytes into its allocation (the matrices of a fused group share one).
#[derive(Clone)]
struct DevMatrix {
    buf: Arc<DevBuf>,
    offset: usize,
    rows: usize,
    cols: usize,
}

impl DevMatrix {
    fn ptr(&self) -> CUdeviceptr {
        self.buf.at(self.offset)
    }
}

/// The weights on the device, indexed like the [`WeightStore`] they came from.
struct DevWeights {
    /// Matrices in the compute dtype; a tied head shares its embedding table's entry.
    mats: Vec<DevMatrix>,
    /// Vectors (norm weights, biases), f32.
    vecs: Vec<DevBuf>,
    /// The model's fused groups ([`Model::fused_groups`]) whose matrices were stored one after
    /// another, by their first member: the group's members, and the whole group as one matrix.
    fused: HashMap<MatId, (Vec<MatId>, DevMatrix)>,
}

impl DevWeights {
    /// The group `members` as one matrix, when they were stored as one.
    fn fused(&self, members: &[MatId]) -> Option<&DevMatrix> {
        let (m, d) = self.fused.get(members.first()?)?;
        (m.as_slice() == members).then_some(d)
    }
}

/// One of the model's scratch buffers, sized for the largest pass. A logits-rows buffer holds
/// `small_logit_rows` rows (graphs write there) and grows a second allocation for passes that
/// return more rows (all-position scoring).
struct DevScratch {
    spec: BufSpec,
    buf: DevBuf,
    big: Option<DevBuf>,
}

/// Activation buffers sized for the largest pass.
struct Workspace {
    /// The model's scratch buffers, indexed by [`Buf`].
    scratch: Vec<DevScratch>,
    partial: DevBuf,
    partial_floats: usize,
    /// Per (token, head), the split-K slices of attention that have finished in this pass (i32,
    /// zero between passes: the last slice merges and resets it).
    attn_done: DevBuf,
    /// Rows a logits-rows buffer holds in its fixed allocation (what graphs write).
    small_logit_rows: usize,
    /// Per-pass metadata, `META_REGIONS * cap_tokens + cap_tables` i32s.
    meta: DevBuf,
    cap_tables: usize,
    /// Rows and slots of a staged commit.
    commit_meta: DevBuf,
    /// Greedy picks: tokens (i32) then log-probabilities (f32), one per logits row.
    picks: DevBuf,
    cublas: DevBuf,
    /// A fused group's product before it is split: `max_batch_tokens × fused_rows` f32s.
    fused: DevBuf,
    fused_rows: usize,
    /// A decode step's mixture: each expert's gated activations (bf16, `experts × GEMV_MAX_N ×
    /// ff`) and outputs (f32, `experts × GEMV_MAX_N × hidden`).
    moe_acts: DevBuf,
    moe_ye: DevBuf,
    /// Larger passes' mixtures over routed tokens ([`MoeRoutedSize`]); `None` without them.
    moe_routed: Option<(DevBuf, MoeRoutedSize)>,
}

/// Rows of one tile of a mixture over routed tokens, and output columns of one block (`MR_ROWS`,
/// `MR_COLS` and `MR_THREADS` in model.cu).
const MR_ROWS: usize = 64;
const MR_COLS: usize = 64;
const MR_THREADS: u32 = 128;

/// What a pass of up to `tokens` tokens needs for a mixture of `experts` over routed tokens
/// (`moe_sort`, `moe_gemm_*`, `moe_gather` in model.cu), laid out in one buffer: per expert a
/// count, per (token, expert) a row, per row its token, per tile its expert, the tiles in use,
/// per token its experts (i32 each), then every row's activations (bf16, `ff` each) and outputs
/// (f32, `hidden` each).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct MoeRoutedSize {
    tokens: usize,
    experts: usize,
    top_k: usize,
    /// The most tiles a pass's routed pairs fill: each expert's count padded up to whole tiles.
    tiles: usize,
    hidden: usize,
    ff: usize,
}

impl MoeRoutedSize {
    fn new(tokens: usize, experts: usize, top_k: usize, hidden: usize, ff: usize) -> MoeRoutedSize {
        let tiles = (tokens * top_k).div_ceil(MR_ROWS) + experts;
        MoeRoutedSize { tokens, experts, top_k, tiles, hidden, ff }
    }

    /// Room for every one of `sizes` (each field the largest).
    fn largest(sizes: &[MoeRoutedSize]) -> MoeRoutedSize {
        sizes.iter().fold(MoeRoutedSize::default(), |a, b| MoeRoutedSize {
            tokens: a.tokens.max(b.tokens),
            experts: a.experts.max(b.experts),
            top_k: a.top_k.max(b.top_k),
            tiles: a.tiles.max(b.tiles),
            hidden: a.hidden.max(b.hidden),
            ff: a.ff.max(b.ff),
        })
    }

    fn rows(&self) -> usize {
        self.tiles * MR_ROWS
    }

    /// Byte offsets of counts, slot_of, sorted_tok, tile_expert, n_tiles, tok_exp, acts and ye,
    /// and the total (each region 16-byte aligned).
    fn offsets(&self) -> [usize; 9] {
        let up = |x: usize| x.next_multiple_of(16);
        let counts = 0;
        let slot_of = up(counts + 4 * self.experts);
        let sorted_tok = up(slot_of + 4 * self.tokens * self.experts);
        let tile_expert = up(sorted_tok + 4 * self.rows());
        let n_tiles = up(tile_expert + 4 * self.tiles);
        let tok_exp = up(n_tiles + 4);
        let acts = up(tok_exp + 4 * self.tokens * self.top_k);
        let ye = up(acts + 2 * self.rows() * self.ff);
        let end = up(ye + 4 * self.rows() * self.hidden);
        [counts, slot_of, sorted_tok, tile_expert, n_tiles, tok_exp, acts, ye, end]
    }

    fn bytes(&self) -> usize {
        if self.experts == 0 {
            0
        } else {
            self.offsets()[8]
        }
    }

    /// Whether a mixture of `experts` (top `top_k`) over `n` tokens, hidden `hidden`, ff `ff`
    /// fits.
    fn holds(&self, n: usize, experts: usize, top_k: usize, hidden: usize, ff: usize) -> bool {
        let need = MoeRoutedSize::new(n, experts, top_k, hidden, ff);
        n <= self.tokens
            && experts <= self.experts
            && need.tiles <= self.tiles
            && hidden <= self.hidden
            && ff <= self.ff
            && top_k <= self.top_k
            && need.offsets()[8] <= self.bytes()
    }
}

/// This instance's cuBLAS handle, bound to its stream. Destroyed without panicking (cudarc's own
/// wrapper unwraps the destroy call, which fails after a sticky device error).
struct Blas(cudarc::cublas::sys::cublasHandle_t);

impl Blas {
    fn new(stream: &Arc<CudaStream>) -> std::result::Result<Blas, cudarc::cublas::result::CublasError> {
        let handle = cudarc::cublas::result::create_handle()?;
        let blas = Blas(handle);
        // SAFETY: a live handle and this instance's live stream.
        unsafe { cudarc::cublas::result::set_stream(handle, stream.cu_stream() as _) }?;
        Ok(blas)
    }
}

// SAFETY: the handle is used only by the backend that owns it, from one thread at a time, with
// the backend's context bound.
unsafe impl Send for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle is live and destroyed only here.
        let status = unsafe { cudarc::cublas::sys::cublasDestroy_v2(self.0) };
        if status != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            tracing::warn!(?status, "destroying the cuBLAS handle failed");
        }
    }
}

/// A captured decode step; the graph is only ever launched from the thread holding `&mut` the
/// backend, after binding its context.
struct Graph(CudaGraph);
// SAFETY: the graph handles are plain driver objects; the backend uses them from one thread at a
// time (it is `Send`, not `Sync`) and binds its context before every launch.
unsafe impl Send for Graph {}

/// A staged pass waiting for `commit_staged` or `discard_staged`: per chunk, its rows in the
/// staging buffer and the pool slots they belong in.
struct StagedPass {
    /// Per chunk: first row, slots, and whether it was written direct (then it is in the pool
    /// already and must be accepted whole).
    segments: Vec<(usize, Vec<i32>, bool)>,
}

/// A LoRA adapter resident in a slot: each delta's A (`rank × in`) and Bᵀ (`rank × out`, so the
/// expand kernel reads it coalesced), f32, in one allocation.
struct DevAdapter {
    adapter: Arc<LoraAdapter>,
    buf: DevBuf,
}

/// The instance's LoRA slots (none when `max_adapters` is 0).
struct LoraSlots {
    slots: Vec<Option<DevAdapter>>,
    /// `[slot][layer * 7 + projection]` entries of `LoraEntry` (model.cu), rank 0 where the slot's
    /// adapter has no delta. Allocated once: graphs captured earlier read it at replay, so
    /// [`Backend::set_adapter`] rewrites entries and never moves it.
    table: DevBuf,
    /// The rank-wide intermediate, `[LORA_MAX_OUTS][tokens][stride]` f32.
    mid: DevBuf,
    /// Row stride of `mid` in floats: at least every resident delta's rank.
    stride: usize,
}

/// Which LoRA launches a pass makes (each `Ops::lora` call: one shrink and one expand per
/// [`LORA_MAX_OUTS`] projections).
///
/// Decode graphs keep working with adapters, rather than adapter passes bypassing replay (which
/// would run every multi-LoRA decode step eagerly): a pass with an adapter chunk replays a graph
/// captured with LoRA launches for every projection ([`PassLora::Every`]), kept apart from the
/// bucket's graph without them, so base-only steps launch nothing for LoRA. The launches read the
/// slots from the metadata and the matrices through the fixed table, and their grids depend only
/// on the token count and the intermediate's stride; growing the stride drops the LoRA graphs.
enum PassLora {
    /// No chunk runs an adapter: nothing is launched.
    Off,
    /// Every projection of every call (a decode graph, replayed with whatever the slots hold).
    Every,
    /// The projections some adapter in these slots has a delta for (an eager pass).
    Slots(Vec<u16>),
}

/// The per-pass host metadata, laid out as the device buffer expects.
struct PassMeta {
    n: usize,
    rows: usize,
    /// Tiles of the tiled attention (0: the pass uses split-K attention).
    tiles: usize,
    host: Vec<i32>,
}

/// CUDA implementation of [`Backend`].
pub struct CudaBackend {
    ordinal: usize,
    info: DeviceInfo,
    /// Kernel launches and cuBLAS calls enqueued so far (a graph replay counts none); those of
    /// the last pass encoded (eagerly or into a graph), and the passes encoded.
    launches: std::sync::atomic::AtomicU64,
    pass_launches: std::sync::atomic::AtomicU64,
    passes_encoded: std::sync::atomic::AtomicU64,
    config: ModelConfig,
    opts: BackendOptions,
    positions: usize,
    ctx: Arc<CudaContext>,
    // Fields drop in declaration order. The cuBLAS handle was given `stream` (cublasSetStream)
    // and holds its raw handle without keeping it alive, so it must be destroyed before the
    // stream is: it is declared first. The graphs hold their own `Arc` of the stream (and are
    // cleared in `Drop`); the module and kernels do not use it.
    blas: Blas,
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    k: Kernels,
    /// The family whose forward pass runs here.
    model: Arc<dyn Model>,
    weights: DevWeights,
    /// `(cos, sin)` per [`Model::ropes`] entry.
    ropes: Vec<(DevBuf, DevBuf)>,
    /// `[layers][K|V][slots][kv_heads * head_dim]` f32; shared with the transfer sink.
    pool: KvPoolAccess,
    /// `[layers][K|V][max_batch_tokens][kv_heads * head_dim]` f32.
    stage: DevBuf,
    ws: Workspace,
    staged: Option<StagedPass>,
    /// Decode graphs by (bucket, with LoRA launches).
    graphs: HashMap<(usize, bool), Graph>,
    graphs_enabled: bool,
    /// Kernels launch with programmatic stream serialization ([`launch_raw`]): the device is
    /// sm_90 or later and `BackendOptions::pdl` is on.
    pdl: bool,
    /// Resident LoRA adapters.
    lora: Option<LoraSlots>,
    /// The decode-step mixture kernels' expert tables, by router matrix (bf16 with decode
    /// products only).
    moe_tables: HashMap<u32, MoeTable>,
    /// Device sampling's parameters, bitmaps and results ([`CudaBackend::sample_on_device`]),
    /// grown to the largest step that sampled.
    sampling: Option<DevBuf>,
}

impl CudaBackend {
    /// Creates a backend on `cuda:<ordinal>`: checks the device and libraries, compiles (or loads
    /// from the on-disk cache) the kernels for its architecture, uploads the weights and RoPE
    /// tables, and allocates the KV pool, staging and workspaces, after checking they fit.
    pub fn new(
        ordinal: usize,
        config: ModelConfig,
        weights: ModelWeights,
        mut opts: BackendOptions,
    ) -> Result<CudaBackend> {
        let device = Device::Cuda(ordinal);
        let ModelWeights { model, store } = weights;
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        if opts.num_blocks == 0 || opts.block_size == 0 || opts.max_batch_tokens == 0 {
            return bad(format!(
                "KV blocks ({}), block size ({}) and max batch tokens ({}) must be positive",
                opts.num_blocks, opts.block_size, opts.max_batch_tokens
            ));
        }
        if opts.kv_shared {
            return Err(EngineError::Device {
                device,
                msg: "the shm KV transport keeps the KV pool in host shared memory, which a GPU worker \
                      does not have; use --transport tcp"
                    .into(),
            });
        }
        // The kernels (attention, KV write and commit) store f32, bf16 or fp8 KV. Refused before
        // any GPU is looked for.
        let kv_dtype = opts.kv_dtype_on(device);
        if kv_kernel_suffix(kv_dtype).is_none() {
            return bad(format!(
                "--kv-dtype {kv_dtype} is not supported with --device {device}: the CUDA backend keeps \
                 its KV cache in bf16 (the default on a GPU), fp8 or f32"
            ));
        }
        if config.head_dim > MAX_HEAD_DIM {
            return Err(EngineError::Device {
                device,
                msg: format!(
                    "head dim {} exceeds the CUDA kernels' limit of {MAX_HEAD_DIM}",
                    config.head_dim
                ),
            });
        }
        let Some(capacity) = opts.num_blocks.checked_mul(opts.block_size) else {
            return bad(format!("{} blocks of {} tokens overflow", opts.num_blocks, opts.block_size));
        };
        if capacity > i32::MAX as usize {
            return bad(format!("{capacity} KV slots exceed the CUDA kernels' i32 slot range"));
        }
        opts.max_batch_tokens = opts.max_batch_tokens.min(capacity);
        check_device(ordinal)?;
        check_libraries(ordinal)?;

        let ctx = CudaContext::new(ordinal).map_err(|e| driver_error(ordinal, "creating a context", e))?;
        let info = describe(&ctx)?;
        // One stream per instance; ordering is by that stream alone, so cudarc's cross-stream
        // event tracking is off (it would also put event records into captured graphs).
        // SAFETY: no buffer of this instance is ever used on another stream.
        unsafe { ctx.disable_event_tracking() };
        let err = |what: &'static str| move |e| driver_error(ordinal, what, e);
        let stream = ctx.new_stream().map_err(err("creating a stream"))?;

        // Everything that will live on the device, checked against free memory first.
        let c = &config;
        let dsz = dtype_bytes(opts.dtype);
        let kvd = c.num_kv_heads * c.head_dim;
        let t = opts.max_batch_tokens;
        let small_logit_rows = GRAPH_BUCKETS.last().copied().unwrap_or(1).min(t);
        let weight_bytes = weight_device_bytes(&store, dsz);
        let pool_bytes = c.num_layers * 2 * capacity * kvd * kv_dtype.bytes();
        let stage_bytes = c.num_layers * 2 * t * kvd * 4;
        let target_blocks = 4 * info.multiprocessors;
        let partial_floats = (target_blocks + t * c.num_heads) * (c.head_dim + 2);
        let scratch_bytes =
            |spec: &BufSpec| scratch_rows(spec, t, small_logit_rows) * spec.width * buf_bytes(spec, dsz);
        let groups = model.fused_groups();
        // The product of a fused group, before it is split (f32 rows of the widest group).
        let fused_rows = groups
            .iter()
            .map(|g| {
                g.iter().filter_map(|m| store.mats.get(m.0 as usize)).map(|(m, _)| m.rows).sum::<usize>()
            })
            .max()
            .unwrap_or(0);
        let fused_bytes = t * fused_rows * 4;
        // A decode step's mixtures over routed experts: every expert's activations and outputs
        // for up to GEMV_MAX_N tokens (bf16 with decode products only).
        let moe_decode = opts.dtype == ComputeDtype::Bf16 && opts.decode_gemv;
        let (moe_acts_bytes, moe_ye_bytes) = if moe_decode {
            model
                .moe_specs()
                .iter()
                .filter_map(|spec| {
                    let (m, _) = store.mats.get(spec.experts.first()?.gate.0 as usize)?;
                    let e = spec.experts.len();
                    Some((e * GEMV_MAX_N * m.rows * 2, e * GEMV_MAX_N * m.cols * 4))
                })
                .fold((0, 0), |(a, y), (a2, y2)| (a.max(a2), y.max(y2)))
        } else {
            (0, 0)
        };
        // Larger passes' mixtures over routed tokens (bf16): the grouped products' layout and
        // their activations and outputs for every row the tiles of a full pass can hold.
        let moe_routed = opts.dtype == ComputeDtype::Bf16 && opts.moe_routed;
        let routed_sizes: Vec<MoeRoutedSize> = if moe_routed {
            model
                .moe_specs()
                .iter()
                .filter_map(|spec| {
                    let (m, _) = store.mats.get(spec.experts.first()?.gate.0 as usize)?;
                    Some(MoeRoutedSize::new(t, spec.experts.len(), spec.top_k, m.cols, m.rows))
                })
                .collect()
        } else {
            Vec::new()
        };
        let routed = MoeRoutedSize::largest(&routed_sizes);
        let ws_bytes = model.scratch().iter().map(scratch_bytes).sum::<usize>()
            + partial_floats * 4
            + t * c.num_heads * 4
            + CUBLAS_WORKSPACE
            + fused_bytes
            + moe_acts_bytes
            + moe_ye_bytes
            + routed.bytes();
        let positions = c.max_position_embeddings.min(capacity);
        let rope_bytes = model.ropes().iter().map(|r| positions * r.dims * 4).sum::<usize>();
        let lora_targets = c.num_layers * Proj::ALL.len();
        let (lora_table_bytes, lora_mid_bytes) = match opts.max_adapters {
            0 => (0, 0),
            slots => (slots * lora_targets * LORA_ENTRY_BYTES, LORA_MAX_OUTS * t * LORA_MIN_STRIDE * 4),
        };
        let needed = weight_bytes
            + pool_bytes
            + stage_bytes
            + ws_bytes
            + rope_bytes
            + lora_table_bytes
            + lora_mid_bytes;
        let (free, _) = ctx.mem_get_info().map_err(err("reading free memory"))?;
        if needed as u128 > free as u128 {
            return bad(format!(
                "{device} has {:.2} GiB free but this model needs {:.2} GiB: weights {:.2} GiB ({}), KV pool \
                 {:.2} GiB ({} blocks of {} tokens), staging and workspaces {:.2} GiB; lower --kv-blocks or \
                 --max-batch-tokens",
                gib(free),
                gib(needed),
                gib(weight_bytes),
                opts.dtype,
                gib(pool_bytes),
                opts.num_blocks,
                opts.block_size,
                gib(stage_bytes + ws_bytes + rope_bytes + lora_table_bytes + lora_mid_bytes)
            ));
        }

        let src = tandem_kernels::source("model")
            .ok_or_else(|| EngineError::Internal("kernel source \"model\" is missing".into()))?;
        let ptx = tandem_kernels::PtxCache::default()
            .get_or_compile(src, info.compute_capability)
            .map_err(|e| EngineError::Device { device, msg: format!("compiling the CUDA kernels: {e}") })?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)).map_err(|e| {
            driver_error(
                ordinal,
                "loading the compiled kernels (an NVRTC newer than the driver emits PTX the driver \
                     cannot load: use the NVRTC of the driver's CUDA version)",
                e,
            )
        })?;
        let shared_optin = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(err("reading the shared memory a block may opt in to"))?
            .max(0) as usize;
        let k = Kernels::load(&module, opts.dtype, kv_dtype, config.head_dim, shared_optin, ordinal)?;
        let blas = Blas::new(&stream)
            .map_err(|e| EngineError::Device { device, msg: format!("creating a cuBLAS handle: {e}") })?;

        let up = Uploader { ctx: &ctx, stream: &stream, ordinal };
        let weights = up.weights(&store, opts.dtype, &groups)?;
        drop(store);
        let mut moe_tables = HashMap::new();
        if moe_decode || moe_routed {
            for spec in model.moe_specs() {
                let mut table: Vec<CUdeviceptr> = Vec::with_capacity(3 * spec.experts.len());
                for which in 0..3 {
                    for ex in &spec.experts {
                        let id = [ex.gate, ex.up, ex.down][which];
                        let m = weights.mats.get(id.0 as usize).ok_or_else(|| {
                            EngineError::Internal(format!("expert matrix {} is not among the weights", id.0))
                        })?;
                        table.push(m.ptr());
                    }
                }
                let buf = up.bytes(&table, "expert tables")?;
                moe_tables.insert(spec.router.0, MoeTable { buf, experts: spec.experts.len() });
            }
        }
        let ropes = model
            .ropes()
            .iter()
            .map(|r| {
                let table = RopeTable::new(r.dims, r.theta, r.scaling.as_ref(), positions);
                Ok((up.f32s(table.cos(), "RoPE cos table")?, up.f32s(table.sin(), "RoPE sin table")?))
            })
            .collect::<Result<Vec<_>>>()?;

        let alloc = |bytes: usize, what: &'static str| DevBuf::alloc(&ctx, bytes, what);
        let pool = alloc(pool_bytes, "KV pool")?;
        // A fresh pool reads as zeros, as the CPU pool does.
        // SAFETY: `pool` is a live allocation of `pool.bytes()` bytes on this context.
        unsafe { cudarc::driver::result::memset_d8_async(pool.ptr(), 0, pool.bytes(), stream.cu_stream()) }
            .map_err(err("clearing the KV pool"))?;
        let layout = KvLayout {
            num_layers: c.num_layers,
            num_blocks: opts.num_blocks,
            block_size: opts.block_size,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            dtype: kv_dtype,
        };
        let pool = KvPoolAccess::new(&ctx, pool, layout);
        let stage = alloc(stage_bytes, "KV staging")?;
        let cap_tables = (opts.num_blocks * 2).max(4096);
        let scratch = model
            .scratch()
            .iter()
            .map(|spec| {
                Ok(DevScratch { spec: *spec, buf: alloc(scratch_bytes(spec), "scratch buffer")?, big: None })
            })
            .collect::<Result<Vec<_>>>()?;
        let ws = Workspace {
            scratch,
            partial: alloc(partial_floats * 4, "attention partials")?,
            partial_floats,
            attn_done: alloc(t * c.num_heads * 4, "attention slice counts")?,
            small_logit_rows,
            meta: alloc((META_REGIONS * t + cap_tables) * 4, "pass metadata")?,
            cap_tables,
            commit_meta: alloc(2 * t * 4, "commit metadata")?,
            picks: alloc(2 * t.max(small_logit_rows) * 4, "greedy picks")?,
            cublas: alloc(CUBLAS_WORKSPACE, "cuBLAS workspace")?,
            fused: alloc(fused_bytes.max(4), "fused products")?,
            moe_acts: alloc(moe_acts_bytes.max(4), "decode mixtures' activations")?,
            moe_ye: alloc(moe_ye_bytes.max(4), "decode mixtures' expert outputs")?,
            moe_routed: if routed.bytes() > 0 {
                Some((alloc(routed.bytes(), "mixtures over routed tokens")?, routed))
            } else {
                None
            },
            fused_rows,
        };
        // SAFETY: `attn_done` is a live allocation of `attn_done.bytes()` bytes on this context.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                ws.attn_done.ptr(),
                0,
                ws.attn_done.bytes(),
                stream.cu_stream(),
            )
        }
        .map_err(err("clearing the attention slice counts"))?;
        // SAFETY: the workspace is a live allocation of CUBLAS_WORKSPACE bytes that outlives the
        // handle (both are fields of the backend; the handle is dropped first, declared earlier).
        unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                blas.0,
                ws.cublas.ptr() as *mut c_void,
                CUBLAS_WORKSPACE,
            )
            .result()
        }
        .map_err(|e| EngineError::Device { device, msg: format!("setting the cuBLAS workspace: {e}") })?;
        let lora = match opts.max_adapters {
            0 => None,
            slots => {
                let table = alloc(lora_table_bytes, "LoRA table")?;
                // SAFETY: a live allocation of `table.bytes()` bytes; ordered before any pass.
                unsafe {
                    cudarc::driver::result::memset_d8_async(table.ptr(), 0, table.bytes(), stream.cu_stream())
                }
                .map_err(err("clearing the LoRA table"))?;
                Some(LoraSlots {
                    slots: (0..slots).map(|_| None).collect(),
                    table,
                    mid: alloc(lora_mid_bytes, "LoRA intermediate")?,
                    stride: LORA_MIN_STRIDE,
                })
            }
        };
        stream.synchronize().map_err(err("finishing the upload"))?;
        let pdl = opts.pdl && info.compute_capability >= (9, 0);
        tracing::info!(
            device = %device,
            gpu = %info.name,
            compute_capability = ?info.compute_capability,
            dtype = %opts.dtype,
            weights_gib = gib(weight_bytes),
            kv_pool_gib = gib(pool_bytes),
            cuda_graphs = opts.cuda_graphs,
            programmatic_dependent_launch = pdl,
            prompt_attention = match tiling(&config, &opts).map(|t| t.kernel) {
                Some(TileKernel::TensorCores) => "tensor cores",
                Some(TileKernel::CudaCores) => "CUDA cores, tiled",
                None => "split-K",
            },
            "CUDA backend ready"
        );
        Ok(CudaBackend {
            ordinal,
            info,
            launches: Default::default(),
            pass_launches: Default::default(),
            passes_encoded: Default::default(),
            positions,
            graphs_enabled: opts.cuda_graphs,
            pdl,
            config,
            opts,
            ctx,
            stream,
            blas,
            _module: module,
            k,
            model,
            weights,
            ropes,
            pool,
            stage,
            ws,
            staged: None,
            graphs: HashMap::new(),
            lora,
            moe_tables,
            sampling: None,
        })
    }

    /// The GPU this instance runs on.
    pub fn device_info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Every device allocation of this instance with the device ordinal the driver reports for
    /// it (the device audit: all must equal this backend's ordinal).
    pub fn allocation_devices(&self) -> Result<Vec<(&'static str, usize)>> {
        self.bind()?;
        let w = &self.weights;
        let ws = &self.ws;
        let mut bufs: Vec<&DevBuf> = w.mats.iter().map(|m| &*m.buf).chain(&w.vecs).collect();
        bufs.extend([&ws.fused, &ws.moe_acts, &ws.moe_ye]);
        bufs.extend(self.moe_tables.values().map(|t| &t.buf));
        bufs.extend(self.ropes.iter().flat_map(|(c, s)| [c, s]));
        bufs.extend([self.pool.buf(), &self.stage]);
        bufs.extend(ws.scratch.iter().flat_map(|b| std::iter::once(&b.buf).chain(b.big.as_ref())));
        bufs.extend([&ws.partial, &ws.attn_done, &ws.meta, &ws.commit_meta, &ws.picks, &ws.cublas]);
        if let Some(l) = &self.lora {
            bufs.extend([&l.table, &l.mid]);
            bufs.extend(l.slots.iter().flatten().map(|a| &a.buf));
        }
        bufs.into_iter().map(|b| Ok((b.what(), b.reported_ordinal()?))).collect()
    }

    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn err<'a>(&'a self, what: &'a str) -> impl Fn(cudarc::driver::DriverError) -> EngineError + 'a {
        move |e| driver_error(self.ordinal, what, e)
    }

    /// Makes this instance's context current on the calling thread.
    fn bind(&self) -> Result<()> {
        super::bind(&self.ctx).map_err(self.err("binding the context"))
    }

    fn kvd(&self) -> usize {
        self.config.num_kv_heads * self.config.head_dim
    }

    /// Device address of `(layer, K=0|V=1)`'s pool plane.
    fn pool_plane(&self, layer: usize, kv: usize) -> CUdeviceptr {
        self.pool.plane(layer, kv)
    }

    fn stage_plane(&self, layer: usize, kv: usize) -> CUdeviceptr {
        let plane = self.opts.max_batch_tokens * self.kvd() * 4;
        self.stage.at((layer * 2 + kv) * plane)
    }

    /// How passes with prompt chunks cut their attention into blocks ([`tiling`]).
    fn tiling(&self) -> Option<Tiling> {
        tiling(&self.config, &self.opts)
    }

    /// Address of metadata region `r` (see [`CudaBackend::build_meta`]).
    fn meta(&self, r: usize) -> CUdeviceptr {
        self.ws.meta.at(r * self.opts.max_batch_tokens * 4)
    }

    /// Uploads metadata; grows the block-table region (dropping captured graphs, which point at
    /// the old buffer) when a pass needs more.
    fn upload_meta(&mut self, meta: &PassMeta) -> Result<()> {
        let cap = self.opts.max_batch_tokens;
        // Two tokens writing one slot would race on the device; the CPU write path refuses it too.
        let mut slots: Vec<i32> =
            meta.host[2 * cap..2 * cap + meta.n].iter().copied().filter(|&s| s >= 0).collect();
        slots.sort_unstable();
        if let Some(w) = slots.windows(2).find(|w| w[0] == w[1]) {
            return Err(KvError::DuplicateSlot { layer: 0, slot: w[0] as usize }.into());
        }
        let tables = meta.host.len() - META_REGIONS * cap;
        if tables > self.ws.cap_tables {
            let grown = tables.next_power_of_two();
            self.ws.meta = DevBuf::alloc(&self.ctx, (META_REGIONS * cap + grown) * 4, "pass metadata")?;
            self.ws.cap_tables = grown;
            self.graphs.clear();
        }
        // SAFETY: the metadata buffer holds at least `host.len()` i32s (checked above); the copy
        // is ordered on this instance's stream before the kernels that read it.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(self.ws.meta.ptr(), &meta.host, self.stream.cu_stream())
        }
        .map_err(self.err("uploading pass metadata"))
    }

    /// `y[n × w.rows] = x[n × w.cols] · wᵀ` (x in the compute dtype, y f32).
    fn gemm(&self, w: &DevMatrix, x: CUdeviceptr, n: usize, y: CUdeviceptr) -> Result<()> {
        if n == 0 {
            // The logits rows of a pass that returns none: nothing to multiply.
            return Ok(());
        }
        self.launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ty = match self.opts.dtype {
            ComputeDtype::Bf16 => cudaDataType::CUDA_R_16BF,
            ComputeDtype::F32 => cudaDataType::CUDA_R_32F,
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Column-major view: C (rows × n) = Aᵀ (rows × cols) · B (cols × n), where A is the
        // row-major weight seen as cols × rows and B the row-major activations seen as cols × n.
        // SAFETY: w holds rows × cols, x at least n × cols elements of `ty`, y n × rows f32s; the
        // handle's stream is this instance's stream.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                self.blas.0,
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                w.rows as i32,
                n as i32,
                w.cols as i32,
                (&alpha as *const f32).cast(),
                w.ptr() as *const c_void,
                ty,
                w.cols as i32,
                x as *const c_void,
                ty,
                w.cols as i32,
                (&beta as *const f32).cast(),
                y as *mut c_void,
                cudaDataType::CUDA_R_32F,
                w.rows as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| EngineError::Device { device: self.device(), msg: format!("cuBLAS GEMM: {e}") })
    }

    /// Enqueues one forward pass over `n` tokens whose metadata is on the device, with `splits`
    /// attention slices and `rows` rows of logits (left in the model's logits buffer).
    fn encode(
        &self,
        n: usize,
        splits: usize,
        rows: usize,
        staged: bool,
        tiles: usize,
        lora: &PassLora,
    ) -> Result<()> {
        let c = &self.config;
        if n * c.num_heads * splits * (c.head_dim + 2) > self.ws.partial_floats {
            return Err(EngineError::Internal(format!(
                "attention partials for {n} tokens in {splits} slices exceed the workspace"
            )));
        }
        let mut pass = CudaPass {
            be: self,
            n,
            splits,
            rows,
            staged,
            tiles,
            lora,
            kv_written: None,
            pending_norm: None,
            pending_linear: None,
        };
        let before = self.launches.load(std::sync::atomic::Ordering::Relaxed);
        let out = self.model.forward(&mut pass).and_then(|()| pass.settle());
        let launched = self.launches.load(std::sync::atomic::Ordering::Relaxed) - before;
        self.pass_launches.store(launched, std::sync::atomic::Ordering::Relaxed);
        self.passes_encoded.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        out
    }

    /// Where a scratch buffer is for a pass returning `rows` rows of logits.
    fn scratch_ptr(&self, b: Buf, rows: usize) -> Result<CUdeviceptr> {
        let s =
            self.ws.scratch.get(b.0 as usize).ok_or_else(|| {
                EngineError::Internal(format!("model pass: buffer {} is not declared", b.0))
            })?;
        match (&s.big, s.spec.rows) {
            (Some(big), Rows::Logits) if rows > self.ws.small_logit_rows => Ok(big.ptr()),
            (None, Rows::Logits) if rows > self.ws.small_logit_rows => {
                Err(EngineError::Internal("model pass: logits buffer not grown".into()))
            }
            _ => Ok(s.buf.ptr()),
        }
    }

    /// Grows every logits-rows buffer for a pass returning `rows` rows.
    fn grow_logit_buffers(&mut self, rows: usize) -> Result<()> {
        let dsz = dtype_bytes(self.opts.dtype);
        for s in self.ws.scratch.iter_mut().filter(|s| s.spec.rows == Rows::Logits) {
            let bytes = rows * s.spec.width * buf_bytes(&s.spec, dsz);
            if s.big.as_ref().is_none_or(|b| b.bytes() < bytes) {
                s.big = None;
                s.big = Some(DevBuf::alloc(&self.ctx, bytes, "logits rows (all positions)")?);
            }
        }
        Ok(())
    }

    /// Copies `rows` rows of logits from the device and splits them per chunk.
    fn read_logits(&self, batch: &[SeqChunk<'_>], src: CUdeviceptr) -> Result<Vec<Vec<f32>>> {
        let vocab = self.config.vocab_size;
        let counts: Vec<usize> = batch
            .iter()
            .map(|ch| match ch.logits {
                LogitsRequest::None => 0,
                LogitsRequest::Last => 1,
                LogitsRequest::All => ch.tokens.len(),
            })
            .collect();
        let total: usize = counts.iter().sum();
        let mut all = vec![0f32; total * vocab];
        if total > 0 {
            // SAFETY: `src` holds at least `total × vocab` f32s written by this pass, on this stream.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut all, src, self.stream.cu_stream()) }
                .map_err(self.err("copying logits"))?;
        }
        self.stream.synchronize().map_err(self.err("running the forward pass"))?;
        let mut out = Vec::with_capacity(batch.len());
        let mut off = 0;
        for cnt in counts {
            out.push(all[off * vocab..(off + cnt) * vocab].to_vec());
            off += cnt;
        }
        Ok(out)
    }

    /// The graph bucket for a decode step, if this pass can replay one.
    fn graph_bucket(&self, batch: &[SeqChunk<'_>], staged: bool) -> Option<usize> {
        if !self.graphs_enabled || staged {
            return None;
        }
        if !batch.iter().all(|c| c.tokens.len() == 1 && c.logits == LogitsRequest::Last) {
            return None;
        }
        // Padding gives every padded token its own chunk entry, so chunks + padding must fit too.
        GRAPH_BUCKETS
            .iter()
            .copied()
            .find(|&b| b >= batch.len())
            .filter(|&b| b <= self.opts.max_batch_tokens && b <= self.ws.small_logit_rows)
    }

    /// Enqueues a whole pass (eagerly or by replaying a graph) and returns where its logits rows
    /// are, or `None` for an empty batch. Nothing has been waited for yet.
    fn run_pass(&mut self, batch: &[SeqChunk<'_>]) -> Result<Option<(CUdeviceptr, usize)>> {
        crate::backend::check_slots(batch, |s| self.resident(s))?;
        let n = validate_batch(batch, self.config.vocab_size, self.positions, &self.opts, &[None])?;
        if n == 0 {
            return Ok(None);
        }
        if self.staged.is_some() {
            return Err(KvError::StagedPending.into());
        }
        let staged = batch.iter().any(|c| c.write == WriteMode::Staged);
        let with_lora = batch.iter().any(|c| c.adapter.is_some());
        if let Some(bucket) = self.graph_bucket(batch, staged) {
            let meta =
                build_meta(batch, Some(bucket), self.opts.max_batch_tokens, self.opts.block_size, None);
            self.upload_meta(&meta)?;
            let splits = splits(bucket, self.config.num_heads, 4 * self.info.multiprocessors, None);
            let logits = self.scratch_ptr(self.model.logits(), bucket)?;
            let lora = if with_lora { PassLora::Every } else { PassLora::Off };
            if let Some(g) = self.graphs.get(&(bucket, with_lora)) {
                g.0.launch().map_err(self.err("replaying a decode graph"))?;
            } else {
                self.encode(bucket, splits, bucket, false, 0, &lora)?;
                self.capture(bucket, splits, &lora);
            }
            return Ok(Some((logits, bucket)));
        }
        // A pass with a chunk of several tokens runs attention in tiles; decode steps (one token per
        // sequence, where the tiles would hold one token each) keep the split-K kernel.
        let longest = batch.iter().map(|c| c.tokens.len()).max().unwrap_or(0);
        let tile = self.tiling().filter(|_| longest >= 2).map(|t| t.tokens);
        let meta = build_meta(batch, None, self.opts.max_batch_tokens, self.opts.block_size, tile);
        self.upload_meta(&meta)?;
        let max_len = batch.iter().map(|c| c.start_pos + c.tokens.len()).max().unwrap_or(1);
        let splits = splits(meta.n, self.config.num_heads, 4 * self.info.multiprocessors, Some(max_len));
        if meta.rows > self.ws.small_logit_rows {
            self.grow_logit_buffers(meta.rows)?;
        }
        let logits = self.scratch_ptr(self.model.logits(), meta.rows)?;
        let lora = if with_lora {
            let mut slots: Vec<u16> = batch.iter().filter_map(|c| c.adapter).collect();
            slots.sort_unstable();
            slots.dedup();
            PassLora::Slots(slots)
        } else {
            PassLora::Off
        };
        self.encode(meta.n, splits, meta.rows, staged, meta.tiles, &lora)?;
        if staged {
            let bs = self.opts.block_size;
            let mut segments = Vec::with_capacity(batch.len());
            let mut row = 0;
            for ch in batch {
                let slots = (0..ch.tokens.len())
                    .map(|j| {
                        let p = ch.start_pos + j;
                        (ch.block_table[p / bs] as usize * bs + p % bs) as i32
                    })
                    .collect();
                segments.push((row, slots, ch.write == WriteMode::Direct));
                row += ch.tokens.len();
            }
            self.staged = Some(StagedPass { segments });
        }
        Ok(Some((logits, meta.rows)))
    }

    fn forward_impl(&mut self, batch: &[SeqChunk<'_>]) -> Result<Vec<Vec<f32>>> {
        let Some((logits, _)) = self.run_pass(batch)? else { return Ok(Vec::new()) };
        let out = self.read_logits(batch, logits);
        if out.is_err() {
            self.staged = None;
        }
        out
    }

    /// A pass whose logits rows are reduced on the device to (greedy token, log-probability);
    /// only those 8 bytes per sequence come back to the host.
    fn forward_greedy_impl(&mut self, batch: &[SeqChunk<'_>]) -> Result<Vec<Option<(u32, f32)>>> {
        if batch.iter().any(|c| c.logits == LogitsRequest::All) {
            return Err(EngineError::Internal("forward_greedy: a chunk asks for all-position logits".into()));
        }
        let Some((logits, rows)) = self.run_pass(batch)? else { return Ok(Vec::new()) };
        let picked = self.pick_greedy(logits, rows);
        let picked = match picked {
            Ok(p) => p,
            Err(e) => {
                self.staged = None;
                return Err(e);
            }
        };
        let mut next = picked.into_iter();
        Ok(batch.iter().map(|c| if c.logits == LogitsRequest::Last { next.next() } else { None }).collect())
    }

    /// A pass whose sampled rows are drawn on the device (`sample_rows`): only each token, its
    /// log-probability and the alternatives asked for come back. Chunks `rows` gives no sampling
    /// for, and rows the kernel leaves to the host, come back whole.
    fn forward_sampled_impl(
        &mut self,
        batch: &[SeqChunk<'_>],
        rows: &mut dyn FnMut() -> Vec<Option<RowSampling>>,
    ) -> Result<Vec<DevicePick>> {
        let Some((logits, _)) = self.run_pass(batch)? else { return Ok(Vec::new()) };
        // The host's part (the constraint's masks, the samplers' draws) overlaps the pass.
        let specs = rows();
        let out = self.sample_on_device(batch, logits, &specs);
        if out.is_err() {
            self.staged = None;
        }
        out
    }

    /// Draws the token of every chunk asking for its last row, from the pass's logits rows at
    /// `logits` (in batch order: one per such chunk, every position's for a chunk asking for
    /// all), as `specs` says; chunks asking for all rows get them back.
    fn sample_on_device(
        &mut self,
        batch: &[SeqChunk<'_>],
        logits: CUdeviceptr,
        specs: &[Option<RowSampling>],
    ) -> Result<Vec<DevicePick>> {
        let vocab = self.config.vocab_size;
        let words = vocab.div_ceil(32);
        // Every logits row of the pass, with the sampling of the chunk it is the last row of.
        let mut rows: Vec<Option<&RowSampling>> = Vec::new();
        let mut first_row = Vec::with_capacity(batch.len());
        for (i, c) in batch.iter().enumerate() {
            first_row.push(rows.len());
            match c.logits {
                LogitsRequest::None => {}
                LogitsRequest::Last => rows.push(specs.get(i).and_then(Option::as_ref)),
                LogitsRequest::All => rows.extend(std::iter::repeat_n(None, c.tokens.len())),
            }
        }
        let n = rows.len();
        let mut out: Vec<DevicePick> = batch.iter().map(|_| DevicePick::Row(Vec::new())).collect();
        if rows.iter().all(Option::is_none) {
            // Nothing to draw: every row comes back, as `forward` gives them.
            return Ok(self.read_logits(batch, logits)?.into_iter().map(DevicePick::Row).collect());
        }
        let (mut fpar, mut ipar, mut uni, mut bits) = (Vec::new(), Vec::new(), Vec::new(), Vec::<u32>::new());
        for &spec in &rows {
            let Some(s) = spec else {
                fpar.extend([0f32; 4]);
                ipar.extend([-1i32, 0, -1, -1]);
                uni.push(0f64);
                continue;
            };
            let mut place = |b: &[u32], what: &str| -> Result<i32> {
                if b.is_empty() {
                    return Ok(-1);
                }
                if b.len() != words {
                    return Err(EngineError::Internal(format!(
                        "device sampling: a {what} bitmap of {} words for a vocabulary of {vocab}",
                        b.len()
                    )));
                }
                let at = bits.len() as i32;
                bits.extend_from_slice(b);
                Ok(at)
            };
            let (allow_at, pen_at) = (place(&s.allowed, "constraint")?, place(&s.penalised, "penalty")?);
            fpar.extend([s.temperature, s.top_p, s.min_p, s.repetition_penalty]);
            ipar.extend([
                s.top_k.min(i32::MAX as usize) as i32,
                s.logprobs.min(SAMPLE_MAX_TOP) as i32,
                allow_at,
                pen_at,
            ]);
            uni.push(s.uniform);
        }
        // One buffer: fpar, ipar, uni, out_i, out_f, bits (offsets stay 8-byte aligned for uni).
        let (at_ipar, at_uni) = (16 * n, 32 * n);
        let (at_oi, at_of) = (40 * n, 40 * n + 4 * SAMPLE_OUT_I * n);
        let at_bits = at_of + 4 * SAMPLE_OUT_F * n;
        let bytes = at_bits + 4 * bits.len();
        if self.sampling.as_ref().is_none_or(|b| b.bytes() < bytes) {
            self.sampling = None;
            self.sampling = Some(DevBuf::alloc(&self.ctx, bytes.next_power_of_two(), "device sampling")?);
        }
        let mut host = Vec::with_capacity(at_oi + 4 * bits.len());
        fpar.iter().for_each(|x| host.extend_from_slice(&x.to_ne_bytes()));
        ipar.iter().for_each(|x| host.extend_from_slice(&x.to_ne_bytes()));
        uni.iter().for_each(|x| host.extend_from_slice(&x.to_ne_bytes()));
        let mut host_bits = Vec::with_capacity(4 * bits.len());
        bits.iter().for_each(|x| host_bits.extend_from_slice(&x.to_ne_bytes()));
        let buf = self.sampling.as_ref().expect("allocated above");
        let (fp, ip, up, bp) = (buf.ptr(), buf.at(at_ipar), buf.at(at_uni), buf.at(at_bits));
        let (oip, ofp) = (buf.at(at_oi), buf.at(at_of));
        // SAFETY: the buffer holds `bytes` bytes laid out as above; the host vectors outlive the
        // synchronize below.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(fp, &host, self.stream.cu_stream()).and_then(|_| {
                if host_bits.is_empty() {
                    Ok(())
                } else {
                    cudarc::driver::result::memcpy_htod_async(bp, &host_bits, self.stream.cu_stream())
                }
            })
        }
        .map_err(self.err("uploading device sampling's parameters"))?;
        launch!(self, sample_rows, per_row(n, 1024); logits, vocab as i32, fp, ip, up, bp, oip, ofp)?;
        let (mut oi, mut of) = (vec![0i32; n * SAMPLE_OUT_I], vec![0f32; n * SAMPLE_OUT_F]);
        // SAFETY: the results region holds `n` rows of each; the copies are on this stream.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut oi, oip, self.stream.cu_stream()).and_then(|_| {
                cudarc::driver::result::memcpy_dtoh_async(&mut of, ofp, self.stream.cu_stream())
            })
        }
        .map_err(self.err("copying device samples"))?;
        self.stream.synchronize().map_err(self.err("running the forward pass"))?;
        for (i, c) in batch.iter().enumerate() {
            let r = first_row[i];
            let count = match c.logits {
                LogitsRequest::None => continue,
                LogitsRequest::Last => {
                    let (ri, rf) =
                        (&oi[r * SAMPLE_OUT_I..][..SAMPLE_OUT_I], &of[r * SAMPLE_OUT_F..][..SAMPLE_OUT_F]);
                    if rows[r].is_some() && ri[0] == 0 {
                        let alternatives = (ri[3].max(0) as usize).min(SAMPLE_MAX_TOP);
                        let top_logprobs =
                            (0..alternatives).map(|k| (ri[4 + k].max(0) as u32, rf[1 + k])).collect();
                        let sampled = Sampled { token: ri[1].max(0) as u32, logprob: rf[0], top_logprobs };
                        out[i] = DevicePick::Sampled { sampled, drew: ri[2] == 1 };
                        continue;
                    }
                    1
                }
                LogitsRequest::All => c.tokens.len(),
            };
            // The chunk's rows come back whole (every copy enqueued, then one wait).
            let mut back = vec![0f32; count * vocab];
            let src = logits + (r * vocab * 4) as u64;
            // SAFETY: rows r..r + count of the pass's logits, `vocab` f32s each, written by this
            // pass; `back`'s heap buffer stays put in `out` until the synchronize below.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut back, src, self.stream.cu_stream()) }
                .map_err(self.err("copying logits"))?;
            out[i] = DevicePick::Row(back);
        }
        self.stream.synchronize().map_err(self.err("copying logits"))?;
        Ok(out)
    }

    /// Greedy token and log-probability of each of the first `rows` logits rows at `logits`.
    fn pick_greedy(&self, logits: CUdeviceptr, rows: usize) -> Result<Vec<(u32, f32)>> {
        if rows == 0 {
            // Only non-final prefill chunks: nothing to pick, but the pass must have finished.
            self.stream.synchronize().map_err(self.err("running the forward pass"))?;
            return Ok(Vec::new());
        }
        let vocab = self.config.vocab_size as i32;
        let cap = self.opts.max_batch_tokens.max(self.ws.small_logit_rows);
        let (tok_ptr, lp_ptr) = (self.ws.picks.ptr(), self.ws.picks.at(cap * 4));
        launch!(self, greedy_rows, per_row(rows, 1024); logits, vocab, tok_ptr, lp_ptr)?;
        let (mut tokens, mut logprobs) = (vec![0i32; rows], vec![0f32; rows]);
        // SAFETY: the picks buffer holds `cap` i32s then `cap` f32s; rows ≤ cap.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut tokens, tok_ptr, self.stream.cu_stream()).and_then(
                |_| cudarc::driver::result::memcpy_dtoh_async(&mut logprobs, lp_ptr, self.stream.cu_stream()),
            )
        }
        .map_err(self.err("copying greedy picks"))?;
        self.stream.synchronize().map_err(self.err("running the forward pass"))?;
        Ok(tokens.into_iter().zip(logprobs).map(|(t, l)| (t.max(0) as u32, l)).collect())
    }

    /// Captures the decode step just run eagerly for `bucket` (with `lora`'s launches) as a graph
    /// for later steps. A failed capture turns graphs off for this instance (with a warning)
    /// rather than failing.
    fn capture(&mut self, bucket: usize, splits: usize, lora: &PassLora) {
        let mode = cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        let key = (bucket, !matches!(lora, PassLora::Off));
        let result = (|| -> Result<Option<CudaGraph>> {
            self.stream.begin_capture(mode).map_err(self.err("starting graph capture"))?;
            let encoded = self.encode(bucket, splits, bucket, false, 0, lora);
            let flags = cudarc::driver::sys::CUgraphInstantiate_flags(0);
            let graph = self.stream.end_capture(flags).map_err(self.err("finishing graph capture"));
            encoded?;
            graph
        })();
        match result {
            Ok(Some(g)) => {
                self.graphs.insert(key, Graph(g));
            }
            Ok(None) | Err(_) => {
                if let Err(e) = &result {
                    tracing::warn!(device = %self.device(), bucket, error = %e, "CUDA graph capture failed; decode steps run eagerly from now on");
                }
                self.graphs_enabled = false;
                self.graphs.clear();
            }
        }
    }

    fn commit_impl(&mut self, accepted: &[usize]) -> Result<()> {
        let Some(pass) = self.staged.as_ref() else {
            return Err(KvError::NothingStaged("no staged pass").into());
        };
        if accepted.len() != pass.segments.len() {
            return Err(KvError::InvalidAccepted(format!(
                "{} accepted lengths for {} segments",
                accepted.len(),
                pass.segments.len()
            ))
            .into());
        }
        for (i, ((_, slots, direct), &a)) in pass.segments.iter().zip(accepted).enumerate() {
            if *direct && a != slots.len() {
                return Err(KvError::InvalidAccepted(format!(
                    "segment {i} was written direct ({} tokens); it is accepted whole, not {a}",
                    slots.len()
                ))
                .into());
            }
            if a > slots.len() {
                return Err(KvError::InvalidAccepted(format!(
                    "segment {i}: {a} tokens accepted of {}",
                    slots.len()
                ))
                .into());
            }
        }
        let mut rows = Vec::new();
        let mut slots = Vec::new();
        for ((row, seg_slots, _), &a) in pass.segments.iter().zip(accepted).filter(|((_, _, d), _)| !d) {
            rows.extend((0..a).map(|j| (row + j) as i32));
            slots.extend_from_slice(&seg_slots[..a]);
        }
        let m = rows.len();
        if m > 0 {
            let cap = self.opts.max_batch_tokens;
            let mut host = rows;
            host.resize(cap, 0);
            host.extend_from_slice(&slots);
            // SAFETY: commit_meta holds 2 × max_batch_tokens i32s; m ≤ max_batch_tokens.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    self.ws.commit_meta.ptr(),
                    &host,
                    self.stream.cu_stream(),
                )
            }
            .map_err(self.err("uploading commit metadata"))?;
            let kvd = self.kvd();
            let cfg = LaunchConfig {
                grid_dim: (m as u32, (2 * self.config.num_layers) as u32, 1),
                block_dim: ((kvd.next_power_of_two().clamp(32, 1024)) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let slots_ptr = self.ws.commit_meta.at(cap * 4);
            let pool_slots = (self.opts.num_blocks * self.opts.block_size) as i64;
            launch!(self, kv_commit, cfg; self.stage.ptr(), self.pool.buf().ptr(), self.ws.commit_meta.ptr(), slots_ptr,
                kvd as i32, cap as i64, pool_slots)?;
            self.stream.synchronize().map_err(self.err("committing staged K/V"))?;
        }
        self.staged = None;
        Ok(())
    }

    /// After a failed pass, waits for whatever it enqueued before the caller frees or reuses
    /// the blocks it wrote (a transfer into a freshly reserved block must not race a stale
    /// write).
    fn settle<T>(&self, out: &Result<T>) {
        if out.is_err() {
            let _ = self.stream.synchronize();
        }
    }

    fn check_block(&self, what: &str, layer: usize, block: BlockId) -> Result<()> {
        if layer >= self.config.num_layers || block as usize >= self.opts.num_blocks {
            return Err(EngineError::Internal(format!("{what}: layer {layer} block {block} out of range")));
        }
        Ok(())
    }

    /// Whether adapter slot `s` holds an adapter.
    fn resident(&self, s: usize) -> bool {
        self.lora.as_ref().is_some_and(|l| l.slots.get(s).is_some_and(Option::is_some))
    }

    /// Uploads `adapter`'s deltas (A as given, B transposed, f32) into an allocation of its own,
    /// then points slot `slot`'s table entries at them (or clears them), and frees what the slot
    /// held. The device is idle before the table changes, so no pass reads a half-written entry
    /// or a freed matrix; the table never moves, so captured graphs stay valid.
    fn set_adapter_impl(&mut self, slot: usize, adapter: Option<Arc<LoraAdapter>>) -> Result<()> {
        let slots = self.adapter_slots();
        if slot >= slots {
            return Err(EngineError::Internal(format!(
                "adapter slot {slot}: this backend has {slots} slots"
            )));
        }
        self.bind()?;
        // A pass ends with a synchronize, a failed one too (`settle`); waiting here costs nothing
        // then, and makes sure no kernel still reads the slot.
        self.stream.synchronize().map_err(self.err("waiting before changing an adapter slot"))?;
        let c = &self.config;
        let n_targets = c.num_layers * Proj::ALL.len();
        // The slot's table entries as 3 u64 each (LoraEntry: a, bt, rank | scale << 32).
        let mut entries = vec![0u64; n_targets * 3];
        let fresh = match adapter {
            None => None,
            Some(a) => {
                let mut host: Vec<f32> = Vec::with_capacity(a.bytes() / 4);
                let mut placed = Vec::with_capacity(a.weights.len());
                for w in &a.weights {
                    let (din, dout) = w.target.proj.dims(c);
                    let t = w.target;
                    if t.layer as usize >= c.num_layers
                        || w.rank == 0
                        || w.rank > i32::MAX as usize
                        || w.a.len() != w.rank * din
                        || w.b.len() != dout * w.rank
                    {
                        return Err(EngineError::Internal(format!(
                            "adapter {}: {} of layer {} does not fit this model",
                            a.name, t.proj, t.layer
                        )));
                    }
                    let a_off = host.len();
                    host.extend_from_slice(&w.a);
                    let bt_off = host.len();
                    host.extend((0..w.rank).flat_map(|j| (0..dout).map(move |o| w.b[o * w.rank + j])));
                    placed.push((lora_target_index(t), a_off, bt_off, w.rank, w.scale));
                }
                let up = Uploader { ctx: &self.ctx, stream: &self.stream, ordinal: self.ordinal };
                let buf = up.f32s(&host, "LoRA adapter")?;
                for (ti, a_off, bt_off, rank, scale) in placed {
                    entries[ti * 3] = buf.at(a_off * 4);
                    entries[ti * 3 + 1] = buf.at(bt_off * 4);
                    entries[ti * 3 + 2] = u64::from(rank as u32) | (u64::from(scale.to_bits()) << 32);
                }
                Some(DevAdapter { adapter: a, buf })
            }
        };
        let rank = fresh.as_ref().map_or(0, |d| d.adapter.max_rank());
        let cap = self.opts.max_batch_tokens;
        let Some(lora) = self.lora.as_mut() else {
            return Err(EngineError::Internal("adapter slots without a LoRA table".into()));
        };
        if rank > lora.stride {
            let stride = rank.next_power_of_two().max(LORA_MIN_STRIDE);
            lora.mid = DevBuf::alloc(&self.ctx, LORA_MAX_OUTS * cap * stride * 4, "LoRA intermediate")?;
            lora.stride = stride;
            // Graphs with LoRA launches name the old buffer and stride.
            self.graphs.retain(|&(_, with_lora), _| !with_lora);
        }
        let at = lora.table.at(slot * n_targets * LORA_ENTRY_BYTES);
        // SAFETY: the slot's entries lie inside the table (slot < slots); the host vector lives
        // until the synchronize below.
        unsafe { cudarc::driver::result::memcpy_htod_async(at, &entries, self.stream.cu_stream()) }
            .map_err(|e| driver_error(self.ordinal, "writing the LoRA table", e))?;
        self.stream.synchronize().map_err(|e| driver_error(self.ordinal, "writing the LoRA table", e))?;
        // What the slot held is freed here; nothing refers to it any more.
        lora.slots[slot] = fresh;
        Ok(())
    }

    /// Byte offset of `block` within a pool plane, and the block's size in bytes.
    fn block_span(&self, block: BlockId) -> (usize, usize) {
        let bytes = self.kv_layout().block_bytes();
        (block as usize * bytes, bytes)
    }
}

impl Backend for CudaBackend {
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
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
        self.bind()?;
        let out = self.forward_impl(batch);
        self.settle(&out);
        out
    }

    fn forward_greedy(&mut self, batch: &[SeqChunk<'_>]) -> Result<Vec<Option<(u32, f32)>>> {
        self.bind()?;
        let out = self.forward_greedy_impl(batch);
        self.settle(&out);
        out
    }

    fn samples_on_device(&self) -> bool {
        self.opts.device_sampling
    }

    fn forward_sampled(
        &mut self,
        batch: &[SeqChunk<'_>],
        rows: &mut dyn FnMut() -> Vec<Option<RowSampling>>,
    ) -> Result<Vec<DevicePick>> {
        self.bind()?;
        let out = self.forward_sampled_impl(batch, rows);
        self.settle(&out);
        out
    }

    fn commit_staged(&mut self, accepted: &[usize]) -> Result<()> {
        self.bind()?;
        self.commit_impl(accepted)
    }

    fn discard_staged(&mut self) {
        self.staged = None;
    }

    fn adapter_slots(&self) -> usize {
        self.lora.as_ref().map_or(0, |l| l.slots.len())
    }

    fn set_adapter(&mut self, slot: usize, adapter: Option<Arc<LoraAdapter>>) -> Result<()> {
        self.set_adapter_impl(slot, adapter)
    }

    fn staged_pending(&self) -> bool {
        self.staged.is_some()
    }

    fn copy_block(&mut self, src: BlockId, dst: BlockId) -> Result<()> {
        self.check_block("copy_block", 0, src)?;
        self.check_block("copy_block", 0, dst)?;
        self.bind()?;
        let (s_off, bytes) = self.block_span(src);
        let (d_off, _) = self.block_span(dst);
        for l in 0..self.config.num_layers {
            for kv in 0..2 {
                let plane = self.pool_plane(l, kv);
                // SAFETY: both blocks lie inside the plane (checked above).
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        plane + d_off as u64,
                        plane + s_off as u64,
                        bytes,
                        self.stream.cu_stream(),
                    )
                }
                .map_err(self.err("copying a KV block"))?;
            }
        }
        self.stream.synchronize().map_err(self.err("copying a KV block"))
    }

    fn read_block(&self, layer: usize, block: BlockId) -> Result<(Vec<u8>, Vec<u8>)> {
        let bytes = self.kv_layout().block_bytes();
        let (mut k, mut v) = (vec![0u8; bytes], vec![0u8; bytes]);
        self.read_block_into(layer, block, &mut k, &mut v)?;
        Ok((k, v))
    }

    fn read_block_into(&self, layer: usize, block: BlockId, k: &mut [u8], v: &mut [u8]) -> Result<()> {
        self.bind()?;
        Ok(self.pool.read(&self.stream, layer, block, k, v)?)
    }

    fn kv_sink(&self) -> Option<Arc<dyn crate::kv::KvBlockSink>> {
        match CudaKvSink::new(self.pool.clone()) {
            Ok(sink) => Some(Arc::new(sink)),
            Err(e) => {
                tracing::error!(device = %self.device(), error = %e, "cannot create the KV transfer sink");
                None
            }
        }
    }

    fn write_block(&mut self, layer: usize, block: BlockId, k: &[u8], v: &[u8]) -> Result<()> {
        self.bind()?;
        Ok(self.pool.write(&self.stream, layer, block, k, v)?)
    }

    unsafe fn copy_pages_out(
        &self,
        blocks: &[BlockId],
        pages: &mut [crate::kv::Page],
    ) -> Result<Option<Box<dyn crate::kv::SpillCopy>>> {
        self.bind()?;
        let mut views: Vec<&mut [u8]> = pages.iter_mut().map(|p| &mut p[..]).collect();
        // SAFETY: the caller keeps the pages' memory until the returned copy's wait returns; on
        // an error the stream has been waited for, or the pages are leaked below.
        let queued = unsafe { self.pool.read_pages_async(&self.stream, blocks, &mut views) };
        let failed = match queued {
            Ok(()) => match self.stream.record_event(None) {
                Ok(event) => {
                    return Ok(Some(Box::new(super::mem::StreamCopy { ctx: self.ctx.clone(), event })))
                }
                // No event to wait for: wait for the stream, so the pages are complete now.
                Err(e) => match super::mem::wait_stream(&self.ctx, &self.stream) {
                    Ok(()) => return Ok(None),
                    Err(_) => (self.err("copying KV pages out")(e), false),
                },
            },
            Err((e, waited)) => (EngineError::from(e), waited),
        };
        if !failed.1 {
            // The copies may still land: their memory is never given back.
            leak_pages(pages);
        }
        Err(failed.0)
    }

    fn write_pages(&mut self, blocks: &[BlockId], pages: &[&[u8]]) -> Result<()> {
        self.bind()?;
        Ok(self.pool.write_pages(&self.stream, blocks, pages)?)
    }

    fn host_memory(&self, bytes: usize) -> Option<Result<Box<dyn crate::kv::HostMemory>>> {
        Some(
            super::mem::PinnedMemory::alloc(&self.ctx, bytes)
                .map(|m| Box::new(m) as Box<dyn crate::kv::HostMemory>),
        )
    }

    fn device_kv_pool(&self) -> Option<crate::kv::DeviceKvPool> {
        Some(self.pool.device_pool())
    }

    fn pass_launches(&self) -> Option<(u64, u64)> {
        use std::sync::atomic::Ordering::Relaxed;
        Some((self.passes_encoded.load(Relaxed), self.pass_launches.load(Relaxed)))
    }
}

/// Leaves each page's memory to copies that may still write into it: the pages become empty and
/// their slots are never given back.
fn leak_pages(pages: &mut [crate::kv::Page]) {
    for p in pages {
        std::mem::forget(std::mem::replace(p, crate::kv::Page::heap(0)));
    }
    tracing::error!(
        "KV page copies out of the GPU pool could not be waited for; their host memory is leaked"
    );
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Buffers free themselves; make sure nothing still runs on them first.
        let _ = super::bind(&self.ctx);
        let _ = self.stream.synchronize();
        self.graphs.clear();
    }
}

/// Uploads host data to one instance's device.
struct Uploader<'a> {
    ctx: &'a Arc<CudaContext>,
    stream: &'a Arc<CudaStream>,
    ordinal: usize,
}

impl Uploader<'_> {
    fn bytes<T>(&self, data: &[T], what: &'static str) -> Result<DevBuf> {
        let buf = DevBuf::alloc(self.ctx, std::mem::size_of_val(data), what)?;
        // SAFETY: `buf` holds exactly `data`'s bytes.
        unsafe { self.copy_to(buf.ptr(), data, what)? };
        Ok(buf)
    }

    /// Copies `data` to `dst` and waits for the copy.
    ///
    /// # Safety
    /// `dst` holds `data`'s bytes in a live allocation of this context.
    unsafe fn copy_to<T>(&self, dst: CUdeviceptr, data: &[T], what: &'static str) -> Result<()> {
        let err = |e| driver_error(self.ordinal, &format!("uploading {what}"), e);
        // SAFETY: `dst` holds `data`'s bytes (the caller's promise); `data` outlives the
        // synchronize below.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, data, self.stream.cu_stream()) }
            .map_err(err)?;
        self.stream.synchronize().map_err(err)
    }

    fn f32s(&self, data: &[f32], what: &'static str) -> Result<DevBuf> {
        self.bytes(data, what)
    }

    /// Dequantizes a matrix on the host (all cores) and copies it in the compute dtype to `dst`
    /// (`rows × cols × dtype` bytes of a live allocation of this context).
    fn upload_matrix(
        &self,
        m: &Matrix,
        dtype: ComputeDtype,
        dst: CUdeviceptr,
        what: &'static str,
    ) -> Result<()> {
        let mut f = vec![0f32; m.rows * m.cols];
        f.par_chunks_mut(m.cols.max(1)).enumerate().for_each(|(r, row)| m.dequantize_row(r, row));
        // SAFETY: `dst` holds the matrix's bytes in `dtype` (the caller's promise).
        match dtype {
            ComputeDtype::F32 => unsafe { self.copy_to(dst, &f, what) },
            ComputeDtype::Bf16 => {
                let b: Vec<u16> = f.par_iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
                drop(f);
                unsafe { self.copy_to(dst, &b, what) }
            }
        }
    }

    /// Uploads the weights. The matrices of each fused group (same columns, each in no other
    /// group) go into one allocation, one after another in the group's order, so the group is
    /// also one matrix; every other matrix gets its own.
    fn weights(&self, w: &WeightStore, dtype: ComputeDtype, groups: &[Vec<MatId>]) -> Result<DevWeights> {
        let n = w.mats.len();
        let mut uses = vec![0usize; n];
        groups.iter().flatten().for_each(|m| {
            if let Some(u) = uses.get_mut(m.0 as usize) {
                *u += 1;
            }
        });
        let dsz = dtype_bytes(dtype);
        // Members one after another keep cuBLAS's 256-byte alignment only where each is a multiple
        // of 256 bytes; a group that is not stays apart.
        let fusable = |g: &Vec<MatId>| {
            g.len() > 1
                && g.iter().all(|m| uses.get(m.0 as usize) == Some(&1))
                && g.iter().all(|m| {
                    let (src, _) = &w.mats[m.0 as usize];
                    src.cols == w.mats[g[0].0 as usize].0.cols
                        && (src.rows * src.cols * dsz).is_multiple_of(256)
                })
        };
        let mut mats: Vec<Option<DevMatrix>> = vec![None; n];
        let mut fused = HashMap::new();
        for g in groups.iter().filter(|g| fusable(g)) {
            let rows: usize = g.iter().map(|m| w.mats[m.0 as usize].0.rows).sum();
            let cols = w.mats[g[0].0 as usize].0.cols;
            let buf = Arc::new(DevBuf::alloc(self.ctx, rows * cols * dsz, "fused weight matrices")?);
            let mut offset = 0;
            for m in g {
                let src = &w.mats[m.0 as usize].0;
                self.upload_matrix(src, dtype, buf.at(offset), "fused weight matrices")?;
                mats[m.0 as usize] =
                    Some(DevMatrix { buf: buf.clone(), offset, rows: src.rows, cols: src.cols });
                offset += src.rows * src.cols * dsz;
            }
            fused.insert(g[0], (g.clone(), DevMatrix { buf, offset: 0, rows, cols }));
        }
        let mats = mats
            .into_iter()
            .zip(&w.mats)
            .map(|(d, (m, _))| match d {
                Some(d) => Ok(d),
                None => {
                    let buf = DevBuf::alloc(self.ctx, m.rows * m.cols * dsz, "weight matrix")?;
                    self.upload_matrix(m, dtype, buf.ptr(), "weight matrix")?;
                    Ok(DevMatrix { buf: Arc::new(buf), offset: 0, rows: m.rows, cols: m.cols })
                }
            })
            .collect::<Result<_>>()?;
        let vecs = w.vecs.iter().map(|v| self.f32s(v, "weight vector")).collect::<Result<_>>()?;
        Ok(DevWeights { mats, vecs, fused })
    }
}

/// The backend during the encoding of one pass: every [`Ops`] call enqueues kernels on the
/// instance's stream (nothing waits), over scratch buffers sized for the largest pass.
struct CudaPass<'a> {
    be: &'a CudaBackend,
    /// Tokens of the pass (padded, for a graph bucket).
    n: usize,
    splits: usize,
    /// Rows of logits the pass returns.
    rows: usize,
    staged: bool,
    /// Tiles of the tiled attention (metadata region 8); 0: split-K attention.
    tiles: usize,
    lora: &'a PassLora,
    /// The layer, K and V buffers whose KV write `qkv_split` already did: that layer's
    /// attention on those buffers skips its `kv_write`.
    kv_written: Option<(usize, Buf, Buf)>,
    /// A norm or a product waiting to be fused into what follows (decode products); at most one
    /// of them at a time, launched by [`CudaPass::settle`] before anything else.
    pending_norm: Option<PendingNorm>,
    pending_linear: Option<PendingLinear>,
}

impl CudaPass<'_> {
    fn spec(&self, b: Buf) -> Result<BufSpec> {
        self.be
            .ws
            .scratch
            .get(b.0 as usize)
            .map(|s| s.spec)
            .ok_or_else(|| EngineError::Internal(format!("model pass: buffer {} is not declared", b.0)))
    }

    fn ptr(&self, b: Buf) -> Result<CUdeviceptr> {
        self.be.scratch_ptr(b, self.rows)
    }

    /// Rows of a buffer in this pass.
    fn rows_of(&self, spec: &BufSpec) -> usize {
        match spec.rows {
            Rows::Tokens => self.n,
            Rows::Logits => self.rows,
        }
    }

    fn vec(&self, w: VecId) -> Result<&DevBuf> {
        self.be
            .weights
            .vecs
            .get(w.0 as usize)
            .ok_or_else(|| EngineError::Internal(format!("model pass: vector {} is not declared", w.0)))
    }

    fn mat(&self, w: MatId) -> Result<&DevMatrix> {
        self.be
            .weights
            .mats
            .get(w.0 as usize)
            .ok_or_else(|| EngineError::Internal(format!("model pass: matrix {} is not declared", w.0)))
    }

    /// The `_f32` or `_mat` variant of a kernel, for the buffer it writes.
    fn variant<'k>(&self, out: &BufSpec, f32: &'k CudaFunction, mat: &'k CudaFunction) -> &'k CudaFunction {
        match out.kind {
            BufKind::F32 => f32,
            BufKind::MatIn => mat,
        }
    }

    /// Whether [`Ops::lora`] launches kernels for `target` in this pass: every projection in a
    /// graph with LoRA launches, those some adapter of the pass has a delta for in an eager pass,
    /// none without adapters.
    fn lora_launches(&self, target: LoraTarget) -> bool {
        let Some(l) = self.be.lora.as_ref() else { return false };
        match self.lora {
            PassLora::Off => false,
            PassLora::Every => true,
            PassLora::Slots(slots) => slots.iter().any(|&s| {
                l.slots
                    .get(s as usize)
                    .and_then(Option::as_ref)
                    .is_some_and(|a| a.adapter.weight(target).is_some())
            }),
        }
    }

    /// Rotary table `rope`'s cos and sin on the device.
    fn rope_table(&self, rope: RopeId) -> Result<&(DevBuf, DevBuf)> {
        self.be.ropes.get(rope.0 as usize).ok_or_else(|| {
            EngineError::Internal(format!("model pass: rope table {} is not declared", rope.0))
        })
    }

    /// The fused group `members` as one matrix, where it was stored as one and this pass can use
    /// it: a token-rows matrix input, its product fitting the fused buffer, no LoRA on its
    /// projections.
    fn fused_mat(&self, members: &[MatId], x: &BufSpec, lora: &[LoraTarget]) -> Option<DevMatrix> {
        let be = self.be;
        let m = be.weights.fused(members)?;
        let input_ok = x.rows == Rows::Tokens
            && x.width == m.cols
            && (x.kind == BufKind::MatIn || be.opts.dtype == ComputeDtype::F32);
        let lora_free = !lora.iter().any(|&t| self.lora_launches(t));
        (input_ok && m.rows <= be.ws.fused_rows && lora_free).then(|| m.clone())
    }

    /// Whether this pass's products over `cols` inputs run in the decode products of our own: a
    /// bf16 pass of at most [`GEMV_MAX_N`] tokens whose inputs fit the kernels' shared memory.
    fn gemv_fits(&self, cols: usize) -> bool {
        let be = self.be;
        be.k.gemv.is_some()
            && be.opts.decode_gemv
            && self.n <= GEMV_MAX_N
            && cols.is_multiple_of(8)
            && self.n * cols * 2 <= be.k.gemv_shared
    }

    /// Whether `x` (f32 residual rows) may wait in a [`PendingNorm`] into `out`.
    fn norm_may_wait(&self, xs: &BufSpec, os: &BufSpec) -> bool {
        self.gemv_fits(xs.width)
            && xs.kind == BufKind::F32
            && os.kind == BufKind::MatIn
            && xs.rows == Rows::Tokens
            && os.rows == Rows::Tokens
            && os.width == xs.width
    }

    /// Launches what waits ([`CudaPass::pending_linear`], [`CudaPass::pending_norm`]) as it
    /// would have run unfused. Every operation that does not consume it calls this first, and the
    /// pass ends with it.
    fn settle(&mut self) -> Result<()> {
        if let Some(pl) = self.pending_linear.take() {
            let y = self.ptr(pl.y)?;
            self.gemv(GemvIn::Mat(pl.x), &pl.m, GemvOut::Store(y))?;
        }
        if let Some(pn) = self.pending_norm.take() {
            self.launch_rms_norm(pn.x, pn.w, pn.eps, pn.out)?;
        }
        Ok(())
    }

    /// The `rms_norm` kernel over every row of `x` into `out` (in `out`'s dtype).
    fn launch_rms_norm(&self, x: Buf, w: VecId, eps: f32, out: Buf) -> Result<()> {
        let be = self.be;
        let (xs, os) = (self.spec(x)?, self.spec(out)?);
        let threads = (xs.width.next_power_of_two().clamp(32, 1024)) as u32;
        let f = self.variant(&os, &be.k.rms_norm_f32, &be.k.rms_norm_mat);
        let null: CUdeviceptr = 0;
        let (xp, wp, op) = (self.ptr(x)?, self.vec(w)?.ptr(), self.ptr(out)?);
        launch_fn!(be, f, "launching rms_norm", per_row(self.rows_of(&xs), threads);
            xp, wp, null, op, xs.width as i32, eps)
    }

    /// A decode kernel's launch: one warp per output row at a time over `rows` rows (blocks of
    /// [`GEMV_THREADS`]), `grid_y` rows of blocks (one per expert of a mixture), and the
    /// tokens' inputs in `shared` bytes of dynamic shared memory.
    fn gemv_launch(rows: usize, grid_y: usize, shared: usize) -> LaunchConfig {
        let warps = (GEMV_THREADS / 32) as usize;
        LaunchConfig {
            grid_dim: (rows.div_ceil(warps).clamp(1, 65535) as u32, grid_y as u32, 1),
            block_dim: (GEMV_THREADS, 1, 1),
            shared_mem_bytes: shared as u32,
        }
    }

    /// The input of a decode product over `x`: the pending norm where it writes `x`, else `x`
    /// itself once whatever waits has been launched.
    fn gemv_input(&mut self, x: Buf) -> Result<GemvIn> {
        match self.pending_norm {
            Some(pn) if pn.out == x => {
                self.pending_norm = None;
                Ok(GemvIn::Norm(pn))
            }
            _ => {
                self.settle()?;
                Ok(GemvIn::Mat(x))
            }
        }
    }

    /// One decode product (`gemv_*`) of matrix `m` over the pass's tokens. A gated output reads
    /// `m` as gate rows then up rows.
    fn gemv(&self, input: GemvIn, m: &DevMatrix, output: GemvOut) -> Result<()> {
        let be = self.be;
        let Some(k) = be.k.gemv.as_ref() else {
            return Err(EngineError::Internal("decode products need a bf16 pass".into()));
        };
        fn bad<T>(what: &str) -> Result<T> {
            Err(EngineError::Internal(format!("model pass: decode product: {what}")))
        }
        let (cols, n) = (m.cols, self.n);
        let rows = match output {
            GemvOut::Gated { .. } => m.rows / 2,
            _ => m.rows,
        };
        if !self.gemv_fits(cols) || (matches!(output, GemvOut::Gated { .. }) && !m.rows.is_multiple_of(2)) {
            return bad("the shape does not fit the kernels");
        }
        let null: CUdeviceptr = 0;
        let (xm, xr, nw, eps, xn_out) = match input {
            GemvIn::Mat(x) => {
                let xs = self.spec(x)?;
                if xs.kind != BufKind::MatIn || xs.width != cols || xs.rows != Rows::Tokens {
                    return bad("the input is not a matrix input of the matrix's width");
                }
                (self.ptr(x)?, null, null, 0.0f32, null)
            }
            GemvIn::Norm(pn) => {
                let (xs, os) = (self.spec(pn.x)?, self.spec(pn.out)?);
                if !self.norm_may_wait(&xs, &os) || xs.width != cols {
                    return bad("the normalized input does not fit the matrix");
                }
                (null, self.ptr(pn.x)?, self.vec(pn.w)?.ptr(), pn.eps, self.ptr(pn.out)?)
            }
        };
        let f32_rows = |b: Buf| -> Result<CUdeviceptr> {
            let sp = self.spec(b)?;
            if sp.kind != BufKind::F32 || sp.width != rows || sp.rows != Rows::Tokens {
                return bad("the output is not an f32 buffer of the matrix's rows");
            }
            self.ptr(b)
        };
        let (f, y, res, out) = match (&input, output) {
            (GemvIn::Mat(_), GemvOut::Store(y)) => (&k.mat, y, null, null),
            (GemvIn::Norm(_), GemvOut::Store(y)) => (&k.norm, y, null, null),
            (GemvIn::Mat(_), GemvOut::AddInto { y, res }) => (&k.mat_add, f32_rows(y)?, f32_rows(res)?, null),
            (GemvIn::Norm(_), GemvOut::AddInto { .. }) => {
                return bad("a normalized input with a residual add")
            }
            (_, GemvOut::Gated { act, out }) => {
                let os = self.spec(out)?;
                if os.kind != BufKind::MatIn || os.width != rows || os.rows != Rows::Tokens {
                    return bad("the gated output is not a matrix input of half the matrix's rows");
                }
                let f = match (&input, act) {
                    (GemvIn::Mat(_), Activation::Silu) => &k.mat_silu,
                    (GemvIn::Mat(_), Activation::GeluTanh) => &k.mat_gelu,
                    (GemvIn::Norm(_), Activation::Silu) => &k.norm_silu,
                    (GemvIn::Norm(_), Activation::GeluTanh) => &k.norm_gelu,
                };
                (f, null, null, self.ptr(out)?)
            }
        };
        let cfg = Self::gemv_launch(rows, 1, n * cols * 2);
        launch_fn!(be, f, "launching a decode product", cfg;
            m.ptr(), rows as i32, cols as i32, xm, xr, nw, eps, xn_out, y, res, out, n as i32)
    }
}

/// A target's index in a slot's row of the LoRA table (`layer * 7 + projection`).
fn lora_target_index(t: LoraTarget) -> usize {
    t.layer as usize * Proj::ALL.len() + t.proj as usize
}

fn per_row(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

fn flat(count: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (count.div_ceil(256).clamp(1, 65535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Ops for CudaPass<'_> {
    fn as_dyn(&mut self) -> &mut dyn Ops {
        self
    }

    fn embed(&mut self, table: MatId, scale: Option<f32>, out: Buf) -> Result<()> {
        self.settle()?;
        let be = self.be;
        let m = self.mat(table)?;
        let (o, spec) = (self.ptr(out)?, self.spec(out)?);
        if spec.width != m.cols || spec.kind != BufKind::F32 {
            return Err(EngineError::Internal("model pass: embedding buffer".into()));
        }
        let (tokens, s) = (be.meta(0), scale.unwrap_or(1.0));
        launch!(be, embed, per_row(self.n, 256); m.ptr(), tokens, o, m.cols as i32, s)
    }

    /// In a pass whose products run in the decode products of our own, the norm waits: the
    /// product reading `out` next takes it as its prologue.
    fn rms_norm(&mut self, x: Buf, w: VecId, eps: f32, out: Buf) -> Result<()> {
        self.settle()?;
        let (xs, os) = (self.spec(x)?, self.spec(out)?);
        if self.norm_may_wait(&xs, &os) && x != out {
            self.vec(w)?;
            self.pending_norm = Some(PendingNorm { x, w, eps, out });
            return Ok(());
        }
        self.launch_rms_norm(x, w, eps, out)
    }

    /// One kernel: the residual add and the norm ([`Ops::add_rms_norm`]). Where the product
    /// that made `y` waits, it adds into `x` itself and the norm waits for the next product.
    fn add_rms_norm(&mut self, x: Buf, y: Buf, w: VecId, eps: f32, out: Buf) -> Result<()> {
        let be = self.be;
        let (xs, ys, os) = (self.spec(x)?, self.spec(y)?, self.spec(out)?);
        if xs.kind != BufKind::F32
            || ys.kind != BufKind::F32
            || ys.width != xs.width
            || ys.rows != xs.rows
            || os.width != xs.width
            || x == y
            || x == out
            || y == out
        {
            return Err(EngineError::Internal("model pass: add_rms_norm buffers".into()));
        }
        if self.pending_linear.as_ref().is_some_and(|pl| pl.y == y && pl.x != x) {
            self.add(x, y)?;
            return self.rms_norm(x, w, eps, out);
        }
        self.settle()?;
        let width = xs.width;
        let threads = (width.next_power_of_two().clamp(32, 1024)) as u32;
        let f = self.variant(&os, &be.k.add_rms_norm_f32, &be.k.add_rms_norm_mat);
        let (xp, yp, wp, op) = (self.ptr(x)?, self.ptr(y)?, self.vec(w)?.ptr(), self.ptr(out)?);
        launch_fn!(be, f, "launching add_rms_norm", per_row(self.rows_of(&xs), threads); xp, yp, wp, op, width as i32, eps)
    }

    fn head_rms_norm(&mut self, x: Buf, w: VecId, head_dim: usize, eps: f32) -> Result<()> {
        self.settle()?;
        let be = self.be;
        let xs = self.spec(x)?;
        let nrows = self.rows_of(&xs) * xs.width / head_dim;
        let (xp, wp) = (self.ptr(x)?, self.vec(w)?.ptr());
        launch!(be, head_rms_norm, per_row(nrows.div_ceil(4), 128); xp, wp, nrows as i32, head_dim as i32, eps)
    }

    /// In a pass whose products run in the decode products of our own, a single product into
    /// an f32 buffer waits: a residual add of its output next takes it as its epilogue.
    fn linear(&mut self, x: Buf, outs: &[(MatId, Buf)]) -> Result<()> {
        self.settle()?;
        let xs = self.spec(x)?;
        if let [(w, y)] = *outs {
            let m = self.mat(w)?;
            let ys = self.spec(y)?;
            let fits = self.gemv_fits(m.cols)
                && xs.kind == BufKind::MatIn
                && xs.rows == Rows::Tokens
                && xs.width == m.cols
                && ys.kind == BufKind::F32
                && ys.rows == Rows::Tokens
                && ys.width == m.rows
                && x != y;
            if fits {
                self.pending_linear = Some(PendingLinear { x, m: m.clone(), y });
                return Ok(());
            }
        }
        if xs.kind != BufKind::MatIn && self.be.opts.dtype != ComputeDtype::F32 {
            return Err(EngineError::Internal(
                "model pass: a matrix input buffer must be declared MatIn".into(),
            ));
        }
        let xp = self.ptr(x)?;
        for &(w, y) in outs {
            let m = self.mat(w)?;
            if m.cols != xs.width || self.spec(y)?.width != m.rows {
                return Err(EngineError::Internal(format!(
                    "model pass: matrix {} does not fit its buffers",
                    w.0
                )));
            }
            self.be.gemm(m, xp, self.rows_of(&xs), self.ptr(y)?)?;
        }
        Ok(())
    }

    /// Per group of up to [`LORA_MAX_OUTS`] projections: `lora_shrink` (x · Aᵀ into the
    /// intermediate, per token through its slot's table entry) then `lora_expand` (adds
    /// scale · mid · Bᵀ to each output). Tokens without an adapter, or whose adapter has no delta
    /// for a projection, are skipped by the kernels; an eager pass launches only for projections
    /// some adapter of the pass targets, a graph for all of them ([`PassLora`]).
    fn lora(&mut self, x: Buf, outs: &[(LoraTarget, Buf)]) -> Result<()> {
        let be = self.be;
        let Some(l) = be.lora.as_ref() else { return Ok(()) };
        let active: Vec<(LoraTarget, Buf)> =
            outs.iter().copied().filter(|(t, _)| self.lora_launches(*t)).collect();
        if active.is_empty() {
            return Ok(());
        }
        self.settle()?;
        let c = &be.config;
        let xs = self.spec(x)?;
        let bad = |what: String| Err(EngineError::Internal(format!("model pass: lora: {what}")));
        if xs.rows != Rows::Tokens {
            return bad("the input is not a token-rows buffer".into());
        }
        let mut ys = Vec::with_capacity(active.len());
        for &(t, y) in &active {
            let (din, dout) = t.proj.dims(c);
            let ysp = self.spec(y)?;
            if t.layer as usize >= c.num_layers {
                return bad(format!("layer {} of {}", t.layer, c.num_layers));
            }
            if y == x || ysp.kind != BufKind::F32 || ysp.rows != Rows::Tokens {
                return bad(format!(
                    "the output of {} of layer {} must be an f32 token-rows buffer other than the input",
                    t.proj, t.layer
                ));
            }
            if xs.width != din || ysp.width != dout {
                return bad(format!(
                    "{} of layer {} is {din}→{dout} but the buffers are {}→{}",
                    t.proj, t.layer, xs.width, ysp.width
                ));
            }
            if ys.iter().any(|&(_, other, _)| other == y) {
                return bad("two projections write one buffer".into());
            }
            ys.push((lora_target_index(t) as i32, y, dout));
        }
        let n = self.n;
        let n_targets = (c.num_layers * Proj::ALL.len()) as i32;
        let (xp, slots, table, mid) = (self.ptr(x)?, be.meta(9), l.table.ptr(), l.mid.ptr());
        let tiles = n.div_ceil(LORA_TILE) as u32;
        let shrink = self.variant(&xs, &be.k.lora_shrink_f32, &be.k.lora_shrink_mat);
        for group in ys.chunks(LORA_MAX_OUTS) {
            let mut targets = [group[0].0; LORA_MAX_OUTS];
            let mut y_ptrs: [CUdeviceptr; LORA_MAX_OUTS] = [0; LORA_MAX_OUTS];
            let mut douts = [0i32; LORA_MAX_OUTS];
            for (k, &(ti, y, dout)) in group.iter().enumerate() {
                targets[k] = ti;
                y_ptrs[k] = self.ptr(y)?;
                douts[k] = dout as i32;
            }
            let outs = group.len() as u32;
            let cfg = LaunchConfig {
                grid_dim: (tiles, outs, (l.stride / LORA_RANKS) as u32),
                block_dim: ((32 * LORA_RANKS) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            launch_fn!(be, shrink, "launching lora_shrink", cfg;
                xp, slots, table, n_targets, targets[0], targets[1], targets[2], mid, n as i32, xs.width as i32,
                l.stride as i32)?;
            let widest = group.iter().map(|g| g.2).max().unwrap_or(0);
            let cfg = LaunchConfig {
                grid_dim: (tiles, widest.div_ceil(256) as u32, outs),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(be, lora_expand, cfg;
                mid, slots, table, n_targets, targets[0], targets[1], targets[2], y_ptrs[0], y_ptrs[1], y_ptrs[2],
                douts[0], douts[1], douts[2], n as i32, l.stride as i32)?;
        }
        Ok(())
    }

    fn add_bias(&mut self, x: Buf, b: VecId) -> Result<()> {
        self.settle()?;
        let be = self.be;
        let xs = self.spec(x)?;
        let count = self.rows_of(&xs) * xs.width;
        let (xp, bp) = (self.ptr(x)?, self.vec(b)?.ptr());
        launch!(be, add_bias, flat(count); xp, bp, count as i64, xs.width as i32)
    }

    fn rope(&mut self, x: Buf, rope: RopeId) -> Result<()> {
        self.settle()?;
        let be = self.be;
        let (cos, sin) = self.rope_table(rope)?;
        let dims = be.model.ropes()[rope.0 as usize].dims;
        let xs = self.spec(x)?;
        let heads = xs.width / dims;
        let threads = ((heads * dims / 2).next_power_of_two().clamp(32, 1024)) as u32;
        let xp = self.ptr(x)?;
        launch!(be, rope, per_row(self.n, threads); xp, cos.ptr(), sin.ptr(), be.meta(1), heads as i32, dims as i32)
    }

    fn attention(&mut self, q: Buf, k: Buf, v: Buf, out: Buf, spec: &AttnSpec) -> Result<()> {
        self.settle()?;
        let be = self.be;
        let c = &be.config;
        let (hd, nh, nkv) = (c.head_dim, c.num_heads, c.num_kv_heads);
        let kvd = nkv * hd;
        let n = self.n;
        let (qp, kp_new, vp_new, op) = (self.ptr(q)?, self.ptr(k)?, self.ptr(v)?, self.ptr(out)?);
        let l = spec.layer;
        let (kp, vp) = (be.pool_plane(l, 0), be.pool_plane(l, 1));
        // Direct chunks' tokens carry their slot, staged chunks' tokens -1 (kv_write skips them).
        // Where qkv_split made these K/V for this layer, it wrote (and rounded) them already.
        if self.kv_written.take() != Some((l, k, v)) {
            let threads = (kvd.next_power_of_two().clamp(32, 1024)) as u32;
            launch!(be, kv_write, per_row(n, threads); kp_new, vp_new, kp, vp, be.meta(2), kvd as i32)?;
        }
        if self.staged {
            for (kv, src) in [(0, kp_new), (1, vp_new)] {
                // SAFETY: both ranges hold n × kvd f32s (n ≤ max_batch_tokens).
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        be.stage_plane(l, kv),
                        src,
                        n * kvd * 4,
                        be.stream.cu_stream(),
                    )
                }
                .map_err(be.err("staging K/V"))?;
            }
        }
        let window = spec.window.map_or(0, |w| w.min(i32::MAX as usize) as i32);
        let softcap = spec.softcap.unwrap_or(0.0);
        let (tok_chunk, pos, chunk_start, chunk_base, chunk_bt) =
            (be.meta(3), be.meta(1), be.meta(4), be.meta(5), be.meta(6));
        let tables = be.meta(META_REGIONS);
        // A pass is given tiles only where a tiled kernel applies (`tiling` is Some).
        if let (1.., Some(tl)) = (self.tiles, be.tiling()) {
            let os = self.spec(out)?;
            let (f, threads) = match tl.kernel {
                TileKernel::CudaCores => {
                    (self.variant(&os, &be.k.attn_tiled_f32, &be.k.attn_tiled_mat), TILE_THREADS)
                }
                TileKernel::TensorCores => match (&be.k.attn_mma, os.kind) {
                    (Some(f), BufKind::MatIn) => (f, MMA_THREADS),
                    _ => {
                        return Err(EngineError::Internal(
                            "tensor-core attention needs a bf16 output buffer and a kernel for the head \
                             dimension"
                                .into(),
                        ))
                    }
                },
            };
            let cfg = LaunchConfig {
                grid_dim: (self.tiles as u32, (nh / tl.heads) as u32, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            };
            return launch_fn!(be, f, cfg;
                qp, kp_new, vp_new, kp, vp, tok_chunk, pos, chunk_start, chunk_base, chunk_bt, tables,
                be.meta(8), op, n as i32, nh as i32, nkv as i32, hd as i32, be.opts.block_size as i32, window,
                spec.scale, softcap, tl.heads as i32, tl.tokens as i32);
        }
        let attn_cfg = LaunchConfig {
            grid_dim: ((n * nh) as u32, self.splits as u32, 1),
            block_dim: (ATTN_THREADS, 1, 1),
            shared_mem_bytes: (ATTN_THREADS / 32) * hd as u32 * 4,
        };
        // The last slice of each (token, head) merges them into `out`, in its dtype.
        let null: CUdeviceptr = 0;
        let (out32, out16) = match (self.spec(out)?.kind, be.opts.dtype) {
            (BufKind::MatIn, ComputeDtype::Bf16) => (null, op),
            _ => (op, null),
        };
        launch!(be, attn_partial, attn_cfg;
            qp, kp_new, vp_new, kp, vp, tok_chunk, pos, chunk_start, chunk_base, chunk_bt,
            tables, be.ws.partial.ptr(), be.ws.attn_done.ptr(), out32, out16, nh as i32, nkv as i32, hd as i32,
            be.opts.block_size as i32, window, spec.scale, softcap)
    }

    fn gated_act(&mut self, gate: Buf, up: Buf, act: Activation, out: Buf) -> Result<()> {
        self.settle()?;
        let be = self.be;
        let (gs, os) = (self.spec(gate)?, self.spec(out)?);
        let count = self.rows_of(&gs) * gs.width;
        let f = match act {
            Activation::Silu => self.variant(&os, &be.k.silu_mul_f32, &be.k.silu_mul_mat),
            Activation::GeluTanh => self.variant(&os, &be.k.gelu_tanh_mul_f32, &be.k.gelu_tanh_mul_mat),
        };
        let (gp, up_p, op) = (self.ptr(gate)?, self.ptr(up)?, self.ptr(out)?);
        launch_fn!(be, f, flat(count); gp, up_p, op, count as i64)
    }

    /// Where Q, K and V were stored as one matrix: one GEMM into the fused buffer, then
    /// `qkv_split` (biases, q/k norms, RoPE, split into q, k, v) in one kernel; otherwise the
    /// operations one by one.
    fn attn_inputs(&mut self, x: Buf, p: &AttnInputs, q: Buf, k: Buf, v: Buf) -> Result<()> {
        let be = self.be;
        let c = &be.config;
        let (hd, nh, nkv) = (p.head_dim, c.num_heads, c.num_kv_heads);
        let xs = self.spec(x)?;
        let (qs, ks, vs) = (self.spec(q)?, self.spec(k)?, self.spec(v)?);
        let dims = be.model.ropes().get(p.rope.0 as usize).map(|r| r.dims);
        let shapes_ok = dims == Some(hd)
            && hd % 2 == 0
            && hd <= MAX_HEAD_DIM
            && [qs.width, ks.width, vs.width] == [nh * hd, nkv * hd, nkv * hd]
            && [&qs, &ks, &vs].iter().all(|s| s.kind == BufKind::F32 && s.rows == Rows::Tokens);
        let fused = if shapes_ok { self.fused_mat(&[p.wq, p.wk, p.wv], &xs, &p.lora) } else { None };
        let Some(m) = fused.filter(|m| m.rows == (nh + 2 * nkv) * hd) else {
            self.settle()?;
            return attn_inputs_unfused(self, x, p, q, k, v);
        };
        let gemv = self.gemv_fits(m.cols);
        if !gemv {
            self.settle()?;
        }
        // Every handle is checked before anything is queued.
        let (cos, sin) = self.rope_table(p.rope).map(|(c, s)| (c.ptr(), s.ptr()))?;
        let opt = |w: Option<VecId>| -> Result<CUdeviceptr> { w.map_or(Ok(0), |w| Ok(self.vec(w)?.ptr())) };
        let [bq, bk, bv] = match p.bias {
            Some([a, b, c]) => [opt(Some(a))?, opt(Some(b))?, opt(Some(c))?],
            None => [0; 3],
        };
        let (wq, wk) = (opt(p.q_norm)?, opt(p.k_norm)?);
        let (xp, qp, kp, vp) = (self.ptr(x)?, self.ptr(q)?, self.ptr(k)?, self.ptr(v)?);
        if p.layer >= c.num_layers {
            return Err(EngineError::Internal(format!("model pass: layer {} of {}", p.layer, c.num_layers)));
        }
        let (k_pool, v_pool) = (be.pool_plane(p.layer, 0), be.pool_plane(p.layer, 1));
        let n = self.n;
        let fp = be.ws.fused.ptr();
        if gemv {
            // The layer's norm, where it waits, is this product's prologue.
            let input = self.gemv_input(x)?;
            self.gemv(input, &m, GemvOut::Store(fp))?;
        } else {
            be.gemm(&m, xp, n, fp)?;
        }
        let threads = ((nh + 2 * nkv) * 32).clamp(32, 1024) as u32;
        // Direct chunks' tokens carry their slot, staged chunks' tokens -1 (rounded, not stored).
        launch!(be, qkv_split, per_row(n, threads);
            fp, bq, bk, bv, wq, wk, cos, sin, be.meta(1), qp, kp, vp, k_pool, v_pool, be.meta(2),
            nh as i32, nkv as i32, hd as i32, p.eps)?;
        self.kv_written = Some((p.layer, k, v));
        Ok(())
    }

    /// Where gate and up were stored as one matrix: one GEMM into the fused buffer, then the
    /// gated activation reading it; otherwise the operations one by one.
    fn gated_ffn(&mut self, x: Buf, p: &GatedFfn, gate: Buf, up: Buf, out: Buf) -> Result<()> {
        let be = self.be;
        let xs = self.spec(x)?;
        let (gs, us, os) = (self.spec(gate)?, self.spec(up)?, self.spec(out)?);
        let f = gs.width;
        let shapes_ok = us.width == f && os.width == f && os.rows == Rows::Tokens;
        let fused = if shapes_ok { self.fused_mat(&[p.gate, p.up], &xs, &p.lora) } else { None };
        let Some(m) = fused.filter(|m| m.rows == 2 * f) else {
            self.settle()?;
            return gated_ffn_unfused(self, x, p, gate, up, out);
        };
        if self.gemv_fits(m.cols) && os.kind == BufKind::MatIn {
            // One launch: the norm where it waits, gate and up, and the activation.
            let input = self.gemv_input(x)?;
            return self.gemv(input, &m, GemvOut::Gated { act: p.act, out });
        }
        self.settle()?;
        let n = self.n;
        let fp = be.ws.fused.ptr();
        be.gemm(&m, self.ptr(x)?, n, fp)?;
        let kernel = match p.act {
            Activation::Silu => self.variant(&os, &be.k.silu_mul_fused_f32, &be.k.silu_mul_fused_mat),
            Activation::GeluTanh => {
                self.variant(&os, &be.k.gelu_tanh_mul_fused_f32, &be.k.gelu_tanh_mul_fused_mat)
            }
        };
        let count = n * f;
        let op = self.ptr(out)?;
        launch_fn!(be, kernel, "launching a fused gated activation", flat(count); fp, op, f as i32, count as i64)
    }

    /// Graph-capturable and without host synchronization: the router GEMM and the routing kernel
    /// leave each token's weight per expert (0 where it is not routed) on the device; then every
    /// expert runs over all the pass's tokens (gate and up GEMMs, the gated activation, the down
    /// GEMM) and `moe_accumulate` adds its output weighted by those weights, skipping zero
    /// weights. Each expert's weights are read once per pass, at the price of computing every
    /// expert for every token (docs/cuda.md). A decode step of bf16 products (at most
    /// [`GEMV_MAX_N`] tokens) instead runs the routed experts only, all of them in three launches
    /// (`moe_gemv_*` skip an expert no token is routed to, without reading its weights;
    /// `moe_combine` sums as `moe_accumulate` does).
    fn moe(&mut self, x: Buf, spec: &MoeSpec, out: Buf) -> Result<()> {
        self.settle()?;
        let be = self.be;
        let sc = spec.scratch;
        let (xs, os) = (self.spec(x)?, self.spec(out)?);
        let (rs, gs, us, acts, ds) = (
            self.spec(sc.route)?,
            self.spec(sc.gate)?,
            self.spec(sc.up)?,
            self.spec(sc.act)?,
            self.spec(sc.down)?,
        );
        let (h, n_exp, ff) = (xs.width, rs.width, gs.width);
        let mat_in_ok = |s: &BufSpec| s.kind == BufKind::MatIn || be.opts.dtype == ComputeDtype::F32;
        if spec.experts.len() != n_exp
            || !(1..=n_exp.min(MOE_MAX_TOPK)).contains(&spec.top_k)
            || os.width != h
            || ds.width != h
            || us.width != ff
            || acts.width != ff
            || !mat_in_ok(&xs)
            || !mat_in_ok(&acts)
            || [os.kind, rs.kind, gs.kind, us.kind, ds.kind].iter().any(|&k| k != BufKind::F32)
        {
            return Err(EngineError::Internal(format!(
                "model pass: mixture of {} experts (top {}) does not fit its buffers (at most {MOE_MAX_TOPK} \
                 experts per token on CUDA)",
                spec.experts.len(),
                spec.top_k
            )));
        }
        let n = self.rows_of(&xs);
        let (xp, op) = (self.ptr(x)?, self.ptr(out)?);
        let (rp, gp, up_p, ap, dp) = (
            self.ptr(sc.route)?,
            self.ptr(sc.gate)?,
            self.ptr(sc.up)?,
            self.ptr(sc.act)?,
            self.ptr(sc.down)?,
        );
        let shaped = |id: MatId, rows: usize, cols: usize| -> Result<&DevMatrix> {
            let m = self.mat(id)?;
            if m.rows != rows || m.cols != cols {
                return Err(EngineError::Internal(format!(
                    "model pass: matrix {} does not fit its buffers",
                    id.0
                )));
            }
            Ok(m)
        };
        be.gemm(shaped(spec.router, n_exp, h)?, xp, n, rp)?;
        launch!(be, moe_route, flat(n); rp, n as i32, n_exp as i32, spec.top_k as i32, i32::from(spec.renormalize))?;
        // A decode step: the routed experts only, in three launches.
        // The experts' tables, where every expert's matrices have the mixture's shapes (what the
        // routed forms below read through them).
        let table = be.moe_tables.get(&spec.router.0).filter(|t| {
            t.experts == n_exp
                && spec.experts.iter().all(|ex| {
                    [(ex.gate, ff, h), (ex.up, ff, h), (ex.down, h, ff)]
                        .iter()
                        .all(|&(id, r, c)| self.mat(id).is_ok_and(|m| m.rows == r && m.cols == c))
                })
        });
        if let (Some(k), Some(table), true) = (be.k.moe_gemv.as_ref(), table, be.opts.decode_gemv) {
            if self.gemv_fits(h) && self.gemv_fits(ff) && xs.kind == BufKind::MatIn && n == self.n {
                let f = match spec.act {
                    Activation::Silu => &k.silu,
                    Activation::GeluTanh => &k.gelu,
                };
                let (gate_tab, up_tab, down_tab) = table.tables();
                let (acts, ye) = (be.ws.moe_acts.ptr(), be.ws.moe_ye.ptr());
                let grid = |rows: usize, shared: usize| Self::gemv_launch(rows, n_exp, shared);
                launch_fn!(be, f, "launching a decode mixture's gate and up", grid(ff, n * h * 2);
                    gate_tab, up_tab, ff as i32, h as i32, xp, rp, n_exp as i32, acts, n as i32)?;
                launch_fn!(be, &k.down, "launching a decode mixture's down", grid(h, n * ff * 2);
                    down_tab, h as i32, ff as i32, acts, rp, n_exp as i32, ye, n as i32)?;
                return launch_fn!(be, &k.combine, "launching a decode mixture's sum", flat(n * h);
                    op, ye, rp, n_exp as i32, h as i32, n as i32);
            }
        }
        // A larger pass in bf16: each expert over the tokens routed to it, one grouped product per
        // projection.
        if let (Some((buf, size)), Some(table)) = (be.ws.moe_routed.as_ref(), table) {
            // A pass the decode products could not take comes here too; without them
            // (`--no-decode-gemv`), passes they would take keep cuBLAS's dense form, the baseline.
            // The products load bf16 pairs: even widths.
            if (n > GEMV_MAX_N || be.opts.decode_gemv)
                && h % 2 == 0
                && ff % 2 == 0
                && xs.kind == BufKind::MatIn
                && size.holds(n, n_exp, spec.top_k, h, ff)
            {
                let at = size.offsets();
                let b = |i: usize| buf.at(at[i]);
                let (counts, slot_of, sorted_tok, tile_expert, n_tiles, tok_exp, acts, ye) =
                    (b(0), b(1), b(2), b(3), b(4), b(5), b(6), b(7));
                let (gate_tab, up_tab, down_tab) = table.tables();
                let tiles = MoeRoutedSize::new(n, n_exp, spec.top_k, h, ff).tiles as u32;
                let grid = |cols: usize| LaunchConfig {
                    grid_dim: (tiles, cols.div_ceil(MR_COLS) as u32, 1),
                    block_dim: (MR_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let gated = match spec.act {
                    Activation::Silu => &be.k.moe_gemm_silu,
                    Activation::GeluTanh => &be.k.moe_gemm_gelu,
                };
                let top_k = spec.top_k as i32;
                launch!(be, moe_sort, per_row(1, 1024);
                    rp, n as i32, n_exp as i32, top_k, counts, slot_of, sorted_tok, tile_expert, n_tiles, tok_exp)?;
                launch_fn!(be, gated, "launching a mixture's grouped gate and up", grid(ff);
                    gate_tab, up_tab, ff as i32, h as i32, xp, sorted_tok, tile_expert, n_tiles, acts)?;
                launch!(be, moe_gemm_down, grid(h);
                    down_tab, h as i32, ff as i32, acts, tile_expert, n_tiles, ye)?;
                return launch!(be, moe_gather, flat(n * h);
                    op, ye, rp, slot_of, tok_exp, n_exp as i32, top_k, h as i32, n as i32);
            }
        }
        // SAFETY: `out` holds at least n × h f32s; the memset is ordered on this instance's stream.
        unsafe { cudarc::driver::result::memset_d8_async(op, 0, n * h * 4, be.stream.cu_stream()) }
            .map_err(be.err("clearing the mixture's output"))?;
        let act = match spec.act {
            Activation::Silu => self.variant(&acts, &be.k.silu_mul_f32, &be.k.silu_mul_mat),
            Activation::GeluTanh => self.variant(&acts, &be.k.gelu_tanh_mul_f32, &be.k.gelu_tanh_mul_mat),
        };
        for (e, ex) in spec.experts.iter().enumerate() {
            be.gemm(shaped(ex.gate, ff, h)?, xp, n, gp)?;
            be.gemm(shaped(ex.up, ff, h)?, xp, n, up_p)?;
            launch_fn!(be, act, flat(n * ff); gp, up_p, ap, (n * ff) as i64)?;
            be.gemm(shaped(ex.down, h, ff)?, ap, n, dp)?;
            launch!(be, moe_accumulate, flat(n * h); op, dp, rp, e as i32, n_exp as i32, h as i32, (n * h) as i64)?;
        }
        Ok(())
    }

    /// Where the product that made `y` waits, it adds into `x` as it stores `y` (one launch).
    fn add(&mut self, x: Buf, y: Buf) -> Result<()> {
        if let Some(pl) = self.pending_linear.take_if(|pl| pl.y == y && pl.x != x && x != y) {
            return self.gemv(GemvIn::Mat(pl.x), &pl.m, GemvOut::AddInto { y, res: x });
        }
        self.settle()?;
        let be = self.be;
        let xs = self.spec(x)?;
        let count = self.rows_of(&xs) * xs.width;
        let (xp, yp) = (self.ptr(x)?, self.ptr(y)?);
        launch!(be, add_inplace, flat(count); xp, yp, count as i64)
    }

    fn softcap(&mut self, x: Buf, cap: f32) -> Result<()> {
        self.settle()?;
        let be = self.be;
        let xs = self.spec(x)?;
        let count = self.rows_of(&xs) * xs.width;
        let xp = self.ptr(x)?;
        launch!(be, softcap, flat(count); xp, count as i64, cap)
    }

    fn gather_logit_rows(&mut self, x: Buf, out: Buf) -> Result<()> {
        self.settle()?;
        let be = self.be;
        let xs = self.spec(x)?;
        let threads = (xs.width.next_power_of_two().clamp(32, 1024)) as u32;
        let (xp, op) = (self.ptr(x)?, self.ptr(out)?);
        launch!(be, gather_rows, per_row(self.rows, threads); xp, be.meta(7), op, xs.width as i32)
    }
}

/// Lays out a pass's metadata: regions of `max_batch_tokens` i32s for token ids, positions,
/// write slots (-1: none), each token's chunk, each chunk's start position, first row and
/// block-table offset, the logit rows, the first token of each attention tile, and each token's
/// adapter slot (-1: none); then the block tables. With `pad_to`, tokens `n..pad_to` are padding:
/// token 0 at position 0, each its own chunk, writing nowhere, without an adapter, and every
/// row's logits are computed. With `tile_tokens`, each chunk is cut into tiles of at most that
/// many tokens (a tile never crosses a chunk).
fn build_meta(
    batch: &[SeqChunk<'_>],
    pad_to: Option<usize>,
    cap: usize,
    bs: usize,
    tile_tokens: Option<usize>,
) -> PassMeta {
    let mut host = vec![0i32; META_REGIONS * cap];
    let mut tables: Vec<i32> = Vec::new();
    let mut t = 0usize;
    let mut rows = 0usize;
    let mut tiles = 0usize;
    for (ci, ch) in batch.iter().enumerate() {
        if let Some(per) = tile_tokens.filter(|_| pad_to.is_none()) {
            for first in (0..ch.tokens.len()).step_by(per.max(1)) {
                host[8 * cap + tiles] = (t + first) as i32;
                tiles += 1;
            }
        }
        host[4 * cap + ci] = ch.start_pos as i32;
        host[5 * cap + ci] = t as i32;
        host[6 * cap + ci] = tables.len() as i32;
        tables.extend(ch.block_table.iter().map(|&b| b as i32));
        for (j, &tok) in ch.tokens.iter().enumerate() {
            let pos = ch.start_pos + j;
            host[t] = tok as i32;
            host[cap + t] = pos as i32;
            host[2 * cap + t] = match ch.write {
                WriteMode::Direct => (ch.block_table[pos / bs] as usize * bs + pos % bs) as i32,
                WriteMode::Staged => -1,
            };
            host[3 * cap + t] = ci as i32;
            host[9 * cap + t] = ch.adapter.map_or(-1, i32::from);
            let wants = match ch.logits {
                LogitsRequest::None => false,
                LogitsRequest::Last => j + 1 == ch.tokens.len(),
                LogitsRequest::All => true,
            };
            if wants && pad_to.is_none() {
                host[7 * cap + rows] = t as i32;
                rows += 1;
            }
            t += 1;
        }
    }
    let n = t;
    if let Some(padded) = pad_to {
        let chunks = batch.len();
        for p in n..padded {
            let ci = chunks + (p - n);
            host[2 * cap + p] = -1;
            host[3 * cap + p] = ci as i32;
            host[9 * cap + p] = -1;
            host[5 * cap + ci] = p as i32;
        }
        for r in 0..padded {
            host[7 * cap + r] = r as i32;
        }
        rows = padded;
    }
    host.extend(tables);
    PassMeta { n: pad_to.unwrap_or(n), rows, tiles, host }
}

/// Split count for attention over `n` tokens of `heads` query heads whose longest context is
/// `max_len` (`None`: unknown, as in a captured graph), aiming at `target` blocks in all. Gives
/// fewer than `target + n × heads` (token, head, slice) triples, which sizes the partials buffer.
fn splits(n: usize, heads: usize, target: usize, max_len: Option<usize>) -> usize {
    let rows = n * heads;
    if rows >= target {
        return 1;
    }
    let by_len = max_len.map_or(MAX_SPLITS, |l| l.div_ceil(64).max(1));
    target.div_ceil(rows).min(MAX_SPLITS).min(by_len).max(1)
}

/// Device bytes of the weights in the compute dtype (norms and biases f32).
fn weight_device_bytes(w: &WeightStore, dsz: usize) -> usize {
    w.mats.iter().map(|(m, _)| m.rows * m.cols * dsz).sum::<usize>()
        + w.vecs.iter().map(|v| v.len() * 4).sum::<usize>()
}

/// Rows a scratch buffer is allocated for: the pass's token capacity, or the fixed logits rows.
fn scratch_rows(spec: &BufSpec, tokens: usize, logit_rows: usize) -> usize {
    match spec.rows {
        Rows::Tokens => tokens,
        Rows::Logits => logit_rows,
    }
}

/// Bytes per element of a scratch buffer.
fn buf_bytes(spec: &BufSpec, dsz: usize) -> usize {
    match spec.kind {
        BufKind::F32 => 4,
        BufKind::MatIn => dsz,
    }
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(m: &PassMeta, cap: usize, r: usize, len: usize) -> &[i32] {
        &m.host[r * cap..r * cap + len]
    }

    fn shaped(num_heads: usize, num_kv_heads: usize, head_dim: usize) -> ModelConfig {
        let json = format!(
            r#"{{"model_type": "llama", "hidden_size": {}, "intermediate_size": 8, "num_hidden_layers": 1,
                "num_attention_heads": {num_heads}, "num_key_value_heads": {num_kv_heads}, "head_dim": {head_dim},
                "vocab_size": 8, "rms_norm_eps": 1e-6, "max_position_embeddings": 64}}"#,
            num_heads * head_dim
        );
        ModelConfig::from_hf_json(std::path::Path::new("config.json"), &json).unwrap()
    }

    #[test]
    fn kernel_arguments_sit_in_the_first_bytes_of_their_slot() {
        let first = |slot: u64, n: usize| slot.to_ne_bytes()[..n].to_vec();
        assert_eq!(first(arg_slot(-3i32), 4), (-3i32).to_ne_bytes());
        assert_eq!(first(arg_slot(1.5f32), 4), 1.5f32.to_ne_bytes());
        assert_eq!(first(arg_slot(-7i64), 8), (-7i64).to_ne_bytes());
        let addr: CUdeviceptr = 0xdead_beef_0000_1234;
        assert_eq!(arg_slot(addr), addr);
    }

    #[test]
    fn prompt_attention_takes_the_tensor_cores_in_bf16_and_the_cuda_cores_in_f32() {
        let bf16 = BackendOptions::default();
        let f32 = BackendOptions { dtype: ComputeDtype::F32, ..Default::default() };
        let off = BackendOptions { tensor_core_attention: false, ..Default::default() };
        let untiled = BackendOptions { tiled_attention: false, ..Default::default() };
        let tc = |heads, tokens| Some(Tiling { kernel: TileKernel::TensorCores, heads, tokens });
        let cc = |heads, tokens| Some(Tiling { kernel: TileKernel::CudaCores, heads, tokens });
        // Qwen3-0.6B's shape: 16 query heads on 8 KV heads of 128.
        let qwen = shaped(16, 8, 128);
        assert_eq!(tiling(&qwen, &bf16), tc(2, 32));
        assert_eq!(tiling(&qwen, &f32), cc(2, 8), "f32 passes keep the kernel that matches the CPU");
        assert_eq!(tiling(&qwen, &off), cc(2, 8));
        assert_eq!(tiling(&qwen, &untiled), None);
        // A block's rows are whole groups of heads: 7 heads per KV head give 9 tokens of 7 (63 rows).
        assert_eq!(tiling(&shaped(28, 4, 128), &bf16), tc(7, 9));
        assert_eq!(tiling(&shaped(32, 32, 64), &bf16), tc(1, 64), "multi-head attention");
        assert_eq!(tiling(&shaped(128, 1, 64), &bf16), tc(64, 1), "more heads per KV head than rows");
        assert_eq!(tiling(&shaped(4, 1, 512), &bf16), None, "heads wider than either kernel takes");
        // Each head dimension takes the smallest variant that holds it.
        let variants: Vec<_> = [16, 40, 64, 65, 96, 128, 200, 256, 257].map(mma_head_dim).into();
        let want =
            [Some(64), Some(64), Some(64), Some(128), Some(128), Some(128), Some(256), Some(256), None];
        assert_eq!(variants, want);
    }

    #[test]
    fn metadata_lays_out_tokens_chunks_slots_rows_and_tables() {
        let cap = 8;
        let (ta, tb) = ([3u32, 9], [1u32, 2]);
        let batch = [
            SeqChunk {
                tokens: &[5, 6, 7],
                start_pos: 2,
                block_table: &ta,
                logits: LogitsRequest::Last,
                write: WriteMode::Direct,
                adapter: None,
            },
            SeqChunk {
                tokens: &[8],
                start_pos: 5,
                block_table: &tb,
                logits: LogitsRequest::All,
                write: WriteMode::Direct,
                adapter: Some(3),
            },
        ];
        let m = build_meta(&batch, None, cap, 4, None);
        assert_eq!((m.n, m.rows), (4, 2));
        assert_eq!(region(&m, cap, 0, 4), [5, 6, 7, 8], "tokens");
        assert_eq!(region(&m, cap, 1, 4), [2, 3, 4, 5], "positions");
        assert_eq!(region(&m, cap, 2, 4), [14, 15, 36, 9], "slots: block * 4 + offset");
        assert_eq!(region(&m, cap, 3, 4), [0, 0, 0, 1], "chunk of each token");
        assert_eq!(region(&m, cap, 4, 2), [2, 5], "chunk start positions");
        assert_eq!(region(&m, cap, 5, 2), [0, 3], "chunk first rows");
        assert_eq!(region(&m, cap, 6, 2), [0, 2], "chunk block-table offsets");
        assert_eq!(region(&m, cap, 7, 2), [2, 3], "logit rows: A's last token, B's only token");
        assert_eq!(region(&m, cap, 9, 4), [-1, -1, -1, 3], "adapter slot of each token (-1: none)");
        assert_eq!(&m.host[META_REGIONS * cap..], [3, 9, 1, 2], "block tables");

        // A staged verification chunk next to a direct prefill chunk: only the direct chunk's
        // tokens carry slots.
        let mut mixed = batch;
        mixed[1].write = WriteMode::Staged;
        let staged = build_meta(&mixed, None, cap, 4, None);
        assert_eq!(region(&staged, cap, 2, 4), [14, 15, 36, -1], "a staged chunk writes no slot");
        assert_eq!(region(&staged, cap, 0, 4), region(&m, cap, 0, 4));
        assert_eq!(m.tiles, 0, "no tiles unless asked for");

        // Tiles of at most 2 tokens: A (3 tokens) gives two, B one; none crosses a chunk.
        let tiled = build_meta(&batch, None, cap, 4, Some(2));
        assert_eq!(tiled.tiles, 3);
        assert_eq!(region(&tiled, cap, 8, 3), [0, 2, 3], "first token of each tile");
        assert_eq!(tiled.host[..8 * cap], m.host[..8 * cap], "the other regions are unchanged");
        assert_eq!(tiled.host[9 * cap..], m.host[9 * cap..], "the other regions are unchanged");
        // Graph buckets never tile.
        assert_eq!(build_meta(&batch, Some(4), cap, 4, Some(2)).tiles, 0);
    }

    #[test]
    fn graph_padding_writes_nowhere_and_keeps_every_row() {
        let cap = 8;
        let t = [[4u32], [6], [2]];
        let batch: Vec<SeqChunk<'_>> = [10usize, 3, 7]
            .iter()
            .zip(&t)
            .map(|(&start, table)| SeqChunk {
                tokens: &[1],
                start_pos: start,
                block_table: table,
                logits: LogitsRequest::Last,
                write: WriteMode::Direct,
                adapter: (start == 3).then_some(1),
            })
            .collect();
        let m = build_meta(&batch, Some(4), cap, 16, None);
        assert_eq!((m.n, m.rows), (4, 4));
        assert_eq!(region(&m, cap, 1, 4), [10, 3, 7, 0], "padding sits at position 0");
        assert_eq!(
            region(&m, cap, 2, 4),
            [4 * 16 + 10, 6 * 16 + 3, 2 * 16 + 7, -1],
            "padding writes nowhere"
        );
        assert_eq!(region(&m, cap, 3, 4), [0, 1, 2, 3], "padding is its own chunk");
        assert_eq!(region(&m, cap, 4, 4), [10, 3, 7, 0], "so it attends only to itself");
        assert_eq!(region(&m, cap, 5, 4), [0, 1, 2, 3]);
        assert_eq!(region(&m, cap, 7, 4), [0, 1, 2, 3], "every row's logits");
        assert_eq!(region(&m, cap, 9, 4), [-1, 1, -1, -1], "padding runs no adapter");
    }

    #[test]
    fn attention_splits_fit_the_partials_buffer() {
        for target in [16, 264, 528, 1056] {
            for heads in [1, 4, 9, 16, 32, 64] {
                for n in (1..600).step_by(7).chain([1, 2, 256, 2048]) {
                    for len in [None, Some(1), Some(64), Some(65), Some(1000), Some(40_000)] {
                        let s = splits(n, heads, target, len);
                        assert!((1..=MAX_SPLITS).contains(&s), "n {n} heads {heads}: {s} splits");
                        assert!(
                            n * heads * s < target + n * heads,
                            "n {n} heads {heads} target {target}: {s}"
                        );
                        if let Some(l) = len {
                            assert!(s <= l.div_ceil(64).max(1), "{s} splits for {l} positions");
                        }
                    }
                }
            }
        }
        assert_eq!(splits(1, 16, 528, None), 32, "a lone decode sequence is split as far as allowed");
        assert_eq!(splits(2048, 16, 528, Some(2048)), 1, "a long prefill needs no split");
    }
}
