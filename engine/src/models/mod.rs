//! Model families, each written once against the operations every backend implements.
//!
//! A family file (`llama.rs`, `gemma.rs`, `phi3.rs`, `moe.rs`) does two things: it reads its tensors from a model file
//! into a [`WeightStore`] (host matrices and vectors addressed by handle, shapes checked), and it
//! describes one forward pass as a sequence of [`Ops`] calls over named scratch buffers. The
//! backends implement [`Ops`] (matmul over quantized weights, norms, RoPE, paged attention,
//! activations, soft-capping); they never learn what a layer of a given model looks like, and a
//! family never learns which device runs it.
//!
//! Invariants:
//! - A family's [`Model::forward`] calls the same operations in the same order for every batch of
//!   a given token count; only the data differs. So a GPU backend can capture a pass as a graph,
//!   and a token's result does not depend on the other tokens of its pass (every operation is
//!   row-wise except attention, which reads only its own sequence, and the mixture of experts,
//!   whose grouping of tokens by expert is invisible in each token's result).
//! - Buffers are declared once ([`Model::scratch`]) with the rows they hold: one per token of the
//!   pass, or one per logits row. Weights are declared once ([`WeightStore`]), each matrix marked
//!   for how it is used, so a backend can prepare it (pack it for integer kernels, upload it)
//!   before the first pass.
//! - Every [`Buf`], [`MatId`], [`VecId`] and [`RopeId`] a family uses comes from its own
//!   declarations; a backend may refuse (with an internal error) a handle out of range.

pub mod gemma;
pub mod llama;
pub mod moe;
pub mod phi3;

use std::sync::Arc;

use crate::config::{ModelConfig, RopeScaling};
use crate::error::Result;
use crate::weights::Matrix;

/// A scratch buffer of the pass, by its index in [`Model::scratch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buf(pub u16);

/// A weight matrix in the [`WeightStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MatId(pub u32);

/// A weight vector (norm weights, biases) in the [`WeightStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VecId(pub u32);

/// A rotary table, by its index in [`Model::ropes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeId(pub u8);

/// How many rows a scratch buffer has in a pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// One per token of the pass.
    Tokens,
    /// One per row of logits the pass returns.
    Logits,
}

/// What a scratch buffer feeds, which decides its element type on a GPU computing in bf16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufKind {
    /// Always f32: the residual stream, projections' outputs, attention inputs, logits.
    F32,
    /// The input of a matrix multiplication: the backend's compute dtype (bf16 on a GPU by
    /// default). Written only by [`Ops::rms_norm`], [`Ops::gated_act`], [`Ops::attention`] and
    /// [`Ops::moe`] (its activation scratch); read only by [`Ops::linear`] and [`Ops::moe`].
    MatIn,
}

/// One scratch buffer: `rows × width` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufSpec {
    pub width: usize,
    pub rows: Rows,
    pub kind: BufKind,
}

/// One rotary table: frequencies for `dims` dimensions (the whole head), base `theta`, scaled as
/// configured. Tables rotate rotate-half style (element `j` with `j + dims/2`).
#[derive(Debug, Clone, PartialEq)]
pub struct RopeSpec {
    pub dims: usize,
    pub theta: f32,
    pub scaling: Option<RopeScaling>,
}

/// The gate activation of a gated MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x · sigmoid(x)` (Llama, Qwen, Mistral).
    Silu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`: Gemma).
    GeluTanh,
}

/// One layer's attention over the paged KV cache.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnSpec {
    /// The layer whose cache the fresh K/V are written to and read from.
    pub layer: usize,
    /// Attend to at most this many positions back, the token's own included.
    pub window: Option<usize>,
    /// Multiplies `q · k` before the softmax.
    pub scale: f32,
    /// Scores become `cap · tanh(score / cap)` after scaling (Gemma 2).
    pub softcap: Option<f32>,
}

/// The attention block's inputs from one normed input ([`Ops::attn_inputs`]): the Q, K and V
/// projections and their LoRA targets, then the optional biases, the optional per-head RMS norms
/// of q and k, and RoPE on q and k; `layer` is the layer whose attention reads them next.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnInputs {
    pub layer: usize,
    pub wq: MatId,
    pub wk: MatId,
    pub wv: MatId,
    pub lora: [crate::lora::LoraTarget; 3],
    pub bias: Option<[VecId; 3]>,
    pub q_norm: Option<VecId>,
    pub k_norm: Option<VecId>,
    pub head_dim: usize,
    pub eps: f32,
    pub rope: RopeId,
}

/// A gated MLP's first half ([`Ops::gated_ffn`]): the gate and up projections and their LoRA
/// targets, and the activation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GatedFfn {
    pub gate: MatId,
    pub up: MatId,
    pub lora: [crate::lora::LoraTarget; 2],
    pub act: Activation,
}

/// A layer's first norm, `out = rms_norm(x)`, with the previous layer's last residual add
/// (`x += y`) first where one is still `pending`: the two as one [`Ops::add_rms_norm`].
pub fn norm_after_residual(
    ops: &mut dyn Ops,
    pending: Option<Buf>,
    x: Buf,
    w: VecId,
    eps: f32,
    out: Buf,
) -> Result<()> {
    match pending {
        Some(y) => ops.add_rms_norm(x, y, w, eps, out),
        None => ops.rms_norm(x, w, eps, out),
    }
}

/// [`Ops::attn_inputs`] as the operations it is made of, in order.
pub fn attn_inputs_unfused(ops: &mut dyn Ops, x: Buf, p: &AttnInputs, q: Buf, k: Buf, v: Buf) -> Result<()> {
    ops.linear(x, &[(p.wq, q), (p.wk, k), (p.wv, v)])?;
    ops.lora(x, &[(p.lora[0], q), (p.lora[1], k), (p.lora[2], v)])?;
    if let Some([bq, bk, bv]) = p.bias {
        ops.add_bias(q, bq)?;
        ops.add_bias(k, bk)?;
        ops.add_bias(v, bv)?;
    }
    if let Some(w) = p.q_norm {
        ops.head_rms_norm(q, w, p.head_dim, p.eps)?;
    }
    if let Some(w) = p.k_norm {
        ops.head_rms_norm(k, w, p.head_dim, p.eps)?;
    }
    ops.rope(q, p.rope)?;
    ops.rope(k, p.rope)
}

/// [`Ops::gated_ffn`] as the operations it is made of, in order.
pub fn gated_ffn_unfused(
    ops: &mut dyn Ops,
    x: Buf,
    p: &GatedFfn,
    gate: Buf,
    up: Buf,
    out: Buf,
) -> Result<()> {
    ops.linear(x, &[(p.gate, gate), (p.up, up)])?;
    ops.lora(x, &[(p.lora[0], gate), (p.lora[1], up)])?;
    ops.gated_act(gate, up, p.act, out)
}

/// One expert of a mixture: a gated MLP, `down(act(gate · x) · (up · x))`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expert {
    pub gate: MatId,
    pub up: MatId,
    pub down: MatId,
}

/// Scratch buffers of a mixture-of-experts layer, declared by the family (its sparse layers may
/// share one set). Their contents after [`Ops::moe`] are unspecified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeScratch {
    /// `num_experts` wide, f32: router logits, then routing weights.
    pub route: Buf,
    /// The experts' width, f32: gate and up projections.
    pub gate: Buf,
    pub up: Buf,
    /// The experts' width, [`BufKind::MatIn`]: the gated activation.
    pub act: Buf,
    /// The hidden width, f32: one expert's output.
    pub down: Buf,
}

/// A sparse MLP: a router over experts, of which each token uses `top_k`.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeSpec {
    /// `num_experts × hidden`: router logits are `x · routerᵀ`.
    pub router: MatId,
    /// Indexed like the router's rows.
    pub experts: Vec<Expert>,
    pub top_k: usize,
    /// Divide the chosen experts' probabilities by their sum.
    pub renormalize: bool,
    pub act: Activation,
    pub scratch: MoeScratch,
}

/// The operations a forward pass is written in. Each acts on whole buffers of the current pass
/// (every token row, or every logits row); the backend knows the pass's tokens, positions and
/// block tables. An output buffer is never also an input unless the operation says it works in
/// place.
pub trait Ops {
    /// `out[t] = table[token t] · scale` (the scale only where given).
    fn embed(&mut self, table: MatId, scale: Option<f32>, out: Buf) -> Result<()>;
    /// `out = x / rms(x) · w` per row (`w` as stored: a `1 + w` family adds the one at load).
    fn rms_norm(&mut self, x: Buf, w: VecId, eps: f32, out: Buf) -> Result<()>;
    /// RMSNorm of every `head_dim` slice of every row of `x`, in place, with one weight vector
    /// of `head_dim` values (q/k norms).
    fn head_rms_norm(&mut self, x: Buf, w: VecId, head_dim: usize, eps: f32) -> Result<()>;
    /// `y = x · Wᵀ` for each `(W, y)`: several matrices over one input, so a backend that
    /// prepares the input (quantizes it) does it once.
    fn linear(&mut self, x: Buf, outs: &[(MatId, Buf)]) -> Result<()>;
    /// The LoRA deltas of projections of one layer that share the input `x`: for each
    /// `(target, y)`, every token row whose chunk runs an adapter holding a delta for `target` gets
    /// `y[t] += scale · (x[t] · Aᵀ) · Bᵀ` ([`crate::lora`]). Rows of other chunks, and every row
    /// when no chunk of the pass runs an adapter, are left as they are. A family calls it right
    /// after the [`Ops::linear`] that made each `y` (before biases, norms or RoPE), with the same
    /// input, for every projection an adapter may target, in every pass.
    fn lora(&mut self, x: Buf, outs: &[(crate::lora::LoraTarget, Buf)]) -> Result<()>;
    /// `x[row] += b` for every row, in place.
    fn add_bias(&mut self, x: Buf, b: VecId) -> Result<()>;
    /// Rotates every `dims`-wide head of every row of `x` at its token's position, in place.
    fn rope(&mut self, x: Buf, rope: RopeId) -> Result<()>;
    /// Writes this layer's fresh `k`, `v` (one row per token) into the KV cache as the pass's
    /// write mode says, and computes causal attention of every query head of `q` over its
    /// sequence's cached and fresh positions into `out`.
    fn attention(&mut self, q: Buf, k: Buf, v: Buf, out: Buf, spec: &AttnSpec) -> Result<()>;
    /// `out = act(gate) · up`, element-wise.
    fn gated_act(&mut self, gate: Buf, up: Buf, act: Activation, out: Buf) -> Result<()>;
    /// q, k, v from `x` as [`attn_inputs_unfused`] computes them: projections, LoRA, biases,
    /// per-head norms, RoPE. A backend may fuse them (one product over the three matrices, one
    /// kernel for the rest, and even the KV write of the [`Ops::attention`] of `p.layer` that
    /// follows on the same `k` and `v`); it leaves the same values in `q`, `k` and `v` up to the
    /// products' summation order.
    fn attn_inputs(&mut self, x: Buf, p: &AttnInputs, q: Buf, k: Buf, v: Buf) -> Result<()> {
        attn_inputs_unfused(self.as_dyn(), x, p, q, k, v)
    }
    /// `out = act(x · gateᵀ + LoRA) · (x · upᵀ + LoRA)` as [`gated_ffn_unfused`] computes it, with
    /// `gate` and `up` as scratch. A backend may fuse it (one product over both matrices, the
    /// activation reading its result); `out` holds the same values up to the products'
    /// summation order, and `gate` and `up` are then left undefined.
    fn gated_ffn(&mut self, x: Buf, p: &GatedFfn, gate: Buf, up: Buf, out: Buf) -> Result<()> {
        gated_ffn_unfused(self.as_dyn(), x, p, gate, up, out)
    }
    /// This as a trait object (for the default methods' helpers).
    fn as_dyn(&mut self) -> &mut dyn Ops;
    /// The mixture of experts of every row of `x` (a [`BufKind::MatIn`] buffer) into `out` (f32,
    /// same width), as transformers computes it: router logits `x · routerᵀ`; their softmax in
    /// f32; the `top_k` largest probabilities, ties going to the lower expert index (`torch.topk`
    /// does not promise an order for equal values; this rule is the engine's); divided by their
    /// sum when `renormalize`; then `out = Σ w_e · expert_e(x)` over the chosen experts, added in
    /// increasing expert index (so a token's result does not depend on which other tokens share
    /// the pass or its experts). Uses `spec.scratch`; `out` is none of the other buffers.
    fn moe(&mut self, x: Buf, spec: &MoeSpec, out: Buf) -> Result<()>;
    /// `x += y`, element-wise, in place.
    fn add(&mut self, x: Buf, y: Buf) -> Result<()>;
    /// `x += y`, then `out = x / rms(x) · w` per row: a residual add and the norm that reads its
    /// result, which a backend may run as one kernel with the same arithmetic as the two
    /// operations ([`Ops::add`], [`Ops::rms_norm`]), so the results are the same bits.
    fn add_rms_norm(&mut self, x: Buf, y: Buf, w: VecId, eps: f32, out: Buf) -> Result<()> {
        self.add(x, y)?;
        self.rms_norm(x, w, eps, out)
    }
    /// `x = cap · tanh(x / cap)`, element-wise, in place.
    fn softcap(&mut self, x: Buf, cap: f32) -> Result<()>;
    /// Copies the token rows that return logits (a [`Rows::Tokens`] buffer) into a
    /// [`Rows::Logits`] buffer, in the order the pass returns them.
    fn gather_logit_rows(&mut self, x: Buf, out: Buf) -> Result<()>;
}

/// A model family's forward pass.
pub trait Model: Send + Sync + std::fmt::Debug {
    /// Every scratch buffer the pass uses, indexed by [`Buf`].
    fn scratch(&self) -> &[BufSpec];
    /// Every rotary table the pass uses, indexed by [`RopeId`].
    fn ropes(&self) -> &[RopeSpec];
    /// Runs one pass; the logits end in [`Model::logits`] (`Rows::Logits × vocab`).
    fn forward(&self, ops: &mut dyn Ops) -> Result<()>;
    /// The buffer holding the logits after [`Model::forward`].
    fn logits(&self) -> Buf;
    /// Matrices the pass always multiplies together, over one input, in this order (a layer's
    /// Q, K and V; gate and up): a backend may store each group's rows contiguously and multiply
    /// them as one matrix ([`Ops::attn_inputs`], [`Ops::gated_ffn`]). Empty by default.
    fn fused_groups(&self) -> Vec<Vec<MatId>> {
        Vec::new()
    }
    /// The model's mixtures of experts, one per sparse layer ([`Ops::moe`] receives the same
    /// specs): a backend may prepare per-expert tables at load. Empty by default.
    fn moe_specs(&self) -> Vec<&MoeSpec> {
        Vec::new()
    }
}

/// How the forward pass uses a matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatUse {
    /// Rows are looked up ([`Ops::embed`]).
    pub table: bool,
    /// Multiplied with activations ([`Ops::linear`]).
    pub linear: bool,
}

/// Weights as read from the file, in Hugging Face conventions (Q/K rows in rotate-half order),
/// addressed by the handles the family keeps.
#[derive(Clone, Debug, Default)]
pub struct WeightStore {
    pub mats: Vec<(Matrix, MatUse)>,
    pub vecs: Vec<Vec<f32>>,
}

impl WeightStore {
    /// Adds a matrix used as `usage` says.
    pub fn mat(&mut self, m: Matrix, usage: MatUse) -> MatId {
        self.mats.push((m, usage));
        MatId((self.mats.len() - 1) as u32)
    }

    /// Adds a matrix multiplied with activations.
    pub fn linear(&mut self, m: Matrix) -> MatId {
        self.mat(m, MatUse { table: false, linear: true })
    }

    /// Marks a stored matrix as also used by [`Ops::linear`] (a tied output head).
    pub fn also_linear(&mut self, id: MatId) -> MatId {
        self.mats[id.0 as usize].1.linear = true;
        id
    }

    /// Adds a vector.
    pub fn vec(&mut self, v: Vec<f32>) -> VecId {
        self.vecs.push(v);
        VecId((self.vecs.len() - 1) as u32)
    }

    /// The matrix behind a handle.
    pub fn matrix(&self, id: MatId) -> &Matrix {
        &self.mats[id.0 as usize].0
    }

    /// The vector behind a handle.
    pub fn vector(&self, id: VecId) -> &[f32] {
        &self.vecs[id.0 as usize]
    }
}

/// A loaded model's weights with the family that runs them.
#[derive(Clone, Debug)]
pub struct ModelWeights {
    pub model: Arc<dyn Model>,
    pub store: WeightStore,
}

/// Declares scratch buffers in order and hands back their handles.
#[derive(Debug, Default)]
pub(crate) struct ScratchBuilder {
    specs: Vec<BufSpec>,
}

impl ScratchBuilder {
    pub(crate) fn add(&mut self, width: usize, rows: Rows, kind: BufKind) -> Buf {
        self.specs.push(BufSpec { width, rows, kind });
        Buf((self.specs.len() - 1) as u16)
    }
    pub(crate) fn f32(&mut self, width: usize) -> Buf {
        self.add(width, Rows::Tokens, BufKind::F32)
    }
    pub(crate) fn mat_in(&mut self, width: usize) -> Buf {
        self.add(width, Rows::Tokens, BufKind::MatIn)
    }
    pub(crate) fn finish(self) -> Vec<BufSpec> {
        self.specs
    }
}

/// Reads the weights of `c`'s family from `src`.
pub(crate) fn load(c: &ModelConfig, src: &dyn TensorSource) -> Result<ModelWeights> {
    let t = Tensors { src };
    match c.arch {
        crate::config::Arch::Llama
        | crate::config::Arch::Mistral
        | crate::config::Arch::Qwen2
        | crate::config::Arch::Qwen3
        // Llama-shaped: Phi-3's fused projections are split by `phi3.rs`, the mixtures' experts
        // read by `moe.rs`.
        | crate::config::Arch::Phi3
        | crate::config::Arch::Qwen3Moe
        | crate::config::Arch::Mixtral => llama::Llama::load(c, &t),
        crate::config::Arch::Gemma2 | crate::config::Arch::Gemma3 => gemma::Gemma::load(c, &t),
    }
}

/// The RoPE table of a config's global layers.
pub(crate) fn default_rope(c: &ModelConfig) -> RopeSpec {
    RopeSpec { dims: c.head_dim, theta: c.rope_theta, scaling: c.rope_scaling.clone() }
}

/// Where a family reads its tensors from: a GGUF file or a Hugging Face directory. Shapes are
/// checked on every read, so a backend never indexes out of bounds on a bad file.
pub(crate) trait TensorSource {
    /// The file or directory, for error messages.
    fn path(&self) -> &std::path::Path;
    /// Whether the file is GGUF (names in llama.cpp's spelling) rather than safetensors.
    fn is_gguf(&self) -> bool;
    fn has(&self, name: &str) -> bool;
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix>;
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>>;
    /// `count` matrices of `rows × cols` stored as one 3-D tensor (experts).
    fn stacked(&self, name: &str, count: usize, rows: usize, cols: usize) -> Result<Vec<Matrix>>;
}

impl TensorSource for crate::gguf::GgufFile {
    fn path(&self) -> &std::path::Path {
        &self.path
    }
    fn is_gguf(&self) -> bool {
        true
    }
    fn has(&self, name: &str) -> bool {
        self.tensor(name).is_some()
    }
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let m = crate::gguf::GgufTensors::matrix(self, name)?;
        if m.rows != rows || m.cols != cols {
            return Err(shape_error(&self.path, name, &[rows, cols], &[m.rows, m.cols]));
        }
        Ok(m)
    }
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let v = crate::gguf::GgufTensors::vector_f32(self, name)?;
        if v.len() != len {
            return Err(shape_error(&self.path, name, &[len], &[v.len()]));
        }
        Ok(v)
    }
    fn stacked(&self, name: &str, count: usize, rows: usize, cols: usize) -> Result<Vec<Matrix>> {
        let ms = crate::gguf::GgufTensors::stacked(self, name)?;
        let (m_rows, m_cols) = ms.first().map_or((0, 0), |m| (m.rows, m.cols));
        if ms.len() != count || m_rows != rows || m_cols != cols {
            // GGUF dims run innermost first.
            return Err(shape_error(&self.path, name, &[cols, rows, count], &[m_cols, m_rows, ms.len()]));
        }
        Ok(ms)
    }
}

impl TensorSource for crate::safetensors::SafeTensors {
    fn path(&self) -> &std::path::Path {
        crate::safetensors::SafeTensors::path(self)
    }
    fn is_gguf(&self) -> bool {
        false
    }
    fn has(&self, name: &str) -> bool {
        self.contains(name)
    }
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        crate::safetensors::SafeTensors::matrix(self, name, rows, cols)
    }
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        crate::safetensors::SafeTensors::vector(self, name, len)
    }
    fn stacked(&self, name: &str, count: usize, rows: usize, cols: usize) -> Result<Vec<Matrix>> {
        crate::safetensors::SafeTensors::stacked(self, name, count, rows, cols)
    }
}

fn shape_error(
    path: &std::path::Path,
    name: &str,
    expected: &[usize],
    actual: &[usize],
) -> crate::EngineError {
    crate::EngineError::Shape {
        path: path.into(),
        tensor: name.into(),
        expected: expected.to_vec(),
        actual: actual.to_vec(),
    }
}

/// A family's view of a [`TensorSource`]: each tensor is named in both spellings side by side
/// (`hf`, then `gguf`), and the source picks its own.
pub(crate) struct Tensors<'a> {
    pub(crate) src: &'a dyn TensorSource,
}

impl Tensors<'_> {
    /// The name of a model-level tensor.
    pub(crate) fn name(&self, hf: &str, gguf: &str) -> String {
        if self.src.is_gguf() { gguf } else { hf }.to_string()
    }

    /// The name of a tensor of layer `i` (`model.layers.{i}.` or `blk.{i}.` before it).
    pub(crate) fn layer(&self, i: usize, hf: &str, gguf: &str) -> String {
        if self.src.is_gguf() {
            format!("blk.{i}.{gguf}")
        } else {
            format!("model.layers.{i}.{hf}")
        }
    }

    pub(crate) fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        self.src.matrix(name, rows, cols)
    }

    pub(crate) fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        self.src.vector(name, len)
    }

    pub(crate) fn stacked(&self, name: &str, count: usize, rows: usize, cols: usize) -> Result<Vec<Matrix>> {
        self.src.stacked(name, count, rows, cols)
    }

    /// The vector if the file has it.
    pub(crate) fn opt_vector(&self, name: &str, len: usize) -> Result<Option<Vec<f32>>> {
        if self.src.has(name) {
            self.vector(name, len).map(Some)
        } else {
            Ok(None)
        }
    }

    /// The output head: the embedding table when tied (like transformers, a tie wins over a
    /// stored head), else the stored head, which must then be there.
    pub(crate) fn output_head(
        &self,
        store: &mut WeightStore,
        embed: MatId,
        tied: bool,
        vocab: usize,
        hidden: usize,
    ) -> Result<MatId> {
        if tied {
            return Ok(store.also_linear(embed));
        }
        let name = self.name("lm_head.weight", "output.weight");
        if !self.src.has(&name) {
            return Err(crate::EngineError::MissingTensor { path: self.src.path().into(), tensor: name });
        }
        Ok(store.linear(self.matrix(&name, vocab, hidden)?))
    }
}

#[cfg(test)]
mod tests {
    use super::TensorSource;
    use crate::gguf::test_file::{f32_bytes, write_tmp, Writer};
    use crate::gguf::GgufFile;

    /// A family reads stacked experts through its view of the file, which checks their shape
    /// (the slicing itself is the GGUF reader's, tested there).
    #[test]
    fn stacked_experts_are_checked_against_the_expected_shape() {
        let (cols, rows, experts) = (32usize, 3usize, 4usize);
        let vals = vec![0.5f32; experts * rows * cols];
        let w = Writer::new().tensor(
            "blk.0.ffn_up_exps.weight",
            &[cols as u64, rows as u64, experts as u64],
            0,
            f32_bytes(&vals),
        );
        let f = GgufFile::open(&write_tmp("family-experts.gguf", &w.bytes())).unwrap();
        let got = TensorSource::stacked(&f, "blk.0.ffn_up_exps.weight", experts, rows, cols).unwrap();
        assert_eq!(got.len(), experts);
        let e = TensorSource::stacked(&f, "blk.0.ffn_up_exps.weight", experts, cols, rows).unwrap_err();
        assert!(e.to_string().contains("ffn_up_exps"), "{e}");
    }
}
