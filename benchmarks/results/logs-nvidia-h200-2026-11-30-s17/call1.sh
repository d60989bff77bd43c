export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
NEW=$(ls .carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
echo "== A: before (f3bded4) vs main, M 16-128"
timeout 150 python3 benchmarks/lib_ab.py --lib before=.carry/before/libexpertd_kernels.so --lib main=$NEW --rounds 2 --ms 16,32,64,128 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -8
echo "== C: main vs v8 early, M 256-1024"
timeout 170 python3 benchmarks/lib_ab.py --lib main=$NEW --lib v8e=.carry/v8e/libexpertd_kernels.so --rounds 3 --ms 256,512,1024 --out $OUT/c 2>&1 | grep -v '^ *$' | tail -8
echo "== B: main vs decode early 2 / 1, M 1-8"
timeout 190 python3 benchmarks/lib_ab.py --lib main=$NEW --lib e2=.carry/e2/libexpertd_kernels.so --lib e1=.carry/e1/libexpertd_kernels.so --rounds 2 --ms 1,2,4,8 --out $OUT/b 2>&1 | grep -v '^ *$' | tail -10
rm -rf $OUT/a/r* $OUT/b/r* $OUT/c/r*
ls -R $OUT | head
