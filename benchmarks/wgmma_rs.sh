#!/usr/bin/env bash
# Register-A wgmma (RS) throughput at small N, alone and with ALU work (benchmarks/wgmma_rs.cu).
# Run from the repository root on the H200:
#   bash benchmarks/wgmma_rs.sh [wgmma|hmma|pingpong|widths|all]
# Writes $OUT/wgmma_rs (binary), $OUT/wgmma_rs.log (stdout) and $OUT/wgmma_rs.json (JSON lines).
set -eu -o pipefail
OUT=${OUT:-/tmp/wgmma-out}
export OUT
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv || true
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I kernels/csrc -Xptxas -v \
  -o "$OUT/wgmma_rs" benchmarks/wgmma_rs.cu >"$OUT/wgmma_rs.build.log" 2>&1 \
  || { tail -30 "$OUT/wgmma_rs.build.log"; exit 1; }
"$OUT/wgmma_rs" "$@" | tee "$OUT/wgmma_rs.log"
