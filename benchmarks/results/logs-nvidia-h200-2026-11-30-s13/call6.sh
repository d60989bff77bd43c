#!/usr/bin/env bash
# Session 13 call 6: final validation of main (self-routed GEMM1 at <= 64 routes, local_first):
# GPU tests, benchmark (README table), server / client GPU tests, memcheck + racecheck.
set -u
T_SERVER=150 T_BENCH=400 bash benchmarks/device_check.sh tests,bench,server,sanitize --fixed-max 8 --bt-sweep-max 0 --path-ab-max 0 --dec-alt-max 0
rm -f $OUT/install.log $OUT/gpu.txt $OUT/build.log
ls $OUT
