#!/usr/bin/env bash
# Installs the runtime libraries of NIXL (the KV transport library) for `--transport nixl`, and
# prints the directory that holds libnixl_capi.so as its last line: give it to the workers as
# --nixl-lib DIR (or TANDEM_NIXL_LIB=DIR).
#
# The libraries come from PyPI's nixl-cu12 wheel, pinned below. The wheel is downloaded without
# its dependencies (no torch) and unpacked without installing it: NIXL's C API, its plugins
# (UCX among them) and the libraries they link, which the wheel bundles (its own UCX included).
# The wheel's sha256 is checked before anything is unpacked. Nothing outside the directory is
# touched, and a second run with the directory in place only prints it.
#
# Layout of $dir: lib/ (libnixl_capi.so, libnixl.so, plugins/, and NIXL_VERSION, which Tandem
# checks against the release it is built for) beside nixl_cu12.libs/ (what lib/'s run path
# names). Works without a GPU: NIXL loads CUDA only where it finds it.
#
# Environment:
#   TANDEM_NIXL_DIR  where to install (default: $HOME/.cache/tandem/nixl/<version>)
#   PYTHON           interpreter with pip (default: python3)
set -euo pipefail

version="1.5.1"
wheel="nixl_cu12-$version-cp311-cp311-manylinux_2_28_x86_64.whl"
sha256_want="341d0dfa499f941c054614252f1d8047d1380e33f29c87707372ff5ec7d3779a"
dir="${TANDEM_NIXL_DIR:-$HOME/.cache/tandem/nixl/$version}"
python="${PYTHON:-python3}"

die() { echo "fetch-nixl: $*" >&2; exit 1; }

if [[ "$(uname -m)" != x86_64 ]]; then
  die "the pinned wheel is for x86_64 Linux; this machine is $(uname -m)"
fi
if [[ -f "$dir/lib/libnixl_capi.so" && "$(cat "$dir/lib/NIXL_VERSION" 2>/dev/null)" == "$version" ]]; then
  echo "NIXL $version already installed" >&2
  echo "$dir/lib"
  exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "downloading nixl-cu12==$version from PyPI (about 70 MB, without its dependencies)..." >&2
# The wheel is built for CPython 3.11, but only its shared libraries are used: ask for that
# wheel whatever Python runs pip.
if ! "$python" -m pip download --quiet --no-deps --disable-pip-version-check --dest "$tmp" \
  --only-binary=:all: --python-version 3.11 --platform manylinux_2_28_x86_64 "nixl-cu12==$version"; then
  die "could not download nixl-cu12==$version from PyPI"
fi
[[ -f "$tmp/$wheel" ]] || die "pip did not produce $wheel"
sha256_got="$(sha256sum "$tmp/$wheel" | cut -d' ' -f1)"
[[ "$sha256_got" == "$sha256_want" ]] || die "$wheel has sha256 $sha256_got, expected $sha256_want"

"$python" - "$tmp/$wheel" "$tmp/unpacked" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
keep = (".nixl_cu12.mesonpy.libs/", "nixl_cu12.libs/")
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(keep) and not n.endswith("/")]
    if not any(n.endswith("/libnixl_capi.so") for n in names):
        sys.exit("fetch-nixl: the wheel holds no libnixl_capi.so")
    for n in names:
        z.extract(n, out)
PY
chmod -R u+rwX,go+rX "$tmp/unpacked"
mkdir -p "$(dirname "$dir")"
rm -rf "$dir.partial"
mkdir "$dir.partial"
mv "$tmp/unpacked/.nixl_cu12.mesonpy.libs" "$dir.partial/lib"
mv "$tmp/unpacked/nixl_cu12.libs" "$dir.partial/nixl_cu12.libs"
echo "$version" >"$dir.partial/lib/NIXL_VERSION"
rm -rf "$dir"
mv "$dir.partial" "$dir"
echo "NIXL $version installed in $dir" >&2
echo "$dir/lib"
