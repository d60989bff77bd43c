#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU (sm_90a) and this tree: build (or
# load) the kernel, run the CUDA tests, run the transport benchmark; JSON and PNG
# under $OUT, the benchmark's table printed last.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh [TESTS...]
#
# TESTS: pytest node ids or paths (default: tests/gpu). Environment:
#   OUT           where results go (default ./gpu-check)
#   BENCH_MS      transport benchmark token counts (default 1,64,256,1024,4096; "" skips it)
#   BENCH_SHARDS  shard processes per run (default 1,8)
#   BENCH_REPS    calls per point (default 100)
#   BENCH_TRANSPORTS  (default grpc,tcp,shm,cuda-ipc,cuda-ipc-stream)
#   BENCH_MPS     1: the benchmark runs under an MPS daemon of its own (transport.py --mps)
#   BENCH_PRESET  the benchmark's preset (default: transport.py's)
#   BENCH_GAP_US  the caller's work before each "spaced" call (default: transport.py's)
#   BENCH_AB      N: then N rounds of the benchmark on the tree in .carry/base (BASE=<commit>
#                 bash scripts/gpu_carry.sh) and on this one, alternated on this machine
#                 (each installed in turn, each loading its own kernel library), into
#                 $OUT/base-R and $OUT/head-R
#   BENCH_SERVE   more `expertd serve` flags for the benchmark's shards (--serve-args)
#   EXAMPLE       1: also run examples/remote_experts_hf.py --device cuda --local-baseline
#                 (needs transformers: HF=1 bash scripts/gpu_carry.sh) under an MPS daemon
#   EXPERTD_KERNEL_LIB  a prebuilt libexpertd_kernels.so (skips the build)
#   PACK          1: at the end, everything under $OUT packed into $OUT/gpu-check.tgz alone
#                 (for a runner that brings back only a few files)
# What the machine lacks may travel in .whl/ beside the tree (scripts/gpu_carry.sh makes
# it): wheels (.whl/*.whl, .whl/hf/*.whl) are installed into /tmp/site first, package
# trees (.whl/*.txz, e.g. NIXL slimmed to fit what travels with a call) unpacked there.
set -uo pipefail
OUT=${OUT:-gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

shopt -s nullglob
trees=(.whl/*.txz) wheels=(.whl/*.whl .whl/*/*.whl)
shopt -u nullglob
if [ ${#trees[@]} -gt 0 ] || [ ${#wheels[@]} -gt 0 ]; then
  mkdir -p /tmp/site
  for tree in "${trees[@]}"; do
    tar -xJf "$tree" -C /tmp/site || exit 1
  done
  if [ ${#wheels[@]} -gt 0 ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "${wheels[@]}" || exit 1
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
if [ -z "${EXPERTD_KERNEL_LIB:-}" ] && [ -f .carry/libexpertd_kernels.so ]; then
  export EXPERTD_KERNEL_LIB=$PWD/.carry/libexpertd_kernels.so
fi
[ -n "${EXPERTD_KERNEL_LIB:-}" ] || $PY -m expertd build-kernels || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader

echo "== CUDA tests"  # -P: the checkout's kernels/ folder must not shadow the kernels package
$PY -P -m pytest -q -p no:cacheprovider -o addopts="" -m cuda --timeout 300 \
  "${@:-tests/gpu}" 2>&1 | tee "$OUT/tests.log" | grep -v "^I[0-9]" | tail -40
tests_rc=${PIPESTATUS[0]}

kind=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-' | tr 'A-Z' 'a-z')
bench() {  # bench OUTDIR: the transport benchmark, its table printed
  mkdir -p "$1"
  $PY benchmarks/transport.py --out "$1" --device cuda \
    --ms "${BENCH_MS-1,64,256,1024,4096}" --shards "${BENCH_SHARDS:-1,8}" \
    --reps "${BENCH_REPS:-100}" --transports "${BENCH_TRANSPORTS:-grpc,tcp,shm,cuda-ipc,cuda-ipc-stream}" \
    $([ "${BENCH_MPS:-0}" = 1 ] && echo --mps) \
    ${BENCH_PRESET:+--preset "$BENCH_PRESET"} ${BENCH_GAP_US:+--gap-us "$BENCH_GAP_US"} \
    ${BENCH_SERVE:+--serve-args "$BENCH_SERVE"} --kind "$kind" \
    2>&1 | tee "$1/transport.log" | grep -v "^I[0-9]\|^{"
  return "${PIPESTATUS[0]}"
}
install() {  # install TREE: the expertd package this process and the shards import
  $PY -m pip install -q --no-deps --no-build-isolation --no-index -e "$1" >>"$OUT/install.log" 2>&1 \
    || { echo "installing $1 failed (see $OUT/install.log)"; return 1; }
}
rc=0
if [ -n "${BENCH_MS-1,64,256,1024,4096}" ]; then
  if [ "${BENCH_AB:-0}" -gt 0 ]; then
    [ -d .carry/base ] || { echo "BENCH_AB needs .carry/base (BASE=<commit> bash scripts/gpu_carry.sh)"; exit 1; }
    head_lib=${EXPERTD_KERNEL_LIB:-}
    for round in $(seq "$BENCH_AB"); do
      for tree in base head; do
        echo "== transport benchmark, $tree tree, round $round"
        install "$([ $tree = base ] && echo .carry/base || echo .)" || exit 1
        if [ $tree = base ] && [ -f .carry/base/libexpertd_kernels.so ]; then
          export EXPERTD_KERNEL_LIB=$PWD/.carry/base/libexpertd_kernels.so
        elif [ -n "$head_lib" ]; then
          export EXPERTD_KERNEL_LIB=$head_lib
        else
          unset EXPERTD_KERNEL_LIB
        fi
        bench "$OUT/$tree-$round" || rc=1
      done
    done
    install . || exit 1
  else
    echo "== transport benchmark"
    bench "$OUT" || rc=1
  fi
fi
ex_rc=0
if [ "${EXAMPLE:-0}" = 1 ]; then
  echo "== example (under an MPS daemon of its own)"
  mps=$(mktemp -d)
  export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d
  $PY examples/remote_experts_hf.py --device cuda --new-tokens 32 --local-baseline 2>&1 \
    | tee "$OUT/example.log" | grep -v "^I[0-9]" | tail -8
  ex_rc=${PIPESTATUS[0]}
  (echo quit | nvidia-cuda-mps-control &)  # detached: the daemon may wait for its clients
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi
echo "== tests rc=$tests_rc benchmark rc=$rc example rc=$ex_rc"
if [ "${PACK:-0}" = 1 ]; then
  tar -czf /tmp/gpu-check.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu-check.tgz "$OUT/"
fi
exit $((tests_rc || rc || ex_rc))
