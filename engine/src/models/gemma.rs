//! Gemma 2 and Gemma 3 (text).
//!
//! Differences from the Llama family, all expressed in the same operations:
//! - embeddings scaled by √hidden;
//! - RMSNorm of `1 + w`: Hugging Face files store `w` and the one is added here at load (in f32,
//!   as transformers computes it); GGUF files already store `1 + w` (llama.cpp's converter adds
//!   it), so they are read as they are;
//! - a norm before and after both attention and the MLP;
//! - interleaved sliding-window (local) and global layers, each kind with its own RoPE table
//!   (Gemma 3: local base 10⁴ unscaled, global base 10⁶ with the configured scaling);
//! - attention scaled by `query_pre_attn_scalar^-1/2`, soft-capped where configured (Gemma 2);
//! - q/k norms (Gemma 3);
//! - a GeGLU MLP (GELU, tanh approximation);
//! - final logits soft-capped where configured (Gemma 2).
//!
//! Rotary halves are not interleaved in Gemma GGUF files (llama.cpp runs Gemma with rotate-half
//! RoPE), so no row permutation is undone at load.

use super::{
    default_rope, norm_after_residual, Activation, AttnInputs, AttnSpec, Buf, BufKind, BufSpec, GatedFfn,
    MatId, MatUse, Model, ModelWeights, Ops, RopeId, RopeSpec, Rows, ScratchBuilder, Tensors, VecId,
    WeightStore,
};
use crate::config::{Arch, MlpAct, ModelConfig};
use crate::error::{EngineError, Result};
use crate::lora::{LoraTarget, Proj};

#[derive(Debug)]
struct Layer {
    attn_norm: VecId,
    wq: MatId,
    wk: MatId,
    wv: MatId,
    wo: MatId,
    q_norm: Option<VecId>,
    k_norm: Option<VecId>,
    post_attn_norm: VecId,
    ffn_norm: VecId,
    w_gate: MatId,
    w_up: MatId,
    w_down: MatId,
    post_ffn_norm: VecId,
    /// Whether this layer attends through the sliding window (with the local RoPE table).
    sliding: bool,
}

#[derive(Debug)]
struct Bufs {
    x: Buf,
    xn: Buf,
    q: Buf,
    k: Buf,
    v: Buf,
    attn: Buf,
    o: Buf,
    /// The post-norm of a block's output, added to the residual stream.
    on: Buf,
    gate: Buf,
    up: Buf,
    act: Buf,
    xsel: Buf,
    hsel: Buf,
    logits: Buf,
}

/// A Gemma 2 or Gemma 3 model's forward pass.
#[derive(Debug)]
pub struct Gemma {
    eps: f32,
    head_dim: usize,
    window: Option<usize>,
    embed_scale: f32,
    attn_scale: f32,
    attn_softcap: Option<f32>,
    final_softcap: Option<f32>,
    embed: MatId,
    layers: Vec<Layer>,
    final_norm: VecId,
    lm_head: MatId,
    /// RoPE of the global layers, and of the sliding ones.
    rope_global: RopeId,
    rope_local: RopeId,
    b: Bufs,
    scratch: Vec<BufSpec>,
    ropes: Vec<RopeSpec>,
}

impl Gemma {
    /// Reads the family's tensors (shapes checked against `c`).
    pub(crate) fn load(c: &ModelConfig, t: &Tensors<'_>) -> Result<ModelWeights> {
        let path = t.src.path();
        let unsupported = |msg: String| EngineError::Unsupported { path: path.into(), msg };
        if c.mlp_act != MlpAct::GeluTanh {
            return Err(unsupported(format!("Gemma with MLP activation {:?}", c.mlp_act)));
        }
        let (h, hd, ff) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (qd, kvd) = (c.num_heads * hd, c.num_kv_heads * hd);
        let scalar = c
            .query_pre_attn_scalar
            .ok_or_else(|| unsupported("Gemma without query_pre_attn_scalar".into()))?;
        let sliding =
            c.sliding_layers.clone().unwrap_or_else(|| vec![c.sliding_window.is_some(); c.num_layers]);
        // Norm weights as the pass multiplies them: `1 + w`.
        let offset = !t.src.is_gguf();
        let norm = |s: &mut WeightStore, name: &str, len: usize| -> Result<VecId> {
            let mut w = t.vector(name, len)?;
            if offset {
                w.iter_mut().for_each(|x| *x += 1.0);
            }
            Ok(s.vec(w))
        };
        let mut s = WeightStore::default();
        let embed_name = t.name("model.embed_tokens.weight", "token_embd.weight");
        let embed = s.mat(t.matrix(&embed_name, c.vocab_size, h)?, MatUse { table: true, linear: false });
        let mut layers = Vec::with_capacity(c.num_layers);
        for (i, &sliding) in sliding.iter().enumerate() {
            let n = |hf: &str, gguf: &str| t.layer(i, hf, gguf);
            let qk_norm = |s: &mut WeightStore, hf: &str, gguf: &str| -> Result<Option<VecId>> {
                if c.qk_norm {
                    norm(s, &n(hf, gguf), hd).map(Some)
                } else {
                    Ok(None)
                }
            };
            layers.push(Layer {
                attn_norm: norm(&mut s, &n("input_layernorm.weight", "attn_norm.weight"), h)?,
                wq: s.linear(t.matrix(&n("self_attn.q_proj.weight", "attn_q.weight"), qd, h)?),
                wk: s.linear(t.matrix(&n("self_attn.k_proj.weight", "attn_k.weight"), kvd, h)?),
                wv: s.linear(t.matrix(&n("self_attn.v_proj.weight", "attn_v.weight"), kvd, h)?),
                wo: s.linear(t.matrix(&n("self_attn.o_proj.weight", "attn_output.weight"), h, qd)?),
                q_norm: qk_norm(&mut s, "self_attn.q_norm.weight", "attn_q_norm.weight")?,
                k_norm: qk_norm(&mut s, "self_attn.k_norm.weight", "attn_k_norm.weight")?,
                post_attn_norm: norm(
                    &mut s,
                    &n("post_attention_layernorm.weight", "post_attention_norm.weight"),
                    h,
                )?,
                ffn_norm: norm(&mut s, &n("pre_feedforward_layernorm.weight", "ffn_norm.weight"), h)?,
                w_gate: s.linear(t.matrix(&n("mlp.gate_proj.weight", "ffn_gate.weight"), ff, h)?),
                w_up: s.linear(t.matrix(&n("mlp.up_proj.weight", "ffn_up.weight"), ff, h)?),
                w_down: s.linear(t.matrix(&n("mlp.down_proj.weight", "ffn_down.weight"), h, ff)?),
                post_ffn_norm: norm(
                    &mut s,
                    &n("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
                    h,
                )?,
                sliding,
            });
        }
        let final_norm = norm(&mut s, &t.name("model.norm.weight", "output_norm.weight"), h)?;
        let lm_head = t.output_head(&mut s, embed, c.tie_word_embeddings, c.vocab_size, h)?;

        let mut ropes = vec![default_rope(c)];
        let rope_local = match (c.arch, c.rope_local_theta) {
            (Arch::Gemma3, Some(theta)) => {
                ropes.push(RopeSpec { dims: hd, theta, scaling: None });
                RopeId(1)
            }
            (Arch::Gemma3, None) => return Err(unsupported("Gemma 3 without a local RoPE base".into())),
            _ => RopeId(0),
        };
        let mut sb = ScratchBuilder::default();
        let b = Bufs {
            x: sb.f32(h),
            xn: sb.mat_in(h),
            q: sb.f32(qd),
            k: sb.f32(kvd),
            v: sb.f32(kvd),
            attn: sb.mat_in(qd),
            o: sb.f32(h),
            on: sb.f32(h),
            gate: sb.f32(ff),
            up: sb.f32(ff),
            act: sb.mat_in(ff),
            xsel: sb.add(h, Rows::Logits, BufKind::F32),
            hsel: sb.add(h, Rows::Logits, BufKind::MatIn),
            logits: sb.add(c.vocab_size, Rows::Logits, BufKind::F32),
        };
        let model = Gemma {
            eps: c.rms_norm_eps,
            head_dim: hd,
            window: c.sliding_window,
            // transformers multiplies by the f32 value of √hidden; so does llama.cpp.
            embed_scale: (h as f64).sqrt() as f32,
            attn_scale: 1.0 / scalar.sqrt(),
            attn_softcap: c.attn_logit_softcapping,
            final_softcap: c.final_logit_softcapping,
            embed,
            layers,
            final_norm,
            lm_head,
            rope_global: RopeId(0),
            rope_local,
            b,
            scratch: sb.finish(),
            ropes,
        };
        Ok(ModelWeights { model: std::sync::Arc::new(model), store: s })
    }
}

impl Model for Gemma {
    fn scratch(&self) -> &[BufSpec] {
        &self.scratch
    }

    fn ropes(&self) -> &[RopeSpec] {
        &self.ropes
    }

    fn logits(&self) -> Buf {
        self.b.logits
    }

    fn fused_groups(&self) -> Vec<Vec<MatId>> {
        self.layers.iter().flat_map(|lw| [vec![lw.wq, lw.wk, lw.wv], vec![lw.w_gate, lw.w_up]]).collect()
    }

    fn forward(&self, ops: &mut dyn Ops) -> Result<()> {
        let b = &self.b;
        let (eps, hd) = (self.eps, self.head_dim);
        ops.embed(self.embed, Some(self.embed_scale), b.x)?;
        // The previous layer's last residual add, done with this layer's first norm.
        let mut residual: Option<Buf> = None;
        for (l, lw) in self.layers.iter().enumerate() {
            norm_after_residual(ops, residual.take(), b.x, lw.attn_norm, eps, b.xn)?;
            let inputs = AttnInputs {
                layer: l,
                wq: lw.wq,
                wk: lw.wk,
                wv: lw.wv,
                lora: [lora(l, Proj::Q), lora(l, Proj::K), lora(l, Proj::V)],
                bias: None,
                q_norm: lw.q_norm,
                k_norm: lw.k_norm,
                head_dim: hd,
                eps,
                rope: if lw.sliding { self.rope_local } else { self.rope_global },
            };
            ops.attn_inputs(b.xn, &inputs, b.q, b.k, b.v)?;
            let spec = AttnSpec {
                layer: l,
                window: if lw.sliding { self.window } else { None },
                scale: self.attn_scale,
                softcap: self.attn_softcap,
            };
            ops.attention(b.q, b.k, b.v, b.attn, &spec)?;
            ops.linear(b.attn, &[(lw.wo, b.o)])?;
            ops.lora(b.attn, &[(lora(l, Proj::O), b.o)])?;
            ops.rms_norm(b.o, lw.post_attn_norm, eps, b.on)?;
            ops.add_rms_norm(b.x, b.on, lw.ffn_norm, eps, b.xn)?;
            let ffn = GatedFfn {
                gate: lw.w_gate,
                up: lw.w_up,
                lora: [lora(l, Proj::Gate), lora(l, Proj::Up)],
                act: Activation::GeluTanh,
            };
            ops.gated_ffn(b.xn, &ffn, b.gate, b.up, b.act)?;
            ops.linear(b.act, &[(lw.w_down, b.o)])?;
            ops.lora(b.act, &[(lora(l, Proj::Down), b.o)])?;
            ops.rms_norm(b.o, lw.post_ffn_norm, eps, b.on)?;
            residual = Some(b.on);
        }
        if let Some(y) = residual {
            ops.add(b.x, y)?;
        }
        ops.gather_logit_rows(b.x, b.xsel)?;
        ops.rms_norm(b.xsel, self.final_norm, eps, b.hsel)?;
        ops.linear(b.hsel, &[(self.lm_head, b.logits)])?;
        if let Some(cap) = self.final_softcap {
            ops.softcap(b.logits, cap)?;
        }
        Ok(())
    }
}

/// The LoRA target of projection `p` in layer `l`.
fn lora(l: usize, p: Proj) -> LoraTarget {
    LoraTarget { layer: l as u32, proj: p }
}
