#!/usr/bin/env bash
# Session 14 call 8 (diagnostic): does a shorter finalize shorten a decode call? finnop = finalize
# returning right after its wait (wrong results, timing only) against main, and the 2 us spin
# build again in the same rounds.
set -u
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
M=$PWD/.carry/main/libexpertd_kernels.so; N=$PWD/.carry/finnop/libexpertd_kernels.so; F=$PWD/.carry/finsl/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
timeout 300 python3 benchmarks/lib_ab.py --lib main=$M --lib finnop=$N --lib finsl=$F --rounds 3 --ms 1,2,4,8,64 --out $OUT/ab 2>&1 | tail -9
rm -rf $OUT/ab/r*
