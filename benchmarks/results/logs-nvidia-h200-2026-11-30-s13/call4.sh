#!/usr/bin/env bash
# Session 13 call 4: decode alternatives 30 / 31 (13 / 28 with 16-row GEMM2 blocks of 8 warps,
# nparts from the alternative; branch s13-g2fine), library A/B against main at M = 1-8.
set -u
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
F=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so); M=$PWD/.carry/main/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
echo "== gpu tests (fine)"
EXPERTD_KERNEL_LIB=$F timeout 150 python3 -m pytest -q --noconftest -p no:cacheprovider -m cuda tests/test_cuda_kernels.py 2>&1 | tail -3
for alt in 30 31; do
  EXPERTD_KERNEL_DECODE_ALT=$alt EXPERTD_KERNEL_LIB=$F timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 python3 benchmarks/sanitize_case.py > $OUT/san-a$alt-racecheck.log 2>&1
  echo "== alt $alt racecheck rc=$? $(grep -E 'RACECHECK SUMMARY|worst' $OUT/san-a$alt-racecheck.log | tr '\n' ' ')"
done
echo "== library A/B"
timeout 300 python3 benchmarks/lib_ab.py --lib main=$M --lib fine=$F --lib a30=$F --lib-env a30=EXPERTD_KERNEL_DECODE_ALT=30 --lib a31=$F --lib-env a31=EXPERTD_KERNEL_DECODE_ALT=31 --rounds 3 --ms 1,2,4,8 --out $OUT/ab 2>&1 | tail -16
rm -rf $OUT/ab/r*
ls -R $OUT | head
