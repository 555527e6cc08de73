//! The model a worker serves, read once at start-up (weights and identity together), the
//! compatibility record it registers with.

use std::path::Path;

use tandem_engine::kv::KvLayout;
use tandem_engine::loader::LoadedModel;
use tandem_proto::v1;
use tandem_serve::identity::{IdentityError, ModelIdentity};

/// A model read once at start-up: its weights for the engine and its identity for the
/// compatibility record, from one pass over its files. Whatever needs the model afterwards takes
/// this value, never the path.
pub struct Model {
    /// What the model is (the compatibility record, logs, the listening worker's record).
    pub identity: ModelIdentity,
    /// Configuration, tokenizer and weights, for the backend.
    pub loaded: LoadedModel,
}

impl Model {
    /// Reads and parses the model at `path` (each file once).
    pub fn load(path: &Path) -> Result<Model, IdentityError> {
        let loaded = tandem_engine::loader::load_model(path)
            .map_err(|source| IdentityError::Read { path: path.to_path_buf(), source: source.into() })?;
        Ok(Model { identity: loaded.info(), loaded })
    }
}

/// The record a worker registers with.
/// `windows`: the window of each layer group of the pool (`[None]` without groups).
pub fn compat_record(id: &ModelIdentity, layout: &KvLayout, windows: &[Option<usize>]) -> v1::CompatRecord {
    v1::CompatRecord {
        protocol_version: tandem_proto::PROTOCOL_VERSION,
        model_id: id.model_id.clone(),
        model_name: id.model_name.clone(),
        kv_dtype: layout.dtype.to_string(),
        block_size: layout.block_size as u32,
        num_layers: layout.num_layers as u32,
        num_kv_heads: layout.num_kv_heads as u32,
        head_dim: layout.head_dim as u32,
        kv_layout: layout.name().into(),
        vocab_size: id.config.vocab_size as u32,
        max_position_embeddings: id.config.max_position_embeddings as u32,
        kv_token_stride: layout.token_bytes() as u64,
        kv_block_stride: layout.block_bytes() as u64,
        kv_windows: if windows.iter().all(Option::is_none) && windows.len() <= 1 {
            Vec::new()
        } else {
            windows.iter().map(|w| w.unwrap_or(0) as u32).collect()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_serve::identity::{compat_mismatch, model_identity};

    #[test]
    fn the_record_carries_the_kv_dtype_and_a_different_one_is_a_mismatch() {
        use tandem_engine::kv::KvDtype;
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/llama-gqa");
        let id = model_identity(&dir).unwrap();
        let c = &id.config;
        let f16 = KvLayout {
            num_layers: c.num_layers,
            num_blocks: 8,
            block_size: 16,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            dtype: KvDtype::F16,
        };
        let a = compat_record(&id, &f16, &[None]);
        assert_eq!((a.kv_dtype.as_str(), a.kv_layout.as_str()), ("f16", "tandem-f16-lkv-v1"));
        // Pool sizes are each worker's own business.
        assert_eq!(
            compat_mismatch(&a, &compat_record(&id, &KvLayout { num_blocks: 99, ..f16 }, &[None])),
            None
        );
        let b = compat_record(&id, &KvLayout { dtype: KvDtype::F32, ..f16 }, &[None]);
        let m = compat_mismatch(&a, &b).unwrap();
        assert!(m.contains(r#"kv_dtype: "f16" vs "f32""#), "{m}");
        assert!(m.contains(r#"kv_layout: "tandem-f16-lkv-v1" vs "tandem-f32-lkv-v1""#), "{m}");
    }
}
