"""Send one shard requests of M tokens back to back for S seconds; print calls/s and Timing medians."""

import statistics
import sys
import time

import grpc
import torch

sys.path.insert(0, "benchmarks")
from service import OPTIONS, shard0_request

from expertd.server.synthetic import get_preset
from expertd.v1 import expertd_pb2_grpc as pb_grpc

address, preset, m, seconds = (
    sys.argv[1],
    get_preset(sys.argv[2]),
    int(sys.argv[3]),
    float(sys.argv[4]),
)
req = shard0_request(preset, m, torch.Generator().manual_seed(0))
with grpc.insecure_channel(address, options=OPTIONS) as ch:
    stub = pb_grpc.ExpertServiceStub(ch)
    deadline = time.time() + 600
    while True:  # until the shard serves
        try:
            stub.Forward(req, timeout=60)
            break
        except grpc.RpcError:
            if time.time() > deadline:
                raise
            time.sleep(1)
    print("serving", flush=True)
    for _ in range(50):
        stub.Forward(req, timeout=60)
    t0, rtt, fields = (
        time.time(),
        [],
        {k: [] for k in ("queue_us", "stage_us", "device_us", "total_us")},
    )
    while time.time() - t0 < seconds:
        t = time.perf_counter()
        r = stub.Forward(req, timeout=60)
        rtt.append((time.perf_counter() - t) * 1e6)
        for k in fields:
            fields[k].append(getattr(r.timing, k))
    med = {k: statistics.median(v) for k, v in fields.items()}
    print(
        f"M={m}: {len(rtt)} calls, round trip median {statistics.median(rtt):.0f} us;",
        med,
        flush=True,
    )
