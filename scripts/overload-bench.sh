#!/usr/bin/env bash
# Overload benchmark: one local cluster (`tandem up`) whose decode worker's KV pool holds about
# CAPACITY sequences of the workload, loaded three ways in this one run — one request at a time,
# CAPACITY at once (full but not over), and twice that for DURATION seconds (offered load twice
# what fits; refused clients wait 100 ms and send the next request). Prints refusals (count and
# how fast they were answered) and inter-token latency of the admitted requests at each load, with
# the targets: refusals answered within 100 ms (p99), and the admitted requests' p99 inter-token
# latency under 2x overload within 2x of the figure without overload. It also prints the prompt
# tokens the decode worker recomputed at each load: sequences it preempted for want of blocks.
#
# Usage: scripts/overload-bench.sh     (env: CAPACITY=8 DURATION=30 PROMPT_TOKENS=64
#        OUTPUT_TOKENS=64 THREADS=1 MAX_KV_WAITING=4 MODEL=<path>
#        UP_FLAGS="<more tandem up flags>", e.g. "--share-cpu false")
set -euo pipefail
cd "$(dirname "$0")/.."
capacity=${CAPACITY:-8}
duration=${DURATION:-30}
prompt=${PROMPT_TOKENS:-64}
output=${OUTPUT_TOKENS:-64}
threads=${THREADS:-1}
block=16
# Blocks for CAPACITY whole sequences (prompt + output), nothing more.
blocks=$(( capacity * ( (prompt + output + block - 1) / block ) ))
. scripts/up-lib.sh
# The router takes these from its environment (tandem up passes it on). UP_FLAGS is split into
# words on purpose.
# shellcheck disable=SC2086
TANDEM_MAX_KV_WAITING=${MAX_KV_WAITING:-4} TANDEM_KV_WAIT_MS=10000 \
  up_cluster overload-bench --threads "$threads" --kv-blocks "$blocks" --block-size "$block" ${UP_FLAGS:-}
load() { # concurrency, then either a request count or --duration-s N
  "$bin/tandem" bench --router "$router" --prompt-tokens "$prompt" --decode-tokens "$output" \
    --concurrency "$1" "${@:2}" --json
}
# The decode worker's ops address: its count of prompt tokens computed is the recomputation of
# sequences it preempted (it computes no prompts of its own in a disaggregated cluster).
decode_http=$(grep 'worker listening' "$up_log" | grep 'role="decode"' | sed -n 's/.* http=\([0-9.:]*\).*/\1/p')
recomputed() {
  curl -sf "http://$decode_http/metrics" |
    awk '$1 == "tandem_worker_prefix_cache_computed_prompt_tokens_total" {print $2; f = 1} END {if (!f) print 0}'
}
r0=$(recomputed)
calm=$(load 1 --requests 16)
r1=$(recomputed)
full=$(load "$capacity" --requests $(( capacity * 4 )))
r2=$(recomputed)
over=$(load $(( capacity * 2 )) --duration-s "$duration")
r3=$(recomputed)
echo "decode worker recomputed (preemption) prompt tokens: 1 at a time $(( r1 - r0 )), capacity $(( r2 - r1 )), 2x overload $(( r3 - r2 ))"

python3 - "$capacity" "$blocks" "$calm" "$full" "$over" <<'PY'
import json, sys
cap, blocks = sys.argv[1], sys.argv[2]
rows = [("1 at a time", json.loads(sys.argv[3])), (f"{cap} at once (capacity)", json.loads(sys.argv[4])),
        (f"{2 * int(cap)} at once (2x overload)", json.loads(sys.argv[5]))]
print(f"decode KV pool: {blocks} blocks = {cap} sequences of the workload")
print("| load | requests | refused | refusal p50 ms | refusal p99 ms | TTFT p50 ms | ITL p50 ms | ITL p99 ms | output tok/s | failed |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for name, r in rows:
    print(f"| {name} | {r['requests']} | {r['refused']} | {r['refusal_ms']['p50']:.1f} | {r['refusal_ms']['p99']:.1f} "
          f"| {r['ttft_ms']['p50']:.0f} | {r['itl_ms']['p50']:.1f} | {r['itl_ms']['p99']:.1f} "
          f"| {r['output_tokens_per_s']:.1f} | {r['failed']} |")
calm, full, over = (r for _, r in rows)
p99 = over['refusal_ms']['p99']
print(f"refusals answered within 100 ms (p99): {p99:.1f} ms -> {'met' if over['refused'] and p99 <= 100 else 'NOT met' if over['refused'] else 'no refusals'}")
for base_name, base in (("at capacity", full), ("one at a time", calm)):
    ratio = over['itl_ms']['p99'] / base['itl_ms']['p99']
    print(f"admitted ITL p99 under 2x overload vs {base_name}: {ratio:.2f}x -> {'within' if ratio <= 2 else 'NOT within'} 2x")
PY
