export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
NEW=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 250 python3 benchmarks/lib_ab.py --lib main=$NEW --lib o1=.carry/o1/libexpertd_kernels.so --lib o2=.carry/o2/libexpertd_kernels.so --rounds 2 --ms 64,96,128 --out $OUT/o 2>&1 | grep -v '^ *$' | tail -7
rm -rf $OUT/o/r*
