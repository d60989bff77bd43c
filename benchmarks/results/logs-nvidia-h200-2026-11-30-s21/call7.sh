export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so | head -1)
T48=$PWD/.carry/t48/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
echo "== GPU kernel tests, t48 (BT 48 tiles of <= 32 routes on the 32-wide mainloop)"
EXPERTD_KERNEL_LIB=$T48 timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
echo "== A/B t48 against the tree, 3 rounds"
timeout 200 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib t48=$T48 --rounds 3 --ms 896,960,1024,1088,1152 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -5
rm -rf $OUT/a/r*
echo "== energy, t48 then tree, M = 1024 (3 s each)"
for L in t48 tree; do
  [ $L = t48 ] && LIB=$T48 || LIB=$TREE
  EXPERTD_KERNEL_LIB=$LIB timeout 60 python3 benchmarks/clock_watch.py --ms 960,1024 --seconds 3 --no-rates --out $OUT/energy-$L.json 2>&1 | grep "^M="
done
echo "== BT 32 against 48 at the bound (lambda 25-29), t48"
EXPERTD_KERNEL_LIB=$T48 timeout 90 python3 benchmarks/kernel.py --ms 800,864,928 --no-baseline --bt-sweep-max 928 --bt-list 32,48 --fixed-max 0 --path-ab-max 0 --dec-alt-max 0 --out $OUT/bt 2>&1 | grep -v '^{' | tail -5
rm -f $OUT/bt/*.png
