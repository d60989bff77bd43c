"""SM clock, power and clock-event reasons while the shard's forward runs back to back.

    python benchmarks/clock_watch.py --ms 64,512,1024,4096 --seconds 4 --out $OUT/clocks.json

Question (session 21): does the H200 lower its SM clock under the mid-M kernels' mix of ALU,
tensor and DRAM work? The wgmma microbenchmark (benchmarks/wgmma_rs.cu, split cases) ran its
combined ALU + tensor blocks at ~1470 MHz where the tensor part alone ran at ~1780 (clock64
cycles over event time), so part of what looked like contention may be clock. For each M this
runs eager forwards for --seconds (layer, routing and inputs as benchmarks/kernel.py) while
`nvidia-smi -lms` samples the GPU, then reports the median SM clock, power draw, temperature
and the clock-event reasons seen (power cap, thermal, ...), plus the time per call in that
window. A bf16 matmul and a device copy (the floor's two rates) get the same treatment.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, "benchmarks")
from gpu_clocks import Sampler
from kernel import EL, TOP_K, H, gpu_layer, routes

from expertd.kernels.cuda import CudaBackend


def run_for(seconds: float, step) -> tuple[float, float, int]:
    """Call step() back to back for `seconds`, syncing every 20 calls; (t0, t1, calls)."""
    torch.cuda.synchronize()
    t0 = time.monotonic()
    calls = 0
    while time.monotonic() - t0 < seconds:
        for _ in range(20):
            step()
        calls += 20
        torch.cuda.synchronize()
    return t0, time.monotonic(), calls


def matmul_case(seconds: float, sampler: Sampler) -> dict:
    a = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16)
    t0, t1, n = run_for(seconds, lambda: torch.mm(a, b))
    us = (t1 - t0) / n * 1e6
    tflops = 2 * 8192**3 / us / 1e6
    return {
        "case": "matmul 8192^3",
        "us_per_call": us,
        "tflops": tflops,
        **sampler.window(t0 + 0.5, t1),
    }


def copy_case(seconds: float, sampler: Sampler) -> dict:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t0, t1, n = run_for(seconds, lambda: dst.copy_(src))
    us = (t1 - t0) / n * 1e6
    return {
        "case": "copy 2 GiB",
        "us_per_call": us,
        "gbps": 2 * src.numel() / us / 1e3,
        **sampler.window(t0 + 0.5, t1),
    }


def forward_case(m: int, seconds: float, sampler: Sampler, backend, state, gen) -> dict:
    ids, w = routes(m, gen)
    x = torch.randn((m, H), generator=gen, device="cuda").to(torch.bfloat16)
    out = torch.empty((m, H), dtype=torch.bfloat16, device="cuda")
    t0, t1, n = run_for(seconds, lambda: backend.forward_into(state, x, ids, w, out))
    us = (t1 - t0) / n * 1e6
    return {"case": f"forward M={m}", "m": m, "us_per_call": us, **sampler.window(t0 + 0.5, t1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ms", default="64,512,1024,4096")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--period-ms", type=int, default=100)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]

    layer = gpu_layer()
    backend = CudaBackend("cuda", max_tokens=max(ms))
    state = backend.prepare(layer)
    gen = torch.Generator(device="cuda").manual_seed(3)
    sampler = Sampler(args.period_ms)
    time.sleep(1.0)
    rows = []
    idle0 = time.monotonic()
    time.sleep(1.0)
    rows.append({"case": "idle", **sampler.window(idle0, time.monotonic())})

    rows.append(matmul_case(args.seconds, sampler))
    rows.append(copy_case(args.seconds, sampler))
    for m in ms:
        rows.append(forward_case(m, args.seconds, sampler, backend, state, gen))
    sampler.close()

    print(
        f"{'case':22s} {'us/call':>9s} {'SM MHz':>7s} {'min':>6s} {'mem':>6s} {'W':>6s} {'C':>4s}  reasons"
    )
    for r in rows:
        print(
            f"{r['case']:22s} {r.get('us_per_call', float('nan')):9.1f} {r.get('sm_mhz_median', 0):7.0f} "
            f"{r.get('sm_mhz_min', 0):6.0f} {r.get('mem_mhz_median', 0):6.0f} {r.get('power_w_median', 0):6.0f} "
            f"{r.get('temp_c_median', 0):4.0f}  {','.join(r.get('reasons', []))}"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps({"top_k": TOP_K, "local_experts": EL, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
