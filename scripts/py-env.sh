#!/usr/bin/env bash
# Creates (or reuses) the Python environment the end-to-end tests use for third-party clients and
# validators: target/py-env, with the pinned packages of tests/e2e/py/requirements.txt from PyPI.
# Prints the environment's python on stdout; everything else goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

env_dir="${TANDEM_PY_ENV:-$PWD/target/py-env}"
req="tests/e2e/py/requirements.txt"
python="${PYTHON:-python3}"
stamp="$env_dir/.requirements"

if [[ -x "$env_dir/bin/python" && -f "$stamp" ]] && cmp -s "$req" "$stamp"; then
  echo "$env_dir/bin/python"
  exit 0
fi

echo "py-env: creating $env_dir from $req" >&2
rm -rf "$env_dir"
if ! "$python" -m venv "$env_dir" >&2; then
  echo "py-env: '$python -m venv' failed; on Debian or Ubuntu install python3-venv" >&2
  exit 1
fi
"$env_dir/bin/python" -m pip install --quiet --disable-pip-version-check --no-input -r "$req" >&2
cp "$req" "$stamp"
echo "$env_dir/bin/python"
