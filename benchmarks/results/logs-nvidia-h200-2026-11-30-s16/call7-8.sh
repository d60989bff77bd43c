export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 150 python3 -m pytest -q -x -s -m cuda tests/test_cuda_kernels.py -k "tail_split or capped or balance or multiblock or deterministic or reference" 2>&1 | grep -E 'tail split|passed|failed|Error|error' | tail -12
timeout 150 python3 -m pytest -q -m cuda tests/test_cuda_kernels.py 2>&1 | tail -3
timeout 300 python3 benchmarks/kernel.py --out $OUT/ab --ms 16,32,64,128 --variant plain:EXPERTD_KERNEL_TAIL_SPLIT=0 --path-ab-max 128 --paths "" --bt-sweep-max 0 --dec-alt-max 0 --fixed-max 0 --no-baseline 2>&1 | tail -9
timeout 120 python3 benchmarks/timeline.py --out $OUT --ms 16,64 --tag s16-tail 2>&1 | grep -E '^M =|gemm1|gemm2|finalize' 
timeout 120 python3 benchmarks/timeline.py --out $OUT/plain --ms 16,64 --tag s16-plain --env EXPERTD_KERNEL_TAIL_SPLIT=0 2>&1 | grep -E '^M =|gemm1|gemm2|finalize'
rm -f $OUT/ab/*.png
