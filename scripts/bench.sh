#!/usr/bin/env bash
# Tandem's CPU engine next to llama.cpp on the same GGUF file, measured in the same run.
#
# Usage: scripts/bench.sh [MODEL.gguf ...]     (THREADS, PROMPT_TOKENS, DECODE_TOKENS, REPS, BATCH as env)
# For each model (default: SmolLM2-135M-Instruct Q4_1, then Gemma 3 270M Q4_K_M, fetched by
# scripts/fetch-model.sh and scripts/fetch-gemma.sh) and for THREADS (default 2) and 1 thread,
# prints prompt and decode tokens/s of llama.cpp and of Tandem in its default mode (16-bit
# activations) and with --activations f32 (the exact path), with each ratio to llama.cpp; then
# Tandem's decode of BATCH (default 16) sequences stepped together next to its single stream.
# Then, unless LONG=0 (SHORT=0 runs only this), a long-context table at THREADS threads: prompts of LONG_LENGTHS tokens
# (default 512 1024 2048 4096 8192), with Tandem's share of each prompt's time spent in attention,
# and decode after LONG_DEPTH (default 4096) tokens, each next to llama.cpp (one repetition each:
# the long prompts take minutes).
set -euo pipefail
cd "$(dirname "$0")/.."

threads="${THREADS:-2}"
prompt_tokens="${PROMPT_TOKENS:-128}"
decode_tokens="${DECODE_TOKENS:-64}"
reps="${REPS:-3}"
batch="${BATCH:-16}"
models=("$@")
if ((${#models[@]} == 0)); then
  dir="${TANDEM_MODEL_DIR:-$HOME/.cache/tandem/models}"
  scripts/fetch-model.sh >&2 && scripts/fetch-gemma.sh >&2 ||
    { echo "bench: could not fetch the default models" >&2; exit 1; }
  models=("$dir/SmolLM2-135M-Instruct.Q4_1.gguf" "$dir/gemma-3-270m-q4_k_m.gguf")
fi
for model in "${models[@]}"; do
  [[ -f "$model" ]] || { echo "bench: $model not found" >&2; exit 1; }
done

cargo build --release -q -p tandem-cli
tandem() { # threads activations [extra flags]
  ./target/release/tandem bench --model "$model" --threads "$1" --activations "$2" \
    --prompt-tokens "$prompt_tokens" --decode-tokens "$decode_tokens" --reps "$reps" --json "${@:3}"
}
llama() { # threads
  THREADS="$1" PROMPT_TOKENS="$prompt_tokens" DECODE_TOKENS="$decode_tokens" REPS="$reps" \
    scripts/llamacpp-bench.sh "$model"
}

bench_model() { # model
model="$1"
results=()
for t in $(printf '%s\n' "$threads" 1 | awk '!seen[$0]++'); do
  results+=("$(llama "$t")" "$(tandem "$t" q16)" "$(tandem "$t" f32)")
done
batched="$(tandem "$threads" q16 --batch "$batch")"

python3 - "$model" "$batched" "${results[@]}" <<'PY'
import json, sys
model, batched, rows = sys.argv[1], json.loads(sys.argv[2]), [json.loads(a) for a in sys.argv[3:]]
print(f"model: {model}")
print(f"llama.cpp: {rows[0]['version']}")
print(f"{'threads':>7} {'engine':<26}{'prompt t/s':>11}{'ratio':>7}{'decode t/s':>12}{'ratio':>7}")
for i in range(0, len(rows), 3):
    llama, fast, exact = rows[i:i + 3]
    for name, r in (("llama.cpp", llama), ("tandem (default, q16)", fast), ("tandem --activations f32", exact)):
        print(f"{r['threads']:>7} {name:<26}{r['prompt_tps']:11.1f}{r['prompt_tps'] / llama['prompt_tps']:7.2f}"
              f"{r['decode_tps']:12.1f}{r['decode_tps'] / llama['decode_tps']:7.2f}")
b = batched
print(f"tandem decode, {b['batch']} sequences together ({b['threads']} threads): {b['batched_decode_tps']:.1f} t/s "
      f"= {b['batched_decode_tps'] / b['decode_tps']:.2f}x its single stream ({b['decode_tps']:.1f} t/s)")
PY
}

long_lengths="${LONG_LENGTHS:-512 1024 2048 4096 8192}"
long_depth="${LONG_DEPTH:-4096}"
long_decode=32
bench_long() { # model
model="$1"
rows=()
# Where attention runs on the AMX tiles, each tandem figure is also taken with it on the vector units
# (TANDEM_AMX_ATTENTION=off), in the same run.
tandem_long() { # prompt tokens, decode tokens, then env assignments
  local n="$1" d="$2"; shift 2
  env "$@" ./target/release/tandem bench --model "$model" --threads "$threads" --prompt-tokens "$n" \
    --decode-tokens "$d" --reps 1 --kv-blocks $(((n + d) / 16 + 8)) --json
}
for n in $long_lengths; do
  rows+=("$(THREADS="$threads" PROMPT_TOKENS="$n" DECODE_TOKENS=1 REPS=1 scripts/llamacpp-bench.sh "$model")")
  default="$(tandem_long "$n" 0)"
  rows+=("$default")
  if [[ "$default" == *"AMX bf16"* ]]; then
    rows+=("$(tandem_long "$n" 0 TANDEM_AMX_ATTENTION=off)")
  else
    rows+=("$default")
  fi
done
deep_llama="$(THREADS="$threads" PROMPT_TOKENS=16 DECODE_TOKENS="$long_decode" DEPTH="$long_depth" REPS=1 \
  scripts/llamacpp-bench.sh "$model")"
deep_tandem="$(tandem_long "$long_depth" "$long_decode")"
deep_vector="$deep_tandem"
if [[ "$deep_tandem" == *"AMX bf16"* ]]; then
  deep_vector="$(tandem_long "$long_depth" "$long_decode" TANDEM_AMX_ATTENTION=off)"
fi
python3 - "$model" "$deep_llama" "$deep_tandem" "$deep_vector" "${rows[@]}" <<'PY'
import json, sys
model = sys.argv[1]
deep_llama, deep_tandem, deep_vector = (json.loads(a) for a in sys.argv[2:5])
rows = [json.loads(a) for a in sys.argv[5:]]
print(f"long context: {model} ({deep_tandem['threads']} threads, {deep_llama['version']})")
print(f"tandem: {deep_tandem.get('attention_kernel', '?')}; 'vector': TANDEM_AMX_ATTENTION=off")
print(f"{'prompt tokens':>13}{'llama.cpp t/s':>15}{'tandem t/s':>12}{'ratio':>7}{'attention':>11}"
      f"{'vector t/s':>12}{'ratio':>7}{'attention':>11}")
def share(r):
    s = r.get("prompt_attention_share")
    return f"{100 * s:10.0f}%" if s is not None else f"{'-':>11}"
for llama, tandem, vector in zip(rows[0::3], rows[1::3], rows[2::3]):
    print(f"{tandem['prompt_tokens']:>13}{llama['prompt_tps']:15.1f}{tandem['prompt_tps']:12.1f}"
          f"{tandem['prompt_tps'] / llama['prompt_tps']:7.2f}{share(tandem)}"
          f"{vector['prompt_tps']:12.1f}{vector['prompt_tps'] / llama['prompt_tps']:7.2f}{share(vector)}")
print(f"decode {deep_tandem['decode_tokens']} tokens after {deep_tandem['prompt_tokens']}: llama.cpp "
      f"{deep_llama['decode_tps']:.1f} t/s, tandem {deep_tandem['decode_tps']:.1f} t/s "
      f"(ratio {deep_tandem['decode_tps'] / deep_llama['decode_tps']:.2f}), vector "
      f"{deep_vector['decode_tps']:.1f} t/s (ratio {deep_vector['decode_tps'] / deep_llama['decode_tps']:.2f})")
PY
}

if [[ "${SHORT:-1}" != 0 ]]; then
  for model in "${models[@]}"; do
    bench_model "$model"
    echo
  done
fi
if [[ "${LONG:-1}" != 0 ]]; then
  for model in "${models[@]}"; do
    bench_long "$model"
    echo
  done
fi
