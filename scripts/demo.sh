#!/usr/bin/env bash
# The main job on a fresh machine: fetch the default model, build, start a local cluster (a
# router, a prefill worker and a decode worker, as three processes with `tandem up`), stream a
# completion through it, and stop the cluster.
# Usage: scripts/demo.sh ["prompt"]   (extra `tandem generate` flags via TANDEM_ARGS,
#        extra `tandem up` flags via TANDEM_UP_ARGS, e.g. "--transport tcp")
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh >&2
cargo build --release -q -p tandem-cli -p tandem-router -p tandem-prefill -p tandem-decode
bin=./target/release

ready=$(mktemp)
# shellcheck disable=SC2086
"$bin/tandem" up ${TANDEM_UP_ARGS:-} >"$ready" &
up=$!
trap 'kill -INT $up 2>/dev/null; wait $up 2>/dev/null || true; rm -f "$ready"' EXIT
for _ in $(seq 1 600); do
  grep -q '^ready router=' "$ready" && break
  kill -0 $up 2>/dev/null || { echo "demo: tandem up exited before the cluster was ready" >&2; exit 1; }
  sleep 0.2
done
router=$(sed -n 's/^ready router=\([^ ]*\).*/\1/p' "$ready" | head -n1)
[ -n "$router" ] || { echo "demo: the cluster did not become ready in 120 s" >&2; exit 1; }
echo "demo: cluster ready, router at $router" >&2
# shellcheck disable=SC2086
"$bin/tandem" generate --router "$router" --chat --max-tokens 128 ${TANDEM_ARGS:-} \
  "${1:-Explain in two sentences why the sky is blue.}"
