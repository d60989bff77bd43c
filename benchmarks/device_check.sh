#!/usr/bin/env bash
# One call on the device machine: install, build, GPU tests, sanitizers, benchmark.
# Logs, JSON and PNG land under $OUT; a short table is printed last.
#   bash benchmarks/device_check.sh [tests|sanitize|bench|server|service|latency|timeline|demo|profile|all] [benchmark args...]
# (comma lists work: tests,server,service). Carry .whl (grpcio-health-checking and
# grpcio-reflection 1.84 wheels, missing on the device image) and .carry (kernel cache).
# A prebuilt kernel cache carried in .carry/kernels is used when its key matches (same sources,
# flags and nvcc); otherwise the library is rebuilt there (a few seconds).
set -u -o pipefail
OUT=${OUT:-/tmp/expertd-out}
mkdir -p "$OUT"
what=${1:-all}; shift || true
export PYTHONUNBUFFERED=1
export EXPERTD_KERNEL_CACHE=${EXPERTD_KERNEL_CACHE:-$PWD/.carry/kernels}
summary=()

if ls .whl/*.whl >/dev/null 2>&1; then  # grpcio-health-checking / -reflection 1.84 (not on the image)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { echo "pip install failed"; tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
EXPERTD_KERNEL_VERBOSE=1 python3 -m expertd.kernels.build >"$OUT/build.log" 2>&1 \
  || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
summary+=("build: ok ($(tail -1 "$OUT/build.log"))")

if [[ $what == all || $what == *tests* ]]; then
  timeout ${T_TESTS:-240} python3 -m pytest -q -s --noconftest -p no:cacheprovider -m cuda tests/test_cuda_kernels.py >"$OUT/tests.log" 2>&1
  rc=$?
  grep -E "rel err" "$OUT/tests.log" | sort -t' ' -k1,1 | tail -40
  tail -15 "$OUT/tests.log"
  summary+=("gpu tests: rc=$rc $(tail -1 "$OUT/tests.log")")
fi
if [[ $what == all || $what == *bench* ]]; then
  timeout ${T_BENCH:-240} python3 benchmarks/kernel.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | tail -22
  summary+=("bench: rc=$?")
fi
if [[ $what == all || $what == *server* ]]; then
  # The shard server with the cuda backend behind real gRPC (graphs and eager, two batches in
  # flight on the copy streams), vs float64.
  timeout ${T_SERVER:-300} python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda_server.py tests/test_cuda_client.py tests/test_cuda_overlap.py >"$OUT/server-tests.log" 2>&1
  rc=$?
  grep -E "rel err" "$OUT/server-tests.log"
  tail -3 "$OUT/server-tests.log"
  summary+=("server tests: rc=$rc $(tail -1 "$OUT/server-tests.log")")
fi
if [[ $what == all || $what == *sanitize* ]]; then
  for tool in memcheck racecheck; do
    # SAN_ENV: settings for the checked process, e.g. EXPERTD_KERNEL_GRID_ROWS=1 (v6 blocks
    # loop over tiles, so racecheck sees the shared memory reused).
    timeout ${T_SAN:-90} env ${SAN_ENV:-} compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/sanitize_case.py \
      >"$OUT/sanitize-$tool.log" 2>&1
    rc=$?
    tail -4 "$OUT/sanitize-$tool.log"
    summary+=("$tool: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize-$tool.log" | tail -1)")
  done
fi
if [[ $what == all || $what == *service* ]]; then
  # 8 shard processes on this one GPU + the real client: end to end, transport, batching.
  timeout ${T_SERVICE:-420} python3 benchmarks/service.py --out "$OUT" ${SERVICE_ARGS:-} 2>&1 | tee "$OUT/service.log" | tail -24
  summary+=("service: rc=$?")
fi
if [[ $what == *latency* ]]; then
  # One shard alone on the GPU, one request at a time: latency and the server's own time per
  # pipeline depth (batches in flight), the deployment's view without 7 other shards on the GPU.
  timeout ${T_LATENCY:-300} python3 benchmarks/latency.py --out "$OUT" ${LATENCY_ARGS:-} 2>&1 | tee "$OUT/latency.log" | tail -9
  summary+=("latency: rc=$?")
fi
if [[ $what == *timeline* ]]; then
  # When each kernel of one forward starts, passes its wait, ends its main loop and ends: the
  # instrumented library (EXPERTD_KERNEL_TIMELINE=1, built separately; carry it in .carry too),
  # its GPU test, then the table.
  timeout ${T_TIMELINE:-300} python3 -m pytest -q -p no:cacheprovider tests/test_cuda_timeline.py >"$OUT/timeline-test.log" 2>&1
  rc=$?
  tail -2 "$OUT/timeline-test.log"
  summary+=("timeline test: rc=$rc $(tail -1 "$OUT/timeline-test.log")")
  timeout ${T_TIMELINE:-300} python3 benchmarks/timeline.py --out "$OUT" --ms ${TIMELINE_MS:-1,8,256,4096} 2>&1 | tee "$OUT/timeline.log" | tail -30
  summary+=("timeline: rc=$?")
fi
if [[ $what == *demo* ]]; then
  # The README's main job on the GPU: 8 shard processes (muse-spark), the client, the reference.
  timeout ${T_DEMO:-240} python3 -m expertd demo ${DEMO_ARGS:-} 2>&1 | tee "$OUT/demo.log" | tail -12
  summary+=("demo: rc=$?")
fi
if [[ $what == *profile* ]]; then
  # Per-kernel speed-of-light, occupancy and stall reasons at M = 1 and M = 256 (ncu reads the
  # counters on Firecracker machines; clocks left alone).
  timeout ${T_PROF:-200} ncu --clock-control none --kernel-name regex:"moe_gemm|route_kernel|finalize" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats --metrics smsp__average_warp_latency_issue_stalled_long_scoreboard,smsp__average_warp_latency_issue_stalled_barrier,smsp__average_warp_latency_issue_stalled_math_pipe_throttle,smsp__average_warp_latency_issue_stalled_short_scoreboard,smsp__average_warp_latency_issue_stalled_wait,smsp__average_warp_latency_issue_stalled_mio_throttle,smsp__average_warp_latency_issue_stalled_lg_throttle,smsp__average_warp_latency_issue_stalled_no_instruction,smsp__average_warp_latency_issue_stalled_not_selected,smsp__average_warp_latency_issue_stalled_selected,smsp__average_warp_latency_issue_stalled_dispatch_stall python3 benchmarks/profile_case.py ${PROFILE_MS:-1 256} \
    >"$OUT/ncu.log" 2>&1
  summary+=("profile: rc=$? (ncu.log)")
  grep -E "moe_gemm|route_kernel|finalize|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Compute \(SM\) Throughput|Issue Slots|No Eligible|Stall" "$OUT/ncu.log" | head -150
fi
echo "== summary =="
printf '%s\n' "${summary[@]}"
