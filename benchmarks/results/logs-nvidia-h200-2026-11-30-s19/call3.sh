export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
echo "== GPU kernel tests, byte scales (tree)"
timeout 150 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -3
echo "== output bits: bf16 scales (session 18's kernels) against byte scales"
EXPERTD_KERNEL_LIB=$PWD/.carry/bf16/libexpertd_kernels.so timeout 100 python3 benchmarks/lib_bits.py --save /tmp/a.pt 2>&1 | tail -2
EXPERTD_KERNEL_LIB=$TREE timeout 100 python3 benchmarks/lib_bits.py --compare /tmp/a.pt 2>&1 | tail -16
echo "== A/B: byte scales (tree) against bf16 scales, 3 rounds"
timeout 330 python3 benchmarks/lib_ab.py --lib bf16=.carry/bf16/libexpertd_kernels.so --lib byte=$TREE --rounds 3 --ms 1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -8
rm -rf $OUT/a/r*
