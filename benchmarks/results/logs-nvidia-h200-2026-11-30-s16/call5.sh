export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 150 python3 -m pytest -q -m cuda tests/test_cuda_kernels.py 2>&1 | tail -3
timeout 200 python3 benchmarks/timeline.py --out $OUT --ms 16,64,512 --tag s16-staged 2>&1 | grep -E '^M =|route|gemm1 ' 
timeout 200 python3 benchmarks/timeline.py --out $OUT/old --ms 16,64,512 --tag s16-unstaged --env EXPERTD_KERNEL_ROUTE_STAGED=0 2>&1 | grep -E '^M =|route|gemm1 '
timeout 300 python3 benchmarks/kernel.py --out $OUT/ab --ms 16,32,64,128,256,512,1024 --variant unstaged:EXPERTD_KERNEL_ROUTE_STAGED=0 --path-ab-max 1024 --paths "" --bt-sweep-max 0 --dec-alt-max 0 --fixed-max 0 --no-baseline 2>&1 | tail -12
rm -f $OUT/ab/*.png
