export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader
L="--lib tree=$TREE"
for n in e1 e3 t1 w1 all; do L="$L --lib $n=$PWD/.carry/$n/libexpertd_kernels.so"; done
echo "== energy breakdown: experiment builds (wrong results) against the tree"
timeout 480 python3 benchmarks/energy_ab.py $L --rounds 2 --ms 64,256,1024 --seconds 2.0 --out $OUT/eab 2>&1 | tail -40
ls $OUT/eab
rm -f $OUT/eab/r*.json
