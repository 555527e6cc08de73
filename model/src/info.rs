//! A model's description without its weights ([`ModelInfo`]): configuration, tokenizer and
//! identity, read from a GGUF file or a Hugging Face directory. What a process that only tokenizes
//! and checks compatibility (a router) needs; the engine's loader builds on the same functions
//! and adds the weights, so each model file is still opened and parsed once.

use std::path::{Path, PathBuf};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::fingerprint::{directory_files, fingerprint_sources, Source};
use crate::gguf::GgufFile;
use crate::tokenizer::Tokenizer;

/// Where a model came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelFormat {
    Gguf,
    HuggingFace,
}

/// Everything about a model but its weights: what a process that only tokenizes and checks
/// compatibility needs.
#[derive(Clone)]
pub struct ModelInfo {
    pub path: PathBuf,
    pub format: ModelFormat,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    /// The model id, `sha256:<32 hex digits>` (see [`crate::fingerprint`]).
    pub model_id: String,
    /// A readable name: GGUF `general.name`, else the file or directory name.
    pub model_name: String,
}

impl std::fmt::Debug for ModelInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelInfo")
            .field("path", &self.path)
            .field("model_id", &self.model_id)
            .field("model_name", &self.model_name)
            .finish_non_exhaustive()
    }
}

/// Reads a model's configuration, tokenizer and identity without reading its weights.
pub fn load_model_info(path: &Path) -> Result<ModelInfo> {
    let meta = std::fs::metadata(path).map_err(|e| ModelError::io(path, e))?;
    if meta.is_dir() {
        let config_text = read_hf_config(path)?;
        let config = ModelConfig::from_hf_json(&path.join("config.json"), &config_text)?;
        let tokenizer = Tokenizer::from_hf_dir(path)?;
        let model_id = hf_fingerprint(path, &config_text, &[])?;
        Ok(ModelInfo {
            path: path.into(),
            format: ModelFormat::HuggingFace,
            config,
            tokenizer,
            model_id,
            model_name: file_name(path),
        })
    } else {
        gguf_info(path, &GgufFile::open(path)?)
    }
}

/// The name a model is known by when its files do not say: the file or directory name.
pub fn file_name(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// A GGUF file's description, from the file already opened (its id hashes the mapped bytes).
pub fn gguf_info(path: &Path, g: &GgufFile) -> Result<ModelInfo> {
    let config = ModelConfig::from_gguf(g)?;
    let tokenizer = Tokenizer::from_gguf(g)?;
    let model_id = fingerprint_sources(vec![(String::new(), Source::Mapped(g.bytes()))])?;
    let model_name =
        g.get("general.name").and_then(|v| v.as_str()).map(str::to_owned).unwrap_or_else(|| file_name(path));
    Ok(ModelInfo { path: path.into(), format: ModelFormat::Gguf, config, tokenizer, model_id, model_name })
}

/// The text of a model directory's `config.json`.
pub fn read_hf_config(dir: &Path) -> Result<String> {
    let cfg_path = dir.join("config.json");
    std::fs::read_to_string(&cfg_path).map_err(|e| ModelError::io(&cfg_path, e))
}

/// A model directory's id: `config.json` from the text already read, weight shards from their
/// maps when they are open (`mapped`: path and bytes of each), every other file read for the
/// ranges hashed.
pub fn hf_fingerprint(dir: &Path, config_text: &str, mapped: &[(&Path, &[u8])]) -> Result<String> {
    let sources = directory_files(dir)?
        .into_iter()
        .map(|(name, p)| {
            let source = if name == "config.json" {
                Source::Mapped(config_text.as_bytes())
            } else if let Some((_, bytes)) = mapped.iter().find(|(mp, _)| *mp == p.as_path()) {
                Source::Mapped(bytes)
            } else {
                Source::File(p)
            };
            (name, source)
        })
        .collect();
    fingerprint_sources(sources)
}
