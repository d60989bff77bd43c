"""SM clock, power and clock-event reasons while the shard's forward runs back to back.

    python benchmarks/clock_watch.py --ms 64,512,1024,4096 --seconds 4 --out $OUT/clocks.json

Question (session 21): does the H200 lower its SM clock under the mid-M kernels' mix of ALU,
tensor and DRAM work? The wgmma microbenchmark (benchmarks/wgmma_rs.cu, split cases) ran its
combined ALU + tensor blocks at ~1470 MHz where the tensor part alone ran at ~1780 (clock64
cycles over event time), so part of what looked like contention may be clock. For each M this
runs the forward for --seconds (layer, routing and inputs as benchmarks/kernel.py) while
`nvidia-smi -lms` samples the GPU, then reports the median SM clock, power draw, temperature
and the clock-event reasons seen (power cap, thermal, ...), plus the time and the energy per call
(NVML's energy counter) in that window: graph replays of one input set per M. A bf16 matmul
and a device copy (the floor's two rates) get the same treatment.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_clocks import EnergyMeter, Sampler, energy_meter
from kernel import EL, TOP_K, H, gpu_layer, graphed, parse_env, routes

from expertd.kernels.cuda import CudaBackend


def run_for(seconds: float, step, meter: EnergyMeter | None) -> tuple[float, float, int, float]:
    """Call step() back to back for `seconds`, syncing every 20 calls: (t0, t1, calls, mJ per
    call from the NVML energy counter over the whole run, nan without one)."""
    torch.cuda.synchronize()
    e0 = meter.millijoules() if meter else 0
    t0 = time.monotonic()
    calls = 0
    while time.monotonic() - t0 < seconds:
        for _ in range(20):
            step()
        calls += 20
        torch.cuda.synchronize()
    t1 = time.monotonic()
    mj = (meter.millijoules() - e0) / calls if meter else float("nan")
    return t0, t1, calls, mj


def case(name: str, seconds: float, step, sampler: Sampler, meter) -> dict:
    """One case: step() back to back; time and energy per call, clocks after the first 0.5 s."""
    t0, t1, n, mj = run_for(seconds, step, meter)
    us = (t1 - t0) / n * 1e6
    row = {"case": name, "us_per_call": us, "mj_per_call": mj, "watts": mj / us * 1e3}
    return {**row, **sampler.window(t0 + 0.5, t1)}


def matmul_case(seconds: float, sampler: Sampler, meter) -> dict:
    a = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16)
    row = case("matmul 8192^3", seconds, lambda: torch.mm(a, b), sampler, meter)
    return {**row, "tflops": 2 * 8192**3 / row["us_per_call"] / 1e6}


def copy_case(seconds: float, sampler: Sampler, meter) -> dict:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    row = case("copy 2 GiB", seconds, lambda: dst.copy_(src), sampler, meter)
    return {**row, "gbps": 2 * src.numel() / row["us_per_call"] / 1e3}


def forward_case(m: int, seconds: float, sampler: Sampler, meter, backend, state, inputs, env):
    """Graph replays of the forward (one input set, as benchmarks/kernel.py draws them),
    captured under the kernel switches `env`."""
    g = graphed(backend, state, m, inputs, env=env)
    tag = ",".join(f"{k.removeprefix('EXPERTD_KERNEL_')}={v}" for k, v in env.items())
    row = case(f"M={m}" + (f" {tag}" if tag else ""), seconds, g.replay, sampler, meter)
    return {"m": m, "env": env, **row}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ms", default="64,512,1024,4096")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--period-ms", type=int, default=100)
    ap.add_argument("--out", default="")
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        help="K=V,K=V: kernel switches for a second (third, ...) pass over the same M and "
        "inputs, after the default's (energy / clock A/B of a switch)",
    )
    ap.add_argument("--no-rates", action="store_true", help="skip the matmul and copy cases")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]

    layer = gpu_layer()
    backend = CudaBackend("cuda", max_tokens=max(ms))
    state = backend.prepare(layer)
    gen = torch.Generator(device="cuda").manual_seed(3)
    sampler = Sampler(args.period_ms)
    meter = energy_meter()
    time.sleep(1.0)
    rows = []
    idle0, e0 = time.monotonic(), meter.millijoules() if meter else 0
    time.sleep(1.0)
    idle_w = (meter.millijoules() - e0) / (time.monotonic() - idle0) / 1e3 if meter else None
    rows.append({"case": "idle", "watts": idle_w, **sampler.window(idle0, time.monotonic())})

    if not args.no_rates:
        rows.append(matmul_case(args.seconds, sampler, meter))
        rows.append(copy_case(args.seconds, sampler, meter))
    sets = {}
    for m in ms:
        ids, w = routes(m, gen)
        x = torch.randn((m, H), generator=gen, device="cuda").to(torch.bfloat16)
        sets[m] = (x, ids, w)
    envs = [{}] + [parse_env(e) for e in args.env]
    for m in ms:
        # With switches: A B B A per M (each for --seconds / 2), so a drift of the clock or the
        # temperature over the pass falls on both sides alike.
        order = envs if len(envs) == 1 else envs + envs[::-1]
        secs = args.seconds if len(envs) == 1 else args.seconds / 2
        for env in order:
            rows.append(forward_case(m, secs, sampler, meter, backend, state, sets[m], env))
    sampler.close()

    print(
        f"{'case':22s} {'us/call':>9s} {'mJ/call':>8s} {'W':>5s} {'SM MHz':>7s} {'min':>6s} "
        f"{'C':>4s}  reasons"
    )
    nan = float("nan")
    for r in rows:
        print(
            f"{r['case']:22s} {r.get('us_per_call', nan):9.1f} {r.get('mj_per_call', nan):8.2f} "
            f"{r.get('watts') or nan:5.0f} {r.get('sm_mhz_median', 0):7.0f} "
            f"{r.get('sm_mhz_min', 0):6.0f} {r.get('temp_c_median', 0):4.0f}  "
            f"{','.join(r.get('reasons', []))}"
        )
    print("W: energy counter (NVML) over the run / its time; SM MHz: nvidia-smi samples")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps({"top_k": TOP_K, "local_experts": EL, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
