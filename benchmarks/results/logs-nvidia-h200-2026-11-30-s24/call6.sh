# Session 24, call 6: the server / client GPU tests after the loops end their tasks before
# closing (stop_loop_thread), on the device's grpcio 1.84; count asyncio's task / loop errors.
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
T_SERVER=200 bash benchmarks/device_check.sh server 2>&1 | tail -8
echo "asyncio task/loop errors in the server tests' log: $(grep -c 'Task was destroyed\|Event loop is closed' $OUT/server-tests.log)"
cp $OUT/server-tests.log $OUT/call6-server-tests.log
rm -f $OUT/install.log $OUT/gpu.txt $OUT/build.log $OUT/server-tests.log
