export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
echo "== tests: ovf1 with OVF on both GEMMs everywhere"
EXPERTD_KERNEL_LIB=$PWD/.carry/ovf1/libexpertd_kernels.so EXPERTD_KERNEL_OVF_GEMMS=3 timeout 120 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -2
echo "== tests: trig"
EXPERTD_KERNEL_LIB=$PWD/.carry/trig/libexpertd_kernels.so timeout 120 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -2
echo "== A: OVF one call site, M 16-128"
timeout 200 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib one=.carry/ovf1/libexpertd_kernels.so --lib oneall=.carry/ovf1/libexpertd_kernels.so --lib-env oneall=EXPERTD_KERNEL_OVF_GEMMS=3 --rounds 2 --ms 16,32,64,96,128 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -10
echo "== B: row-1 early trigger, M 1-8"
timeout 150 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib trig=.carry/trig/libexpertd_kernels.so --rounds 2 --ms 1,2,4,8 --out $OUT/b 2>&1 | grep -v '^ *$' | tail -8
rm -rf $OUT/a/r* $OUT/b/r*
ls -R $OUT | head
