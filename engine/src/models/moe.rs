//! Mixture-of-experts models: Qwen3-MoE and Mixtral.
//!
//! Both are Llama-shaped (pre-norm blocks, one RoPE table; Qwen3's q/k norms, Mistral's optional
//! sliding window) and run the Llama family's pass (`llama.rs`, which `models::load` picks for
//! them); in their sparse layers the MLP is a routed mixture of SwiGLU experts, one
//! [`Ops::moe`](super::Ops::moe) call. This file reads the mixture's tensors. Qwen3-MoE's dense
//! layers (`mlp_only_layers`, `decoder_sparse_step`) keep the ordinary MLP.
//!
//! Tensors, in every spelling the files use:
//! - router (`num_experts × hidden`): `mlp.gate.weight` (Qwen3-MoE, and Mixtral as transformers
//!   names it in memory), `block_sparse_moe.gate.weight` (Mixtral checkpoints), GGUF
//!   `ffn_gate_inp.weight`;
//! - experts one by one, as published checkpoints and transformers' `save_pretrained` store them:
//!   `mlp.experts.{e}.{gate,up,down}_proj.weight` (Qwen3-MoE) and
//!   `block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` (Mixtral: w1 gate, w3 up, w2 down);
//! - or stacked, as transformers 5 holds them in memory: `mlp.experts.gate_up_proj`
//!   (`[experts, 2 · ff, hidden]`, gate rows then up rows) and `mlp.experts.down_proj`
//!   (`[experts, hidden, ff]`);
//! - GGUF: `ffn_{gate,up,down}_exps.weight`, 3-D tensors of one matrix per expert, sliced into
//!   per-expert matrices by byte range without copying (quantized blocks included).
//!
//! Mixtral GGUF files (architecture `llama`) carry llama.cpp's interleaved Q/K rows, undone at
//! load as for Llama; Qwen3-MoE files do not. Shared experts and router biases are refused.

use super::{Activation, Expert, MoeScratch, MoeSpec, Tensors, WeightStore};
use crate::config::{Arch, ModelConfig, MoeConfig};
use crate::error::{EngineError, Result};

/// Reads layer `i`'s router and experts.
pub(super) fn load_experts(
    c: &ModelConfig,
    m: &MoeConfig,
    t: &Tensors<'_>,
    s: &mut WeightStore,
    i: usize,
    scratch: MoeScratch,
) -> Result<MoeSpec> {
    let (h, ff, count) = (c.hidden_size, m.expert_intermediate_size, m.num_experts);
    let path = t.src.path();
    let n = |hf: &str, gguf: &str| t.layer(i, hf, gguf);
    let refuse = |name: String, what: &str| -> Result<()> {
        if t.src.has(&name) {
            return Err(EngineError::Unsupported {
                path: path.into(),
                msg: format!("tensor `{name}` ({what})"),
            });
        }
        Ok(())
    };
    refuse(n("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight"), "shared experts")?;
    refuse(n("mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight"), "shared experts")?;
    // Mixtral checkpoints name the block `block_sparse_moe`; transformers' own names say `mlp`.
    let block =
        if !t.src.is_gguf() && c.arch == Arch::Mixtral && t.src.has(&n("block_sparse_moe.gate.weight", "")) {
            "block_sparse_moe"
        } else {
            "mlp"
        };
    refuse(n(&format!("{block}.gate.bias"), "ffn_gate_inp.bias"), "router bias")?;
    let router = s.linear(t.matrix(&n(&format!("{block}.gate.weight"), "ffn_gate_inp.weight"), count, h)?);

    let (gate, up, down) = if t.src.is_gguf() {
        refuse(n("", "ffn_gate_up_exps.weight"), "fused gate and up experts")?;
        (
            t.stacked(&n("", "ffn_gate_exps.weight"), count, ff, h)?,
            t.stacked(&n("", "ffn_up_exps.weight"), count, ff, h)?,
            t.stacked(&n("", "ffn_down_exps.weight"), count, h, ff)?,
        )
    } else {
        let [g, u, d] = match (c.arch, block) {
            (Arch::Mixtral, "block_sparse_moe") => ["w1", "w3", "w2"],
            _ => ["gate_proj", "up_proj", "down_proj"],
        };
        let one = |e: usize, name: &str| format!("{block}.experts.{e}.{name}.weight");
        let fused = n(&format!("{block}.experts.gate_up_proj"), "");
        if !t.src.has(&n(&one(0, g), "")) && t.src.has(&fused) {
            let gate_up = t.stacked(&fused, count, 2 * ff, h)?;
            (
                gate_up.iter().map(|m| m.rows(0..ff)).collect(),
                gate_up.iter().map(|m| m.rows(ff..2 * ff)).collect(),
                t.stacked(&n(&format!("{block}.experts.down_proj"), ""), count, h, ff)?,
            )
        } else {
            let mut gate = Vec::with_capacity(count);
            let mut up = Vec::with_capacity(count);
            let mut down = Vec::with_capacity(count);
            for e in 0..count {
                gate.push(t.matrix(&n(&one(e, g), ""), ff, h)?);
                up.push(t.matrix(&n(&one(e, u), ""), ff, h)?);
                down.push(t.matrix(&n(&one(e, d), ""), h, ff)?);
            }
            (gate, up, down)
        }
    };
    let experts = gate
        .into_iter()
        .zip(up)
        .zip(down)
        .map(|((g, u), d)| Expert { gate: s.linear(g), up: s.linear(u), down: s.linear(d) })
        .collect();
    Ok(MoeSpec {
        router,
        experts,
        top_k: m.top_k,
        renormalize: m.renormalize,
        act: Activation::Silu,
        scratch,
    })
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use crate::backend::{Activations, Backend, BackendOptions, LogitsRequest, SeqChunk};
    use crate::config::ModelConfig;
    use crate::cpu::CpuBackend;
    use crate::gguf::test_file::{f32_bytes, write_tmp, Writer};
    use crate::gguf::GgufFile;
    use crate::kv::{KvDtype, WriteMode};
    use crate::models::ModelWeights;
    use crate::safetensors::SafeTensors;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures").join(name)
    }

    fn hf_config(name: &str) -> ModelConfig {
        let p = fixture(name).join("config.json");
        ModelConfig::from_hf_json(&p, &std::fs::read_to_string(&p).unwrap()).unwrap()
    }

    /// A tensor's f32 values and its Hugging Face shape.
    fn values(st: &SafeTensors, name: &str) -> (Vec<f32>, Vec<usize>) {
        let shape = st.shape(name).unwrap().to_vec();
        let v = match shape[..] {
            [len] => st.vector(name, len).unwrap(),
            [r, c] => st.matrix(name, r, c).unwrap().data.as_f32().unwrap().to_vec(),
            _ => panic!("{name}: shape {shape:?}"),
        };
        (v, shape)
    }

    /// llama.cpp's converter's Q/K row order for Llama: row `(head, j, t)` is Hugging Face row
    /// `(head, t, j)` (the two rotary halves interleaved).
    fn permute(v: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
        let (hd, mut out) = (rows / heads, vec![0f32; v.len()]);
        for h in 0..heads {
            for j in 0..hd / 2 {
                for t in 0..2 {
                    let (dst, src) = (h * hd + 2 * j + t, h * hd + t * (hd / 2) + j);
                    out[dst * cols..(dst + 1) * cols].copy_from_slice(&v[src * cols..(src + 1) * cols]);
                }
            }
        }
        out
    }

    /// The fixture as llama.cpp's converter writes it, in f32: experts stacked into 3-D tensors,
    /// Q/K rows permuted for architecture `llama` (Mixtral).
    fn to_gguf(name: &str, arch: &str, c: &ModelConfig) -> Writer {
        let st = SafeTensors::open_dir(&fixture(name)).unwrap();
        let m = c.moe.as_ref().unwrap();
        let k = |s: &str| format!("{arch}.{s}");
        let mut w = Writer::new()
            .string("general.architecture", arch)
            .u32(&k("block_count"), c.num_layers as u32)
            .u32(&k("embedding_length"), c.hidden_size as u32)
            .u32(&k("feed_forward_length"), c.intermediate_size as u32)
            .u32(&k("attention.head_count"), c.num_heads as u32)
            .u32(&k("attention.head_count_kv"), c.num_kv_heads as u32)
            .u32(&k("attention.key_length"), c.head_dim as u32)
            .u32(&k("rope.dimension_count"), c.head_dim as u32)
            .u32(&k("context_length"), c.max_position_embeddings as u32)
            .f32(&k("rope.freq_base"), c.rope_theta)
            .f32(&k("attention.layer_norm_rms_epsilon"), c.rms_norm_eps)
            .u32(&k("expert_count"), m.num_experts as u32)
            .u32(&k("expert_used_count"), m.top_k as u32);
        if arch == "qwen3moe" {
            w = w.u32(&k("expert_feed_forward_length"), m.expert_intermediate_size as u32);
        }
        let put = |w: Writer, gguf: &str, hf: &str, heads: Option<usize>| -> Writer {
            let (mut v, shape) = values(&st, hf);
            if let Some(heads) = heads {
                v = permute(&v, shape[0], shape[1], heads);
            }
            let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
            w.tensor(gguf, &dims, 0, f32_bytes(&v))
        };
        w = put(w, "token_embd.weight", "model.embed_tokens.weight", None);
        w = put(w, "output_norm.weight", "model.norm.weight", None);
        w = put(w, "output.weight", "lm_head.weight", None);
        let mixtral = arch == "llama";
        for i in 0..c.num_layers {
            let l = |s: &str| format!("model.layers.{i}.{s}");
            let b = |s: &str| format!("blk.{i}.{s}");
            w = put(w, &b("attn_norm.weight"), &l("input_layernorm.weight"), None);
            w = put(w, &b("attn_q.weight"), &l("self_attn.q_proj.weight"), mixtral.then_some(c.num_heads));
            w = put(w, &b("attn_k.weight"), &l("self_attn.k_proj.weight"), mixtral.then_some(c.num_kv_heads));
            w = put(w, &b("attn_v.weight"), &l("self_attn.v_proj.weight"), None);
            w = put(w, &b("attn_output.weight"), &l("self_attn.o_proj.weight"), None);
            if c.qk_norm {
                w = put(w, &b("attn_q_norm.weight"), &l("self_attn.q_norm.weight"), None);
                w = put(w, &b("attn_k_norm.weight"), &l("self_attn.k_norm.weight"), None);
            }
            w = put(w, &b("ffn_norm.weight"), &l("post_attention_layernorm.weight"), None);
            if !m.sparse_layers[i] {
                for (gguf, hf) in
                    [("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")]
                {
                    w = put(w, &b(&format!("{gguf}.weight")), &l(&format!("mlp.{hf}.weight")), None);
                }
                continue;
            }
            let (block, names) = if mixtral {
                ("block_sparse_moe", ["w1", "w3", "w2"])
            } else {
                ("mlp", ["gate_proj", "up_proj", "down_proj"])
            };
            w = put(w, &b("ffn_gate_inp.weight"), &l(&format!("{block}.gate.weight")), None);
            for (gguf, hf) in ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"].into_iter().zip(names) {
                let (mut data, mut shape) = (Vec::new(), Vec::new());
                for e in 0..m.num_experts {
                    let (v, s) = values(&st, &l(&format!("{block}.experts.{e}.{hf}.weight")));
                    data.extend(v);
                    shape = s;
                }
                let dims = [shape[1] as u64, shape[0] as u64, m.num_experts as u64];
                w = w.tensor(&b(&format!("{gguf}.weight")), &dims, 0, f32_bytes(&data));
            }
        }
        w
    }

    const PROMPT: [u32; 24] =
        [1, 72, 300, 5, 447, 19, 250, 3, 88, 120, 7, 64, 2, 399, 31, 180, 9, 77, 260, 14, 333, 41, 6, 90];

    /// Logits at every position of [`PROMPT`], on the CPU in f32.
    fn logits(config: ModelConfig, weights: ModelWeights) -> Vec<f32> {
        let opts = BackendOptions {
            num_blocks: 8,
            block_size: 8,
            max_batch_tokens: 64,
            threads: 2,
            activations: Activations::F32,
            kv_dtype: Some(KvDtype::F32),
            ..Default::default()
        };
        let mut be = CpuBackend::new(config, weights, opts).unwrap();
        let table: Vec<u32> = (0..4).collect();
        let chunk = SeqChunk {
            tokens: &PROMPT,
            start_pos: 0,
            block_table: &table,
            logits: LogitsRequest::All,
            write: WriteMode::Direct,
            adapter: None,
        };
        be.forward(&[chunk]).unwrap().remove(0)
    }

    /// A GGUF file written from the safetensors fixture as llama.cpp writes these architectures
    /// (`qwen3moe`; Mixtral as `llama` with experts, Q/K rows permuted) reads as the same config
    /// and gives the same logits, bit for bit: the 3-D expert tensors are sliced into the right
    /// experts, the router and experts found under their GGUF names, Mixtral's Q/K rows restored.
    #[test]
    fn gguf_files_give_the_safetensors_logits() {
        for (name, arch) in [("qwen3-moe", "qwen3moe"), ("mixtral", "llama")] {
            let hf = hf_config(name);
            let st = SafeTensors::open_dir(&fixture(name)).unwrap();
            let want = logits(hf.clone(), crate::models::load(&hf, &st).unwrap());
            let path = write_tmp(&format!("{name}.gguf"), &to_gguf(name, arch, &hf).bytes());
            let g = GgufFile::open(&path).unwrap();
            let c = ModelConfig::from_gguf(&g).unwrap();
            assert_eq!(c, hf, "{name}: GGUF config");
            let got = logits(c.clone(), crate::models::load(&c, &g).unwrap());
            let diff = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(got == want, "{name}: GGUF logits differ from safetensors' by up to {diff}");
        }
    }

    /// What a GGUF mixture may not say: shared experts, another gating function, a routing
    /// scale, fused gate-and-up experts.
    #[test]
    fn gguf_refusals_name_the_setting() {
        let hf = hf_config("qwen3-moe");
        let base = || to_gguf("qwen3-moe", "qwen3moe", &hf);
        for (w, needle) in [
            (base().u32("qwen3moe.expert_shared_count", 1), "shared experts"),
            (base().u32("qwen3moe.expert_gating_func", 2), "expert_gating_func"),
            (base().f32("qwen3moe.expert_weights_scale", 2.5), "expert_weights_scale"),
        ] {
            let g = GgufFile::open(&write_tmp("refused.gguf", &w.bytes())).unwrap();
            let e = ModelConfig::from_gguf(&g).unwrap_err();
            assert!(e.to_string().contains(needle), "{e}");
        }
        let w = base().tensor("blk.0.ffn_gate_up_exps.weight", &[64, 64, 8], 0, vec![0; 64 * 64 * 8 * 4]);
        let g = GgufFile::open(&write_tmp("fused.gguf", &w.bytes())).unwrap();
        let c = ModelConfig::from_gguf(&g).unwrap();
        let e = crate::models::load(&c, &g).unwrap_err();
        assert!(e.to_string().contains("ffn_gate_up_exps"), "{e}");
    }
}
