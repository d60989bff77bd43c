#!/usr/bin/env bash
# Session 13 call 9: timeline of main with the instrumented build at production's occupancy
# (kSelfTwoMb: the self-routed GEMM1 of M = 1 at 124 registers, 4 blocks per SM).
set -u
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python3 benchmarks/timeline.py --out $OUT --ms 1,2,8,64 --tag s13-main 2>&1 | tail -40
