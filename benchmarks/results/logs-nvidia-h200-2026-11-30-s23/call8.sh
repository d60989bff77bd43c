export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so | head -1)
BASE=$PWD/.carry/base/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader
echo "== GPU kernel tests, tree (static tiles + early GEMM1 weights)"
timeout 120 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -3
echo "== output bits: base (session 23's 8-op build) vs tree"
EXPERTD_KERNEL_LIB=$BASE timeout 60 python3 benchmarks/lib_bits.py --save /tmp/a.pt 2>&1 | tail -1
timeout 60 python3 benchmarks/lib_bits.py --compare /tmp/a.pt 2>&1 | grep -c "^same"
timeout 60 python3 benchmarks/lib_bits.py --compare /tmp/a.pt 2>&1 | grep DIFF | head -3
echo "== memcheck / racecheck (tree)"
timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_case.py 2>&1 | tail -2
timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 python3 benchmarks/sanitize_case.py 2>&1 | tail -2
echo "== A/B: tree (static) vs tree with EXPERTD_KERNEL_STATIC_TILES=0 (nost) vs base, 3 rounds"
timeout 240 python3 benchmarks/lib_ab.py --lib nost=$TREE --lib tree=$TREE --lib base=$BASE --lib-env nost=EXPERTD_KERNEL_STATIC_TILES=0 --rounds 3 --ms 16,128,160,256,384,512,1024,1536,2048 --out $OUT/ab 2>&1 | grep -v '^ *$' | tail -8
rm -rf $OUT/ab/r*
