"""The host scan for NaN/Inf rows (server/graphs.host_nonfinite_rows) flags exactly the
rows torch's isfinite flags (server/graphs.nonfinite_rows, what the GPU graphs run), for
every special bf16 value, in any block, in inputs, weights or outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from expertd.server import graphs
from expertd.server.graphs import host_nonfinite_rows, nonfinite_rows

SPECIALS = [float("nan"), float("inf"), float("-inf"), -float("nan")]


@pytest.mark.parametrize("block", [7, 64, 1 << 16])
def test_host_scan_flags_the_rows_torch_flags(monkeypatch, block):
    monkeypatch.setattr(graphs, "HOST_SCAN_ELEMENTS", block)
    gen = torch.Generator().manual_seed(block)
    for m, h, k in ((0, 16, 4), (1, 512, 8), (37, 48, 3), (300, 128, 8)):
        x = torch.randn((m, h), generator=gen).bfloat16()
        out = (torch.randn((m, h), generator=gen) * 1e3).bfloat16()
        w = torch.rand((m, k), generator=gen)
        if m:
            # the largest finite bf16, -0 and subnormals are finite: never flagged
            x[0, 0] = torch.finfo(torch.bfloat16).max
            x[-1, -1] = -0.0
            out[0, 1] = 1e-40
            for i, v in enumerate(SPECIALS * 4):
                t = (x, out, w)[i % 3]
                r = int(torch.randint(0, m, (1,), generator=gen))
                c = int(torch.randint(0, t.shape[1], (1,), generator=gen))
                t[r, c] = v
            # every NaN bit pattern, positive and negative, in one row
            nan_bits = torch.tensor([0x7F81, 0x7FC0, 0x7FFF, 0xFF81, 0xFFC0, 0xFFFF])
            row = torch.zeros(h, dtype=torch.int16)
            row[: nan_bits.numel()] = nan_bits.to(torch.int32).to(torch.int16)
            x[m // 2] = row.view(torch.bfloat16)
        want = nonfinite_rows(x, w, output=out)
        got = host_nonfinite_rows(x, w, out)
        assert got.dtype == torch.bool and got.shape == (m,)
        assert torch.equal(got, want), (m, h)
        if m:
            assert bool(got[m // 2])  # the row of NaN patterns
        if m >= 300:
            assert int(got.sum()) < m  # and not every row


def test_a_clean_call_has_no_flags():
    x = torch.randn((1024, 512)).bfloat16()
    w = torch.rand((1024, 8))
    got = host_nonfinite_rows(x, w, x)
    assert not got.any() and np.array_equal(got.numpy(), nonfinite_rows(x, w, output=x).numpy())
