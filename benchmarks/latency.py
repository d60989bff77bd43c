"""One shard alone on the GPU: single-request latency and the server's own time, per pipeline
depth (server/runner.py: batches in flight). What a deployment with one GPU per shard sees for a
lone request, without the other seven shard processes of benchmarks/service.py on the same GPU.

    python benchmarks/latency.py --out $OUT [--depths 1,2] [--ms 1,16,256] [--reps 200]

For each depth: start `expertd serve` (preset muse-spark, 1 layer, shard 0 of 8, --device), send
`reps` requests one after another (the next as soon as the previous answered) for each M, and
report medians of the round trip and of the server's Timing (host staging, device: copies in,
forward, copies out and the wait, and total in the server). Writes JSON; prints a table last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).parent))
from service import OPTIONS, shard0_request

from expertd.launcher import start_shard, stop_shards, wait_serving
from expertd.server.synthetic import get_preset
from expertd.v1 import expertd_pb2_grpc as pb_grpc


def measure(address: str, preset, ms: list[int], reps: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    with grpc.insecure_channel(address, options=OPTIONS) as channel:
        stub = pb_grpc.ExpertServiceStub(channel)
        for m in ms:
            req = shard0_request(preset, m, gen)
            for _ in range(10):  # warm-up (graphs, clocks)
                stub.Forward(req, timeout=60)
            rtt, stage, device, total, queue = [], [], [], [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                timing = stub.Forward(req, timeout=60).timing
                rtt.append(time.perf_counter() - t0)
                stage.append(timing.stage_us)
                device.append(timing.device_us)
                total.append(timing.total_us)
                queue.append(timing.queue_us)
            rows.append(
                {
                    "M": m,
                    "round_trip_us": statistics.median(rtt) * 1e6,
                    "round_trip_p90_us": sorted(rtt)[int(0.9 * (reps - 1))] * 1e6,
                    "server_total_us": statistics.median(total),
                    "queue_us": statistics.median(queue),
                    "stage_us": statistics.median(stage),
                    "device_us": statistics.median(device),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--depths", default="1,2")
    ap.add_argument("--ms", default="1,16,256")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--preset", default="muse-spark")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kind", default="nvidia-h200" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    preset = get_preset(args.preset)
    ms = [int(v) for v in args.ms.split(",")]
    common = [
        *("--synthetic", preset.name, "--layers", "1", "--device", args.device),
        *("--shard", "0", "--num-shards", "8", "--log-level", "WARNING"),
    ]
    result = {
        "date": dt.date.today().isoformat(),
        "kind": args.kind,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "preset": preset.name,
        "setup": "one shard process alone on the GPU, requests one after another, TCP loopback",
        "depths": {},
    }
    for depth in (int(v) for v in args.depths.split(",")):
        shard = start_shard([*common, "--pipeline-depth", str(depth)])
        try:
            wait_serving([shard], timeout=600)
            result["depths"][str(depth)] = measure(shard.address, preset, ms, args.reps)
        finally:
            stop_shards([shard])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"latency-{args.kind}-{result['date']}.json").write_text(json.dumps(result, indent=1))
    print(f"\none shard alone ({result['device']}, {preset.name}), medians in us")
    print(
        f"{'depth':>5} {'M':>5} {'round trip':>11} {'p90':>6} {'server':>8} {'queue':>7}"
        f" {'stage':>7} {'device':>8}"
    )
    for depth, rows in result["depths"].items():
        for r in rows:
            print(
                f"{depth:>5} {r['M']:>5} {r['round_trip_us']:>11.0f} {r['round_trip_p90_us']:>6.0f}"
                f" {r['server_total_us']:>8.0f} {r['queue_us']:>7.0f} {r['stage_us']:>7.0f}"
                f" {r['device_us']:>8.0f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
