"""Session 24 call 3: does the split-tail draft (branch s24-split-tail-dropped) compute the right
sums? Split 0 vs 1 on the same inputs, each against the float64 reference."""

import os
import sys

import torch

sys.path.insert(0, "tests")
from test_cuda_kernels import LOCAL, _routes

from expertd.kernels.cuda import CudaBackend
from expertd.kernels.reference import reference_forward, relative_error
from expertd.server.synthetic import PRESETS, synthetic_layer

be = CudaBackend("cuda")
for name, cases in (
    ("small", [(1024, 0), (1024, 160), (256, 16)]),
    ("muse-spark", [(256, 0), (1024, 0), (512, 0), (2048, 0)]),
):
    p = PRESETS[name]
    layer = synthetic_layer(p, seed=7, layer=0, experts=LOCAL[name], device="cuda")
    st = be.prepare(layer)
    for m, bt in cases:
        ids, w = _routes(m, p.num_experts, p.top_k, seed=m)
        x = torch.randn((m, p.hidden_size), device="cuda").to(torch.bfloat16)
        outs = {}
        for sp in ("0", "1"):
            os.environ["EXPERTD_KERNEL_V8_SPLIT"] = sp
            o = torch.empty((m, p.hidden_size), dtype=torch.bfloat16, device="cuda")
            be.forward_into(st, x, ids, w, o, bt=bt)
            torch.cuda.synchronize()
            outs[sp] = o.float()
        ref = reference_forward(layer, x, ids, w)
        d = (outs["1"] - outs["0"]).abs()
        rows = (d.amax(dim=1) > 0).sum().item()
        ratio = (outs["1"].norm() / outs["0"].norm()).item()
        print(
            f"{name} M {m} bt {bt}: err split0 {relative_error(outs['0'], ref):.2e} split1 "
            f"{relative_error(outs['1'], ref):.2e}; rows differing {rows}/{m}; max diff "
            f"{d.max().item():.3e}; norm ratio {ratio:.4f}",
            flush=True,
        )
