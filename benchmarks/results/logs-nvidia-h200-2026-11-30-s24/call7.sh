# Session 24, call 7: the server / client GPU tests with the sync clients on one shared never-closed loop (and the server loops ending their tasks before
# closing), on the device's grpcio 1.84; count asyncio's task / loop errors.
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
T_SERVER=200 bash benchmarks/device_check.sh server 2>&1 | tail -8
echo "asyncio task/loop errors in the server tests' log: $(grep -c 'Task was destroyed\|Event loop is closed' $OUT/server-tests.log)"
cp $OUT/server-tests.log $OUT/call7-server-tests.log
rm -f $OUT/install.log $OUT/gpu.txt $OUT/build.log $OUT/server-tests.log
