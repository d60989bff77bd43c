"""Graph replays of one forward for a timeline tool (Nsight Systems), one token count per run.

    nsys profile --cuda-graph-trace=node -o out python benchmarks/timeline_case.py 1
    nsys stats --report cuda_gpu_trace out.nsys-rep

Layer and routing as benchmarks/kernel.py (muse-spark, 32 local experts, real top-8 routing,
at least one local route). 20 warm-up replays, then 20 back to back: the kernels of each call,
their start and end times and the gaps between them (PDL overlap included) are what the
kernel benchmark's single number hides.
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "benchmarks")
from kernel import EL, TOP_K, H, gpu_layer, routes

from expertd.kernels.cuda import CudaBackend, GraphedForward


def main() -> None:
    m = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    layer = gpu_layer()
    backend = CudaBackend("cuda", max_tokens=m)
    state = backend.prepare(layer)
    gen = torch.Generator(device="cuda").manual_seed(3)
    ids, w = routes(m, gen)
    ids[:, 0] = layer.experts[m % EL]  # at least one local route per token
    x = torch.randn((m, H), generator=gen, device="cuda").to(torch.bfloat16)
    g = GraphedForward(backend, state, m, TOP_K)
    g.x.copy_(x)
    g.topk_ids.copy_(ids)
    g.topk_weights.copy_(w)
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"M={m}: 20 replays traced", flush=True)


if __name__ == "__main__":
    main()
