# Session 26, call 2: the energy floor again (another sample) with the read + MMA pair cases at
# M = 512, 1024, 2048 (benchmarks/energy_floor.py --pairs).
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,serial --format=csv | sed 's/, [0-9]*$/, (serial)/'
timeout 500 python3 benchmarks/energy_floor.py --seconds 3 --out $OUT/energy-floor.json 2>&1 | tee $OUT/energy-floor.log | grep -v Warning
