export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader
echo "== ring 2 against ring 3 on the 4-warpgroup tiles (BT 96 / 128 / 144), 2 rounds"
timeout 150 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib r2=$TREE --lib-env r2=EXPERTD_KERNEL_WG_RING=2 --rounds 2 --ms 2048,3072,8192 --out $OUT/ab 2>&1 | grep -v '^ *$' | tail -6
rm -rf $OUT/ab/r*
echo "== token re-copies removed (experiment build, wrong results) on the 4-warpgroup BT 96 / 160"
timeout 120 python3 benchmarks/energy_ab.py --lib tree=$TREE --lib t1=$PWD/.carry/t1/libexpertd_kernels.so --rounds 2 --ms 2048,4096 --seconds 2.0 --out $OUT/eab 2>&1 | tail -12
rm -f $OUT/eab/r*.json
