# Session 25, call 2: the in-process runner pieces (runner_latency.py) and this host's RPC floor
# (rpc_floor.py: Python steps of one M = 1 request, grpc.aio echo / one-hop round trips).
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nproc; lscpu | grep -E "Model name|MHz"; nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
timeout 120 python3 benchmarks/rpc_floor.py --out $OUT --reps 2000 --tag=-s25 2>&1 | tail -9
timeout 120 python3 benchmarks/rpc_floor.py --out $OUT --m 16 --reps 2000 --tag=-s25-m16 2>&1 | tail -9
timeout 250 python3 benchmarks/runner_latency.py --out $OUT --ms 1,16,256 --reps 400 --tag=-s25 2>&1 | tail -12
