# Session 26, call 7: the client's sum in C (client/csrc/combine.c, new) against HEAD's numpy sum
# (old), the same 8 muse-spark shards, alternating, M = 1, 16, 64, 256, 4 rounds; then the
# client GPU test and the combine tests on the host.
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/oldsite .carry/oldtree >/tmp/oldinst.log 2>&1 || tail -5 /tmp/oldinst.log
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/newsite . >/tmp/newinst.log 2>&1 || tail -5 /tmp/newinst.log
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ls /tmp/newsite/expertd/client/csrc/ && (cd /tmp && PYTHONPATH=/tmp/newsite:/tmp/site python3 -c "from expertd.client import native; print(native.library())")
timeout 420 python3 .carry/client_ab.py --trees old=/tmp/oldsite:/tmp/site new=/tmp/newsite:/tmp/site --ms 1,16,64,256 --reps 150 --rounds 4 --out $OUT/client-ab.json 2>&1 | tee $OUT/client-ab.log | tail -40
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_client.py tests/test_client_combine.py > $OUT/tests.log 2>&1; tail -2 $OUT/tests.log
