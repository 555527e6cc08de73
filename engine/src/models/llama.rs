//! The Llama family: Llama 2/3, SmolLM, Mistral (sliding window), Qwen2 (QKV bias), Qwen3
//! (per-head q/k RMSNorm) and Phi-3 (fused projections split at load by [`super::phi3`]). Pre-norm blocks, one RoPE table, a SwiGLU MLP. The same pass runs the
//! mixture-of-experts models of [`super::moe`] (Qwen3-MoE, Mixtral), whose sparse layers call
//! [`Ops::moe`] where the others have their dense MLP.

use super::{
    default_rope, norm_after_residual, Activation, AttnInputs, AttnSpec, Buf, BufKind, BufSpec, GatedFfn,
    MatId, Model, ModelWeights, MoeScratch, MoeSpec, Ops, RopeId, RopeSpec, Rows, ScratchBuilder, Tensors,
    VecId, WeightStore,
};
use crate::config::{Arch, ModelConfig};
use crate::error::{EngineError, Result};
use crate::lora::{LoraTarget, Proj};
use crate::weights::{Bytes, Matrix};

#[derive(Debug)]
struct Layer {
    attn_norm: VecId,
    wq: MatId,
    wk: MatId,
    wv: MatId,
    wo: MatId,
    /// QKV biases (Qwen2).
    bias: Option<[VecId; 3]>,
    /// Per-head RMSNorm weights over `head_dim` for queries and keys (Qwen3; some Llama files).
    q_norm: Option<VecId>,
    k_norm: Option<VecId>,
    ffn_norm: VecId,
    mlp: Mlp,
}

/// A layer's MLP.
#[derive(Debug)]
enum Mlp {
    /// SwiGLU over `intermediate_size`.
    Dense { gate: MatId, up: MatId, down: MatId },
    /// A routed mixture of SwiGLU experts.
    Sparse(MoeSpec),
}

/// The dense MLP's scratch.
#[derive(Debug, Clone, Copy)]
struct DenseBufs {
    gate: Buf,
    up: Buf,
    act: Buf,
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
    /// Declared when some layer is dense.
    dense: Option<DenseBufs>,
    /// Declared when some layer is sparse.
    moe: Option<MoeScratch>,
    /// The residual rows that return logits, then their final norm.
    xsel: Buf,
    hsel: Buf,
    logits: Buf,
}

/// A Llama-family model's forward pass.
#[derive(Debug)]
pub struct Llama {
    eps: f32,
    head_dim: usize,
    window: Option<usize>,
    embed: MatId,
    layers: Vec<Layer>,
    final_norm: VecId,
    lm_head: MatId,
    b: Bufs,
    scratch: Vec<BufSpec>,
    ropes: Vec<RopeSpec>,
}

impl Llama {
    /// Reads the family's tensors (shapes checked against `c`).
    pub(crate) fn load(c: &ModelConfig, t: &Tensors<'_>) -> Result<ModelWeights> {
        let (h, hd, ff) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (qd, kvd) = (c.num_heads * hd, c.num_kv_heads * hd);
        let path = t.src.path();
        let bias_name = t.layer(0, "self_attn.o_proj.bias", "attn_output.bias");
        if t.src.has(&bias_name) {
            return Err(EngineError::Unsupported {
                path: path.into(),
                msg: format!("tensor `{bias_name}` (output projection bias)"),
            });
        }
        // llama.cpp's converter interleaves the two rotary halves of each Q/K head for Llama and
        // Mistral (its RoPE rotates adjacent pairs); undo it so every backend uses one RoPE style.
        let permuted = t.src.is_gguf() && matches!(c.arch, Arch::Llama | Arch::Mistral | Arch::Mixtral);
        // Phi-3 fuses its projections; they are split here and run as any other Llama's.
        let phi3 = c.arch == Arch::Phi3;
        if phi3 {
            super::phi3::check(c, t)?;
        }
        let sparse = |i: usize| c.moe.as_ref().is_some_and(|m| m.sparse_layers[i]);
        let mut sb = ScratchBuilder::default();
        let b = Bufs {
            x: sb.f32(h),
            xn: sb.mat_in(h),
            q: sb.f32(qd),
            k: sb.f32(kvd),
            v: sb.f32(kvd),
            attn: sb.mat_in(qd),
            o: sb.f32(h),
            dense: (0..c.num_layers).any(|i| !sparse(i)).then(|| DenseBufs {
                gate: sb.f32(ff),
                up: sb.f32(ff),
                act: sb.mat_in(ff),
            }),
            moe: c.moe.as_ref().filter(|m| m.sparse_layers.contains(&true)).map(|m| {
                let eff = m.expert_intermediate_size;
                MoeScratch {
                    route: sb.f32(m.num_experts),
                    gate: sb.f32(eff),
                    up: sb.f32(eff),
                    act: sb.mat_in(eff),
                    down: sb.f32(h),
                }
            }),
            xsel: sb.add(h, Rows::Logits, BufKind::F32),
            hsel: sb.add(h, Rows::Logits, BufKind::MatIn),
            logits: sb.add(c.vocab_size, Rows::Logits, BufKind::F32),
        };
        let mut s = WeightStore::default();
        let embed_name = t.name("model.embed_tokens.weight", "token_embd.weight");
        let embed =
            s.mat(t.matrix(&embed_name, c.vocab_size, h)?, super::MatUse { table: true, linear: false });
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let n = |hf: &str, gguf: &str| t.layer(i, hf, gguf);
            let (mut wq, mut wk, wv) = if phi3 {
                super::phi3::qkv(c, t, i)?
            } else {
                (
                    t.matrix(&n("self_attn.q_proj.weight", "attn_q.weight"), qd, h)?,
                    t.matrix(&n("self_attn.k_proj.weight", "attn_k.weight"), kvd, h)?,
                    t.matrix(&n("self_attn.v_proj.weight", "attn_v.weight"), kvd, h)?,
                )
            };
            if permuted {
                wq = unpermute_rope_rows(&wq, c.num_heads);
                wk = unpermute_rope_rows(&wk, c.num_kv_heads);
            }
            let bias = if c.qkv_bias {
                Some([
                    s.vec(t.vector(&n("self_attn.q_proj.bias", "attn_q.bias"), qd)?),
                    s.vec(t.vector(&n("self_attn.k_proj.bias", "attn_k.bias"), kvd)?),
                    s.vec(t.vector(&n("self_attn.v_proj.bias", "attn_v.bias"), kvd)?),
                ])
            } else {
                None
            };
            // Qwen3 must have q/k norms; a GGUF of another Llama-family model may carry them too.
            let qk = |hf: &str, gguf: &str| -> Result<Option<Vec<f32>>> {
                if c.qk_norm {
                    t.vector(&n(hf, gguf), hd).map(Some)
                } else if t.src.is_gguf() {
                    t.opt_vector(&n(hf, gguf), hd)
                } else {
                    Ok(None)
                }
            };
            let (q_norm, k_norm) = (
                qk("self_attn.q_norm.weight", "attn_q_norm.weight")?,
                qk("self_attn.k_norm.weight", "attn_k_norm.weight")?,
            );
            let mlp = match (&c.moe, b.moe) {
                (Some(m), Some(scratch)) if m.sparse_layers[i] => {
                    Mlp::Sparse(super::moe::load_experts(c, m, t, &mut s, i, scratch)?)
                }
                _ => {
                    let (gate, up) = if phi3 {
                        super::phi3::gate_up(c, t, i)?
                    } else {
                        (
                            t.matrix(&n("mlp.gate_proj.weight", "ffn_gate.weight"), ff, h)?,
                            t.matrix(&n("mlp.up_proj.weight", "ffn_up.weight"), ff, h)?,
                        )
                    };
                    Mlp::Dense {
                        gate: s.linear(gate),
                        up: s.linear(up),
                        down: s.linear(t.matrix(&n("mlp.down_proj.weight", "ffn_down.weight"), h, ff)?),
                    }
                }
            };
            layers.push(Layer {
                attn_norm: s.vec(t.vector(&n("input_layernorm.weight", "attn_norm.weight"), h)?),
                wq: s.linear(wq),
                wk: s.linear(wk),
                wv: s.linear(wv),
                wo: s.linear(t.matrix(&n("self_attn.o_proj.weight", "attn_output.weight"), h, qd)?),
                bias,
                q_norm: q_norm.map(|v| s.vec(v)),
                k_norm: k_norm.map(|v| s.vec(v)),
                ffn_norm: s.vec(t.vector(&n("post_attention_layernorm.weight", "ffn_norm.weight"), h)?),
                mlp,
            });
        }
        let final_norm = s.vec(t.vector(&t.name("model.norm.weight", "output_norm.weight"), h)?);
        let lm_head = t.output_head(&mut s, embed, c.tie_word_embeddings, c.vocab_size, h)?;

        let model = Llama {
            eps: c.rms_norm_eps,
            head_dim: hd,
            window: c.sliding_window,
            embed,
            layers,
            final_norm,
            lm_head,
            b,
            scratch: sb.finish(),
            ropes: vec![default_rope(c)],
        };
        Ok(ModelWeights { model: std::sync::Arc::new(model), store: s })
    }
}

impl Model for Llama {
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
        let mut g = Vec::new();
        for lw in &self.layers {
            g.push(vec![lw.wq, lw.wk, lw.wv]);
            if let Mlp::Dense { gate, up, .. } = &lw.mlp {
                g.push(vec![*gate, *up]);
            }
        }
        g
    }

    fn moe_specs(&self) -> Vec<&MoeSpec> {
        self.layers
            .iter()
            .filter_map(|lw| match &lw.mlp {
                Mlp::Sparse(spec) => Some(spec),
                Mlp::Dense { .. } => None,
            })
            .collect()
    }

    fn forward(&self, ops: &mut dyn Ops) -> Result<()> {
        let b = &self.b;
        let (eps, hd) = (self.eps, self.head_dim);
        let rope = RopeId(0);
        ops.embed(self.embed, None, b.x)?;
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
                bias: lw.bias,
                q_norm: lw.q_norm,
                k_norm: lw.k_norm,
                head_dim: hd,
                eps,
                rope,
            };
            ops.attn_inputs(b.xn, &inputs, b.q, b.k, b.v)?;
            let spec =
                AttnSpec { layer: l, window: self.window, scale: 1.0 / (hd as f32).sqrt(), softcap: None };
            ops.attention(b.q, b.k, b.v, b.attn, &spec)?;
            ops.linear(b.attn, &[(lw.wo, b.o)])?;
            ops.lora(b.attn, &[(lora(l, Proj::O), b.o)])?;
            ops.add_rms_norm(b.x, b.o, lw.ffn_norm, eps, b.xn)?;
            match (&lw.mlp, b.dense) {
                (Mlp::Dense { gate, up, down }, Some(d)) => {
                    let ffn = GatedFfn {
                        gate: *gate,
                        up: *up,
                        lora: [lora(l, Proj::Gate), lora(l, Proj::Up)],
                        act: Activation::Silu,
                    };
                    ops.gated_ffn(b.xn, &ffn, d.gate, d.up, d.act)?;
                    ops.linear(d.act, &[(*down, b.o)])?;
                    ops.lora(d.act, &[(lora(l, Proj::Down), b.o)])?;
                }
                (Mlp::Sparse(spec), _) => ops.moe(b.xn, spec, b.o)?,
                (Mlp::Dense { .. }, None) => {
                    return Err(EngineError::Internal("model pass: a dense layer without its buffers".into()))
                }
            }
            residual = Some(b.o);
        }
        if let Some(y) = residual {
            ops.add(b.x, y)?;
        }
        ops.gather_logit_rows(b.x, b.xsel)?;
        ops.rms_norm(b.xsel, self.final_norm, eps, b.hsel)?;
        ops.linear(b.hsel, &[(self.lm_head, b.logits)])
    }
}

/// Reorders the rows of a Q or K projection from llama.cpp's interleaved RoPE layout (pairs
/// `(2j, 2j+1)` rotate together) back to the rotate-half layout (`j` with `j + head_dim/2`).
/// Rows are independent in every GGML type, so this is a byte copy per row.
pub fn unpermute_rope_rows(m: &Matrix, n_heads: usize) -> Matrix {
    let hd = m.rows / n_heads;
    let half = hd / 2;
    let rb = m.row_bytes();
    let mut out = vec![0u8; m.rows * rb];
    for head in 0..n_heads {
        for t in 0..2 {
            for j in 0..half {
                let dst = head * hd + t * half + j;
                let src = head * hd + 2 * j + t;
                out[dst * rb..(dst + 1) * rb].copy_from_slice(m.row(src));
            }
        }
    }
    Matrix { rows: m.rows, cols: m.cols, dtype: m.dtype, data: Bytes::copy_from(&out) }
}

/// The LoRA target of projection `p` in layer `l`.
fn lora(l: usize, p: Proj) -> LoraTarget {
    LoraTarget { layer: l as u32, proj: p }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::GgmlType;

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        // 2 heads of head_dim 4, one f32 column whose value is the Hugging Face row index.
        let (heads, hd) = (2usize, 4usize);
        let hf: Vec<f32> = (0..heads * hd).map(|r| r as f32).collect();
        // llama.cpp: reshape(heads, 2, hd/2).swapaxes(1, 2): gguf row (h, j, t) = hf row (h, t, j).
        let mut gg = vec![0f32; hf.len()];
        for h in 0..heads {
            for j in 0..hd / 2 {
                for t in 0..2 {
                    gg[h * hd + j * 2 + t] = hf[h * hd + t * (hd / 2) + j];
                }
            }
        }
        let m = Matrix { rows: heads * hd, cols: 1, dtype: GgmlType::F32, data: Bytes::from_f32(&gg) };
        let back = unpermute_rope_rows(&m, heads);
        assert_eq!(back.data.as_f32().unwrap(), hf.as_slice());
    }
}
