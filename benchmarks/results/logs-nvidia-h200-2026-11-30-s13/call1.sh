#!/usr/bin/env bash
# Session 13 call 1: self-routed GEMM1 at <= 64 routes (branch s13-self-route, the tree's library)
# and session 12's start-up index-load draft (a), as library A/Bs against main.
set -u
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
S=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so); M=$PWD/.carry/main/libexpertd_kernels.so; A=$PWD/.carry/a/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
echo "== gpu tests (self)"
EXPERTD_KERNEL_LIB=$S timeout 150 python3 -m pytest -q --noconftest -p no:cacheprovider -m cuda tests/test_cuda_kernels.py 2>&1 | tail -3
echo "== gpu tests (a)"
EXPERTD_KERNEL_LIB=$A timeout 120 python3 -m pytest -q --noconftest -p no:cacheprovider -m cuda tests/test_cuda_kernels.py 2>&1 | tail -2
for lib in self:$S a:$A; do
  for tool in memcheck racecheck; do
    EXPERTD_KERNEL_LIB=${lib#*:} timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/sanitize_case.py > $OUT/san-${lib%%:*}-$tool.log 2>&1
    echo "== ${lib%%:*} $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|worst' $OUT/san-${lib%%:*}-$tool.log | tr '\n' ' ')"
  done
done
echo "== library A/B"
timeout 330 python3 benchmarks/lib_ab.py --lib main=$M --lib self=$S --lib noself=$S --lib-env noself=EXPERTD_KERNEL_SELF_ROUTE=0 --lib a=$A --rounds 2 --ms 1,2,4,8,16,64,128 --out $OUT/ab 2>&1 | tail -30
rm -rf $OUT/ab/r*
ls -R $OUT | head
