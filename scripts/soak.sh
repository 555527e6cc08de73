#!/usr/bin/env bash
# Soak run: a local cluster (`tandem up`, default model) under steady load for DURATION seconds
# (default 600). Every INTERVAL seconds it records the resident memory (RSS) of the router and of
# each worker; at the end it waits for the cluster to go idle and checks that every worker has
# every KV block back (free + cached == capacity, nothing used, no reservation, nothing running),
# then prints the RSS table, each process's growth over the last two thirds of the run, and PASS or
# FAIL. (The first third is warm-up: the KV pools' pages are first touched as the prefix cache
# fills them, which raises RSS by up to the pool size once.) Not part of the test suite (it takes minutes); results go in
# docs/benchmarks.md.
#
# Usage: scripts/soak.sh      (env: DURATION=600 INTERVAL=30 CONCURRENCY=4 PROMPT_TOKENS=128
#        OUTPUT_TOKENS=64 THREADS=1 TRANSPORT=shm MODEL=<path>)
set -euo pipefail
cd "$(dirname "$0")/.."
duration=${DURATION:-600}
interval=${INTERVAL:-30}
. scripts/up-lib.sh
up_cluster soak --threads "${THREADS:-1}" --transport "${TRANSPORT:-shm}"
rss=$(mktemp); load_json=$(mktemp)
# The workers' ops HTTP addresses, from their "worker listening" log lines.
worker_http=$(grep 'worker listening' "$up_log" | sed -n 's/.* http=\([0-9.:]*\).*/\1/p')
pids=$(pgrep -P $up)

"$bin/tandem" bench --router "$router" --concurrency "${CONCURRENCY:-4}" --duration-s "$duration" \
  --prompt-tokens "${PROMPT_TOKENS:-128}" --decode-tokens "${OUTPUT_TOKENS:-64}" --json >"$load_json" &
bench=$!
start=$(date +%s)
while kill -0 $bench 2>/dev/null; do
  row="$(( $(date +%s) - start ))"
  for p in $pids; do
    row="$row $(ps -o comm= -p "$p"):$(awk '/^VmRSS/ {print $2}' "/proc/$p/status" 2>/dev/null || echo 0)"
  done
  echo "$row" >>"$rss"
  sleep "$interval"
done
wait $bench
load=$(cat "$load_json"); rm -f "$load_json"

# Idle: every worker gives every block back.
quiet=1
for _ in $(seq 1 100); do
  quiet=1
  for a in $worker_http; do
    m=$(curl -sf "http://$a/metrics") || { quiet=0; continue; }
    v() { echo "$m" | awk -v n="$1" '$1 == n {print $2; f = 1} END {if (!f) print 0}'; }
    [ "$(v tandem_worker_kv_blocks_used)" = 0 ] && [ "$(v tandem_worker_reservations)" = 0 ] \
      && [ "$(v tandem_worker_running_sequences)" = 0 ] \
      && [ $(( $(v tandem_worker_kv_blocks_free) + $(v tandem_worker_prefix_cache_blocks) )) \
           = "$(v tandem_worker_kv_blocks_capacity)" ] || quiet=0
  done
  [ $quiet = 1 ] && break
  sleep 0.2
done
final=""
for a in $worker_http; do
  m=$(curl -sf "http://$a/metrics")
  v() { echo "$m" | awk -v n="$1" '$1 == n {print $2}'; }
  final="$final $a:free=$(v tandem_worker_kv_blocks_free),cached=$(v tandem_worker_prefix_cache_blocks),capacity=$(v tandem_worker_kv_blocks_capacity),used=$(v tandem_worker_kv_blocks_used)"
done

status=0
python3 - "$rss" "$load" "$quiet" "$final" <<'PY' || status=$?
import json, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
load, quiet, final = json.loads(sys.argv[2]), sys.argv[3] == "1", sys.argv[4].split()
names = [c.split(":")[0] for c in rows[0][1:]]
print(f"load: {load['requests']} requests ({load['failed']} failed) at concurrency {load['concurrency']} "
      f"over {load['wall_s']:.0f} s, {load['output_tokens_per_s']:.1f} output tokens/s")
print("| t (s) | " + " | ".join(f"{n} RSS MiB" for n in names) + " |")
print("|---:|" + "---:|" * len(names))
for r in rows:
    print(f"| {r[0]} | " + " | ".join(f"{int(c.split(':')[1]) / 1024:.1f}" for c in r[1:]) + " |")
# Growth from the first sample after the first third of the run (warm-up) to the last.
third = int(rows[-1][0]) / 3
base = next(r for r in rows if int(r[0]) >= third)
print(f"growth from t = {base[0]} s to t = {rows[-1][0]} s:")
for i, n in enumerate(names):
    a, b = int(base[i + 1].split(":")[1]), int(rows[-1][i + 1].split(":")[1])
    print(f"{n}: {a / 1024:.1f} -> {b / 1024:.1f} MiB ({(b - a) / 1024:+.1f} MiB)")
print("workers at the end: " + " ".join(final))
ok = quiet and load["failed"] == 0
print("PASS" if ok else "FAIL: " + ("workers did not give every block back" if not quiet else "requests failed"))
sys.exit(0 if ok else 1)
PY
rm -f "$rss"
exit $status
