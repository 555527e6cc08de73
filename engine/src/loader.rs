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
    let has_fp8 = st.has_fp8();
    if let Some(blocks) = fp8_quantization(&dir.join("config.json"), &config_text)?.filter(|_| has_fp8) {
        st.set_fp8_blocks(blocks);
        let scales = blocks
            .map_or("per tensor or per row".to_string(), |b| format!("per {}×{} block", b.rows, b.cols));
        tracing::info!(
            scales,
            "FP8 weights: dequantized at load (the CPU computes in f32, a GPU in bf16; no FP8 products yet)"
        );
    } else if has_fp8 {
        tracing::info!("FP8 tensors without an FP8 quantization_config: dequantized at load by their scales");
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
/// for FP8 (`quant_method` "fp8", or "compressed-tensors" whose quantized weights are 8-bit
/// floats), the block of its block scales where it has them (`weight_block_size`, or a group's
/// `block_structure`, or its `group_size` as blocks of one row). Other methods, and
/// compressed-tensors formats other than 8-bit floats, are refused by name.
pub fn fp8_quantization(path: &Path, text: &str) -> Result<Option<Option<Fp8Blocks>>> {
    use serde_json::Value;
    let v: Value =
        serde_json::from_str(text).map_err(|e| EngineError::format(path, format!("invalid JSON: {e}")))?;
    let Some(q) = v.get("quantization_config").filter(|q| !q.is_null()) else { return Ok(None) };
    let bad = |msg: &str| EngineError::format(path, format!("quantization_config: {msg}"));
    let unsupported = |msg: String| EngineError::Unsupported { path: path.into(), msg };
    let positive = |x: Option<&Value>| x.and_then(Value::as_u64).filter(|&n| n > 0).map(|n| n as usize);
    let pair = |x: &Value| -> Option<Fp8Blocks> {
        match x.as_array()?.as_slice() {
            [r, c] => Some(Fp8Blocks { rows: positive(Some(r))?, cols: positive(Some(c))? }),
            _ => None,
        }
    };
    let Some(method) = q.get("quant_method").and_then(Value::as_str) else {
        return Err(bad("no `quant_method`"));
    };
    match method {
        "fp8" => match q.get("weight_block_size").filter(|b| !b.is_null()) {
            None => Ok(Some(None)),
            Some(b) => pair(b)
                .map(|b| Some(Some(b)))
                .ok_or_else(|| bad("`weight_block_size` must be two positive sizes")),
        },
        "compressed-tensors" => {
            let mut blocks: Option<Fp8Blocks> = None;
            let groups = q.get("config_groups").and_then(Value::as_object);
            for (name, g) in groups.into_iter().flatten() {
                // A group that quantizes only activations leaves its weights as they are.
                let Some(w) = g.get("weights").filter(|w| !w.is_null()) else { continue };
                let bits = w.get("num_bits").and_then(Value::as_u64);
                let kind = w.get("type").and_then(Value::as_str);
                if bits != Some(8) || kind != Some("float") {
                    return Err(unsupported(format!(
                        "compressed-tensors group `{name}` quantizes weights to {} {}-bit values; only 8-bit \
                         floats (FP8) load",
                        kind.unwrap_or("?"),
                        bits.map_or("?".to_string(), |b| b.to_string())
                    )));
                }
                let group = match w.get("strategy").and_then(Value::as_str) {
                    Some("block") => Some(w.get("block_structure").and_then(pair).ok_or_else(|| {
                        bad("a block group needs a `block_structure` of two positive sizes")
                    })?),
                    Some("group") => Some(Fp8Blocks {
                        rows: 1,
                        cols: positive(w.get("group_size"))
                            .ok_or_else(|| bad("a group needs a positive `group_size`"))?,
                    }),
                    _ => None,
                };
                match (blocks, group) {
                    (Some(a), Some(b)) if a != b => {
                        return Err(unsupported(format!(
                            "compressed-tensors groups with different blocks ({}×{} and {}×{})",
                            a.rows, a.cols, b.rows, b.cols
                        )))
                    }
                    (None, Some(b)) => blocks = Some(b),
                    _ => {}
                }
            }
            Ok(Some(blocks))
        }
        other => Err(unsupported(format!(
            "quantization method {other:?} in quantization_config; supported: fp8 and compressed-tensors \
             FP8 (GGUF files load their own quantized types)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quant(config: &str) -> Result<Option<Option<Fp8Blocks>>> {
        fp8_quantization(Path::new("config.json"), config)
    }

    #[test]
    fn quantization_configs_are_read_or_refused_by_name() {
        assert_eq!(quant(r#"{"model_type": "qwen3"}"#).unwrap(), None);
        assert_eq!(quant(r#"{"quantization_config": null}"#).unwrap(), None);
        let fp8 = r#"{"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 64]}}"#;
        assert_eq!(quant(fp8).unwrap(), Some(Some(Fp8Blocks { rows: 128, cols: 64 })));
        assert_eq!(quant(r#"{"quantization_config": {"quant_method": "fp8"}}"#).unwrap(), Some(None));
        let e = quant(r#"{"quantization_config": {"quant_method": "fp8", "weight_block_size": [0, 8]}}"#);
        assert!(e.unwrap_err().to_string().contains("weight_block_size"));
        let e = quant(r#"{"quantization_config": {"bits": 4}}"#).unwrap_err().to_string();
        assert!(e.contains("no `quant_method`"), "{e}");
        let e = quant(r#"{"quantization_config": {"quant_method": "awq"}}"#).unwrap_err().to_string();
        assert!(e.contains("method \"awq\""), "{e}");
        // compressed-tensors: per-channel FP8 weights, an activations-only group, a block group, a
        // 4-bit integer group.
        let ct = |groups: &str| {
            format!(
                r#"{{"quantization_config": {{"quant_method": "compressed-tensors", "config_groups": {{{groups}}}}}}}"#
            )
        };
        let channel = r#""g0": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}"#;
        let acts = r#""g1": {"weights": null, "input_activations": {"num_bits": 8, "type": "float"}}"#;
        assert_eq!(quant(&ct(&format!("{channel}, {acts}"))).unwrap(), Some(None));
        let block = r#""g2": {"weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}}"#;
        assert_eq!(quant(&ct(block)).unwrap(), Some(Some(Fp8Blocks { rows: 128, cols: 128 })));
        let group =
            r#""g3": {"weights": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32}}"#;
        assert_eq!(quant(&ct(group)).unwrap(), Some(Some(Fp8Blocks { rows: 1, cols: 32 })));
        let e = quant(&ct(&format!("{block}, {group}"))).unwrap_err().to_string();
        assert!(e.contains("different blocks"), "{e}");
        let int4 =
            r#""g4": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}"#;
        let e = quant(&ct(int4)).unwrap_err().to_string();
        assert!(e.contains("int 4-bit") && e.contains("g4"), "{e}");
    }
}
