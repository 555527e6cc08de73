#!/usr/bin/env bash
# Puts NVRTC (CUDA 13's run-time compiler, which needs no GPU) into target/nvrtc/lib and prints
# that directory on stdout; everything else goes to stderr. The kernels crate loads libnvrtc.so.13
# with dlopen, so callers put the printed directory on LD_LIBRARY_PATH:
#
#   export LD_LIBRARY_PATH="$(scripts/fetch-nvrtc.sh)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
#
# The libraries ship in PyPI's nvidia-cuda-nvrtc wheel; we download it without installing it (kept
# in TANDEM_NVRTC_CACHE, by default ~/.cache/tandem/nvrtc) and extract only the two libraries the
# compiler needs. The wheel has no CUDA headers, so kernel sources must not include any.
set -euo pipefail
cd "$(dirname "$0")/.."

version="13.0.88"
dest="$PWD/target/nvrtc/lib"
stamp="$dest/.version"
libs=(libnvrtc.so.13 libnvrtc-builtins.so.13.0)

if [[ -f "$stamp" && "$(cat "$stamp")" == "$version" ]] \
  && [[ -s "$dest/${libs[0]}" && -s "$dest/${libs[1]}" ]]; then
  echo "$dest"
  exit 0
fi

cache="${TANDEM_NVRTC_CACHE:-$HOME/.cache/tandem/nvrtc}"
python="${PYTHON:-python3}"
mkdir -p "$cache"
wheel="$(ls "$cache"/nvidia_cuda_nvrtc-"$version"-*.whl 2>/dev/null | sed -n 1p || true)"
if [[ -z "$wheel" ]]; then
  echo "fetch-nvrtc: downloading nvidia-cuda-nvrtc==$version from PyPI (about 90 MB)..." >&2
  tmp="$(mktemp -d "$cache/.download.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  "$python" -m pip download --quiet --disable-pip-version-check --no-deps --dest "$tmp" \
    "nvidia-cuda-nvrtc==$version" >&2
  downloaded="$(ls "$tmp"/nvidia_cuda_nvrtc-"$version"-*.whl)"
  mv "$downloaded" "$cache/"
  wheel="$cache/$(basename "$downloaded")"
fi

# Extract into a fresh directory beside the destination, then swap it in, so an interrupted run
# never leaves a half-written library where the tests would load it.
mkdir -p "$(dirname "$dest")"
part="$dest.part"
rm -rf "$part"
"$python" - "$wheel" "$part" "${libs[@]}" <<'PY'
import os, shutil, sys, zipfile
wheel, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
os.makedirs(out)
with zipfile.ZipFile(wheel) as z:
    members = {os.path.basename(m): m for m in z.namelist() if "/lib/" in m}
    for name in names:
        if name not in members:
            sys.exit(f"fetch-nvrtc: {name} is not in {wheel}")
        with z.open(members[name]) as src, open(os.path.join(out, name), "wb") as dst:
            shutil.copyfileobj(src, dst)
PY
echo "$version" >"$part/.version"
rm -rf "$dest"
mv "$part" "$dest"
echo "fetch-nvrtc: NVRTC $version in $dest" >&2
echo "$dest"
