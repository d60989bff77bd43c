#!/usr/bin/env bash
# Session 13 call 2: cumulative drafts on top of the self-routed GEMM1 (base = main 23c8f06):
# fin (finalize's first position / weight before its wait), range (+ local_first: no local_of
# lookups for a shard of consecutive ids), g2 (+ GEMM2 self-routed, its first weight copies before
# its wait; the tree's library). GPU tests + sanitizers on g2, library A/B, timeline of g2.
set -u
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
G=$PWD/.carry/kernels/54c229c318c4752f/libexpertd_kernels.so
B=$PWD/.carry/base/libexpertd_kernels.so; F=$PWD/.carry/fin/libexpertd_kernels.so; R=$PWD/.carry/range/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
echo "== gpu tests (g2)"
EXPERTD_KERNEL_LIB=$G timeout 150 python3 -m pytest -q --noconftest -p no:cacheprovider -m cuda tests/test_cuda_kernels.py 2>&1 | tail -3
for tool in memcheck racecheck; do
  EXPERTD_KERNEL_LIB=$G timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/sanitize_case.py > $OUT/san-g2-$tool.log 2>&1
  echo "== g2 $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|worst' $OUT/san-g2-$tool.log | tr '\n' ' ')"
done
echo "== library A/B"
timeout 300 python3 benchmarks/lib_ab.py --lib base=$B --lib fin=$F --lib range=$R --lib g2=$G --rounds 2 --ms 1,2,4,8,16,64 --out $OUT/ab 2>&1 | tail -16
rm -rf $OUT/ab/r*
echo "== timeline (g2)"
timeout 120 python3 benchmarks/timeline.py --out $OUT --ms 1,2,64 --tag s13 2>&1 | tail -24
ls -R $OUT | head -20
