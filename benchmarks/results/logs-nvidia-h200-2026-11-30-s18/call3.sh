export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
echo "== tests: pf528"
EXPERTD_KERNEL_LIB=$PWD/.carry/pf528/libexpertd_kernels.so timeout 120 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -2
echo "== A: tail L2 prefetch (last 264 / 528 real blocks), M 16-128, 3 rounds"
timeout 300 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib pf264=.carry/pf264/libexpertd_kernels.so --lib pf528=.carry/pf528/libexpertd_kernels.so --rounds 3 --ms 16,32,64,96,128 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -12
rm -rf $OUT/a/r*
ls -R $OUT | head
