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

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;
pub use crate::models::llama::unpermute_rope_rows;
use crate::models::ModelWeights;
use crate::safetensors::{Fp8Blocks, SafeTensors};
use crate::tokenizer::Tokenizer;
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

/// Loads a GGUF file: weights, tokenizer and chat template all come from it.
pub fn load_gguf(path: &Path) -> Result<LoadedModel> {
    let g = GgufFile::open(path)?;
    let ModelInfo { config, tokenizer, model_id, model_name, .. } = gguf_info(path, &g)?;
    let weights = crate::models::load(&config, &g)?;
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

/// Loads a Hugging Face model directory.
pub fn load_hf_dir(dir: &Path) -> Result<LoadedModel> {
    let config_text = read_hf_config(dir)?;
    let config = ModelConfig::from_hf_json(&dir.join("config.json"), &config_text)?;
    let tokenizer = Tokenizer::from_hf_dir(dir)?;
    let mut st = SafeTensors::open_dir(dir)?;
    if let Some(blocks) = fp8_quantization(&dir.join("config.json"), &config_text)? {
        st.set_fp8_blocks(blocks);
        let scales = blocks
            .map_or("per tensor or per row".to_string(), |b| format!("per {}×{} block", b.rows, b.cols));
        tracing::info!(
            scales,
            "FP8 weights: dequantized at load (the CPU computes in f32, a GPU in bf16; no FP8 products yet)"
        );
    } else if st.has_fp8() {
        tracing::info!("FP8 tensors without a quantization_config: dequantized at load by their scales");
    }
    let weights = crate::models::load(&config, &st)?;
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

/// The weight quantization a `config.json` declares in `quantization_config`: `None` without one;
/// for FP8 (`quant_method` "fp8", or "compressed-tensors" whose weights are 8-bit floats), the
/// block of its block scales where it has them (`weight_block_size`, or a group's
/// `block_structure`). Other methods, and compressed-tensors formats other than 8-bit floats, are
/// refused by name.
pub fn fp8_quantization(path: &Path, text: &str) -> Result<Option<Option<Fp8Blocks>>> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| EngineError::format(path, format!("invalid JSON: {e}")))?;
    let Some(q) = v.get("quantization_config").filter(|q| !q.is_null()) else { return Ok(None) };
    let unsupported = |msg: String| EngineError::Unsupported { path: path.into(), msg };
    let pair = |x: Option<&serde_json::Value>| -> Option<Fp8Blocks> {
        let a = x?.as_array()?;
        match a.as_slice() {
            [r, c] => Some(Fp8Blocks { rows: r.as_u64()? as usize, cols: c.as_u64()? as usize }),
            _ => None,
        }
    };
    let method = q.get("quant_method").and_then(serde_json::Value::as_str).unwrap_or("");
    match method {
        "fp8" => {
            let blocks = pair(q.get("weight_block_size"));
            if q.get("weight_block_size").is_some_and(|b| !b.is_null())
                && blocks.is_none_or(|b| b.rows == 0 || b.cols == 0)
            {
                return Err(EngineError::format(
                    path,
                    "quantization_config: `weight_block_size` must be two positive sizes",
                ));
            }
            Ok(Some(blocks))
        }
        "compressed-tensors" => {
            let groups = q.get("config_groups").and_then(serde_json::Value::as_object);
            let mut blocks = None;
            for (name, g) in groups.into_iter().flatten() {
                let w = g.get("weights");
                let bits = w.and_then(|w| w.get("num_bits")).and_then(serde_json::Value::as_u64);
                let kind = w.and_then(|w| w.get("type")).and_then(serde_json::Value::as_str);
                if bits != Some(8) || kind != Some("float") {
                    return Err(unsupported(format!(
                        "compressed-tensors group `{name}` quantizes weights to {} {}-bit values; only 8-bit \
                         floats (FP8) load",
                        kind.unwrap_or("?"),
                        bits.map_or("?".to_string(), |b| b.to_string())
                    )));
                }
                blocks = blocks.or(pair(w.and_then(|w| w.get("block_structure"))));
            }
            Ok(Some(blocks))
        }
        other => Err(unsupported(format!(
            "quantization method {other:?} in quantization_config; supported: fp8 and compressed-tensors \
             FP8 (GGUF files load their own quantized types)"
        ))),
    }
}
