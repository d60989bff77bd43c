export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
for v in b48s5 b96k1; do
  echo "== GPU kernel tests, $v"
  EXPERTD_KERNEL_LIB=$PWD/.carry/$v/libexpertd_kernels.so timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
done
echo "== A/B: v8 BT 48 GEMM1 with 5 stages (b48s5, M = 865-1152), BT 96 with KG 1 / 6 stages (b96k1, M ~ 1857-2240), 3 rounds"
timeout 300 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib b48s5=.carry/b48s5/libexpertd_kernels.so --lib b96k1=.carry/b96k1/libexpertd_kernels.so --rounds 3 --ms 960,1024,1152,1920,2048,2240 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -10
rm -rf $OUT/a/r*
echo "== BT 32 against 48 at the bound (lambda 27-31), BT 32's GEMM1 at 3 blocks per SM"
timeout 100 python3 benchmarks/kernel.py --ms 864,928,992 --no-baseline --bt-sweep-max 992 --bt-list 32,48 --fixed-max 0 --path-ab-max 0 --dec-alt-max 0 --out $OUT/bt3248 2>&1 | grep -v '^{' | tail -7
echo "== BT 16 against 32 at the bound (lambda 12-13)"
timeout 80 python3 benchmarks/kernel.py --ms 384,400,416 --no-baseline --bt-sweep-max 416 --bt-list 16,32 --fixed-max 0 --path-ab-max 0 --dec-alt-max 0 --out $OUT/bt1632 2>&1 | grep -v '^{' | tail -7
