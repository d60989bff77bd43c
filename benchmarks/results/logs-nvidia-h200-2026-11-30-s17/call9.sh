T_SERVER=150 T_BENCH=300 T_SAN=120 bash benchmarks/device_check.sh tests,bench,server,sanitize --fixed-max 8 --bt-sweep-max 0 --path-ab-max 0 --dec-alt-max 0 2>&1 | tail -32
rm -f $OUT/install.log $OUT/gpu.txt $OUT/build.log
ls $OUT
