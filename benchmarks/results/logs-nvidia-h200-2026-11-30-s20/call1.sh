export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
for v in k2s4 k2s3 b16k1s6m4; do
  echo "== GPU kernel tests, $v"
  EXPERTD_KERNEL_LIB=$PWD/.carry/$v/libexpertd_kernels.so timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
done
echo "== A/B: v8 BT 32 with KG 2 / ST 4|3 / MB 3 against KG 4 / ST 3 / MB 2, 3 rounds"
timeout 260 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib k2s4=.carry/k2s4/libexpertd_kernels.so --lib k2s3=.carry/k2s3/libexpertd_kernels.so --rounds 3 --ms 400,480,576,704,864 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -10
rm -rf $OUT/a/r*
echo "== A/B: v8 BT 16 with KG 1 / ST 6 / MB 4 (52 registers) against KG 2 / ST 5 / MB 2, 3 rounds"
timeout 150 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib b16=.carry/b16k1s6m4/libexpertd_kernels.so --rounds 3 --ms 160,256,320,384 --out $OUT/b 2>&1 | grep -v '^ *$' | tail -6
rm -rf $OUT/b/r*
echo "== BT 8 against 16 at the bound (lambda 3.5-5.5)"
timeout 120 python3 benchmarks/kernel.py --ms 112,128,144,176 --no-baseline --bt-sweep-max 176 --bt-list 8,16 --fixed-max 0 --path-ab-max 0 --dec-alt-max 0 --out $OUT/bt816 2>&1 | grep -v '^{' | tail -8
echo "== BT 16 against 32 at the bound (lambda 11-15), tree"
timeout 120 python3 benchmarks/kernel.py --ms 352,384,416,448,480 --no-baseline --bt-sweep-max 480 --bt-list 16,32 --fixed-max 0 --path-ab-max 0 --dec-alt-max 0 --out $OUT/bt1632 2>&1 | grep -v '^{' | tail -9
