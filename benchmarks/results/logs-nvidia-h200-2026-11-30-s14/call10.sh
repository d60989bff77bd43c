#!/usr/bin/env bash
# Session 14 call 10: finalize of small calls with one round trip after its wait (branch
# s14-fin-one-rt, the tree's library). GPU tests, bits against main, sanitizers, library A/B.
set -u
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
T=$(ls -d $PWD/.carry/kernels/*/ | head -1)libexpertd_kernels.so
M=$PWD/.carry/main/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
echo "== gpu tests (draft)"
timeout 150 python3 -m pytest -q --noconftest -p no:cacheprovider -m cuda tests/test_cuda_kernels.py 2>&1 | tail -2
echo "== bits: draft against main"
EXPERTD_KERNEL_LIB=$M timeout 120 python3 benchmarks/lib_bits.py --save /tmp/main-bits.pt 2>&1 | tail -1
EXPERTD_KERNEL_LIB=$T timeout 120 python3 benchmarks/lib_bits.py --compare /tmp/main-bits.pt 2>&1 | grep -v "^same"; echo "differing cases above (none: all 14 the same); rc=$?"
for tool in memcheck racecheck; do
  timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/sanitize_case.py > $OUT/san-$tool.log 2>&1
  echo "== draft $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|worst' $OUT/san-$tool.log | tr '\n' ' ')"
done
echo "== library A/B"
timeout 300 python3 benchmarks/lib_ab.py --lib main=$M --lib draft=$T --rounds 3 --ms 1,2,4,8,16,64,256 --out $OUT/ab 2>&1 | tail -5
rm -rf $OUT/ab/r*
