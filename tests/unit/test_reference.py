"""The reference forward (docs/protocol.md) against a route-by-route float64
evaluation written straight from the formulas, and the reference backend."""

from __future__ import annotations

import math

import pytest
import torch

from expertd.kernels import ReferenceBackend, reference_forward, relative_error
from expertd.server.synthetic import get_preset, synthetic_layer

PRESET = get_preset("small")
H, I = PRESET.hidden_size, PRESET.intermediate_size  # noqa: E741 (the protocol's names)
OWNED = [3, 9, 10, 11, 40, 63]  # a non-contiguous shard


@pytest.fixture(scope="module")
def layer():
    return synthetic_layer(PRESET, 5, 0, OWNED)


def by_the_formulas(layer, x, ids, w) -> torch.Tensor:
    """One route at a time, float64, exactly as docs/protocol.md writes it."""
    gate, up, down = (p.dequantize(torch.float64) for p in (layer.gate, layer.up, layer.down))
    norm = layer.norm_weight.double()
    out = torch.zeros((x.shape[0], H), dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e not in layer.experts:
                continue
            s = layer.experts.index(e)
            xt = x[t].double()
            h = torch.cat((gate[s] @ xt, up[s] @ xt))
            a = torch.nn.functional.silu(h[:I]) * h[I:]
            z = (down[s] @ a) * (1 + norm)
            r = z / math.sqrt(float((z * z).mean()) + 1e-8)
            out[t] += float(w[t, j]) * r
    return out


def inputs(m: int, seed: int, k: int = 8):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((m, H), generator=gen).to(torch.bfloat16)
    ids = torch.randint(-1, PRESET.num_experts, (m, k), generator=gen, dtype=torch.int32)
    ids[: m // 2, 0] = torch.tensor(OWNED)[
        torch.arange(m // 2) % len(OWNED)
    ].int()  # some owned routes
    w = torch.rand((m, k), generator=gen)
    return x, ids, w


@pytest.mark.parametrize("m", [1, 3, 17])
def test_reference_matches_formulas(layer, m):
    x, ids, w = inputs(m, m)
    ref = reference_forward(layer, x, ids, w)
    assert ref.dtype == torch.float64
    assert relative_error(ref, by_the_formulas(layer, x, ids, w)) < 1e-12


@pytest.mark.parametrize("m", [0, 1, 7, 64, 257])
def test_reference_backend_within_tolerance(layer, m):
    backend = ReferenceBackend("cpu")
    state = backend.prepare(layer)
    x, ids, w = inputs(m, 100 + m)
    out = backend.forward(state, x, ids, w)
    assert out.dtype == torch.bfloat16 and out.shape == (m, H)
    assert torch.isfinite(out.float()).all()
    assert relative_error(out, reference_forward(layer, x, ids, w)) <= 1e-2


def test_all_routes_on_one_expert(layer):
    x, _, w = inputs(33, 1)
    ids = torch.full((33, 8), 40, dtype=torch.int32)
    out = ReferenceBackend().forward(ReferenceBackend().prepare(layer), x, ids, w)
    assert relative_error(out, by_the_formulas(layer, x, ids, w)) <= 1e-2


def test_no_owned_routes_gives_zeros(layer):
    x, _, w = inputs(5, 2)
    ids = torch.tensor([[0, 1, -1, 2, 4, 5, 6, 7]] * 5, dtype=torch.int32)  # none owned
    out = ReferenceBackend().forward(ReferenceBackend().prepare(layer), x, ids, w)
    assert out.shape == (5, H) and (out == 0).all()


def test_int64_ids_and_bf16_weights_accepted(layer):
    x, ids, w = inputs(4, 3)
    a = reference_forward(layer, x, ids.long(), w.to(torch.bfloat16).float())
    b = reference_forward(layer, x, ids, w.to(torch.bfloat16))
    assert relative_error(a, b) < 1e-12
