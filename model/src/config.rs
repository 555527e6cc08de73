//! Model hyper-parameters, read from a Hugging Face `config.json` or from GGUF metadata into one
//! shape the backends use. Anything the engine cannot run faithfully is refused here with an error
//! naming the file and the setting, rather than producing wrong tokens later.

use std::path::Path;

use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

/// Decoder architectures the engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Llama 2/3, SmolLM and other Llama-shaped models.
    Llama,
    /// Mistral (Llama-shaped, optional sliding window).
    Mistral,
    /// Qwen2 (QKV bias).
    Qwen2,
    /// Qwen3 (per-head q/k RMSNorm).
    Qwen3,
    /// Gemma 2: interleaved sliding-window and global layers, pre- and post-norms, GeGLU,
    /// attention and final-logit soft-capping.
    Gemma2,
    /// Gemma 3 (text): as Gemma 2 with q/k norms and a separate RoPE base for local layers.
    Gemma3,
    /// Phi-3, Phi-3.5-mini and Phi-4 (Llama-shaped with fused QKV and gate/up projections,
    /// optional LongRoPE and sliding window).
    Phi3,
    /// Qwen3-MoE: Qwen3's attention (q/k norms), and in its sparse layers a routed mixture of
    /// SwiGLU experts instead of the dense MLP.
    Qwen3Moe,
    /// Mixtral: Mistral's attention (optional sliding window), every MLP a routed mixture of
    /// SwiGLU experts.
    Mixtral,
}

impl Arch {
    /// Whether the family is Gemma's (norms of `1 + w`, embeddings scaled by √hidden).
    pub fn is_gemma(self) -> bool {
        matches!(self, Arch::Gemma2 | Arch::Gemma3)
    }
}

/// The gate activation of the gated MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpAct {
    /// SiLU (SwiGLU).
    Silu,
    /// GELU, tanh approximation (GeGLU): `gelu_pytorch_tanh`.
    GeluTanh,
}

/// The routed mixture of experts of a sparse MLP layer.
///
/// Per token: router logits `x · Wrᵀ` (one per expert), their softmax (f32), the `top_k` largest
/// probabilities (ties to the lower expert index), renormalized to sum to one where `renormalize`
/// says, and the output `Σ w · down_e(silu(gate_e(x)) · up_e(x))` over the chosen experts.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Width of each expert's SwiGLU (its gate and up rows).
    pub expert_intermediate_size: usize,
    /// Whether the chosen experts' probabilities are divided by their sum.
    pub renormalize: bool,
    /// Per layer, whether its MLP is the mixture (else the dense MLP of `intermediate_size`).
    pub sparse_layers: Vec<bool>,
}

/// How rotary frequencies are adjusted for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Positions divided by `factor` (equivalently, every frequency divided by it).
    Linear { factor: f32 },
    /// Llama 3.1's piecewise frequency scaling.
    Llama3 { factor: f32, low_freq_factor: f32, high_freq_factor: f32, original_max_position_embeddings: f32 },
    /// Per-frequency divisors stored in the file (GGUF's `rope_freqs.weight`), one per pair.
    Factors(Vec<f32>),
    /// LongRoPE (Phi-3 "128k", Phi-3.5): frequency `i` is divided by `short_factor[i]` at
    /// positions below `original_max_position_embeddings` and by `long_factor[i]` from there on,
    /// and cos and sin are multiplied by `attention_factor` at every position.
    LongRope {
        short_factor: Vec<f32>,
        long_factor: Vec<f32>,
        original_max_position_embeddings: usize,
        attention_factor: f32,
    },
}

/// Everything the backends need to know about a model's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Q, K and V projections carry a bias (Qwen2).
    pub qkv_bias: bool,
    /// Per-head RMSNorm on queries and keys before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Attention only looks this many positions back (Mistral; Gemma's local layers), if set.
    pub sliding_window: Option<usize>,
    /// Per layer, whether it attends through `sliding_window` (Gemma's interleaved local and
    /// global layers); `None`: every layer does when a window is set.
    pub sliding_layers: Option<Vec<bool>>,
    /// RoPE base of the sliding-window layers where it differs from `rope_theta` (Gemma 3's local
    /// layers; they take no scaling).
    pub rope_local_theta: Option<f32>,
    pub mlp_act: MlpAct,
    /// Attention scores are scaled by `query_pre_attn_scalar^-1/2` where set (Gemma), else by
    /// `head_dim^-1/2`.
    pub query_pre_attn_scalar: Option<f32>,
    /// Attention scores become `cap · tanh(score / cap)` (Gemma 2).
    pub attn_logit_softcapping: Option<f32>,
    /// Final logits become `cap · tanh(logit / cap)` (Gemma 2).
    pub final_logit_softcapping: Option<f32>,
    /// The mixture of experts of the sparse layers (Qwen3-MoE, Mixtral); `None`: every MLP is dense.
    pub moe: Option<MoeConfig>,
}

impl ModelConfig {
    /// The attention window of each layer (`None`: the layer reads every earlier position), as
    /// the model families apply it: `sliding_window` on the layers `sliding_layers` marks, or on
    /// every layer when it marks none.
    pub fn layer_windows(&self) -> Vec<Option<usize>> {
        (0..self.num_layers)
            .map(|l| match &self.sliding_layers {
                Some(s) if !s.get(l).copied().unwrap_or(false) => None,
                _ => self.sliding_window,
            })
            .collect()
    }

    /// Checks the shape is internally consistent; `path` names the file in errors.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |msg: String| Err(ModelError::format(path, msg));
        if self.num_layers == 0 || self.hidden_size == 0 || self.vocab_size == 0 {
            return bad(format!(
                "layers ({}), hidden size ({}) and vocab size ({}) must be positive",
                self.num_layers, self.hidden_size, self.vocab_size
            ));
        }
        if self.num_heads == 0 || self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads)
        {
            return bad(format!(
                "attention heads ({}) must be a positive multiple of KV heads ({})",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!("head dim {} must be positive and even", self.head_dim));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad(format!("rope theta {} must be positive", self.rope_theta));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return bad(format!("rms norm epsilon {} is invalid", self.rms_norm_eps));
        }
        if self.max_position_embeddings < 2 {
            return bad(format!("context length {} must be at least 2", self.max_position_embeddings));
        }
        if self.sliding_window == Some(0) {
            return bad("sliding window must be at least 1 token".into());
        }
        if let Some(layers) = &self.sliding_layers {
            if layers.len() != self.num_layers {
                return bad(format!("{} layer types for {} layers", layers.len(), self.num_layers));
            }
            if self.sliding_window.is_none() && layers.iter().any(|&s| s) {
                return bad("sliding-window layers without a `sliding_window`".into());
            }
        }
        for (name, x) in [
            ("query_pre_attn_scalar", self.query_pre_attn_scalar),
            ("attn_logit_softcapping", self.attn_logit_softcapping),
            ("final_logit_softcapping", self.final_logit_softcapping),
            ("local rope theta", self.rope_local_theta),
        ] {
            if x.is_some_and(|x| !(x.is_finite() && x > 0.0)) {
                return bad(format!("{name} {} must be positive", x.unwrap_or_default()));
            }
        }
        if let Some(m) = &self.moe {
            if m.num_experts == 0 || m.top_k == 0 || m.top_k > m.num_experts {
                return bad(format!(
                    "experts per token ({}) must be between 1 and the number of experts ({})",
                    m.top_k, m.num_experts
                ));
            }
            if m.expert_intermediate_size == 0 {
                return bad("expert intermediate size must be positive".into());
            }
            if m.sparse_layers.len() != self.num_layers {
                return bad(format!(
                    "{} sparse-layer flags for {} layers",
                    m.sparse_layers.len(),
                    self.num_layers
                ));
            }
        }
        let positive = |x: f32| x.is_finite() && x > 0.0;
        match &self.rope_scaling {
            Some(RopeScaling::Linear { factor }) if !positive(*factor) => {
                return bad(format!("linear rope scaling factor {factor} must be positive"));
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) if !(positive(*factor)
                && positive(*low_freq_factor)
                && positive(*original_max_position_embeddings)
                && high_freq_factor.is_finite()
                && high_freq_factor > low_freq_factor) =>
            {
                return bad(format!(
                    "llama3 rope scaling needs a positive factor ({factor}) and original context \
                     ({original_max_position_embeddings}), and high_freq_factor ({high_freq_factor}) > \
                     low_freq_factor ({low_freq_factor}) > 0"
                ));
            }
            Some(RopeScaling::Factors(f)) => {
                if f.len() != self.head_dim / 2 {
                    return bad(format!(
                        "rope_freqs has {} factors, expected head_dim/2 = {}",
                        f.len(),
                        self.head_dim / 2
                    ));
                }
                if let Some(x) = f.iter().find(|&&x| !positive(x)) {
                    return bad(format!("rope_freqs factor {x} must be positive"));
                }
            }
            Some(RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings,
                attention_factor,
            }) => {
                for (name, f) in [("short_factor", short_factor), ("long_factor", long_factor)] {
                    if f.len() != self.head_dim / 2 {
                        return bad(format!(
                            "longrope {name} has {} values, expected head_dim/2 = {}",
                            f.len(),
                            self.head_dim / 2
                        ));
                    }
                    if let Some(x) = f.iter().find(|&&x| !positive(x)) {
                        return bad(format!("longrope {name} value {x} must be positive"));
                    }
                }
                if *original_max_position_embeddings < 2 {
                    return bad(format!(
                        "longrope original_max_position_embeddings {original_max_position_embeddings} must \
                         be at least 2"
                    ));
                }
                if !positive(*attention_factor) {
                    return bad(format!("longrope attention factor {attention_factor} must be positive"));
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Reads a Hugging Face `config.json`.
    pub fn from_hf_json(path: &Path, text: &str) -> Result<ModelConfig> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| ModelError::format(path, format!("invalid JSON: {e}")))?;
        let unsupported = |msg: String| ModelError::Unsupported { path: path.into(), msg };
        let model_type = v.get("model_type").and_then(Value::as_str).unwrap_or("");
        let arch_name = v.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str).unwrap_or("");
        let arch = match (model_type, arch_name) {
            ("llama", _) | (_, "LlamaForCausalLM") => Arch::Llama,
            ("mistral", _) | (_, "MistralForCausalLM") => Arch::Mistral,
            ("qwen2", _) | (_, "Qwen2ForCausalLM") => Arch::Qwen2,
            ("qwen3", _) | (_, "Qwen3ForCausalLM") => Arch::Qwen3,
            ("gemma2", _) | (_, "Gemma2ForCausalLM") => Arch::Gemma2,
            ("gemma3_text", _) | (_, "Gemma3ForCausalLM") => Arch::Gemma3,
            ("phi3", _) | (_, "Phi3ForCausalLM") => Arch::Phi3,
            ("qwen3_moe", _) | (_, "Qwen3MoeForCausalLM") => Arch::Qwen3Moe,
            ("mixtral", _) | (_, "MixtralForCausalLM") => Arch::Mixtral,
            ("gemma3", _) | (_, "Gemma3ForConditionalGeneration") => {
                return Err(unsupported(
                    "multimodal Gemma 3 (model_type \"gemma3\"); only the text model (gemma3_text) runs"
                        .into(),
                ))
            }
            _ => {
                return Err(unsupported(format!(
                "architecture {arch_name:?} (model_type {model_type:?}); supported: Llama, Mistral, Qwen2, \
                     Qwen3, Gemma 2, Gemma 3 (text), Phi-3, Qwen3-MoE, Mixtral"
            )))
            }
        };
        let gemma = arch.is_gemma();
        let get_usize = |key: &str| -> Result<usize> {
            v.get(key)
                .and_then(Value::as_u64)
                .map(|x| x as usize)
                .ok_or_else(|| ModelError::format(path, format!("missing or invalid `{key}`")))
        };
        let opt_usize = |key: &str| v.get(key).and_then(Value::as_u64).map(|x| x as usize);
        let opt_f32 = |key: &str| v.get(key).and_then(Value::as_f64).map(|x| x as f32);
        let flag = |key: &str| v.get(key).and_then(Value::as_bool).unwrap_or(false);

        let hidden_size = get_usize("hidden_size")?;
        let num_heads = get_usize("num_attention_heads")?;
        // Llama-family configs derive these as transformers does. Gemma's config classes carry
        // defaults of their own for the 2B/7B shapes (head_dim 256, 4 or 16 KV heads) that a
        // smaller model would silently get wrong, so a Gemma config must state them.
        let num_kv_heads = match opt_usize("num_key_value_heads") {
            Some(n) => n,
            None if gemma => get_usize("num_key_value_heads")?,
            None => num_heads,
        };
        let head_dim = match v.get("head_dim") {
            Some(Value::Null) | None if gemma => get_usize("head_dim")?,
            Some(Value::Null) | None => hidden_size / num_heads.max(1),
            Some(h) => h.as_u64().ok_or_else(|| ModelError::format(path, "invalid `head_dim`"))? as usize,
        };
        if flag("mlp_bias") {
            return Err(unsupported("mlp_bias = true".into()));
        }
        // Llama-style attention_bias also puts a bias on o_proj, which the engine does not apply.
        if flag("attention_bias")
            && matches!(
                arch,
                Arch::Llama
                    | Arch::Mistral
                    | Arch::Gemma2
                    | Arch::Gemma3
                    | Arch::Phi3
                    | Arch::Qwen3Moe
                    | Arch::Mixtral
            )
        {
            return Err(unsupported("attention_bias = true".into()));
        }
        if flag("use_bidirectional_attention") {
            return Err(unsupported("use_bidirectional_attention = true (an embedding model)".into()));
        }
        // Gemma names it `hidden_activation` (`hidden_act` is a legacy key its config ignores).
        let act_key =
            if gemma && v.get("hidden_activation").is_some() { "hidden_activation" } else { "hidden_act" };
        let mlp_act = match v.get(act_key).and_then(Value::as_str) {
            None if !gemma => MlpAct::Silu,
            Some("silu") if !gemma => MlpAct::Silu,
            Some("gelu_pytorch_tanh") if gemma => MlpAct::GeluTanh,
            None => return Err(ModelError::format(path, "missing `hidden_activation`")),
            Some(other) => return Err(unsupported(format!("{act_key} {other:?}"))),
        };
        // Rope parameters moved from `rope_scaling` + `rope_theta` to `rope_parameters` in newer
        // transformers releases; accept both. Gemma 3 keeps one set per layer type there
        // (`full_attention`, `sliding_attention`).
        let rope_params = v.get("rope_parameters").filter(|p| p.is_object());
        let (global_params, local_params) = match rope_params {
            Some(p) if p.get("full_attention").is_some() || p.get("sliding_attention").is_some() => {
                (p.get("full_attention"), p.get("sliding_attention"))
            }
            other => (other, None),
        };
        let rope_scaling_v = v.get("rope_scaling").filter(|p| p.is_object()).or(global_params);
        let theta_of =
            |p: Option<&Value>| p.and_then(|p| p.get("rope_theta")).and_then(Value::as_f64).map(|x| x as f32);
        // transformers' `default_theta`: 10⁴, but 10⁶ for Mixtral.
        let default_theta = if arch == Arch::Mixtral { 1e6 } else { 10000.0 };
        let rope_theta = opt_f32("rope_theta").or_else(|| theta_of(global_params)).unwrap_or(default_theta);
        let max_position_embeddings = opt_usize("max_position_embeddings").unwrap_or(4096);
        if arch == Arch::Phi3 {
            // Phi-4-mini and Phi-3.5-MoE rotate only part of each head; transformers reads the
            // fraction from the top level or from the rope parameters.
            for p in [Some(&v), rope_scaling_v] {
                match p.and_then(|p| p.get("partial_rotary_factor")) {
                    None | Some(Value::Null) => {}
                    Some(x) if x.as_f64() == Some(1.0) => {}
                    Some(x) => {
                        return Err(unsupported(format!(
                            "partial_rotary_factor {x} (RoPE on part of each head)"
                        )))
                    }
                }
            }
        }
        let rope_scaling = match rope_scaling_v {
            None => None,
            Some(rs) if arch == Arch::Phi3 => phi3_rope_scaling(path, &v, rs, max_position_embeddings)?,
            Some(rs) => parse_rope_scaling(path, rs)?,
        };
        let rope_local_theta = match arch {
            Arch::Gemma3 => {
                if let Some(local) = local_params {
                    if parse_rope_scaling(path, local)?.is_some() {
                        return Err(unsupported("rope scaling on the sliding-window layers".into()));
                    }
                }
                Some(opt_f32("rope_local_base_freq").or_else(|| theta_of(local_params)).ok_or_else(|| {
                    ModelError::format(
                        path,
                        "missing `rope_local_base_freq` (or rope_parameters.sliding_attention)",
                    )
                })?)
            }
            _ => None,
        };
        let sliding_window = match arch {
            Arch::Mistral | Arch::Phi3 | Arch::Mixtral => opt_usize("sliding_window"),
            Arch::Gemma2 | Arch::Gemma3 => Some(get_usize("sliding_window")?),
            Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe if flag("use_sliding_window") => {
                return Err(unsupported("use_sliding_window = true".into()))
            }
            _ => None,
        };
        let num_layers = get_usize("num_hidden_layers")?;
        let sliding_layers = if gemma { Some(gemma_layer_types(path, &v, arch, num_layers)?) } else { None };
        let opt_cap = |key: &str| -> Result<Option<f32>> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_f64()
                    .map(|x| Some(x as f32))
                    .ok_or_else(|| ModelError::format(path, format!("invalid `{key}`"))),
            }
        };
        let (attn_logit_softcapping, final_logit_softcapping) = if gemma {
            (opt_cap("attn_logit_softcapping")?, opt_cap("final_logit_softcapping")?)
        } else {
            (None, None)
        };
        let query_pre_attn_scalar = if gemma {
            Some(
                v.get("query_pre_attn_scalar")
                    .and_then(Value::as_f64)
                    .map(|x| x as f32)
                    .ok_or_else(|| ModelError::format(path, "missing or invalid `query_pre_attn_scalar`"))?,
            )
        } else {
            None
        };
        let intermediate_size = get_usize("intermediate_size")?;
        let moe = match arch {
            Arch::Qwen3Moe | Arch::Mixtral => hf_experts(path, &v, arch, num_layers, intermediate_size)?,
            _ => None,
        };
        // The config classes' defaults where the file says nothing.
        let (default_eps, default_context) = match arch {
            Arch::Mixtral => (1e-5, 4096 * 32),
            Arch::Qwen3Moe => (1e-6, 32768),
            _ => (1e-6, 4096),
        };
        let cfg = ModelConfig {
            arch,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: get_usize("vocab_size")?,
            // transformers' defaults: 1e-5 for Phi-3 and Mixtral, 1e-6 for the others.
            rms_norm_eps: opt_f32("rms_norm_eps").unwrap_or(if arch == Arch::Phi3 {
                1e-5
            } else {
                default_eps
            }),
            rope_theta,
            rope_scaling,
            max_position_embeddings: if arch == Arch::Phi3 {
                max_position_embeddings
            } else {
                opt_usize("max_position_embeddings").unwrap_or(default_context)
            },
            // transformers' default: tied for Gemma, untied for the Llama family.
            tie_word_embeddings: v.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(gemma),
            qkv_bias: arch == Arch::Qwen2,
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Gemma3 | Arch::Qwen3Moe),
            sliding_window,
            sliding_layers,
            rope_local_theta,
            mlp_act,
            query_pre_attn_scalar,
            attn_logit_softcapping,
            final_logit_softcapping,
            moe,
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Reads GGUF metadata (`<arch>.*` keys). `vocab_size` falls back to the token list length.
    pub fn from_gguf(g: &GgufFile) -> Result<ModelConfig> {
        let path = g.path.as_path();
        let arch_name = g
            .get("general.architecture")
            .and_then(|v| v.as_str())
            .ok_or_else(|| ModelError::format(path, "missing `general.architecture`"))?
            .to_string();
        let has_experts =
            g.get(&format!("{arch_name}.expert_count")).and_then(|v| v.as_u64()).unwrap_or(0) > 0;
        let arch = match arch_name.as_str() {
            // llama.cpp writes Mixtral as `llama` with experts.
            "llama" if has_experts => Arch::Mixtral,
            "llama" => Arch::Llama,
            "qwen3moe" => Arch::Qwen3Moe,
            "mistral" => Arch::Mistral,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "gemma2" => Arch::Gemma2,
            "gemma3" => Arch::Gemma3,
            "phi3" => Arch::Phi3,
            other => {
                return Err(ModelError::Unsupported {
                    path: path.into(),
                    msg: format!(
                        "architecture {other:?}; supported: llama (with or without experts), mistral, \
                         qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3"
                    ),
                })
            }
        };
        if has_experts && !matches!(arch, Arch::Mixtral | Arch::Qwen3Moe) {
            return Err(ModelError::Unsupported {
                path: path.into(),
                msg: format!("experts (`{arch_name}.expert_count`) in architecture {arch_name:?}"),
            });
        }
        let gemma = arch.is_gemma();
        let key = |k: &str| format!("{arch_name}.{k}");
        let get_usize = |k: &str| -> Result<usize> {
            g.get(&key(k))
                .and_then(|v| v.as_u64())
                .map(|x| x as usize)
                .ok_or_else(|| ModelError::format(path, format!("missing or invalid `{}`", key(k))))
        };
        let opt_usize = |k: &str| g.get(&key(k)).and_then(|v| v.as_u64()).map(|x| x as usize);
        let opt_f32 = |k: &str| g.get(&key(k)).and_then(|v| v.as_f64()).map(|x| x as f32);

        let hidden_size = get_usize("embedding_length")?;
        let num_heads = get_usize("attention.head_count")?;
        let num_kv_heads = opt_usize("attention.head_count_kv").unwrap_or(num_heads);
        // llama.cpp's Phi-3 converter writes the rotated dimensions (fewer than the head's for
        // Phi-4-mini) but not the head size, so the head size is hidden / heads there.
        let head_dim = match arch {
            Arch::Phi3 => opt_usize("attention.key_length"),
            _ => opt_usize("attention.key_length").or_else(|| opt_usize("rope.dimension_count")),
        }
        .unwrap_or(hidden_size / num_heads.max(1));
        if let Some(rd) = opt_usize("rope.dimension_count") {
            if rd != head_dim {
                return Err(ModelError::Unsupported {
                    path: path.into(),
                    msg: format!("partial rotary embedding (rope dims {rd} of head dim {head_dim})"),
                });
            }
        }
        let vocab_size = match opt_usize("vocab_size") {
            Some(v) => v,
            None => g
                .get("tokenizer.ggml.tokens")
                .and_then(|v| v.as_array())
                .map(|a| a.len())
                .or_else(|| g.tensor("token_embd.weight").and_then(|t| t.dims.get(1).copied()))
                .ok_or_else(|| ModelError::format(path, "cannot determine vocab size"))?,
        };
        let max_position_embeddings = opt_usize("context_length").unwrap_or(4096);
        let longrope =
            ["rope_factors_short.weight", "rope_factors_long.weight"].map(|n| g.tensor(n).is_some());
        let rope_scaling = if arch == Arch::Phi3 && longrope.contains(&true) {
            // LongRoPE as llama.cpp's converter writes it: both factor sets as tensors, the
            // original context as a key, and the attention factor it computed as another.
            let original_key = key("rope.scaling.original_context_length");
            let original = g.get(&original_key).and_then(|v| v.as_u64()).ok_or_else(|| {
                ModelError::format(path, format!("LongRoPE factors without `{original_key}`"))
            })? as usize;
            let attention_factor = opt_f32("rope.scaling.attn_factor").unwrap_or_else(|| {
                longrope_attention_factor(max_position_embeddings as f64 / original as f64, original)
            });
            Some(RopeScaling::LongRope {
                short_factor: g.plain_vector_f32("rope_factors_short.weight")?,
                long_factor: g.plain_vector_f32("rope_factors_long.weight")?,
                original_max_position_embeddings: original,
                attention_factor,
            })
        } else if g.tensor("rope_freqs.weight").is_some() {
            Some(RopeScaling::Factors(g.plain_vector_f32("rope_freqs.weight")?))
        } else {
            match g.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
                None | Some("none") => None,
                Some("linear") => {
                    Some(RopeScaling::Linear { factor: opt_f32("rope.scaling.factor").unwrap_or(1.0) })
                }
                Some(other) => {
                    return Err(ModelError::Unsupported {
                        path: path.into(),
                        msg: format!("rope scaling type {other:?}"),
                    })
                }
            }
        };
        let num_layers = get_usize("block_count")?;
        // GGUF stores neither Gemma's layer pattern, its local RoPE base nor its attention scale:
        // llama.cpp (which writes and defines these files) fixes them per architecture, and so
        // does this reader. Layer pattern: Gemma 2 alternates sliding and global layers starting
        // with a sliding one; Gemma 3 has five sliding layers to each global one. Local RoPE base:
        // 10000 (Gemma 3). Attention scale: 1/√head_dim, except the 27B shapes' 1/√(hidden/heads).
        // llama.cpp's Phi-3 converter writes 0 for "no window" (Phi-4).
        let sliding_window =
            opt_usize("attention.sliding_window").filter(|&w| !(arch == Arch::Phi3 && w == 0));
        let (sliding_layers, rope_local_theta, query_pre_attn_scalar) = if gemma {
            sliding_window.ok_or_else(|| {
                ModelError::format(path, format!("missing `{}`", key("attention.sliding_window")))
            })?;
            let pattern = if arch == Arch::Gemma2 { 2 } else { 6 };
            let layers = (0..num_layers).map(|i| (i + 1) % pattern != 0).collect();
            let local_theta =
                (arch == Arch::Gemma3).then(|| opt_f32("rope.freq_base_swa").unwrap_or(10000.0));
            let is_27b =
                (arch == Arch::Gemma2 && num_layers == 46) || (arch == Arch::Gemma3 && num_layers == 62);
            let scalar = if is_27b { hidden_size / num_heads.max(1) } else { head_dim };
            (Some(layers), local_theta, Some(scalar as f32))
        } else {
            (None, None, None)
        };
        let intermediate_size = get_usize("feed_forward_length")?;
        let moe = match arch {
            Arch::Qwen3Moe | Arch::Mixtral => {
                Some(gguf_experts(g, &arch_name, arch, num_layers, intermediate_size)?)
            }
            _ => None,
        };
        let cfg = ModelConfig {
            arch,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            rms_norm_eps: opt_f32("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
            rope_theta: opt_f32("rope.freq_base").unwrap_or(10000.0),
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings: g.tensor("output.weight").is_none(),
            qkv_bias: g.tensor("blk.0.attn_q.bias").is_some(),
            qk_norm: g.tensor("blk.0.attn_q_norm.weight").is_some(),
            sliding_window,
            sliding_layers,
            rope_local_theta,
            mlp_act: if gemma { MlpAct::GeluTanh } else { MlpAct::Silu },
            query_pre_attn_scalar,
            attn_logit_softcapping: opt_f32("attn_logit_softcapping").filter(|_| gemma),
            final_logit_softcapping: opt_f32("final_logit_softcapping").filter(|_| gemma),
            moe,
        };
        cfg.validate(path)?;
        Ok(cfg)
    }
}

/// Reads one RoPE parameter object (`rope_scaling`, or a `rope_parameters` entry).
fn parse_rope_scaling(path: &Path, rs: &Value) -> Result<Option<RopeScaling>> {
    let kind = rs.get("rope_type").or_else(|| rs.get("type")).and_then(Value::as_str).unwrap_or("default");
    let f = |k: &str| rs.get(k).and_then(Value::as_f64).map(|x| x as f32);
    let need =
        |k: &str| f(k).ok_or_else(|| ModelError::format(path, format!("rope scaling `{kind}` needs `{k}`")));
    Ok(match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor: need("factor")? }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: need("original_max_position_embeddings")?,
        }),
        other => {
            return Err(ModelError::Unsupported {
                path: path.into(),
                msg: format!("rope scaling type {other:?}"),
            })
        }
    })
}

/// Reads a Phi-3 RoPE parameter object: `default`, or LongRoPE (`longrope`, or `su`, its older
/// name). As in transformers' Phi-3 config, `original_max_position_embeddings` comes from the top
/// level (4096 when absent); the attention factor is `attention_factor` where given, else
/// `sqrt(1 + ln(factor) / ln(original_max_position_embeddings))` with `factor` where given, else
/// `max_position_embeddings / original_max_position_embeddings` (1 when the factor is at most 1).
fn phi3_rope_scaling(
    path: &Path,
    v: &Value,
    rs: &Value,
    max_positions: usize,
) -> Result<Option<RopeScaling>> {
    let kind = rs.get("rope_type").or_else(|| rs.get("type")).and_then(Value::as_str).unwrap_or("default");
    let unsupported = |msg: String| ModelError::Unsupported { path: path.into(), msg };
    match kind {
        "default" => return Ok(None),
        "longrope" | "su" => {}
        other => {
            return Err(unsupported(format!(
                "rope scaling type {other:?} for Phi-3 (supported: default, longrope, su)"
            )))
        }
    }
    let factors = |key: &str| -> Result<Vec<f32>> {
        rs.get(key)
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(|x| x.as_f64().map(|x| x as f32)).collect::<Option<Vec<f32>>>())
            .ok_or_else(|| {
                ModelError::format(path, format!("rope scaling `{kind}` needs `{key}` (a list of numbers)"))
            })
    };
    let (short_factor, long_factor) = (factors("short_factor")?, factors("long_factor")?);
    let original = match v.get("original_max_position_embeddings") {
        None | Some(Value::Null) => 4096,
        Some(x) => x
            .as_u64()
            .ok_or_else(|| ModelError::format(path, "invalid `original_max_position_embeddings`"))?
            as usize,
    };
    if let Some(inner) = rs.get("original_max_position_embeddings").filter(|x| !x.is_null()) {
        if inner.as_u64() != Some(original as u64) {
            return Err(unsupported(format!(
                "rope scaling original_max_position_embeddings {inner} differs from the top-level \
                 original_max_position_embeddings ({original}), which transformers uses for Phi-3"
            )));
        }
    }
    let attention_factor = match rs.get("attention_factor").filter(|x| !x.is_null()) {
        Some(x) => {
            x.as_f64().ok_or_else(|| ModelError::format(path, "invalid rope scaling `attention_factor`"))?
                as f32
        }
        None => {
            let factor = match rs.get("factor").filter(|x| !x.is_null()) {
                Some(x) => {
                    x.as_f64().ok_or_else(|| ModelError::format(path, "invalid rope scaling `factor`"))?
                }
                None => max_positions as f64 / original as f64,
            };
            longrope_attention_factor(factor, original)
        }
    };
    Ok(Some(RopeScaling::LongRope {
        short_factor,
        long_factor,
        original_max_position_embeddings: original,
        attention_factor,
    }))
}

/// LongRoPE's default attention factor for a context extended `factor` times beyond `original`
/// positions: `sqrt(1 + ln(factor) / ln(original))`, or 1 when not extended (transformers'
/// `_compute_longrope_parameters`; llama.cpp's converter writes the same value).
fn longrope_attention_factor(factor: f64, original: usize) -> f32 {
    if factor <= 1.0 {
        1.0
    } else {
        (1.0 + factor.ln() / (original as f64).ln()).sqrt() as f32
    }
}

/// Which layers of a Gemma model attend through the sliding window: `layer_types` where the
/// config lists them; else transformers' rule for the family (Gemma 2: every even layer; Gemma 3:
/// all but every `sliding_window_pattern`-th).
fn gemma_layer_types(path: &Path, v: &Value, arch: Arch, layers: usize) -> Result<Vec<bool>> {
    if let Some(types) = v.get("layer_types").filter(|t| !t.is_null()) {
        let types =
            types.as_array().ok_or_else(|| ModelError::format(path, "`layer_types` is not a list"))?;
        if types.len() != layers {
            return Err(ModelError::format(
                path,
                format!("`layer_types` has {} entries for {layers} layers", types.len()),
            ));
        }
        return types
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => Err(ModelError::Unsupported { path: path.into(), msg: format!("layer type {t}") }),
            })
            .collect();
    }
    match arch {
        Arch::Gemma2 => Ok((0..layers).map(|i| (i + 1) % 2 != 0).collect()),
        _ => {
            let pattern =
                v.get("sliding_window_pattern").and_then(Value::as_u64).filter(|&p| p > 0).ok_or_else(
                    || ModelError::format(path, "missing `layer_types` (or `sliding_window_pattern`)"),
                )? as usize;
            Ok((0..layers).map(|i| (i + 1) % pattern != 0).collect())
        }
    }
}

/// The mixture of experts of a Qwen3-MoE or Mixtral `config.json`, as transformers builds it.
///
/// Qwen3-MoE: layer `i` is sparse when it is not in `mlp_only_layers` (default none), there are
/// experts, and `(i + 1) % decoder_sparse_step == 0` (default step 1); dense layers keep the MLP of
/// `intermediate_size`. The expert count, experts per token and `moe_intermediate_size` must be
/// stated (the config class's defaults are the 30B model's shape); `norm_topk_prob` defaults to
/// false, as there. Mixtral: every layer is sparse, experts of `intermediate_size`, 8 experts and 2
/// per token unless stated (the class's defaults, Mixtral's own shape), always renormalized.
/// `num_experts` and `num_local_experts` name the same count (transformers maps one to the other).
/// Settings of mixtures this engine does not run (shared experts, a routing scale or another
/// scoring function) are refused by name. `router_jitter_noise`, `router_aux_loss_coef` and
/// `output_router_logits` only act in training and are ignored, as transformers does at inference.
fn hf_experts(
    path: &Path,
    v: &Value,
    arch: Arch,
    num_layers: usize,
    intermediate_size: usize,
) -> Result<Option<MoeConfig>> {
    let unsupported = |msg: String| ModelError::Unsupported { path: path.into(), msg };
    let opt_usize = |key: &str| -> Result<Option<usize>> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_u64()
                .map(|x| Some(x as usize))
                .ok_or_else(|| ModelError::format(path, format!("invalid `{key}`"))),
        }
    };
    let need = |key: &str| -> Result<usize> {
        opt_usize(key)?.ok_or_else(|| ModelError::format(path, format!("missing `{key}`")))
    };
    for key in ["shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"] {
        if let Some(n) = opt_usize(key)?.filter(|&n| n > 0) {
            return Err(unsupported(format!("shared experts (`{key}` = {n})")));
        }
    }
    if let Some(f) = v.get("routed_scaling_factor").and_then(Value::as_f64).filter(|&f| f != 1.0) {
        return Err(unsupported(format!("`routed_scaling_factor` = {f}")));
    }
    if let Some(f) = v.get("scoring_func").and_then(Value::as_str).filter(|&f| f != "softmax") {
        return Err(unsupported(format!("`scoring_func` {f:?} (only softmax routing runs)")));
    }
    let experts = match (opt_usize("num_experts")?, opt_usize("num_local_experts")?) {
        (Some(a), Some(b)) if a != b => {
            return Err(ModelError::format(
                path,
                format!("`num_experts` ({a}) and `num_local_experts` ({b}) disagree"),
            ))
        }
        (a, b) => a.or(b),
    };
    let moe = match arch {
        Arch::Qwen3Moe => {
            let experts = experts
                .ok_or_else(|| ModelError::format(path, "missing `num_experts` (or `num_local_experts`)"))?;
            let step = opt_usize("decoder_sparse_step")?.unwrap_or(1);
            if step == 0 {
                return Err(ModelError::format(path, "`decoder_sparse_step` must be at least 1"));
            }
            let dense: Vec<usize> = match v.get("mlp_only_layers") {
                None | Some(Value::Null) => Vec::new(),
                Some(l) => l
                    .as_array()
                    .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect())
                    .ok_or_else(|| {
                        ModelError::format(path, "`mlp_only_layers` is not a list of layer indices")
                    })?,
            };
            let sparse: Vec<bool> =
                (0..num_layers).map(|i| !dense.contains(&i) && experts > 0 && (i + 1) % step == 0).collect();
            if !sparse.contains(&true) {
                return Ok(None);
            }
            let renormalize = match v.get("norm_topk_prob") {
                None | Some(Value::Null) => false,
                Some(b) => b.as_bool().ok_or_else(|| ModelError::format(path, "invalid `norm_topk_prob`"))?,
            };
            MoeConfig {
                num_experts: experts,
                top_k: need("num_experts_per_tok")?,
                expert_intermediate_size: need("moe_intermediate_size")?,
                renormalize,
                sparse_layers: sparse,
            }
        }
        _ => MoeConfig {
            num_experts: experts.unwrap_or(8),
            top_k: opt_usize("num_experts_per_tok")?.unwrap_or(2),
            expert_intermediate_size: intermediate_size,
            renormalize: true,
            sparse_layers: vec![true; num_layers],
        },
    };
    Ok(Some(moe))
}

/// The mixture of experts of a GGUF file's `qwen3moe` or MoE `llama` (Mixtral) architecture, as
/// llama.cpp, which defines these files, runs it: softmax routing over `expert_count` experts with
/// `expert_used_count` per token, renormalized (unless `expert_weights_norm` says false). A layer
/// is sparse when it has a router (`blk.N.ffn_gate_inp.weight`; llama.cpp requires one in every
/// layer, and a layer without one is read as a dense MLP). Qwen3-MoE experts are `expert_feed_forward_length` wide
/// (else `feed_forward_length / expert_used_count`), Mixtral's `feed_forward_length`. Shared
/// experts, grouped routing, another gating function and a routing scale are refused by name.
fn gguf_experts(
    g: &GgufFile,
    arch_name: &str,
    arch: Arch,
    num_layers: usize,
    ff: usize,
) -> Result<MoeConfig> {
    let path = g.path.as_path();
    let key = |k: &str| format!("{arch_name}.{k}");
    let opt_u64 = |k: &str| g.get(&key(k)).and_then(|v| v.as_u64());
    let unsupported = |msg: String| ModelError::Unsupported { path: path.into(), msg };
    let need = |k: &str| -> Result<usize> {
        opt_u64(k)
            .filter(|&n| n > 0)
            .map(|n| n as usize)
            .ok_or_else(|| ModelError::format(path, format!("missing or zero `{}`", key(k))))
    };
    let experts = need("expert_count")?;
    let top_k = need("expert_used_count")?;
    if let Some(n) = opt_u64("expert_shared_count").filter(|&n| n > 0) {
        return Err(unsupported(format!("shared experts (`{}` = {n})", key("expert_shared_count"))));
    }
    if g.tensor("blk.0.ffn_gate_inp_shexp.weight").is_some()
        || g.tensor("blk.0.ffn_up_shexp.weight").is_some()
    {
        return Err(unsupported("shared experts (tensors `blk.0.ffn_*_shexp`)".into()));
    }
    if let Some(n) = opt_u64("expert_group_count").filter(|&n| n > 1) {
        return Err(unsupported(format!("grouped expert routing (`{}` = {n})", key("expert_group_count"))));
    }
    if let Some(f) = opt_u64("expert_gating_func").filter(|&f| f != 1) {
        return Err(unsupported(format!(
            "`{}` = {f} (only softmax gating, 1, runs)",
            key("expert_gating_func")
        )));
    }
    let scale = g.get(&key("expert_weights_scale")).and_then(|v| v.as_f64());
    if let Some(s) = scale.filter(|&s| s != 0.0 && s != 1.0) {
        return Err(unsupported(format!("`{}` = {s}", key("expert_weights_scale"))));
    }
    let expert_intermediate_size = match arch {
        Arch::Qwen3Moe => opt_u64("expert_feed_forward_length").map_or(ff / top_k, |n| n as usize),
        _ => ff,
    };
    let sparse_layers: Vec<bool> =
        (0..num_layers).map(|i| g.tensor(&format!("blk.{i}.ffn_gate_inp.weight")).is_some()).collect();
    if !sparse_layers.contains(&true) {
        return Err(ModelError::format(path, "experts but no router tensor (`blk.N.ffn_gate_inp.weight`)"));
    }
    Ok(MoeConfig {
        num_experts: experts,
        top_k,
        expert_intermediate_size,
        renormalize: g.get(&key("expert_weights_norm")).and_then(|v| v.as_bool()).unwrap_or(true),
        sparse_layers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<ModelConfig> {
        ModelConfig::from_hf_json(Path::new("config.json"), s)
    }

    const BASE: &str = r#""hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 100"#;

    #[test]
    fn llama_with_llama3_scaling_and_new_style_rope_parameters() {
        let c = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_parameters": {{"rope_type": "llama3", "rope_theta": 500000.0,
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}}}"#
        ))
        .unwrap();
        assert_eq!(c.arch, Arch::Llama);
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.rope_theta, 500000.0);
        assert!(matches!(c.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 8.0));
    }

    #[test]
    fn qwen2_has_bias_qwen3_has_qk_norm() {
        let q2 = parse(&format!(r#"{{"model_type": "qwen2", {BASE}}}"#)).unwrap();
        assert!(q2.qkv_bias && !q2.qk_norm);
        let q3 = parse(&format!(r#"{{"model_type": "qwen3", {BASE}, "head_dim": 32}}"#)).unwrap();
        assert!(q3.qk_norm && !q3.qkv_bias);
        assert_eq!(q3.head_dim, 32);
    }

    #[test]
    fn refuses_what_it_cannot_run() {
        let e = parse(&format!(r#"{{"model_type": "gpt2", {BASE}}}"#)).unwrap_err();
        assert!(e.to_string().contains("gpt2"), "{e}");
        let e = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_scaling": {{"rope_type": "yarn", "factor": 4.0}}}}"#
        ))
        .unwrap_err();
        assert!(e.to_string().contains("yarn"), "{e}");
        let e = parse(r#"{"model_type": "llama", "hidden_size": 64}"#).unwrap_err();
        assert!(e.to_string().contains("num_attention_heads"), "{e}");
        let e = parse(&format!(r#"{{"model_type": "llama", {BASE}, "hidden_act": "gelu"}}"#)).unwrap_err();
        assert!(e.to_string().contains("gelu"), "{e}");
        for (extra, needle) in [
            (r#""max_position_embeddings": 0"#, "context length"),
            (r#""model_type": "mistral", "sliding_window": 0"#, "sliding window"),
            (r#""rope_scaling": {"rope_type": "linear", "factor": 0.0}"#, "factor"),
            (
                r#""rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}"#,
                "high_freq_factor",
            ),
            (r#""attention_bias": true"#, "attention_bias"),
        ] {
            let json = format!(r#"{{"model_type": "llama", {BASE}, {extra}}}"#);
            // A later duplicate key wins in serde_json, so "model_type" may be overridden.
            let e = parse(&json).unwrap_err();
            assert!(e.to_string().contains(needle), "{extra}: {e}");
        }
        let e = parse("{not json").unwrap_err();
        assert!(e.to_string().starts_with("config.json"), "{e}");
    }

    const GEMMA: &str = r#""hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "intermediate_size": 160, "num_hidden_layers": 4, "vocab_size": 100,
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 24, "sliding_window": 16"#;

    #[test]
    fn gemma3_reads_the_same_from_both_spellings() {
        let new = parse(&format!(
            r#"{{"model_type": "gemma3_text", {GEMMA},
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {{"full_attention": {{"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
                                 "sliding_attention": {{"rope_type": "default", "rope_theta": 10000.0}}}}}}"#
        ))
        .unwrap();
        let classic = parse(&format!(
            r#"{{"model_type": "gemma3_text", {GEMMA}, "sliding_window_pattern": 3, "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0, "rope_scaling": {{"rope_type": "linear", "factor": 8.0}}}}"#
        ))
        .unwrap();
        assert_eq!(new, classic);
        assert_eq!(new.arch, Arch::Gemma3);
        assert_eq!(new.sliding_layers, Some(vec![true, true, false, true]));
        assert_eq!((new.rope_theta, new.rope_local_theta), (1e6, Some(1e4)));
        assert_eq!(new.rope_scaling, Some(RopeScaling::Linear { factor: 8.0 }));
        assert_eq!(new.mlp_act, MlpAct::GeluTanh);
        assert_eq!(new.query_pre_attn_scalar, Some(24.0));
        assert!(new.qk_norm && new.tie_word_embeddings, "Gemma 3: q/k norms, tied by default");
    }

    #[test]
    fn gemma2_alternates_layers_and_soft_caps() {
        let c = parse(&format!(
            r#"{{"model_type": "gemma2", {GEMMA}, "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": null, "tie_word_embeddings": false}}"#
        ))
        .unwrap();
        assert_eq!(c.arch, Arch::Gemma2);
        assert_eq!(c.sliding_layers, Some(vec![true, false, true, false]));
        assert_eq!((c.attn_logit_softcapping, c.final_logit_softcapping), (Some(50.0), None));
        assert!(!c.qk_norm && !c.tie_word_embeddings && c.rope_local_theta.is_none());
    }

    #[test]
    fn gemma_settings_are_stated_or_refused_by_name() {
        let drop = |key: &str| {
            let quoted = format!("\"{key}\"");
            GEMMA
                .split(',')
                .map(str::trim)
                .filter(|kv| !kv.starts_with(&quoted))
                .collect::<Vec<_>>()
                .join(", ")
        };
        for key in [
            "head_dim",
            "num_key_value_heads",
            "query_pre_attn_scalar",
            "sliding_window",
            "hidden_activation",
        ] {
            let json = format!(r#"{{"model_type": "gemma2", {}}}"#, drop(key));
            let e = parse(&json).unwrap_err();
            assert!(e.to_string().contains(key), "{key}: {e}");
        }
        let e = parse(&format!(r#"{{"model_type": "gemma3_text", {GEMMA}, "rope_local_base_freq": 1e4}}"#))
            .unwrap_err();
        assert!(e.to_string().contains("sliding_window_pattern"), "{e}");
        let e = parse(&format!(r#"{{"model_type": "gemma3_text", {GEMMA}, "sliding_window_pattern": 6}}"#))
            .unwrap_err();
        assert!(e.to_string().contains("rope_local_base_freq"), "{e}");
        for (extra, needle) in [
            (r#""model_type": "gemma3", "text_config": {}"#, "multimodal"),
            (r#""model_type": "gemma2", "use_bidirectional_attention": true"#, "use_bidirectional_attention"),
            (r#""model_type": "gemma2", "layer_types": ["full_attention"]"#, "layer_types"),
            (
                r#""model_type": "gemma2", "layer_types": ["chunked_attention", "full_attention", "full_attention", "full_attention"]"#,
                "chunked_attention",
            ),
            (r#""model_type": "gemma2", "attn_logit_softcapping": -1.0"#, "attn_logit_softcapping"),
            (r#""model_type": "gemma2", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}"#, "yarn"),
        ] {
            let e = parse(&format!(r#"{{{GEMMA}, {extra}}}"#)).unwrap_err();
            assert!(e.to_string().contains(needle), "{extra}: {e}");
        }
        let e = parse(&format!(
            r#"{{"model_type": "gemma2", {}, "hidden_activation": "silu"}}"#,
            drop("hidden_activation")
        ))
        .unwrap_err();
        assert!(e.to_string().contains("silu"), "{e}");
    }

    fn fixture_config(name: &str) -> ModelConfig {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures").join(name);
        let path = path.join("config.json");
        ModelConfig::from_hf_json(&path, &std::fs::read_to_string(&path).unwrap()).unwrap()
    }

    fn longrope_parts(c: &ModelConfig) -> (&[f32], &[f32], usize, f32) {
        match &c.rope_scaling {
            Some(RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings,
                attention_factor,
            }) => (short_factor, long_factor, *original_max_position_embeddings, *attention_factor),
            other => panic!("expected LongRoPE, got {other:?}"),
        }
    }

    #[test]
    fn phi3_fixtures() {
        // transformers 5's spelling: `rope_parameters` with rope_type "default".
        let c = fixture_config("phi3");
        assert_eq!(c.arch, Arch::Phi3);
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size), (4, 2, 16, 128));
        assert_eq!((c.rope_theta, c.rope_scaling.clone(), c.sliding_window), (10000.0, None, None));
        assert!(!c.tie_word_embeddings && !c.qkv_bias && !c.qk_norm);
        // The published spelling: `rope_theta`, `rope_scaling` with `type: longrope`, the original
        // context at the top level; attention factor sqrt(1 + ln(512 / 64) / ln(64)).
        let c = fixture_config("phi3-longrope");
        let (short, long, original, af) = longrope_parts(&c);
        assert_eq!((short.len(), short[1], short[7]), (8, 1.05, 1.35));
        assert_eq!((long.len(), long[1], long[7]), (8, 1.6, 26.8435));
        assert_eq!(original, 64);
        assert_eq!(af, 1.5f64.sqrt() as f32);
    }

    const PHI3: &str = r#""model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "num_hidden_layers": 2, "vocab_size": 100, "max_position_embeddings": 131072"#;
    const FACTORS: &str = r#""short_factor": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        "long_factor": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]"#;

    fn phi3(extra: &str) -> Result<ModelConfig> {
        parse(&format!("{{{PHI3}, {extra}}}"))
    }

    #[test]
    fn phi3_longrope_spellings_and_attention_factor() {
        // Phi-3-mini-128k's older `su`, Phi-3.5's `longrope`, transformers 5's `rope_parameters`:
        // one setting. The factor is 131072 / 4096 = 32: sqrt(1 + ln 32 / ln 4096) = sqrt(17/12).
        let want = (17.0f64 / 12.0).sqrt() as f32;
        for rope in [
            format!(r#""rope_scaling": {{"type": "su", {FACTORS}}}"#),
            format!(r#""rope_scaling": {{"type": "longrope", {FACTORS}}}"#),
            format!(
                r#""rope_parameters": {{"rope_type": "longrope", "rope_theta": 10000.0,
                "partial_rotary_factor": 1.0, "original_max_position_embeddings": 4096, {FACTORS}}}"#
            ),
        ] {
            for top in ["", r#""original_max_position_embeddings": 4096,"#] {
                let c = phi3(&format!("{top} {rope}")).unwrap_or_else(|e| panic!("{rope}: {e}"));
                let (short, long, original, af) = longrope_parts(&c);
                assert_eq!((short[7], long[7], original), (1.0, 8.0, 4096), "{rope}");
                assert_eq!(af, want, "{top} {rope}");
            }
        }
        // `factor` replaces max / original; `attention_factor` is taken as given.
        let c =
            phi3(&format!(r#""rope_scaling": {{"type": "longrope", "factor": 4.0, {FACTORS}}}"#)).unwrap();
        assert_eq!(longrope_parts(&c).3, (1.0 + 4f64.ln() / 4096f64.ln()).sqrt() as f32);
        let c =
            phi3(&format!(r#""rope_scaling": {{"type": "longrope", "attention_factor": 1.1, {FACTORS}}}"#))
                .unwrap();
        assert_eq!(longrope_parts(&c).3, 1.1);
        // Not extended (max <= original): factor 1.
        let c = phi3(&format!(
            r#""original_max_position_embeddings": 131072, "rope_scaling": {{"type": "su", {FACTORS}}}"#
        ))
        .unwrap();
        assert_eq!(longrope_parts(&c).3, 1.0);
    }

    #[test]
    fn phi3_defaults_and_sliding_window() {
        // Phi-3-mini-4k: a 2047-token window, no rope scaling, transformers' eps default 1e-5.
        let c = phi3(r#""sliding_window": 2047, "rope_scaling": null"#).unwrap();
        assert_eq!((c.sliding_window, c.rms_norm_eps, c.rope_scaling.clone()), (Some(2047), 1e-5, None));
        let c = phi3(r#""sliding_window": null, "rms_norm_eps": 1e-6"#).unwrap();
        assert_eq!((c.sliding_window, c.rms_norm_eps), (None, 1e-6));
        // Found by its class name alone.
        let c = parse(&format!("{{{}}}", PHI3.replace(r#""model_type": "phi3","#, ""))).unwrap();
        assert_eq!(c.arch, Arch::Phi3);
    }

    #[test]
    fn phi3_refusals_name_the_setting() {
        for (extra, needle) in [
            (r#""partial_rotary_factor": 0.75"#.to_string(), "partial_rotary_factor"),
            (
                r#""rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}"#
                    .to_string(),
                "partial_rotary_factor",
            ),
            (format!(r#""rope_scaling": {{"type": "yarn", {FACTORS}}}"#), "yarn"),
            (r#""rope_scaling": {"type": "linear", "factor": 2.0}"#.to_string(), "linear"),
            (r#""rope_scaling": {"type": "longrope", "short_factor": [1.0]}"#.to_string(), "long_factor"),
            (
                r#""rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.0],
                "long_factor": [1.0, 1.0]}"#
                    .to_string(),
                "short_factor has 2 values",
            ),
            (
                format!(r#""rope_scaling": {{"type": "longrope", "original_max_position_embeddings": 64, {FACTORS}}}"#),
                "differs",
            ),
            (r#""attention_bias": true"#.to_string(), "attention_bias"),
            (r#""mlp_bias": true"#.to_string(), "mlp_bias"),
            (r#""hidden_act": "gelu_new""#.to_string(), "gelu_new"),
        ] {
            let e = phi3(&extra).unwrap_err();
            assert!(e.to_string().contains(needle), "{extra}: {e}");
        }
        // Other Phi models are other architectures.
        let e = parse(&format!(r#"{{"model_type": "phimoe", {BASE}}}"#)).unwrap_err();
        assert!(e.to_string().contains("phimoe"), "{e}");
        // LongRoPE is read for Phi-3 only.
        let e = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_scaling": {{"type": "longrope", {FACTORS}}}}}"#
        ))
        .unwrap_err();
        assert!(e.to_string().contains("longrope"), "{e}");
    }

    /// The shipped fixtures' configs, as transformers 5 writes them.
    fn fixture(name: &str) -> Result<ModelConfig> {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/reference/fixtures")
            .join(name)
            .join("config.json");
        ModelConfig::from_hf_json(&p, &std::fs::read_to_string(&p).unwrap())
    }

    #[test]
    fn qwen3_moe_layers_follow_transformers_rule() {
        let c = fixture("qwen3-moe").unwrap();
        assert_eq!(c.arch, Arch::Qwen3Moe);
        assert!(c.qk_norm && !c.qkv_bias);
        assert_eq!((c.intermediate_size, c.head_dim), (128, 32));
        let m = c.moe.unwrap();
        // `num_local_experts` (transformers 5's spelling of `num_experts`), mlp_only_layers [1].
        assert_eq!((m.num_experts, m.top_k, m.expert_intermediate_size), (8, 2, 32));
        assert!(m.renormalize);
        assert_eq!(m.sparse_layers, [true, false, true]);

        const Q: &str = r#""model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4,
            "intermediate_size": 128, "num_hidden_layers": 6, "vocab_size": 100, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16"#;
        let c = parse(&format!(r#"{{{Q}, "decoder_sparse_step": 2, "mlp_only_layers": [3]}}"#)).unwrap();
        let m = c.moe.unwrap();
        // (i + 1) % 2 == 0 and not in mlp_only_layers: layers 1 and 5.
        assert_eq!(m.sparse_layers, [false, true, false, false, false, true]);
        assert!(!m.renormalize, "norm_topk_prob defaults to false, as in transformers");
        assert_eq!(c.max_position_embeddings, 32768);
        // No experts: every layer dense.
        let c = parse(&format!(r#"{{{Q}, "num_experts": 0}}"#)).unwrap();
        assert_eq!(c.moe, None);
        for (extra, needle) in [
            (r#""num_experts_per_tok": 5"#, "between 1 and"),
            (r#""num_experts_per_tok": 0"#, "between 1 and"),
            (r#""num_local_experts": 8"#, "disagree"),
            (r#""decoder_sparse_step": 0"#, "decoder_sparse_step"),
            (r#""mlp_only_layers": "all""#, "mlp_only_layers"),
            (r#""shared_expert_intermediate_size": 64"#, "shared experts"),
            (r#""use_sliding_window": true"#, "use_sliding_window"),
            (r#""attention_bias": true"#, "attention_bias"),
            (r#""scoring_func": "sigmoid""#, "scoring_func"),
        ] {
            let e = parse(&format!("{{{Q}, {extra}}}")).unwrap_err();
            assert!(e.to_string().contains(needle), "{extra}: {e}");
        }
        for missing in ["num_experts_per_tok", "moe_intermediate_size"] {
            let json = Q.replace(&format!(r#""{missing}""#), r#""unused""#);
            let e = parse(&format!("{{{json}}}")).unwrap_err();
            assert!(e.to_string().contains(missing), "{e}");
        }
        let e = parse(&format!("{{{}}}", Q.replace(r#""num_experts""#, r#""unused""#))).unwrap_err();
        assert!(e.to_string().contains("num_experts"), "{e}");
    }

    #[test]
    fn mixtral_defaults_are_transformers() {
        let c = fixture("mixtral").unwrap();
        assert_eq!(c.arch, Arch::Mixtral);
        assert!(!c.qk_norm);
        assert_eq!(c.sliding_window, None);
        let m = c.moe.unwrap();
        assert_eq!((m.num_experts, m.top_k, m.expert_intermediate_size), (4, 2, 96));
        assert!(m.renormalize);
        assert_eq!(m.sparse_layers, [true, true]);

        // Nothing but the shape: MixtralConfig's defaults (8 experts, top 2, rope 1e6, eps 1e-5).
        let c = parse(&format!(
            r#"{{"model_type": "mixtral", {BASE}, "sliding_window": 32,
            "router_jitter_noise": 0.1}}"#
        ))
        .unwrap();
        let m = c.moe.unwrap();
        assert_eq!((m.num_experts, m.top_k, m.expert_intermediate_size), (8, 2, 128));
        assert_eq!((c.rope_theta, c.rms_norm_eps), (1e6, 1e-5));
        assert_eq!(c.sliding_window, Some(32));
        assert_eq!(c.max_position_embeddings, 131072);
        let e = parse(&format!(r#"{{"model_type": "mixtral", {BASE}, "n_shared_experts": 1}}"#)).unwrap_err();
        assert!(e.to_string().contains("shared experts"), "{e}");
        let e = parse(&format!(r#"{{"model_type": "mixtral", {BASE}, "routed_scaling_factor": 2.5}}"#))
            .unwrap_err();
        assert!(e.to_string().contains("routed_scaling_factor"), "{e}");
        // Dense families have no mixture.
        assert_eq!(parse(&format!(r#"{{"model_type": "mistral", {BASE}}}"#)).unwrap().moe, None);
    }
}
