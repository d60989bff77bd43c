# Session 25, call 3: the small-batch fast path (fused graphs with the copies inside up to 64
# tokens; small lone batches on the event loop; cheaper validation). GPU server tests, then
# latency.py (one shard alone, depth 2) alternating old (HEAD before the change, from git
# archive) / new / old / new on one machine, then runner_latency.py on the new tree.
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/oldsite .carry/oldtree >/tmp/oldinst.log 2>&1 || tail -5 /tmp/oldinst.log
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
R=$PWD
timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda_server.py tests/test_cuda_client.py tests/test_cuda_overlap.py > $OUT/server-tests.log 2>&1; tail -3 $OUT/server-tests.log
for r in 0 1; do
  for who in old new; do
    mkdir -p $OUT/lat-$r-$who
    if [ $who = old ]; then
      (cd /tmp && PYTHONPATH=/tmp/oldsite:/tmp/site timeout 150 python3 $R/benchmarks/latency.py --out $OUT/lat-$r-$who --depths 2 --ms 1,16,64,256 --reps 300 2>&1 | tail -5 | sed "s/^/$r $who /")
    else
      timeout 150 python3 benchmarks/latency.py --out $OUT/lat-$r-$who --depths 2 --ms 1,16,64,256 --reps 300 2>&1 | tail -5 | sed "s/^/$r $who /"
    fi
  done
done
timeout 150 python3 benchmarks/runner_latency.py --out $OUT --ms 1,16,64,256 --reps 400 --tag=-s25-new 2>&1 | tail -6
