export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
V="--variant a13:EXPERTD_KERNEL_DECODE_ALT=13 --variant a15:EXPERTD_KERNEL_DECODE_ALT=15 --variant a18:EXPERTD_KERNEL_DECODE_ALT=18 --variant a28:EXPERTD_KERNEL_DECODE_ALT=28 --variant g2plain:EXPERTD_KERNEL_G2_PER_SM=-1"
timeout 400 python3 benchmarks/kernel.py --out $OUT/alts --ms 1,2,3,4,6,8 --sets 32 $V --path-ab-max 8 --paths "" --bt-sweep-max 0 --dec-alt-max 0 --fixed-max 0 --no-baseline 2>&1 | tail -12
rm -f $OUT/alts/*.png
