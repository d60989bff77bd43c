export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
TW=$PWD/.carry/tw/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
echo "== GPU kernel tests, tile wait (default rows; then OVF rows on both GEMMs)"
EXPERTD_KERNEL_LIB=$TW timeout 120 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -2
EXPERTD_KERNEL_OVF_GEMMS=3 EXPERTD_KERNEL_LIB=$TW timeout 120 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -2
echo "== output bits: tree against tile wait"
EXPERTD_KERNEL_LIB=$TREE timeout 100 python3 benchmarks/lib_bits.py --save /tmp/a.pt 2>&1 | tail -1
EXPERTD_KERNEL_LIB=$TW timeout 100 python3 benchmarks/lib_bits.py --compare /tmp/a.pt 2>&1 | tail -15
echo "== A/B: tile wait (tw), with OVF rows on both GEMMs (tw3), and the tree with them (t3), 3 rounds"
timeout 330 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib tw=$TW --lib tw3=$TW --lib-env tw3=EXPERTD_KERNEL_OVF_GEMMS=3 --lib t3=$TREE --lib-env t3=EXPERTD_KERNEL_OVF_GEMMS=3 --rounds 3 --ms 16,32,48,64,96,128 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -14
rm -rf $OUT/a/r*
