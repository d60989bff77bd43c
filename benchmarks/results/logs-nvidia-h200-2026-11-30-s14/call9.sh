#!/usr/bin/env bash
# Session 14 call 9 (diagnostic): which part of finalize costs? finnop = finalize
# returning right after its wait (wrong results, timing only) against main, and the 2 us spin
# build replaced by fst1 (no z phase) and fst2 (no stores).
set -u
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
M=$PWD/.carry/main/libexpertd_kernels.so; N=$PWD/.carry/finnop/libexpertd_kernels.so; A=$PWD/.carry/fst1/libexpertd_kernels.so; B=$PWD/.carry/fst2/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
timeout 300 python3 benchmarks/lib_ab.py --lib main=$M --lib finnop=$N --lib fst1=$A --lib fst2=$B --rounds 3 --ms 1,2,4,8 --out $OUT/ab 2>&1 | tail -9
rm -rf $OUT/ab/r*
