"""`expertd demo`: a local N-shard expert service, answered by the real client,
checked against the reference.

It creates (or reuses) a synthetic checkpoint in the cache dir, starts the
shard servers as subprocesses on loopback, runs the client on randomly routed
tokens at a few batch sizes, compares each result with the reference of the
whole layer, prints a table, and stops the servers with SIGTERM.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

TOLERANCE = 1e-2  # docs/protocol.md: relative Frobenius error


def cache_dir() -> Path:
    return Path(os.environ.get("EXPERTD_CACHE_DIR") or Path.home() / ".cache" / "expertd")


def add_demo_arguments(p) -> None:
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--preset", default="auto", help="small | muse-spark | auto (GPU: muse-spark)")
    p.add_argument("--layers", type=int, default=None, help="default: 2 (small), 1 (muse-spark)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="cpu | cuda | auto")
    p.add_argument("--batch-sizes", default="1,7,64,512", help="comma-separated token counts")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--log-level", default="WARNING")


def random_routing(m: int, num_experts: int, top_k: int, gen: torch.Generator):
    """Top-k routing as a router makes it: k distinct experts per token, softmax
    weights; about 1 route in 50 is -1 ("no route")."""
    logits = torch.randn((m, num_experts), generator=gen)
    top = logits.topk(top_k, dim=1)
    ids = top.indices.to(torch.int32)
    weights = torch.softmax(top.values, dim=1)
    dropped = torch.rand((m, top_k), generator=gen) < 0.02
    return ids.masked_fill(dropped, -1), weights.masked_fill(dropped, 0.0)


def _reference(args, preset, layer: int, checkpoint: Path | None, device: str):
    """A function (x, ids, w) -> float64 [M, H]: the whole layer by the reference."""
    from expertd.kernels.reference import reference_forward
    from expertd.server.config import shard_experts
    from expertd.server.synthetic import synthetic_layer

    if checkpoint is not None:
        from expertd.server.checkpoint import CheckpointReader

        full = CheckpointReader(str(checkpoint)).load_layer(layer, list(range(preset.num_experts)))
        return lambda x, ids, w: reference_forward(full, x, ids, w, torch.float64)

    # Full size: the same synthetic weights the shards made (NVFP4, 864 MiB a shard on
    # the device), drawn once, in parallel (torch releases the GIL while drawing).
    from concurrent.futures import ThreadPoolExecutor

    def draw(s: int):
        experts = shard_experts(preset.num_experts, s, args.shards)
        return synthetic_layer(preset, args.seed, layer, experts, device=device)

    with ThreadPoolExecutor(min(args.shards, os.cpu_count() or 1)) as pool:
        parts = list(pool.map(draw, range(args.shards)))

    def per_shard(x, ids, w):  # fp32 on the device, one shard's experts at a time
        total = torch.zeros(x.shape, dtype=torch.float64)
        for part in parts:
            dev = part.norm_weight.device
            out = reference_forward(part, x.to(dev), ids.to(dev), w.to(dev), torch.float32)
            total += out.cpu().double()
        return total

    return per_shard


def run_demo(args) -> int:
    from expertd.client import ExpertClient
    from expertd.kernels.reference import relative_error
    from expertd.server.launcher import start_shard, stop_shards, wait_serving
    from expertd.server.synthetic import get_preset

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    preset_name = (
        args.preset if args.preset != "auto" else ("muse-spark" if device == "cuda" else "small")
    )
    preset = get_preset(preset_name)
    if args.layers is None:
        args.layers = 2 if preset.name == "small" else 1
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    started = time.perf_counter()

    checkpoint = None
    if preset.name == "small":
        from expertd.server.checkpoint import write_checkpoint

        checkpoint = cache_dir() / "checkpoints" / f"{preset.name}-L{args.layers}-s{args.seed}"
        if not (checkpoint / "model.safetensors.index.json").exists():
            print(f"writing synthetic checkpoint {checkpoint} ...", flush=True)
            write_checkpoint(str(checkpoint), preset, args.layers, args.seed)
        weights = ["--checkpoint", str(checkpoint)]
    else:  # full size: each shard generates its experts in memory (no multi-GB files)
        weights = [
            "--synthetic",
            preset.name,
            "--layers",
            str(args.layers),
            "--seed",
            str(args.seed),
        ]

    print(
        f"starting {args.shards} shard servers ({preset.name}: H={preset.hidden_size} "
        f"I={preset.intermediate_size} E={preset.num_experts} top_k={preset.top_k}, "
        f"{args.layers} layers, device {device}) ...",
        flush=True,
    )
    threads = max(1, (os.cpu_count() or 1) // args.shards)
    shards = []
    try:
        for s in range(args.shards):
            shard_device = device if device != "cuda" else f"cuda:{s % torch.cuda.device_count()}"
            shards.append(
                start_shard(
                    [
                        *weights,
                        "--shard",
                        str(s),
                        "--num-shards",
                        str(args.shards),
                        "--listen",
                        "127.0.0.1:0",
                        "--device",
                        shard_device,
                        "--torch-threads",
                        str(threads),
                        "--log-level",
                        args.log_level,
                    ]
                )
            )
        wait_serving(shards, timeout=1800)
        addresses = [s.address for s in shards]
        print(f"serving on {', '.join(addresses)} ({time.perf_counter() - started:.1f} s)")

        layer = args.layers - 1
        reference = _reference(args, preset, layer, checkpoint, device)
        gen = torch.Generator().manual_seed(1234)
        rows, ok = [], True
        with ExpertClient(addresses, timeout=120.0) as client:
            for m in batch_sizes:
                x = torch.randn((m, preset.hidden_size), generator=gen).to(torch.bfloat16)
                ids, w = random_routing(m, preset.num_experts, preset.top_k, gen)
                out = client.forward(layer, x, ids, w)  # warm-up, and the checked result
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    client.forward(layer, x, ids, w)
                    times.append(time.perf_counter() - t0)
                err = relative_error(out, reference(x, ids, w))
                latency = statistics.median(times)
                good = err <= TOLERANCE and bool(torch.isfinite(out.float()).all())
                ok &= good
                rows.append((m, latency * 1e3, m / latency, err, "ok" if good else "FAIL"))
    finally:
        codes = stop_shards(shards)
    print()
    print(f"expertd demo: {args.shards} shards on {device}, preset {preset.name}, layer {layer}")
    print(f"{'M':>6} | {'latency ms':>10} | {'tokens/s':>10} | {'rel. error':>10} | check")
    print(f"{'-' * 6}-+-{'-' * 10}-+-{'-' * 10}-+-{'-' * 10}-+------")
    for m, ms, tps, err, verdict in rows:
        print(f"{m:>6} | {ms:>10.2f} | {tps:>10.0f} | {err:>10.2e} | {verdict}")
    clean = all(c == 0 for c in codes)
    print(
        f"servers stopped {'cleanly' if clean else f'with exit codes {codes}'}; "
        f"total {time.perf_counter() - started:.1f} s; tolerance {TOLERANCE:g}: "
        f"{'all results correct' if ok else 'SOME RESULTS WRONG'}"
    )
    return 0 if ok and clean else 1
