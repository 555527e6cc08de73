#!/usr/bin/env bash
# Unpacks an xz-compressed tar (the GPU check's bundle) into a directory:
#
#   scripts/gpu/unpack.sh FILE.tar.xz DIR
#
# With the xz tool where the machine has it, else through Python's lzma module (a bare GPU
# machine may lack xz-utils but has python3).
set -euo pipefail
file="$1"
dir="$2"
mkdir -p "$dir"
if command -v xz >/dev/null 2>&1; then
  xz -dc "$file" | tar -C "$dir" -xf -
else
  python3 - "$file" "$dir" <<'PY'
import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as t:
    try:
        t.extractall(sys.argv[2], filter="tar")  # Python 3.12+: keep modes, as tar does
    except TypeError:
        t.extractall(sys.argv[2])
PY
fi
