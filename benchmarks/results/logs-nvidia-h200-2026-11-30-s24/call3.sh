# Session 24, call 3: the split-tail draft's sums, split 0 vs 1 against the reference.
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
EXPERTD_KERNEL_LIB=$PWD/.carry/f/libexpertd_kernels.so timeout 200 python3 benchmarks/results/logs-nvidia-h200-2026-11-30-s24/split_check.py 2>&1 | tee $OUT/call3.log | tail -20
