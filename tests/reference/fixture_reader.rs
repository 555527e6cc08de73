//! Reads the reference fixtures (`tests/reference/fixtures/<model>/reference.json` and
//! `logits.f32`) for the Rust tests of every crate, which include this file with
//! `#[path = ".../tests/reference/fixture_reader.rs"] mod fixture_reader;`. Each crate directory is
//! one level below the repository root, so `CARGO_MANIFEST_DIR/..` is the root for all of them.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use serde_json::Value;

/// The tiny random-weight reference models.
pub const MODELS: &[&str] = &[
    "llama-gqa",
    "llama3-rope-scaled",
    "qwen3",
    "qwen2-mqa",
    "mistral",
    "mistral-sliding",
    "gemma3",
    "gemma3-classic",
    "gemma2",
    "phi3",
    "phi3-longrope",
    "qwen3-moe",
    "mixtral",
];

/// One recorded prompt: its text and ids, transformers' logits at every position
/// (`positions × vocab`), and its greedy continuation.
pub struct Prompt {
    pub text: String,
    pub ids: Vec<u32>,
    pub logits: Vec<f32>,
    pub greedy: Vec<u32>,
    pub stopped_at_eos: bool,
}

/// The fixture directory of model `name`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures").join(name)
}

/// Little-endian f32s of a whole file.
pub fn read_f32(path: &Path) -> Vec<f32> {
    let raw = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(raw.len() % 4, 0, "{}: not a whole number of f32s", path.display());
    raw.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// The fixture's vocabulary size and the prompts the engine is expected to reproduce: all of them,
/// except, for a LongRoPE model, those whose prompt and greedy continuation together exceed the
/// original context. transformers runs such a sequence with the long factors at every position (a
/// prompt longer than the original context from its first pass on; a continuation that grows past
/// it has its cache recomputed with them), where the engine picks factors per position, the short
/// ones below the original context (docs/engine.md). [`read_reference_all`] has every prompt.
pub fn read_reference(name: &str) -> (usize, Vec<Prompt>) {
    let (vocab, mut prompts) = read_reference_all(name);
    if let Some(original) = longrope_original_context(name) {
        prompts.retain(|p| p.ids.len() + p.greedy.len() <= original);
        assert!(!prompts.is_empty(), "{name}: no prompt stays within the original context {original}");
    }
    (vocab, prompts)
}

/// `original_max_position_embeddings` of a LongRoPE fixture (`None` for other fixtures).
pub fn longrope_original_context(name: &str) -> Option<usize> {
    let text = std::fs::read_to_string(fixture(name).join("config.json")).unwrap();
    let c: Value = serde_json::from_str(&text).unwrap();
    let rope = c.get("rope_scaling").filter(|r| r.is_object()).or_else(|| c.get("rope_parameters"))?;
    let kind = rope.get("rope_type").or_else(|| rope.get("type")).and_then(Value::as_str)?;
    if kind != "longrope" {
        return None;
    }
    Some(c["original_max_position_embeddings"].as_u64().expect("LongRoPE fixture without original context")
        as usize)
}

/// The fixture's vocabulary size and every recorded prompt.
pub fn read_reference_all(name: &str) -> (usize, Vec<Prompt>) {
    let dir = fixture(name);
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let all = read_f32(&dir.join("logits.f32"));
    let vocab = r["vocab_size"].as_u64().unwrap() as usize;
    let ids = |v: &Value| v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    let prompts = r["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let off = p["logits_offset"].as_u64().unwrap() as usize;
            let n = p["n_positions"].as_u64().unwrap() as usize;
            Prompt {
                text: p["text"].as_str().unwrap().to_string(),
                ids: ids(&p["prompt_ids"]),
                logits: all[off..off + n * vocab].to_vec(),
                greedy: ids(&p["greedy_ids"]),
                stopped_at_eos: p["stopped_at_eos"].as_bool().unwrap_or(false),
            }
        })
        .collect();
    (vocab, prompts)
}

/// Index of the largest value (the first on ties).
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// The gap between the largest and the second largest value (0 for fewer than two).
pub fn top2_gap(v: &[f32]) -> f32 {
    let (mut first, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in v {
        if x > first {
            second = first;
            first = x;
        } else if x > second {
            second = x;
        }
    }
    if second.is_finite() {
        first - second
    } else {
        0.0
    }
}
