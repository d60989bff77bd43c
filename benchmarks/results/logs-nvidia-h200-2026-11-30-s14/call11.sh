#!/usr/bin/env bash
# Session 14 call 11: the final validation of main with the one-trip finalize (GPU tests,
# benchmark = the README table, server / client GPU tests, sanitizers).
set -u
T_SERVER=150 T_BENCH=300 bash benchmarks/device_check.sh tests,bench,server,sanitize --fixed-max 8 --bt-sweep-max 0 --path-ab-max 0 --dec-alt-max 0 2>&1 | tail -30
rm -f $OUT/install.log $OUT/gpu.txt $OUT/build.log
ls $OUT
