"""When each kernel of one forward starts, passes its wait, finishes its main loop and ends.

The instrumented kernel library (EXPERTD_KERNEL_TIMELINE=1, a separate build: the production
library has no marks) writes %globaltimer per block of each kernel of the call (route, GEMM1,
GEMM2, finalize) at four events (block entry, after griddepcontrol.wait, main loop done, block
done), and the block's SM; the table shows the earliest and the latest block per event. The per-block part
says, for the GEMMs' real blocks (those that ran a tile), how long each streamed (wait to main
loop done) and whether blocks that shared an SM with another real block streamed slower. One CUDA-graph replay per sample (the
buffer is reset between replays, outside the graph); times are relative to the route kernel's
first block entry, median over the samples. The benchmark's single number per M hides this:
how long each kernel waits for the one before, how long it streams, how long its tail is.

    python benchmarks/timeline.py --ms 1,8,256 [--reps 20] [--out DIR] [--env K=V,K=V] [--tag T]

Layer and routing as benchmarks/kernel.py (muse-spark, 32 local experts, real top-8 routing),
with one local route at least per call. (Before session 4's last runs every token's first route
went to one local expert: a skewed load that made M >= 64 up to 1.5x slower than the benchmark.)
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
from kernel import TOP_K, E, H, env_set, gpu_layer, graphed, parse_env, routes, time_calls

from expertd.kernels.cuda import (
    CudaBackend,
    GraphedForward,
    kernel_path,
    pick_bt,
    set_timeline,
    timeline_words,
)

KERNELS = ("route", "gemm1", "gemm2", "finalize")
EVENTS = ("entry", "waited", "loop_done", "done")


def sample(g: GraphedForward, buf: torch.Tensor, burst: int) -> tuple[dict, dict]:
    """The last of `burst` back-to-back replays (each overwrites the records: the last one ran
    behind the others, as in the benchmark's timing): ({kernel: {event: (first, last)}},
    {kernel: real-block records}), in us after the route kernel's first entry; a record is
    (sm, entry, waited, loop_done, done)."""
    buf.zero_()
    for _ in range(burst):
        g.replay()
    torch.cuda.synchronize()
    recs = buf.view(4, -1, 5)
    times = recs[..., :4]
    written = times != 0
    first = torch.where(written, times, torch.iinfo(torch.int64).max).amin(dim=1).cpu().tolist()
    last = times.amax(dim=1).cpu().tolist()
    t0 = first[0][0]
    out = {}
    for k, kname in enumerate(KERNELS):
        out[kname] = {}
        for e, ename in enumerate(EVENTS):
            if last[k][e] != 0:
                out[kname][ename] = ((first[k][e] - t0) / 1e3, (last[k][e] - t0) / 1e3)
    blocks = {}
    for k in (1, 2):  # the GEMMs: blocks that finished a main loop ran a tile
        r = recs[k]
        r = r[r[:, 2] != 0].cpu().double()
        r[:, :4] = (r[:, :4] - t0) / 1e3
        blocks[KERNELS[k]] = r[:, [4, 0, 1, 2, 3]].tolist()
    return out, blocks


def block_stats(recs: list[list[float]]) -> dict:
    """Real blocks of one GEMM in one replay: how many, on how many SMs, and their streaming
    times (wait to main loop done), alone on their SM and sharing it with another real block."""
    by_sm: dict[int, int] = {}
    for r in recs:
        by_sm[int(r[0])] = by_sm.get(int(r[0]), 0) + 1
    stream = [r[3] - r[2] for r in recs]
    alone = [r[3] - r[2] for r in recs if by_sm[int(r[0])] == 1]
    shared = [r[3] - r[2] for r in recs if by_sm[int(r[0])] > 1]

    def med(v: list[float]) -> float | None:
        return statistics.median(v) if v else None

    return {
        "blocks": len(recs),
        "sms": len(by_sm),
        "max_per_sm": max(by_sm.values(), default=0),
        "stream_min": min(stream, default=None),
        "stream_med": med(stream),
        "stream_max": max(stream, default=None),
        "stream_med_alone": med(alone),
        "stream_med_shared": med(shared),
        "entry_last": max((r[1] for r in recs), default=None),
        "waited_first": min((r[2] for r in recs), default=None),
        "waited_last": max((r[2] for r in recs), default=None),
    }


def occupancy(recs: list[list[float]], bins: int = 16) -> dict:
    """How full a GEMM's block slots were over time, from one replay's real blocks.

    Slots per SM = the most real blocks any SM held at once. From the first block passing its
    wait to the last block done ("span"), `busy` is the share of slot-time holding a real block
    (entry, or the first wait if later, to done), `streaming` the share inside main loops
    (wait to loop done). `ideal_us` = the span the same streaming would take with every slot
    streaming all the time; `profile` = streaming blocks / slots in `bins` equal slices of the
    span; `tail_us` = time from the last block entry to the last block done."""
    if not recs:
        return {}
    start = min(r[2] for r in recs)
    end = max(r[4] for r in recs)
    span = end - start
    events: dict[int, list[tuple[float, int]]] = {}
    for r in recs:
        events.setdefault(int(r[0]), []).extend(((max(r[1], start), 1), (r[4], -1)))
    slots = 0
    for ev in events.values():
        cur = 0
        for _, d in sorted(ev, key=lambda e: (e[0], e[1])):
            cur += d
            slots = max(slots, cur)
    cap = slots * len(events) * span
    busy = sum(r[4] - max(r[1], start) for r in recs)
    stream = sum(r[3] - r[2] for r in recs)
    width = span / bins
    profile = []
    for i in range(bins):
        lo, hi = start + i * width, start + (i + 1) * width
        inside = sum(max(0.0, min(hi, r[3]) - max(lo, r[2])) for r in recs)
        profile.append(round(inside / (width * slots * len(events)), 3))
    return {
        "slots_per_sm": slots,
        "sms": len(events),
        "span_us": span,
        "busy": busy / cap,
        "streaming": stream / cap,
        "ideal_us": stream / (slots * len(events)),
        "tail_us": end - max(r[1] for r in recs),
        "prologue_med_us": statistics.median(r[2] - max(r[1], start) for r in recs),
        "epilogue_med_us": statistics.median(r[4] - r[3] for r in recs),
        "profile": profile,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,8,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--burst", type=int, default=8, help="back-to-back replays per sample")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--kind", default="nvidia-h200")
    ap.add_argument("--env", default="", help="kernel switches for the graphs, K=V,K=V")
    ap.add_argument("--tag", default="", help="suffix of the results file")
    ap.add_argument(
        "--records-max", type=int, default=8, help="keep one replay's block records to this M"
    )
    args = ap.parse_args()
    env = parse_env(args.env)
    layer = gpu_layer()
    ms = [int(v) for v in args.ms.split(",")]
    backend = CudaBackend("cuda", max_tokens=max(ms))
    state = backend.prepare(layer)
    buf = torch.zeros(timeline_words(), dtype=torch.int64, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    result = {"date": dt.date.today().isoformat(), "device": torch.cuda.get_device_name()}
    result["unit"] = "us after the route kernel's first block entry; (first block, last block)"
    result["env"] = env
    result["rows"] = []
    for m in ms:
        ids, w = routes(m, gen)  # as the benchmark's, with one local route at least
        local = torch.as_tensor(layer.experts, device=ids.device, dtype=ids.dtype)
        if not torch.isin(ids, local).any():
            ids[0, 0] = next(int(e) for e in local if not (ids[0] == e).any())
        x = torch.randn((m, H), generator=gen, device="cuda").to(torch.bfloat16)
        g = graphed(backend, state, m, (x, ids, w), env=env or None)
        graph_off = time_calls(lambda s, g=g: g.replay(), 1, 20, 15) * 1e6
        set_timeline(buf)
        graph_on = time_calls(lambda s, g=g: g.replay(), 1, 20, 15) * 1e6
        pairs = [sample(g, buf, args.burst) for _ in range(args.reps)]
        set_timeline(None)
        samples = [p[0] for p in pairs]
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
        with env_set(env):
            gemm_path = kernel_path(pick_bt(m, TOP_K, E))
        row = {"M": m, "path": gemm_path, "events": med, "blocks": {}}
        # What the marks cost: the same graph timed with the marks off and on.
        row["graph_us_marks_off"], row["graph_us_marks_on"] = graph_off, graph_on
        for kname in ("gemm1", "gemm2"):
            stats = [block_stats(p[1][kname]) for p in pairs]
            row["blocks"][kname] = {
                key: statistics.median(s[key] for s in stats if s[key] is not None)
                for key in stats[0]
                if any(s[key] is not None for s in stats)
            }
            occ = [occupancy(p[1][kname]) for p in pairs]
            occ = [o for o in occ if o]
            if occ:
                row["blocks"][kname]["occupancy"] = {
                    key: statistics.median(o[key] for o in occ)
                    for key in occ[0]
                    if key != "profile"
                }
                row["blocks"][kname]["occupancy"]["profile"] = [
                    statistics.median(o["profile"][i] for o in occ)
                    for i in range(len(occ[0]["profile"]))
                ]
            if m <= args.records_max:  # one replay's records, for plots
                row["blocks"][kname]["records"] = pairs[-1][1][kname]
        result["rows"].append(row)
        print(
            f"\nM = {m} (GEMM v{row['path']}; graph {graph_off:.1f} us, {graph_on:.1f} with "
            "the marks on), us after the route kernel starts:"
        )
        print(f"{'kernel':>9} " + " ".join(f"{e + ' first/last':>22}" for e in EVENTS))
        for kname in KERNELS:
            cells = []
            for ename in EVENTS:
                v = med[kname].get(ename)
                cells.append(f"{v[0]:>10.1f} /{v[1]:>9.1f}" if v else f"{'-':>22}")
            print(f"{kname:>9} " + " ".join(cells))
        for kname, b in row["blocks"].items():
            print(
                f"{kname}: {b['blocks']:.0f} real blocks on {b['sms']:.0f} SMs (at most "
                f"{b['max_per_sm']:.0f} per SM); streaming us min / median / max "
                f"{b['stream_min']:.1f} / {b['stream_med']:.1f} / {b['stream_max']:.1f}, median "
                f"alone {b.get('stream_med_alone', float('nan')):.1f}, sharing an SM "
                f"{b.get('stream_med_shared', float('nan')):.1f}"
            )
            o = b.get("occupancy")
            if o:
                print(
                    f"  slots {o['slots_per_sm']:.0f}/SM; span {o['span_us']:.1f} us, ideal "
                    f"{o['ideal_us']:.1f}; busy {o['busy']:.3f}, streaming {o['streaming']:.3f}; "
                    f"tail {o['tail_us']:.1f} us; prologue / epilogue median "
                    f"{o['prologue_med_us']:.2f} / {o['epilogue_med_us']:.2f} us"
                )
                print(
                    "  streaming / slots by sixteenths: "
                    + " ".join(f"{v:.2f}" for v in o["profile"])
                )
        del g
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"-{args.tag}" if args.tag else ""
    path = out / f"timeline-{args.kind}-{result['date']}{tag}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
