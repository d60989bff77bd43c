export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 90 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
EXPERTD_KERNEL_V8_OVF_GEMMS=3 EXPERTD_KERNEL_OVF=1 timeout 90 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
timeout 400 python3 benchmarks/kernel.py --out $OUT/v8tail --ms 256,512,1024,2048,4096,16384 --variant g1:EXPERTD_KERNEL_V8_OVF_GEMMS=1 --variant g2:EXPERTD_KERNEL_V8_OVF_GEMMS=2 --variant both:EXPERTD_KERNEL_V8_OVF_GEMMS=3 --path-ab-max 16384 --paths "" --rings "" --bt-sweep-max 0 --dec-alt-max 0 --fixed-max 0 --no-baseline 2>&1 | tail -9
rm -f $OUT/v8tail/*.png
