#!/usr/bin/env bash
# Session 14 call 2: decode alternatives 32 / 33 (branch s14-g2-16row: alts 13 / 28 with GEMM2 in
# alt 28's GEMM1 shape, 16 rows / 4 warps / 4 stages). GPU tests on the draft, then library A/B:
# main, the draft's default, the draft with alt 33 and with alt 32 forced.
set -u
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
T=$(ls -d $PWD/.carry/kernels/*/ | head -1)libexpertd_kernels.so
M=$PWD/.carry/main/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
echo "== gpu tests (draft)"
timeout 150 python3 -m pytest -q --noconftest -p no:cacheprovider -m cuda tests/test_cuda_kernels.py 2>&1 | tail -3
echo "== library A/B"
timeout 400 python3 benchmarks/lib_ab.py --lib main=$M --lib draft=$T --lib d33=$T --lib d32=$T --lib-env d33=EXPERTD_KERNEL_DECODE_ALT=33 --lib-env d32=EXPERTD_KERNEL_DECODE_ALT=32 --rounds 2 --ms 1,2,3,4,8,16 --out $OUT/ab 2>&1 | tail -16
rm -rf $OUT/ab/r*
ls -R $OUT | head
