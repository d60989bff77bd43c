# Tiles per input set at BT 48 as benchmarks/kernel.py draws them (session 21: why lib_ab's
# M = 1024 sets ran 25% slower than the sweep's).
import math
import sys

import torch

sys.path.insert(0, "benchmarks")
from kernel import LOCAL_EXPERTS, M_SWEEP, H, default_sets, routes


def draw(ms):
    gen = torch.Generator(device="cuda").manual_seed(1)
    out = {}
    for m in ms:
        sets = []
        for _ in range(default_sets(m)):
            ids, _w = routes(m, gen)
            torch.randn((m, H), generator=gen, device="cuda")
            sets.append(ids)
        out[m] = sets
    return out


def describe(ids, bt=48):
    cnt = torch.bincount(ids.flatten().long(), minlength=256)[
        LOCAL_EXPERTS[0] : LOCAL_EXPERTS[-1] + 1
    ]
    tiles = []
    for c in cnt.tolist():
        for t in range(math.ceil(c / bt)):
            tiles.append(min(bt, c - t * bt))
    return (
        len(tiles),
        sum(1 for r in tiles if r <= 32),
        sum(1 for r in tiles if r <= 16),
        max(cnt.tolist()),
    )


for name, ms in (("sweep", M_SWEEP), ("lib_ab call 7", (896, 960, 1024, 1088, 1152))):
    d = draw(ms)
    for s, ids in enumerate(d[1024]):
        n, le32, le16, mx = describe(ids)
        print(
            f"{name:14s} M=1024 set {s}: {n} tiles at BT 48, {le32} of <= 32 routes, {le16} of <= 16, busiest expert {mx}"
        )
