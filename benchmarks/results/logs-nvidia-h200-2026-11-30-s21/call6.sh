export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export EXPERTD_KERNEL_LIB=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
echo "== energy per call, graph replays, 3 s per case"
timeout 150 python3 benchmarks/clock_watch.py --ms 1,8,16,64,256,512,1024,2048,4096 --seconds 3 --out $OUT/energy.json 2>&1 | tail -16
echo "== energy A/B: every v8 tile at N = BT (FULLN) against the trimmed default, A B B A, 2 s each"
timeout 100 python3 benchmarks/clock_watch.py --ms 256,512,2048 --seconds 4 --no-rates --env EXPERTD_KERNEL_WG_FULLN=1 --out $OUT/energy-fulln.json 2>&1 | tail -15
