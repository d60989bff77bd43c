T_SERVER=150 T_BENCH=300 bash benchmarks/device_check.sh tests,bench,server,sanitize --fixed-max 8 --bt-sweep-max 0 --dec-alt-max 0 --variant r4:EXPERTD_KERNEL_GRID_ROWS=4 --variant-min 2 --path-ab-max 8 --paths ""
rm -f $OUT/install.log $OUT/gpu.txt $OUT/build.log
ls $OUT
