#!/usr/bin/env bash
# Session 14 call 1: GPU tests on the tree (host tidy-up: grid rows computed once, one GEMM2
# launch in launch_gemms), library A/B main / tree / trig (EXPERTD_EARLY_TRIGGER=15: every GEMM
# block issues launch_dependents at entry), decode alternatives at the alt 13 / 18 boundary.
set -u
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
T=$(ls -d $PWD/.carry/kernels/*/ | head -1)libexpertd_kernels.so
M=$PWD/.carry/main/libexpertd_kernels.so; G=$PWD/.carry/trig/libexpertd_kernels.so
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
echo "== gpu tests (tree)"
timeout 150 python3 -m pytest -q --noconftest -p no:cacheprovider -m cuda tests/test_cuda_kernels.py 2>&1 | tail -3
echo "== gpu tests (trig)"
EXPERTD_KERNEL_LIB=$G timeout 150 python3 -m pytest -q --noconftest -p no:cacheprovider -m cuda tests/test_cuda_kernels.py 2>&1 | tail -2
echo "== library A/B"
timeout 330 python3 benchmarks/lib_ab.py --lib main=$M --lib tree=$T --lib trig=$G --rounds 2 --ms 1,2,4,8,16,32,64,256,1024 --out $OUT/ab 2>&1 | tail -14
rm -rf $OUT/ab/r*
echo "== alt boundary"
timeout 120 python3 benchmarks/kernel.py --ms 8,16,32 --no-baseline --bt-sweep-max 0 --dec-alt-max 0 --fixed-max 0 --path-ab-max 32 --paths "" --variant a13:EXPERTD_KERNEL_DECODE_ALT=13 --variant a18:EXPERTD_KERNEL_DECODE_ALT=18 --out $OUT/alt 2>&1 | tail -8
ls -R $OUT | head
