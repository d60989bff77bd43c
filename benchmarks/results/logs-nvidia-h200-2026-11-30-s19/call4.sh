export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
echo "== A/B: v8 ring forced to 3 / to 2 against the default (3 from BT 96, 2 below), 3 rounds"
timeout 500 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib r3=$TREE --lib-env r3=EXPERTD_KERNEL_WG_RING=3 --lib r2=$TREE --lib-env r2=EXPERTD_KERNEL_WG_RING=2 --rounds 3 --ms 256,512,768,1024,1536,2048,4096 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -10
rm -rf $OUT/a/r*
