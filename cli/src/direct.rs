//! What the tools that drive a [`Backend`] directly (`tandem logits`, `tandem backend-bench`)
//! share: the flags that pick the model, device and numerics, and the facts about the weights
//! they need after the weights have been handed to the backend.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use tandem_engine::backend::{Backend, BackendOptions, ComputeDtype};
use tandem_engine::factory::create_backend;
use tandem_engine::loader::{load_model, LoadedModel};
use tandem_engine::Device;
use tandem_serve::identity::resolve_model;

#[derive(Args)]
pub(crate) struct BackendFlags {
    /// GGUF file or Hugging Face model directory [default: the default model in the model cache].
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: Option<PathBuf>,
    /// Compute device (`cpu` or `cuda:N`).
    #[arg(long, default_value = "cpu", env = "TANDEM_DEVICE")]
    pub device: Device,
    /// Worker threads for the CPU backend [default: all cores].
    #[arg(long, env = "TANDEM_THREADS")]
    pub threads: Option<usize>,
    /// Element type of a GPU's weights and matrix inputs (`bf16` or `f32`); the CPU backend
    /// ignores it (see `--activations`).
    #[arg(long, default_value = "bf16")]
    pub dtype: ComputeDtype,
    /// GPU: run decode steps without CUDA graphs.
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// GPU: run prompt chunks' attention with the split-K kernel of decode steps instead of the
    /// tiled kernel (for comparison).
    #[arg(long)]
    pub no_tiled_attention: bool,
    /// GPU: run prompt chunks' attention in bf16 with the CUDA-core tiled kernel instead of the
    /// tensor-core one (for comparison).
    #[arg(long)]
    pub no_tensor_core_attention: bool,
    /// GPU: run decode steps' matrix products in cuBLAS instead of the fused decode products of
    /// our own (for comparison).
    #[arg(long)]
    pub no_decode_gemv: bool,
    /// GPU: copy each sampled row's logits to the host sampler instead of drawing the token on
    /// the device (for comparison).
    #[arg(long)]
    pub no_device_sampling: bool,
    /// GPU: run a mixture of experts' larger passes with every expert over every token (cuBLAS)
    /// instead of over its routed tokens only (for comparison).
    #[arg(long)]
    pub no_routed_moe: bool,
    /// GPU: launch kernels without programmatic dependent launch (sm_90 and later use it by
    /// default; for comparison).
    #[arg(long)]
    pub no_pdl: bool,
    /// CPU: activations fed to quantized matrices (Q4_0, Q4_1, Q5_0, Q8_0 and Q2_K..Q6_K): q16 (16-bit integer kernels, the
    /// default), q8 (8-bit, fastest, least exact) or f32 (exact: matches Hugging Face
    /// transformers token for token).
    #[arg(long, default_value = "q16", env = "TANDEM_ACTIVATIONS")]
    pub activations: tandem_engine::backend::Activations,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Element type of the KV cache: f32, f16, bf16 or fp8 [default: f16 on the CPU, bf16 on a GPU].
    #[arg(long, env = "TANDEM_KV_DTYPE", value_name = "DTYPE")]
    pub kv_dtype: Option<tandem_engine::kv::KvDtype>,
}

impl BackendFlags {
    /// Backend options for a pool of `num_blocks` blocks and passes of `max_batch_tokens`.
    pub fn options(&self, num_blocks: usize, max_batch_tokens: usize) -> BackendOptions {
        BackendOptions {
            num_blocks,
            block_size: self.block_size,
            max_batch_tokens,
            threads: self.threads.unwrap_or(0),
            dtype: self.dtype,
            cuda_graphs: !self.no_cuda_graphs,
            tiled_attention: !self.no_tiled_attention,
            tensor_core_attention: !self.no_tensor_core_attention,
            decode_gemv: !self.no_decode_gemv,
            device_sampling: !self.no_device_sampling,
            moe_routed: !self.no_routed_moe,
            pdl: !self.no_pdl,
            activations: self.activations,
            kv_dtype: self.kv_dtype,
            ..Default::default()
        }
    }

    /// Loads the model and creates the backend.
    pub fn open(&self, opts: BackendOptions) -> Result<(PathBuf, WeightsInfo, Box<dyn Backend>)> {
        let path = resolve_model(self.model.as_deref())?;
        let loaded = load_model(&path).with_context(|| format!("loading {}", path.display()))?;
        let info = WeightsInfo::of(&loaded);
        let backend = create_backend(self.device, loaded, opts)?;
        Ok((path, info, backend))
    }

    /// The element type the backend's matrices are stored and multiplied in.
    pub fn compute_dtype(&self) -> String {
        match self.device {
            Device::Cpu => "f32".into(),
            Device::Cuda(_) => self.dtype.to_string(),
        }
    }
}

/// What the tools need to know about the weights.
pub(crate) struct WeightsInfo {
    /// Element types of the weight matrices as loaded (e.g. `["F32"]`, `["Q4_1", "Q6_K"]`).
    pub dtypes: Vec<&'static str>,
    /// The dtype the model's `config.json` declares (`dtype` or `torch_dtype`), if any.
    pub file_dtype: Option<String>,
    /// Bytes (as loaded) and elements of the matrices a decode step reads in full: every layer's
    /// projections and MLP, and the output head. The embedding table is read only in the rows of
    /// the step's tokens, so an untied one is not counted (a tied one is the head).
    pub step_matrix_bytes: u64,
    pub step_matrix_elems: u64,
    /// Elements of the output head (`vocab × hidden`).
    pub head_elems: u64,
    /// Bytes of the norm weights and biases (f32 in every backend).
    pub vector_bytes: u64,
}

impl WeightsInfo {
    fn of(m: &LoadedModel) -> WeightsInfo {
        let w = &m.weights.store;
        let mut dtypes: Vec<&'static str> = Vec::new();
        let (mut bytes, mut elems) = (0u64, 0u64);
        // Every matrix a pass multiplies in full (a tied head is the embedding table, marked so).
        for (mat, _) in w.mats.iter().filter(|(_, usage)| usage.linear) {
            bytes += mat.data.len() as u64;
            elems += (mat.rows * mat.cols) as u64;
            if !dtypes.contains(&mat.dtype.name()) {
                dtypes.push(mat.dtype.name());
            }
        }
        let vec_elems: u64 = w.vecs.iter().map(|v| v.len() as u64).sum();
        let file_dtype = std::fs::read_to_string(m.path.join("config.json"))
            .ok()
            .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
            .and_then(|v| v.get("dtype").or_else(|| v.get("torch_dtype")).cloned())
            .and_then(|v| v.as_str().map(str::to_string));
        WeightsInfo {
            dtypes,
            file_dtype,
            step_matrix_bytes: bytes,
            step_matrix_elems: elems,
            head_elems: (m.config.vocab_size * m.config.hidden_size) as u64,
            vector_bytes: vec_elems * 4,
        }
    }

    /// Bytes of the weights a decode step reads, as `device` stores them, and that storage's
    /// name. The CPU backend keeps matrices as loaded (f32, or GGML blocks it dequantizes inside
    /// its kernels); the CUDA backend converts every matrix to `dtype` at load.
    pub fn step_bytes_on(&self, device: Device, dtype: ComputeDtype) -> (u64, String) {
        match device {
            Device::Cpu => {
                (self.step_matrix_bytes + self.vector_bytes, format!("as loaded: {}", self.dtypes.join(", ")))
            }
            Device::Cuda(_) => {
                let elem = match dtype {
                    ComputeDtype::Bf16 => 2,
                    ComputeDtype::F32 => 4,
                };
                (elem * self.step_matrix_elems + self.vector_bytes, dtype.to_string())
            }
        }
    }
}

/// Index of the largest value (the first one on ties), as a token id.
pub(crate) fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}
