# Session 25, call 1: where a lone small request's time goes on the H200 host.
# (1) runner_latency.py: BatchRunner in one process, no gRPC (run / launch / wait / replay / copies /
#     one fused graph with the copies inside / an event sync); (2) latency.py, one shard process
#     alone over gRPC; (3) py-spy (--native --idle, raw) of that shard under back-to-back M = 1 calls.
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nproc; nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
timeout 200 python3 benchmarks/runner_latency.py --out $OUT --ms 1,16,256 --reps 400 --tag -s25 2>&1 | tail -12
timeout 200 python3 benchmarks/latency.py --out $OUT --depths 2 --ms 1,16,256 --reps 300 2>&1 | tail -6
python3 -m expertd serve --synthetic muse-spark --layers 1 --shard 0 --num-shards 8 --device cuda \
  --listen 127.0.0.1:50999 --log-level WARNING > $OUT/spy-server.log 2>&1 &
SRV=$!
timeout 150 python3 .carry/lat_client.py 127.0.0.1:50999 muse-spark 1 16 > $OUT/spy-client.log 2>&1 &
CL=$!
for i in $(seq 120); do grep -q serving $OUT/spy-client.log 2>/dev/null && break; sleep 1; done
sleep 3
nvidia-smi --query-gpu=clocks.sm,power.draw,utilization.gpu --format=csv,noheader -lms 250 > $OUT/spy-smi.csv &
SMI=$!
timeout 30 /tmp/site/bin/py-spy record --pid $SRV --duration 6 --rate 500 --threads --native --idle -f raw -o $OUT/spy-m1.txt 2>&1 | tail -2
kill $SMI; wait $CL; cat $OUT/spy-client.log; kill $SRV; wait $SRV
ls $OUT
