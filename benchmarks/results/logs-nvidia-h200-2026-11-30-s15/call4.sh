#!/usr/bin/env bash
# Session 15 call 4: GEMM2 at decode spread over the SMs, as its own kernel (moe_gemm_spread_kernel;
# EXPERTD_KERNEL_G2_PER_SM=0: as many blocks per SM as fit, =2: two, padded; unset: main's grid).
set -u
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
T=$(ls -d $PWD/.carry/kernels/*/ | head -1)libexpertd_kernels.so
M=$PWD/.carry/main/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
for p in 0 2; do
echo "== gpu tests (draft, G2_PER_SM=$p)"
EXPERTD_KERNEL_G2_PER_SM=$p timeout 150 python3 -m pytest -q --noconftest -p no:cacheprovider -m cuda tests/test_cuda_kernels.py 2>&1 | tail -2
done
echo "== bits: draft against main (plain, spread 0, spread 2)"
EXPERTD_KERNEL_LIB=$M timeout 120 python3 benchmarks/lib_bits.py --save /tmp/main-bits.pt 2>&1 | tail -1
for p in -1 0 2; do
EXPERTD_KERNEL_G2_PER_SM=$p EXPERTD_KERNEL_LIB=$T timeout 120 python3 benchmarks/lib_bits.py --compare /tmp/main-bits.pt 2>&1 | grep -v "^same"; echo "P=$p: differing cases above (none: all 14 the same)"
done
for tool in memcheck racecheck; do
  EXPERTD_KERNEL_G2_PER_SM=0 timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/sanitize_case.py > $OUT/san-$tool.log 2>&1
  echo "== draft (spread 0) $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|worst' $OUT/san-$tool.log | tr '\n' ' ')"
done
echo "== timelines"
for p in -1 0; do
  EXPERTD_KERNEL_LIB=$PWD/.carry/tl/libexpertd_kernels.so timeout 60 python3 benchmarks/timeline.py --ms 1,2,4,8 --env EXPERTD_KERNEL_G2_PER_SM=$p --tag s15-spread$p --out $OUT 2>&1 | grep -iE "^M =|gemm2|finalize" | head -30
done
echo "== library A/B"
timeout 330 python3 benchmarks/lib_ab.py --lib main=$M --lib plain=$T --lib spread=$T --lib-env spread=EXPERTD_KERNEL_G2_PER_SM=0 --rounds 3 --ms 1,2,4,8,16 --out $OUT/ab 2>&1 | tail -12
rm -rf $OUT/ab/r*
ls $OUT
