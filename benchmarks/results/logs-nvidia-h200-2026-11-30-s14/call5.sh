#!/usr/bin/env bash
# Session 14 call 5 (diagnostic): timelines of main at M = 1, 2, 16 with the instrumented library,
# then with EXPERTD_TL_FIRST_STAGE (v6 blocks mark "loop_done" when their first stage is in):
# how much of a decode GEMM block's time is its first stage's arrival.
set -u
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
echo "== timeline (main's kernels, loop_done = main loop done)"
timeout 150 python3 benchmarks/timeline.py --out $OUT --ms 1,2,16 --tag s14-main 2>&1 | tail -40
echo "== timeline (loop_done = first stage in)"
EXPERTD_KERNEL_LIB=$PWD/.carry/tlfs/libexpertd_kernels.so timeout 150 python3 benchmarks/timeline.py --out $OUT --ms 1,2,16 --tag s14-first-stage 2>&1 | tail -40
ls $OUT
