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
use crate::safetensors::SafeTensors;
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
    let st = SafeTensors::open_dir(dir)?;
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
