"""Session 26, call 5: the client process at M = 64 and 256 (the numpy combine) against 8 muse-spark shards on the H200,
ExpertClient back to back; run under py-spy. Prints e2e medians and per-thread CPU per call."""

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, "benchmarks")
from service import routing

from expertd.client import ExpertClient
from expertd.server.launcher import start_shard, stop_shards, wait_serving
from expertd.server.synthetic import get_preset

preset = get_preset("muse-spark")
common = [
    "--synthetic",
    "muse-spark",
    "--layers",
    "1",
    "--device",
    "cuda",
    "--log-level",
    "WARNING",
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
        out[(tid, name)] = int(f[11]) + int(f[12])
    return out


try:
    wait_serving(shards, timeout=400)
    addrs = [s.address for s in shards]
    gen = torch.Generator().manual_seed(0)
    with ExpertClient(addrs, timeout=60) as c:
        for m in (64, 256):
            ids, w = routing(m, preset, gen)
            x = torch.randn((m, preset.hidden_size), generator=gen).to(torch.bfloat16)
            for _ in range(20):
                c.forward(0, x, ids, w)
            n, ts, a = 0, [], threads_cpu()
            t0 = time.time()
            while time.time() - t0 < float(os.environ.get("SECS", "10")):
                t = time.perf_counter()
                c.forward(0, x, ids, w)
                ts.append(time.perf_counter() - t)
            b = threads_cpu()
            ts.sort()
            print(f"M={m}: {len(ts)} calls, e2e median {ts[len(ts) // 2] * 1e3:.2f} ms", flush=True)
            tick = os.sysconf("SC_CLK_TCK")
            for k in sorted(b, key=lambda k: -(b[k] - a.get(k, 0)))[:6]:
                print(
                    f"  {k[1]:20s} {(b[k] - a.get(k, 0)) / tick / len(ts) * 1e3:.3f} ms/call",
                    flush=True,
                )
finally:
    stop_shards(shards)
