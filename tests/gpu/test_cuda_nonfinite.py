"""The one-launch NaN/Inf check of a batch's rows (kernels/csrc/rows.cu,
CudaBackend.nonfinite_rows_into) against the nine-op torch form it replaces
(server.graphs.nonfinite_rows): the same flags for NaN, +Inf and -Inf placed in x, the
weights or the output, at every position of a row, on both the 16-byte and the
one-value path. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from expertd.server.graphs import nonfinite_rows

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def backend():
    from expertd.kernels.cuda import CudaBackend

    return CudaBackend("cuda")


@pytest.mark.parametrize(
    "m, h, k, offset",
    [(1, 512, 8, 0), (37, 4096, 8, 0), (300, 7168, 6, 0), (9, 2052, 4, 0), (5, 512, 8, 1)],
)
def test_flags_match_the_torch_check(backend, m, h, k, offset):
    gen = torch.Generator(device="cuda").manual_seed(m * h + k)
    dev = "cuda"

    def bf16(rows, cols):  # offset 1: rows that start off 16 bytes (the one-value path)
        flat = torch.randn(rows * cols + offset, generator=gen, device=dev).bfloat16()
        return flat[offset:].view(rows, cols)

    x, out = bf16(m, h), bf16(m, h)
    w = torch.rand((m, k), generator=gen, device=dev)
    rows = torch.randperm(m, device="cpu")[: max(1, m // 2)].tolist()
    specials = (float("nan"), float("inf"), float("-inf"))
    for n, r in enumerate(rows):
        t = (x, w, out)[n % 3]
        col = (n * 7919) % t.shape[1]
        t[r, col] = specials[n % 3]
    x[rows[0], h - 1] = float("nan")  # the last value of a row
    got = torch.ones(m, dtype=torch.bool, device=dev)
    backend.nonfinite_rows_into(x, w, got, out)
    want = nonfinite_rows(x, w, output=out)
    assert torch.equal(got, want)
    assert got[rows].all() and int(got.sum()) == len(rows)


def test_huge_finite_values_are_not_flagged(backend):
    x = torch.full((3, 512), 3.0e38, device="cuda").bfloat16()  # bf16's largest finite range
    w = torch.full((3, 8), 3.0e38, device="cuda")
    bad = torch.ones(3, dtype=torch.bool, device="cuda")
    backend.nonfinite_rows_into(x, w, bad, x.clone())
    assert not bad.any()
