#!/usr/bin/env bash
# Session 13 call 5: GEMM2-only share cap above 64 routes (GEMM1 keeps its full grid; branch
# s13-rowcap2; host only), library A/B against main at M = 16-128.
set -u
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
C=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so); M=$PWD/.carry/main/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
echo "== gpu tests (cap2)"
EXPERTD_KERNEL_LIB=$C timeout 150 python3 -m pytest -q --noconftest -p no:cacheprovider -m cuda tests/test_cuda_kernels.py -k "cap or forward or decode or route" 2>&1 | tail -2
echo "== library A/B"
timeout 420 python3 benchmarks/lib_ab.py --lib main=$M --lib cap2=$C --lib both=$C --lib-env both=EXPERTD_KERNEL_ROW_CAP=1 --rounds 3 --ms 16,32,48,64,96,128 --out $OUT/ab 2>&1 | tail -14
rm -rf $OUT/ab/r*
