# Session 24, call 9: the service benchmark (8 muse-spark shard processes on the H200, the real
# client over TCP loopback) with the client's per-call tensor work in numpy (new, up to 2^17 elements) and in torch
# (old client/core.py), alternating new / old / new on one machine.
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nproc; nvidia-smi --query-gpu=name --format=csv,noheader
for v in new old new2; do
  cp .carry/core_${v%2}.py client/core.py
  mkdir -p $OUT/$v
  timeout 170 python3 benchmarks/service.py --out $OUT/$v --ms 1,16,64,256 --reps 5 --seconds 1 2>&1 | grep -E "^M=|clients" | sed "s/^/$v /"
  mv $OUT/$v/service-*.json $OUT/service-s24-client17-$v.json 2>/dev/null; rm -rf $OUT/$v
done
cp .carry/core_new.py client/core.py
