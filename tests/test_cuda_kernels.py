"""GPU tests of the `cuda` backend against the float64 reference (docs/protocol.md).

Skipped without a CUDA device. Tolerance: relative Frobenius error <= 1e-2 (bf16 operands and
bf16 intermediates; measured errors are printed with -s).
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
M_SWEEP = (0, 1, 2, 3, 7, 16, 33, 64, 255, 1024, 4097)
# Local experts per preset: a shard of `small`, and 4 of muse-spark's 256 (fast to generate,
# and a realistic share of routes lands elsewhere).
LOCAL = {"small": list(range(8, 24)), "muse-spark": [3, 70, 128, 255]}


@pytest.fixture(scope="module")
def backend():
    from expertd.kernels.cuda import CudaBackend

    return CudaBackend("cuda")


@pytest.fixture(params=["6", "8"])
def path(request, monkeypatch):
    """Every GEMM path (moe_nvfp4.cu: v6 mma.sync, v8 wgmma; a forced path applies to the tile
    sizes it has, the others take the default)."""
    monkeypatch.setenv("EXPERTD_KERNEL_PATH", request.param)
    return int(request.param)


@pytest.fixture(scope="module", params=["small", "muse-spark"])
def case(request, backend):
    preset = PRESETS[request.param]
    layer = synthetic_layer(preset, seed=7, layer=0, experts=LOCAL[preset.name], device="cuda")
    return preset, layer, backend.prepare(layer)


def _busy_inputs(preset, layer, m: int, busy: int, expert: int, seed: int, x_seed: int):
    """m tokens of random routes whose first `busy` tokens send their first route to local
    expert `expert` (full and partial tiles of one busy expert), and their hidden states."""
    ids, w = _routes(m, preset.num_experts, preset.top_k, seed=seed)
    ids[:busy, 0] = int(layer.experts[expert])
    x = torch.randn((m, preset.hidden_size), generator=torch.Generator().manual_seed(x_seed))
    return x.to(torch.bfloat16).cuda(), ids, w


def _routes(m: int, e: int, top_k: int, seed: int, drop: float = 0.1):
    gen = torch.Generator().manual_seed(seed)
    ids = (
        torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(m)])
        if m
        else (torch.empty((0, top_k), dtype=torch.int64))
    )
    ids = ids.to(torch.int32)
    ids[torch.rand(ids.shape, generator=gen) < drop] = -1
    w = torch.rand((m, top_k), generator=gen, dtype=torch.float32)
    return ids.cuda(), w.cuda()


def _run(backend, state, x, ids, w, **kw):
    out = torch.full((x.shape[0], x.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    backend.forward_into(state, x, ids, w, out, **kw)
    torch.cuda.synchronize()
    return out


def _same_bits_under(monkeypatch, backend, state, inputs, var, base, other, what, calls=2, **kw):
    """The forward with kernel switch `var` at `other` equals the one at `base` bit for bit, on
    `calls` calls in a row; returns the last output."""
    x, ids, w = inputs
    monkeypatch.setenv(var, base)
    want = _run(backend, state, x, ids, w, **kw)
    monkeypatch.setenv(var, other)
    for _ in range(calls):
        got = _run(backend, state, x, ids, w, **kw)
        assert torch.equal(got, want), f"{what}: {var}={other} differs from {base}"
    return got


_REFS: dict = {}


def _reference(key, layer, x, ids, w):
    """float64 reference, cached per input set (the same inputs run under both paths)."""
    if key not in _REFS:
        _REFS[key] = reference_forward(layer, x, ids, w)
    return _REFS[key]


def _check(out, ref, what):
    assert torch.isfinite(out.float()).all(), f"{what}: non-finite output (unwritten or overflow)"
    err = relative_error(out, ref)
    print(f"{what}: rel err {err:.2e}")
    assert err <= TOL, f"{what}: relative error {err:.3e} > {TOL}"


@pytest.mark.parametrize("m", M_SWEEP)
def test_forward_matches_reference(case, backend, path, m):
    preset, layer, state = case
    ids, w = _routes(m, preset.num_experts, preset.top_k, seed=m)
    x = torch.randn((m, preset.hidden_size), generator=torch.Generator().manual_seed(m + 1))
    x = x.to(torch.bfloat16).cuda()
    out = _run(backend, state, x, ids, w)
    if m == 0:
        assert out.shape == (0, preset.hidden_size)
        return
    ref = _reference((preset.name, m), layer, x, ids, w)
    _check(out, ref, f"{preset.name} M={m} v{path}")


@pytest.mark.parametrize("m", [1, 37])
def test_unaligned_views(case, backend, m):
    """x and out as views that start 2 bytes into a buffer (not on the kernels' 16-byte chunks):
    the same bits as aligned tensors, and the context survives (a later call still runs)."""
    preset, _layer, state = case
    h = preset.hidden_size
    ids, w = _routes(m, preset.num_experts, preset.top_k, seed=m + 70)
    x = torch.randn((m, h), generator=torch.Generator().manual_seed(m + 71))
    x = x.to(torch.bfloat16).cuda()
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


@pytest.mark.parametrize(
    "path,bt",
    [(6, bt) for bt in (8, 16, 24, 32, 48, 64)]
    + [(8, bt) for bt in (16, 32, 48, 64, 96, 128, 144, 160)],
)
def test_every_compiled_tile_size(case, backend, monkeypatch, path, bt):
    # v6 for the mma.sync tiles, v8 for the wgmma ones
    monkeypatch.setenv("EXPERTD_KERNEL_PATH", str(path))
    preset, layer, state = case
    m = 97
    ids, w = _routes(m, preset.num_experts, preset.top_k, seed=11)
    x = torch.randn((m, preset.hidden_size), generator=torch.Generator().manual_seed(12))
    x = x.to(torch.bfloat16).cuda()
    _check(
        _run(backend, state, x, ids, w, bt=bt),
        _reference((preset.name, "bt"), layer, x, ids, w),
        f"{preset.name} bt={bt} v{path}",
    )


def test_all_routes_on_one_expert(case, backend, path):
    preset, layer, state = case
    m = 300
    ids = torch.full((m, preset.top_k), layer.experts[-1], dtype=torch.int32, device="cuda")
    w = torch.rand((m, preset.top_k), device="cuda")
    x = torch.randn((m, preset.hidden_size), device="cuda").to(torch.bfloat16)
    _check(
        _run(backend, state, x, ids, w),
        reference_forward(layer, x, ids, w),
        f"{preset.name} one expert",
    )


def test_no_owned_routes_gives_zeros(case, backend, path):
    preset, layer, state = case
    m = 37
    foreign = [e for e in range(preset.num_experts) if e not in layer.experts][: preset.top_k]
    ids = torch.tensor([foreign] * m, dtype=torch.int32, device="cuda")
    ids[::3, 0] = -1
    w = torch.rand((m, preset.top_k), device="cuda")
    x = torch.randn((m, preset.hidden_size), device="cuda").to(torch.bfloat16)
    out = _run(backend, state, x, ids, w)
    assert torch.equal(out, torch.zeros_like(out))


def test_path_switch(backend, path):
    from expertd.kernels.cuda import kernel_path

    assert kernel_path() == path
    # a forced path without a configuration for the BT gives the default: v8 has no BT 8
    assert kernel_path(64) == path
    assert kernel_path(8) == (6 if path == 8 else path)


def test_default_path_by_tile_size(backend, monkeypatch):
    from expertd.kernels.cuda import kernel_path

    # unset, or a value other than 6 / 8 (9 was the removed fused decode kernel's): the default
    for value in (None, "9", "x"):
        if value is None:
            monkeypatch.delenv("EXPERTD_KERNEL_PATH", raising=False)
        else:
            monkeypatch.setenv("EXPERTD_KERNEL_PATH", value)
        assert kernel_path() == 0  # nothing forced
        bts = (8, 16, 24, 32, 48, 64, 96, 128, 144, 160)
        assert [kernel_path(bt) for bt in bts] == [6, 8, 6, 8, 8, 8, 8, 8, 8, 8]


# Decode alternatives (moe_nvfp4.cu): id -> (tile size, GEMM1's and GEMM2's k per stage, the
# alternative whose bits it must reproduce: 7, 12, 13, 14 and 28 sum the k-groups of each warp in
# the table's order, 15 in 11's). The defaults where H and I are multiples of 512: 28 / 13 / 18 for
# BT 8 calls (<= 8 routes / < 128 / more), 12 for BT 16.
DECODE_ALTS = {
    6: (8, 512, 512, None),
    7: (8, 512, 512, 0),
    11: (8, 512, 512, None),
    12: (16, 512, 512, 0),
    13: (8, 512, 512, 0),
    14: (8, 512, 512, 0),
    15: (8, 512, 512, 11),
    18: (8, 256, 512, None),
    28: (8, 512, 512, 0),
}


@pytest.mark.parametrize("alt", sorted(DECODE_ALTS))
def test_decode_alternative(case, backend, monkeypatch, alt):
    """v6 decode alternatives: float64-close (6, 11: another fp32 sum order), bit-identical to
    the configuration they share their sum order with; presets whose H or I is not a multiple
    of the alternative's k-stage get a clear error."""
    preset, layer, state = case
    bt, bk1, bk2, same_as = DECODE_ALTS[alt]
    m = 5
    ids, w = _routes(m, preset.num_experts, preset.top_k, seed=91)
    ids[:, 0] = int(layer.experts[0])  # local routes: muse-spark's shard owns 4 of 256 experts
    ids[1:3, 1] = int(layer.experts[-1])
    x = torch.randn((m, preset.hidden_size), generator=torch.Generator().manual_seed(92))
    x = x.to(torch.bfloat16).cuda()
    monkeypatch.setenv("EXPERTD_KERNEL_PATH", "6")
    monkeypatch.setenv("EXPERTD_KERNEL_DECODE_ALT", str(alt))
    if preset.hidden_size % bk1 or preset.intermediate_size % bk2:
        with pytest.raises(RuntimeError, match="multiples of the GEMMs' k-stage"):
            _run(backend, state, x, ids, w, bt=bt)
        return
    got = _run(backend, state, x, ids, w, bt=bt)
    _check(got, reference_forward(layer, x, ids, w), f"{preset.name} v6 BT {bt} alt {alt}")
    if same_as is not None:
        monkeypatch.setenv("EXPERTD_KERNEL_DECODE_ALT", str(same_as))
        want = _run(backend, state, x, ids, w, bt=bt)
        assert torch.equal(got, want), f"{preset.name}: alt {alt} differs from alt {same_as}"


@pytest.mark.parametrize("bt", [16, 32, 48, 64, 96, 128, 144, 160])
def test_v8_ring_bit_identical_to_v8(case, backend, monkeypatch, bt):
    """v8 with the dequantization under the wgmmas (ring 3) computes the block-barrier ring's
    (2) sums: the same bits, at every tile size, tiles of several widths, repeated calls."""
    preset, layer, state = case
    x, ids, w = _busy_inputs(preset, layer, 150, 75, 0, seed=bt, x_seed=bt + 1)
    monkeypatch.setenv("EXPERTD_KERNEL_PATH", "8")
    what = f"{preset.name} BT {bt}"
    got = _same_bits_under(
        monkeypatch, backend, state, (x, ids, w), "EXPERTD_KERNEL_WG_RING", "2", "3", what, 3, bt=bt
    )
    _check(got, reference_forward(layer, x, ids, w), f"{preset.name} BT {bt} v8 ring 3")


@pytest.mark.parametrize(
    "bt,switch",
    [(16, "EXPERTD_KERNEL_WG_MIN_N=16"), (16, "EXPERTD_KERNEL_WG_FULLN=1")]
    + [(bt, "EXPERTD_KERNEL_WG_FULLN=1") for bt in (32, 48, 96)],
)
def test_v8_trimmed_width_bit_identical(case, backend, monkeypatch, bt, switch):
    """v8 tiles run wgmma N = their routes rounded up to 8 (BT 16), 16 (BT 32 and from 64) or
    32 (BT 48: N 32 or 48); N = 16 at least (EXPERTD_KERNEL_WG_MIN_N=16) or N = BT
    (EXPERTD_KERNEL_WG_FULLN=1) gives the same bits: the padding columns are separate sums.
    At BT 48 the busy expert gets 40 routes (a 48-wide tile beside the others' 32-wide ones)."""
    preset, layer, state = case
    busy = 40 if bt == 48 else 30
    x, ids, w = _busy_inputs(preset, layer, 90, busy, 2, seed=bt + 3, x_seed=bt + 4)
    monkeypatch.setenv("EXPERTD_KERNEL_PATH", "8")
    got = _run(backend, state, x, ids, w, bt=bt)
    name, _, value = switch.partition("=")
    monkeypatch.setenv(name, value)
    want = _run(backend, state, x, ids, w, bt=bt)
    assert torch.equal(got, want), f"{preset.name} BT {bt}: trimmed width differs ({switch})"
    _check(got, reference_forward(layer, x, ids, w), f"{preset.name} BT {bt} v8 trimmed")


@pytest.mark.parametrize("m,top_k", [(1, 8), (5, 8), (97, 8), (300, 12), (600, 8)])
def test_finalize_batched_bit_identical(case, backend, monkeypatch, m, top_k):
    """finalize loads a token's routes together (batches of 8) below 512 tokens; one after
    another (EXPERTD_KERNEL_FIN_SERIAL=1, and the default from 512) gives the same bits, with
    local routes in the second batch too."""
    preset, layer, state = case
    ids, w = _routes(m, preset.num_experts, top_k, seed=m + top_k)
    ids[:, 0] = int(layer.experts[0])
    ids[::2, top_k - 1] = int(layer.experts[-1])
    x = torch.randn((m, preset.hidden_size), generator=torch.Generator().manual_seed(m + 5))
    x = x.to(torch.bfloat16).cuda()
    got = _run(backend, state, x, ids, w)
    monkeypatch.setenv("EXPERTD_KERNEL_FIN_SERIAL", "1")
    want = _run(backend, state, x, ids, w)
    assert torch.equal(got, want), f"{preset.name} M {m} top-{top_k}: batched finalize differs"
    _check(got, reference_forward(layer, x, ids, w), f"{preset.name} M {m} top-{top_k} finalize")


@pytest.mark.parametrize("threads,m", [(1024, 1), (1024, 8), (256, 97), (256, 200)])
def test_route_threads_bit_identical(case, backend, monkeypatch, threads, m):
    """route_kernel on 256 threads (the default to 64 routes) or 1024 (above): the same bits
    either way (EXPERTD_KERNEL_ROUTE_THREADS forces one)."""
    preset, layer, state = case
    ids, w = _routes(m, preset.num_experts, 8, seed=m + 24)
    ids[:, 0] = int(layer.experts[0])
    ids[::2, 7] = int(layer.experts[-1])
    x = torch.randn((m, preset.hidden_size), generator=torch.Generator().manual_seed(m + 9))
    x = x.to(torch.bfloat16).cuda()
    want = _run(backend, state, x, ids, w)
    monkeypatch.setenv("EXPERTD_KERNEL_ROUTE_THREADS", str(threads))
    got = _run(backend, state, x, ids, w)
    assert torch.equal(got, want), f"{preset.name} M {m}: route_kernel on {threads} threads differs"


@pytest.mark.parametrize(
    "m,bt,threads", [(9, 8, ""), (64, 0, ""), (200, 0, "256"), (600, 0, ""), (1024, 160, "")]
)
def test_route_warp_tables_bit_identical(case, backend, monkeypatch, m, bt, threads):
    """route_kernel's barrier-free tables (every warp scans the counts in registers; the default
    for <= 32 local experts) against the general path (EXPERTD_KERNEL_ROUTE_WARP=0): the same
    bits, with a busy expert over several tiles and routes past the cached ones (M = 200 on 256
    threads, M = 600 on 1024)."""
    preset, layer, state = case
    ids, w = _routes(m, preset.num_experts, preset.top_k, seed=m + 41)
    ids[:, 0] = int(layer.experts[0])
    ids[::3, 2] = int(layer.experts[-1])
    x = torch.randn((m, preset.hidden_size), generator=torch.Generator().manual_seed(m + 3))
    x = x.to(torch.bfloat16).cuda()
    monkeypatch.setenv("EXPERTD_KERNEL_SELF_ROUTE", "0")  # route_kernel at M <= 8 too
    if threads:
        monkeypatch.setenv("EXPERTD_KERNEL_ROUTE_THREADS", threads)
    what = f"{preset.name} M {m} BT {bt}"
    got = _same_bits_under(
        monkeypatch, backend, state, (x, ids, w), "EXPERTD_KERNEL_ROUTE_WARP", "0", "1", what, bt=bt
    )
    _check(got, reference_forward(layer, x, ids, w), f"{preset.name} M {m} warp tables")


@pytest.mark.parametrize(
    "m,f,gemms", [(100, "1", "3"), (100, "2", "2"), (160, "2", "1"), (130, "", "")]
)
def test_one_tile_rows_bit_identical(case, backend, monkeypatch, m, f, gemms):
    """The one-tile v6 grids on R < t_max rows (moe_gemm_kernel<..., OVF>: tiles past R run on
    the rows' blocks in turn) against every tile on a row of its own (EXPERTD_KERNEL_OVF=0): the
    same bits, with most routes local so that the call has more tiles than R (the loop runs)."""
    preset, layer, state = case
    ids, w = _routes(m, preset.num_experts, preset.top_k, seed=m + 5)
    ids = ids.cpu()
    gen = torch.Generator().manual_seed(m)
    local = [int(e) for e in layer.experts]
    for t in range(m):  # up to 4 local routes per token, each token's ids kept distinct
        ids[t, :4] = -1
        for j, e in enumerate(torch.randperm(len(local), generator=gen)[:4].tolist()):
            if local[e] not in ids[t].tolist():
                ids[t, j] = local[e]
    ids = ids.cuda()
    x = torch.randn((m, preset.hidden_size), generator=torch.Generator().manual_seed(m + 9))
    x = x.to(torch.bfloat16).cuda()
    if gemms:
        monkeypatch.setenv("EXPERTD_KERNEL_OVF_GEMMS", gemms)
    what = f"{preset.name} M {m} OVF {f or 'default'} GEMMs {gemms or 'default'}"
    got = _same_bits_under(
        monkeypatch, backend, state, (x, ids, w), "EXPERTD_KERNEL_OVF", "0", f, what, bt=8
    )
    _check(got, reference_forward(layer, x, ids, w), what)


@pytest.mark.parametrize("bt", [8, 32, 96, 160])
def test_route_balance_bit_identical(case, backend, monkeypatch, bt):
    """Tiles filled in order (the default) or round-robin (EXPERTD_KERNEL_ROUTE_BALANCE=1): the
    same bits, with a busy expert spread over several tiles of several widths."""
    preset, layer, state = case
    # 350 routes on one expert: 3 tiles at BT 160, 44 at BT 8
    x, ids, w = _busy_inputs(preset, layer, 400, 350, 1, seed=bt + 7, x_seed=bt)
    monkeypatch.setenv("EXPERTD_KERNEL_ROUTE_BALANCE", "0")
    want = _run(backend, state, x, ids, w, bt=bt)
    monkeypatch.setenv("EXPERTD_KERNEL_ROUTE_BALANCE", "1")
    got = _run(backend, state, x, ids, w, bt=bt)
    assert torch.equal(got, want), f"{preset.name} BT {bt}: balanced tiles differ"
    _check(got, reference_forward(layer, x, ids, w), f"{preset.name} BT {bt} balanced")


@pytest.mark.parametrize("m,bt", [(1, 0), (97, 8), (97, 32), (1024, 0), (4097, 0), (4097, 160)])
def test_route_multiblock_bit_identical(case, backend, monkeypatch, m, bt):
    """Routing by route_count_kernel + route_scatter_kernel (chunks of 4096 routes; forced for
    every call with EXPERTD_KERNEL_ROUTE_MULTI=1) computes route_kernel's bits."""
    preset, _layer, state = case
    ids, w = _routes(m, preset.num_experts, preset.top_k, seed=m + bt)
    x = torch.randn((m, preset.hidden_size), generator=torch.Generator().manual_seed(m))
    x = x.to(torch.bfloat16).cuda()
    monkeypatch.setenv("EXPERTD_KERNEL_ROUTE_MULTI", "0")
    want = _run(backend, state, x, ids, w, bt=bt)
    monkeypatch.setenv("EXPERTD_KERNEL_ROUTE_MULTI", "1")
    for _ in range(2):
        got = _run(backend, state, x, ids, w, bt=bt)
        assert torch.equal(got, want), f"{preset.name} M={m} BT {bt}: multi-block routing differs"


@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_self_route_bit_identical(case, backend, monkeypatch, m):
    """Calls of <= 64 routes on <= 32 local experts: GEMM1 routes the call itself (no route_kernel;
    EXPERTD_KERNEL_SELF_ROUTE=0 launches it) and computes the same bits, with a busy expert, one
    expert taking two routes of a token (more than BT = 8 routes at M = 8: two tiles), ids that
    are -1 or out of range, and a call with no local route between two calls that have some."""
    preset, layer, state = case
    ids, w = _routes(m, preset.num_experts, preset.top_k, seed=m + 41)
    ids[:, 0] = int(layer.experts[0])
    ids[:, 1] = int(layer.experts[0])  # the same expert twice in a token: 2 M routes on it
    ids[0, 2] = int(layer.experts[-1])
    ids[-1, 3] = preset.num_experts + 5  # out of range: not local
    x = torch.randn((m, preset.hidden_size), generator=torch.Generator().manual_seed(m + 3))
    x = x.to(torch.bfloat16).cuda()
    foreign = torch.tensor(
        [[e for e in range(preset.num_experts) if e not in set(layer.experts)][: preset.top_k]] * m,
        dtype=torch.int32,
        device="cuda",
    )
    monkeypatch.setenv("EXPERTD_KERNEL_SELF_ROUTE", "0")
    want = _run(backend, state, x, ids, w)
    assert not _run(backend, state, x, foreign, w).any()
    monkeypatch.delenv("EXPERTD_KERNEL_SELF_ROUTE")
    for _ in range(2):
        got = _run(backend, state, x, ids, w)
        assert torch.equal(got, want), f"{preset.name} M={m}: self-routed GEMM1 differs"
        assert not _run(backend, state, x, foreign, w).any(), "no local route must give zeros"
    _check(got, reference_forward(layer, x, ids, w), f"{preset.name} M {m} self-routed")


@pytest.mark.parametrize("rows", [1, 2, 6])
def test_v6_capped_grid_rows_bit_identical(case, backend, monkeypatch, rows):
    """v6 grids of fewer rows than tiles (EXPERTD_KERNEL_GRID_ROWS; by default 2 at <= 64
    routes: blocks loop over tiles) compute the same bits as one row per possible tile."""
    preset, layer, state = case
    for m, bt in ((1, 8), (3, 8), (40, 8), (40, 24)):
        ids, w = _routes(m, preset.num_experts, preset.top_k, seed=m + bt)
        ids[: m // 2, 0] = int(layer.experts[0])  # several tiles, one expert with a few
        x = torch.randn((m, preset.hidden_size), generator=torch.Generator().manual_seed(m))
        x = x.to(torch.bfloat16).cuda()
        monkeypatch.setenv("EXPERTD_KERNEL_GRID_ROWS", "0")  # one row per possible tile
        want = _run(backend, state, x, ids, w, bt=bt)
        monkeypatch.setenv("EXPERTD_KERNEL_GRID_ROWS", str(rows))
        got = _run(backend, state, x, ids, w, bt=bt)
        assert torch.equal(got, want), f"{preset.name} M={m} BT {bt}: {rows} grid rows differ"


def test_gate_and_up_global_scales_differ(case):
    _, layer, _ = case
    assert not torch.allclose(layer.gate.weight_scale_2, layer.up.weight_scale_2)


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


def test_cuda_graph_replay_matches_eager(case, backend, path):
    from expertd.kernels.cuda import GraphedForward

    preset, _, state = case
    m = 24
    graphed = GraphedForward(backend, state, m, preset.top_k)
    for seed in (1, 2):
        ids, w = _routes(m, preset.num_experts, preset.top_k, seed=seed)
        x = torch.randn((m, preset.hidden_size), device="cuda").to(torch.bfloat16)
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


@pytest.mark.parametrize("m", [2, 3, 8])
def test_gemm2_spread_bit_identical(case, backend, monkeypatch, m):
    """GEMM2 of a self-routed call above 8 routes spreads its items over the SMs (per-SM slot
    counters): the same bits as the (n-blocks, rows) grid (EXPERTD_KERNEL_G2_PER_SM=-1), with 1
    or 2 blocks per SM (padded shared memory), and when every block takes its place by the
    fallback scan (EXPERTD_KERNEL_SPREAD_SCAN=1), twice in a row (the counters are reset by each
    call's GEMM1)."""
    preset, layer, state = case
    ids, w = _routes(m, preset.num_experts, preset.top_k, seed=m + 61)
    ids[:, 0] = int(layer.experts[0])
    ids[0, 1] = int(layer.experts[-1])
    x = torch.randn((m, preset.hidden_size), generator=torch.Generator().manual_seed(m + 13))
    x = x.to(torch.bfloat16).cuda()
    monkeypatch.setenv("EXPERTD_KERNEL_G2_PER_SM", "-1")
    want = _run(backend, state, x, ids, w)
    for per_sm, scan in (("", "0"), ("1", "0"), ("2", "0"), ("", "1"), ("2", "1")):
        if per_sm:
            monkeypatch.setenv("EXPERTD_KERNEL_G2_PER_SM", per_sm)
        else:
            monkeypatch.delenv("EXPERTD_KERNEL_G2_PER_SM")
        monkeypatch.setenv("EXPERTD_KERNEL_SPREAD_SCAN", scan)
        for _ in range(2):
            got = _run(backend, state, x, ids, w)
            assert torch.equal(got, want), f"{preset.name} M={m} per_sm={per_sm!r} scan={scan}"
    _check(got, reference_forward(layer, x, ids, w), f"{preset.name} M {m} spread GEMM2")
