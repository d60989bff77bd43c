# Session 24, call 4: what else at M = 192-320 (BT 16, the 0.6 us miss at 256)? Paired, 3 rounds:
# the tree against itself under ring 3, the v6 path, and no 8-wide mainloop.
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
T=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so)
timeout 500 python3 benchmarks/lib_ab.py --lib tree=$T --lib ring3=$T --lib v6=$T --lib minn16=$T \
  --lib-env ring3=EXPERTD_KERNEL_WG_RING=3 --lib-env v6=EXPERTD_KERNEL_PATH=6 --lib-env minn16=EXPERTD_KERNEL_WG_MIN_N=16 \
  --rounds 3 --ms 192,256,320 --out $OUT/ab 2>&1 | tee $OUT/call4-ab.log | grep -v "^== "
cp $OUT/ab/lib-ab.json $OUT/lib-ab-s24-m256-alts.json; rm -rf $OUT/ab
