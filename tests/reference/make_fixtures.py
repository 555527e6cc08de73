#!/usr/bin/env python3
"""Builds Tandem's reference-parity fixtures with Hugging Face transformers.

Outputs, all under tests/reference/fixtures/:
  <model>/            tiny random-weight models (config.json, safetensors, tokenizer files,
                      generation_config.json), plus reference.json (prompt ids, greedy ids, chat
                      rendering) and logits.f32 (all-position float32 logits, little endian);
                      --only tiny: Llama, Qwen, Mistral; --only gemma: Gemma 3 and Gemma 2;
                      --only phi3: Phi-3; --only moe: Qwen3-MoE and Mixtral
  smollm2-135m-instruct-q4_1.json
                      tokenizer cases, chat renderings and greedy continuations of the real
                      SmolLM2-135M-Instruct GGUF (skipped with a message when the file is absent)
  gguf-spm/           tokenizer-only SentencePiece GGUF files and their cases, ids and text from
                      llama.cpp itself (llamacpp_vocab.cpp, built by build-llamacpp-vocab.sh), chat
                      renderings of Gemma and Phi-3 templates from transformers
  gemma-3-270m-q4_k_m.json
                      llama.cpp's ids and text over the real Gemma 3 270M vocabulary (skipped with
                      a message when the file is absent)

Everything is seeded, so running it twice gives the same files (up to the library versions
listed in README.md). Run with the reference venv:

    ~/.venvs/tandem-ref/bin/python tests/reference/make_fixtures.py [--only tiny|gemma|phi3|moe|gguf-tok|smollm|gguf-spm]

The gguf-spm part needs no torch.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

try:
    import torch
except ImportError:  # the tokenizer-only part (gguf-spm) runs without it
    torch = None
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"
SMOLLM_GGUF = Path(
    os.environ.get(
        "TANDEM_SMOLLM_GGUF",
        "/root/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    )
)
# llama.cpp's vocabulary code as a program (llamacpp_vocab.cpp), the reference for SentencePiece
# GGUF ids and text: $TANDEM_LLAMACPP_VOCAB, else what build-llamacpp-vocab.sh builds (once).
LLAMACPP_VOCAB = os.environ.get("TANDEM_LLAMACPP_VOCAB")
GEMMA_GGUF = Path(
    os.environ.get(
        "TANDEM_GEMMA_GGUF",
        "/root/.cache/tandem/models/gemma-3-270m-q4_k_m.gguf",
    )
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 448

# ChatML, the format SmolLM2 and Qwen use. The BOS variant exercises the `bos_token` variable.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_BOS = "{{ bos_token }}" + CHATML

# Training text for the tiny tokenizer: plain English with some digits and punctuation.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A lazy dog sleeps in the warm sun while the fox runs.
Once upon a time there was a little town by the river. The people of the town were kind and
they liked to tell stories in the evening. Every story began the same way, and every story
ended with a song. The children listened, the old men smiled, and the river kept on flowing.
In the morning the baker opened his shop at 6 o'clock and sold 12 loaves of bread, 24 rolls
and 3 cakes. The price of a loaf was 2.50 and the price of a cake was 7.25. On Sundays the
shop was closed, so the baker walked along the river and counted the boats: one, two, three.
Language models read text as tokens. A tokenizer splits the text into pieces, and each piece
has a number. The model predicts the next piece, one at a time, until it reaches the end.
Questions and answers: What is the capital of France? Paris is the capital of France.
How many days are in a week? There are seven days in a week. Why is the sky blue? Because
light from the sun is scattered by the air, and blue light is scattered the most.
def add(a, b):
    return a + b
print(add(2, 3))
The weather today is sunny with a light wind from the west. Tomorrow it will rain.
She said: "I will be there at noon." He answered: "Then we will meet at the bridge."
"""

CHAT_MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me a story about the river."},
        {"role": "assistant", "content": "Once upon a time there was a little town."},
        {"role": "user", "content": "And then?"},
    ],
]


def seed_everything(seed: int) -> None:
    if torch is not None:
        torch.manual_seed(seed)
    np.random.seed(seed)


# --------------------------------------------------------------------------------------------
# Tiny tokenizer
# --------------------------------------------------------------------------------------------


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, out: Path, add_bos: bool) -> PreTrainedTokenizerFast:
    """Saves tokenizer.json + tokenizer_config.json into `out` and loads them back the way a user
    of the model would (AutoTokenizer), so the recorded ids are what transformers produces."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>" if add_bos else None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        add_bos_token=add_bos,
        chat_template=CHATML_BOS if add_bos else CHATML,
    )
    fast.save_pretrained(out)
    # Make the file self-describing whatever the library version writes by default.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["add_bos_token"] = add_bos
    cfg["add_eos_token"] = False
    cfg["chat_template"] = CHATML_BOS if add_bos else CHATML
    if add_bos:
        cfg["bos_token"] = "<|endoftext|>"
    cfg["eos_token"] = "<|im_end|>"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return AutoTokenizer.from_pretrained(out)


# --------------------------------------------------------------------------------------------
# Tiny models
# --------------------------------------------------------------------------------------------


def tiny_specs(vocab: int):
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    return [
        dict(
            name="llama-gqa",
            config=LlamaConfig(
                **common,
                intermediate_size=160,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                rope_theta=10000.0,
                tie_word_embeddings=False,
            ),
            dtype=torch.float32,
            shard=None,
            add_bos=True,
        ),
        dict(
            name="llama3-rope-scaled",
            config=LlamaConfig(
                **common,
                intermediate_size=176,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=32,
                rope_theta=10000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
                tie_word_embeddings=True,
            ),
            dtype=torch.bfloat16,
            shard="60KB",
            classic_rope_keys=True,
            add_bos=True,
        ),
        dict(
            name="qwen3",
            config=Qwen3Config(
                **common,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                rope_theta=1000000.0,
                tie_word_embeddings=True,
                attention_bias=False,
                use_sliding_window=False,
            ),
            dtype=torch.float16,
            shard=None,
            add_bos=False,
        ),
        dict(
            name="qwen2-mqa",
            config=Qwen2Config(
                **common,
                intermediate_size=144,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=1,
                rope_theta=1000000.0,
                tie_word_embeddings=False,
                use_sliding_window=False,
            ),
            dtype=torch.float32,
            shard=None,
            add_bos=False,
        ),
        dict(
            name="mistral",
            config=MistralConfig(
                **common,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                rope_theta=10000.0,
                sliding_window=None,
                tie_word_embeddings=False,
            ),
            dtype=torch.float32,
            shard=None,
            add_bos=False,
        ),
        dict(
            # A window much shorter than the long prompt, so positions outside it must be masked.
            name="mistral-sliding",
            config=MistralConfig(
                **common,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                rope_theta=10000.0,
                sliding_window=16,
                tie_word_embeddings=False,
            ),
            dtype=torch.float32,
            shard=None,
            add_bos=False,
        ),
    ]


# Gemma fixtures. Seeds continue at 100 so the models above keep theirs. Each `effects` entry
# switches one feature off in a copy of the config; build_models records how far the long
# prompt's logits move, so a test knows the fixture would catch an engine that ignored it.

# Gemma 2 ships 50.0; these random weights give attention scores of a few units, which a cap of 50
# barely bends (max logit change 0.012), so the fixture uses 10.0 (0.3).
ATTN_SOFTCAP = 10.0
FINAL_SOFTCAP = 30.0
GEMMA3_LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def _no_window(cfg):
    cfg.sliding_window = 4096


def _local_theta_as_global(cfg):
    cfg.rope_parameters["sliding_attention"]["rope_theta"] = cfg.rope_parameters["full_attention"]["rope_theta"]


def _scalar_is_head_dim(cfg):
    cfg.query_pre_attn_scalar = cfg.head_dim


def _no_global_rope_scaling(cfg):
    cfg.rope_parameters["full_attention"] = {
        "rope_type": "default",
        "rope_theta": cfg.rope_parameters["full_attention"]["rope_theta"],
    }


def _no_attn_softcap(cfg):
    cfg.attn_logit_softcapping = None


def _no_final_softcap(cfg):
    cfg.final_logit_softcapping = None


def gemma_specs(vocab: int):
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        hidden_activation="gelu_pytorch_tanh",
    )
    gemma3 = dict(
        **common,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=16,
        tie_word_embeddings=True,
    )
    gemma3_effects = {
        "sliding_window": _no_window,
        "rope_local_base_freq": _local_theta_as_global,
        "query_pre_attn_scalar": _scalar_is_head_dim,
    }
    return [
        dict(
            name="gemma3",
            seed=100,
            config=Gemma3TextConfig(
                **gemma3,
                layer_types=GEMMA3_LAYERS,
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                },
            ),
            dtype=torch.bfloat16,
            shard=None,
            add_bos=True,
            attn="eager",
            norm_base=-0.4,
            effects=gemma3_effects,
        ),
        dict(
            # Published Gemma 3 config.json files (4B and up) use this spelling: rope_theta for
            # the global layers, rope_local_base_freq for the sliding ones, sliding_window_pattern
            # (every pattern-th layer is global) and linear RoPE scaling on the global layers.
            name="gemma3-classic",
            seed=101,
            config=Gemma3TextConfig(
                **gemma3,
                layer_types=GEMMA3_LAYERS,
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                },
            ),
            dtype=torch.float32,
            shard=None,
            add_bos=True,
            attn="eager",
            norm_base=-0.4,
            classic_gemma3_keys=dict(sliding_window_pattern=3),
            effects=dict(gemma3_effects, rope_scaling=_no_global_rope_scaling),
        ),
        dict(
            name="gemma2",
            seed=102,
            config=Gemma2Config(
                **common,
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                query_pre_attn_scalar=32,
                sliding_window=16,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                attn_logit_softcapping=ATTN_SOFTCAP,
                final_logit_softcapping=FINAL_SOFTCAP,
                tie_word_embeddings=False,
            ),
            dtype=torch.float32,
            shard=None,
            add_bos=True,
            attn="eager",
            norm_base=-0.4,
            effects={
                "sliding_window": _no_window,
                "query_pre_attn_scalar": _scalar_is_head_dim,
                "attn_logit_softcapping": _no_attn_softcap,
                "final_logit_softcapping": _no_final_softcap,
            },
        ),
    ]


# Phi-3 (fused qkv_proj / gate_up_proj). Seeds from 200.

PHI3_SHORT_FACTOR = [round(1.0 + 0.05 * i, 4) for i in range(8)]
PHI3_LONG_FACTOR = [round(1.6**i, 4) for i in range(8)]


def _no_longrope(cfg):
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_parameters["rope_theta"],
                           "partial_rotary_factor": 1.0}


def phi3_specs(vocab: int):
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        sliding_window=None,
    )
    return [
        dict(
            name="phi3",
            seed=200,
            config=Phi3Config(
                **common,
                original_max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            ),
            dtype=torch.float32,
            shard=None,
            add_bos=False,
        ),
        dict(
            # LongRoPE as Phi-3/3.5 "128k" files spell it: per-dimension short and long factors,
            # `original_max_position_embeddings` 64 < max 512, so the attention factor is
            # sqrt(1 + ln(8) / ln(64)), and the long factors apply to sequences over 64 tokens.
            name="phi3-longrope",
            seed=201,
            config=Phi3Config(
                **common,
                original_max_position_embeddings=64,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "short_factor": PHI3_SHORT_FACTOR,
                    "long_factor": PHI3_LONG_FACTOR,
                },
            ),
            dtype=torch.bfloat16,
            shard=None,
            add_bos=False,
            classic_rope_keys="type",
            effects={"longrope": _no_longrope},
        ),
    ]


# Mixture-of-experts models. Seeds from 300. An expert choice flips when two router logits swap,
# so each seed was picked among ten for wide margins (router top-k gap and greedy top-2 gap,
# both recorded in reference.json).


def moe_specs(vocab: int):
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return [
        dict(
            # Layers 0 and 2 are sparse (8 experts, top 2, renormalized), layer 1 is dense.
            name="qwen3-moe",
            seed=302,
            config=Qwen3MoeConfig(
                **common,
                intermediate_size=128,
                moe_intermediate_size=32,
                num_experts=8,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[1],
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                use_sliding_window=False,
            ),
            dtype=torch.float32,
            shard=None,
            add_bos=False,
        ),
        dict(
            name="mixtral",
            seed=312,
            config=MixtralConfig(
                **common,
                intermediate_size=96,
                num_local_experts=4,
                num_experts_per_tok=2,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                sliding_window=None,
            ),
            dtype=torch.float32,
            shard=None,
            add_bos=False,
        ),
    ]


def randomize(model: torch.nn.Module, seed: int, norm_base: float = 0.6) -> None:
    """Weights at a scale where logits spread out: the default init (std 0.02, unit norms, zero
    biases) gives near-uniform logits whose argmax a rounding error can flip.

    Norm weights are uniform in [norm_base, norm_base + 0.8]. Gemma's RMSNorm multiplies by
    (1 + w), so Gemma models use norm_base -0.4: the same effective scale [0.6, 1.4] as the
    others, with stored weights around zero (an engine that forgets the 1 + is far off)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "norm" in name:
                p.copy_(norm_base + 0.8 * torch.rand(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "lm_head" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                # Small next to the layers' output, or a tied head mostly predicts its own input.
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.12 * torch.randn(p.shape, generator=gen))


def write_classic_rope_keys(path: Path, type_key: str = "rope_type") -> None:
    """Rewrites `rope_parameters` (what transformers 5 writes) as the `rope_theta` +
    `rope_scaling` pair that Llama 3.1's published config.json uses, so the fixtures cover both
    spellings. transformers reads either; the reload below checks that it reads this one.
    Phi-3's published files name the scaling type `type` rather than `rope_type`."""
    cfg = json.loads(path.read_text())
    rp = cfg.pop("rope_parameters", None)
    if rp is None:
        return
    rp = dict(rp)
    cfg["rope_theta"] = rp.pop("rope_theta")
    if rp.get("partial_rotary_factor") == 1.0:
        rp.pop("partial_rotary_factor")
    if "original_max_position_embeddings" in rp and rp["original_max_position_embeddings"] == cfg.get(
        "original_max_position_embeddings"
    ):
        rp.pop("original_max_position_embeddings")  # Phi-3 files have it at the top level only
    rp[type_key] = rp.pop("rope_type")
    cfg["rope_scaling"] = rp
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def write_classic_gemma3_keys(path: Path, sliding_window_pattern: int) -> None:
    """Rewrites a Gemma 3 config.json as published Gemma 3 checkpoints spell it: `rope_theta`
    (global layers), `rope_local_base_freq` (sliding layers), `rope_scaling` (global layers only,
    or null), `sliding_window_pattern` instead of `layer_types`, and `torch_dtype`. The caller
    reloads the file and checks that transformers reads back the layer types and RoPE settings
    the weights were made for."""
    cfg = json.loads(path.read_text())
    rp = cfg.pop("rope_parameters")
    layer_types = cfg.pop("layer_types")
    n = len(layer_types)
    want = [
        "sliding_attention" if (i + 1) % sliding_window_pattern else "full_attention" for i in range(n)
    ]
    assert layer_types == want, f"layer_types {layer_types} are not pattern {sliding_window_pattern}"
    local, glob = dict(rp["sliding_attention"]), dict(rp["full_attention"])
    assert local.pop("rope_type") == "default", local
    cfg["rope_local_base_freq"] = local.pop("rope_theta")
    assert not local, f"sliding layers' RoPE has settings the classic spelling cannot hold: {local}"
    cfg["rope_theta"] = glob.pop("rope_theta")
    cfg["rope_scaling"] = glob if glob.get("rope_type", "default") != "default" else None
    cfg["sliding_window_pattern"] = sliding_window_pattern
    cfg.pop("_sliding_window_pattern", None)  # a private attribute transformers 5 serializes
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def tiny_prompts(tokenizer, add_bos: bool):
    long_text = (
        "Once upon a time there was a little town by the river. The people of the town were kind "
        "and they liked to tell stories in the evening. Every story began the same way, and every "
        "story ended with a song. In the morning the baker opened his shop at 6 o'clock and sold "
        "12 loaves of bread. The children listened, the old men smiled, and the river kept on flowing."
    )
    prompts = [
        # A single position: BOS alone where the model adds one, otherwise one whole-word token.
        "" if add_bos else "The",
        "The quick brown fox",
        "What is the capital of France?",
        "def add(a, b):\n    return a + b\nprint(add(2, 3))",
        long_text,
    ]
    return prompts


def greedy_reference(model, ids: list[int], n_new: int) -> list[int]:
    """Greedy continuation via model.generate with no stop token, checked against a plain
    argmax loop over full forward passes."""
    input_ids = torch.tensor([ids], dtype=torch.long)
    gen_cfg = GenerationConfig(
        do_sample=False,
        max_new_tokens=n_new,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
    )
    with torch.no_grad():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=gen_cfg
        )
    new = out[0, len(ids):].tolist()
    assert len(new) == n_new, f"generation stopped early: {new}"
    seq = list(ids)
    min_gap = float("inf")
    with torch.no_grad():
        for step in range(n_new):
            logits = model(torch.tensor([seq])).logits[0, -1]
            nxt = int(torch.argmax(logits))
            assert nxt == new[step], f"generate and argmax loop disagree at step {step}"
            top2 = torch.topk(logits, 2).values
            min_gap = min(min_gap, float(top2[0] - top2[1]))
            seq.append(nxt)
    return new, min_gap


def feature_effects(model, ids: list[int], effects: dict, attn: str | None) -> dict:
    """For each named feature, the largest |change| of the logits over `ids` when the feature is
    switched off (the config mutated, the same weights loaded)."""
    with torch.no_grad():
        base = model(torch.tensor([ids])).logits[0]
    out = {}
    for label, mutate in effects.items():
        cfg = copy.deepcopy(model.config)
        mutate(cfg)
        kw = {"attn_implementation": attn} if attn else {}
        other = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **kw)
        other.load_state_dict(model.state_dict())
        other.eval()
        with torch.no_grad():
            logits = other(torch.tensor([ids])).logits[0]
        out[label] = round(float((logits - base).abs().max()), 4)
        del other
    return out


def build_tiny(tok: Tokenizer) -> None:
    build_models(tok, tiny_specs(tok.get_vocab_size(with_added_tokens=True)))


def build_gemma(tok: Tokenizer) -> None:
    build_models(tok, gemma_specs(tok.get_vocab_size(with_added_tokens=True)))


def build_phi3(tok: Tokenizer) -> None:
    build_models(tok, phi3_specs(tok.get_vocab_size(with_added_tokens=True)))


def build_moe(tok: Tokenizer) -> None:
    build_models(tok, moe_specs(tok.get_vocab_size(with_added_tokens=True)))


class RouterGaps:
    """Records, over every forward pass while active, the smallest gap between the k-th and
    (k+1)-th router logit of any token in any sparse layer: the margin by which an expert choice
    could flip under rounding."""

    def __init__(self, model):
        self.min_gap = float("inf")
        self.handles = []
        for mod in model.modules():
            if type(mod).__name__.endswith("TopKRouter"):
                self.handles.append(mod.register_forward_hook(self._hook))

    def _hook(self, mod, args, output):
        logits = output[0].detach().float()
        top = torch.topk(logits, mod.top_k + 1, dim=-1).values
        self.min_gap = min(self.min_gap, float((top[:, -2] - top[:, -1]).min()))

    def close(self):
        for h in self.handles:
            h.remove()


def build_models(tok: Tokenizer, specs: list[dict]) -> None:
    """Writes one fixture directory per spec. A spec's `seed` (default: its index in the list)
    seeds the library RNGs with 1000 + seed and the weights with 2000 + seed."""
    vocab = tok.get_vocab_size(with_added_tokens=True)
    summary = []
    for pos, spec in enumerate(specs):
        idx = spec.get("seed", pos)
        name = spec["name"]
        out = FIXTURES / name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        seed_everything(1000 + idx)

        hf_tok = save_tokenizer(tok, out, spec["add_bos"])
        cfg = spec["config"]
        attn_kw = {"attn_implementation": spec["attn"]} if spec.get("attn") else {}
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **attn_kw)
        randomize(model, 2000 + idx, spec.get("norm_base", 0.6))
        if cfg.tie_word_embeddings:
            model.tie_weights()
        model = model.to(spec["dtype"])
        model.generation_config = GenerationConfig(
            bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=0
        )
        kw = {"max_shard_size": spec["shard"]} if spec["shard"] else {}
        model.save_pretrained(out, safe_serialization=True, **kw)
        del model
        if spec.get("classic_rope_keys"):
            key = spec["classic_rope_keys"]
            write_classic_rope_keys(out / "config.json", key if isinstance(key, str) else "rope_type")
        if spec.get("classic_gemma3_keys"):
            write_classic_gemma3_keys(out / "config.json", **spec["classic_gemma3_keys"])

        # Reload exactly as the engine sees the files: stored dtype, upcast to f32.
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **attn_kw)
        model.eval()
        if spec.get("classic_rope_keys") == "type":
            # transformers keeps the `type` key next to the `rope_type` it derives from it.
            read = {k: v for k, v in model.config.rope_parameters.items() if k != "type"}
            assert read == cfg.rope_parameters, (read, cfg.rope_parameters)
        if spec.get("classic_gemma3_keys"):
            # The rewritten file must mean what the weights were made with.
            assert model.config.layer_types == cfg.layer_types, model.config.layer_types
            assert model.config.rope_parameters == cfg.rope_parameters, (
                model.config.rope_parameters, cfg.rope_parameters)

        records = []
        blobs = []
        offset = 0
        min_gap = float("inf")
        router = RouterGaps(model)
        for text in tiny_prompts(hf_tok, spec["add_bos"]):
            ids = hf_tok(text)["input_ids"]
            assert len(ids) >= 1, f"{name}: empty prompt for {text!r}"
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].to(torch.float32).numpy()
            greedy, gap = greedy_reference(model, ids, 16)
            min_gap = min(min_gap, gap)
            records.append(
                {
                    "text": text,
                    "prompt_ids": ids,
                    "logits_offset": offset,
                    "n_positions": len(ids),
                    "greedy_ids": greedy,
                    "greedy_text": hf_tok.decode(greedy),
                    "stopped_at_eos": False,
                    "greedy_min_top2_gap": gap,
                }
            )
            blobs.append(np.ascontiguousarray(logits, dtype="<f4").tobytes())
            offset += logits.size

        chats = []
        for messages in CHAT_MESSAGES:
            for agp in (True, False):
                rendered = hf_tok.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=agp
                )
                chats.append(
                    {
                        "messages": messages,
                        "add_generation_prompt": agp,
                        "rendered": rendered,
                        "ids": hf_tok(rendered, add_special_tokens=False)["input_ids"],
                    }
                )

        ref = {
            "model": name,
            "vocab_size": vocab,
            "torch_dtype_on_disk": str(spec["dtype"]).replace("torch.", ""),
            "add_bos": spec["add_bos"],
            "greedy_min_top2_gap": min_gap,
            "prompts": records,
            "chat": chats,
        }
        router.close()
        if router.handles:
            ref["router_min_topk_gap"] = router.min_gap
        if spec.get("attn"):
            ref["attn_implementation"] = spec["attn"]
        if spec.get("effects"):
            ref["feature_effects"] = feature_effects(
                model, records[-1]["prompt_ids"], spec["effects"], spec.get("attn")
            )
        (out / "reference.json").write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n")
        (out / "logits.f32").write_bytes(b"".join(blobs))
        size = sum(f.stat().st_size for f in out.iterdir())
        summary.append(f"{name}: {size / 1024:.0f} KiB, min top-2 logit gap on the greedy path {min_gap:.4f}")
        if ref.get("feature_effects"):
            summary[-1] += f", feature effects {ref['feature_effects']}"
        if "router_min_topk_gap" in ref:
            summary[-1] += f", min router top-k gap {ref['router_min_topk_gap']:.4f}"
        print(summary[-1], flush=True)


# --------------------------------------------------------------------------------------------
# Tokenizer-only GGUF files, one per pre-tokenizer type
# --------------------------------------------------------------------------------------------

GGUF_PRE_TYPES = ["gpt2", "smollm", "llama-bpe", "qwen2"]

SPLIT_CASES = [
    "12 loaves and 24 rolls cost 2.50 and 7.25",
    "1234567 and 1000000",
    "don't you'll I'M THEY'RE",
    "  two leading spaces",
    "trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nthree",
    "a\r\nwindows line",
    "punctuation!!! ... ??? (yes) [no] {maybe}",
    "  \n  mixed whitespace \t\n",
    "café 日本語 😀 Привет",
    "<|im_start|>user\nThe price was 12.<|im_end|>",
    "def add(a, b):\n    return a + b\n",
    "x=1;y=22;z=333",
    "",
]


def llamacpp_split_tokenizer(tok: Tokenizer, pre: str) -> Tokenizer:
    """The tiny tokenizer with the split llama.cpp applies for `tokenizer.ggml.pre = pre`.

    For "smollm" llama.cpp isolates every digit, then applies the GPT-2 regex (what SmolLM's own
    tokenizer.json does with `Digits(individual_digits=True)`); transformers' GGUF loader does not
    know this type and splits like GPT-2, so for this one type the ids here are the reference."""
    from tokenizers import Regex
    from transformers.integrations.gguf.gguf_tokenizer_mapping import _LLAMA3_SPLIT
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT

    t = Tokenizer.from_str(tok.to_str())
    t.post_processor = None
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    plain = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    split = lambda rx: pre_tokenizers.Split(Regex(rx), behavior="isolated")  # noqa: E731
    t.pre_tokenizer = {
        "gpt2": gpt2,
        "smollm": pre_tokenizers.Sequence([split(r"\p{N}"), gpt2]),
        "llama-bpe": pre_tokenizers.Sequence([split(_LLAMA3_SPLIT), plain]),
        "qwen2": pre_tokenizers.Sequence([split(QWEN2_SPLIT), plain]),
    }[pre]
    return t


def build_gguf_tokenizers(tok: Tokenizer) -> None:
    """Writes the tiny tokenizer as tokenizer-only GGUF files that differ only in
    `tokenizer.ggml.pre`, and records how transformers' GGUF loader encodes some texts with each,
    so the engine's GGUF tokenizer is checked for every pre-tokenizer it supports without the
    real model."""
    import gguf

    out = FIXTURES / "gguf-tokenizers"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    assert all(t is not None for t in tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    types = [
        gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens
    ]
    record = {}
    for pre in GGUF_PRE_TYPES:
        add_bos = pre == "llama-bpe"  # one file with BOS, as Llama 3 files have
        path = out / f"tiny-{pre}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_name(f"tiny-{pre}")
        w.add_context_length(512)
        w.add_embedding_length(64)
        w.add_block_count(1)
        w.add_feed_forward_length(128)
        w.add_head_count(4)
        w.add_head_count_kv(2)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(len(tokens))
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(0)
        w.add_eos_token_id(2)
        w.add_pad_token_id(0)
        w.add_add_bos_token(add_bos)
        w.add_chat_template(CHATML_BOS if add_bos else CHATML)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        hf = AutoTokenizer.from_pretrained(str(out), gguf_file=path.name)
        ref = llamacpp_split_tokenizer(tok, pre)
        cases = []
        for text in SPLIT_CASES:
            hf_ids = hf(text)["input_ids"]
            ids = ([0] if add_bos else []) + ref.encode(text, add_special_tokens=False).ids
            case = {"text": text, "ids": ids, "decoded": hf.decode(ids)}
            if hf_ids != ids:
                # transformers' GGUF loader has no split for this pre type and falls back to GPT-2's.
                assert pre == "smollm", f"{pre}: transformers {hf_ids} != llama.cpp split {ids}"
                case["transformers_gguf_ids"] = hf_ids
            cases.append(case)
        chats = []
        for messages in CHAT_MESSAGES:
            rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            chats.append({"messages": messages, "add_generation_prompt": True, "rendered": rendered})
        record[pre] = {
            "file": path.name,
            "add_bos": add_bos,
            "bos_token_id": hf.bos_token_id,
            "eos_token_id": hf.eos_token_id,
            "cases": cases,
            "chats": chats,
        }
        print(f"gguf tokenizer {pre}: {path.stat().st_size / 1024:.0f} KiB", flush=True)
    (out / "cases.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------------------------
# SmolLM2 (real GGUF)
# --------------------------------------------------------------------------------------------

TOKENIZER_CASES = [
    "Hello world",
    "Hello, world!",
    "hello",
    " Hello",
    "  Hello",
    "Hello ",
    "Hello  ",
    "",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "a\tb",
    "line one\nline two\n\nline four",
    "multiple   spaces   here",
    "trailing newline\n",
    "12345 3.14159",
    "1 22 333 4444 55555",
    "The year 2024 had 366 days.",
    "café résumé naïve façade",
    "Ünïcödé àccénts",
    "日本語のテキスト",
    "中文分词测试",
    "한국어 텍스트",
    "Привет, мир!",
    "emoji 😀👍🏽🎉",
    "👨‍👩‍👧‍👦 family",
    "def f(x):\n    return x ** 2  # square\n",
    "fn main() { println!(\"{}\", 1 + 2); }",
    "if (a && b || !c) { x->y[0] = {}; }",
    "<|im_start|>user\nHi<|im_end|>",
    "before <|im_start|> after",
    "text<|endoftext|>more",
    "<|im_end|>",
    "don't won't it's I'm we're they've you'll he'd",
    "DON'T SHOUT",
    "https://example.com/path?query=1&b=2",
    "email@example.com",
    "$100.00 + 50% = ?",
    "   leading and trailing   ",
    "CamelCaseIdentifier snake_case_identifier",
    "\u00a0non-breaking\u00a0space",
    "mixed 中文 and English 123",
]

SMOLLM_PROMPTS = [
    "The capital of France is",
    "Once upon a time,",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5,",
    "The quick brown fox",
    "Water boils at a temperature of",
]

SMOLLM_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ],
]


def build_smollm() -> None:
    out_path = FIXTURES / "smollm2-135m-instruct-q4_1.json"
    if not SMOLLM_GGUF.exists():
        print(f"skipping SmolLM2 fixtures: {SMOLLM_GGUF} not found", flush=True)
        return
    seed_everything(7)
    d, f = str(SMOLLM_GGUF.parent), SMOLLM_GGUF.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    eos = tok.eos_token_id

    cases = []
    for text in TOKENIZER_CASES:
        ids = tok(text)["input_ids"]
        cases.append(
            {
                "text": text,
                "ids": ids,
                "decoded": tok.decode(ids, skip_special_tokens=False),
                "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
            }
        )

    def greedy(ids):
        input_ids = torch.tensor([ids])
        gen_cfg = GenerationConfig(
            do_sample=False, max_new_tokens=32, eos_token_id=eos, pad_token_id=eos
        )
        with torch.no_grad():
            full = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), generation_config=gen_cfg
            )
            last = model(input_ids).logits[0, -1]
        new = full[0, len(ids):].tolist()
        stopped = bool(new) and new[-1] == eos
        top = torch.topk(last, 5)
        return new, stopped, [[int(i), float(v)] for v, i in zip(top.values, top.indices)]

    prompts = []
    for text in SMOLLM_PROMPTS:
        ids = tok(text)["input_ids"]
        new, stopped, top = greedy(ids)
        prompts.append(
            {
                "text": text,
                "prompt_ids": ids,
                "greedy_ids": new,
                "greedy_text": tok.decode(new, skip_special_tokens=False),
                "stopped_at_eos": stopped,
                "last_logits_top5": top,
            }
        )

    chats = []
    for messages in SMOLLM_CHATS:
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # apply_chat_template(tokenize=True) encodes without adding special tokens.
        ids = tok(rendered, add_special_tokens=False)["input_ids"]
        new, stopped, top = greedy(ids)
        chats.append(
            {
                "messages": messages,
                "add_generation_prompt": True,
                "rendered": rendered,
                "prompt_ids": ids,
                "greedy_ids": new,
                "greedy_text": tok.decode(new, skip_special_tokens=False),
                "stopped_at_eos": stopped,
                "last_logits_top5": top,
            }
        )

    ref = {
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "note": (
            "Reference from transformers' GGUF loader (weights dequantized to float32). The GGUF "
            "says tokenizer.ggml.add_bos_token = false, and transformers follows it: no BOS is "
            "prepended by encode(add_special_tokens=True). transformers reports bos_token = "
            f"{tok.bos_token!r} (id {tok.bos_token_id}) and eos_token = {tok.eos_token!r} "
            f"(id {tok.eos_token_id}). The GGUF pre-tokenizer type is 'smollm': digits are split "
            "one by one, then the GPT-2 regex applies."
        ),
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "add_bos_token": bool(getattr(tok, "add_bos_token", False)),
        "tokenizer_cases": cases,
        "prompts": prompts,
        "chats": chats,
    }
    out_path.write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out_path}", flush=True)


# --------------------------------------------------------------------------------------------
# SentencePiece GGUF vocabularies (tokenizer.ggml.model = "llama")
# --------------------------------------------------------------------------------------------

SPM_VOCAB_SIZE = 512

# Chat templates equivalent to the models' own (Gemma 3 as published; the same with the Python
# method spelling `.strip()`; Gemma 2, which refuses a system message; Phi-3 mini, June 2024 and
# April 2024). model/tests/tokenizer_spm.rs holds the same strings and checks they match.
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""
GEMMA3_STRIP_TEMPLATE = GEMMA3_TEMPLATE.replace(
    "{{ message['content'] | trim }}", "{{ message['content'].strip() }}"
)
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
PHI3_APRIL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') %}"
    "{{'<|user|>' + '\\n' + message['content'] + '<|end|>' + '\\n' + '<|assistant|>' + '\\n'}}"
    "{% elif (message['role'] == 'assistant') %}{{message['content'] + '<|end|>' + '\\n'}}{% endif %}{% endfor %}"
)

SPM_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "  Tell me a story about the river.\n"},
        {"role": "assistant", "content": "Once upon a time there was a little town. "},
        {"role": "user", "content": "And then? café 😀"},
    ],
    [
        {"role": "user", "content": "\x1c\t\u3000padded with odd whitespace\x0b\x0c\r\n\u00a0\x85\x1f"},
        {"role": "assistant", "content": "ok"},
    ],
    [{"role": "assistant", "content": "I start."}],
]

# Each vocabulary: how its SentencePiece model is trained and what its GGUF file says.
SPM_VOCABS = {
    # Llama 2 / Mistral layout, Phi-3's chat tokens. general.name contains "phi-3", so llama.cpp
    # strips whitespace after special tokens (it needs <|endoftext|> in the vocabulary for that);
    # add_space_prefix absent (true); add_bos absent (true).
    "phi3": dict(
        file="tiny-spm-phi3.gguf",
        name="tiny-phi-3-spm",
        train=dict(
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=True,
            control_symbols=["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"],
            user_defined_symbols=["<sep>"],
        ),
        add_space_prefix=None,
        add_bos=None,
        add_eos=None,
        score_step=None,
        templates={"phi3": PHI3_TEMPLATE, "phi3-april": PHI3_APRIL_TEMPLATE},
    ),
    # Gemma layout: <pad> 0, <eos> 1, <bos> 2, <unk> 3, turn markers, no space prefix.
    "gemma": dict(
        file="tiny-spm-gemma.gguf",
        name="tiny-gemma-spm",
        train=dict(
            pad_id=0, eos_id=1, bos_id=2, unk_id=3, add_dummy_prefix=False,
            pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
            control_symbols=["<start_of_turn>", "<end_of_turn>"],
            user_defined_symbols=["<sep>"],
        ),
        add_space_prefix=False,
        add_bos=True,
        add_eos=None,
        score_step=None,
        templates={"gemma3": GEMMA3_TEMPLATE, "gemma3-strip": GEMMA3_STRIP_TEMPLATE, "gemma2": GEMMA2_TEMPLATE},
    ),
    # The phi3 vocabulary under another name (no whitespace stripping), add_space_prefix written
    # as true, EOS appended, and scores rounded down to multiples of 64 so that many candidate
    # merges tie: llama.cpp then merges the leftmost pair, where SentencePiece's order differs.
    "ties": dict(
        file="tiny-spm-ties.gguf",
        name="tiny-spm-ties",
        train=None,  # the phi3 model's
        add_space_prefix=True,
        add_bos=None,
        add_eos=True,
        score_step=64.0,
        templates={},
    ),
}

SPM_CASES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "   three leading spaces",
    "trailing space ",
    "multiple   inner    spaces  ",
    "line one\nline two\n\n\nthree\n",
    "\n",
    " ",
    "tabs\tand\r\nwindows",
    "12 loaves cost 2.50 and 1234567",
    "café au lait",
    "日本語",
    "emoji 😀 and 👍🏽",
    "Привет, мир",
    "<|user|>\nWhat is the capital of France?<|end|>\n<|assistant|>\n",
    "<|system|> x <|end|>  \n y",
    "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n",
    "a<sep>b <sep> c",
    "<s>Hello</s>",
    "<bos>text<eos>",
    "<unk> and <pad>",
    "<0x41> is not a byte",
    "▁ is a lower one eighth block",
    "",
    CORPUS[:700],
]


def llamacpp_vocab() -> str:
    """The path of the llamacpp_vocab program, built by build-llamacpp-vocab.sh when not given."""
    global LLAMACPP_VOCAB
    if LLAMACPP_VOCAB is None:
        script = HERE / "build-llamacpp-vocab.sh"
        built = subprocess.run([str(script)], check=True, stdout=subprocess.PIPE, text=True)
        LLAMACPP_VOCAB = built.stdout.strip()
    return LLAMACPP_VOCAB


class LlamaCppVocab:
    """llama.cpp's vocabulary code over one GGUF file, through the llamacpp_vocab program."""

    def __init__(self, path: Path):
        self.proc = subprocess.Popen(
            [llamacpp_vocab(), str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        info = self._line().split()
        assert info[0] == "info", info
        self.n_vocab, self.bos, self.eos = int(info[1]), int(info[2]), int(info[3])
        self.add_bos, self.add_eos = info[4] == "1", info[5] == "1"
        eog = self._line().split()
        assert eog[0] == "eog", eog
        self.eog = [int(x) for x in eog[1:]]

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        assert line, "llamacpp_vocab ended early"
        return line.rstrip("\n")

    def _ask(self, request: str) -> list[str]:
        self.proc.stdin.write(request + "\n")
        self.proc.stdin.flush()
        return self._line().split(" ")

    @staticmethod
    def _hex(text: str) -> str:
        return text.encode().hex() or "-"

    @staticmethod
    def _text(h: str) -> str:
        return "" if h == "-" else bytes.fromhex(h).decode("utf-8", errors="replace")

    def encode(self, text: str, add_special: bool) -> list[int]:
        out = self._ask(("E " if add_special else "N ") + self._hex(text))
        assert out[0] == "ids", out
        return [int(x) for x in out[1:] if x]

    def decode(self, ids: list[int]) -> tuple[str, str]:
        """(special tokens shown, special tokens removed)"""
        out = self._ask("D " + " ".join(map(str, ids)))
        assert out[0] == "dec", out
        return self._text(out[1]), self._text(out[2])

    def piece(self, id: int) -> str:
        out = self._ask(f"P {id}")
        assert out[0] == "piece", out
        return self._text(out[1])

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait() == 0


def train_spm(train: dict):
    """A SentencePiece BPE model trained on CORPUS: identity normalization and no whitespace
    collapsing (as Llama's and Gemma's models), byte fallback, digits split."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines()),
        model_writer=model,
        model_type="bpe",
        vocab_size=SPM_VOCAB_SIZE,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        num_threads=1,
        minloglevel=2,
        **train,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def write_spm_gguf(path: Path, sp, v: dict, template: str | None) -> list[str]:
    """Writes `sp` as a tokenizer-only GGUF the way llama.cpp's converter lays out a SentencePiece
    vocabulary (pieces, scores, token types); returns the token list."""
    import gguf

    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        score = sp.get_score(i)
        if v["score_step"]:
            score = float(np.floor(score / v["score_step"]) * v["score_step"])
        scores.append(score)
        if sp.is_unknown(i):
            types.append(gguf.TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(gguf.TokenType.CONTROL)
        elif sp.is_byte(i):
            types.append(gguf.TokenType.BYTE)
        elif sp.is_unused(i):
            types.append(gguf.TokenType.UNUSED)
        elif tokens[-1] in v["train"]["user_defined_symbols"]:
            types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(v["name"])
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    if sp.pad_id() >= 0:
        w.add_pad_token_id(sp.pad_id())
    if v["add_bos"] is not None:
        w.add_add_bos_token(v["add_bos"])
    if v["add_eos"] is not None:
        w.add_add_eos_token(v["add_eos"])
    if v["add_space_prefix"] is not None:
        w.add_add_space_prefix(v["add_space_prefix"])
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


def chat_renderer(bos: str, eos: str) -> PreTrainedTokenizerFast:
    """A transformers tokenizer whose only use is apply_chat_template with the given BOS and EOS
    texts (transformers' GGUF loader needs torch; rendering does not need the vocabulary)."""
    vocab = {"<unk>": 0, bos: 1, eos: 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token="<unk>")


def spm_reference(path: Path, tokens: list[str], v: dict, sp) -> dict:
    """llama.cpp's ids and text for SPM_CASES over one file, cross-checked against SentencePiece
    itself where the two must agree; chat renderings by transformers' apply_chat_template."""
    import jinja2

    ref = LlamaCppVocab(path)
    hf = chat_renderer(tokens[ref.bos], tokens[ref.eos])
    control = [t for t, kind in zip(tokens, v["types"]) if kind != 1 and not t.startswith("<0x")]
    cases = []
    for text in SPM_CASES:
        ids = ref.encode(text, add_special=True)
        shown, removed = ref.decode(ids)
        case = {"text": text, "ids": ids, "decoded": shown, "decoded_skip_special": removed}
        body = ids[1:] if ref.add_bos else ids
        body = body[:-1] if ref.add_eos else body
        if not any(t in text for t in control):
            # SentencePiece's own encoder merges the same way on text without special tokens,
            # unless scores tie.
            if v["score_step"] is None:
                assert sp.encode(text) == body, f"{path.name} {text!r}: sentencepiece {sp.encode(text)} != {body}"
            elif sp.encode(text) != body:
                case["sentencepiece_ids"] = sp.encode(text)
        cases.append(case)
    # Prefixes of the longest byte-fallback case, cut inside characters, to check partial bytes.
    emoji = next(c for c in cases if c["text"].startswith("emoji"))["ids"]
    partial = []
    for n in range(1, len(emoji) + 1):
        shown, removed = ref.decode(emoji[:n])
        partial.append({"ids": emoji[:n], "decoded": shown, "decoded_skip_special": removed})
    pieces = {str(i): ref.piece(i) for i in sorted({i for c in cases for i in c["ids"]})}
    chats = []
    for name, template in v["templates"].items():
        for messages in SPM_CHATS:
            for gen in (True, False):
                chat = {"template": name, "messages": messages, "add_generation_prompt": gen}
                try:
                    rendered = hf.apply_chat_template(
                        messages, chat_template=template, tokenize=False, add_generation_prompt=gen
                    )
                except jinja2.exceptions.TemplateError as e:  # raise_exception in the template
                    chat["error"] = str(e)
                else:
                    chat["rendered"] = rendered
                    chat["ids"] = ref.encode(rendered, add_special=False)
                chats.append(chat)
    out = {
        "file": path.name,
        "vocab_size": ref.n_vocab,
        "bos_token_id": ref.bos,
        "eos_token_id": ref.eos,
        "add_bos": ref.add_bos,
        "add_eos": ref.add_eos,
        "eog_ids": ref.eog,
        "cases": cases,
        "partial": partial,
        "pieces": pieces,
        "templates": v["templates"],
        "chats": chats,
    }
    ref.close()
    return out


def build_gguf_spm() -> None:
    """Writes tokenizer-only SentencePiece GGUF files (SPM_VOCABS) and records llama.cpp's ids and
    text for SPM_CASES, with chat renderings of the Gemma and Phi-3 templates by transformers."""
    import gguf

    if not Path(llamacpp_vocab()).exists():
        sys.exit(f"gguf-spm needs llama.cpp's vocabulary program, not found at {llamacpp_vocab()}")
    out = FIXTURES / "gguf-spm"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    models = {}
    record = {}
    for key, v in SPM_VOCABS.items():
        if v["train"] is None:
            v = dict(v, train=SPM_VOCABS["phi3"]["train"])
            sp = models["phi3"]
        else:
            sp = models[key] = train_spm(v["train"])
        path = out / v["file"]
        template = next(iter(v["templates"].values()), None)
        tokens = write_spm_gguf(path, sp, v, template)
        reader = gguf.GGUFReader(str(path))
        field = reader.fields["tokenizer.ggml.token_type"]
        v = dict(v, types=[int(field.parts[i][0]) for i in field.data])
        record[key] = spm_reference(path, tokens, v, sp)
        print(f"gguf spm {key}: {path.stat().st_size / 1024:.0f} KiB, {len(tokens)} tokens", flush=True)
    (out / "cases.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    if GEMMA_GGUF.exists():
        gemma = FIXTURES / "gemma-3-270m-q4_k_m.json"
        gemma.write_text(json.dumps(gemma_reference(), indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {gemma}", flush=True)
    else:
        print(f"skipping Gemma 3 cases: {GEMMA_GGUF} not found", flush=True)


def gemma_reference() -> dict:
    """llama.cpp's ids and text for SPM_CASES over the real Gemma 3 270M vocabulary, and for the
    Gemma 3 template's renderings of SPM_CHATS (the file carries no template of its own)."""
    import jinja2

    ref = LlamaCppVocab(GEMMA_GGUF)
    cases = []
    for text in SPM_CASES + [CORPUS]:
        ids = ref.encode(text, add_special=True)
        shown, removed = ref.decode(ids)
        cases.append({"text": text, "ids": ids, "decoded": shown, "decoded_skip_special": removed})
    hf = chat_renderer(ref.piece(ref.bos), ref.piece(ref.eos))
    chats = []
    for messages in SPM_CHATS:
        try:
            rendered = hf.apply_chat_template(
                messages, chat_template=GEMMA3_TEMPLATE, tokenize=False, add_generation_prompt=True
            )
        except jinja2.exceptions.TemplateError:
            continue
        chats.append({"messages": messages, "rendered": rendered, "ids": ref.encode(rendered, add_special=False)})
    out = {
        "file": GEMMA_GGUF.name,
        "vocab_size": ref.n_vocab,
        "bos_token_id": ref.bos,
        "eos_token_id": ref.eos,
        "add_bos": ref.add_bos,
        "eog_ids": ref.eog,
        "cases": cases,
        "chats": chats,
    }
    ref.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["tiny", "gemma", "phi3", "moe", "gguf-tok", "smollm", "gguf-spm"], default=None)
    args = ap.parse_args()
    if torch is not None:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    FIXTURES.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "tiny"):
        seed_everything(0)
        build_tiny(train_tokenizer())
    if args.only in (None, "gemma"):
        seed_everything(0)
        build_gemma(train_tokenizer())
    if args.only in (None, "phi3"):
        seed_everything(0)
        build_phi3(train_tokenizer())
    if args.only in (None, "moe"):
        seed_everything(0)
        build_moe(train_tokenizer())
    if args.only in (None, "gguf-tok"):
        seed_everything(0)
        build_gguf_tokenizers(train_tokenizer())
    if args.only in (None, "smollm"):
        build_smollm()
    if args.only in (None, "gguf-spm"):
        build_gguf_spm()
    return 0


if __name__ == "__main__":
    sys.exit(main())
