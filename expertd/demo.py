"""`expertd demo`: a local N-shard expert service, answered by the real client,
checked against the reference.

It creates (or reuses) a synthetic checkpoint in the cache dir, starts the
shard servers as subprocesses on loopback, runs the client on randomly routed
tokens at a few batch sizes, compares each result with the reference of the
whole layer, and stops the servers with SIGTERM, saying what it does as it goes.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

TOLERANCE = 1e-2  # docs/protocol.md: relative Frobenius error
SERVING = 1  # grpc.health.v1 HealthCheckResponse.SERVING


def cache_dir() -> Path:
    return Path(os.environ.get("EXPERTD_CACHE_DIR") or Path.home() / ".cache" / "expertd")


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


def _loading_progress(shards, layers: int, health_status) -> tuple[int, int]:
    """(layers loaded, shards serving): the first from the servers' log lines, the
    second from grpc.health.v1."""
    loaded = sum(sum("loaded layer " in line for line in s.log) for s in shards)
    serving = sum(health_status(s.address) == SERVING for s in shards)
    return min(loaded, layers * len(shards)), serving


def run_demo(args) -> int:
    from expertd.client import ExpertClient
    from expertd.kernels.reference import relative_error
    from expertd.launcher import health_status, start_shard, stop_shards, wait_serving
    from expertd.server.config import shard_experts
    from expertd.server.synthetic import get_preset

    started = time.perf_counter()
    print_lock = threading.Lock()

    def say(message: str) -> None:
        with print_lock:
            print(f"[{time.perf_counter() - started:5.1f} s] {message}", flush=True)

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
    say(
        f"expertd demo: {args.shards} shard servers on {device}, preset {preset.name} "
        f"(H={preset.hidden_size} I={preset.intermediate_size} E={preset.num_experts} "
        f"top_k={preset.top_k}), {args.layers} layers"
    )

    checkpoint = None
    if preset.name == "small":
        from expertd.server.checkpoint import write_checkpoint

        checkpoint = cache_dir() / "checkpoints" / f"{preset.name}-L{args.layers}-s{args.seed}"
        if (checkpoint / "model.safetensors.index.json").exists():
            say(f"synthetic NVFP4 checkpoint: {checkpoint} (cached)")
        else:
            say(f"writing a synthetic NVFP4 checkpoint to {checkpoint}")

            def written(layer: int, layers: int, nbytes: int) -> None:
                say(f"  layer {layer + 1}/{layers} written ({nbytes / 2**20:.1f} MiB)")

            write_checkpoint(str(checkpoint), preset, args.layers, args.seed, progress=written)
        weights = ["--checkpoint", str(checkpoint)]
    else:  # full size: each shard generates its experts in memory (no multi-GB files)
        say("full size: each shard generates its synthetic NVFP4 experts in memory")
        weights = [
            "--synthetic",
            preset.name,
            "--layers",
            str(args.layers),
            "--seed",
            str(args.seed),
        ]

    say(f"starting {args.shards} shard servers (expertd serve) on loopback ports")
    threads = max(1, (os.cpu_count() or 1) // args.shards)
    shards = []

    def start(s: int):
        shard_device = device if device != "cuda" else f"cuda:{s % torch.cuda.device_count()}"
        owned = shard_experts(preset.num_experts, s, args.shards)
        shard = start_shard(
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
                "INFO",  # kept by the launcher: the progress below, and errors
            ]
        )
        with print_lock:
            shards.append(shard)
        say(f"  shard {s} listening on {shard.address} (experts {owned[0]}-{owned[-1]})")
        return shard

    try:
        # as many starting at once as there are cores: each start is mostly Python imports
        with ThreadPoolExecutor(min(args.shards, os.cpu_count() or 1)) as pool:
            ordered = list(pool.map(start, range(args.shards)))
        what = "reading" if checkpoint is not None else "generating"
        if device.startswith("cuda"):
            what += " their experts, repacking them for the CUDA kernels, capturing CUDA graphs"
        else:
            what += " their experts and warming up"
        say(f"shards are loading: {what}")
        deadline, shown, last = time.monotonic() + 1800, None, 0.0
        while True:
            try:  # raises at once if a server died, TimeoutError while some still load
                wait_serving(ordered, timeout=1.0)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
            progress = _loading_progress(ordered, args.layers, health_status)
            if progress != shown or time.monotonic() - last > 5:
                say(
                    f"  {progress[0]}/{args.layers * args.shards} shard layers loaded, "
                    f"{progress[1]}/{args.shards} shards serving"
                )
                shown, last = progress, time.monotonic()
        addresses = [s.address for s in ordered]
        say(f"all {args.shards} shards serving")

        layer = args.layers - 1
        say(f"reference: layer {layer} over all {preset.num_experts} experts, float64, plain torch")
        reference = _reference(args, preset, layer, checkpoint, device)
        gen = torch.Generator().manual_seed(1234)
        ok = True
        say(
            f"calling the service with ExpertClient: top-{preset.top_k} routed tokens, "
            f"median of {args.repeats} calls per size, each result checked"
        )
        print(f"{'M':>6} | {'latency ms':>10} | {'tokens/s':>10} | {'rel. error':>10} | check")
        print(f"{'-' * 6}-+-{'-' * 10}-+-{'-' * 10}-+-{'-' * 10}-+------", flush=True)
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
                verdict = "ok" if good else "FAIL"
                print(
                    f"{m:>6} | {latency * 1e3:>10.2f} | {m / latency:>10.0f} | {err:>10.2e} | "
                    f"{verdict}",
                    flush=True,
                )
    finally:
        if shards:
            say("stopping the servers (SIGTERM: each drains, then exits)")
        codes = stop_shards(shards)
    clean = all(c == 0 for c in codes)
    print(
        f"servers stopped {'cleanly' if clean else f'with exit codes {codes}'}; "
        f"total {time.perf_counter() - started:.1f} s; tolerance {TOLERANCE:g}: "
        f"{'all results correct' if ok else 'SOME RESULTS WRONG'}"
    )
    return 0 if ok and clean else 1
