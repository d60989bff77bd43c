# Session 26, call 8 (call 6 again, after the client's C sum): the server / client / overlap GPU
# tests and the client CPU tests on the H200 host.
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_server.py tests/test_cuda_client.py tests/test_cuda_overlap.py tests/test_client_combine.py tests/test_client_api.py tests/test_client_stream.py > $OUT/final-tests.log 2>&1; tail -3 $OUT/final-tests.log
