export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
NEW=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
EXPERTD_KERNEL_LIB=$PWD/.carry/tx/libexpertd_kernels.so timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
EXPERTD_KERNEL_LIB=$PWD/.carry/tx8/libexpertd_kernels.so timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
echo "== main vs tiles along x (v6: tx, v8: tx8)"
timeout 420 python3 benchmarks/lib_ab.py --lib main=$NEW --lib tx=.carry/tx/libexpertd_kernels.so --lib tx8=.carry/tx8/libexpertd_kernels.so --rounds 2 --ms 16,32,64,128,256,512,1024,4096 --out $OUT/t 2>&1 | grep -v '^ *$' | tail -12
rm -rf $OUT/t/r*
