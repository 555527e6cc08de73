#!/usr/bin/env python3
"""Builds a random-weight model shaped like Qwen3-0.6B and records transformers' logits for it.

The model is what Tandem's GPU parity check and benchmarks run on where no real checkpoint can
be downloaded: Qwen3ForCausalLM with hidden 1024, 28 layers, 16 query / 8 KV heads of 128, MLP
3072, vocabulary 151936, tied embeddings, rope_theta 1e6, 40960 positions (every shape a flag, so
a much smaller one runs on a CPU in seconds). Weights are seeded random values at scales that keep
every layer's output near unit size, saved as bf16 safetensors with config.json. The engine's
loader also wants a tokenizer: the tiny fixture tokenizer is copied in (its 448 tokens are a
subset of the ids; the checks feed token ids, never text).

Reference outputs, in the format of tests/reference/fixtures (see tests/reference/README.md):

  reference.json   prompts (random token ids of several lengths), their greedy continuations
                   from transformers in bf16, and where each prompt's logits start
  logits-bf16.f32  transformers in bf16 (the saved weights, bf16 activations) on --device
  logits.f32       transformers in float32 from the same bf16 weights (TF32 off): the exact
                   function a bf16-weight engine approximates

For each prompt the logits cover every position of prompt_ids + greedy_ids[:-1], so a
teacher-forced run of those ids checks both the prompt's logits and the greedy continuation.

    python3 scripts/gpu/make_qwen3_shaped.py --out target/gpu-check/qwen3-shaped
    python3 scripts/gpu/make_qwen3_shaped.py --device cpu --hidden 64 --layers 2 --heads 4 \\
        --kv-heads 2 --head-dim 16 --ffn 128 --vocab 448 --out /tmp/q3small
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_FROM = REPO / "tests/reference/fixtures/qwen3"
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="model directory to write")
    ap.add_argument("--device", default="cuda", help="torch device for the reference (default cuda)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--max-pos", type=int, default=40960)
    ap.add_argument("--rope-theta", type=float, default=1e6)
    ap.add_argument("--prompt-lens", default="1,17,64,190", help="comma-separated prompt lengths")
    ap.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per prompt")
    ap.add_argument("--seed", type=int, default=20240604)
    return ap.parse_args()


def randomize(model: torch.nn.Module, seed: int, hidden: int) -> None:
    """Seeded weights: norms uniform in [0.6, 1.4]; each projection with std 1/sqrt(fan_in), so its
    output has about the size of its (normalized) input; embeddings (also the tied output head)
    with std 4/sqrt(hidden), so logits have a standard deviation of about 4."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "norm" in name:
                v = 0.6 + 0.8 * torch.rand(p.shape, generator=gen)
            elif "embed_tokens" in name or "lm_head" in name:
                v = (4.0 / hidden**0.5) * torch.randn(p.shape, generator=gen)
            else:
                v = torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
            p.copy_(v.to(p.dtype))


def make_config(a) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.ffn,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        max_position_embeddings=a.max_pos,
        rope_theta=a.rope_theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=False,
        use_sliding_window=False,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )


def greedy(model, ids: list[int], n_new: int, device: str) -> tuple[list[int], float]:
    """Greedy continuation with generate() (no stop token), and the smallest top-2 logit gap
    along it, from a plain forward pass over the whole sequence."""
    x = torch.tensor([ids], device=device)
    cfg = GenerationConfig(
        do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
    new = out[0, len(ids):].tolist()
    assert len(new) == n_new, f"generation stopped after {len(new)} tokens"
    with torch.no_grad():
        logits = model(out[:, :-1]).logits[0, len(ids) - 1:].float()
    top2 = torch.topk(logits, 2, dim=-1).values
    return new, float((top2[:, 0] - top2[:, 1]).min())


def all_logits(model, ids: list[int], device: str) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids], device=device)).logits[0].float().cpu().numpy()


def main() -> int:
    a = parse_args()
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out: Path = a.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    cfg = make_config(a)
    torch.manual_seed(a.seed)
    with torch.device(a.device):
        model = Qwen3ForCausalLM(cfg)
    randomize(model, a.seed, a.hidden)
    model.tie_weights()
    model = model.to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(out, safe_serialization=True)
    for f in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_FROM / f, out / f)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.1f}M parameters, saved to {out} ({time.time() - t0:.1f} s)", flush=True)
    del model

    def load(dtype):
        # As a user loads the files (RoPE frequencies stay float32, whatever the weights' dtype).
        return AutoModelForCausalLM.from_pretrained(out, dtype=dtype).to(a.device).eval()

    rng = np.random.default_rng(a.seed)
    lens = [int(x) for x in a.prompt_lens.split(",") if x]
    prompts = [rng.integers(0, a.vocab, size=n).tolist() for n in lens]

    # bf16, as transformers is usually run; the greedy continuations come from it.
    model = load(torch.bfloat16)
    records, bf16_blocks, offset = [], [], 0
    for ids in prompts:
        new, gap = greedy(model, ids, a.new_tokens, a.device)
        full = ids + new[:-1]
        bf16_blocks.append(all_logits(model, full, a.device))
        records.append(
            {
                "prompt_ids": ids,
                "greedy_ids": new,
                "logits_offset": offset,
                "n_positions": len(full),
                "stopped_at_eos": False,
                "greedy_min_top2_gap": gap,
            }
        )
        offset += len(full) * a.vocab

    # float32 compute from the same (bf16-rounded) weights.
    del model
    model = load(torch.float32)
    f32_blocks = [all_logits(model, r["prompt_ids"] + r["greedy_ids"][:-1], a.device) for r in records]

    np.concatenate([b.reshape(-1) for b in bf16_blocks]).astype("<f4").tofile(out / "logits-bf16.f32")
    np.concatenate([b.reshape(-1) for b in f32_blocks]).astype("<f4").tofile(out / "logits.f32")
    diff = [np.linalg.norm(b - f) / np.linalg.norm(f) for b, f in zip(bf16_blocks, f32_blocks)]
    agree = np.mean(
        np.concatenate([b.argmax(-1) == f.argmax(-1) for b, f in zip(bf16_blocks, f32_blocks)])
    )
    ref = {
        "model": "qwen3-shaped",
        "vocab_size": a.vocab,
        "torch_dtype_on_disk": "bfloat16",
        "device": str(torch.device(a.device)) + (f" ({torch.cuda.get_device_name()})" if a.device.startswith("cuda") else ""),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "seed": a.seed,
        "reference_logits": {"bfloat16": "logits-bf16.f32", "float32": "logits.f32"},
        "note": (
            "logits cover prompt_ids + greedy_ids[:-1]; greedy_ids come from the bf16 model. "
            f"transformers bf16 vs float32: relative error {max(diff):.2e} (worst prompt), "
            f"argmax agreement {100 * agree:.2f}%"
        ),
        "prompts": records,
    }
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    print(
        f"reference: {len(records)} prompts, {offset // a.vocab} positions; transformers bf16 vs f32: "
        f"rel. error {max(diff):.2e}, argmax {100 * agree:.2f}% ({time.time() - t0:.1f} s)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
