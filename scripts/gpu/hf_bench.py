#!/usr/bin/env python3
"""Hugging Face transformers' speed on a model directory, for comparison with
`tandem backend-bench` on the same model and GPU.

- Decode: for each batch size, `generate` (greedy, no stop token) on a batch of random prompts of
  --context tokens, once with 1 new token and once with --new-tokens; the difference is the
  decode steps alone: tokens/s = batch x (new_tokens - 1) / (t_new - t_1). Medians of --reps.
- Prefill: one forward pass over a --prefill-token prompt with the KV cache on and only the last
  position's logits, as a serving engine runs it; median of --reps after a warm-up.
- The device's peak: a --matmul-size cube bf16 matrix product (TFLOP/s, for the prefill bound of
  `tandem backend-bench --peak-tflops`) and a device-to-device copy (bytes copied per second).

Prints one JSON object (also written to --json). Runs on a CPU too with small flags:

    python3 scripts/gpu/hf_bench.py --model target/gpu-check/qwen3-shaped --json hf.json
    python3 scripts/gpu/hf_bench.py --model /tmp/q3small --device cpu --dtype float32 \\
        --batch 1,2 --context 32 --new-tokens 4 --prefill 64 --matmul-size 256 --copy-mib 16
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--batch", default="1,16,64,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--matmul-size", type=int, default=8192, help="0: skip the peak measurement")
    ap.add_argument("--copy-mib", type=int, default=1024, help="0: skip the copy measurement")
    ap.add_argument("--attn", default="sdpa", help="transformers attn_implementation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    return ap.parse_args()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, fn) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def matmul_tflops(device, n: int, dtype) -> float:
    gen = torch.Generator(device=device).manual_seed(1)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    for _ in range(3):
        a @ b
    iters = 10
    t = timed(device, lambda: [a @ b for _ in range(iters)])
    return 2 * n**3 * iters / t / 1e12


def copy_bandwidth(device, mib: int) -> float:
    n = mib << 20
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    iters = 20
    t = timed(device, lambda: [dst.copy_(src) for _ in range(iters)])
    return n * iters / t


def main() -> int:
    a = parse_args()
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    torch.backends.cuda.matmul.allow_tf32 = False
    result = {
        "engine": "transformers",
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "dtype": a.dtype,
        "model": str(a.model),
        "attn_implementation": a.attn,
        "context": a.context,
        "new_tokens": a.new_tokens,
    }
    if a.matmul_size > 0:
        result["matmul_size"] = a.matmul_size
        result["matmul_tflops"] = matmul_tflops(device, a.matmul_size, dtype)
    if a.copy_mib > 0:
        result["copy_bytes_per_s"] = copy_bandwidth(device, a.copy_mib)

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, attn_implementation=a.attn)
    model = model.to(device).eval()
    result["load_seconds"] = time.perf_counter() - t0
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(a.seed)

    def generate(ids, n):
        cfg = GenerationConfig(
            do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0
        )
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        assert out.shape[1] == ids.shape[1] + n, f"generated {out.shape[1] - ids.shape[1]} of {n} tokens"

    rows = []
    assert a.new_tokens >= 2, "--new-tokens must be at least 2"
    for b in [int(x) for x in a.batch.split(",") if x]:
        ids = torch.randint(0, vocab, (b, a.context), generator=gen).to(device)
        generate(ids, 2)  # warm-up
        one, full = [], []
        for _ in range(a.reps):
            one.append(timed(device, lambda: generate(ids, 1)))
            full.append(timed(device, lambda: generate(ids, a.new_tokens)))
        step = (statistics.median(full) - statistics.median(one)) / (a.new_tokens - 1)
        rows.append({"batch": b, "ms_per_step": step * 1e3, "tokens_per_s": b / step})
        print(f"transformers decode batch {b}: {b / step:.1f} tokens/s ({step * 1e3:.2f} ms/step)",
              file=sys.stderr, flush=True)
        del ids
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["decode"] = rows

    if a.prefill > 0:
        ids = torch.randint(0, vocab, (1, a.prefill), generator=gen).to(device)

        def prefill():
            with torch.no_grad():
                try:
                    model(input_ids=ids, use_cache=True, logits_to_keep=1)
                except TypeError:  # older transformers compute every position's logits
                    model(input_ids=ids, use_cache=True)

        prefill()
        times = [timed(device, prefill) for _ in range(max(a.reps, 3))]
        s = statistics.median(times)
        result["prefill"] = {"tokens": a.prefill, "seconds": s, "tokens_per_s": a.prefill / s}
    print(json.dumps(result))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
