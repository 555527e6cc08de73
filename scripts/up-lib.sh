# Sourced by the cluster scripts: builds the release binaries and starts `tandem up` in the
# background.
#
#   up_cluster NAME [tandem up flags...]
#
# starts the cluster with the default model (or $MODEL), its stdout in $up_ready and its stderr in
# $up_log (temporary files), waits for its ready line and sets $up (its pid) and $router (the
# router's gRPC address). The cluster is stopped (SIGINT, then waited for) and the files removed
# when the sourcing script exits. NAME prefixes error messages.
scripts/fetch-model.sh >&2
cargo build --release -q -p tandem-cli -p tandem-router -p tandem-prefill -p tandem-decode
bin=./target/release
up=""
up_ready=$(mktemp)
up_log=$(mktemp)
trap 'if [ -n "$up" ]; then kill -INT $up 2>/dev/null; wait $up 2>/dev/null; fi; rm -f "$up_ready" "$up_log"' EXIT

up_cluster() {
  local name=$1; shift
  local model_args=()
  [ -n "${MODEL:-}" ] && model_args=(--model "$MODEL")
  "$bin/tandem" up "${model_args[@]}" "$@" >"$up_ready" 2>"$up_log" &
  up=$!
  for _ in $(seq 1 900); do
    grep -q '^ready router=' "$up_ready" && break
    kill -0 $up 2>/dev/null || { echo "$name: tandem up exited early" >&2; cat "$up_log" >&2; exit 1; }
    sleep 0.2
  done
  router=$(sed -n 's/^ready router=\([^ ]*\).*/\1/p' "$up_ready" | head -n1)
  [ -n "$router" ] || { echo "$name: tandem up was not ready in time" >&2; cat "$up_log" >&2; exit 1; }
}
