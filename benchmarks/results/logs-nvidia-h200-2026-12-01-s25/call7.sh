# Session 25, call 7: the server / client / overlap GPU tests after the review refactor (the fused
# replay moved into BatchRunner._enqueue; GraphBank.fused_bytes from the largest fused layout).
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda_server.py tests/test_cuda_client.py tests/test_cuda_overlap.py > $OUT/server-tests.log 2>&1; tail -3 $OUT/server-tests.log
