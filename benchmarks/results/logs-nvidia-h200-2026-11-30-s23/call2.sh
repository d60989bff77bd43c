export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so | head -1)
OLD=$PWD/.carry/old/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader
echo "== GPU kernel tests, tree (8-op E2M1 conversion)"
timeout 90 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
echo "== output bits: old layout vs new"
EXPERTD_KERNEL_LIB=$OLD timeout 60 python3 benchmarks/lib_bits.py --save /tmp/a.pt 2>&1 | tail -1
EXPERTD_KERNEL_LIB=$TREE timeout 60 python3 benchmarks/lib_bits.py --compare /tmp/a.pt 2>&1 | tail -3
echo "== A/B: 8-op conversion (tree) against session 22's 10-op (old), 3 rounds"
timeout 260 python3 benchmarks/lib_ab.py --lib old=$OLD --lib new=$TREE --rounds 3 --ms 1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192 --out $OUT/ab 2>&1 | grep -v '^ *$' | tail -12
rm -rf $OUT/ab/r*
echo "== energy A/B, A B / B A"
timeout 150 python3 benchmarks/energy_ab.py --lib old=$OLD --lib new=$TREE --rounds 2 --ms 64,256,1024,4096 --seconds 2.5 --out $OUT/eab 2>&1 | grep -v '^ *$' | tail -12
rm -rf $OUT/eab/r*
