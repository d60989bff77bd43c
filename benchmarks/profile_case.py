"""One eager forward per token count, for a profiler (ncu) to look at each kernel.

    ncu --clock-control none --kernel-name regex:"moe|route|finalize" \
        --section SpeedOfLight python benchmarks/profile_case.py 1 256

Layer: muse-spark shapes, 32 local experts drawn on the GPU (as benchmarks/kernel.py). Below
M = 32 every token has a route to one local expert, so the GEMMs have work.
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "benchmarks")
from kernel import EL, TOP_K, H, gpu_layer, routes

from expertd.kernels.cuda import CudaBackend


def main() -> None:
    ms = [int(a) for a in sys.argv[1:]] or [1, 256]
    layer = gpu_layer()
    backend = CudaBackend("cuda", max_tokens=max(ms))
    state = backend.prepare(layer)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for m in ms:
        ids, w = routes(m, gen)
        if m < 32:  # at least one local route per token (above: the benchmark's routing)
            ids[:, 0] = layer.experts[m % EL]
        x = torch.randn((m, H), generator=gen, device="cuda").to(torch.bfloat16)
        out = torch.empty((m, H), dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        backend.forward_into(state, x, ids, w, out)
        torch.cuda.synchronize()
        print(f"M={m} top_k={TOP_K} done", flush=True)


if __name__ == "__main__":
    main()
