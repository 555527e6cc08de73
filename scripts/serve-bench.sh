#!/usr/bin/env bash
# Serving benchmark: llama.cpp's llama-server, `tandem up --colocated` (one colocated worker) and
# `tandem up` (router, one prefill and one decode worker, KV over shared memory), measured in this
# one run, one server at a time, with the same prompts through the same OpenAI streaming client
# (scripts/serve_bench.py, Python standard library only; its docstring says exactly what is
# measured and how).
#
# For each server and each concurrency C of CONCURRENCY it sends one warm-up request, then keeps
# C streams busy (closed loop) until max(4, REQUESTS_PER_STREAM x C) requests are done, each a
# streaming POST /v1/completions of a unique prompt of about PROMPT_WORDS words (nothing for a
# prefix cache to reuse) asking for OUTPUT_TOKENS tokens (greedy, ignore_eos). It prints a
# markdown table (server x concurrency: requests, failed, output tok/s, TTFT p50/p99, ITL
# p50/p99, tokens per streamed chunk), then the targets, each met or NOT met, at concurrency 16:
#   - each Tandem mode's output tok/s >= 1.5x llama-server's;
#   - each Tandem mode's ITL p99 <= 150 ms and <= llama-server's;
#   - disaggregated TTFT p50 <= 1.5x colocated TTFT p50.
# Figures go into docs/benchmarks.md. Exits non-zero, with the server's log tail, when a server
# does not come up or any request fails.
#
# llama-server is built (CPU only, once, cached) by scripts/llamacpp-build.sh and runs on the same
# GGUF file as Tandem with one slot per stream of the highest concurrency (--parallel), continuous
# batching (its default) and LLAMA_CTX_PER_SLOT tokens of context per slot.
#
# Usage: scripts/serve-bench.sh
# Environment (defaults in brackets):
#   CONCURRENCY          concurrency levels, space-separated               ["1 4 16"]
#   REQUESTS_PER_STREAM  requests per client stream at each level          [3]
#   OUTPUT_TOKENS        max_tokens of every request                       [64]
#   PROMPT_WORDS         words per prompt                                  [180]
#   THREADS              threads of llama-server and of each Tandem worker [nproc]
#   MODEL                GGUF file [the default model, scripts/fetch-model.sh:
#                        $TANDEM_MODEL_DIR/SmolLM2-135M-Instruct.Q4_1.gguf]
#   TANDEM_UP_FLAGS      extra flags for both `tandem up` runs, word-split [none]
#                        (e.g. "--kv-blocks 1024"; a --threads or --transport here replaces the
#                        script's own)
#   LLAMA_CTX_PER_SLOT   llama-server context per slot, in tokens          [1024]
#   SEED                 seed of the prompts' words                        [1]
#   JSON_OUT             also write every figure and target to this JSON file
#   TANDEM_MODEL_DIR, TANDEM_CACHE, LLAMA_CPP_VERSION, BUILD_JOBS: as in scripts/llamacpp-build.sh
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

log() { printf 'serve-bench: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
is_uint() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }

CONCURRENCY="${CONCURRENCY:-1 4 16}"
REQUESTS_PER_STREAM="${REQUESTS_PER_STREAM:-3}"
OUTPUT_TOKENS="${OUTPUT_TOKENS:-64}"
PROMPT_WORDS="${PROMPT_WORDS:-180}"
THREADS="${THREADS:-$(nproc)}"
LLAMA_CTX_PER_SLOT="${LLAMA_CTX_PER_SLOT:-1024}"
SEED="${SEED:-1}"
read -ra levels <<< "$CONCURRENCY"
((${#levels[@]} > 0)) || die "CONCURRENCY is empty"
for v in "${levels[@]}" "$REQUESTS_PER_STREAM" "$OUTPUT_TOKENS" "$PROMPT_WORDS" "$THREADS" \
    "$LLAMA_CTX_PER_SLOT" "$SEED"; do
    is_uint "$v" || die "expected a positive integer, got '$v' (CONCURRENCY, REQUESTS_PER_STREAM, OUTPUT_TOKENS, PROMPT_WORDS, THREADS, LLAMA_CTX_PER_SLOT, SEED)"
done
slots=$(printf '%s\n' "${levels[@]}" | sort -n | tail -n1)

# Everything this script starts is stopped on any exit: llama-server by its pid, the Tandem
# cluster (`tandem up`, which stops its router and workers) by SIGINT, as scripts/up-lib.sh does.
llama_pid=""
work=""
stop_llama() {
    if [[ -n "$llama_pid" ]]; then
        kill "$llama_pid" 2>/dev/null || true
        wait "$llama_pid" 2>/dev/null || true
        llama_pid=""
    fi
}
stop_cluster() {
    if [[ -n "${up:-}" ]]; then
        kill -INT "$up" 2>/dev/null || true
        wait "$up" 2>/dev/null || true
        up=""
    fi
}
cleanup() {
    stop_llama
    stop_cluster
    rm -rf "${work:-}" "${TMP_DIR:-}"
    rm -f "${up_ready:-}" "${up_log:-}"
}
trap 'exit 130' INT
trap 'exit 143' TERM

# Fetches the default model and builds Tandem's release binaries; sets $bin, $up, $up_ready,
# $up_log and its own EXIT trap, which cleanup() replaces (and does the work of).
# shellcheck source=scripts/up-lib.sh
source scripts/up-lib.sh
trap cleanup EXIT

# shellcheck source=scripts/llamacpp-build.sh
source scripts/llamacpp-build.sh
llamacpp_init
trap cleanup EXIT
llamacpp_ensure_built llama-server

MODEL="${MODEL:-${TANDEM_MODEL_DIR:-$HOME/.cache/tandem/models}/SmolLM2-135M-Instruct.Q4_1.gguf}"
[[ -f "$MODEL" ]] || die "model file not found: $MODEL"
work="$(mktemp -d)"

read -ra extra_flags <<< "${TANDEM_UP_FLAGS:-}"
tandem_flags=("${extra_flags[@]}")
[[ " ${TANDEM_UP_FLAGS:-} " == *" --threads"* ]] || tandem_flags+=(--threads "$THREADS")
disagg_flags=()
[[ " ${TANDEM_UP_FLAGS:-} " == *" --transport"* ]] || disagg_flags+=(--transport shm)

log "model: $MODEL"
log "llama.cpp $VERSION_TAG; $THREADS threads; concurrency $CONCURRENCY; $REQUESTS_PER_STREAM requests per stream; $PROMPT_WORDS-word prompts; $OUTPUT_TOKENS output tokens; TANDEM_UP_FLAGS='${TANDEM_UP_FLAGS:-}'"

results=()
failed=0
# measure NAME URL LOG: runs the driver against one server; a failed request marks the run failed
# (the remaining servers are still measured), a server the driver cannot use at all ends it.
measure() {
    local name=$1 url=$2 server_log=$3 rc=0
    local out
    out="$work/$(tr ' ' '-' <<< "$name").json"
    python3 scripts/serve_bench.py run --name "$name" --url "$url" --out "$out" \
        --concurrency "${levels[@]}" --requests-per-stream "$REQUESTS_PER_STREAM" \
        --output-tokens "$OUTPUT_TOKENS" --prompt-words "$PROMPT_WORDS" --seed "$SEED" || rc=$?
    if ((rc != 0)); then
        log "$name: its log's last lines follow"
        tail -n 40 "$server_log" >&2
    fi
    case $rc in
        0) results+=("$out") ;;
        1) results+=("$out"); failed=1; log "$name: some requests failed" ;;
        *) die "$name could not be measured (see above)" ;;
    esac
}

# 1. llama-server.
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
llama_log="$work/llama-server.log"
log "starting llama-server on 127.0.0.1:$port: $slots slots, context $((slots * LLAMA_CTX_PER_SLOT)) (log: $llama_log)"
"$LLAMACPP_BIN_DIR/llama-server" -m "$MODEL" --host 127.0.0.1 --port "$port" -t "$THREADS" \
    --parallel "$slots" -c "$((slots * LLAMA_CTX_PER_SLOT))" --no-webui > "$llama_log" 2>&1 &
llama_pid=$!
for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    if ! kill -0 "$llama_pid" 2>/dev/null; then
        tail -n 40 "$llama_log" >&2
        llama_pid=""
        die "llama-server exited before it was ready (its log's tail is above)"
    fi
    sleep 0.2
done
if ! curl -sf "http://127.0.0.1:$port/health" > /dev/null; then
    tail -n 40 "$llama_log" >&2
    die "llama-server was not ready within 120 s (its log's tail is above)"
fi
measure "llama-server" "http://127.0.0.1:$port" "$llama_log"
stop_llama

# 2. and 3. Tandem, colocated then disaggregated. up_cluster exits (printing the log) when the
# cluster does not come up.
for mode in colocated disaggregated; do
    if [[ $mode == colocated ]]; then
        log "starting tandem up --colocated ${tandem_flags[*]}"
        up_cluster "serve-bench (tandem colocated)" --colocated "${tandem_flags[@]}"
    else
        log "starting tandem up ${disagg_flags[*]} ${tandem_flags[*]}"
        up_cluster "serve-bench (tandem disaggregated)" "${disagg_flags[@]}" "${tandem_flags[@]}"
    fi
    http="$(sed -n 's/^ready router=.* http=\([^ ]*\).*/\1/p' "$up_ready" | head -n1)"
    [[ -n "$http" ]] || die "tandem $mode: no http= address in its ready line: $(cat "$up_ready")"
    measure "tandem $mode" "http://$http" "$up_log"
    stop_cluster
done

echo
report_rc=0
python3 scripts/serve_bench.py report "${results[@]}" ${JSON_OUT:+--json-out "$JSON_OUT"} || report_rc=$?
[[ -z "${JSON_OUT:-}" ]] || log "wrote $JSON_OUT"
((failed == 0 && report_rc == 0)) || die "some requests failed (see above)"
