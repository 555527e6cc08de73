#!/usr/bin/env bash
# The GPU check: everything that says whether the CUDA backend and the GPU KV transports are right
# and how fast they are, on a machine with an NVIDIA GPU, run as stages that each fit in one
# device call of under 10 minutes:
#
#   tests       the engine's GPU tests (engine/tests/cuda_*.rs and every test file with
#               device_test! bodies), with TANDEM_REQUIRE_GPU=1 so that a test that cannot reach
#               the GPU fails instead of skipping;
#   transports  the GPU KV transport tests: transport/tests/gpu_kinds.rs and nccl_gpu.rs (bytes,
#               cancellation, in one process), then tests/e2e/tests/gpu_transports.rs (real
#               processes: greedy parity with the CPU cluster, cancellations leave every block);
#   parity      logits of `tandem logits --device cuda:0` against transformers for the tiny
#               reference models (tests/reference/fixtures), in f32 and bf16; then a random-weight
#               Qwen3-0.6B-shaped model built there (scripts/gpu/make_qwen3_shaped.py) and the same
#               check on it;
#   bench       transformers' speed on that model (scripts/gpu/hf_bench.py, which also measures
#               the GPU's bf16 matmul peak) and `tandem backend-bench` on it, next to the
#               bandwidth and matmul bounds;
#   transfer    `tandem bench --transfer` on that model's KV geometry: cuda-ipc (and nccl with a
#               second GPU) next to a device-to-device copy of the same bytes;
#   cluster     a disaggregated `tandem up` on the GPU over cuda-ipc, a Qwen3-shaped body with the
#               tiny fixtures' 448-token vocabulary (so every sampled id decodes), loaded by
#               `tandem bench --router` at concurrency 1 and 16: TTFT, ITL, output tok/s;
#   all         every stage above, in one run (default; for a machine without a 10-minute limit).
#
# Each stage adds its own rows and files to target/gpu-check/out, so stages run as separate calls
# on one machine add up; every call prints the table of all results so far
# (scripts/gpu/summary.py) and copies the results to $OUT when it is set. docs/gpu.md lists the
# calls a GPU session makes, in order. Exit status 1 when a stage of this call failed.
#
# Building. The GPU machine may have no Rust toolchain and no network: on a build machine
# (x86-64 Linux, glibc no newer than the GPU machine's) run
#
#   scripts/gpu-check.sh --prebuild
#
# which builds every binary the stages run (tandem, tandem-router, tandem-prefill, tandem-decode
# and the test executables above) in release mode, strips them and packs them into one compressed
# file, target/gpu-check/bundle.tar.xz. It prints the size and fails when the bundle and the
# working tree together would not fit in the 64 MiB a device call carries. Bring that one file
# along (it is ignored by git); the check unpacks it and never calls cargo. Test executables find
# the fixtures through the path they were built at; the script links that path to this checkout
# when they differ. Where cargo exists and no bundle does, the check builds what it needs.
#
# Options:
#   --stage NAME   run one stage (tests, transports, parity, bench, transfer, cluster, all)
#   --prebuild     build the bundle and exit
#   --check-fit F  say whether file F and the working tree fit in one device call (exit 1: no)
#   --cpu-smoke    run the stages on the CPU with small shapes (no GPU needed): checks the plumbing
#                  (the bundle, scripts, file formats, the table), not the GPU; GPU tests skip
#   --skip-tests   with --stage all: leave out tests and transports
# Environment: PYTHON (default python3; torch, transformers, safetensors, numpy), TANDEM_BIN (a
# tandem binary to use instead), GPU_CHECK_BUDGET (seconds for this call, default 540: each step
# gets at most what is left).
set -uo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
base="$root/target/gpu-check"
bundle_file="$base/bundle.tar.xz"
bundle="$base/bundle"
carry_limit=$((64 * 1024 * 1024))
server_bins=(tandem tandem-router tandem-prefill tandem-decode)
transport_tests=(gpu_kinds nccl_gpu)
cluster_tests=(gpu_transports)
mode=gpu
stage=all
skip_tests=0
fit_file=""
while (($#)); do
  case "$1" in
    --prebuild) mode=prebuild ;;
    --check-fit)
      mode=check-fit
      fit_file="${2:-}"
      shift
      ;;
    --cpu-smoke) mode=cpu ;;
    --skip-tests) skip_tests=1 ;;
    --stage)
      stage="${2:-}"
      shift
      ;;
    --stage=*) stage="${1#--stage=}" ;;
    *) echo "gpu-check: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
case "$stage" in
  tests | transports | parity | bench | transfer | cluster | all) ;;
  *) echo "gpu-check: unknown stage '$stage' (tests, transports, parity, bench, transfer, cluster, all)" >&2; exit 2 ;;
esac

cuda_test_names() {
  # cuda_*.rs, and the files whose tests run one body per device (device_test!).
  for f in engine/tests/cuda_*.rs $(grep -l 'device_test!(' engine/tests/*.rs); do
    [[ -e "$f" ]] && basename "$f" .rs
  done | sort -u
}

# Bytes of the working tree a device call carries: tracked files and untracked ones git does not
# ignore.
tree_bytes() {
  git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null \
    | awk '{ s += $1 } END { print s + 0 }'
}

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

# fits FILE: says whether FILE and the working tree fit in what one device call carries.
fits() {
  local size tree total
  size=$(stat -c %s "$1") || return 1
  tree=$(tree_bytes)
  total=$((size + tree))
  echo "gpu-check: bundle $1: $(mib "$size"); working tree $(mib "$tree"); a device call carries $(mib "$total") of at most $(mib "$carry_limit")" >&2
  if ((total > carry_limit)); then
    echo "gpu-check: the bundle does not fit: a device call carries at most $(mib "$carry_limit")" >&2
    return 1
  fi
}

if [[ "$mode" == check-fit ]]; then
  [[ -f "$fit_file" ]] || { echo "gpu-check: --check-fit needs a file" >&2; exit 2; }
  fits "$fit_file"
  exit
fi

# ---------------------------------------------------------------------------------------------
# --prebuild: the bundle, for a machine without cargo.
# ---------------------------------------------------------------------------------------------
if [[ "$mode" == prebuild ]]; then
  set -e
  rm -rf "$bundle" "$bundle_file"
  mkdir -p "$bundle/bin" "$bundle/tests"
  echo "gpu-check: building the server binaries (release)" >&2
  cargo build --release --workspace --bins
  for b in "${server_bins[@]}"; do cp "target/release/$b" "$bundle/bin/"; done
  want=($(cuda_test_names) "${transport_tests[@]}" "${cluster_tests[@]}")
  args=()
  for t in "${want[@]}"; do args+=(--test "$t"); done
  echo "gpu-check: building the GPU test executables (release): ${want[*]}" >&2
  # The executables cargo reports for those test targets (the same feature set as the binaries).
  cargo test --release --workspace --no-run "${args[@]}" --message-format=json \
    | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do cp "$exe" "$bundle/tests/$name"; done
  for t in "${want[@]}"; do
    [[ -x "$bundle/tests/$t" ]] || { echo "gpu-check: test executable $t was not built" >&2; exit 1; }
  done
  # Symbols and debug info are most of their size; the bundle must travel light.
  for f in "$bundle"/bin/* "$bundle"/tests/*; do strip --strip-all "$f"; done
  echo "$root" >"$bundle/build-root"
  # xz with a large window: the executables link the same crates, and gzip's 32 KiB window
  # cannot see that (53.6 MiB with gzip -9 against 13.6 MiB on 2026-12-07).
  echo "gpu-check: compressing the bundle (xz -9, about a minute)" >&2
  tar -C "$base" -cf - bundle | xz -9 -T2 >"$bundle_file"
  du -sh "$bundle"/bin/* "$bundle"/tests/* | sed 's/^/gpu-check:   /' >&2
  echo "gpu-check: unpacked $(du -sh "$bundle" | cut -f1)" >&2
  fits "$bundle_file" || exit 1
  echo "gpu-check: carry target/gpu-check/bundle.tar.xz with the call; the check unpacks it" >&2
  exit 0
fi

# ---------------------------------------------------------------------------------------------
# The check.
# ---------------------------------------------------------------------------------------------
python="${PYTHON:-python3}"
budget="${GPU_CHECK_BUDGET:-540}"
res="$base/out"
work="$base/work"
mkdir -p "$res" "$work"
# This call's rows and log; other stages' results stay (they add up in the table).
tag="$stage"
[[ "$mode" == cpu ]] && tag="cpu-$stage"
log="$res/gpu-check-$tag.log"
stages="$res/stages-$tag.tsv"
: >"$stages"
: >"$log"
export TANDEM_KERNEL_CACHE="$base/kernel-cache"
if [[ "$mode" == gpu ]]; then
  export TANDEM_REQUIRE_GPU=1
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
failed=0

say() { echo "gpu-check: $*" | tee -a "$log" >&2; }
record() { printf '%s\t%s\t%s\n' "$1" "$2" "${3:-0}" >>"$stages"; }

# run_step NAME LIMIT CMD...: runs CMD with at most LIMIT seconds (less when the budget is nearly
# spent), appends its output to the log, records status and time.
run_step() {
  local name="$1" limit="$2"
  shift 2
  local left=$((budget - SECONDS))
  ((limit > left)) && limit=$left
  if ((limit < 10)); then
    say "$name: skipped, the time budget is spent (run this stage again: kernels are cached)"
    record "$name" "skipped (no time left)"
    failed=1
    return 1
  fi
  say "$name (at most ${limit}s)"
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  local dt=$((SECONDS - t0)) status=ok
  if ((rc == 124 || rc == 137)); then
    status="timed out after ${limit}s"
  elif ((rc != 0)); then
    status="failed (exit $rc)"
  fi
  [[ "$status" == ok ]] || failed=1
  record "$name" "$status" "$dt"
  say "$name: $status in ${dt}s"
  [[ "$status" == ok ]]
}

# First existing directory holding LIB among the usual places: the toolkit, /usr, /opt (PyTorch's
# wheels ship cuBLAS, NVRTC and NCCL in site-packages/nvidia/*/lib), and target/nvrtc.
find_lib() {
  find "$root/target/nvrtc/lib" /usr/local/cuda/lib64 /usr/local/cuda/targets /usr/local /opt /usr/lib \
    -name "$1" -print -quit 2>/dev/null
}
libdirs=""
for lib in libcublas.so.13 libnvrtc.so.13; do
  dir="$(find_lib "$lib" | xargs -r dirname)"
  [[ -n "$dir" && ":$libdirs:" != *":$dir:"* ]] && libdirs="${libdirs:+$libdirs:}$dir"
done
export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# NCCL: the library search looks in a Python environment only when VIRTUAL_ENV (or CONDA_PREFIX)
# names it; name the file instead.
if [[ -z "${TANDEM_NCCL_LIBRARY:-}" ]]; then
  nccl="$(find_lib libnccl.so.2)"
  [[ -n "$nccl" ]] && export TANDEM_NCCL_LIBRARY="$nccl"
fi
say "mode $mode, stage $stage; LD_LIBRARY_PATH=$LD_LIBRARY_PATH; TANDEM_NCCL_LIBRARY=${TANDEM_NCCL_LIBRARY:-(not found)}"

# Binaries: the bundle (unpacked once per copy of it), else built here with cargo.
prebuilt=0
if [[ -f "$bundle_file" ]]; then
  if [[ ! -f "$bundle/build-root" || "$bundle_file" -nt "$bundle/build-root" ]]; then
    rm -rf "$bundle"
    scripts/gpu/unpack.sh "$bundle_file" "$base" && touch "$bundle/build-root" && say "unpacked $bundle_file"
  fi
fi
if [[ -x "$bundle/bin/tandem" ]]; then
  prebuilt=1
  say "using the prebuilt binaries in $bundle"
  record build prebuilt
  built_at="$(cat "$bundle/build-root")"
  if [[ "$built_at" != "$root" && ! -e "$built_at" ]]; then
    mkdir -p "$(dirname "$built_at")" && ln -s "$root" "$built_at" \
      && say "linked $built_at -> $root (the test executables' fixture paths)"
  fi
  export TANDEM_BIN_DIR="$bundle/bin"
fi
tandem="$bundle/bin/tandem"
if [[ -n "${TANDEM_BIN:-}" ]]; then
  tandem="$TANDEM_BIN"
  say "using $tandem (TANDEM_BIN)"
elif ((!prebuilt)); then
  if command -v cargo >/dev/null; then
    run_step build 400 cargo build --release --workspace --bins || true
    tandem="$root/target/release/tandem"
  else
    say "no bundle ($bundle_file) and no cargo: run scripts/gpu-check.sh --prebuild on a build machine and bring the bundle along"
    record build "failed (no bundle, no cargo)"
    exit 1
  fi
fi

if [[ "$mode" == gpu ]]; then
  device=cuda:0
  nvidia-smi 2>&1 | tee "$res/nvidia-smi.txt" | tee -a "$log" >/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader \
    >"$res/gpu.txt" 2>/dev/null || echo "nvidia-smi failed" >"$res/gpu.txt"
  # Qwen3-0.6B's shape and the issue's benchmark.
  qwen_flags=()
  hf_flags=()
  bench_flags=(--batch 1,16,64,256 --context 1024 --prefill 2048)
  split_flags=(--batch 1 --context 1024 --prefill 2048 --steps 4)
  kv_flags=(--batch 1,16,64,256 --context 1024 --prefill 0 --steps 16)
  gemv_flags=(--batch 1 --context 1024 --prefill 0 --steps 16)
else
  device=cpu
  echo "cpu smoke run (no GPU)" >"$res/gpu.txt"
  qwen_flags=(--device cpu --hidden 128 --layers 3 --heads 4 --kv-heads 2 --head-dim 32 --ffn 256 --vocab 4096
    --max-pos 2048 --prompt-lens 1,9,40 --new-tokens 6)
  hf_flags=(--device cpu --dtype float32 --batch 1,4 --context 64 --new-tokens 4 --prefill 128 --matmul-size 512
    --copy-mib 64)
  bench_flags=(--batch 1,4 --context 64 --prefill 128 --steps 8)
  split_flags=(--batch 1 --context 64 --prefill 128 --steps 4)
  kv_flags=(--batch 1,4 --context 64 --prefill 0 --steps 4)
  gemv_flags=(--batch 1 --context 64 --prefill 0 --steps 4)
fi

# run_tests NAME DIR LIMIT PACKAGE TEST...: the prebuilt test executables, one step each (run from
# DIR, as cargo would), else `cargo test` of PACKAGE in one step. Output is not captured, so the
# log shows every SKIPPED and NOT RUN line.
run_tests() {
  local name="$1" dir="$2" limit="$3" package="$4"
  shift 4
  if ((prebuilt)); then
    local t
    for t in "$@"; do
      if [[ -x "$bundle/tests/$t" ]]; then
        (cd "$dir" && run_step "test $t" "$limit" "$bundle/tests/$t" --test-threads=1 --nocapture) || true
      else
        say "test $t: not in the bundle"
        record "test $t" "failed (not in the bundle)"
        failed=1
      fi
    done
  elif command -v cargo >/dev/null; then
    local args=() t
    for t in "$@"; do args+=(--test "$t"); done
    run_step "$name" 540 cargo test --release --workspace "${args[@]}" -- --test-threads=1 --nocapture || true
  else
    record "$name" "failed (no bundle, no cargo)"
    failed=1
  fi
}

# A skip means the GPU was not reached: a failure on a GPU machine. (nccl on one GPU prints
# NOT RUN instead: that machine cannot run it.) The exception is a real model's file, which
# does not travel to the GPU machine (a device call carries 64 MiB): those tests are recorded as
# not run, naming the model, and are no failure of the GPU.
check_skips() {
  [[ "$mode" == gpu ]] || return 0
  local skips missing
  skips="$(grep -E '(^|\.\.\. )SKIPPED' "$log")"
  missing="$(grep -E 'model missing' <<<"$skips")"
  if [[ -n "$missing" ]]; then
    local n models
    n=$(wc -l <<<"$missing")
    models="$(grep -oE 'model missing \([^)]*\)' <<<"$missing" | sed -E 's/.*\/([^/)]*)\)$/\1/' | sort -u | paste -sd, -)"
    say "$n tests not run: model not on this machine ($models)"
    record "tests needing a real model" "not run ($n: $models not on this machine)"
  fi
  if grep -vq 'model missing' <<<"$skips" && [[ -n "$skips" ]]; then
    say "some GPU tests skipped (see the log)"
    record "tests skipped" "failed (a GPU test skipped)"
    failed=1
  fi
}

stage_tests() {
  # shellcheck disable=SC2046
  run_tests "cuda tests" engine 150 tandem-engine $(cuda_test_names)
  check_skips
}

stage_transports() {
  run_tests "test transports" transport 240 tandem-transport "${transport_tests[@]}"
  run_tests "test gpu clusters" tests/e2e 400 tandem-e2e "${cluster_tests[@]}"
  check_skips
}

qwen="$work/qwen3-shaped"
# The Qwen3-shaped model, built once per machine (the parity stage builds it; bench and transfer
# build it when they run first).
ensure_qwen() {
  if [[ -s "$qwen/reference.json" ]]; then
    return 0
  fi
  run_step "build qwen3-shaped" 180 "$python" scripts/gpu/make_qwen3_shaped.py --out "$qwen" "${qwen_flags[@]}" \
    && cp "$qwen/reference.json" "$res/qwen3-shaped-reference.json"
}

stage_parity() {
  # Tiny models: f32 must match tightly and give the reference's greedy tokens; bf16 within 2e-2.
  # (phi3-longrope is left to the Rust parity test, which skips its prompts past the original
  # context: LongRoPE per position differs from transformers there, as docs/engine.md says.)
  local fixtures=() m
  for m in llama-gqa llama3-rope-scaled qwen3 qwen2-mqa mistral mistral-sliding gemma3 gemma3-classic gemma2 \
    phi3 qwen3-moe mixtral; do
    fixtures+=("$root/tests/reference/fixtures/$m")
  done
  # The exact mode is f32 compute with an f32 KV cache. bf16 compute keeps the GPU's default bf16 KV
  # cache, then f32 KV (the compute's own error) and fp8 KV. Tolerances (docs/cuda.md#kv-cache):
  # measured on the CPU with exact compute, bf16 KV alone gives a rel. error of at most 3.9e-3 and
  # fp8 KV 4.4e-2 to 1.0e-1 on these models, decisive argmax 100% for both.
  run_step "parity tiny f32" 150 "$python" scripts/gpu/compare_logits.py --tandem "$tandem" --device "$device" \
    --dtype f32 --kv-dtype f32 --rel-tol 1e-3 --greedy-min 1.0 --label "tiny models" \
    --json "$res/parity-tiny-f32.json" "${fixtures[@]}" || true
  run_step "parity tiny bf16" 150 "$python" scripts/gpu/compare_logits.py --tandem "$tandem" --device "$device" \
    --dtype bf16 --rel-tol 2e-2 --label "tiny models" --json "$res/parity-tiny-bf16.json" "${fixtures[@]}" || true
  # The other KV dtypes on four families (a lease's minutes are few): GQA, q/k norms, sliding
  # windows with soft-capping, a mixture of experts.
  local some=()
  for m in llama-gqa qwen3 gemma2 mixtral; do some+=("$root/tests/reference/fixtures/$m"); done
  run_step "parity tiny bf16, f32 KV" 90 "$python" scripts/gpu/compare_logits.py --tandem "$tandem" \
    --device "$device" --dtype bf16 --kv-dtype f32 --rel-tol 2e-2 --label "tiny models" \
    --json "$res/parity-tiny-bf16-kvf32.json" "${some[@]}" || true
  run_step "parity tiny bf16, fp8 KV" 90 "$python" scripts/gpu/compare_logits.py --tandem "$tandem" \
    --device "$device" --dtype bf16 --kv-dtype fp8 --rel-tol 0.15 --label "tiny models" \
    --json "$res/parity-tiny-bf16-kvfp8.json" "${some[@]}" || true
  ensure_qwen || return 0
  run_step "parity qwen3-shaped bf16" 150 "$python" scripts/gpu/compare_logits.py --tandem "$tandem" \
    --device "$device" --dtype bf16 --rel-tol 2e-2 --label "qwen3-shaped" --json "$res/parity-qwen3-bf16.json" \
    "$qwen" || true
  run_step "parity qwen3-shaped f32" 150 "$python" scripts/gpu/compare_logits.py --tandem "$tandem" \
    --device "$device" --dtype f32 --kv-dtype f32 --rel-tol 1e-3 --label "qwen3-shaped" \
    --json "$res/parity-qwen3-f32.json" \
    "$qwen" || true
}

stage_bench() {
  ensure_qwen || return 0
  # transformers first: it also measures the matmul peak the prefill bound uses.
  run_step "transformers bench" 200 "$python" scripts/gpu/hf_bench.py --model "$qwen" --json "$res/hf-bench.json" \
    "${hf_flags[@]}" || true
  local peak=() p
  if [[ -s "$res/hf-bench.json" ]]; then
    p="$("$python" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("matmul_tflops", ""))' \
      "$res/hf-bench.json")"
    [[ -n "$p" ]] && peak=(--peak-tflops "$p")
  fi
  run_step "tandem backend-bench" 200 bash -c '"$@" >"'"$res/tandem-bench.json"'"' _ \
    "$tandem" backend-bench --model "$qwen" --device "$device" --dtype bf16 "${bench_flags[@]}" "${peak[@]}" --json \
    || true
  # Decode with the KV cache in f32 (the cache before bf16 became the default) and in fp8, in the
  # same run: what the cache's bytes cost per step.
  local kv
  for kv in f32 fp8; do
    run_step "tandem backend-bench, $kv KV" 120 bash -c '"$@" >"'"$res/tandem-bench-kv-$kv.json"'"' _ \
      "$tandem" backend-bench --model "$qwen" --device "$device" --dtype bf16 --kv-dtype "$kv" \
      "${kv_flags[@]}" --json || true
  done
  # The baseline for the decode products of our own, in the same run: cuBLAS's products.
  run_step "tandem backend-bench, cuBLAS decode products" 90 bash -c '"$@" >"'"$res/tandem-bench-cublas.json"'"' _ \
    "$tandem" backend-bench --model "$qwen" --device "$device" --dtype bf16 "${gemv_flags[@]}" \
    --no-decode-gemv --json || true
  # The baseline for programmatic dependent launch, in the same run: kernels launched one
  # after another (decode at batch 1, where launches weigh most).
  run_step "tandem backend-bench, no PDL" 90 bash -c '"$@" >"'"$res/tandem-bench-nopdl.json"'"' _ \
    "$tandem" backend-bench --model "$qwen" --device "$device" --dtype bf16 "${gemv_flags[@]}" \
    --no-pdl --json || true
  # Seeded sampling (temperature 1, top-p 0.9) drawn on the device, and its baseline in the same
  # run: each step's logits rows copied to the host sampler.
  run_step "tandem backend-bench, sampled on the device" 90 bash -c '"$@" >"'"$res/tandem-bench-sampled.json"'"' _ \
    "$tandem" backend-bench --model "$qwen" --device "$device" --dtype bf16 "${kv_flags[@]}" --sampled --json || true
  run_step "tandem backend-bench, sampled on the host" 90 bash -c '"$@" >"'"$res/tandem-bench-hostsampled.json"'"' _ \
    "$tandem" backend-bench --model "$qwen" --device "$device" --dtype bf16 "${kv_flags[@]}" --sampled \
    --no-device-sampling --json || true
  # The baseline for prompt attention, in the same run: the CUDA-core tiled kernel instead of
  # the tensor-core one (decode steps use split-K either way). The split-K kernel's figure for
  # prompts is in the runs before 2026-12-07.
  run_step "tandem backend-bench, CUDA-core attention" 120 bash -c '"$@" >"'"$res/tandem-bench-cudacores.json"'"' _ \
    "$tandem" backend-bench --model "$qwen" --device "$device" --dtype bf16 "${split_flags[@]}" "${peak[@]}" \
    --no-tensor-core-attention --json || true
}

stage_transfer() {
  ensure_qwen || return 0
  # On Qwen3-0.6B's KV geometry: cuda-ipc (and nccl with a second GPU) next to a device-to-device
  # copy of the same bytes; host transports in the CPU smoke run.
  local flags
  if [[ "$mode" == gpu ]]; then
    local to="$device"
    if nvidia-smi -L 2>/dev/null | grep -q '^GPU 1:'; then to=cuda:1; fi
    # f32 KV: the same bytes per token as the 2026-11-26 figures it is compared with.
    flags=(--device "$device" --transfer-to "$to" --transfer-tokens 1024,4096,16384 --kv-dtype f32)
  else
    flags=(--transfer-tokens 64,256 --reps 2)
  fi
  run_step "transfer bench" 200 bash -c '"$@" >"'"$res/transfer-bench.md"'"' _ \
    "$tandem" bench --transfer --model "$qwen" "${flags[@]}" || true
}

stage_cluster() {
  local model="$work/qwen3-body-v448" flags up_flags  # flags: word lists
  if [[ ! -s "$model/config.json" ]]; then
    run_step "build qwen3-body-v448" 120 "$python" scripts/gpu/make_qwen3_shaped.py --out "$model" "${qwen_flags[@]}" \
      --vocab 448 || return 0
  fi
  if [[ "$mode" == gpu ]]; then
    up_flags="--device $device --transport cuda-ipc"
    flags="--prompt-tokens 512 --decode-tokens 64"
  else
    up_flags="--transport shm --threads 1"
    flags="--prompt-tokens 32 --decode-tokens 8"
  fi
  run_step "cluster bench" 240 bash -c '
    set -uo pipefail
    tandem="$1" model="$2" res="$3" up=($4) fl=($5)
    ready=$(mktemp)
    "$tandem" up --model "$model" "${up[@]}" >"$ready" 2>"$res/cluster-up.log" &
    pid=$!
    for _ in $(seq 1 600); do
      grep -q "^ready router=" "$ready" && break
      kill -0 $pid 2>/dev/null || { echo "tandem up exited early:"; tail -20 "$res/cluster-up.log"; exit 1; }
      sleep 0.2
    done
    router=$(sed -n "s/^ready router=\([^ ]*\).*/\1/p" "$ready" | head -n1)
    [[ -n "$router" ]] || { echo "tandem up not ready in 120 s"; tail -20 "$res/cluster-up.log"; kill -INT $pid; exit 1; }
    : >"$res/cluster-bench.jsonl"
    rc=0
    for c in 1 16; do
      "$tandem" bench --router "$router" --concurrency $c --requests $((c * 2 < 8 ? 8 : c * 2)) "${fl[@]}" --json \
        >>"$res/cluster-bench.jsonl" || rc=1
    done
    kill -INT $pid; wait $pid
    exit $rc
  ' _ "$tandem" "$model" "$res" "$up_flags" "$flags" || true
}

case "$stage" in
  tests) stage_tests ;;
  cluster) stage_cluster ;;
  transports) stage_transports ;;
  parity) stage_parity ;;
  bench) stage_bench ;;
  transfer) stage_transfer ;;
  all)
    if ((!skip_tests)); then
      stage_tests
      stage_transports
    fi
    stage_parity
    stage_bench
    stage_transfer
    stage_cluster
    ;;
esac

# Steps run in subshells (the tests) cannot set `failed`; this call's rows are the record.
awk -F'\t' '$2 != "ok" && $2 != "prebuilt" && $2 !~ /^not run/ { bad = 1 } END { exit !bad }' "$stages" && failed=1
"$python" scripts/gpu/summary.py "$res" | tee "$res/summary.md"
if [[ -s "$res/transfer-bench.md" ]]; then
  { echo; cat "$res/transfer-bench.md"; } | tee -a "$res/summary.md"
fi
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  find "$res" -maxdepth 1 -type f \( -name '*.md' -o -name '*.json' -o -name '*.tsv' -o -name '*.log' -o -name '*.txt' \) \
    -exec cp {} "$OUT/" \;
  say "results copied to $OUT"
fi
say "stage $stage done in ${SECONDS}s; $([[ $failed == 0 ]] && echo 'every step passed' || echo 'SOME STEPS FAILED')"
exit "$failed"
