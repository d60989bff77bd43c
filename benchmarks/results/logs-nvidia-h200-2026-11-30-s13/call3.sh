#!/usr/bin/env bash
# Session 13 call 3: v6 grids capped at 1.5x the shard's share of routes + El above 64 routes
# (branch s13-rowcap, host only: kernels identical to main's), library A/B at M = 16-128.
set -u
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
C=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so); M=$PWD/.carry/main/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
echo "== gpu tests (cap)"
EXPERTD_KERNEL_LIB=$C timeout 150 python3 -m pytest -q --noconftest -p no:cacheprovider -m cuda tests/test_cuda_kernels.py 2>&1 | tail -3
echo "== library A/B"
timeout 400 python3 benchmarks/lib_ab.py --lib main=$M --lib cap=$C --lib capoff=$C --lib-env capoff=EXPERTD_KERNEL_ROW_CAP=0 --rounds 3 --ms 16,32,64,128 --out $OUT/ab 2>&1 | tail -16
rm -rf $OUT/ab/r*
ls -R $OUT | head
