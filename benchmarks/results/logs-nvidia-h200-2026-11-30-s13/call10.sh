#!/usr/bin/env bash
# Session 13 call 10: M = 1 on one grid row (EXPERTD_KERNEL_GRID_ROWS=1; blocks loop over tiles)
# against main's two: the self-routed GEMM1's row-1 blocks route before they exit, and the
# timeline of call 9 has GEMM2 entering 1.3 us after GEMM1's last real block.
set -u
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
L=$PWD/.carry/kernels/ef01465df27cdf58/libexpertd_kernels.so
timeout 150 python3 benchmarks/lib_ab.py --lib main=$L --lib rows1=$L --lib-env rows1=EXPERTD_KERNEL_GRID_ROWS=1 --rounds 3 --ms 1 --out $OUT/ab 2>&1 | tail -8
rm -rf $OUT/ab/r*
