export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so | head -1)
T16=$PWD/.carry/t16/libexpertd_kernels.so
echo "== tiles of the M = 1024 input sets (BT 48)"
timeout 60 python3 .carry/tiles_check.py
echo "== GPU kernel tests, t16 (BT 48 ladder 16 / 32 / 48)"
EXPERTD_KERNEL_LIB=$T16 timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
echo "== A/B t16 against the tree, lib_ab's sets of call 7, 2 rounds"
timeout 120 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib t16=$T16 --rounds 2 --ms 896,960,1024 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -8
rm -rf $OUT/a/r*
for tool in memcheck racecheck; do
  echo "== $tool, t16"
  EXPERTD_KERNEL_LIB=$T16 timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/sanitize_case.py > $OUT/san-$tool.log 2>&1; echo "rc=$?"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY" $OUT/san-$tool.log | tail -1
done
