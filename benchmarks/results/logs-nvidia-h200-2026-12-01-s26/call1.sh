# Session 26, call 1: the energy floor under the power limit (benchmarks/energy_floor.py):
# idle, a read-only HBM stream, the 8192^3 bf16 matmul, the copy, and the forward at M = 16..16384.
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,power.limit,power.max_limit,clocks.max.sm --format=csv
timeout 400 python3 benchmarks/energy_floor.py --seconds 3 --out $OUT/energy-floor.json 2>&1 | tee $OUT/energy-floor.log | grep -v Warning
