"""The client's per-call tensor work on the host (client/core.py): below NUMPY_MAX_ELEMENTS it
runs in numpy, on the loop's thread alone (torch's CPU ops wait on OpenMP workers in a busy
process); it must give torch's bits exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from expertd import wire
from expertd.client import core
from expertd.client.core import Inputs, Piece, combine, forward_request
from expertd.client.routing import ShardPart


def test_bf16_conversions_match_torch_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    scale = 10.0 ** torch.randint(-40, 39, (200_000,), generator=gen).float()
    a = torch.randn(200_000, generator=gen) * scale
    edges = [0.0, -0.0, float("inf"), -float("inf"), 3.3895314e38, -3.3895314e38, 1e-40, -1e-40]
    edges += [1.00390625, 1.01171875, 1.0 + 2**-8 + 2**-9, 1.0 + 2**-9]  # ties to even, up
    a = torch.cat([a, torch.tensor(edges)])
    want = a.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(core._f32_to_bf16(a.numpy()), want)
    b = a.to(torch.bfloat16)
    back = core._bf16_to_f32(core._bf16_bits(b))
    assert np.array_equal(back.view(np.uint32), b.float().numpy().view(np.uint32))
    nan = core._f32_to_bf16(np.array([np.nan, -np.nan], dtype=np.float32))
    assert np.isnan(core._bf16_to_f32(nan)).all()


def _call(m: int, h: int, shards: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((m, h), generator=gen).to(torch.bfloat16)
    inputs = Inputs(x, torch.zeros((m, 1), dtype=torch.int32), torch.ones((m, 1)), x.device)
    pieces = []
    for s in range(shards):  # the last shard answers for every token, the others for subsets
        keep = m if s == shards - 1 else max(1, m // 2)
        tokens = torch.randperm(m, generator=gen)[:keep].sort().values
        out = (torch.randn((tokens.numel(), h), generator=gen) * 3).to(torch.bfloat16)
        pieces.append(Piece(s, tokens, wire.encode(out)))
    return inputs, pieces


@pytest.mark.parametrize("m,h", [(1, 512), (7, 512), (64, 4096)])
def test_numpy_and_torch_paths_compute_the_same_bits(monkeypatch, m, h):
    inputs, pieces = _call(m, h, 8, seed=m)
    monkeypatch.setattr(core, "NUMPY_MAX_ELEMENTS", 1 << 30)
    fast = combine(inputs, h, list(reversed(pieces)))  # any arrival order: summed in shard order
    monkeypatch.setattr(core, "NUMPY_MAX_ELEMENTS", 0)
    slow = combine(inputs, h, pieces)
    assert torch.equal(fast.view(torch.int16), slow.view(torch.int16))
    # rows go out the same way too
    part = ShardPart(
        0, pieces[0].tokens, torch.zeros((1, 1), dtype=torch.int32), torch.ones(1, 1), [0]
    )
    rows_torch = forward_request(0, inputs, part).hidden_states
    monkeypatch.setattr(core, "NUMPY_MAX_ELEMENTS", 1 << 30)
    rows_numpy = forward_request(0, inputs, part).hidden_states
    assert torch.equal(rows_numpy.view(torch.int16), rows_torch.view(torch.int16))
    assert rows_numpy.dtype == torch.bfloat16 and rows_numpy.shape == (part.tokens.numel(), h)


def test_combine_refuses_a_wrong_shape():
    inputs, pieces = _call(4, 512, 2, seed=1)
    bad = Piece(9, pieces[0].tokens, wire.encode(torch.zeros((1, 3), dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="expected"):
        combine(inputs, 512, [*pieces, bad])
