#!/usr/bin/env bash
# Session 13 call 11: at M = 1 with the self-routed GEMM1, alt 13's 32-row GEMM1 blocks (512 blocks
# on 2 rows: one wave, the row-1 blocks exit early) against main's alt 28 (1024 blocks: row 1 runs
# late, call 9). Same library, EXPERTD_KERNEL_DECODE_ALT forced; GEMM2 is the same in both.
set -u
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
L=$PWD/.carry/kernels/ef01465df27cdf58/libexpertd_kernels.so
timeout 120 python3 benchmarks/lib_ab.py --lib main=$L --lib a13=$L --lib-env a13=EXPERTD_KERNEL_DECODE_ALT=13 --rounds 3 --ms 1 --out $OUT/ab 2>&1 | tail -6
rm -rf $OUT/ab/r*
