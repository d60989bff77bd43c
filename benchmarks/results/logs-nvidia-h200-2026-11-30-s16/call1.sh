export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm --format=csv,noheader
NEW=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
echo "new lib: $NEW"
timeout 150 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -4
timeout 330 python3 benchmarks/lib_ab.py --lib old=.carry/old/libexpertd_kernels.so --lib new=$NEW --lib new17=$NEW --lib-env new17=EXPERTD_KERNEL_SPREAD_STEP=17 --lib m1=$NEW --lib-env m1=EXPERTD_KERNEL_SPREAD_STEP=17,EXPERTD_KERNEL_G2_PER_SM=0 --rounds 3 --ms 1,2,4,8 --out $OUT/ab 2>&1 | grep -v '^ *$' | tail -60
rm -rf $OUT/ab/r*
ls -la $OUT/ab
