export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
echo "== diagnostics: scale bytes (noscale) and scale multiplies (nomul) removed, 3 rounds"
timeout 500 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib noscale=.carry/noscale/libexpertd_kernels.so --lib nomul=.carry/nomul/libexpertd_kernels.so --rounds 3 --ms 16,32,64,128,256,512,1024,2048 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -14
rm -rf $OUT/a/r*
ls -R $OUT | head
