# Session 26, call 4: the client A/B again at M = 1, 16, 64 (4 rounds, 200 calls each): call 3 read
# M = 1 2-4% slower with the new client, where its per-call tensor work is cheaper on the CPU
# machine.
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/oldsite .carry/oldtree >/tmp/oldinst.log 2>&1 || tail -5 /tmp/oldinst.log
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/newsite . >/tmp/newinst.log 2>&1 || tail -5 /tmp/newinst.log
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 400 python3 .carry/client_ab.py --trees old=/tmp/oldsite:/tmp/site new=/tmp/newsite:/tmp/site --ms 1,16,64 --reps 200 --rounds 4 --out $OUT/client-ab.json 2>&1 | tee $OUT/client-ab.log | tail -40
