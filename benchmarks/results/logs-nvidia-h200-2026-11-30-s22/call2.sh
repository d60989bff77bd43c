export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader
L="--lib tree=$TREE"
for n in t1 e3 w1; do L="$L --lib $n=$PWD/.carry/$n/libexpertd_kernels.so"; done
echo "== energy breakdown at large M: experiment builds (wrong results) against the tree"
timeout 300 python3 benchmarks/energy_ab.py $L --rounds 2 --ms 2048,4096 --seconds 2.0 --out $OUT/eab 2>&1 | tail -24
rm -f $OUT/eab/r*.json
echo "== v6 decode alternatives at mid M in energy (A B B A passes)"
timeout 200 python3 benchmarks/clock_watch.py --ms 16,32,64,128 --seconds 3 --no-rates --env EXPERTD_KERNEL_DECODE_ALT=15 --env EXPERTD_KERNEL_DECODE_ALT=11 --out $OUT/clocks-alts.json 2>&1 | tail -30
