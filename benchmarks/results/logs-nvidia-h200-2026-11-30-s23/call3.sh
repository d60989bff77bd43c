export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
echo "== output bits: session 22's library with session 22's repack (old tree) against the tree's"
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/oldsite .carry/oldtree >/tmp/oldinst.log 2>&1 || tail -5 /tmp/oldinst.log
(cd .carry/oldtree && EXPERTD_KERNEL_LIB=$PWD/../old/libexpertd_kernels.so PYTHONPATH=/tmp/oldsite:/tmp/site timeout 90 python3 -c "import expertd.kernels.repack as r, sys; print('old repack from', r.__file__); print(r.e2m1_regs(0x12345678))" && EXPERTD_KERNEL_LIB=$PWD/../old/libexpertd_kernels.so PYTHONPATH=/tmp/oldsite:/tmp/site timeout 90 python3 benchmarks/lib_bits.py --save /tmp/a.pt 2>&1 | tail -1)
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -c "import expertd.kernels.repack as r; print('new repack from', r.__file__); print(r.e2m1_regs(0x12345678))"
timeout 90 python3 benchmarks/lib_bits.py --compare /tmp/a.pt 2>&1 | tail -15
echo "== final run"
T_SERVER=150 T_BENCH=300 T_SAN=120 bash benchmarks/device_check.sh tests,bench,server,sanitize --fixed-max 8 --bt-sweep-max 0 --path-ab-max 0 --dec-alt-max 0 2>&1 | tail -8
grep -v '^{' $OUT/bench.log | tail -27
rm -f $OUT/install.log $OUT/gpu.txt $OUT/build.log
ls -R $OUT | head -20
