//! Phi-3 (mini, medium), Phi-3.5-mini and Phi-4: a Llama-shaped decoder (pre-norm blocks,
//! RMSNorm, SwiGLU, rotate-half RoPE, GQA) whose files fuse projections.
//!
//! - Attention: one `qkv_proj` matrix (GGUF `attn_qkv`) whose rows are the query rows
//!   (`heads × head_dim`), then the key rows, then the value rows (`kv_heads × head_dim` each).
//!   A GGUF file may instead carry `attn_q` / `attn_k` / `attn_v`.
//! - MLP: one `gate_up_proj` matrix (GGUF `ffn_up`) of `2 × ffn` rows, the gate's first and the
//!   up projection's after (transformers' `gate, up = gate_up_proj(x).chunk(2)`; llama.cpp's
//!   SwiGLU over a fused input activates the first half).
//!
//! The fused matrices are split by rows at load (rows are independent in every GGML type), so
//! Phi-3 runs the Llama family's pass ([`super::llama`]); this file only reads its tensors. RoPE: one table, LongRoPE where configured
//! (`RopeScaling::LongRope`); the sliding window, where configured, applies to every layer.
//! llama.cpp's converter does not interleave Phi-3's rotary halves (llama.cpp runs Phi-3 with
//! NEOX, i.e. rotate-half, RoPE), so no row permutation is undone at load.

use super::Tensors;
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::weights::Matrix;

/// Refuses what Phi-3's pass does not apply: biases and q/k norms.
pub(super) fn check(c: &ModelConfig, t: &Tensors<'_>) -> Result<()> {
    let unsupported = |msg: String| EngineError::Unsupported { path: t.src.path().into(), msg };
    if c.qkv_bias || c.qk_norm {
        return Err(unsupported("Phi-3 with QKV biases or q/k norms".into()));
    }
    // Phi-3 has no biases; a file that carries one would need it applied.
    for (hf, gguf) in [
        ("self_attn.qkv_proj.bias", "attn_qkv.bias"),
        ("self_attn.q_proj.bias", "attn_q.bias"),
        ("self_attn.o_proj.bias", "attn_output.bias"),
        ("mlp.gate_up_proj.bias", "ffn_up.bias"),
        ("mlp.down_proj.bias", "ffn_down.bias"),
    ] {
        let name = t.layer(0, hf, gguf);
        if t.src.has(&name) {
            return Err(unsupported(format!("tensor `{name}` (a bias)")));
        }
    }
    Ok(())
}

/// Layer `i`'s query, key and value projections, split from the fused `qkv_proj` (a GGUF file
/// may carry them separate instead).
pub(super) fn qkv(c: &ModelConfig, t: &Tensors<'_>, i: usize) -> Result<(Matrix, Matrix, Matrix)> {
    let (h, hd) = (c.hidden_size, c.head_dim);
    let (qd, kvd) = (c.num_heads * hd, c.num_kv_heads * hd);
    let n = |hf: &str, gguf: &str| t.layer(i, hf, gguf);
    let fused = n("self_attn.qkv_proj.weight", "attn_qkv.weight");
    Ok(if !t.src.is_gguf() || t.src.has(&fused) {
        let qkv = t.matrix(&fused, qd + 2 * kvd, h)?;
        (qkv.rows(0..qd), qkv.rows(qd..qd + kvd), qkv.rows(qd + kvd..qd + 2 * kvd))
    } else {
        (
            t.matrix(&n("self_attn.q_proj.weight", "attn_q.weight"), qd, h)?,
            t.matrix(&n("self_attn.k_proj.weight", "attn_k.weight"), kvd, h)?,
            t.matrix(&n("self_attn.v_proj.weight", "attn_v.weight"), kvd, h)?,
        )
    })
}

/// Layer `i`'s gate and up projections, split from the fused `gate_up_proj` (GGUF `ffn_up`).
pub(super) fn gate_up(c: &ModelConfig, t: &Tensors<'_>, i: usize) -> Result<(Matrix, Matrix)> {
    let (h, ff) = (c.hidden_size, c.intermediate_size);
    let gate_up = t.matrix(&t.layer(i, "mlp.gate_up_proj.weight", "ffn_up.weight"), 2 * ff, h)?;
    Ok((gate_up.rows(0..ff), gate_up.rows(ff..2 * ff)))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::backend::{Backend, BackendOptions, LogitsRequest, SeqChunk};
    use crate::config::{ModelConfig, RopeScaling};
    use crate::cpu::CpuBackend;
    use crate::gguf::test_file::{f32_bytes, str_bytes, write_tmp, Writer};
    use crate::gguf::GgufFile;
    use crate::kv::{BlockAllocator, KvDtype, WriteMode};
    use crate::safetensors::SafeTensors;

    const U32: u32 = 4;
    const F32: u32 = 6;
    const STR: u32 = 8;

    fn u32_kv(w: Writer, key: &str, v: usize) -> Writer {
        w.kv(&format!("phi3.{key}"), U32, (v as u32).to_le_bytes().to_vec())
    }

    /// A GGUF file holding a Hugging Face Phi-3 directory's weights and settings as llama.cpp's
    /// converter names them: `attn_qkv` and `ffn_up` fused as they are (or, with `split_qkv`,
    /// separate `attn_q` / `attn_k` / `attn_v`), LongRoPE factors as tensors.
    fn to_gguf(dir: &Path, c: &ModelConfig, split_qkv: bool) -> std::path::PathBuf {
        let st = SafeTensors::open_dir(dir).unwrap();
        let (h, ff, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
        let (qd, kvd) = (c.num_heads * hd, c.num_kv_heads * hd);
        let mut w = Writer::new().kv("general.architecture", STR, str_bytes("phi3"));
        for (key, v) in [
            ("embedding_length", h),
            ("block_count", c.num_layers),
            ("feed_forward_length", ff),
            ("attention.head_count", c.num_heads),
            ("attention.head_count_kv", c.num_kv_heads),
            ("context_length", c.max_position_embeddings),
            ("rope.dimension_count", hd),
            // The converter's "no window".
            ("attention.sliding_window", c.sliding_window.unwrap_or(0)),
        ] {
            w = u32_kv(w, key, v);
        }
        let f32_kv =
            |w: Writer, key: &str, v: f32| w.kv(&format!("phi3.{key}"), F32, v.to_le_bytes().to_vec());
        w = f32_kv(w, "attention.layer_norm_rms_epsilon", c.rms_norm_eps);
        w = f32_kv(w, "rope.freq_base", c.rope_theta);
        if let Some(RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings,
            attention_factor,
        }) = &c.rope_scaling
        {
            w = u32_kv(w, "rope.scaling.original_context_length", *original_max_position_embeddings);
            w = f32_kv(w, "rope.scaling.attn_factor", *attention_factor);
            let n = short_factor.len() as u64;
            w = w.tensor("rope_factors_long.weight", &[n], 0, f32_bytes(long_factor));
            w = w.tensor("rope_factors_short.weight", &[n], 0, f32_bytes(short_factor));
        }
        let mat = |name: &str, rows: usize, cols: usize| {
            f32_bytes(st.matrix(name, rows, cols).unwrap().data.as_f32().unwrap())
        };
        let vec = |name: &str, len: usize| f32_bytes(&st.vector(name, len).unwrap());
        let dims = |rows: usize, cols: usize| [cols as u64, rows as u64];
        w = w.tensor(
            "token_embd.weight",
            &dims(c.vocab_size, h),
            0,
            mat("model.embed_tokens.weight", c.vocab_size, h),
        );
        w = w.tensor("output_norm.weight", &[h as u64], 0, vec("model.norm.weight", h));
        w = w.tensor("output.weight", &dims(c.vocab_size, h), 0, mat("lm_head.weight", c.vocab_size, h));
        for i in 0..c.num_layers {
            let hf = |n: &str| format!("model.layers.{i}.{n}");
            let gg = |n: &str| format!("blk.{i}.{n}");
            w = w.tensor(&gg("attn_norm.weight"), &[h as u64], 0, vec(&hf("input_layernorm.weight"), h));
            let qkv = mat(&hf("self_attn.qkv_proj.weight"), qd + 2 * kvd, h);
            if split_qkv {
                let rb = 4 * h;
                w = w.tensor(&gg("attn_q.weight"), &dims(qd, h), 0, qkv[..qd * rb].to_vec());
                w = w.tensor(&gg("attn_k.weight"), &dims(kvd, h), 0, qkv[qd * rb..(qd + kvd) * rb].to_vec());
                w = w.tensor(&gg("attn_v.weight"), &dims(kvd, h), 0, qkv[(qd + kvd) * rb..].to_vec());
            } else {
                w = w.tensor(&gg("attn_qkv.weight"), &dims(qd + 2 * kvd, h), 0, qkv);
            }
            w = w.tensor(
                &gg("attn_output.weight"),
                &dims(h, qd),
                0,
                mat(&hf("self_attn.o_proj.weight"), h, qd),
            );
            w = w.tensor(
                &gg("ffn_norm.weight"),
                &[h as u64],
                0,
                vec(&hf("post_attention_layernorm.weight"), h),
            );
            w = w.tensor(
                &gg("ffn_up.weight"),
                &dims(2 * ff, h),
                0,
                mat(&hf("mlp.gate_up_proj.weight"), 2 * ff, h),
            );
            w = w.tensor(&gg("ffn_down.weight"), &dims(h, ff), 0, mat(&hf("mlp.down_proj.weight"), h, ff));
        }
        let name = format!("{}-{split_qkv}.gguf", dir.file_name().unwrap().to_string_lossy());
        write_tmp(&name, &w.bytes())
    }

    /// A Phi-3 GGUF's metadata (4 heads of 16, 2 KV heads), `extra` added, with `tensors`
    /// (`(name, values)`, f32) and no weights.
    fn metadata_only(tag: &str, extra: &[(&str, usize)], tensors: &[(&str, &[f32])]) -> GgufFile {
        let mut w = Writer::new().kv("general.architecture", STR, str_bytes("phi3"));
        let base = [
            ("embedding_length", 64),
            ("block_count", 2),
            ("feed_forward_length", 128),
            ("attention.head_count", 4),
            ("attention.head_count_kv", 2),
            ("context_length", 512),
            ("vocab_size", 100),
        ];
        for &(key, v) in base.iter().chain(extra) {
            w = u32_kv(w, key, v);
        }
        for &(name, values) in tensors {
            w = w.tensor(name, &[values.len() as u64], 0, f32_bytes(values));
        }
        GgufFile::open(&write_tmp(&format!("phi3-meta-{tag}.gguf"), &w.bytes())).unwrap()
    }

    #[test]
    fn gguf_metadata_refusals_and_defaults() {
        let f = [1.0f32; 8];
        let c =
            ModelConfig::from_gguf(&metadata_only("plain", &[("attention.sliding_window", 0)], &[])).unwrap();
        assert_eq!((c.head_dim, c.sliding_window, c.rope_scaling), (16, None, None));
        let c = ModelConfig::from_gguf(&metadata_only("swa", &[("attention.sliding_window", 2047)], &[]))
            .unwrap();
        assert_eq!(c.sliding_window, Some(2047));
        // No attention factor written: derived from context_length / original (512 / 64).
        let both = [("rope_factors_short.weight", &f[..]), ("rope_factors_long.weight", &f[..])];
        let g = metadata_only("derived", &[("rope.scaling.original_context_length", 64)], &both);
        let Some(RopeScaling::LongRope { attention_factor, original_max_position_embeddings, .. }) =
            ModelConfig::from_gguf(&g).unwrap().rope_scaling
        else {
            panic!("expected LongRoPE")
        };
        assert_eq!((attention_factor, original_max_position_embeddings), (1.5f64.sqrt() as f32, 64));

        let err = |g: GgufFile| ModelConfig::from_gguf(&g).unwrap_err().to_string();
        // Phi-4-mini rotates 96 of 128 dimensions; here 12 of 16.
        let e = err(metadata_only("partial", &[("rope.dimension_count", 12)], &[]));
        assert!(e.contains("partial rotary"), "{e}");
        let e = err(metadata_only("no-original", &[], &both));
        assert!(e.contains("phi3.rope.scaling.original_context_length"), "{e}");
        let long_only = [("rope_factors_long.weight", &f[..])];
        let e = err(metadata_only("long-only", &[("rope.scaling.original_context_length", 64)], &long_only));
        assert!(e.contains("rope_factors_short.weight"), "{e}");
        let short = [("rope_factors_short.weight", &f[..4]), ("rope_factors_long.weight", &f[..])];
        let e = err(metadata_only("short", &[("rope.scaling.original_context_length", 64)], &short));
        assert!(e.contains("short_factor has 4 values"), "{e}");
    }

    /// Logits at every position of `ids`.
    fn logits(c: &ModelConfig, weights: crate::models::ModelWeights, ids: &[u32]) -> Vec<f32> {
        let opts = BackendOptions {
            num_blocks: 32,
            block_size: 8,
            max_batch_tokens: 256,
            kv_dtype: Some(KvDtype::F32),
            ..Default::default()
        };
        let mut be = CpuBackend::new(c.clone(), weights, opts).unwrap();
        let mut alloc = BlockAllocator::new(32, 8);
        alloc.add_sequence(1, ids.len()).unwrap();
        let table = alloc.block_table(1).unwrap().to_vec();
        let chunk = SeqChunk {
            tokens: ids,
            start_pos: 0,
            block_table: &table,
            logits: LogitsRequest::All,
            write: WriteMode::Direct,
            adapter: None,
        };
        be.forward(&[chunk]).unwrap().remove(0)
    }

    /// A Phi-3 GGUF as llama.cpp writes it reads as the same configuration as the Hugging Face
    /// directory it came from (LongRoPE included) and gives the same logits bit for bit: fused
    /// QKV and gate/up split at the same rows, separate Q/K/V taken as they are, no row
    /// permutation.
    #[test]
    fn gguf_matches_hugging_face() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures");
        // 80 tokens: past the LongRoPE fixture's original context of 64.
        let ids: Vec<u32> = (0..80).map(|i| (i * 37 + 5) % 448).collect();
        for (name, split_qkv) in [("phi3", true), ("phi3-longrope", false)] {
            let dir = root.join(name);
            let hf = crate::loader::load_model(&dir).unwrap();
            let path = to_gguf(&dir, &hf.config, split_qkv);
            let g = GgufFile::open(&path).unwrap();
            let c = ModelConfig::from_gguf(&g).unwrap();
            assert_eq!(c, hf.config, "{name}: configuration");
            assert_eq!(matches!(c.rope_scaling, Some(RopeScaling::LongRope { .. })), name == "phi3-longrope");
            let weights = super::super::load(&c, &g).unwrap();
            let (want, got) = (logits(&hf.config, hf.weights, &ids), logits(&c, weights, &ids));
            assert_eq!(want.len(), ids.len() * c.vocab_size);
            assert!(want == got, "{name}: GGUF logits differ from the Hugging Face directory's");
            std::fs::remove_file(&path).unwrap();
        }
    }
}
