export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader
for n in g48a g48b g96a g96b; do
  echo "== GPU kernel tests, $n"
  EXPERTD_KERNEL_LIB=$PWD/.carry/$n/libexpertd_kernels.so timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1
done
L="--lib tree=$TREE"; for n in g48a g48b g96a g96b; do L="$L --lib $n=$PWD/.carry/$n/libexpertd_kernels.so"; done
echo "== A/B: 4-warpgroup blocks (256 rows per token tile) at BT 48 / 96 against the tree, 2 rounds"
timeout 330 python3 benchmarks/lib_ab.py $L --rounds 2 --ms 960,1024,1984,2048 --out $OUT/ab 2>&1 | grep -v '^ *$' | tail -14
rm -rf $OUT/ab/r*
