"""Kernel benchmark: the shard forward (preset muse-spark, 32 local experts) over the M sweep of
docs/performance.md, with the floor's two rates measured in the same run.

Prints a table last; writes JSON + PNG (log-log time vs M with the floor) under --out.

    python benchmarks/kernel.py --out $OUT [--ms 1,2,4] [--compare-lib OTHER.so]
    python benchmarks/kernel.py --preset deepseek-v3     # a family's shape (docs/models.md)

--preset runs another family's expert shape (server/synthetic.py's presets: deepseek-v3,
qwen3-235b-a22b, qwen3-30b-a3b, ...), a shard of 1/8 of its experts, with the family's post-
expert norm or none; files are named kernel-KIND-PRESET-DATE (muse-spark keeps the old name).

Timings: median over repetitions of (time of N back-to-back calls) / N, CUDA events, after
warm-up, cycling over input sets (default_sets: 32 at M <= 2, 8 to M = 64, 4 above). `graph` =
CUDA-graph replay (one graph per input set), `eager` = Python call per forward. Baseline =
weights dequantized to bf16 once, then per hit expert torch matmuls (index by expert with host
syncs), eager.

--compare-lib PATH times another build of the kernel library (e.g. the one before a change,
built from that commit's kernels/csrc) against this checkout's, in the same process on the same
inputs: graphs of both, timed in alternating runs (`old us`, `new/old`: the median ratio), and
whether the two give the same bits on every input set (`bits`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from gpu_clocks import start_sampler

from expertd.kernels.cuda import CudaBackend, GraphedForward, kernel_path, pick_bt
from expertd.kernels.layer import ShardLayer
from expertd.kernels.nvfp4 import Nvfp4Weight, quantize
from expertd.kernels.reference import RMS_EPS, relative_error
from expertd.server.synthetic import PRESETS

M_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
H, INTER, E, TOP_K, EL = 4096, 4096, 256, 8, 32
POST_NORM = True  # muse-spark's post-expert norm; the released families have none
PRESET = "muse-spark"
SETS = 4
LOCAL_EXPERTS = tuple(range(32, 32 + EL))  # the benchmark's shard: 1 of 8


def use_preset(name: str) -> None:
    """Set the shape globals to a preset's: H, I, E, top_k, its norm, a shard of E/8 experts
    (the second of eight)."""
    global H, INTER, E, TOP_K, EL, POST_NORM, PRESET, LOCAL_EXPERTS
    p = PRESETS[name]
    H, INTER, E, TOP_K = p.hidden_size, p.intermediate_size, p.num_experts, p.top_k
    EL, POST_NORM, PRESET = E // 8, p.post_norm, name
    LOCAL_EXPERTS = tuple(range(EL, 2 * EL))


def default_sets(m: int) -> int:
    """Input sets per M. A call of M <= 2 hits 0-5 local experts and its time moves ~2x with
    that count, so it gets 32 sets: their mix follows top-8 routing's (M = 1: P(0-3 hits) =
    0.34 / 0.41 / 0.20 / 0.05) where 8 sets drift (one variant read 1.011 of another on 8 sets,
    0.975 on 32). 8 to M = 64, 4 above."""
    return 8 * SETS if m <= 2 else 2 * SETS if m <= 64 else SETS


BTS = (8, 16, 32, 48, 64, 96, 128, 144, 160)  # the compiled tile sizes (moe_nvfp4.cu)


def gpu_layer(seed: int = 0) -> ShardLayer:
    """EL experts of the preset's shape (32 of muse-spark's) drawn and quantized on the GPU
    (fast; not the synthetic checkpoint's exact tensors, same statistics)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def proj(n, k, gain):
        parts = []
        for _ in range(EL):
            w = torch.randn((n, k), generator=gen, device="cuda")
            spread = torch.empty((n, k // 16, 1), device="cuda").uniform_(-2, 2, generator=gen)
            w = (w.view(n, k // 16, 16) * spread.exp()).view(n, k) * (gain / k**0.5)
            parts.append(quantize(w))
        return Nvfp4Weight(
            torch.stack([p.weight for p in parts]),
            torch.stack([p.weight_scale for p in parts]),
            torch.stack([p.weight_scale_2 for p in parts]),
        )

    norm = (torch.randn(H, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
    norm = norm if POST_NORM else None
    return ShardLayer(
        LOCAL_EXPERTS, E, proj(INTER, H, 1.0), proj(INTER, H, 2.5), proj(H, INTER, 1.0), norm
    )


def routes(m: int, gen: torch.Generator):
    """Real top-8 routing: 8 distinct ids of 256 per token, uniform; softmax-like weights."""
    ids = torch.rand((m, E), generator=gen, device="cuda").topk(TOP_K, dim=1).indices
    w = torch.rand((m, TOP_K), generator=gen, device="cuda")
    return ids.to(torch.int32), (w / w.sum(dim=1, keepdim=True)).float()


def warm_up(fn, n_sets: int, seconds: float = 0.1) -> None:
    """Every input set once, then calls until `seconds` have passed (at large M the first runs
    after a capture timed 5-10% slow: clocks and caches settle over ~100 ms of work)."""
    for s in range(n_sets):
        fn(s)
    torch.cuda.synchronize()
    t0, c = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        fn(c % n_sets)
        c += 1
        if c % n_sets == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()


def _run_s(fn, n_sets: int, calls: int) -> float:
    """Seconds per call of one run of `calls` back-to-back calls (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for c in range(calls):
        fn(c % n_sets)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def time_calls(fn, n_sets: int, calls: int, reps: int) -> float:
    """Median seconds per call over `reps` runs of `calls` back-to-back calls, after warm-up."""
    warm_up(fn, n_sets)
    return statistics.median(_run_s(fn, n_sets, calls) for _ in range(reps))


def time_paired(fa, fb, n_sets: int, calls: int, reps: int) -> tuple[float, float, float]:
    """A and B timed in alternating runs of `calls` calls (A first in even reps, B first in odd):
    (median s per call of A, of B, median over reps of B / A). Identical graphs drift 3-10%
    apart within a run when timed minutes apart; paired runs seconds apart cancel the drift."""
    warm_up(lambda s: (fa(s), fb(s)), n_sets)
    ta, tb = [], []
    for rep in range(reps):
        for fn, out in ((fa, ta), (fb, tb)) if rep % 2 == 0 else ((fb, tb), (fa, ta)):
            out.append(_run_s(fn, n_sets, calls))
    ratio = statistics.median(b / a for a, b in zip(ta, tb, strict=True))
    return statistics.median(ta), statistics.median(tb), ratio


def time_vs(base, other, n_sets: int, calls: int, reps: int) -> tuple[float, float]:
    """Graphs `other` (one per input set) timed in alternating runs against `base`: (median us
    per call, median ratio to base)."""
    _, t, ratio = time_paired(
        lambda s: base[s].replay(), lambda s: other[s].replay(), n_sets, calls, reps
    )
    return t * 1e6, ratio


def graphed(backend, state, m: int, inputs, bt: int = 0) -> GraphedForward:
    """A CUDA graph of the forward for M tokens (tile size bt, 0: the library's pick), loaded
    with `inputs` (x, topk_ids, topk_weights)."""
    g = GraphedForward(backend, state, m, TOP_K, bt=bt)
    for dst, src in zip((g.x, g.topk_ids, g.topk_weights), inputs, strict=True):
        dst.copy_(src)
    return g


def measure_graph_floor(calls: int = 24, reps: int = 15) -> dict[str, float]:
    """Replay period (us) of CUDA graphs of 1 and 3 one-element torch kernels replayed back to
    back: the launch floor under any call of that many kernels on this machine (the forward
    of a decode call is 3 kernels, chained with PDL, which these are not)."""
    t = torch.zeros(1, device="cuda")
    floor = {}
    for n in (1, 3):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                t.add_(1)
        floor[f"{n}_kernels"] = time_calls(lambda s, g=g: g.replay(), 1, calls, reps) * 1e6
        del g
    return floor


def measure_copy_bw() -> float:
    n = 1 << 30  # 1 GiB
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    t = time_calls(lambda s: b.copy_(a), 1, 10, 5)
    return 2 * n / t


def measure_matmul() -> float:
    n = 8192
    a = torch.randn((n, n), device="cuda").to(torch.bfloat16)
    b = torch.randn((n, n), device="cuda").to(torch.bfloat16)
    t = time_calls(lambda s: a @ b, 1, 10, 5)
    return 2 * n**3 / t


class Baseline:
    """Weights dequantized to bf16 once; per hit expert: gather, two matmuls, norm, index_add."""

    def __init__(self, layer: ShardLayer):
        self.w13 = torch.cat(
            (layer.gate.dequantize(torch.float32), layer.up.dequantize(torch.float32)), dim=1
        ).to(torch.bfloat16)
        self.w2 = layer.down.dequantize(torch.float32).to(torch.bfloat16)
        self.scale = None if layer.norm_weight is None else 1.0 + layer.norm_weight.float()
        self.local_of = layer.global_to_local("cuda").long()

    def __call__(self, x, ids, w):
        slots = self.local_of[ids.long() % self.local_of.numel()]
        out = torch.zeros((x.shape[0], H), dtype=torch.float32, device=x.device)
        for e in torch.unique(slots[slots >= 0]).tolist():
            tok, j = torch.nonzero(slots == e, as_tuple=True)
            hdn = x[tok] @ self.w13[e].T
            act = torch.nn.functional.silu(hdn[:, :INTER]) * hdn[:, INTER:]
            z = (act @ self.w2[e].T).float()
            if self.scale is None:
                r = z
            else:
                z = z * self.scale
                r = z * torch.rsqrt(z.square().mean(dim=-1, keepdim=True) + RMS_EPS)
            out.index_add_(0, tok, r * w[tok, j].unsqueeze(-1))
        return out.to(torch.bfloat16)


def compare_builds(other, graphs, m: int, sets, n_sets: int, calls: int, reps: int) -> dict:
    """The other build's graphs against this build's (`graphs`), on the same inputs: both timed
    in alternating runs (this / other: the median ratio), and their outputs compared bit for bit
    on every input set."""
    backend, state = other
    og = [graphed(backend, state, m, inputs) for inputs in sets]
    t_other, t_this, ratio = time_paired(
        lambda s: og[s].replay(), lambda s: graphs[s].replay(), n_sets, calls, reps
    )
    same = all(torch.equal(og[s].replay(), graphs[s].replay()) for s in range(n_sets))
    return {"other_us": t_other * 1e6, "this_us": t_this * 1e6, "ratio": ratio, "same_bits": same}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--ms", default=",".join(map(str, M_SWEEP)))
    ap.add_argument("--kind", help="the machine's name in the results (default: the GPU's)")
    ap.add_argument("--preset", default="muse-spark", choices=sorted(PRESETS))
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--bt-sweep-max", type=int, default=4096, help="time every BT up to this M")
    ap.add_argument("--bt-list", default="", help="tile sizes of the BT sweep (default: all)")
    ap.add_argument("--fixed-max", type=int, default=8, help="time calls with no local route")
    ap.add_argument(
        "--compare-lib",
        default="",
        help="another build of libexpertd_kernels.so, timed against this checkout's build on the "
        "same inputs (alternating runs) and compared bit for bit",
    )
    ap.add_argument(
        "--sets",
        type=int,
        default=0,
        help="input sets per M (0: default_sets, 32 at M <= 2, 8 to M = 64, 4 above); at M = 1 "
        "the sets' mix of 0-3 hit experts moves the mean",
    )
    args = ap.parse_args()
    use_preset(args.preset)
    ms = [int(v) for v in args.ms.split(",")]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    name = torch.cuda.get_device_name()
    if args.kind is None:  # e.g. nvidia-h100-80gb-hbm3, as benchmarks/transport.py names it
        args.kind = "-".join(name.lower().split())
    # SM clock and power per timing (gpu_clocks.py): the forward runs at the 700 W power cap
    # from M = 16 when it runs long enough, so a time is read with the clock it ran at.
    sampler = start_sampler()

    def clocks(t0: float) -> dict:
        return sampler.window(t0, time.monotonic()) if sampler else {"samples": 0}

    t0 = time.monotonic()
    bw = measure_copy_bw()
    copy_clocks = clocks(t0)
    t0 = time.monotonic()
    tc = measure_matmul()
    matmul_clocks = clocks(t0)
    print(f"{name}: copy {bw / 1e9:.0f} GB/s, bf16 matmul {tc / 1e12:.0f} TFLOP/s", flush=True)

    layer = gpu_layer()
    backend = CudaBackend("cuda", max_tokens=max(ms))
    state = backend.prepare(layer)
    other = None
    if args.compare_lib:
        other_backend = CudaBackend("cuda", max_tokens=max(ms), library=args.compare_lib)
        other = (other_backend, other_backend.prepare(layer))
    expert_bytes = layer.nbytes() / EL  # NVFP4 codes + fp8 scales of one expert
    baseline = None if args.no_baseline else Baseline(layer)
    local_of = layer.global_to_local("cuda").long()
    gen = torch.Generator(device="cuda").manual_seed(1)

    date = dt.date.today().isoformat()
    try:  # an auxiliary figure: a failure is reported, not fatal to the run
        graph_floor: dict[str, float | str] = measure_graph_floor()
    except RuntimeError as e:
        graph_floor = {"error": str(e)}
    result = {
        "date": date,
        "kind": args.kind,
        "device": name,
        "compare_lib": args.compare_lib or None,
        "copy_GBps": bw / 1e9,
        "matmul_TFLOPs": tc / 1e12,
        "copy_clocks": copy_clocks,
        "matmul_clocks": matmul_clocks,
        "graph_floor_us": graph_floor,
        "preset": PRESET,
        "shape": {"H": H, "I": INTER, "E": E, "top_k": TOP_K, "post_norm": POST_NORM},
        "local_experts": EL,
        "expert_bytes": expert_bytes,
        "timing": "median of reps x (N back-to-back calls)/N, CUDA events, rotating input sets "
        "(32 at M <= 2, 8 to M = 64, 4 above: see hit_experts_per_set)",
        "rows": [],
    }
    stem = f"kernel-{args.kind}-{date}"
    if PRESET != "muse-spark":
        stem = f"kernel-{args.kind}-{PRESET}-{date}"
    rows = []
    for m in ms:
        sets = []
        for _ in range(n_sets := args.sets or default_sets(m)):
            ids, w = routes(m, gen)
            x = torch.randn((m, H), generator=gen, device="cuda").to(torch.bfloat16)
            sets.append((x, ids, w))
        # Floor per input set (hit experts and local routes differ), averaged like the timing.
        hits, lroutes, floors = [], [], []
        for _, ids, _ in sets:
            slots = local_of[ids.long()]
            hits.append(int(torch.unique(slots[slots >= 0]).numel()))
            lroutes.append(int((slots >= 0).sum()))
            fl = lroutes[-1] * 2 * (H * 2 * INTER + INTER * H)
            floors.append(max(hits[-1] * expert_bytes / bw, fl / tc))
        hit = statistics.mean(hits)
        local_routes = statistics.mean(lroutes)
        flops = local_routes * 2 * (H * 2 * INTER + INTER * H)
        floor = max(statistics.mean(floors), 1e-9)
        calls = 24 if m <= 512 else 8 if m <= 4096 else 4
        reps = 15 if m <= 4096 else 5

        outs = [torch.empty((m, H), dtype=torch.bfloat16, device="cuda") for _ in range(n_sets)]
        t_eager = time_calls(
            lambda s, sets=sets, outs=outs: backend.forward_into(state, *sets[s], outs[s]),
            n_sets,
            calls,
            reps,
        )
        graphs = [graphed(backend, state, m, inputs) for inputs in sets]
        t0 = time.monotonic()
        t_graph = time_calls(lambda s, graphs=graphs: graphs[s].replay(), n_sets, calls, reps)
        graph_clocks = clocks(t0)
        torch.cuda.synchronize()
        compare = compare_builds(other, graphs, m, sets, n_sets, calls, reps) if other else None
        # Fixed cost: the same call with no route on this shard (every id -1): routing, GEMM
        # grids with nothing to do, finalize writing zeros, launch gaps.
        t_fixed = None
        if m <= args.fixed_max:
            foreign = torch.full((m, TOP_K), -1, dtype=torch.int32, device="cuda")
            g = graphed(backend, state, m, (sets[0][0], foreign, sets[0][2]))
            t_fixed = time_calls(lambda s, g=g: g.replay(), 1, calls, reps)
            del g
        # Every compiled tile size (graph replay, every input set): data for the BT pick, each
        # timed in alternating runs against the pick (bt_vs_default: the median ratio).
        bt_us, bt_vs_default = {}, {}
        if m <= args.bt_sweep_max:
            for bt in [int(b) for b in args.bt_list.split(",")] if args.bt_list else BTS:
                gs = [graphed(backend, state, m, inputs, bt=bt) for inputs in sets]
                bt_us[bt], bt_vs_default[bt] = time_vs(graphs, gs, n_sets, calls, reps)
                del gs
        bt = pick_bt(m, TOP_K, E, H, INTER)
        row = {
            "M": m,
            "bt": bt,
            "path": kernel_path(bt),
            "bt_us": bt_us,
            "bt_vs_default": bt_vs_default,
            "hit_experts": hit,
            "hit_experts_per_set": hits,
            "local_routes": local_routes,
            "floor_us": floor * 1e6,
            "graph_us": t_graph * 1e6,
            "eager_us": t_eager * 1e6,
            "no_local_route_us": None if t_fixed is None else t_fixed * 1e6,
            "compare": compare,
            "graph_x_floor": t_graph / floor,
            "graph_GBps": hit * expert_bytes / t_graph / 1e9,
            "graph_TFLOPs": flops / t_graph / 1e12,
            "graph_clocks": graph_clocks,
        }
        if baseline is not None:
            t_base = time_calls(
                lambda s, sets=sets: baseline(*sets[s]),
                n_sets,
                max(1, calls // 4),
                max(3, reps // 3),
            )
            ref = baseline(*sets[0])
            row["baseline_us"] = t_base * 1e6
            row["baseline_x_floor"] = t_base / floor
            row["speedup_vs_baseline"] = t_base / t_graph
            row["rel_err_vs_baseline"] = relative_error(graphs[0].replay().clone(), ref)
        rows.append(row)
        print(json.dumps(row), flush=True)
        result["rows"] = rows  # written after every M: a killed run keeps what it measured
        (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
        del graphs, outs, sets
        torch.cuda.empty_cache()

    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
    if sampler:
        sampler.close()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 5))
        mm = [r["M"] for r in rows]
        ax.loglog(mm, [r["floor_us"] for r in rows], "k--", label="floor")
        ax.loglog(mm, [r["graph_us"] for r in rows], "o-", label="cuda (graph)")
        ax.loglog(mm, [r["eager_us"] for r in rows], ".-", label="cuda (eager)")
        if other is not None:
            ax.loglog(mm, [r["compare"]["other_us"] for r in rows], "x:", label="other build")
        if baseline is not None:
            ax.loglog(mm, [r["baseline_us"] for r in rows], "s-", label="baseline bf16 torch")
        ax.set_xlabel("tokens M")
        ax.set_ylabel("time per forward (us)")
        ax.set_title(f"expertd shard forward, {PRESET}, {EL} experts, {name}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.savefig(out_dir / f"{stem}.png", dpi=120, bbox_inches="tight")
    except Exception as exc:  # the numbers matter more than the plot
        print(f"plot skipped: {exc}", file=sys.stderr)

    print(f"\n{name}: copy {bw / 1e9:.0f} GB/s, bf16 {tc / 1e12:.0f} TFLOP/s ({date})")
    for what, c in (("copy", copy_clocks), ("matmul", matmul_clocks)):
        if c.get("samples"):
            print(
                f"  {what} ran at {c['sm_mhz_median']:.0f} MHz (min {c['sm_mhz_min']:.0f}), "
                f"{c['power_w_median']:.0f} W {','.join(c['reasons'])}"
            )
    print("MHz / W: median SM clock and power draw while the graph column was timed (nvidia-smi)")
    print("BT: the library's tile size for the call; path 6 = mma.sync, 8 = wgmma")
    if other is not None:
        print(
            f"old: {args.compare_lib}; old us / new/old: timed in alternating runs against this "
            "build (< 1: this build faster); bits: the same output on every input set"
        )
    head = f"{'M':>6} {'hit':>4} {'BT':>4} {'path':>4} {'floor us':>9} {'graph us':>9}"
    head += f" {'x floor':>8} {'eager us':>9}"
    if other is not None:
        head += f" {'old us':>8} {'new/old':>8} {'bits':>5}"
    head += f" {'GB/s':>6} {'TFLOP/s':>8} {'MHz':>5} {'W':>4}"
    if baseline is not None:
        head += f" {'base us':>9} {'x base':>7} {'err':>8}"
    print(head)
    for r in rows:
        line = (
            f"{r['M']:>6} {r['hit_experts']:>4.1f} {r['bt']:>4} {r['path']:>4} "
            f"{r['floor_us']:>9.1f} {r['graph_us']:>9.1f} "
            f"{r['graph_x_floor']:>8.2f} {r['eager_us']:>9.1f}"
        )
        if other is not None:
            c = r["compare"]
            line += (
                f" {c['other_us']:>8.1f} {c['ratio']:>8.3f}"
                f" {'same' if c['same_bits'] else 'DIFF':>5}"
            )
        line += (
            f" {r['graph_GBps']:>6.0f} "
            f"{r['graph_TFLOPs']:>8.1f} "
            f"{r['graph_clocks'].get('sm_mhz_median', float('nan')):>5.0f} "
            f"{r['graph_clocks'].get('power_w_median', float('nan')):>4.0f}"
        )
        if baseline is not None:
            line += (
                f" {r['baseline_us']:>9.1f} {r['speedup_vs_baseline']:>7.2f}"
                f" {r['rel_err_vs_baseline']:>8.1e}"
            )
        print(line)
    fixed = [r for r in rows if r["no_local_route_us"] is not None]
    if fixed:
        print(
            "no local route (fixed cost), graph us: "
            + ", ".join(f"M={r['M']} {r['no_local_route_us']:.1f}" for r in fixed)
            + "; empty graphs (torch, back to back): "
            + ", ".join(
                f"{k.replace('_', ' ')} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in result["graph_floor_us"].items()
            )
        )
    if other is not None:
        diff = [r["M"] for r in rows if not r["compare"]["same_bits"]]
        print(
            "bit for bit at every M: the two builds give the same outputs"
            if not diff
            else f"OUTPUTS DIFFER between the builds at M = {diff}"
        )
    sweep = [r for r in rows if r["bt_us"]]
    if sweep:
        print("\ngraph us per tile size BT (the pick is expertd_pick_bt):")
        keys = list(sweep[0]["bt_us"])
        print(f"{'M':>6} " + " ".join(f"{'BT=' + str(b):>15}" for b in keys))
        for r in sweep:
            print(
                f"{r['M']:>6} "
                + " ".join(f"{r['bt_us'][b]:>8.1f} ({r['bt_vs_default'][b]:.3f})" for b in keys)
            )
        print("(in brackets: time / the pick's, timed in alternating runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
