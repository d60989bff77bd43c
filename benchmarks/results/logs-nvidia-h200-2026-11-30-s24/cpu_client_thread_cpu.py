"""Session 24, on the CPU machine: CPU per call of each thread of the client process (/proc),
AsyncExpertClient against 8 local CPU shard processes at M = 1."""

import asyncio
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, "tests")
from conftest import hidden, routing

from expertd.client import AsyncExpertClient
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


def threads_cpu():
    out = {}
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            st = Path(f"/proc/{os.getpid()}/task/{tid}/stat").read_text()
            name = Path(f"/proc/{os.getpid()}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        f = st.rsplit(")", 1)[1].split()
        out[(tid, name)] = int(f[11]) + int(f[12])  # utime + stime in ticks
    return out


try:
    wait_serving(shards, timeout=120)
    addrs = [s.address for s in shards]
    gen = torch.Generator().manual_seed(0)
    M = 1
    ids, w = routing(M, gen)
    x = hidden(M, gen)

    async def go():
        c = await AsyncExpertClient.connect(addrs, timeout=30)
        for _ in range(20):
            await c.forward(0, x, ids, w)
        a = threads_cpu()
        t = time.perf_counter()
        for _ in range(200):
            await c.forward(0, x, ids, w)
        wall = time.perf_counter() - t
        b = threads_cpu()
        tick = os.sysconf("SC_CLK_TCK")
        print(f"wall/call {wall / 200 * 1e3:.2f} ms")
        for k in sorted(b, key=lambda k: -(b[k] - a.get(k, 0))):
            d = (b[k] - a.get(k, 0)) / tick / 200 * 1e3
            if d > 0.01:
                print(f"  {k[1]:20s} {d:.3f} ms/call")
        await c.close()

    asyncio.run(go())
finally:
    stop_shards(shards)
