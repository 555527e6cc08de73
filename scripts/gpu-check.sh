#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, in one command from the repository root,
#
#   1. nvidia-smi;
#   2. the engine's GPU tests (engine/tests/cuda_*.rs) with TANDEM_REQUIRE_GPU=1, so a test that
#      cannot reach the GPU fails instead of skipping; then, where cargo exists, the GPU KV
#      transport tests (transport/tests/gpu_kinds.rs, nccl_gpu.rs, tests/e2e/tests/gpu_transports.rs:
#      cuda-ipc and nccl bytes, parity with the CPU cluster, cancellations);
#   3. logits parity of `tandem logits --device cuda:0` against transformers for the tiny
#      reference models (tests/reference/fixtures), in f32 and in bf16;
#   4. a random-weight Qwen3-0.6B-shaped model built there with transformers
#      (scripts/gpu/make_qwen3_shaped.py) and the same parity check on it, in bf16 and f32;
#   5. transformers' speed on that model (scripts/gpu/hf_bench.py, which also measures the GPU's
#      bf16 matmul peak) and `tandem backend-bench` on it (decode at batch 1/16/64/256, context
#      1024, prefill of 2048 tokens) next to the bandwidth and matmul bounds;
#   6. `tandem bench --transfer` on that model's KV geometry: cuda-ipc (and nccl when there is a
#      second GPU) next to a device-to-device copy of the same bytes;
#
# then prints one table (scripts/gpu/summary.py). Results go to target/gpu-check/out, and to $OUT
# when it is set: summary.md, results.json and the full log. Exit status 1 when a stage failed.
#
# Building: where `cargo` exists the script builds what it needs (release). A GPU machine without
# a Rust toolchain runs binaries built elsewhere: on the build machine (x86-64 Linux, glibc no
# newer than the GPU machine's) run
#
#   scripts/gpu-check.sh --prebuild
#
# which builds `tandem` and the cuda_* test binaries into target/gpu-check/bin, then take that
# directory along (it is ignored by git) and run `scripts/gpu-check.sh` there. The test binaries
# find the fixtures through the path they were built at; the script links that path to this
# checkout when they differ.
#
# Options:
#   --prebuild     build the binaries into target/gpu-check/bin and exit
#   --cpu-smoke    run every stage on the CPU with small shapes (no GPU needed): checks the
#                  plumbing, not the GPU
#   --skip-tests   skip stage 2
# Environment: PYTHON (default python3; needs torch, transformers, safetensors, numpy), TANDEM_BIN
# (a tandem binary to use instead of building one),
# GPU_CHECK_BUDGET (seconds for the whole run, default 570: each stage gets what is left).
set -uo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
base="$root/target/gpu-check"
bindir="$base/bin"
mode=gpu
skip_tests=0
for arg in "$@"; do
  case "$arg" in
    --prebuild) mode=prebuild ;;
    --cpu-smoke) mode=cpu ;;
    --skip-tests) skip_tests=1 ;;
    *) echo "gpu-check: unknown option $arg" >&2; exit 2 ;;
  esac
done

cuda_test_names() {
  # cuda_*.rs, and the files whose tests run one body per device (device_test!).
  for f in engine/tests/cuda_*.rs $(grep -l 'device_test!(' engine/tests/*.rs); do
    [[ -e "$f" ]] && basename "$f" .rs
  done | sort -u
}

# ---------------------------------------------------------------------------------------------
# --prebuild: release binaries for a machine without cargo.
# ---------------------------------------------------------------------------------------------
if [[ "$mode" == prebuild ]]; then
  set -e
  mkdir -p "$bindir"
  rm -f "$bindir"/*
  cargo build --release -p tandem-cli
  cp target/release/tandem "$bindir/"
  tests=()
  for t in $(cuda_test_names); do tests+=(--test "$t"); done
  if ((${#tests[@]})); then
    # The executables cargo reports for the test targets.
    cargo test --release -p tandem-engine --no-run "${tests[@]}" --message-format=json \
      | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do cp "$exe" "$bindir/$name"; done
  fi
  # Debug info is most of their size; the copy must travel light.
  for f in "$bindir"/*; do strip --strip-debug "$f" 2>/dev/null || true; done
  echo "$root" >"$bindir/build-root"
  du -sh "$bindir"/* | sed 's/^/gpu-check: /' >&2
  echo "gpu-check: prebuilt into $bindir" >&2
  exit 0
fi

# ---------------------------------------------------------------------------------------------
# The check.
# ---------------------------------------------------------------------------------------------
python="${PYTHON:-python3}"
budget="${GPU_CHECK_BUDGET:-570}"
res="$base/out"
work="$base/work"
rm -rf "$res"
mkdir -p "$res" "$work"
log="$res/gpu-check.log"
stages="$res/stages.tsv"
: >"$stages"
export TANDEM_KERNEL_CACHE="$base/kernel-cache"
export TANDEM_REQUIRE_GPU=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
failed=0

say() { echo "gpu-check: $*" | tee -a "$log" >&2; }

# run_stage NAME LIMIT CMD...: runs CMD with at most LIMIT seconds (less when the budget is
# nearly spent), appends its output to the log, records status and time.
run_stage() {
  local name="$1" limit="$2"
  shift 2
  local left=$((budget - SECONDS))
  ((limit > left)) && limit=$left
  if ((limit < 10)); then
    say "$name: skipped, the time budget is spent"
    printf '%s\tskipped (no time left)\t0\n' "$name" >>"$stages"
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
  printf '%s\t%s\t%s\n' "$name" "$status" "$dt" >>"$stages"
  say "$name: $status in ${dt}s"
  [[ "$status" == ok ]]
}

# The CUDA libraries the engine loads at run time (cuBLAS, NVRTC): the toolkit's, or the ones
# PyTorch's wheels ship.
libdirs=""
for lib in libcublas.so.13 libnvrtc.so.13; do
  dir="$(find "$root/target/nvrtc/lib" /usr/local/cuda/lib64 /usr/local/cuda/targets /usr/local /opt /usr/lib \
    -name "$lib" -print -quit 2>/dev/null | xargs -r dirname)"
  [[ -n "$dir" && ":$libdirs:" != *":$dir:"* ]] && libdirs="${libdirs:+$libdirs:}$dir"
done
export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
say "mode $mode; LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

# Binaries: $TANDEM_BIN, else prebuilt, else built here.
tandem="$bindir/tandem"
if [[ -n "${TANDEM_BIN:-}" ]]; then
  tandem="$TANDEM_BIN"
  say "using $tandem (TANDEM_BIN)"
  printf 'build\tprebuilt\t0\n' >>"$stages"
elif [[ -x "$tandem" ]]; then
  say "using the prebuilt binaries in $bindir"
  printf 'build\tprebuilt\t0\n' >>"$stages"
  built_at="$(cat "$bindir/build-root" 2>/dev/null || echo "$root")"
  if [[ "$built_at" != "$root" && ! -e "$built_at" ]]; then
    mkdir -p "$(dirname "$built_at")" && ln -s "$root" "$built_at" \
      && say "linked $built_at -> $root (the test binaries' fixture paths)"
  fi
elif command -v cargo >/dev/null; then
  run_stage build 400 cargo build --release -p tandem-cli || true
  tandem="$root/target/release/tandem"
else
  say "no prebuilt binaries in $bindir and no cargo: run scripts/gpu-check.sh --prebuild on a build machine and bring target/gpu-check along"
  printf 'build\tfailed (no binaries, no cargo)\t0\n' >>"$stages"
  exit 1
fi

if [[ "$mode" == gpu ]]; then
  device=cuda:0
  nvidia-smi 2>&1 | tee "$res/nvidia-smi.txt" | tee -a "$log"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader \
    >"$res/gpu.txt" 2>/dev/null || echo "nvidia-smi failed" >"$res/gpu.txt"
  # Qwen3-0.6B's shape and the issue's benchmark.
  qwen_flags=()
  hf_flags=()
  bench_flags=(--batch 1,16,64,256 --context 1024 --prefill 2048)
else
  device=cpu
  echo "cpu smoke run (no GPU)" >"$res/gpu.txt"
  qwen_flags=(--device cpu --hidden 128 --layers 3 --heads 4 --kv-heads 2 --head-dim 32 --ffn 256 --vocab 4096
    --max-pos 2048 --prompt-lens 1,9,40 --new-tokens 6)
  hf_flags=(--device cpu --dtype float32 --batch 1,4 --context 64 --new-tokens 4 --prefill 128 --matmul-size 512
    --copy-mib 64)
  bench_flags=(--batch 1,4 --context 64 --prefill 128 --steps 8)
fi

# 2. GPU tests.
if [[ "$mode" == gpu && "$skip_tests" == 0 ]]; then
  names="$(cuda_test_names)"
  if [[ -z "$names" ]]; then
    say "no engine/tests/cuda_*.rs"
  elif [[ -x "$bindir/tandem" ]]; then
    for t in $names; do
      if [[ -x "$bindir/$t" ]]; then
        (cd engine && run_stage "test $t" 240 "$bindir/$t" --test-threads=1) || true
      else
        say "test $t: not prebuilt"
        printf 'test %s\tfailed (not prebuilt)\t0\n' "$t" >>"$stages"
        failed=1
      fi
    done
  else
    args=()
    for t in $names; do args+=(--test "$t"); done
    run_stage "cuda tests" 400 cargo test --release -p tandem-engine "${args[@]}" -- --test-threads=1 || true
  fi
  # The GPU KV transports (cuda-ipc, nccl): in one process (bytes equal, cancellation), then
  # through the real processes (greedy parity with the CPU cluster, cancellations leave every
  # block free). Built here: they need cargo.
  if command -v cargo >/dev/null; then
    run_stage "test transports" 300 cargo test --release -p tandem-transport --test gpu_kinds --test nccl_gpu \
      -- --test-threads=1 || true
    run_stage "test gpu clusters" 400 cargo test --release -p tandem-e2e --test gpu_transports \
      -- --test-threads=1 || true
  else
    say "transport tests: not run (they need cargo; the prebuilt binaries do not include them)"
    printf 'test transports\tfailed (no cargo)\t0\n' >>"$stages"
  fi
  # A skip means the GPU was not reached: that is a failure here.
  if grep -q "^SKIPPED" "$log"; then
    say "some GPU tests skipped (see the log)"
    printf 'tests skipped\tfailed (a GPU test skipped)\t0\n' >>"$stages"
    failed=1
  fi
fi

# 3. Tiny models: f32 must match tightly and give the reference's greedy tokens; bf16 within 2e-2.
fixtures=()
for m in llama-gqa llama3-rope-scaled qwen3 qwen2-mqa mistral mistral-sliding; do
  fixtures+=("$root/tests/reference/fixtures/$m")
done
run_stage "parity tiny f32" 150 "$python" scripts/gpu/compare_logits.py --tandem "$tandem" --device "$device" \
  --dtype f32 --rel-tol 1e-3 --greedy-min 1.0 --label "tiny models" --json "$res/parity-tiny-f32.json" \
  "${fixtures[@]}" || true
run_stage "parity tiny bf16" 150 "$python" scripts/gpu/compare_logits.py --tandem "$tandem" --device "$device" \
  --dtype bf16 --rel-tol 2e-2 --label "tiny models" --json "$res/parity-tiny-bf16.json" "${fixtures[@]}" || true

# 4. The Qwen3-0.6B-shaped model.
qwen="$work/qwen3-shaped"
if run_stage "build qwen3-shaped" 180 "$python" scripts/gpu/make_qwen3_shaped.py --out "$qwen" "${qwen_flags[@]}"; then
  cp "$qwen/reference.json" "$res/qwen3-shaped-reference.json"
  run_stage "parity qwen3-shaped bf16" 150 "$python" scripts/gpu/compare_logits.py --tandem "$tandem" \
    --device "$device" --dtype bf16 --rel-tol 2e-2 --label "qwen3-shaped" --json "$res/parity-qwen3-bf16.json" \
    "$qwen" || true
  run_stage "parity qwen3-shaped f32" 150 "$python" scripts/gpu/compare_logits.py --tandem "$tandem" \
    --device "$device" --dtype f32 --rel-tol 1e-3 --label "qwen3-shaped" --json "$res/parity-qwen3-f32.json" \
    "$qwen" || true

  # 5. Speed: transformers first (it also measures the matmul peak the prefill bound uses).
  run_stage "transformers bench" 200 "$python" scripts/gpu/hf_bench.py --model "$qwen" --json "$res/hf-bench.json" \
    "${hf_flags[@]}" || true
  peak=()
  if [[ -s "$res/hf-bench.json" ]]; then
    p="$("$python" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("matmul_tflops", ""))' \
      "$res/hf-bench.json")"
    [[ -n "$p" ]] && peak=(--peak-tflops "$p")
  fi
  run_stage "tandem backend-bench" 200 bash -c '"$@" >"'"$res/tandem-bench.json"'"' _ \
    "$tandem" backend-bench --model "$qwen" --device "$device" --dtype bf16 "${bench_flags[@]}" "${peak[@]}" --json \
    || true

  # 6. KV transfers on Qwen3-0.6B's KV geometry: cuda-ipc (and nccl with a second GPU) next to a
  # device-to-device copy of the same bytes; host transports in the CPU smoke run.
  if [[ "$mode" == gpu ]]; then
    to="$device"
    if nvidia-smi -L 2>/dev/null | grep -q '^GPU 1:'; then to=cuda:1; fi
    transfer_flags=(--device "$device" --transfer-to "$to" --transfer-tokens 1024,4096,16384)
  else
    transfer_flags=(--transfer-tokens 64,256 --reps 2)
  fi
  run_stage "transfer bench" 200 bash -c '"$@" >"'"$res/transfer-bench.md"'"' _ \
    "$tandem" bench --transfer --model "$qwen" "${transfer_flags[@]}" || true
fi

# Stages run in subshells (the tests) cannot set `failed`; the table of stages is the record.
awk -F'\t' '$2 != "ok" && $2 != "prebuilt" { bad = 1 } END { exit !bad }' "$stages" && failed=1
"$python" scripts/gpu/summary.py "$res" | tee "$res/summary.md"
if [[ -s "$res/transfer-bench.md" ]]; then
  { echo; cat "$res/transfer-bench.md"; } | tee -a "$res/summary.md"
fi
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  cp "$res/summary.md" "$res/results.json" "$log" "$OUT/" 2>/dev/null
  say "results copied to $OUT"
fi
say "done in ${SECONDS}s; $([[ $failed == 0 ]] && echo 'every stage passed' || echo 'SOME STAGES FAILED')"
exit "$failed"
