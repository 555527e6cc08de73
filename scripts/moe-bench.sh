#!/usr/bin/env bash
# What a token costs in a mixture-of-experts model next to a dense model with the same active
# parameters, on Tandem's CPU engine, measured in the same run.
#
# Usage: scripts/moe-bench.sh     (THREADS, PROMPT_TOKENS, DECODE_TOKENS, REPS, BATCH as env;
#                                  PYTHON: an interpreter with numpy)
# Writes two random-weight Hugging Face models into a temporary directory
# (scripts/moe_bench_models.py, seeded, so every run measures the same weights): a Qwen3-MoE with
# 16 experts of 512 per layer, 2 per token, and a dense Qwen3 whose MLP is 2 x 512 = 1024 wide;
# both hidden 1024, 8 layers, 16 heads / 4 KV heads of 64, vocab 448, bf16 on disk. Runs
# on each, with THREADS (default 2) threads and --activations f32:
# - `tandem bench --batch BATCH` (PROMPT_TOKENS, DECODE_TOKENS, REPS): prompt and single-stream
#   decode tokens/s, then BATCH (default 16) sequences decoded together. Those sequences share one
#   prompt, so they generate the same tokens and route every token to the same experts: the best
#   case for a mixture ("batch same").
# - `tandem bench --workload unfriendly --requests BATCH --concurrency BATCH` (DECODE_TOKENS, one
#   run): BATCH different prompts through the scheduler, decoded together; their tokens spread over
#   the experts ("batch distinct": tokens of decode-only steps over those steps' time).
# Prints total and active parameters per token, those tokens/s for each model, and each MoE/dense
# ratio.
set -euo pipefail
cd "$(dirname "$0")/.."

threads="${THREADS:-2}"
prompt_tokens="${PROMPT_TOKENS:-128}"
decode_tokens="${DECODE_TOKENS:-64}"
reps="${REPS:-3}"
batch="${BATCH:-16}"

python="${PYTHON:-python3}"
if ! "$python" -c 'import numpy' 2>/dev/null; then
  python="$HOME/.venvs/tandem-ref/bin/python" # tests/reference/README.md's environment
  "$python" -c 'import numpy' 2>/dev/null \
    || { echo "moe-bench: needs python3 with numpy (set PYTHON)" >&2; exit 1; }
fi

cargo build --release -q -p tandem-cli

dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
models="$("$python" scripts/moe_bench_models.py "$dir")"

# Room in the KV pool for the batched sequences (16-token blocks).
per_seq=$(( (prompt_tokens + decode_tokens + 15) / 16 ))
kv_blocks=$(( (batch + 1) * per_seq > 512 ? (batch + 1) * per_seq : 512 ))
tandem() { # model dir
  ./target/release/tandem bench --model "$1" --threads "$threads" --activations f32 \
    --prompt-tokens "$prompt_tokens" --decode-tokens "$decode_tokens" --reps "$reps" \
    --batch "$batch" --kv-blocks "$kv_blocks" --json
}
spread() { # model dir
  ./target/release/tandem bench --model "$1" --threads "$threads" --activations f32 \
    --workload unfriendly --requests "$batch" --concurrency "$batch" --decode-tokens "$decode_tokens" \
    --kv-blocks "$kv_blocks" --json
}
moe="$(tandem "$dir/moe")"
dense="$(tandem "$dir/dense")"
moe_spread="$(spread "$dir/moe")"
dense_spread="$(spread "$dir/dense")"

"$python" - "$models" "$moe" "$dense" "$moe_spread" "$dense_spread" <<'PY'
import json, sys
models, moe, dense, moe_spread, dense_spread = (json.loads(a) for a in sys.argv[1:])
for r, w in ((moe, moe_spread), (dense, dense_spread)):
    r["spread_tps"] = w["baseline"]["decode_tokens_per_s"]
    r["spread_tokens"] = w["baseline"]["output_tokens"]
s = models["shape"]
print(f"shape: hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads / {s['kv_heads']} KV of "
      f"{s['head_dim']}, vocab {s['vocab']}; MoE {s['experts']} experts of {s['expert_ff']}, top {s['top_k']}; "
      f"dense ff {s['top_k'] * s['expert_ff']}")
print(f"threads {moe['threads']}, activations {moe['activations']}, prompt {moe['prompt_tokens']} tokens, "
      f"decode {moe['decode_tokens']} tokens; batch: {moe['batch']} sequences, one prompt (same) or "
      f"{moe['batch']} prompts of the unfriendly workload (distinct)")
print(f"{'model':<10}{'params':>9}{'active':>9}{'prompt t/s':>12}{'decode t/s':>12}"
      f"{'batch same':>12}{'batch distinct':>16}")
for name, r in (("moe", moe), ("dense", dense)):
    m = models[name]
    print(f"{name:<10}{m['total_params'] / 1e6:8.1f}M{m['active_params'] / 1e6:8.1f}M"
          f"{r['prompt_tps']:12.1f}{r['decode_tps']:12.1f}{r['batched_decode_tps']:12.1f}{r['spread_tps']:16.1f}")
ratio = lambda k: moe[k] / dense[k]
print(f"{'moe/dense':<10}{models['moe']['total_params'] / models['dense']['total_params']:9.2f}"
      f"{models['moe']['active_params'] / models['dense']['active_params']:9.2f}"
      f"{ratio('prompt_tps'):12.2f}{ratio('decode_tps'):12.2f}{ratio('batched_decode_tps'):12.2f}"
      f"{ratio('spread_tps'):16.2f}")
want = moe["batch"] * moe["decode_tokens"]
print(f"distinct: tokens generated {moe['spread_tokens']} (moe), {dense['spread_tokens']} (dense) of {want} "
      "(fewer when a sequence ends at its end-of-sequence token); t/s counts decode-only steps")
PY
