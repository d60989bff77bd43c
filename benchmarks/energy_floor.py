"""The energy floor: what the H200's power limit allows a shard forward at each M.

    python benchmarks/energy_floor.py --out $OUT/energy-floor.json [--ms 16,...] [--seconds 3]

From M = 16 the forward runs at the board's 700 W limit (session 21), so a call's time there is
its energy over the power the board may draw above its idle. Any kernel of this format must at
least read the hit experts' NVFP4 bytes from HBM and do the routes' bf16 MMAs. This measures,
sustained for --seconds each with NVML's energy counter:
  - idle power, and the enforced power limit;
  - a read-only stream of HBM (a Triton kernel summing int32 words: no writes, one add per
    word): energy per byte read;
  - a large bf16 matmul (8192^3, cuBLAS): energy per flop of the best-fed MMAs;
  - the shard forward at each M (graph replays of one input set, as clock_watch.py);
  - at the --pairs M, the call's read and its MMAs as two plain kernels, alone and together.
Then per M (that input set's hits and routes):
  floor    = max(bytes / copy rate, flops / matmul rate), the rates burst-timed as kernel.py;
  t_energy = (bytes x J per byte + flops x J per flop) / (limit - idle): the time below which
             no kernel can run while reading those bytes and doing those MMAs under the limit
             (a lower bound: idle power is the least static draw, and nothing else is counted);
  left     = what the target time leaves over t_energy, as energy: the budget for every
             other part (dequantization, on-chip copies, tokens, epilogues, routing).
Both quantities are reported against the issue's targets (x floor) beside the forward's
sustained time and energy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from clock_watch import case, copy_case, forward_case, matmul_case
from gpu_clocks import Sampler, energy_meter
from kernel import EL, INTER, H, gpu_layer, measure_copy_bw, measure_matmul, routes

from expertd.kernels.cuda import CudaBackend

TARGETS = {1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0, 2048: 1.5, 4096: 1.5, 8192: 1.5, 16384: 1.5}


def target(m: int) -> float:
    """Issue 4's time / floor target at M (1.25 from 16 to 1024)."""
    return TARGETS.get(m, 1.25)


def flops_per_route() -> int:
    return 2 * (H * 2 * INTER + INTER * H)


def energy_row(m: int, nbytes: float, flops: float, rates: dict) -> dict:
    """The floor and the energy floor of one call (seconds, joules; `rates` as main builds it:
    copy_Bps, matmul_flops, j_per_byte, j_per_flop, budget_w)."""
    floor = max(nbytes / rates["copy_Bps"], flops / rates["matmul_flops"])
    e_bytes = nbytes * rates["j_per_byte"]
    e_flops = flops * rates["j_per_flop"]
    t_energy = (e_bytes + e_flops) / rates["budget_w"]
    t_target = target(m) * floor
    return {
        "m": m,
        "bytes": nbytes,
        "flops": flops,
        "floor_us": floor * 1e6,
        "target_x": target(m),
        "target_us": t_target * 1e6,
        "read_mj": e_bytes * 1e3,
        "mma_mj": e_flops * 1e3,
        "t_energy_us": t_energy * 1e6,
        "t_energy_x_floor": t_energy / floor,
        "left_mj": (t_target - t_energy) * rates["budget_w"] * 1e3,
    }


def read_step(nbytes: float):
    """A read-only HBM stream of ~nbytes: Triton sums int32 words per program (8 per thread
    per step), one word written per program. Returns (step, bytes read per call)."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_sum(x_ptr, out_ptr, per_prog, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * per_prog
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for i in range(0, per_prog, BLOCK):
            acc += tl.load(x_ptr + base + i + tl.arange(0, BLOCK))
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    progs, block = 132 * 8, 2048  # one wave of 8 x 256 threads per SM
    per_prog = max(block, round(nbytes / 4 / progs / block) * block)
    x = torch.randint(-1000, 1000, (progs * per_prog,), dtype=torch.int32, device="cuda")
    out = torch.empty(progs, dtype=torch.int32, device="cuda")

    def step():
        read_sum[(progs,)](x, out, per_prog, BLOCK=block, num_warps=8)

    step()
    torch.cuda.synchronize()
    want = x.view(progs, per_prog).to(torch.int64).sum(dim=1).to(torch.int32)  # |sum| < 2^31
    if not torch.equal(out, want):
        raise RuntimeError("read kernel: wrong sums")
    return step, x.numel() * 4


def pair_cases(m: int, nbytes: float, routes_: int, seconds: float, sampler, meter) -> list:
    """The call's two unavoidable parts as separate kernels, sustained: reading its weight bytes
    (the read stream), its MMAs (one cuBLAS matmul [routes, H] x [H, 2I + I]: the same flops),
    each alone and both at once on two streams. The pair's time is what the board's power
    limit and clock policy give the two together, with no dequantization or anything else."""
    read, nread = read_step(nbytes)
    a = torch.randn((routes_, H), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((H, 2 * INTER + INTER), device="cuda", dtype=torch.bfloat16)

    def mm():
        torch.mm(a, b)

    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        cur = torch.cuda.current_stream()
        s1.wait_stream(cur)
        s2.wait_stream(cur)
        with torch.cuda.stream(s1):
            read()
        with torch.cuda.stream(s2):
            mm()
        cur.wait_stream(s1)
        cur.wait_stream(s2)

    rows = []
    for name, step in (("read", read), ("mma", mm), ("read+mma", both)):
        row = case(f"M={m} {name}", seconds, step, sampler, meter)
        rows.append({"m": m, "part": name, "bytes": nread, "routes": routes_, **row})
    return rows


def dynamic_j(row: dict, idle_w: float) -> float:
    """A sustained case's energy per call above idle, in joules."""
    return row["mj_per_call"] / 1e3 - idle_w * row["us_per_call"] / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ms", default="16,64,256,512,1024,2048,4096,16384")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--pairs", default="512,1024,2048", help="M of the read + MMA pair cases")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    pairs = {int(m) for m in args.pairs.split(",") if m}
    meter = energy_meter()
    if meter is None:
        sys.exit("energy_floor.py needs NVML's energy counter")
    sampler = Sampler(100)

    copy_bps, matmul_flops = measure_copy_bw(), measure_matmul()  # burst, as kernel.py's floor
    time.sleep(1.0)
    t0, e0 = time.monotonic(), meter.millijoules()
    time.sleep(2.0)
    idle_w = (meter.millijoules() - e0) / (time.monotonic() - t0) / 1e3
    limit_w = meter.power_limit_w() or 700.0
    rows = [{"case": "idle", "watts": idle_w, **sampler.window(t0, time.monotonic())}]

    step, nread = read_step(2 << 30)
    read = case("read 2 GiB", args.seconds, step, sampler, meter)
    read["read_gbps"] = nread / read["us_per_call"] / 1e3
    mm = matmul_case(args.seconds, sampler, meter)
    cp = copy_case(args.seconds, sampler, meter)
    rows += [read, mm, cp]
    rates = {
        "copy_Bps": copy_bps,
        "matmul_flops": matmul_flops,
        "idle_w": idle_w,
        "limit_w": limit_w,
        "budget_w": limit_w - idle_w,
        "j_per_byte": dynamic_j(read, idle_w) / nread,
        "j_per_flop": dynamic_j(mm, idle_w) / (2 * 8192**3),
        "copy_j_per_byte_moved": dynamic_j(cp, idle_w) / (4 << 30),
    }

    layer = gpu_layer()
    backend = CudaBackend("cuda", max_tokens=max(ms))
    state = backend.prepare(layer)
    expert_bytes = layer.nbytes() / EL
    local_of = layer.global_to_local("cuda").long()
    gen = torch.Generator(device="cuda").manual_seed(3)
    per_m = []
    for m in ms:
        ids, w = routes(m, gen)
        x = torch.randn((m, H), generator=gen, device="cuda").to(torch.bfloat16)
        slots = local_of[ids.long()]
        hits = int(torch.unique(slots[slots >= 0]).numel())
        nroutes = int((slots >= 0).sum())
        fwd = forward_case(m, args.seconds, sampler, meter, backend, state, (x, ids, w), {})
        row = energy_row(m, hits * expert_bytes, nroutes * flops_per_route(), rates)
        row.update(
            hits=hits,
            routes=nroutes,
            sustained_us=fwd["us_per_call"],
            sustained_mj=fwd["mj_per_call"],
            sustained_x_floor=fwd["us_per_call"] / row["floor_us"],
            sm_mhz=fwd.get("sm_mhz_median"),
        )
        if m in pairs:
            pair = pair_cases(m, hits * expert_bytes, nroutes, args.seconds, sampler, meter)
            row["pair_us"] = {p["part"]: p["us_per_call"] for p in pair}
            row["pair_mj"] = {p["part"]: p["mj_per_call"] for p in pair}
            rows += pair
        per_m.append(row)
        rows.append(fwd)
    sampler.close()

    print(
        f"idle {idle_w:.0f} W, limit {limit_w:.0f} W; read {read['read_gbps']:.0f} GB/s at "
        f"{read['watts']:.0f} W: {rates['j_per_byte'] * 1e12:.1f} pJ/B; matmul "
        f"{mm['tflops']:.0f} TFLOP/s at {mm['watts']:.0f} W: {rates['j_per_flop'] * 1e12:.3f} "
        f"pJ/flop; copy {cp['gbps']:.0f} GB/s at {cp['watts']:.0f} W"
    )
    print(
        f"{'M':>6} {'floor us':>9} {'target x':>8} {'t_energy us':>11} {'x floor':>8} "
        f"{'left mJ':>8} {'sustained us':>12} {'x floor':>8} {'mJ':>7}"
    )
    for r in per_m:
        print(
            f"{r['m']:>6} {r['floor_us']:>9.1f} {r['target_x']:>8.2f} {r['t_energy_us']:>11.1f} "
            f"{r['t_energy_x_floor']:>8.2f} {r['left_mj']:>8.1f} {r['sustained_us']:>12.1f} "
            f"{r['sustained_x_floor']:>8.2f} {r['sustained_mj']:>7.1f}"
        )
    for r in per_m:
        if "pair_us" in r:
            us, mj = r["pair_us"], r["pair_mj"]
            print(
                f"M = {r['m']}: read {us['read']:.1f} us ({mj['read']:.1f} mJ), MMAs "
                f"{us['mma']:.1f} us ({mj['mma']:.1f} mJ), both at once {us['read+mma']:.1f} us "
                f"({mj['read+mma']:.1f} mJ) = {us['read+mma'] / r['floor_us']:.2f} x floor"
            )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        doc = {"rates": rates, "per_m": per_m, "rows": rows}
        Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
