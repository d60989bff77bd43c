#!/usr/bin/env bash
# Session 14 call 6 (diagnostic): which parts of a decode call are on its critical path? Library
# A/B of main against two diagnostic builds: finsl (finalize spins 2 us after its wait) and exsl
# (the self-routed GEMM1's exit-only blocks spin 2 us before exiting; M <= 8 only).
set -u
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
M=$PWD/.carry/main/libexpertd_kernels.so; F=$PWD/.carry/finsl/libexpertd_kernels.so; X=$PWD/.carry/exsl/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
echo "== library A/B"
timeout 300 python3 benchmarks/lib_ab.py --lib main=$M --lib finsl=$F --lib exsl=$X --rounds 2 --ms 1,2,4,8,64 --out $OUT/ab 2>&1 | tail -12
rm -rf $OUT/ab/r*
ls -R $OUT | head
