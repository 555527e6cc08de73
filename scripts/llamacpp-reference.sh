#!/usr/bin/env bash
# Reference outputs of llama.cpp for a real GGUF model (by default Gemma 3 270M, Q4_K_M), written
# to tests/reference/fixtures/<name>.json for Tandem's parity tests (<name>: the file's name in
# lower case without .gguf, "gemma-3-" shortened to "gemma3-": gemma3-270m-q4_k_m.json).
#
# Usage: scripts/llamacpp-reference.sh [MODEL.gguf [OUT.json]]
#
# Builds llama.cpp's `llama-server` and `llama-tokenize` (CPU only) once, with the cache and
# build logic of scripts/llamacpp-build.sh (the same llama.cpp source that llamacpp-bench.sh
# uses), starts llama-server on a free local port, and runs scripts/llamacpp_reference.py against
# it: tokenizations with and without BOS (cross-checked with llama-tokenize), chat-template
# renderings, greedy continuations with the top-5 log-probabilities of every generated position.
# When the Python that runs the driver has transformers, the driver also records transformers'
# reading of the same GGUF (tokenizer, and greedy continuations of the dequantized weights) as a
# second opinion.
#
# Environment:
#   TANDEM_MODEL_DIR   model cache                           (default: $HOME/.cache/tandem/models)
#   TANDEM_CACHE       cache root for the llama.cpp build    (default: $HOME/.cache/tandem)
#   LLAMA_CPP_VERSION  llama.cpp build number                (default: 11434, i.e. tag b11434)
#   BUILD_JOBS         parallel compile jobs                 (default: 1)
#   THREADS            llama-server threads                  (default: 2)
#   CHAT_TEMPLATE_FILE Jinja chat template for llama-server (default: the GGUF's own; for a
#                      gemma-3 file, which carries none, tests/reference/templates/gemma3-chat.jinja,
#                      since llama.cpp would otherwise fall back to ChatML)
#   PYTHON             interpreter for the driver (default: ~/.venvs/tandem-ref/bin/python when
#                      present, else python3; without transformers the second opinion is skipped)
#
# Get the default model with scripts/fetch-gemma.sh.
set -euo pipefail
shopt -s inherit_errexit

log() { printf 'llamacpp-reference: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# shellcheck source=scripts/llamacpp-build.sh
source "$ROOT/scripts/llamacpp-build.sh"
LLAMACPP_DEFAULT_JOBS=1
llamacpp_init

THREADS="${THREADS:-2}"
llamacpp_is_uint "$THREADS" || die "THREADS must be a positive integer, got '$THREADS'"

[[ $# -le 2 ]] || die "usage: $0 [MODEL.gguf [OUT.json]]"
MODEL="${1:-${TANDEM_MODEL_DIR:-$HOME/.cache/tandem/models}/gemma-3-270m-q4_k_m.gguf}"
[[ -f "$MODEL" ]] || die "model file not found: $MODEL (run scripts/fetch-gemma.sh, or pass a GGUF path)"
base="$(basename "$MODEL" .gguf)"
name="${base,,}"
name="${name/#gemma-3-/gemma3-}"
OUT="${2:-$ROOT/tests/reference/fixtures/$name.json}"

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$HOME/.venvs/tandem-ref/bin/python" ]]; then
        PYTHON="$HOME/.venvs/tandem-ref/bin/python"
    else
        PYTHON=python3
    fi
fi

llamacpp_ensure_built llama-server llama-tokenize
SERVER_BIN="$LLAMACPP_BIN_DIR/llama-server"
TOKENIZE_BIN="$LLAMACPP_BIN_DIR/llama-tokenize"

CHAT_TEMPLATE_FILE="${CHAT_TEMPLATE_FILE:-}"
if [[ -z "$CHAT_TEMPLATE_FILE" && "$base" == gemma-3-* ]]; then
    CHAT_TEMPLATE_FILE="$ROOT/tests/reference/templates/gemma3-chat.jinja"
fi
TEMPLATE_ARGS=()
DRIVER_TEMPLATE_ARGS=()
if [[ -n "$CHAT_TEMPLATE_FILE" ]]; then
    [[ -f "$CHAT_TEMPLATE_FILE" ]] || die "chat template not found: $CHAT_TEMPLATE_FILE"
    TEMPLATE_ARGS=(--jinja --chat-template-file "$CHAT_TEMPLATE_FILE")
    DRIVER_TEMPLATE_ARGS=(--chat-template-file "$CHAT_TEMPLATE_FILE")
    log "chat template: $CHAT_TEMPLATE_FILE"
fi

PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
SERVER_LOG="$TMP_DIR/llama-server.log"
# One slot, no prompt cache reuse between requests, context large enough for the long prompt.
# The server is stopped (by its pid) on any exit.
log "starting llama-server on 127.0.0.1:$PORT (log: $SERVER_LOG)"
"$SERVER_BIN" -m "$MODEL" --host 127.0.0.1 --port "$PORT" -t "$THREADS" -c 4096 -np 1 \
    --no-webui "${TEMPLATE_ARGS[@]}" > "$SERVER_LOG" 2>&1 &
SERVER_PID=$!
trap 'kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; rm -rf "$TMP_DIR"' EXIT

log "running the driver with $PYTHON"
if ! "$PYTHON" "$ROOT/scripts/llamacpp_reference.py" \
        --server "http://127.0.0.1:$PORT" --server-pid "$SERVER_PID" \
        --tokenize-bin "$TOKENIZE_BIN" --model "$MODEL" --version "$VERSION_TAG" --out "$OUT" --threads "$THREADS" \
        "${DRIVER_TEMPLATE_ARGS[@]}"; then
    log "llama-server's log follows"
    tail -n 40 "$SERVER_LOG" >&2
    die "the driver failed"
fi
log "wrote $OUT"
