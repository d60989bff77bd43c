#!/usr/bin/env bash
# Session 14 call 7: finalize warming its instruction caches before its wait (EXPERTD_FIN_WARM:
# 1 = a dry pass with no route, 2 = a dry pass loading position 0). Bits against main, library A/B.
set -u
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
M=$PWD/.carry/main/libexpertd_kernels.so; W1=$PWD/.carry/warm1/libexpertd_kernels.so; W2=$PWD/.carry/warm2/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
echo "== bits"
EXPERTD_KERNEL_LIB=$M timeout 120 python3 benchmarks/lib_bits.py --save /tmp/main-bits.pt 2>&1 | tail -1
EXPERTD_KERNEL_LIB=$W1 timeout 120 python3 benchmarks/lib_bits.py --compare /tmp/main-bits.pt 2>&1 | grep -c same
EXPERTD_KERNEL_LIB=$W2 timeout 120 python3 benchmarks/lib_bits.py --compare /tmp/main-bits.pt 2>&1 | grep -v "^same"; echo "warm2 bits rc=$?"
echo "== library A/B"
timeout 330 python3 benchmarks/lib_ab.py --lib main=$M --lib warm1=$W1 --lib warm2=$W2 --rounds 2 --ms 1,2,4,8,64,1024 --out $OUT/ab 2>&1 | tail -10
rm -rf $OUT/ab/r*
ls -R $OUT | head
