#!/usr/bin/env bash
# Makes a second real k-quant model for benchmarks: SmolLM2-135M-Instruct requantized to Q4_K_M by
# llama.cpp's `llama-quantize --allow-requantize` from the Q4_1 file scripts/fetch-model.sh
# fetches (no other source of its weights is reachable). The result is a Llama-family Q4_K_M file
# that Tandem and llama.cpp can both run, so their outputs and speeds compare on the same file.
#
# Usage: scripts/make-smollm2-q4km.sh        prints the path of the file on its last line
#
# SmolLM2's hidden width, 576, is not a multiple of a k-quant super-block (256), so llama-quantize
# stores the matrices that are 576 wide in its fallback types (Q5_0, and Q8_0 where Q4_K_M would
# pick Q6_K); only the 1,536-wide ffn_down matrices become Q4_K and Q6_K. Requantizing a Q4_1 file
# also compounds two roundings: the file is for speed and agreement with llama.cpp on the same
# weights, not for quality.
#
# Environment: TANDEM_MODEL_DIR (default $HOME/.cache/tandem/models), and those of
# scripts/llamacpp-build.sh (TANDEM_CACHE, LLAMA_CPP_VERSION, BUILD_JOBS).
set -euo pipefail
shopt -s inherit_errexit

log() { printf 'make-smollm2-q4km: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

cd "$(dirname "$0")/.."
dir="${TANDEM_MODEL_DIR:-$HOME/.cache/tandem/models}"
src="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
dest="$dir/SmolLM2-135M-Instruct.Q4_K_M.gguf"
if [[ -s "$dest" ]]; then
    log "already present"
    echo "$dest"
    exit 0
fi
scripts/fetch-model.sh >&2 || die "could not fetch the Q4_1 source file"

# shellcheck source=scripts/llamacpp-build.sh
source scripts/llamacpp-build.sh
LLAMACPP_DEFAULT_JOBS=2
llamacpp_init
llamacpp_ensure_built llama-quantize

log "requantizing $src to Q4_K_M"
"$LLAMACPP_BIN_DIR/llama-quantize" --allow-requantize "$src" "$dest.part" Q4_K_M >&2 \
    || { rm -f "$dest.part"; die "llama-quantize failed"; }
mv "$dest.part" "$dest"
log "saved $dest"
echo "$dest"
