export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
NEW=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -2
echo "== main (decode early 2, grid early 1) vs grid early 2 / 0, M 16-128"
timeout 200 python3 benchmarks/lib_ab.py --lib main=$NEW --lib g2=.carry/g2/libexpertd_kernels.so --lib g0=.carry/g0/libexpertd_kernels.so --rounds 2 --ms 16,32,64,128 --out $OUT/g 2>&1 | grep -v '^ *$' | tail -10
rm -rf $OUT/g/r*
