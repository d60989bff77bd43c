export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
for v in g1k2 g2k2; do
  echo "== GPU kernel tests, $v"
  EXPERTD_KERNEL_LIB=$PWD/.carry/$v/libexpertd_kernels.so timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
done
echo "== A/B: v8 BT 32, KG 2 / MB 3 on both GEMMs (k2s4), on GEMM1 only (g1k2), on GEMM2 only (g2k2), 3 rounds"
timeout 330 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib k2s4=.carry/k2s4/libexpertd_kernels.so --lib g1k2=.carry/g1k2/libexpertd_kernels.so --lib g2k2=.carry/g2k2/libexpertd_kernels.so --rounds 3 --ms 400,448,480,544,576,640,704,864 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -14
rm -rf $OUT/a/r*
echo "== BT 16 against 32 at the bound (lambda 12-14), BT 32 as k2s4"
EXPERTD_KERNEL_LIB=$PWD/.carry/k2s4/libexpertd_kernels.so timeout 100 python3 benchmarks/kernel.py --ms 384,400,416,448 --no-baseline --bt-sweep-max 480 --bt-list 16,32 --fixed-max 0 --path-ab-max 0 --dec-alt-max 0 --out $OUT/bt1632 2>&1 | grep -v '^{' | tail -8
