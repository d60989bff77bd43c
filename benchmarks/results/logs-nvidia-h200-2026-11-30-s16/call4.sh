export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 150 python3 -m pytest -q -m cuda tests/test_cuda_kernels.py 2>&1 | tail -3
timeout 300 python3 benchmarks/kernel.py --out $OUT/rows --ms 1,2,3,4,6,8 --sets 32 --variant r2:EXPERTD_KERNEL_GRID_ROWS=2 --variant r4:EXPERTD_KERNEL_GRID_ROWS=4 --variant r6:EXPERTD_KERNEL_GRID_ROWS=6 --path-ab-max 8 --paths "" --bt-sweep-max 0 --dec-alt-max 0 --fixed-max 0 --no-baseline 2>&1 | tail -14
rm -f $OUT/rows/*.png
