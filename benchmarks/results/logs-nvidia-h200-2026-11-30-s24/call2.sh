# Session 24, call 2: v8 split tail. GPU tests on the split build (f: BT 16 at MB 3) with every
# v8 call split (EXPERTD_KERNEL_V8_SPLIT=1), then lib_ab: old (main 59bf352) / f with split 0, 0.5,
# 1, 1.5 waves of half items at BT 16 (M 160-384), 48 (1024), 64 (1536).
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
F=$PWD/.carry/f/libexpertd_kernels.so
EXPERTD_KERNEL_LIB=$F EXPERTD_KERNEL_V8_SPLIT=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_kernels.py -x 2>&1 | tail -4 | tee $OUT/call2-tests.log
timeout 330 python3 benchmarks/lib_ab.py --lib old=$PWD/.carry/old/libexpertd_kernels.so --lib s0=$F --lib s05=$F --lib s1=$F --lib s15=$F \
  --lib-env s0=EXPERTD_KERNEL_V8_SPLIT=0 --lib-env s05=EXPERTD_KERNEL_V8_SPLIT=0.5 --lib-env s1=EXPERTD_KERNEL_V8_SPLIT=1 --lib-env s15=EXPERTD_KERNEL_V8_SPLIT=1.5 \
  --rounds 2 --ms 160,256,384,1024,1536 --out $OUT/ab 2>&1 | tee $OUT/call2-ab.log | grep -v "^== "
cp $OUT/ab/lib-ab.json $OUT/lib-ab-s24-split.json; rm -rf $OUT/ab
