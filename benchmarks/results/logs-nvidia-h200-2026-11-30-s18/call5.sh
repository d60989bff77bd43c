export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
echo "== tests: co100"
EXPERTD_KERNEL_LIB=$PWD/.carry/co100/libexpertd_kernels.so timeout 120 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -2
echo "== A: max shared-memory carveout for route / finalize kernels, 3 rounds"
timeout 400 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib co100=.carry/co100/libexpertd_kernels.so --rounds 3 --ms 1,2,4,8,16,32,128,1024,4096 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -8
rm -rf $OUT/a/r*
ls -R $OUT | head
