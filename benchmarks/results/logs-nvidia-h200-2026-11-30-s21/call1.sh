export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
for v in u48 u64 u2; do
  echo "== GPU kernel tests, $v"
  EXPERTD_KERNEL_LIB=$PWD/.carry/$v/libexpertd_kernels.so timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
done
echo "== GPU kernel tests, u64 under ring 3"
EXPERTD_KERNEL_WG_RING=3 EXPERTD_KERNEL_LIB=$PWD/.carry/u64/libexpertd_kernels.so timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
echo "== A/B: ring-3 units of 2 k-steps (u2), + BT 48 at 3 blocks/SM (u48), + BT 64 KG1/ST5/MB3 (u64, ring 2 and 3), 3 rounds"
C=$PWD/.carry
timeout 420 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib u2=$C/u2/libexpertd_kernels.so --lib u48=$C/u48/libexpertd_kernels.so --lib u64=$C/u64/libexpertd_kernels.so --lib u64r3=$C/u64/libexpertd_kernels.so --lib-env u64r3=EXPERTD_KERNEL_WG_RING=3 --rounds 3 --ms 960,1024,1088,1280,1408,1600,2048 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -22
rm -rf $OUT/a/r*
