export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
PAD=$PWD/.carry/pad896/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
echo "== GPU kernel tests, pad896t (BT 32 traps if its 896-byte pad misses the 1024 alignment)"
EXPERTD_KERNEL_LIB=$PWD/.carry/pad896t/libexpertd_kernels.so timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
echo "== A/B: v8 BT 32 GEMM2 at KG 2 / ST 4 / 3 blocks per SM (896-byte alignment pad at BT 32), 3 rounds"
timeout 150 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib pad896=$PAD --rounds 3 --ms 432,480,576,704,864 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -6
rm -rf $OUT/a/r*
for tool in memcheck racecheck; do
  echo "== $tool, pad896"
  EXPERTD_KERNEL_LIB=$PAD timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/sanitize_case.py > $OUT/san-$tool.log 2>&1; echo "rc=$?"
  grep -E "M=70 |ERROR SUMMARY|RACECHECK SUMMARY|worst" $OUT/san-$tool.log | tail -3
done
echo "== bench, pad896"
EXPERTD_KERNEL_LIB=$PAD timeout 150 python3 benchmarks/kernel.py --out $OUT/bench --fixed-max 8 --bt-sweep-max 0 --path-ab-max 0 --dec-alt-max 0 2>&1 | grep -v '^{' | tail -19
