"""GPU tests of the `cuda` backend at the released families' expert shapes (server/families.py,
docs/models.md) against the plain-torch float64 reference: DeepSeek-V3/R1 (H 7168, I 2048),
Qwen3-235B-A22B (H 4096, I 1536) and Qwen3-30B-A3B (H 2048, I 768), all without a post-expert
norm (the kernel's rms_norm = 0 path: out = sum_j w_j * W2 a_j); the `small` shape with its norm
dropped; and the ModelOpt export of tests/fixtures/qwen3-moe-tiny.

The same tolerances as test_cuda_kernels.py: relative Frobenius error <= 1e-2 per call, <= 2e-2
per token row, exact zeros for a token with no owned route; outputs start poisoned with NaN.
Skipped without a CUDA device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from expertd.kernels.layer import ShardLayer
from expertd.kernels.reference import reference_forward, relative_error
from expertd.server.checkpoint import CheckpointReader
from expertd.server.synthetic import PRESETS, synthetic_layer

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = 1e-2
ROW_TOL = 2e-2
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3-moe-tiny"
M_SWEEP = (1, 2, 7, 16, 64, 118, 152, 371, 1023, 4096)
COMPILED_BTS = (8, 16, 32, 48, 64, 96, 128, 144, 160)
# A few owned experts per family (fast to generate): a range, and ids through the table.
LOCAL = {
    "deepseek-v3": [0, 1, 2, 3],
    "qwen3-235b-a22b": [5, 64, 100, 127],
    "qwen3-30b-a3b": list(range(16, 32)),
    "llama4-scout": [0, 7, 15],  # top-1
    "llama4-maverick": [3, 64, 127],
}


@pytest.fixture(scope="module")
def backend():
    from expertd.kernels.cuda import CudaBackend

    return CudaBackend("cuda")


@pytest.fixture(scope="module", params=sorted(LOCAL))
def case(request, backend):
    preset = PRESETS[request.param]
    layer = synthetic_layer(preset, seed=3, layer=0, experts=LOCAL[preset.name], device="cuda")
    assert layer.norm_weight is None
    return preset, layer, backend.prepare(layer)


def _inputs(m: int, preset, layer, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack(
        [torch.randperm(preset.num_experts, generator=gen)[: preset.top_k] for _ in range(m)]
    )
    ids = ids.to(torch.int32)
    ids[: (m + 1) // 2, 0] = int(layer.experts[m % len(layer.experts)])  # routes land here
    ids[torch.rand(ids.shape, generator=gen) < 0.1] = -1
    w = torch.rand((m, preset.top_k), generator=gen)
    x = torch.randn((m, preset.hidden_size), generator=gen).to(torch.bfloat16)
    return x.cuda(), ids.cuda(), w.cuda()


def _check(backend, state, layer, x, ids, w, what, **kw):
    out = torch.full(x.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    backend.forward_into(state, x, ids, w, out, **kw)
    torch.cuda.synchronize()
    ref = reference_forward(layer, x, ids, w).cpu()
    out = out.double().cpu()
    assert torch.isfinite(out).all(), f"{what}: non-finite output (an unwritten element)"
    owned = ref.norm(dim=1) > 0
    assert torch.equal(out[~owned], torch.zeros_like(out[~owned])), what
    err = relative_error(out, ref)
    rows = (out - ref).norm(dim=1)[owned] / ref.norm(dim=1)[owned]
    worst = rows.max().item() if rows.numel() else 0.0
    print(f"{what}: rel err {err:.2e}, worst row {worst:.2e}")
    assert err <= TOL and worst <= ROW_TOL, f"{what}: rel err {err:.3e}, worst row {worst:.3e}"


@pytest.mark.parametrize("m", M_SWEEP)
def test_family_shapes_match_reference(case, backend, m):
    preset, layer, state = case
    x, ids, w = _inputs(m, preset, layer, seed=m)
    _check(backend, state, layer, x, ids, w, f"{preset.name} M={m}")


@pytest.mark.parametrize("bt", COMPILED_BTS)
def test_family_shapes_every_tile_size(case, backend, bt):
    preset, layer, state = case
    x, ids, w = _inputs(152, preset, layer, seed=bt)
    _check(backend, state, layer, x, ids, w, f"{preset.name} M=152 BT={bt}", bt=bt)


def test_small_shape_without_the_norm(backend):
    """The `small` weights with the post-expert norm dropped: the rms_norm = 0 path, where the
    norm's RMS would otherwise rescale every route."""
    preset = PRESETS["small"]
    normed = synthetic_layer(preset, seed=7, layer=0, experts=list(range(8, 24)), device="cuda")
    layer = ShardLayer(
        normed.experts, normed.num_experts, normed.gate, normed.up, normed.down, None
    )
    state = backend.prepare(layer)
    for m in (1, 7, 64, 371):
        x, ids, w = _inputs(m, preset, layer, seed=m)
        _check(backend, state, layer, x, ids, w, f"small without norm M={m}")
        with_norm = reference_forward(normed, x, ids, w).cpu()
        assert relative_error(with_norm, reference_forward(layer, x, ids, w).cpu()) > 0.1


def test_modelopt_export_on_the_kernels(backend):
    """Both layers of the committed ModelOpt export (H = I = 256, 8 experts, top-2)."""
    reader = CheckpointReader(FIXTURE)
    for layer_id in reader.layers:
        layer = reader.load_layer(layer_id, list(range(reader.num_experts)), device="cuda")
        state = backend.prepare(layer)
        for m in (1, 5, 64, 300):
            gen = torch.Generator().manual_seed(m)
            ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(m)]).int()
            w = torch.softmax(torch.randn(m, 2, generator=gen), dim=1)
            x = (torch.randn(m, 256, generator=gen) * 0.5).to(torch.bfloat16)
            _check(
                backend, state, layer, x.cuda(), ids.cuda(), w.cuda(), f"export L{layer_id} M={m}"
            )
