export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
echo "== GPU kernel tests, b16g2k4"
EXPERTD_KERNEL_LIB=$PWD/.carry/b16g2k4/libexpertd_kernels.so timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
echo "== A/B: v8 BT 16 with GEMM2 back at KG 4 / 3 stages / 2 blocks (GEMM1 KG 2 / 5 stages as the tree), 3 rounds"
timeout 200 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib b16g2k4=.carry/b16g2k4/libexpertd_kernels.so --rounds 3 --ms 160,192,256,320,400 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -6
rm -rf $OUT/a/r*
