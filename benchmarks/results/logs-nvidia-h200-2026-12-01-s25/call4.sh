# Session 25, call 4: server_trace.py (step timestamps inside one shard process, new tree) at
# M = 1 and 16; then the 8-shard service benchmark, old (dea9ee0) / new alternating, M = 1,16,64.
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/oldsite .carry/oldtree >/tmp/oldinst.log 2>&1 || tail -5 /tmp/oldinst.log
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
R=$PWD
for m in 1 16; do timeout 100 python3 benchmarks/server_trace.py --out $OUT --m $m --seconds 6 --tag=-s25 2>&1 | tail -12; done
for who in old new; do
  mkdir -p $OUT/svc-$who
  if [ $who = old ]; then
    (cd /tmp && PYTHONPATH=/tmp/oldsite:/tmp/site timeout 170 python3 $R/.carry/oldtree/benchmarks/service.py --out $OUT/svc-$who --ms 1,16,64 --reps 30 --seconds 1 2>&1 | grep -E "^M=|clients|tok" | sed "s/^/$who /")
  else
    timeout 170 python3 benchmarks/service.py --out $OUT/svc-$who --ms 1,16,64 --reps 30 --seconds 1 2>&1 | grep -E "^M=|clients|tok" | sed "s/^/$who /"
  fi
done
