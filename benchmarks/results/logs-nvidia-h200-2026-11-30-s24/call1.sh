# Session 24, call 1: slot occupancy of both GEMMs (timeline build) at M = 16-2048.
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
timeout 400 python3 benchmarks/timeline.py --ms 16,64,160,256,384,512,1024,2048 --reps 10 --out $OUT --tag s24-occupancy 2>&1 | tee $OUT/call1.log | grep -v "^$"
