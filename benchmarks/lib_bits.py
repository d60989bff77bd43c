"""Output bits of one kernel library, saved or compared with another library's (on a GPU).

A library A/B (benchmarks/lib_ab.py) times two builds but cannot see their outputs: each build
runs in its own process (EXPERTD_KERNEL_LIB is read once). This runs a fixed set of forwards
(seeded inputs; preset `muse-spark` at decode and mid M, where the v6 loop, self-routed and
full-grid kernels and v8 run, and a k512 layer for the decode alternatives) and either saves
their outputs or compares them bit for bit with a saved file:

    EXPERTD_KERNEL_LIB=.carry/main/libexpertd_kernels.so python benchmarks/lib_bits.py --save /tmp/a.pt
    EXPERTD_KERNEL_LIB=.carry/new/libexpertd_kernels.so python benchmarks/lib_bits.py --compare /tmp/a.pt

--compare prints one line per case (equal, or the count of differing elements and the largest
difference) and exits non-zero if any case differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel import gpu_layer, routes  # benchmarks/kernel.py: the benchmark's layer and routing

from expertd.kernels.cuda import CudaBackend
from expertd.server.synthetic import Preset, synthetic_layer

MUSE_MS = (1, 2, 3, 8, 16, 64, 128, 256, 1024, 2048)
K512_MS = (1, 5, 40, 200)


def cases(backend: CudaBackend):
    """(name, state, x, ids, w) for every case, inputs drawn from fixed seeds."""
    layer = gpu_layer()
    state = backend.prepare(layer)
    gen = torch.Generator(device="cuda").manual_seed(7)
    h = layer.hidden_size
    for m in MUSE_MS:
        ids, w = routes(m, gen)
        x = torch.randn((m, h), generator=gen, device="cuda").to(torch.bfloat16)
        yield f"muse-spark M={m}", state, x, ids, w
    small = Preset("k512", 512, 512, 64, 8)
    layer = synthetic_layer(small, seed=3, layer=0, experts=list(range(16, 32)), device="cpu")
    state = backend.prepare(layer.to("cuda"))
    cpu = torch.Generator().manual_seed(5)
    for m in K512_MS:
        ids = torch.stack([torch.randperm(small.num_experts, generator=cpu)[:8] for _ in range(m)])
        w = torch.rand((m, 8), generator=cpu)
        x = torch.randn((m, small.hidden_size), generator=cpu).to(torch.bfloat16)
        yield f"k512 M={m}", state, x.cuda(), ids.to(torch.int32).cuda(), w.cuda()


def outputs() -> dict[str, torch.Tensor]:
    backend = CudaBackend("cuda", max_tokens=max(*MUSE_MS, *K512_MS))
    out = {}
    for name, state, x, ids, w in cases(backend):
        y = torch.empty((x.shape[0], x.shape[1]), dtype=torch.bfloat16, device="cuda")
        backend.forward_into(state, x, ids, w, y)
        out[name] = y.cpu()
    torch.cuda.synchronize()
    return out


def compare(saved: dict[str, torch.Tensor], now: dict[str, torch.Tensor]) -> list[str]:
    """One line per case of `saved`; lines of differing or missing cases start with 'DIFF'."""
    lines = []
    for name, a in saved.items():
        b = now.get(name)
        if b is None or b.shape != a.shape:
            lines.append(f"DIFF {name}: missing or another shape")
        elif torch.equal(a.view(torch.int16), b.view(torch.int16)):
            lines.append(f"same {name}")
        else:
            n = int((a.view(torch.int16) != b.view(torch.int16)).sum())
            d = float((a.float() - b.float()).abs().max())
            lines.append(f"DIFF {name}: {n} elements differ, largest difference {d:.3g}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--save", help="write this library's outputs to FILE")
    group.add_argument("--compare", help="compare this library's outputs with FILE's")
    args = ap.parse_args()
    now = outputs()
    if args.save:
        torch.save(now, args.save)
        print(f"saved {len(now)} outputs to {args.save}")
        return 0
    lines = compare(torch.load(args.compare), now)
    print("\n".join(lines))
    return 1 if any(line.startswith("DIFF") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
