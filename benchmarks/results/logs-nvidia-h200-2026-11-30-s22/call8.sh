export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader
echo "== GPU kernel tests, pf700"
EXPERTD_KERNEL_LIB=$PWD/.carry/pf700/libexpertd_kernels.so timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
echo "== A/B: the one-tile grid's tail prefetch (items left 400 / 700) against the tree, 2 rounds"
timeout 110 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib pf400=$PWD/.carry/pf400/libexpertd_kernels.so --lib pf700=$PWD/.carry/pf700/libexpertd_kernels.so --rounds 2 --ms 16,32,64,128 --out $OUT/ab 2>&1 | grep -v '^ *$' | tail -10
rm -rf $OUT/ab/r*
echo "== memcheck, pf700"
timeout 60 env EXPERTD_KERNEL_LIB=$PWD/.carry/pf700/libexpertd_kernels.so compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_case.py 2>&1 | tail -2
