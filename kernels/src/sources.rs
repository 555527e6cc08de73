//! The list of kernel sources (files under `kernels/cuda/`).

use crate::KernelSource;

/// Every kernel source the CUDA backend compiles.
pub const SOURCES: &[KernelSource] = &[KernelSource {
    name: "model",
    source: include_str!("../cuda/model.cu"),
    entries: &[
        "embed_bf16",
        "embed_f32",
        "gather_rows",
        "rms_norm_bf16",
        "rms_norm_f32",
        "head_rms_norm",
        "add_bias",
        "add_inplace",
        "silu_mul_bf16",
        "silu_mul_f32",
        "gelu_tanh_mul_bf16",
        "gelu_tanh_mul_f32",
        "softcap",
        "rope",
        "kv_write",
        "kv_commit",
        "attn_partial",
        "attn_tiled_bf16",
        "attn_tiled_f32",
        "attn_combine_bf16",
        "attn_combine_f32",
        "greedy_rows",
        "moe_route",
        "moe_accumulate",
        "lora_shrink_bf16",
        "lora_shrink_f32",
        "lora_expand",
    ],
}];
