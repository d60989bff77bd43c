#!/usr/bin/env bash
# Session 14 call 4: the final validation of main (GPU tests, benchmark = the README table,
# server / client GPU tests, sanitizers), then ncu of GEMM2 at M = 1 and 2 (eager, isolated) for the
# next session: memory workload and warp states of the decode GEMM2 that nothing so far moved.
set -u
T_SERVER=150 T_BENCH=400 bash benchmarks/device_check.sh tests,bench,server,sanitize --fixed-max 8 --bt-sweep-max 0 --path-ab-max 0 --dec-alt-max 0 2>&1 | tail -30
export PYTHONPATH=/tmp/site EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
timeout 150 ncu --clock-control none --kernel-name regex:"moe_gemm_loop|moe_gemm_self" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
  --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
  python3 benchmarks/profile_case.py 1 2 > $OUT/ncu-g2.log 2>&1
echo "ncu rc=$?"; grep -cE "moe_gemm" $OUT/ncu-g2.log
rm -f $OUT/install.log $OUT/gpu.txt $OUT/build.log
ls $OUT
