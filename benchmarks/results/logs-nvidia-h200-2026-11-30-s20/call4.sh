export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
for v in g1r3 g2r3; do
  echo "== GPU kernel tests, $v"
  EXPERTD_KERNEL_LIB=$PWD/.carry/$v/libexpertd_kernels.so timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
done
echo "== A/B: v8 ring per GEMM: g1r3 = GEMM1 ring 3 / GEMM2 the default's; g2r3 = GEMM2 ring 3 / GEMM1 the default's; g1r3w2 = GEMM1 3 / GEMM2 2 everywhere; 3 rounds"
timeout 360 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib g1r3=.carry/g1r3/libexpertd_kernels.so --lib g2r3=.carry/g2r3/libexpertd_kernels.so --lib g1r3w2=.carry/g1r3/libexpertd_kernels.so --lib-env g1r3w2=EXPERTD_KERNEL_WG_RING=2 --rounds 3 --ms 192,320,480,704,1024,1408,2048 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -16
rm -rf $OUT/a/r*
