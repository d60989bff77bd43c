export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
for v in 0 1 2 3; do
  if [ $v = 0 ]; then unset EXPERTD_KERNEL_DEFINES; else export EXPERTD_KERNEL_DEFINES="-DEXPERTD_TL_ROUTE_MARK=$v"; fi
  echo "== route mark $v"
  timeout 100 python3 benchmarks/timeline.py --out $OUT --ms 16,64,512 --reps 20 --tag s16-route-mark$v 2>&1 | grep -E '^M =| route |gemm1  '
done
