export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ls .carry/kernels
timeout 90 python3 -m pytest -q -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_server.py 2>&1 | tail -1
