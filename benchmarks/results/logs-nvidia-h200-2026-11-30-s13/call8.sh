#!/usr/bin/env bash
# Session 13 call 8: GEMM1 routing itself on the full grid at 65-256 routes (branch
# s13-self-full); sf1 = the same library with EXPERTD_KERNEL_SELF_ROUTE=1 (loop grids only, as
# main). GPU tests, sanitizers, library A/B against main.
set -u
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
S=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so); M=$PWD/.carry/main/libexpertd_kernels.so
echo "== gpu tests (sf)"
EXPERTD_KERNEL_LIB=$S timeout 150 python3 -m pytest -q --noconftest -p no:cacheprovider -m cuda tests/test_cuda_kernels.py 2>&1 | tail -3
for tool in memcheck racecheck; do
  EXPERTD_KERNEL_LIB=$S timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/sanitize_case.py > $OUT/san-sf-$tool.log 2>&1
  echo "== sf $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|worst' $OUT/san-sf-$tool.log | tr '\n' ' ')"
done
echo "== library A/B"
timeout 330 python3 benchmarks/lib_ab.py --lib main=$M --lib sf=$S --lib sf1=$S --lib-env sf1=EXPERTD_KERNEL_SELF_ROUTE=1 --rounds 3 --ms 1,2,12,16,24,32,64 --out $OUT/ab 2>&1 | tail -16
rm -rf $OUT/ab/r*
