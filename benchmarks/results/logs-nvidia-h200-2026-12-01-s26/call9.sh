# Session 26, call 9: energy_floor.py after the review refactor (power limit through
# gpu_clocks.EnergyMeter, dynamic_j): a short run, M = 64 and 1024, pair at 1024.
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python3 benchmarks/energy_floor.py --seconds 1.5 --ms 64,1024 --pairs 1024 --out $OUT/energy-floor.json 2>&1 | tee $OUT/energy-floor.log | grep -v Warning
