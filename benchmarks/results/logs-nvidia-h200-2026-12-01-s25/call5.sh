# Session 25, call 5: final validation of main (kernels unchanged since session 23; the serving
# path's fast path new): GPU kernel tests, the kernel benchmark, server / client GPU tests, sanitizers.
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
T_SERVER=200 T_BENCH=300 T_SAN=120 bash benchmarks/device_check.sh tests,bench,server,sanitize --fixed-max 8 --bt-sweep-max 0 --path-ab-max 0 --dec-alt-max 0 2>&1 | tail -8
grep -v '^{' $OUT/bench.log | tail -27
rm -f $OUT/install.log $OUT/gpu.txt $OUT/build.log
ls -R $OUT | head -20
