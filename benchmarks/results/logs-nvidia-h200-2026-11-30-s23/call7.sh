export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader
SWEEP=1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192,16384
timeout 400 python3 benchmarks/set_spread.py --ms 1024,512,2048 --sets 10 --kernel-ms $SWEEP --kernel-ms 16,64,256,512,1024,2048,4096 --kernel-ms 1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192 --kernel-ms 16,64,256,512,1024,2048 --out $OUT 2>&1 | grep -v '^{' | tail -80
