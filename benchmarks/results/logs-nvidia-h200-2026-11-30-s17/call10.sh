T_BENCH=300 bash benchmarks/device_check.sh bench --fixed-max 8 --bt-sweep-max 0 --path-ab-max 0 --dec-alt-max 0 2>&1 | tail -22
timeout 200 python3 benchmarks/timeline.py --ms 2,128 --reps 10 --out $OUT --tag s17-ovf 2>&1 | tail -30
rm -f $OUT/install.log $OUT/gpu.txt $OUT/build.log
ls $OUT
