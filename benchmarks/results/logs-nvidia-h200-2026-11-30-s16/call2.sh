T_SERVER=150 T_BENCH=300 bash benchmarks/device_check.sh tests,bench,server,sanitize --fixed-max 8 --bt-sweep-max 0 --path-ab-max 0 --dec-alt-max 0
rm -f $OUT/install.log $OUT/gpu.txt $OUT/build.log
grep -h -A3 'graph_floor\|graph floor' $OUT/bench.log | head
ls $OUT
