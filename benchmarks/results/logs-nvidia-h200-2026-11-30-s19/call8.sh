export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
echo "== BT 48 against 64 at the bound (lambda 32-38)"
timeout 200 python3 benchmarks/kernel.py --ms 1024,1088,1152,1216 --no-baseline --bt-sweep-max 1216 --bt-list 48,64 --fixed-max 0 --path-ab-max 0 --dec-alt-max 0 --out $OUT/bt 2>&1 | grep -v '^{' | tail -12
echo "== A/B: ring 3 at BT 64 (M = 1536-1792), 4 rounds"
timeout 250 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib r3=$TREE --lib-env r3=EXPERTD_KERNEL_WG_RING=3 --rounds 4 --ms 1408,1600,1792 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -8
rm -rf $OUT/a/r*
