export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader
L="--lib tree=$TREE"; for n in t1 t1g1 t1g2; do L="$L --lib $n=$PWD/.carry/$n/libexpertd_kernels.so"; done
echo "== token re-copies removed per GEMM (experiment builds, wrong results) against the tree"
timeout 300 python3 benchmarks/energy_ab.py $L --rounds 2 --ms 256,512,1024 --seconds 2.0 --out $OUT/eab 2>&1 | tail -22
rm -f $OUT/eab/r*.json
