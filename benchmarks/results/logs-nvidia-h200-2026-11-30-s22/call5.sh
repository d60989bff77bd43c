export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv,noheader
T_SERVER=150 T_BENCH=300 T_SAN=120 bash benchmarks/device_check.sh tests,bench,server,sanitize --fixed-max 8 --bt-sweep-max 0 --path-ab-max 0 --dec-alt-max 0 2>&1 | tail -8
grep -v '^{' $OUT/bench.log | tail -27
rm -f $OUT/install.log $OUT/gpu.txt $OUT/build.log
TREE=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so | head -1)
echo "== BT 64 against 96 (4 warpgroups) at lambda 40-56"
timeout 100 python3 benchmarks/kernel.py --ms 1280,1536,1792 --no-baseline --bt-sweep-max 1792 --bt-list 64,96 --fixed-max 0 --path-ab-max 0 --dec-alt-max 0 --out $OUT/bt 2>&1 | grep -v '^{' | tail -6
rm -f $OUT/bt/*.png
echo "== energy A/B: the tree against session 21's library (old), 2 rounds"
timeout 150 python3 benchmarks/energy_ab.py --lib tree=$TREE --lib old=$PWD/.carry/old/libexpertd_kernels.so --rounds 2 --ms 2048,8192 --seconds 2.0 --out $OUT/eab 2>&1 | tail -12
rm -f $OUT/eab/r*.json
ls -R $OUT | head -30
