#!/usr/bin/env bash
# Cluster benchmark: TTFT, inter-token latency (p50/p99) and throughput at concurrency 1, 8 and 32
# for the same fixed synthetic workload on three local clusters started with `tandem up`:
# disaggregated over shm, over tcp and (when scripts/fetch-nixl.sh can install NIXL) over nixl,
# and colocated (one worker doing both phases); then KV transfer throughput for the same
# transports next to a plain memcpy of the same bytes.
# Everything is measured in this one run on this machine.
#
# Usage: scripts/bench-cluster.sh            (env: PROMPT_TOKENS=128 OUTPUT_TOKENS=32
#        CONCURRENCY="1 8 32" THREADS=1 MODEL=<path>)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh >&2
cargo build --release -q -p tandem-cli -p tandem-router -p tandem-prefill -p tandem-decode
bin=./target/release
prompt=${PROMPT_TOKENS:-128}
output=${OUTPUT_TOKENS:-32}
threads=${THREADS:-1}
model_args=()
[ -n "${MODEL:-}" ] && model_args=(--model "$MODEL")

run_cluster() { # name, tandem up flags...
  local name=$1; shift
  local ready; ready=$(mktemp)
  "$bin/tandem" up "${model_args[@]}" "$@" >"$ready" &
  local up=$!
  for _ in $(seq 1 900); do
    grep -q '^ready router=' "$ready" && break
    kill -0 $up 2>/dev/null || { echo "bench: tandem up ($name) exited early" >&2; return 1; }
    sleep 0.2
  done
  local router; router=$(sed -n 's/^ready router=\([^ ]*\).*/\1/p' "$ready" | head -n1)
  for c in ${CONCURRENCY:-1 8 32}; do
    local n=$(( c * 2 < 8 ? 8 : c * 2 ))
    local json
    json=$("$bin/tandem" bench --router "$router" --concurrency "$c" --requests "$n" \
      --prompt-tokens "$prompt" --decode-tokens "$output" --json)
    python3 - "$name" "$json" <<'PY'
import json, sys
name, r = sys.argv[1], json.loads(sys.argv[2])
print(f"| {name} | {r['concurrency']} | {r['requests']} | {r['ttft_ms']['p50']:.0f} | {r['ttft_ms']['p99']:.0f} "
      f"| {r['itl_ms']['p50']:.1f} | {r['itl_ms']['p99']:.1f} | {r['output_tokens_per_s']:.1f} | {r['failed']} |")
PY
  done
  kill -INT $up; wait $up || true
  rm -f "$ready"
}

echo "workload: $prompt prompt tokens + $output output tokens per request (ignore_eos), worker threads $threads"
echo
echo "| cluster | concurrency | requests | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | output tok/s | failed |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
run_cluster "disaggregated shm" --transport shm --threads "$threads"
run_cluster "disaggregated tcp" --transport tcp --threads "$threads"
transports=shm,tcp
if nixl_lib=$(scripts/fetch-nixl.sh); then
  run_cluster "disaggregated nixl" --transport nixl --nixl-lib "$nixl_lib" --threads "$threads"
  transports=nixl,shm,tcp
  export TANDEM_NIXL_LIB="$nixl_lib"
else
  echo "bench: no NIXL (scripts/fetch-nixl.sh failed): no nixl rows" >&2
fi
run_cluster "colocated" --colocated --threads $(( threads * 2 ))
echo
"$bin/tandem" bench --transfer --transfer-transports "$transports" "${model_args[@]}"
