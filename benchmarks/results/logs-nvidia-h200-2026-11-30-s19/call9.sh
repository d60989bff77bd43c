export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
echo "== GPU kernel tests, BT 16 with KG 2 / 6 stages"
EXPERTD_KERNEL_LIB=$PWD/.carry/k2s6/libexpertd_kernels.so timeout 100 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
echo "== A/B: v8 BT 16 with KG 2 and 6 / 5 stages against KG 4 / 3 stages, 3 rounds"
timeout 300 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib k2s6=.carry/k2s6/libexpertd_kernels.so --lib k2s5=.carry/k2s5/libexpertd_kernels.so --rounds 3 --ms 160,192,256,320,384 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -9
rm -rf $OUT/a/r*
