"""GPU tests of the `cuda` backend (the kernel library, kernels/csrc/moe_nvfp4.cu) against the
plain-torch float64 reference (kernels/reference.py, docs/protocol.md).

Every output buffer starts poisoned with NaN, so an element the kernels fail to write fails the
check. Tolerances: relative Frobenius error <= 1e-2 over the call and <= 2e-2 for every token row
on its own (bf16 operands and bf16 intermediates: ~3e-3 expected); rows with no owned route must
be exact zeros. Measured errors are printed with -s.

The shapes walk through the configurations the library picks (moe_nvfp4.cu, "compiled
configurations"): with the `small` preset (H 512, I 256, 64 experts, 16 local) and `muse-spark`
(H = I = 4096, 256 experts, 4 local), M = 1-118 runs the mma.sync GEMMs at BT 8 (capped grids
routed by GEMM1 to 64 routes, one-tile grids above, on fewer rows from 512 routes), larger M the
wgmma GEMMs at BT 16-160, and M = 4096 the multi-block routing and the unbatched finalize.
Skipped without a CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from expertd.kernels.layer import ShardLayer
from expertd.kernels.nvfp4 import Nvfp4Weight, quantize
from expertd.kernels.reference import reference_forward, relative_error
from expertd.server.synthetic import PRESETS, synthetic_layer

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = 1e-2
ROW_TOL = 2e-2
M_SWEEP = (0, 1, 2, 3, 7, 16, 64, 118, 152, 371, 1023, 4096)
COMPILED_BTS = (8, 16, 32, 48, 64, 96, 128, 144, 160)
# Local experts per preset: a shard of `small` (consecutive ids: no table lookups in the
# kernels), and 4 of muse-spark's 256 (ids through the local_of table; fast to generate, and a
# realistic share of routes lands elsewhere).
LOCAL = {"small": list(range(8, 24)), "muse-spark": [3, 70, 128, 255]}


@pytest.fixture(scope="module")
def backend():
    from expertd.kernels.cuda import CudaBackend

    return CudaBackend("cuda")


@pytest.fixture(scope="module", params=["small", "muse-spark"])
def case(request, backend):
    preset = PRESETS[request.param]
    layer = synthetic_layer(preset, seed=7, layer=0, experts=LOCAL[preset.name], device="cuda")
    return preset, layer, backend.prepare(layer)


def _routes(m: int, e: int, top_k: int, seed: int, drop: float = 0.1):
    """Distinct random ids per token (a share of them -1) and positive weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = (
        torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(m)])
        if m
        else torch.empty((0, top_k), dtype=torch.int64)
    )
    ids = ids.to(torch.int32)
    ids[torch.rand(ids.shape, generator=gen) < drop] = -1
    w = torch.rand((m, top_k), generator=gen, dtype=torch.float32)
    return ids.cuda(), w.cuda()


def _x(m: int, h: int, seed: int) -> torch.Tensor:
    x = torch.randn((m, h), generator=torch.Generator().manual_seed(seed))
    return x.to(torch.bfloat16).cuda()


def _run(backend, state, x, ids, w, **kw):
    """The forward into a NaN-poisoned output."""
    out = torch.full((x.shape[0], x.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    backend.forward_into(state, x, ids, w, out, **kw)
    torch.cuda.synchronize()
    return out


def _check(out, ref, what):
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), f"{what}: non-finite output (an unwritten element)"
    err = relative_error(out, ref)
    ref_norm = ref.norm(dim=1)
    owned = ref_norm > 0
    assert torch.equal(out[~owned], torch.zeros_like(out[~owned])), (
        f"{what}: a token with no owned route must give exact zeros"
    )
    rows = (out - ref).norm(dim=1)[owned] / ref_norm[owned]
    worst = rows.max().item() if rows.numel() else 0.0
    print(f"{what}: rel err {err:.2e}, worst row {worst:.2e}")
    assert err <= TOL, f"{what}: relative error {err:.3e} > {TOL}"
    assert worst <= ROW_TOL, f"{what}: a token row's relative error {worst:.3e} > {ROW_TOL}"


def _foreign(layer, num_experts: int, top_k: int) -> list[int]:
    owned = set(layer.experts)
    return [e for e in range(num_experts) if e not in owned][:top_k]


@pytest.mark.parametrize("m", M_SWEEP)
def test_forward_matches_reference(case, backend, m):
    preset, layer, state = case
    ids, w = _routes(m, preset.num_experts, preset.top_k, seed=m)
    x = _x(m, preset.hidden_size, seed=m + 1)
    out = _run(backend, state, x, ids, w)
    if m == 0:
        assert out.shape == (0, preset.hidden_size)
        return
    _check(out, reference_forward(layer, x, ids, w), f"{preset.name} M={m}")


@pytest.mark.parametrize("m", [1, 2, 3, 7, 16, 64, 118, 371])
def test_every_token_with_local_routes(case, backend, m):
    """Most routes owned here (muse-spark's shard gets few otherwise): the first route of every
    token on a local expert, the second on another for half the tokens, so the decode sizes run
    several tiles per call."""
    preset, layer, state = case
    ids, w = _routes(m, preset.num_experts, preset.top_k, seed=m + 100)
    ids[:, 0] = int(layer.experts[m % len(layer.experts)])
    ids[::2, 1] = int(layer.experts[(m + 1) % len(layer.experts)])
    x = _x(m, preset.hidden_size, seed=m + 101)
    _check(_run(backend, state, x, ids, w), reference_forward(layer, x, ids, w), f"M={m} local")


@pytest.mark.parametrize("bt", COMPILED_BTS)
@pytest.mark.parametrize("m", [5, 152])
def test_every_compiled_tile_size(case, backend, bt, m):
    """The caller's bt (every compiled tile size, outside the range the pick gives it): BT 8 at
    M = 152 runs the one-tile grids on fewer rows; a busy expert fills several tiles, one of them
    partly, so the wgmma GEMMs run their narrower widths beside the full one."""
    preset, layer, state = case
    ids, w = _routes(m, preset.num_experts, preset.top_k, seed=bt + m)
    ids[: (m * 3) // 4, 0] = int(layer.experts[0])
    x = _x(m, preset.hidden_size, seed=bt + m + 1)
    _check(
        _run(backend, state, x, ids, w, bt=bt),
        reference_forward(layer, x, ids, w),
        f"{preset.name} M={m} bt={bt}",
    )


def test_tile_size_not_compiled_is_an_error(case, backend):
    from expertd.kernels.cuda import kernel_path

    preset, _layer, state = case
    ids, w = _routes(4, preset.num_experts, preset.top_k, seed=3)
    x = _x(4, preset.hidden_size, seed=4)
    with pytest.raises(RuntimeError, match="not a compiled tile size"):
        _run(backend, state, x, ids, w, bt=24)
    assert [kernel_path(bt) for bt in (*COMPILED_BTS, 24)] == [6] + [8] * 8 + [0]


@pytest.mark.parametrize("m", [1, 7, 300, 4096])
def test_all_routes_on_one_expert(case, backend, m):
    """Every route of every token on the last local expert (each token routes to it top_k
    times): one expert's run over many tiles, the others empty."""
    preset, layer, state = case
    ids = torch.full((m, preset.top_k), layer.experts[-1], dtype=torch.int32, device="cuda")
    w = torch.rand((m, preset.top_k), generator=torch.Generator().manual_seed(m)).cuda()
    x = _x(m, preset.hidden_size, seed=m + 2)
    _check(
        _run(backend, state, x, ids, w),
        reference_forward(layer, x, ids, w),
        f"{preset.name} M={m} one expert",
    )


@pytest.mark.parametrize("m", [1, 3, 16, 152, 1023])
def test_an_empty_expert_between_busy_ones(case, backend, m):
    """Routes on every local expert but the second (an empty run between two busy ones: its
    offsets equal its neighbour's, no tile of its own)."""
    preset, layer, state = case
    experts = [e for i, e in enumerate(layer.experts) if i != 1]
    gen = torch.Generator().manual_seed(m + 7)
    ids, w = _routes(m, preset.num_experts, preset.top_k, seed=m + 7, drop=0.0)
    ids = ids.cpu()
    ids[:, :2] = -1
    pick = torch.randint(len(experts), (m,), generator=gen)
    ids[:, 0] = torch.tensor(experts, dtype=torch.int32)[pick]
    ids = torch.where(ids == layer.experts[1], torch.tensor(-1, dtype=torch.int32), ids).cuda()
    x = _x(m, preset.hidden_size, seed=m + 8)
    assert not (ids == layer.experts[1]).any()
    _check(
        _run(backend, state, x, ids, w),
        reference_forward(layer, x, ids, w),
        f"{preset.name} M={m} empty expert",
    )


@pytest.mark.parametrize("m", [1, 2, 7, 37, 1023])
def test_no_owned_routes_gives_zeros(case, backend, m):
    """Ids of other shards' experts and -1: every element written, all zeros; then a call with
    local routes still computes (nothing left over from the empty one)."""
    preset, layer, state = case
    ids = torch.tensor(
        [_foreign(layer, preset.num_experts, preset.top_k)] * m, dtype=torch.int32, device="cuda"
    )
    ids[::3, 0] = -1
    w = torch.rand((m, preset.top_k), device="cuda")
    x = _x(m, preset.hidden_size, seed=m)
    out = _run(backend, state, x, ids, w)
    assert torch.equal(out, torch.zeros_like(out))
    ids2, w2 = _routes(m, preset.num_experts, preset.top_k, seed=m + 5)
    ids2[:, 0] = int(layer.experts[0])
    _check(_run(backend, state, x, ids2, w2), reference_forward(layer, x, ids2, w2), "after")


def test_ids_out_of_range_are_not_owned(case, backend):
    """Ids >= num_experts (and -1) route nowhere, on both the table and the range lookups."""
    preset, layer, state = case
    m = 9
    ids, w = _routes(m, preset.num_experts, preset.top_k, seed=17)
    ids[:, 0] = int(layer.experts[0])
    ids[:, 1] = preset.num_experts + 3
    ids[::2, 2] = -1
    x = _x(m, preset.hidden_size, seed=18)
    _check(_run(backend, state, x, ids, w), reference_forward(layer, x, ids, w), "out of range")


@pytest.mark.parametrize("m", [1, 7, 152])
def test_gate_and_up_with_different_global_scales(case, backend, m):
    """gate and up of every expert scaled apart by weight_scale_2 (x 8 and x 1/16, and one
    expert's the other way round): a kernel that used one projection's scale for the other, or
    one expert's for another's, fails."""
    preset, layer, _state = case
    el = layer.num_local_experts
    gate_f = torch.full((el,), 8.0, device="cuda")
    up_f = torch.full((el,), 1.0 / 16, device="cuda")
    gate_f[0], up_f[0] = 1.0 / 16, 8.0
    gate, up = layer.gate, layer.up
    scaled = ShardLayer(
        layer.experts,
        layer.num_experts,
        Nvfp4Weight(gate.weight, gate.weight_scale, gate.weight_scale_2 * gate_f),
        Nvfp4Weight(up.weight, up.weight_scale, up.weight_scale_2 * up_f),
        layer.down,
        layer.norm_weight,
    )
    assert not torch.allclose(scaled.gate.weight_scale_2, scaled.up.weight_scale_2)
    state = backend.prepare(scaled)
    ids, w = _routes(m, preset.num_experts, preset.top_k, seed=m + 31)
    ids[:, 0] = int(layer.experts[0])
    ids[::2, 1] = int(layer.experts[-1])
    x = _x(m, preset.hidden_size, seed=m + 32)
    _check(
        _run(backend, state, x, ids, w),
        reference_forward(scaled, x, ids, w),
        f"{preset.name} M={m} gate/up scales",
    )


@pytest.mark.parametrize("m,top_k", [(1, 1), (5, 2), (3, 12), (300, 12), (600, 12)])
def test_other_top_k(case, backend, m, top_k):
    """top_k other than the preset's: 1 and 2 routes per token, and 12 (two batches of a
    token's routes in finalize, below and above the batched finalize's 512 tokens)."""
    preset, layer, state = case
    ids, w = _routes(m, preset.num_experts, top_k, seed=m + top_k)
    ids[:, 0] = int(layer.experts[0])
    ids[::2, top_k - 1] = int(layer.experts[-1])
    x = _x(m, preset.hidden_size, seed=m + 5)
    _check(
        _run(backend, state, x, ids, w),
        reference_forward(layer, x, ids, w),
        f"{preset.name} M={m} top-{top_k}",
    )


@pytest.mark.parametrize("m", [1, 3, 8, 40, 200])
def test_shard_of_more_than_32_experts(backend, m):
    """40 local experts: the routing kernel's general tables (a scan behind barriers) instead of
    the one-warp ones, and at M <= 8 no routing inside GEMM1 (the capped grid's loop kernels)."""
    preset = PRESETS["small"]
    layer = synthetic_layer(preset, seed=3, layer=1, experts=list(range(12, 52)), device="cuda")
    state = backend.prepare(layer)
    ids, w = _routes(m, preset.num_experts, preset.top_k, seed=m + 50)
    ids[:, 0] = int(layer.experts[m % 40])
    x = _x(m, preset.hidden_size, seed=m + 51)
    _check(_run(backend, state, x, ids, w), reference_forward(layer, x, ids, w), f"El=40 M={m}")


@pytest.mark.parametrize("m", [1, 37])
def test_unaligned_views(case, backend, m):
    """x and out as views that start 2 bytes into a buffer (not on the kernels' 16-byte chunks):
    the same bits as aligned tensors, and the context survives (a later call still runs)."""
    preset, _layer, state = case
    h = preset.hidden_size
    ids, w = _routes(m, preset.num_experts, preset.top_k, seed=m + 70)
    x = _x(m, h, seed=m + 71)
    want = _run(backend, state, x, ids, w)
    xbuf = torch.zeros(m * h + 1, dtype=torch.bfloat16, device="cuda")
    x_view = xbuf[1:].view(m, h)
    x_view.copy_(x)
    obuf = torch.full((m * h + 1,), float("nan"), dtype=torch.bfloat16, device="cuda")
    out_view = obuf[1:].view(m, h)
    assert x_view.data_ptr() % 16 and out_view.data_ptr() % 16
    backend.forward_into(state, x_view, ids, w, out_view)
    torch.cuda.synchronize()
    assert torch.equal(out_view, want), f"{preset.name} M {m}: unaligned views differ"
    assert torch.equal(_run(backend, state, x, ids, w), want)


def test_deterministic_and_int64_bf16_inputs_accepted(case, backend):
    preset, layer, state = case
    m = 50
    ids, w = _routes(m, preset.num_experts, preset.top_k, seed=5)
    x = torch.randn((m, preset.hidden_size), device="cuda").to(torch.bfloat16)
    a = _run(backend, state, x, ids, w)
    b = _run(backend, state, x, ids, w)
    assert torch.equal(a, b)
    c = backend.forward(state, x, ids.long(), w.to(torch.bfloat16))
    _check(c, reference_forward(layer, x, ids, w.to(torch.bfloat16).float()), "int64/bf16 in")


@pytest.mark.parametrize("m", [1, 3, 24, 300])
def test_cuda_graph_replay_matches_eager(case, backend, m):
    """A captured forward replays with new inputs and gives the eager call's bits."""
    from expertd.kernels.cuda import GraphedForward

    preset, layer, state = case
    graphed = GraphedForward(backend, state, m, preset.top_k)
    for seed in (1, 2):
        ids, w = _routes(m, preset.num_experts, preset.top_k, seed=seed + m)
        ids[:, 0] = int(layer.experts[seed % len(layer.experts)])
        x = _x(m, preset.hidden_size, seed=seed)
        got = graphed(x, ids, w).clone()
        torch.cuda.synchronize()
        assert torch.equal(got, _run(backend, state, x, ids, w))


def test_repack_on_gpu_equals_cpu(case):
    from expertd.kernels.repack import repack_down

    _, layer, _ = case
    sub = Nvfp4Weight(
        layer.down.weight[:2], layer.down.weight_scale[:2], layer.down.weight_scale_2[:2]
    )
    gpu = repack_down(sub)
    cpu = repack_down(sub.to("cpu"))
    assert torch.equal(gpu.codes.cpu(), cpu.codes) and torch.equal(gpu.scales.cpu(), cpu.scales)


def test_fp8_scales_spanning_their_range(backend):
    # Per-16-block magnitudes over e^-9..e^9 drive the fp8 scales from 448 down to subnormals
    # and zero; gate and up get global scales 1000x apart.
    h, i, e_local, num_experts, top_k = 512, 256, 4, 16, 4
    gen = torch.Generator().manual_seed(9)

    def proj(n, k, gain):
        w = torch.randn((e_local, n, k), generator=gen) * gain
        mag = torch.exp(torch.empty((e_local, n, k // 16, 1)).uniform_(-9, 9, generator=gen))
        return quantize((w.view(e_local, n, k // 16, 16) * mag).view(e_local, n, k)).to("cuda")

    gate, up, down = proj(i, h, 1e-3), proj(i, h, 1.0), proj(h, i, 0.05)
    fp8 = gate.weight_scale.float()
    assert fp8.max() == 448 and (fp8 == 0).any() and ((fp8 > 0) & (fp8 < 2**-6)).any()
    layer = ShardLayer(
        (1, 4, 9, 15),
        num_experts,
        gate,
        up,
        down,
        (torch.randn(h, generator=gen) * 0.1).to(torch.bfloat16).cuda(),
    )
    state = backend.prepare(layer)
    m = 200
    ids, w = _routes(m, num_experts, top_k, seed=3)
    x = torch.randn((m, h), device="cuda").to(torch.bfloat16)
    _check(_run(backend, state, x, ids, w), reference_forward(layer, x, ids, w), "fp8 range")
