#!/usr/bin/env bash
# What a disk KV tier gives a workload that outgrows the KV pool: `tandem bench --workload revisit`
# (CONVERSATIONS multi-turn conversations, each revisited once per round in a seeded random order
# with its whole history) against a local cluster (`tandem up`, default model) whose workers' pools
# hold about 1/RATIO of the working set, run three times with the same seed:
#   1. pool only: a revisit finds its history only if the pool still holds it;
#   2. pool + disk tier (--kv-disk-dir, a new temporary directory, persisted): what the pool evicts
#      is kept on disk and reloaded when a conversation comes back;
#   3. the tiered cluster restarted on the same directory, the workload run again with run 2's
#      salt: round 1 (the openings) finds on disk what run 2 left there.
# Prints each run's rounds, then revisit TTFT p50 and output tokens/s without and with the tier.
#
# Then (SPILL=0 skips it) what spilling costs when nothing comes back: SPILL_CONVERSATIONS
# conversations of one round each (every opening its own from the first token, so no prompt shares
# a prefix with another), SPILL_CONCURRENCY in flight, against the same cluster settings with a pool
# of max(the pool above, SPILL_CONCURRENCY requests) blocks, which the workload outgrows: every
# eviction spills to the tiers and nothing is reloaded. Run twice with the same seed:
#   4. no tiers;
#   5. --kv-host-bytes SPILL_HOST_BYTES and --kv-disk-dir (a new temporary directory, not persisted).
# Prints both runs' output tokens/s and their ratio (target: the tier costs at most 5%, ratio >= 0.95),
# and the workers' tier counters, so that the spills are seen to have happened.
#
# Usage: scripts/kv-tier-bench.sh     (env: CONVERSATIONS=16 ROUNDS=3 FIRST_TOKENS=384
#        TURN_TOKENS=32 ANSWER_TOKENS=8 CONCURRENCY=2 SEED=1 RATIO=4 BLOCK_SIZE=16
#        KV_BLOCKS=<blocks per worker; default: the working set / RATIO> KV_DISK_BYTES=2GiB
#        SPILL=1 SPILL_CONVERSATIONS=48 SPILL_CONCURRENCY=8 SPILL_HOST_BYTES=256MiB
#        SPILL_KV_BLOCKS=<blocks per worker for runs 4-5; default: see above>
#        MODEL=<path> UP_FLAGS="<more tandem up flags>")
set -euo pipefail
cd "$(dirname "$0")/.."
conversations=${CONVERSATIONS:-16}
rounds=${ROUNDS:-3}
first=${FIRST_TOKENS:-384}
turn=${TURN_TOKENS:-32}
answer=${ANSWER_TOKENS:-8}
concurrency=${CONCURRENCY:-2}
seed=${SEED:-1}
ratio=${RATIO:-4}
block=${BLOCK_SIZE:-16}
disk_bytes=${KV_DISK_BYTES:-2GiB}
spill=${SPILL:-1}
spill_conversations=${SPILL_CONVERSATIONS:-48}
spill_concurrency=${SPILL_CONCURRENCY:-8}
spill_host_bytes=${SPILL_HOST_BYTES:-256MiB}

# The working set: every conversation's final history (prompts and answers), as `tandem bench`
# counts it, in tokens and in blocks.
history=$(( first + (rounds - 1) * turn + rounds * answer ))
working_set=$(( conversations * history ))
ws_blocks=$(( conversations * ( (history + block - 1) / block ) ))
# A pool of 1/RATIO of it, but never less than CONCURRENCY whole conversations (and a spare block
# each): requests that do not fit at all would wait or fail instead of measuring the tier.
min_blocks=$(( concurrency * ( (history + block - 1) / block + 1 ) ))
blocks=${KV_BLOCKS:-$(( ws_blocks / ratio > min_blocks ? ws_blocks / ratio : min_blocks ))}
# The spill runs: one request per conversation (its opening and answer); a pool that fits
# SPILL_CONCURRENCY of them (and a spare block each) but not the workload.
spill_request_blocks=$(( (first + answer + block - 1) / block ))
spill_ws_blocks=$(( spill_conversations * spill_request_blocks ))
spill_min_blocks=$(( spill_concurrency * (spill_request_blocks + 1) ))
spill_blocks=${SPILL_KV_BLOCKS:-$(( blocks > spill_min_blocks ? blocks : spill_min_blocks ))}
runs=3
[ "$spill" = 0 ] || runs=5

. scripts/up-lib.sh
disk=$(mktemp -d)
spill_disk=$(mktemp -d)
down() { # stops the cluster up_cluster started, if any
  if [ -n "$up" ]; then kill -INT "$up" 2>/dev/null || true; wait "$up" 2>/dev/null || true; up=""; fi
}
# Replaces up-lib's trap (which stops the cluster and removes its files) to remove the disk tier too.
trap 'down; rm -rf "$disk" "$spill_disk"; rm -f "$up_ready" "$up_log"' EXIT
trap 'exit 130' INT TERM

echo "working set: $working_set tokens = $ws_blocks blocks of $block; pool: $blocks blocks per worker" \
  "= $(( blocks * block )) tokens; working set / pool = $(python3 -c "print(f'{$working_set / ($blocks * $block):.1f}')")x" >&2
if [ "$spill" != 0 ]; then
  spill_tokens=$(( spill_conversations * (first + answer) ))
  echo "spill runs: $spill_tokens tokens = $spill_ws_blocks blocks of $block; pool: $spill_blocks blocks per worker" \
    "= $(( spill_blocks * block )) tokens; workload / pool =" \
    "$(python3 -c "print(f'{$spill_tokens / ($spill_blocks * $block):.1f}')")x" >&2
  if [ "$spill_ws_blocks" -le "$spill_blocks" ]; then
    echo "warning: the spill workload fits the pool, so little or nothing is evicted; raise SPILL_CONVERSATIONS" >&2
  fi
fi

start() { # NAME KV_BLOCKS [tandem up flags...]
  # UP_FLAGS is split into words on purpose.
  # shellcheck disable=SC2086
  up_cluster "$1" --kv-blocks "$2" --block-size "$block" "${@:3}" ${UP_FLAGS:-}
}
bench() { # [more tandem bench flags...]
  "$bin/tandem" bench --router "$router" --workload revisit --conversations "$conversations" \
    --rounds "$rounds" --first-tokens "$first" --turn-tokens "$turn" --answer-tokens "$answer" \
    --concurrency "$concurrency" --seed "$seed" --json "$@"
}
# One round of SPILL_CONVERSATIONS openings: the workload reads each from its own stream of the
# seed, so no two share a block (cli/src/revisit_bench/workload.rs), and one round never revisits.
spill_bench() {
  "$bin/tandem" bench --router "$router" --workload revisit --conversations "$spill_conversations" \
    --rounds 1 --first-tokens "$first" --turn-tokens "$turn" --answer-tokens "$answer" \
    --concurrency "$spill_concurrency" --seed "$seed" --json
}
# The workers' tier counters, one line per worker and tier (best effort: a worker without tiers
# prints none).
tier_counters() {
  grep 'worker listening' "$up_log" | while read -r line; do
    role=$(sed -n 's/.*role="\{0,1\}\([a-z]*\).*/\1/p' <<<"$line")
    http=$(sed -n 's/.* http=\([0-9.:]*\).*/\1/p' <<<"$line")
    [ -n "$http" ] || continue
    curl -sf "http://$http/metrics" 2>/dev/null |
      awk -v role="$role" 'match($1, /^tandem_worker_kv_tier_(spills|hits|drops)_total\{tier="[a-z]+"\}$/) {
        tier = $1; sub(/.*tier="/, "", tier); sub(/".*/, "", tier)
        name = $1; sub(/_total\{.*/, "", name); sub(/tandem_worker_kv_tier_/, "", name)
        if (!(tier in s)) order[++n] = tier
        s[tier] = s[tier] " " name "=" $2 }
        END { for (i = 1; i <= n; i++) print "  " role " " order[i] " tier:" s[order[i]] }' || true
  done
}

start kv-tier-bench "$blocks"
echo "run 1/$runs: pool only" >&2
pool=$(bench)
down

salt="kv-tier-bench-$(date +%s)-$$"
start kv-tier-bench "$blocks" --kv-disk-dir "$disk" --kv-disk-bytes "$disk_bytes" --kv-disk-persist true
echo "run 2/$runs: pool + disk tier ($disk)" >&2
tiered=$(bench --cache-salt "$salt")
tiered_counters=$(tier_counters)
down
on_disk=$(du -sh "$disk" | cut -f1)

start kv-tier-bench "$blocks" --kv-disk-dir "$disk" --kv-disk-bytes "$disk_bytes" --kv-disk-persist true
echo "run 3/$runs: the tiered cluster restarted on the same directory, run 2's salt" >&2
restarted=$(bench --cache-salt "$salt")
restarted_counters=$(tier_counters)
down

spill_plain="" spill_tiered="" spill_counters=""
if [ "$spill" != 0 ]; then
  start kv-tier-bench "$spill_blocks"
  echo "run 4/$runs: spill cost, no tiers" >&2
  spill_plain=$(spill_bench)
  down
  start kv-tier-bench "$spill_blocks" --kv-host-bytes "$spill_host_bytes" --kv-disk-dir "$spill_disk" \
    --kv-disk-bytes "$disk_bytes"
  echo "run 5/$runs: spill cost, host tier $spill_host_bytes + disk tier ($spill_disk)" >&2
  spill_tiered=$(spill_bench)
  spill_counters=$(tier_counters)
  down
fi

python3 - "$blocks" "$block" "$on_disk" "$pool" "$tiered" "$restarted" "$tiered_counters" "$restarted_counters" \
  "$spill_blocks" "$spill_host_bytes" "$spill_plain" "$spill_tiered" "$spill_counters" <<'PY'
import json, sys
blocks, block, on_disk = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
runs = [json.loads(a) for a in sys.argv[4:7]]
counters = sys.argv[7:9]
spill_blocks, spill_host = int(sys.argv[9]), sys.argv[10]
spill = [json.loads(a) for a in sys.argv[11:13] if a]
spill_counters = sys.argv[13]
s = runs[0]["shape"]
ws = runs[0]["working_set_tokens"]
print(f"model: default; {s['conversations']} conversations, {s['rounds']} rounds, {s['first_tokens']}-token "
      f"openings, +{s['turn_tokens']} tokens per revisit, {s['answer_tokens']} answer tokens, "
      f"concurrency {runs[0]['concurrency']}, seed {s['seed']}")
print(f"working set {ws} tokens; pool {blocks} blocks x {block} = {blocks * block} tokens per worker; "
      f"working set / pool = {ws / (blocks * block):.1f}x")
names = ["pool only", "pool + disk tier", "restarted, same disk"]
for name, r in zip(names, runs):
    print(f"\n{name} (salt {r['salt']}):")
    print("| round | requests | failed | TTFT p50 ms | TTFT p90 ms | cached tokens / request | cached % of prompt | output tok/s | time s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    n = len(r["rounds"])
    rows = [(str(i + 1), x) for i, x in enumerate(r["rounds"])]
    if n > 1:
        rows.append((f"2-{n}" if n > 2 else "2", r["revisits"]))
    for k, x in rows:
        print(f"| {k} | {x['requests']} | {x['failed']} | {x['ttft_ms']['p50']:.1f} | {x['ttft_ms']['p90']:.1f} "
              f"| {x['cached_per_request']:.1f} | {100 * x['cached_fraction']:.1f}% | {x['output_tokens_per_s']:.1f} "
              f"| {x['wall_s']:.1f} |")
for name, c in zip(names[1:], counters):
    if c:
        print(f"{name}:\n{c}")
print(f"disk tier after run 2: {on_disk}")
p, t, a = (r["revisits"] for r in runs)
print("\n| revisits (rounds >= 2) | pool only | pool + disk tier | disk tier's speed-up |")
print("|---|---:|---:|---:|")
ratio = lambda x, y: f"{x / y:.2f}x" if y > 0 else "-"
print(f"| TTFT p50 ms | {p['ttft_ms']['p50']:.1f} | {t['ttft_ms']['p50']:.1f} | {ratio(p['ttft_ms']['p50'], t['ttft_ms']['p50'])} |")
print(f"| cached % of prompt | {100 * p['cached_fraction']:.1f}% | {100 * t['cached_fraction']:.1f}% | |")
print(f"| output tok/s | {p['output_tokens_per_s']:.1f} | {t['output_tokens_per_s']:.1f} | {ratio(t['output_tokens_per_s'], p['output_tokens_per_s'])} |")
r1 = runs[2]["rounds"][0]
verdict = "found on disk" if r1["cached_tokens"] > 0 else "NOT found"
print(f"after restart, round 1: {r1['cached_tokens']} cached tokens of {r1['prompt_tokens']} "
      f"({100 * r1['cached_fraction']:.1f}%), {r1['cached_per_request']:.1f} per request -> {verdict}")
if spill:
    s = spill[0]["shape"]
    print(f"\nspill runs (nothing reloaded): {s['conversations']} conversations of one {s['first_tokens']}-token "
          f"opening each, no two sharing a block, {s['answer_tokens']} answer tokens, "
          f"concurrency {spill[0]['concurrency']}; pool {spill_blocks} blocks x {block} = {spill_blocks * block} tokens per worker; workload / pool = "
          f"{spill[0]['working_set_tokens'] / (spill_blocks * block):.1f}x")
    print("| cluster | requests | failed | TTFT p50 ms | cached tokens | output tok/s | time s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in zip(["no tiers", f"host tier {spill_host} + disk tier"], spill):
        x = r["all"]
        print(f"| {name} | {x['requests']} | {x['failed']} | {x['ttft_ms']['p50']:.1f} | {x['cached_tokens']} "
              f"| {x['output_tokens_per_s']:.1f} | {x['wall_s']:.1f} |")
    print(f"tiers after the tiered run:\n{spill_counters}" if spill_counters else
          "tiers after the tiered run: no counters read (no tier spilled, or /metrics unreachable)")
    if spill[1]["all"]["cached_tokens"]:
        print("note: the tiered run reported cached tokens, so something was found again; "
              "the workload is meant to share none")
    off, on = (r["all"]["output_tokens_per_s"] for r in spill)
    z, verdict = (f"{on / off:.3f}", "within" if on / off >= 0.95 else "OVER") if off > 0 else ("-", "no measure for")
    print(f"spill cost: output tok/s without tier {off:.1f}, with tier {on:.1f}, ratio {z} ({verdict} the 5% target)")
    runs += spill
failed = sum(r["all"]["failed"] for r in runs)
if failed:
    print(f"warning: {failed} requests failed; see the rounds above")
PY
