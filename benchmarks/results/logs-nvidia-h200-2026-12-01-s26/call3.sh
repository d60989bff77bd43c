# Session 26, call 3: (1) the energy floor, a third board, pairs at M = 256-2048; (2) the client
# A/B: HEAD's client (old) against the numpy combine / gather (new), the same 8 muse-spark
# shards, alternating, M = 1, 16, 64, 256; (3) the client GPU tests on the new tree.
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/oldsite .carry/oldtree >/tmp/oldinst.log 2>&1 || tail -5 /tmp/oldinst.log
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/newsite . >/tmp/newinst.log 2>&1 || tail -5 /tmp/newinst.log
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python3 benchmarks/energy_floor.py --seconds 3 --pairs 256,512,1024,2048 --ms 16,64,256,512,1024,2048,4096 --out $OUT/energy-floor.json 2>&1 | tee $OUT/energy-floor.log | grep -v Warning
timeout 330 python3 .carry/client_ab.py --trees old=/tmp/oldsite:/tmp/site new=/tmp/newsite:/tmp/site --ms 1,16,64,256 --reps 100 --rounds 2 --out $OUT/client-ab.json 2>&1 | tee $OUT/client-ab.log | tail -40
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_client.py > $OUT/client-tests.log 2>&1; tail -2 $OUT/client-tests.log
