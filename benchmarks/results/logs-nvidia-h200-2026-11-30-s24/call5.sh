# Session 24, call 5: the decode alternative at M = 16-32 (128-256 routes: alt 18 by default since
# session 9) against alts 13 and 7 on today's kernels. Paired, 3 rounds.
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
T=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so)
timeout 500 python3 benchmarks/lib_ab.py --lib tree=$T --lib alt13=$T --lib alt7=$T \
  --lib-env alt13=EXPERTD_KERNEL_DECODE_ALT=13 --lib-env alt7=EXPERTD_KERNEL_DECODE_ALT=7 \
  --rounds 3 --ms 12,16,24,32 --out $OUT/ab 2>&1 | tee $OUT/call5-ab.log | grep -v "^== "
cp $OUT/ab/lib-ab.json $OUT/lib-ab-s24-m16-alts.json; rm -rf $OUT/ab
