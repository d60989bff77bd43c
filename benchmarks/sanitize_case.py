"""A small forward for compute-sanitizer (memcheck / racecheck / initcheck): preset `small`, a
shard of 16 experts, a few token counts and every compiled tile size; then a layer whose H and I
are multiples of 512, where BT 8 calls run the decode alternatives (28 at M = 1, on a grid of 2
rows; 13 below 128 routes; 18 from 128 routes; from 512 routes the one-tile grids on fewer rows
than t_max, and a call with every route local so that their blocks loop over further tiles).
Exits non-zero on a wrong result.
Run: compute-sanitizer --tool memcheck python benchmarks/sanitize_case.py"""

from __future__ import annotations

import sys

import torch

from expertd.kernels.cuda import CudaBackend
from expertd.kernels.reference import reference_forward, relative_error
from expertd.server.synthetic import PRESETS, Preset, synthetic_layer


def main() -> int:
    worst = 0.0
    gen = torch.Generator().manual_seed(0)
    cases = ((1, 0), (5, 8), (33, 16), (50, 24), (70, 32), (90, 48), (130, 64), (150, 96))
    runs = (
        # v8 at BT 16 and from 32; M = 2100: 16800 routes, multi-block routing
        (PRESETS["small"], (*cases, (260, 128), (300, 144), (340, 160), (700, 0), (2100, 0))),
        # decode alternatives; bt < 0: every route local
        (Preset("k512", 512, 512, 64, 8), ((1, 0), (5, 8), (40, 8), (140, 8), (140, -8))),
    )
    backend = CudaBackend("cuda")
    for preset, ms in runs:
        worst = max(worst, run(backend, preset, ms, gen))
    print(f"worst rel err {worst:.2e}")
    return 0 if worst <= 1e-2 else 1


def run(backend, preset, cases, gen) -> float:
    owned = list(range(16, 32))
    layer = synthetic_layer(preset, seed=3, layer=0, experts=owned, device="cpu")
    state = backend.prepare(layer.to("cuda"))
    worst = 0.0
    for m, bt in cases:
        # bt < 0: ids drawn from the shard's own experts only (every route local)
        pool = torch.tensor(owned) if bt < 0 else torch.arange(preset.num_experts)
        ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:8]] for _ in range(m)])
        bt = abs(bt)
        ids = ids.to(torch.int32)
        ids[0, 0] = -1
        w = torch.rand((m, 8), generator=gen)
        x = torch.randn((m, preset.hidden_size), generator=gen).to(torch.bfloat16)
        out = torch.full((m, preset.hidden_size), float("nan"), dtype=torch.bfloat16, device="cuda")
        backend.forward_into(state, x.cuda(), ids.cuda(), w.cuda(), out, bt=bt)
        torch.cuda.synchronize()
        err = relative_error(out.cpu(), reference_forward(layer, x, ids, w))
        worst = max(worst, err if out.isfinite().all() else float("inf"))
        print(f"{preset.name} M={m} bt={bt}: rel err {err:.2e}")
    return worst


if __name__ == "__main__":
    sys.exit(main())
