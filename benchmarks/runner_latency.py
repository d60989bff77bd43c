"""Where a lone small batch's server-side device time goes, in one process, no gRPC.

    python benchmarks/runner_latency.py --out $OUT [--ms 1,16,256] [--reps 400]

One shard's bank (preset muse-spark, 1 layer, shard 0 of 8) and its BatchRunner, as
`expertd serve` builds them. For each M, medians (and p90) of host wall time, in us, of:
  run        BatchRunner.run: pack, enqueue (copy in, graph, copy out), wait, views
  launch     BatchRunner.launch alone (pack + enqueue), then wait (+ release)
  replay     the bucket's graph replayed on one stream, then that stream synchronized
  copies     the prefix copies alone (in, then out) on one stream, then synchronized
  fused      one graph holding copy in + forward + copy out, replayed, synchronized
  sync       an event recorded on an idle stream and synchronized (the floor of a wait)
and the device-side time of `fused` by CUDA events. Writes JSON; prints a table last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from expertd.server.bank import ExpertBank
from expertd.server.config import ServerConfig
from expertd.server.graphs import forward_checked
from expertd.server.runner import BatchRunner


def stats(samples_s: list[float]) -> dict:
    us = sorted(v * 1e6 for v in samples_s)
    return {"median": statistics.median(us), "p90": us[int(0.9 * (len(us) - 1))]}


def timed(fn, reps: int) -> list[float]:
    for _ in range(20):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def request(m: int, hidden: int, experts: int, top_k: int, gen: torch.Generator):
    x = (torch.randn(m, hidden, generator=gen) * 0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(m)])
    w = torch.softmax(torch.randn(m, top_k, generator=gen), dim=1)
    return x, ids.to(torch.int32), w


def measure(runner: BatchRunner, bank: ExpertBank, m: int, reps: int, dev, gen) -> dict:
    info, layer = bank.info, bank.info.layers[0]
    x, ids, w = request(m, info.hidden_size, info.num_experts, info.top_k, gen)
    row: dict = {"M": m}
    row["run"] = stats(timed(lambda: runner.run(layer, [x], [ids], [w]), reps))
    launch_s, wait_s = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        flight = runner.launch(layer, [x], [ids], [w])
        t1 = time.perf_counter()
        flight.wait()
        flight.release()
        launch_s.append(t1 - t0)
        wait_s.append(time.perf_counter() - t1)
    row["launch"], row["wait"] = stats(launch_s), stats(wait_s)
    if dev.type == "cuda" and runner.graphs is not None:
        graphs = runner.graphs
        bucket = graphs.bucket(layer, m, ids.shape[1])
        layout = graphs.layouts[bucket]
        dev_in, dev_out = graphs.buffers(0)
        slot = runner._slot_bufs[0]
        slot.host.pack(layout, [x], [ids], [w])
        n_in, n_out = layout.in_prefix(m), layout.out_prefix(m)
        stream = torch.cuda.Stream(dev)

        def replay() -> None:
            with torch.cuda.stream(stream):
                graphs.replay(layer, bucket, 0)
            stream.synchronize()

        def copies() -> None:
            with torch.cuda.stream(stream):
                dev_in[:n_in].copy_(slot.host.input[:n_in], non_blocking=True)
                slot.host.output[:n_out].copy_(dev_out[:n_out], non_blocking=True)
            stream.synchronize()

        row["replay"] = stats(timed(replay, reps))
        row["copies"] = stats(timed(copies, reps))
        # One graph: copy in, the forward (the bucket's graph body), copy out.
        fused = torch.cuda.CUDAGraph()
        xin, iin, win = layout.inputs(dev_in)
        out, bad = layout.outputs(dev_out)
        cap = torch.cuda.Stream(dev)
        with torch.cuda.stream(cap):
            torch.cuda.synchronize(dev)
            with torch.cuda.graph(fused, stream=cap):
                dev_in[:n_in].copy_(slot.host.input[:n_in], non_blocking=True)
                forward_checked(bank.backend, bank.state(layer), xin, iin, win, out, bad)
                slot.host.output[:n_out].copy_(dev_out[:n_out], non_blocking=True)
        torch.cuda.synchronize(dev)

        def fused_run() -> None:
            with torch.cuda.stream(stream):
                fused.replay()
            stream.synchronize()

        row["fused"] = stats(timed(fused_run, reps))
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dev_ms = []
        for _ in range(50):
            with torch.cuda.stream(stream):
                ev0.record()
                fused.replay()
                ev1.record()
            ev1.synchronize()
            dev_ms.append(ev0.elapsed_time(ev1) * 1e-3)
        row["fused_device"] = stats(dev_ms)
        ev = torch.cuda.Event()

        def sync() -> None:
            with torch.cuda.stream(stream):
                ev.record()
            ev.synchronize()

        row["sync"] = stats(timed(sync, reps))
        # the fused graph's bits equal the runner's
        ref = runner.run(layer, [x], [ids], [w])[0].clone()
        fused_run()
        got = out[:m].cpu()
        row["fused_matches_run"] = bool(torch.equal(ref, got))
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--ms", default="1,16,256")
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--preset", default="muse-spark")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    dev = torch.device(args.device)
    config = ServerConfig(
        synthetic=args.preset, layers=1, shard=0, num_shards=8, device=args.device
    )
    bank = ExpertBank.load(config, progress=lambda _m: None)
    runner = BatchRunner(bank)
    runner.warmup()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for m in (int(v) for v in args.ms.split(",")):
        rows.append(measure(runner, bank, m, args.reps, dev, gen))
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "date": dt.date.today().isoformat(),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "preset": args.preset,
        "setup": "one shard's BatchRunner in one process (depth 2), requests one at a time",
        "rows": rows,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"runner-latency-{dev.type}-{result['date']}{args.tag}.json"
    (out_dir / name).write_text(json.dumps(result, indent=1))
    keys = [
        k for k in ("run", "launch", "wait", "replay", "copies", "fused", "sync") if k in rows[0]
    ]
    print(f"\nmedian (p90) us, {result['device']}, {args.preset}")
    print(f"{'M':>5} " + " ".join(f"{k:>14}" for k in keys))
    for r in rows:
        cells = " ".join(f"{r[k]['median']:>7.0f} ({r[k]['p90']:>4.0f})" for k in keys)
        print(f"{r['M']:>5} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
