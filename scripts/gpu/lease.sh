#!/usr/bin/env bash
# The GPU check in one device call of a short lease: the stages of scripts/gpu-check.sh that
# say whether the CUDA half is right run side by side, then the timed stages run alone.
#
#   scripts/gpu/lease.sh [SECONDS]              (default 420: the whole call's budget)
#   scripts/gpu/lease.sh SECONDS STAGE...       those stages only, one after another
#
# Order: the bundle is unpacked once; then `tests`, `transports` and `parity` run at the same
# time (three stages on one GPU: their results are pass/fail and error figures, which sharing
# the card does not change); then `bench` and `transfer` run alone with what is left of the
# budget, so their timings are the card's own. A stage the budget cuts short records its steps as
# "skipped (no time left)" and the table says so.
#
# Everything the stages wrote goes back as one file, $OUT/gpu-check-out.tar.gz (a device call
# returns at most 8 files), with the table beside it as $OUT/summary.md. Exit status 1 when any
# stage failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
budget="${1:-420}"
shift $(($# > 0 ? 1 : 0))
only=("$@")
base=target/gpu-check
res="$base/out"
mkdir -p "$res"
out_dir="${OUT:-}"
# The stages copy their files to $OUT one by one; here they are packed into one instead.
unset OUT

if [[ -f "$base/bundle.tar.xz" ]]; then
  rm -rf "$base/bundle"
  scripts/gpu/unpack.sh "$base/bundle.tar.xz" "$base" && touch "$base/bundle/build-root"
fi

left() { echo $((budget - SECONDS)); }
stage() {
  local name="$1" share="$2"
  GPU_CHECK_BUDGET="$share" scripts/gpu-check.sh --stage "$name" >"$res/lease-$name.out" 2>&1
  echo "lease: stage $name exit $? at ${SECONDS}s" | tee -a "$res/lease.log"
}

if ((${#only[@]})); then
  for s in "${only[@]}"; do
    stage "$s" "$(left)"
  done
else
  # Correctness, side by side; bench, transfer and cluster keep 40% of the budget.
  correct=$(($(left) * 60 / 100))
  stage tests "$correct" &
  stage transports "$correct" &
  stage parity "$correct" &
  wait

  # Timings, alone on the card.
  rest=$(left)
  if ((rest > 60)); then
    stage bench $((rest * 50 / 100))
    stage transfer $(($(left) * 40 / 100))
    stage cluster "$(left)"
  else
    echo "lease: no time left for bench, transfer and cluster" | tee -a "$res/lease.log"
  fi
fi

failed=0
for f in "$res"/lease-*.out; do
  echo "== tail of $f"
  grep -E '^gpu-check: .*(failed|timed out|skipped|SKIPPED|passed|done)|FAILED|panicked|error' "$f" | tail -25
done
grep -q 'exit [^0]' "$res/lease.log" && failed=1
python3 scripts/gpu/summary.py "$res" | tee "$res/summary.md"
[[ -s "$res/transfer-bench.md" ]] && { echo; cat "$res/transfer-bench.md"; } | tee -a "$res/summary.md"
if [[ -n "$out_dir" ]]; then
  mkdir -p "$out_dir"
  tar -C "$base" -czf "$out_dir/gpu-check-out.tar.gz" out kernel-cache 2>/dev/null \
    || tar -C "$base" -czf "$out_dir/gpu-check-out.tar.gz" out
  cp "$res/summary.md" "$out_dir/"
fi
echo "lease: done in ${SECONDS}s of ${budget}s; $([[ $failed == 0 ]] && echo 'every stage passed' || echo 'SOME STAGES FAILED')"
exit "$failed"
