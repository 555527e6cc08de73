//! LoRA adapters: low-rank deltas added to a base model's projections, many adapters over one copy
//! of the base weights, mixed in one forward pass.
//!
//! An adapter ([`LoraAdapter`]) is read from a PEFT directory or a llama.cpp GGUF LoRA file
//! ([`load`]), checked against the base model's shapes, and named by a hash of its weights and
//! scales ([`LoraAdapter::id`]). That id joins the prefix cache's chain root, so KV made under one
//! adapter is never found by a request under another (or under the base).
//!
//! The model families call [`crate::models::Ops::lora`] after each projection an adapter may
//! target; a backend holds a few adapters *resident* in numbered slots
//! ([`crate::backend::Backend::set_adapter`]) and each chunk of a pass names its slot
//! ([`crate::backend::SeqChunk::adapter`]). The operation adds, for every token whose chunk runs
//! an adapter targeting that projection, `scale · (x · Aᵀ) · Bᵀ` to the projection's output,
//! grouped by adapter so each adapter's A and B are read once per pass. A pass with no adapter
//! (or none targeting the projection) leaves the output as the base model made it.

pub mod load;

use sha2::{Digest, Sha256};

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};

/// A projection an adapter may target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Proj {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Proj {
    pub const ALL: [Proj; 7] = [Proj::Q, Proj::K, Proj::V, Proj::O, Proj::Gate, Proj::Up, Proj::Down];

    /// The module name PEFT uses (`q_proj`, ..., `down_proj`).
    pub fn peft_name(self) -> &'static str {
        match self {
            Proj::Q => "q_proj",
            Proj::K => "k_proj",
            Proj::V => "v_proj",
            Proj::O => "o_proj",
            Proj::Gate => "gate_proj",
            Proj::Up => "up_proj",
            Proj::Down => "down_proj",
        }
    }

    /// `(input, output)` widths of the projection in a model of config `c`.
    pub fn dims(self, c: &ModelConfig) -> (usize, usize) {
        let (h, ff) = (c.hidden_size, c.intermediate_size);
        let (qd, kvd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        match self {
            Proj::Q => (h, qd),
            Proj::K | Proj::V => (h, kvd),
            Proj::O => (qd, h),
            Proj::Gate | Proj::Up => (h, ff),
            Proj::Down => (ff, h),
        }
    }
}

impl std::fmt::Display for Proj {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.peft_name())
    }
}

/// One projection of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LoraTarget {
    pub layer: u32,
    pub proj: Proj,
}

/// The low-rank delta of one target: `Δy = scale · (x · Aᵀ) · Bᵀ`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraWeight {
    pub target: LoraTarget,
    pub rank: usize,
    /// `rank × in`, row-major.
    pub a: Vec<f32>,
    /// `out × rank`, row-major.
    pub b: Vec<f32>,
    /// `lora_alpha / rank`, or `lora_alpha / √rank` with rsLoRA.
    pub scale: f32,
}

/// A loaded adapter, checked against the base model it was loaded for.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    /// The name requests use (`--lora NAME=PATH`, the admin call).
    pub name: String,
    /// Where it was read from (for listings and messages).
    pub source: std::path::PathBuf,
    /// Hex hash of the weights and scales ([`adapter_id`]): the adapter's identity.
    pub id: String,
    /// Its deltas, sorted by target; at most one per target.
    pub weights: Vec<LoraWeight>,
}

impl LoraAdapter {
    /// Builds an adapter from its deltas, checking each against `c` and computing its id.
    pub fn new(
        name: &str,
        source: &std::path::Path,
        mut weights: Vec<LoraWeight>,
        c: &ModelConfig,
    ) -> Result<LoraAdapter> {
        let bad = |msg: String| EngineError::Lora { path: source.into(), msg };
        if weights.is_empty() {
            return Err(bad("the adapter has no LoRA weights".into()));
        }
        weights.sort_by_key(|w| w.target);
        for pair in weights.windows(2) {
            if pair[0].target == pair[1].target {
                return Err(bad(format!(
                    "two deltas for {} of layer {}",
                    pair[0].target.proj, pair[0].target.layer
                )));
            }
        }
        for w in &weights {
            let t = w.target;
            if t.layer as usize >= c.num_layers {
                return Err(bad(format!(
                    "{} of layer {}: the base model has {} layers",
                    t.proj, t.layer, c.num_layers
                )));
            }
            let (din, dout) = t.proj.dims(c);
            if w.rank == 0 || w.a.len() != w.rank * din || w.b.len() != dout * w.rank {
                return Err(bad(format!(
                    "{} of layer {}: A is {} values and B {} for rank {}, but the base model's \
                     projection is {din} → {dout} (A must be {}, B {})",
                    t.proj,
                    t.layer,
                    w.a.len(),
                    w.b.len(),
                    w.rank,
                    w.rank * din,
                    dout * w.rank
                )));
            }
            if !w.scale.is_finite() || w.a.iter().chain(&w.b).any(|v| !v.is_finite()) {
                return Err(bad(format!(
                    "{} of layer {}: a weight or the scale is not finite",
                    t.proj, t.layer
                )));
            }
        }
        if let Some(m) = &c.moe {
            if let Some(w) = weights.iter().find(|w| {
                matches!(w.target.proj, Proj::Gate | Proj::Up | Proj::Down)
                    && m.sparse_layers.get(w.target.layer as usize) == Some(&true)
            }) {
                return Err(bad(format!(
                    "{} of layer {}: the layer is a mixture of experts, whose experts adapters cannot target",
                    w.target.proj, w.target.layer
                )));
            }
        }
        let id = adapter_id(&weights);
        Ok(LoraAdapter { name: name.into(), source: source.into(), id, weights })
    }

    /// The delta for `target`, if the adapter has one.
    pub fn weight(&self, target: LoraTarget) -> Option<&LoraWeight> {
        self.weights.binary_search_by_key(&target, |w| w.target).ok().map(|i| &self.weights[i])
    }

    /// The largest rank of its deltas.
    pub fn max_rank(&self) -> usize {
        self.weights.iter().map(|w| w.rank).max().unwrap_or(0)
    }

    /// Bytes its weights take (f32).
    pub fn bytes(&self) -> usize {
        self.weights.iter().map(|w| 4 * (w.a.len() + w.b.len())).sum()
    }

    /// The projections it targets (in some layer), sorted.
    pub fn projections(&self) -> Vec<Proj> {
        let mut p: Vec<Proj> = self.weights.iter().map(|w| w.target.proj).collect();
        p.sort();
        p.dedup();
        p
    }
}

/// The identity of an adapter: the first 16 bytes of SHA-256 over every delta (target, rank,
/// scale, A and B, little endian, in target order), in hex. Two files with the same weights and
/// scales are the same adapter whatever their names or formats.
pub fn adapter_id(weights: &[LoraWeight]) -> String {
    let mut h = Sha256::new();
    h.update(b"tandem-lora-v1");
    for w in weights {
        h.update(w.target.layer.to_le_bytes());
        h.update([w.target.proj as u8]);
        h.update((w.rank as u64).to_le_bytes());
        h.update(w.scale.to_le_bytes());
        for v in w.a.iter().chain(&w.b) {
            h.update(v.to_le_bytes());
        }
    }
    h.finalize()[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// The prefix-cache salt of a request with cache salt `salt` under `adapter`
/// ([`tandem_model::prefix::adapter_salt`]).
pub fn salted(salt: &str, adapter: Option<&LoraAdapter>) -> String {
    tandem_model::prefix::adapter_salt(salt, adapter.map(|a| a.id.as_str()))
}
