"""When each kernel of one forward starts, passes its wait, finishes its main loop and ends.

The instrumented kernel library (EXPERTD_KERNEL_TIMELINE=1, a separate build: the production
library has no marks) folds %globaltimer into a 32-entry buffer: per kernel of the call
(route, GEMM1, GEMM2, finalize) and event (block entry, after griddepcontrol.wait, main loop
done, block done), the earliest and the latest block. One CUDA-graph replay per sample (the
buffer is reset between replays, outside the graph); times are relative to the route kernel's
first block entry, median over the samples. The benchmark's single number per M hides this:
how long each kernel waits for the one before, how long it streams, how long its tail is.

    python benchmarks/timeline.py --ms 1,8,256 [--reps 20] [--out DIR]

Layer and routing as benchmarks/kernel.py (muse-spark, 32 local experts, real top-8 routing,
at least one local route per token).
"""

from __future__ import annotations

import os

os.environ["EXPERTD_KERNEL_TIMELINE"] = "1"  # before the library is built or loaded

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel import EL, TOP_K, E, H, gpu_layer, graphed, routes

from expertd.kernels.cuda import CudaBackend, GraphedForward, kernel_path, pick_bt, set_timeline

KERNELS = ("route", "gemm1", "gemm2", "finalize")
EVENTS = ("entry", "waited", "loop_done", "done")
NONE = -1  # a min slot no block wrote (int64 view of 2^64 - 1)


def sample(g: GraphedForward, buf: torch.Tensor) -> dict[str, dict[str, tuple[float, float]]]:
    """One replay: {kernel: {event: (first, last) us after the route kernel's first entry}}."""
    view = buf.view(4, 4, 2)
    view[..., 0] = NONE
    view[..., 1] = 0
    g.replay()
    torch.cuda.synchronize()
    t = buf.cpu().view(4, 4, 2).tolist()
    t0 = t[0][0][0]
    out = {}
    for k, kname in enumerate(KERNELS):
        out[kname] = {}
        for e, ename in enumerate(EVENTS):
            lo, hi = t[k][e]
            if lo != NONE and hi != 0:
                out[kname][ename] = ((lo - t0) / 1e3, (hi - t0) / 1e3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,8,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--kind", default="nvidia-h200")
    args = ap.parse_args()
    layer = gpu_layer()
    ms = [int(v) for v in args.ms.split(",")]
    backend = CudaBackend("cuda", max_tokens=max(ms))
    state = backend.prepare(layer)
    buf = torch.zeros(32, dtype=torch.int64, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    result = {"date": dt.date.today().isoformat(), "device": torch.cuda.get_device_name()}
    result["unit"] = "us after the route kernel's first block entry; (first block, last block)"
    result["rows"] = []
    for m in ms:
        ids, w = routes(m, gen)
        ids[:, 0] = layer.experts[m % EL]
        x = torch.randn((m, H), generator=gen, device="cuda").to(torch.bfloat16)
        g = graphed(backend, state, m, (x, ids, w))
        for _ in range(10):
            g.replay()
        set_timeline(buf)
        samples = [sample(g, buf) for _ in range(args.reps)]
        set_timeline(None)
        med = {}
        for kname in KERNELS:
            med[kname] = {}
            for ename in EVENTS:
                got = [s[kname][ename] for s in samples if ename in s[kname]]
                if got:
                    med[kname][ename] = [
                        statistics.median(v[0] for v in got),
                        statistics.median(v[1] for v in got),
                    ]
        row = {"M": m, "path": kernel_path(pick_bt(m, TOP_K, E)), "events": med}
        result["rows"].append(row)
        print(f"\nM = {m} (GEMM v{row['path']}), us after the route kernel starts:")
        print(f"{'kernel':>9} " + " ".join(f"{e + ' first/last':>22}" for e in EVENTS))
        for kname in KERNELS:
            cells = []
            for ename in EVENTS:
                v = med[kname].get(ename)
                cells.append(f"{v[0]:>10.1f} /{v[1]:>9.1f}" if v else f"{'-':>22}")
            print(f"{kname:>9} " + " ".join(cells))
        del g
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"timeline-{args.kind}-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
