T_BENCH=300 bash benchmarks/device_check.sh bench --fixed-max 8 --bt-sweep-max 0 --path-ab-max 0 --dec-alt-max 0 2>&1 | tail -22
rm -f $OUT/install.log $OUT/gpu.txt $OUT/build.log
ls $OUT
