T_SAN=90 bash benchmarks/device_check.sh tests,sanitize 2>&1 | tail -8
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels PYTHONPATH=/tmp/site
timeout 240 python3 benchmarks/kernel.py --out $OUT/ab --ms 16,32,64,128,256,512,1024 --variant general:EXPERTD_KERNEL_ROUTE_WARP=0 --path-ab-max 1024 --paths "" --bt-sweep-max 0 --dec-alt-max 0 --fixed-max 0 --no-baseline 2>&1 | tail -11
rm -f $OUT/ab/*.png $OUT/install.log $OUT/gpu.txt $OUT/build.log
