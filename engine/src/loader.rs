//! Turns a path into a runnable model: a GGUF file, or a Hugging Face directory
//! (`config.json`, safetensors, tokenizer files). Tensor names and layouts are mapped to the one
//! convention the backends use ([`ModelWeights`]: Hugging Face row orders); every shape is checked
//! here so that a backend never indexes out of bounds on a bad file.
//!
//! One call reads everything a process needs about a model: configuration, tokenizer, weights
//! and identity (the fingerprint of [`crate::fingerprint`]). Each model file is opened and
//! parsed once: the fingerprint hashes the bytes the parser has mapped, and callers pass the
//! [`LoadedModel`] on (to the backend, to the compatibility record) instead of the path. A
//! process that needs no weights (a router) reads a [`ModelInfo`] instead, which leaves the
//! tensors unread.

use std::path::{Path, PathBuf};

use crate::config::{Arch, ModelConfig};
use crate::error::{EngineError, Result};
use crate::gguf::{GgufFile, GgufTensors};
use crate::safetensors::SafeTensors;
use crate::tokenizer::Tokenizer;
use crate::weights::{Bytes, LayerWeights, Matrix, ModelWeights};
use tandem_model::info::{file_name, gguf_info, hf_fingerprint, read_hf_config};
pub use tandem_model::info::{load_model_info, ModelFormat, ModelInfo};

/// A model ready to hand to a backend, with its identity.
pub struct LoadedModel {
    pub path: PathBuf,
    pub format: ModelFormat,
    pub config: ModelConfig,
    pub weights: ModelWeights,
    pub tokenizer: Tokenizer,
    /// The model id, `sha256:<32 hex digits>` (see [`crate::fingerprint`]).
    pub model_id: String,
    /// A readable name: GGUF `general.name`, else the file or directory name.
    pub model_name: String,
}

impl LoadedModel {
    /// The model's description, without touching its files again.
    pub fn info(&self) -> ModelInfo {
        ModelInfo {
            path: self.path.clone(),
            format: self.format.clone(),
            config: self.config.clone(),
            tokenizer: self.tokenizer.clone(),
            model_id: self.model_id.clone(),
            model_name: self.model_name.clone(),
        }
    }
}

/// Loads a GGUF file or a Hugging Face model directory.
pub fn load_model(path: &Path) -> Result<LoadedModel> {
    let meta = std::fs::metadata(path).map_err(|e| EngineError::io(path, e))?;
    if meta.is_dir() {
        load_hf_dir(path)
    } else {
        load_gguf(path)
    }
}

fn check(path: &Path, name: &str, m: &Matrix, rows: usize, cols: usize) -> Result<()> {
    if m.rows != rows || m.cols != cols {
        return Err(EngineError::Shape {
            path: path.into(),
            tensor: name.into(),
            expected: vec![rows, cols],
            actual: vec![m.rows, m.cols],
        });
    }
    Ok(())
}

fn check_len(path: &Path, name: &str, v: &[f32], len: usize) -> Result<()> {
    if v.len() != len {
        return Err(EngineError::Shape {
            path: path.into(),
            tensor: name.into(),
            expected: vec![len],
            actual: vec![v.len()],
        });
    }
    Ok(())
}

/// Loads a GGUF file: weights, tokenizer and chat template all come from it.
pub fn load_gguf(path: &Path) -> Result<LoadedModel> {
    let g = GgufFile::open(path)?;
    let ModelInfo { config, tokenizer, model_id, model_name, .. } = gguf_info(path, &g)?;
    let c = &config;
    let (h, hd) = (c.hidden_size, c.head_dim);
    let mat = |name: &str, rows: usize, cols: usize| -> Result<Matrix> {
        let m = g.matrix(name)?;
        check(path, name, &m, rows, cols)?;
        Ok(m)
    };
    let vec = |name: &str, len: usize| -> Result<Vec<f32>> {
        let v = g.vector_f32(name)?;
        check_len(path, name, &v, len)?;
        Ok(v)
    };
    let opt_vec = |name: &str, len: usize| -> Result<Option<Vec<f32>>> {
        if g.tensor(name).is_some() {
            vec(name, len).map(Some)
        } else {
            Ok(None)
        }
    };
    // llama.cpp's converter interleaves the two rotary halves of each Q/K head for Llama-family
    // models (its RoPE rotates adjacent pairs); undo it so every backend uses one RoPE style.
    let permuted = matches!(c.arch, Arch::Llama | Arch::Mistral);
    if g.tensor("blk.0.attn_output.bias").is_some() {
        return Err(EngineError::Unsupported {
            path: path.into(),
            msg: "tensor `blk.0.attn_output.bias` (output projection bias)".into(),
        });
    }
    let embed = mat("token_embd.weight", c.vocab_size, h)?;
    let mut layers = Vec::new();
    for i in 0..c.num_layers {
        let n = |s: &str| format!("blk.{i}.{s}");
        let mut wq = mat(&n("attn_q.weight"), c.num_heads * hd, h)?;
        let mut wk = mat(&n("attn_k.weight"), c.num_kv_heads * hd, h)?;
        if permuted {
            wq = unpermute_rope_rows(&wq, c.num_heads);
            wk = unpermute_rope_rows(&wk, c.num_kv_heads);
        }
        layers.push(LayerWeights {
            attn_norm: vec(&n("attn_norm.weight"), h)?,
            wq,
            wk,
            wv: mat(&n("attn_v.weight"), c.num_kv_heads * hd, h)?,
            wo: mat(&n("attn_output.weight"), h, c.num_heads * hd)?,
            bq: if c.qkv_bias { Some(vec(&n("attn_q.bias"), c.num_heads * hd)?) } else { None },
            bk: if c.qkv_bias { Some(vec(&n("attn_k.bias"), c.num_kv_heads * hd)?) } else { None },
            bv: if c.qkv_bias { Some(vec(&n("attn_v.bias"), c.num_kv_heads * hd)?) } else { None },
            q_norm: if c.qk_norm {
                Some(vec(&n("attn_q_norm.weight"), hd)?)
            } else {
                opt_vec(&n("attn_q_norm.weight"), hd)?
            },
            k_norm: if c.qk_norm {
                Some(vec(&n("attn_k_norm.weight"), hd)?)
            } else {
                opt_vec(&n("attn_k_norm.weight"), hd)?
            },
            ffn_norm: vec(&n("ffn_norm.weight"), h)?,
            w_gate: mat(&n("ffn_gate.weight"), c.intermediate_size, h)?,
            w_up: mat(&n("ffn_up.weight"), c.intermediate_size, h)?,
            w_down: mat(&n("ffn_down.weight"), h, c.intermediate_size)?,
        });
    }
    let lm_head = if c.tie_word_embeddings { embed.clone() } else { mat("output.weight", c.vocab_size, h)? };
    let weights = ModelWeights { embed, layers, final_norm: vec("output_norm.weight", h)?, lm_head };
    Ok(LoadedModel {
        path: path.into(),
        format: ModelFormat::Gguf,
        config,
        weights,
        tokenizer,
        model_id,
        model_name,
    })
}

/// Reorders the rows of a Q or K projection from llama.cpp's interleaved RoPE layout (pairs
/// `(2j, 2j+1)` rotate together) back to the rotate-half layout (`j` with `j + head_dim/2`).
/// Rows are independent in every GGML type, so this is a byte copy per row.
pub fn unpermute_rope_rows(m: &Matrix, n_heads: usize) -> Matrix {
    let hd = m.rows / n_heads;
    let half = hd / 2;
    let rb = m.row_bytes();
    let mut out = vec![0u8; m.rows * rb];
    for head in 0..n_heads {
        for t in 0..2 {
            for j in 0..half {
                let dst = head * hd + t * half + j;
                let src = head * hd + 2 * j + t;
                out[dst * rb..(dst + 1) * rb].copy_from_slice(m.row(src));
            }
        }
    }
    Matrix { rows: m.rows, cols: m.cols, dtype: m.dtype, data: Bytes::copy_from(&out) }
}

/// Loads a Hugging Face model directory.
pub fn load_hf_dir(dir: &Path) -> Result<LoadedModel> {
    let config_text = read_hf_config(dir)?;
    let config = ModelConfig::from_hf_json(&dir.join("config.json"), &config_text)?;
    let tokenizer = Tokenizer::from_hf_dir(dir)?;
    let st = SafeTensors::open_dir(dir)?;
    let c = &config;
    let (h, hd) = (c.hidden_size, c.head_dim);
    let opt = |name: &str, len: usize, present: bool| -> Result<Option<Vec<f32>>> {
        if present {
            st.vector(name, len).map(Some)
        } else {
            Ok(None)
        }
    };
    let embed = st.matrix("model.embed_tokens.weight", c.vocab_size, h)?;
    let mut layers = Vec::new();
    for i in 0..c.num_layers {
        let n = |s: &str| format!("model.layers.{i}.{s}");
        layers.push(LayerWeights {
            attn_norm: st.vector(&n("input_layernorm.weight"), h)?,
            wq: st.matrix(&n("self_attn.q_proj.weight"), c.num_heads * hd, h)?,
            wk: st.matrix(&n("self_attn.k_proj.weight"), c.num_kv_heads * hd, h)?,
            wv: st.matrix(&n("self_attn.v_proj.weight"), c.num_kv_heads * hd, h)?,
            wo: st.matrix(&n("self_attn.o_proj.weight"), h, c.num_heads * hd)?,
            bq: opt(&n("self_attn.q_proj.bias"), c.num_heads * hd, c.qkv_bias)?,
            bk: opt(&n("self_attn.k_proj.bias"), c.num_kv_heads * hd, c.qkv_bias)?,
            bv: opt(&n("self_attn.v_proj.bias"), c.num_kv_heads * hd, c.qkv_bias)?,
            q_norm: opt(&n("self_attn.q_norm.weight"), hd, c.qk_norm)?,
            k_norm: opt(&n("self_attn.k_norm.weight"), hd, c.qk_norm)?,
            ffn_norm: st.vector(&n("post_attention_layernorm.weight"), h)?,
            w_gate: st.matrix(&n("mlp.gate_proj.weight"), c.intermediate_size, h)?,
            w_up: st.matrix(&n("mlp.up_proj.weight"), c.intermediate_size, h)?,
            w_down: st.matrix(&n("mlp.down_proj.weight"), h, c.intermediate_size)?,
        });
    }
    // Tied checkpoints sometimes still ship an `lm_head.weight`; like transformers, the tie wins.
    let lm_head = if c.tie_word_embeddings {
        embed.clone()
    } else if st.contains("lm_head.weight") {
        st.matrix("lm_head.weight", c.vocab_size, h)?
    } else {
        return Err(EngineError::MissingTensor { path: st.path().into(), tensor: "lm_head.weight".into() });
    };
    let weights = ModelWeights { embed, layers, final_norm: st.vector("model.norm.weight", h)?, lm_head };
    let model_id = {
        let mapped: Vec<(&Path, &[u8])> = st.mapped_files().collect();
        hf_fingerprint(dir, &config_text, &mapped)?
    };
    Ok(LoadedModel {
        path: dir.into(),
        format: ModelFormat::HuggingFace,
        config,
        weights,
        tokenizer,
        model_id,
        model_name: file_name(dir),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::GgmlType;

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        // 2 heads of head_dim 4, one f32 column whose value is the Hugging Face row index.
        let (heads, hd) = (2usize, 4usize);
        let hf: Vec<f32> = (0..heads * hd).map(|r| r as f32).collect();
        // llama.cpp: reshape(heads, 2, hd/2).swapaxes(1, 2): gguf row (h, j, t) = hf row (h, t, j).
        let mut gg = vec![0f32; hf.len()];
        for h in 0..heads {
            for j in 0..hd / 2 {
                for t in 0..2 {
                    gg[h * hd + j * 2 + t] = hf[h * hd + t * (hd / 2) + j];
                }
            }
        }
        let m = Matrix { rows: heads * hd, cols: 1, dtype: GgmlType::F32, data: Bytes::from_f32(&gg) };
        let back = unpermute_rope_rows(&m, heads);
        assert_eq!(back.data.as_f32().unwrap(), hf.as_slice());
    }
}
