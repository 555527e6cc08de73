//! Where models live when no path is given: the model cache, and the default model in it.
//!
//! The default model, SmolLM2-135M-Instruct in GGUF Q4_1, is put there by
//! `scripts/fetch-model.sh`. Every binary and every test crate finds it through this module, so
//! there is one answer to "where is the default model".

use std::path::PathBuf;

/// File name of the default model inside the model cache.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The model cache: `$TANDEM_MODEL_DIR`, else `~/.cache/tandem/models`.
pub fn model_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TANDEM_MODEL_DIR") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache/tandem/models")
}

/// Where the default model is (or would be) in the model cache.
pub fn default_model_path() -> PathBuf {
    model_dir().join(DEFAULT_MODEL_FILE)
}
