export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv,noheader
T_BENCH=300 bash benchmarks/device_check.sh bench --fixed-max 8 --bt-sweep-max 0 --path-ab-max 0 --dec-alt-max 0 >/dev/null 2>&1
grep -v '^{' $OUT/bench.log | tail -26
echo "== decode alternatives at M = 1, 2, 4 against the default (alt 28 to 8 routes, 13 below 128)"
timeout 200 python3 benchmarks/kernel.py --ms 1,2,4 --no-baseline --dec-alt-max 4 --dec-alts 6,13,14,18 --path-ab-max 0 --bt-sweep-max 0 --fixed-max 0 --out $OUT/dec 2>&1 | grep -v '^{' | tail -6
rm -f $OUT/install.log $OUT/gpu.txt $OUT/build.log $OUT/dec/*.png
ls $OUT
