#!/usr/bin/env bash
# Session 15 call 7: the service's batching throughput with and without the batcher's inline
# finish (EXPERTD_INLINE_FINISH=0: every batch to the finisher thread, as in run 4), M = 16.
set -u
for r in 1 2; do
for v in 1 0; do
  export EXPERTD_INLINE_FINISH=$v
  mkdir -p $OUT/inline$v-r$r
  T_SERVICE=200 SERVICE_ARGS="--ms 16 --reps 3 --seconds 3" OUT=$OUT/inline$v-r$r bash benchmarks/device_check.sh service 2>&1 | grep -E "clients|unary|M=16" | head -8
  echo "== above: inline finish $v, round $r"
done
done
find $OUT -name "*.json" | while read f; do cp $f $OUT/$(basename $(dirname $f)).json; done
find $OUT -mindepth 1 -type d -exec rm -rf {} + ; ls $OUT
