#!/usr/bin/env bash
# Chaos soak: a cluster with mutual TLS on every port, 2 routers, 2 prefill and 2 decode workers
# (KV over shm) serves a steady load with random client cancellations for DURATION seconds
# (default 600) while, every 20-40 s, one process (a prefill worker, a decode worker or a router)
# is killed (SIGKILL) or frozen (SIGSTOP) for DOWN seconds (default 5), then restarted or resumed.
#
# It runs the e2e test `tests/e2e/tests/chaos.rs` (whose short form is part of the test suite)
# with its long settings and strict checks: every request completes with the greedy output of an
# undisturbed run or fails within 5 s with a retryable status naming its request id (or a broken
# connection to a router that was killed); afterwards every worker has every block back, nothing
# of a killed process is left in /dev/shm, each router that was never killed counts what its
# clients saw, and the RSS of every process that lived through the second half stayed flat.
# It prints the figures (requests, faults, migrations by phase, failures and their causes) as
# Markdown and exits non-zero on a violation. Not part of the test suite; results go in
# docs/benchmarks.md.
#
# HARNESS=up runs the other mode: `tandem up` itself is the harness (1 router, 2 prefill and 2
# decode workers). Every EVERY seconds a worker is SIGKILLed and nobody but `tandem up` starts it
# again; with a worker of each role always up, every request must complete with the undisturbed
# output (or be cancelled by its client), every killed worker must come back and register again,
# `tandem up`'s restart count must match the kills, and every worker must be quiescent at the end.
#
# Usage: scripts/chaos.sh   (env: HARNESS=cluster|up DURATION=600 EVERY=20-40 DOWN=5 CONCURRENCY=6
#        MODEL=smollm2|tiny SEED=<n> REPORT=<file>)
set -euo pipefail
cd "$(dirname "$0")/.."
model=${MODEL:-smollm2}
if [ "$model" = smollm2 ]; then
  scripts/fetch-model.sh >&2
fi
report=${REPORT:-$(mktemp)}
export TANDEM_CHAOS_SECS=${DURATION:-600} TANDEM_CHAOS_EVERY_S=${EVERY:-20-40} \
  TANDEM_CHAOS_DOWN_S=${DOWN:-5} TANDEM_CHAOS_CONCURRENCY=${CONCURRENCY:-6} \
  TANDEM_CHAOS_MODEL=$model TANDEM_CHAOS_STRICT=1 TANDEM_CHAOS_LEASE_MS=30000 \
  TANDEM_CHAOS_REPORT=$report TANDEM_REQUIRE_MODEL=1
[ -n "${SEED:-}" ] && export TANDEM_CHAOS_SEED=$SEED
status=0
case "${HARNESS:-cluster}" in
  cluster) test=chaos_every_request_is_correct_or_retryable_and_nothing_leaks ;;
  up) test=chaos_under_tandem_up_killed_workers_come_back_and_no_request_fails ;;
  *) echo "chaos: HARNESS is cluster or up, not ${HARNESS}" >&2; exit 2 ;;
esac
cargo test --quiet -p tandem-e2e --test chaos -- --exact "$test" --nocapture --test-threads 1 >&2 || status=$?
if [ -s "$report" ]; then
  cat "$report"
else
  echo "FAIL: the run ended before it wrote its figures (see the output above)"
fi
[ -z "${REPORT:-}" ] && rm -f "$report"
exit $status
