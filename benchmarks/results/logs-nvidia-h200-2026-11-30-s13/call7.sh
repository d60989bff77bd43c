#!/usr/bin/env bash
# Session 13 call 7: the benchmark again on main, on a fresh machine (call 6's machine ran the
# unchanged mid-M kernels 3-7% slower than calls 1-2's).
set -u
nvidia-smi --query-gpu=name,serial,clocks.max.sm,power.limit --format=csv,noheader
T_BENCH=400 bash benchmarks/device_check.sh bench --fixed-max 8 --bt-sweep-max 0 --path-ab-max 0 --dec-alt-max 0 2>&1 | tail -22
rm -f $OUT/install.log $OUT/gpu.txt $OUT/build.log
