#!/usr/bin/env bash
# Session 15 call 1: v6 loop grids as one wave of resident blocks (the tree; EXPERTD_KERNEL_STRIPE=0
# gives the old grids in the same library); session 14's finalize code-size test (bloat) and
# finalize phase timelines (fp0 / fp1 / fp3, branch s14-fin-phases).
set -u
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
T=$(ls -d $PWD/.carry/kernels/*/ | head -1)libexpertd_kernels.so
M=$PWD/.carry/main/libexpertd_kernels.so
B=$PWD/.carry/bloat/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
echo "== gpu tests (draft)"
timeout 150 python3 -m pytest -q --noconftest -p no:cacheprovider -m cuda tests/test_cuda_kernels.py 2>&1 | tail -2
echo "== bits: draft against main"
EXPERTD_KERNEL_LIB=$M timeout 120 python3 benchmarks/lib_bits.py --save /tmp/main-bits.pt 2>&1 | tail -1
EXPERTD_KERNEL_LIB=$T timeout 120 python3 benchmarks/lib_bits.py --compare /tmp/main-bits.pt 2>&1 | grep -v "^same"; echo "differing cases above (none: all 14 the same)"
for tool in memcheck racecheck; do
  timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/sanitize_case.py > $OUT/san-$tool.log 2>&1
  echo "== draft $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|worst' $OUT/san-$tool.log | tr '\n' ' ')"
done
echo "== library A/B"
timeout 330 python3 benchmarks/lib_ab.py --lib main=$M --lib stripe=$T --lib nostripe=$T --lib-env nostripe=EXPERTD_KERNEL_STRIPE=0 --lib bloat=$B --rounds 2 --ms 1,2,4,8,16,32,64 --out $OUT/ab 2>&1 | tail -12
rm -rf $OUT/ab/r*
echo "== finalize phase timelines"
for v in 0 1 3; do
  EXPERTD_KERNEL_LIB=$PWD/.carry/fp$v/libexpertd_kernels.so timeout 60 python3 benchmarks/timeline.py --ms 1,2 --tag s15-fp$v --out $OUT 2>&1 | grep -iE "^ *(M|kernel|finalize|gemm|route|graph)|loop_done|done" | head -30
done
ls $OUT
