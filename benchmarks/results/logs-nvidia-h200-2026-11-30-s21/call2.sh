export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
W1=$PWD/.carry/w1/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
echo "== GPU kernel tests, w1 (ring 3 waits for the unit before, wait_group 1)"
EXPERTD_KERNEL_LIB=$W1 timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
echo "== GPU kernel tests, w1 under ring 3 everywhere"
EXPERTD_KERNEL_WG_RING=3 EXPERTD_KERNEL_LIB=$W1 timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
echo "== A/B: w1 (default rings), w1r3 (ring 3 at every BT), tree r3; 3 rounds"
timeout 400 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib w1=$W1 --lib w1r3=$W1 --lib-env w1r3=EXPERTD_KERNEL_WG_RING=3 --lib tr3=$TREE --lib-env tr3=EXPERTD_KERNEL_WG_RING=3 --rounds 3 --ms 256,512,704,1024,1088,1408,2048,4096 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -16
rm -rf $OUT/a/r*
