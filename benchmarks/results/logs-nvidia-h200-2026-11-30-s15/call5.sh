#!/usr/bin/env bash
# Session 15 call 5: final validation of the tree (GEMM2 spread over the SMs for self-routed calls
# above 8 routes): GPU tests (with the new spread test), benchmark = the README table, server /
# client GPU tests, sanitizers; then a library A/B of the tree against main at M = 1-8.
set -u
T_SERVER=150 T_BENCH=300 bash benchmarks/device_check.sh tests,bench,server,sanitize --fixed-max 8 --bt-sweep-max 0 --path-ab-max 0 --dec-alt-max 0 2>&1 | tail -30
grep -E "spread|passed|failed" $OUT/tests.log | tail -5
rm -f $OUT/install.log $OUT/gpu.txt $OUT/build.log
export PYTHONPATH=/tmp/site EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels PYTHONUNBUFFERED=1
T=$(ls -d $PWD/.carry/kernels/*/ | head -1)libexpertd_kernels.so
echo "== library A/B (tree = default spread above 8 routes)"
timeout 200 python3 benchmarks/lib_ab.py --lib main=$PWD/.carry/main/libexpertd_kernels.so --lib tree=$T --rounds 2 --ms 1,2,4,8 --out $OUT/ab 2>&1 | tail -6
rm -rf $OUT/ab/r*
ls $OUT
