export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
EXPERTD_KERNEL_OVF=1 timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
timeout 400 python3 benchmarks/kernel.py --out $OUT/ovf --ms 16,32,64,96,128 --variant ovf1:EXPERTD_KERNEL_OVF=1 --variant ovf2:EXPERTD_KERNEL_OVF=2 --variant ovf3:EXPERTD_KERNEL_OVF=3 --path-ab-max 128 --paths "" --bt-sweep-max 0 --dec-alt-max 0 --fixed-max 0 --no-baseline 2>&1 | tail -12
rm -f $OUT/ovf/*.png
