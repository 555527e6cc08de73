#!/usr/bin/env bash
# Tandem's CPU engine next to llama.cpp on the same GGUF file, measured in the same run.
#
# Usage: scripts/bench.sh [MODEL.gguf]     (THREADS, PROMPT_TOKENS, DECODE_TOKENS, REPS as env)
# Prints a table of prompt and decode tokens/s for both engines and their ratio.
set -euo pipefail
cd "$(dirname "$0")/.."

threads="${THREADS:-2}"
prompt_tokens="${PROMPT_TOKENS:-128}"
decode_tokens="${DECODE_TOKENS:-64}"
reps="${REPS:-3}"
model="${1:-${TANDEM_MODEL_DIR:-$HOME/.cache/tandem/models}/SmolLM2-135M-Instruct.Q4_1.gguf}"
[[ -f "$model" ]] || { echo "bench: $model not found (run scripts/fetch-model.sh)" >&2; exit 1; }

cargo build --release -q -p tandem-cli
tandem_json="$(./target/release/tandem bench --model "$model" --threads "$threads" \
  --prompt-tokens "$prompt_tokens" --decode-tokens "$decode_tokens" --reps "$reps" --json)"
llama_json="$(THREADS="$threads" PROMPT_TOKENS="$prompt_tokens" DECODE_TOKENS="$decode_tokens" REPS="$reps" \
  scripts/llamacpp-bench.sh "$model")"

python3 - "$tandem_json" "$llama_json" "$model" <<'PY'
import json, sys
t, l, model = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
print(f"model: {model}")
print(f"threads: {t['threads']}   llama.cpp: {l['version']}")
print(f"{'':24}{'tandem':>12}{'llama.cpp':>12}{'ratio':>8}")
for key, label in (("prompt_tps", f"prompt {t['prompt_tokens']} tok/s"), ("decode_tps", f"decode {t['decode_tokens']} tok/s")):
    print(f"{label:24}{t[key]:12.1f}{l[key]:12.1f}{t[key] / l[key]:8.2f}")
PY
