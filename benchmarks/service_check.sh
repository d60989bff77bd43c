#!/usr/bin/env bash
# One device call for the service: install (carried wheels), build the kernels, run the GPU
# server tests, then benchmarks/service.py. Logs and JSON/PNG land under $OUT.
#   bash benchmarks/service_check.sh [service.py args...]
set -u -o pipefail
OUT=${OUT:-/tmp/expertd-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export EXPERTD_KERNEL_CACHE=${EXPERTD_KERNEL_CACHE:-$PWD/.carry/kernels}
if ls .whl/*.whl >/dev/null 2>&1; then  # grpcio-health-checking / -reflection 1.84 (not on the image)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { echo "pip install failed"; tail -20 "$OUT/install.log"; exit 1; }
python3 -m expertd.kernels.build >"$OUT/build.log" 2>&1 || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
timeout ${T_TESTS:-300} python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda_server.py >"$OUT/server-tests.log" 2>&1
rc=$?
grep -E "rel err" "$OUT/server-tests.log"
tail -5 "$OUT/server-tests.log"
timeout ${T_BENCH:-420} python3 benchmarks/service.py --out "$OUT" "$@" 2>&1 | tee "$OUT/service.log" | tail -32
echo "server tests rc=$rc; service benchmark rc=$?"
