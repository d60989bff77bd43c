"""Session 24, on the CPU machine: ExpertClient end to end against 8 local CPU shard processes
(small preset), median / p90 / mean per M. Run from the repo root; old / new by git stash."""

import sys
import time

import torch

sys.path.insert(0, "tests")
from conftest import hidden, routing

from expertd.client import ExpertClient
from expertd.server.launcher import start_shard, stop_shards, wait_serving

common = [
    "--synthetic",
    "small",
    "--layers",
    "1",
    "--device",
    "cpu",
    "--log-level",
    "WARNING",
    "--torch-threads",
    "1",
]
shards = [start_shard([*common, "--shard", str(s), "--num-shards", "8"]) for s in range(8)]
try:
    wait_serving(shards, timeout=120)
    addrs = [s.address for s in shards]
    gen = torch.Generator().manual_seed(0)
    with ExpertClient(addrs, timeout=30) as c:
        for M in (1, 16):
            ids, w = routing(M, gen)
            x = hidden(M, gen)
            for _ in range(20):
                c.forward(0, x, ids, w)
            ts = []
            for _ in range(150):
                t = time.perf_counter()
                c.forward(0, x, ids, w)
                ts.append(time.perf_counter() - t)
            ts.sort()
            print(
                f"M={M}: e2e median {ts[75] * 1e3:.2f} ms, p90 {ts[135] * 1e3:.2f}, mean {sum(ts) / len(ts) * 1e3:.2f}",
                flush=True,
            )
finally:
    stop_shards(shards)
