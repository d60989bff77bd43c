"""How much one call's time depends on its input set, and on what in the set (on a GPU).

benchmarks/kernel.py times each M over a few input sets in rotation, drawn from one seed in the
order of --ms, so two runs with different --ms lists time different sets. Sessions 21 and 23
saw M = 1024 read 10-19% slower in lib_ab.py's runs than in the sweep's at the same SM clock.
This times many sets one by one (a CUDA graph each, replayed back to back) and prints, per set,
what the route kernel will make of it: routes per local expert, the tiles at the call's tile
size BT and how many tiles fall in each width v8 runs (wgmma N trimmed per tile), beside the
time (kernel.py's time_calls: 100 ms of warm-up, then the median of --reps runs of --calls
replays), so a slow set can be told from a slow machine.

    python benchmarks/set_spread.py --ms 1024 --sets 16 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_clocks import start_sampler  # benchmarks/gpu_clocks.py: nvidia-smi sampling
from kernel import EL, TOP_K, E, H, default_sets, gpu_layer, routes, time_calls

from expertd.kernels.cuda import CudaBackend, GraphedForward, pick_bt


def set_stats(ids: torch.Tensor, local_of: torch.Tensor, bt: int) -> dict:
    """Routes per local expert and the tiles the route kernel makes of them at tile size bt."""
    slots = local_of[ids.long()]
    counts = torch.bincount(slots[slots >= 0], minlength=EL).tolist()
    tiles = sum((c + bt - 1) // bt for c in counts)
    # the rows of each tile (full tiles, then the remainder), as v8 trims each tile's width
    rows = [bt] * sum(c // bt for c in counts) + [c % bt for c in counts if c % bt]
    return {
        "local_routes": sum(counts),
        "max_routes": max(counts),
        "min_routes": min(counts),
        "tiles": tiles,
        "tile_rows_le_half": sum(1 for r in rows if r <= bt // 2),
        "tile_rows_le_2_3": sum(1 for r in rows if r <= (2 * bt) // 3),
        "padding_rows": tiles * bt - sum(counts),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ms", default="1024")
    ap.add_argument("--sets", type=int, default=16, help="input sets per M")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument(
        "--kernel-ms",
        action="append",
        default=[],
        help="also time the sets benchmarks/kernel.py --ms LIST draws for the M of --ms (repeatable)",
    )
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    layer = gpu_layer()
    backend = CudaBackend("cuda", max_tokens=max(ms))
    state = backend.prepare(layer)
    local_of = layer.global_to_local("cuda").long()
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    sampler = start_sampler()
    result = {"device": torch.cuda.get_device_name(), "seed": args.seed, "rows": []}

    def timed(g: GraphedForward, inputs) -> tuple[float, dict]:
        for buf, v in zip((g.x, g.topk_ids, g.topk_weights), inputs, strict=True):
            buf.copy_(v)
        t0 = time.monotonic()
        us = time_calls(lambda _s: g.replay(), 1, args.calls, args.reps) * 1e6  # after warm-up
        return us, sampler.window(t0, time.monotonic()) if sampler else {}

    for m in ms:
        bt = pick_bt(m, TOP_K, E)
        g = GraphedForward(backend, state, m, TOP_K)
        first = None
        for s in range(args.sets):
            ids, w = routes(m, gen)
            x = torch.randn((m, H), generator=gen, device="cuda").to(torch.bfloat16)
            first = first or (x, ids, w)
            us, clocks = timed(g, (x, ids, w))
            row = {"M": m, "bt": bt, "set": s, "graph_us": us, "clocks": clocks}
            row.update(set_stats(ids, local_of, bt))
            result["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "clocks"}), flush=True)
        for lst in args.kernel_ms:  # kernel.py's draw: seed 1, every M of its list in order
            kgen = torch.Generator(device="cuda").manual_seed(1)
            for km in (int(v) for v in lst.split(",")):
                for s in range(default_sets(km)):
                    ids, w = routes(km, kgen)
                    x = torch.randn((km, H), generator=kgen, device="cuda").to(torch.bfloat16)
                    if km != m:
                        continue
                    us, clocks = timed(g, (x, ids, w))
                    row = {"M": m, "bt": bt, "set": f"kernel.py --ms {lst}: {s}", "graph_us": us}
                    row.update(set_stats(ids, local_of, bt), clocks=clocks)
                    result["rows"].append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "clocks"}), flush=True)
        # The first set again: the board's state drifts over the run, the set does not.
        us, clocks = timed(g, first)
        result.setdefault("first_set_again", {})[str(m)] = {"graph_us": us, "clocks": clocks}
        print(f"M = {m}: set 0 again {us:.1f} us", flush=True)
        del g
    if sampler:
        sampler.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "set-spread.json").write_text(json.dumps(result, indent=1))
    for m in ms:
        rows = sorted((r for r in result["rows"] if r["M"] == m), key=lambda r: r["graph_us"])
        print(f"\nM = {m} (BT {rows[0]['bt']}): {len(rows)} sets, fastest first")
        print("    us  tiles  max  min  rows<=BT/2  rows<=2BT/3  padding  MHz  set")
        for r in rows:
            mhz = r["clocks"].get("sm_mhz_median", float("nan"))
            print(
                f"{r['graph_us']:7.1f}  {r['tiles']:5d}  {r['max_routes']:3d}  {r['min_routes']:3d}"
                f"  {r['tile_rows_le_half']:10d}  {r['tile_rows_le_2_3']:11d}  {r['padding_rows']:7d}"
                f"  {mhz:4.0f}  {r['set']}"
            )


if __name__ == "__main__":
    main()
