#!/usr/bin/env bash
# The main job on a fresh machine: fetch the default model, build, and stream a completion.
# Usage: scripts/demo.sh ["prompt"]   (extra tandem generate flags via TANDEM_ARGS)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh >&2
cargo build --release -q -p tandem-cli
# shellcheck disable=SC2086
exec ./target/release/tandem generate --chat --max-tokens 128 ${TANDEM_ARGS:-} \
  "${1:-Explain in two sentences why the sky is blue.}"
