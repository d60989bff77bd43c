export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 400 python3 benchmarks/kernel.py --out $OUT/ovf --ms 32,64,96,128 --variant g1:EXPERTD_KERNEL_OVF=2,EXPERTD_KERNEL_OVF_GEMMS=1 --variant g2:EXPERTD_KERNEL_OVF=2,EXPERTD_KERNEL_OVF_GEMMS=2 --variant both:EXPERTD_KERNEL_OVF=2,EXPERTD_KERNEL_OVF_GEMMS=3 --path-ab-max 128 --paths "" --bt-sweep-max 0 --dec-alt-max 0 --fixed-max 0 --no-baseline 2>&1 | tail -8
rm -f $OUT/ovf/*.png
