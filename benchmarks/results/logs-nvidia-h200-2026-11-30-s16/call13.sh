export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
NEW=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
timeout 40 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -2
timeout 110 python3 benchmarks/lib_ab.py --lib main=.carry/main/libexpertd_kernels.so --lib early=$NEW --rounds 2 --ms 1,2,16 --out $OUT/ab 2>&1 | grep -v '^ *$' | tail -8
rm -rf $OUT/ab/r*
