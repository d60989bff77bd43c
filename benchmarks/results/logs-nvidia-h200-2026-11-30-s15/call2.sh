#!/usr/bin/env bash
# Session 15 call 2: decode GEMM2 as exactly P blocks per SM (EXPERTD_KERNEL_G2_PER_SM=P; the
# tree's library, off by default) against main: GPU tests and bits under P=2, library A/B for
# P = 2, 3, 4, timelines of M = 2, 4 with and without.
set -u
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
T=$(ls -d $PWD/.carry/kernels/*/ | head -1)libexpertd_kernels.so
M=$PWD/.carry/main/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
echo "== gpu tests (draft, P=2)"
EXPERTD_KERNEL_G2_PER_SM=2 timeout 150 python3 -m pytest -q --noconftest -p no:cacheprovider -m cuda tests/test_cuda_kernels.py 2>&1 | tail -2
echo "== bits: draft P=2 against main"
EXPERTD_KERNEL_LIB=$M timeout 120 python3 benchmarks/lib_bits.py --save /tmp/main-bits.pt 2>&1 | tail -1
EXPERTD_KERNEL_G2_PER_SM=2 EXPERTD_KERNEL_LIB=$T timeout 120 python3 benchmarks/lib_bits.py --compare /tmp/main-bits.pt 2>&1 | grep -v "^same"; echo "differing cases above (none: all 14 the same)"
EXPERTD_KERNEL_G2_PER_SM=2 timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_case.py > $OUT/san-memcheck.log 2>&1
echo "== draft P=2 memcheck rc=$? $(grep -E 'ERROR SUMMARY|worst' $OUT/san-memcheck.log | tr '\n' ' ')"
echo "== timelines"
for p in 0 2; do
  EXPERTD_KERNEL_LIB=$PWD/.carry/tl/libexpertd_kernels.so timeout 60 python3 benchmarks/timeline.py --ms 1,2,4 --env EXPERTD_KERNEL_G2_PER_SM=$p --tag s15-g2p$p --out $OUT 2>&1 | grep -iE "^M =|gemm|finalize" | head -30
done
echo "== library A/B"
timeout 330 python3 benchmarks/lib_ab.py --lib main=$M --lib p0=$T --lib p2=$T --lib-env p2=EXPERTD_KERNEL_G2_PER_SM=2 --lib p3=$T --lib-env p3=EXPERTD_KERNEL_G2_PER_SM=3 --lib p1=$T --lib-env p1=EXPERTD_KERNEL_G2_PER_SM=1 --rounds 2 --ms 1,2,4,8,16,32,64 --out $OUT/ab 2>&1 | tail -14
rm -rf $OUT/ab/r*
ls $OUT
