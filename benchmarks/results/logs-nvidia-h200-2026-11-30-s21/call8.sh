export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so | head -1)
T8=$PWD/.carry/t8/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
echo "== GPU kernel tests, t8 (wgmma widths in steps of 8: BT 48 32/40/48, BT 96 above 48)"
EXPERTD_KERNEL_LIB=$T8 timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
echo "== A/B t8 against the tree (BT 48 trimmed to 32 since cf7b304), 3 rounds"
timeout 260 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib t8=$T8 --rounds 3 --ms 960,1024,1088,1920,2048,2176 --out $OUT/a 2>&1 | grep -v '^ *$' | tail -5
rm -rf $OUT/a/r*
