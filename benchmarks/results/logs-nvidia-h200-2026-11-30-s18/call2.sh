export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
echo "== A: main (two call sites) vs tree (one call site), M 64-128, 3 rounds"
timeout 150 python3 benchmarks/lib_ab.py --lib main=.carry/main/libexpertd_kernels.so --lib one=$TREE --rounds 3 --ms 64,96,128 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -10
rm -rf $OUT/a/r*
T_SERVER=150 T_BENCH=300 T_SAN=120 bash benchmarks/device_check.sh tests,bench,server,sanitize --fixed-max 8 --bt-sweep-max 0 --path-ab-max 0 --dec-alt-max 0 2>&1 | tail -30
rm -f $OUT/install.log $OUT/gpu.txt $OUT/build.log
ls $OUT
