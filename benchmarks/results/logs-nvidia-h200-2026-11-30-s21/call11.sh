export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
echo "== energy A/B: the tree (BT 48 trimmed) against session 20's library; M = 2048 is a control (same kernels)"
timeout 300 python3 benchmarks/energy_ab.py --lib tree=$TREE --lib s20=$PWD/.carry/s20/libexpertd_kernels.so --rounds 4 --ms 1024,2048 --seconds 2.5 --out $OUT/eab 2>&1 | tail -16
rm -f $OUT/eab/r*.json
