#!/usr/bin/env python3
"""Writes the two random-weight models `scripts/moe-bench.sh` compares, as Hugging Face directories.

Usage: moe_bench_models.py OUT_DIR [--hidden H --layers L --heads N --kv-heads K --head-dim D
                                    --experts E --expert-ff F --top-k T --vocab V --seed S]

OUT_DIR/moe:   Qwen3MoeForCausalLM (`qwen3_moe`), every layer sparse: E experts of `moe_intermediate_size`
               F, T per token (`norm_topk_prob`).
OUT_DIR/dense: Qwen3ForCausalLM (`qwen3`) with `intermediate_size` = T * F, so a token runs the same
               number of multiply-adds in both; everything else (hidden size, layers, heads, vocab,
               untied lm_head) is the same.

Both take the tokenizer of the tiny reference fixtures (tests/reference/fixtures/qwen3, vocab
448). Weights are bf16 (the engine widens them to f32 when loading), drawn from one seeded
generator: a rerun writes the same bytes. Needs only numpy. Prints one JSON line: each model's
directory, total parameters and parameters active per token.
"""

import argparse
import json
import os
import shutil
import struct
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_DIR = os.path.join(ROOT, "tests", "reference", "fixtures", "qwen3")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def bf16_bytes(a):
    """float32 array -> bf16 bytes, rounded to nearest even (values are finite)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


def write_safetensors(path, tensors):
    """tensors: list of (name, float32 array); written as BF16 in that order."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, a in tensors:
        b = bf16_bytes(a)
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # keeps the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


class Weights:
    """Seeded random weights; projections scaled by 1/sqrt(fan-in) so activations stay near unit size."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.out = []

    def linear(self, name, rows, cols):
        w = self.rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(cols**-0.5)
        self.out.append((name, w))
        return w.size

    def norm(self, name, n):
        self.out.append((name, self.rng.uniform(0.8, 1.2, n).astype(np.float32)))
        return n

    def embedding(self, name, rows, cols):
        self.out.append((name, self.rng.standard_normal((rows, cols), dtype=np.float32)))
        return rows * cols


def make(out, a, moe):
    """Writes one model; returns (total parameters, active parameters per token)."""
    os.makedirs(out, exist_ok=True)
    h, hd, L = a.hidden, a.head_dim, a.layers
    w = Weights(a.seed + (1 if moe else 0))
    total = inactive = 0
    total += w.embedding("model.embed_tokens.weight", a.vocab, h)
    for i in range(L):
        p = f"model.layers.{i}."
        total += w.norm(p + "input_layernorm.weight", h)
        total += w.linear(p + "self_attn.q_proj.weight", a.heads * hd, h)
        total += w.linear(p + "self_attn.k_proj.weight", a.kv_heads * hd, h)
        total += w.linear(p + "self_attn.v_proj.weight", a.kv_heads * hd, h)
        total += w.linear(p + "self_attn.o_proj.weight", h, a.heads * hd)
        total += w.norm(p + "self_attn.q_norm.weight", hd)
        total += w.norm(p + "self_attn.k_norm.weight", hd)
        total += w.norm(p + "post_attention_layernorm.weight", h)
        if moe:
            total += w.linear(p + "mlp.gate.weight", a.experts, h)
            for e in range(a.experts):
                q = f"{p}mlp.experts.{e}."
                n = w.linear(q + "gate_proj.weight", a.expert_ff, h)
                n += w.linear(q + "up_proj.weight", a.expert_ff, h)
                n += w.linear(q + "down_proj.weight", h, a.expert_ff)
                total += n
                if e >= a.top_k:
                    inactive += n
        else:
            ff = a.top_k * a.expert_ff
            total += w.linear(p + "mlp.gate_proj.weight", ff, h)
            total += w.linear(p + "mlp.up_proj.weight", ff, h)
            total += w.linear(p + "mlp.down_proj.weight", h, ff)
    total += w.norm("model.norm.weight", h)
    total += w.linear("lm_head.weight", a.vocab, h)
    write_safetensors(os.path.join(out, "model.safetensors"), w.out)

    config = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "dtype": "bfloat16",
        "head_dim": hd,
        "hidden_act": "silu",
        "hidden_size": h,
        "initializer_range": 0.02,
        "intermediate_size": a.top_k * a.expert_ff,
        "max_position_embeddings": 8192,
        "num_attention_heads": a.heads,
        "num_hidden_layers": L,
        "num_key_value_heads": a.kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": a.vocab,
    }
    if moe:
        config.update({
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": a.expert_ff,
            "norm_topk_prob": True,
            "num_experts": a.experts,
            "num_experts_per_tok": a.top_k,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        })
    else:
        config.update({"layer_types": ["full_attention"] * L, "max_window_layers": L})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0}, f, indent=2)
        f.write("\n")
    for name in TOKENIZER_FILES:
        src = os.path.join(TOKENIZER_DIR, name)
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(out, name))
    return total, total - inactive


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--expert-ff", type=int, default=512)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=448, help="the fixture tokenizer has 448 tokens")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if not 0 < a.top_k <= a.experts:
        sys.exit("moe_bench_models: need 0 < top-k <= experts")
    result = {"shape": {k: v for k, v in vars(a).items() if k != "out"}}
    for name, moe in (("moe", True), ("dense", False)):
        d = os.path.join(a.out, name)
        total, active = make(d, a, moe)
        result[name] = {"dir": d, "total_params": total, "active_params": active}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
