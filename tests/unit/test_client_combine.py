"""The client's per-call tensor work on the host (client/core.py): the sum of the shards'
answers and each shard's rows, both in numpy, open no OpenMP region (torch's index_add_
and indexing do, where a busy process's loop thread waits), and must give torch's bits
exactly: the reference is zeros + index_add_ in float32 in shard order, then
.to(bfloat16)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from expertd import codec, wire
from expertd.client import core
from expertd.client.core import Inputs, Piece, combine, forward_request
from expertd.client.routing import ShardPart
from expertd.v1 import expertd_pb2 as pb

# bf16 bit patterns: -0, +0, +-inf, quiet and signalling NaNs of both signs, the least
# subnormals, the largest finite values
SPECIAL = np.array(
    [0x8000, 0x0000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001, 0x8001, 0x7F7F, 0xFF7F],
    dtype=np.uint16,
)


def set_block(monkeypatch, rows_elements: int | None) -> None:
    """Blocks of output rows this many elements long."""
    if rows_elements is not None:
        monkeypatch.setattr(core, "COMBINE_BLOCK_ELEMENTS", rows_elements)


@pytest.fixture(params=["small", "blocked"])
def sum_path(request, monkeypatch):
    """Each sum test runs through both of combine's paths (whole arrays for small calls,
    blocks of rows otherwise), whatever its size."""
    monkeypatch.setattr(core, "SMALL_SUM_ELEMENTS", 1 << 40 if request.param == "small" else 0)
    return request.param


def reference(m: int, h: int, pieces: list[Piece]) -> torch.Tensor:
    total = torch.zeros((m, h), dtype=torch.float32)
    for p in sorted(pieces, key=lambda p: p.shard):
        total.index_add_(0, p.tokens, wire.decode(p.output, "output").float())
    return total.to(torch.bfloat16)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bits; NaN elements by NaN-ness (torch's conversion writes more than one NaN)."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    g, w = got.view(torch.int16)[~nan], want.view(torch.int16)[~nan]
    bad = (g != w).nonzero()
    assert bad.numel() == 0, f"{bad.numel()} elements differ, first {g[bad[0]]} != {w[bad[0]]}"


def inputs_for(m: int, h: int) -> Inputs:
    x = torch.from_numpy(np.zeros((m, h), np.int16)).view(torch.bfloat16)  # no torch kernel
    ids = torch.from_numpy(np.zeros((m, 1), np.int32))
    return Inputs(x, ids, torch.from_numpy(np.ones((m, 1), np.float32)), x.device)


def make_pieces(m, h, shards, seed, keep=0.67, special=0.0, full=(), empty=()):
    """Answers with ~`keep` of the rows each and values over a wide range (so that another
    order of the additions shows in the bits); `special` of the elements from SPECIAL."""
    rng = np.random.default_rng(seed)
    pieces = []
    for s in range(shards):
        if s in full:
            tokens = np.arange(m)
        elif s in empty:
            tokens = np.arange(0)
        else:
            tokens = np.flatnonzero(rng.random(m) < keep)
        scale = 2.0 ** rng.integers(-20, 21, (tokens.size, 1))
        vals = (rng.standard_normal((tokens.size, h)) * scale).astype(np.float32)
        bits = (vals.view(np.uint32) >> 16).astype(np.uint16)  # numpy: no torch thread starts
        pick = rng.random(bits.shape) < special
        bits[pick] = rng.choice(SPECIAL, int(pick.sum()))
        out = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
        pieces.append(Piece(s, torch.from_numpy(tokens.astype(np.int64)), wire.encode(out)))
    return pieces


@pytest.mark.parametrize(
    "m,h,block",
    [
        (1, 512, None),
        (7, 512, None),
        (64, 4096, None),  # one block of 64 rows
        (65, 4096, None),  # two: 64 + 1
        (300, 1000, None),  # 262 + 38
        (37, 96, 96 * 5),  # blocks of 5 rows
        (9, 33, 1),  # one row a block, odd width
    ],
)
def test_combine_gives_index_adds_bits(sum_path, monkeypatch, m, h, block):
    set_block(monkeypatch, block)
    pieces = make_pieces(m, h, 8, seed=m * h)
    want = reference(m, h, pieces)
    # any arrival order: summed in shard order
    assert_same(combine(inputs_for(m, h), h, list(reversed(pieces))), want)


@pytest.mark.parametrize("block", [None, 2 * 256])
def test_combine_nan_inf_zeros_and_subnormals(sum_path, monkeypatch, block):
    set_block(monkeypatch, block)
    m, h = 40, 256
    pieces = make_pieces(m, h, 8, seed=3, special=0.05)
    # rows whose every addend is -0.0 (index_add_ from zeros gives +0.0), rows of NaN, of
    # +inf meeting -inf, and of values that overflow float32 only when summed
    for i, p in enumerate(pieces):
        bits = wire.decode(p.output, "output").view(torch.int16).numpy().view(np.uint16).copy()
        rows = p.tokens.numpy()
        bits[rows % 5 == 0] = 0x8000
        bits[rows % 7 == 1, :3] = 0x7FC0
        bits[rows % 11 == 2, 3:6] = 0x7F80 if p.shard % 2 else 0xFF80
        bits[rows % 13 == 3, 6:9] = 0x7F7F
        out = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
        pieces[i] = Piece(p.shard, p.tokens, wire.encode(out))
    want = reference(m, h, pieces)
    assert (want.view(torch.int16) == 0).any() and torch.isnan(want).any()
    assert torch.isinf(want).any()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow and invalid warnings included
        got = combine(inputs_for(m, h), h, pieces)
    assert_same(got, want)
    assert not (got.view(torch.int16) == -0x8000).any()


@pytest.mark.parametrize("block", [None, 3 * 64])
def test_combine_empty_full_and_missing(sum_path, monkeypatch, block):
    set_block(monkeypatch, block)
    m, h = 20, 64
    cases = [
        make_pieces(m, h, 6, seed=4, full=(2,), empty=(0, 5)),  # one answer holds every row
        make_pieces(m, h, 4, seed=5, full=(0, 1, 2, 3)),  # every answer holds every row
        make_pieces(m, h, 3, seed=6, keep=0.2),  # rows no answer holds: zeros
        make_pieces(m, h, 1, seed=7, full=(0,)),
        make_pieces(m, h, 1, seed=9, full=(0,), special=0.3),  # -0, NaN, inf in the only one
        make_pieces(m, h, 3, seed=8, empty=(0, 1, 2)),
        [],
    ]
    for pieces in cases:
        assert_same(combine(inputs_for(m, h), h, pieces), reference(m, h, pieces))
    assert_same(combine(inputs_for(0, h), h, []), torch.zeros((0, h), dtype=torch.bfloat16))


def test_combine_reuses_its_buffers_cleanly():
    """Calls of other sizes in between leave nothing behind in the per-thread buffers."""
    calls = [(64, 512, 9), (3, 512, 10), (200, 700, 11), (64, 512, 12), (5, 512, 13)]
    for m, h, seed in calls:
        pieces = make_pieces(m, h, 8, seed, keep=0.3 + 0.1 * (seed % 5))
        assert_same(combine(inputs_for(m, h), h, pieces), reference(m, h, pieces))


def test_combine_reads_parsed_responses_at_any_alignment():
    """The client's answers are views into received bytes, at whatever offset the header
    leaves (odd ones too)."""
    m, h = 16, 128
    rng = np.random.default_rng(14)
    pieces, plain = [], []
    for s, request_id in enumerate([1, 300, 70_000, 1 << 30, 1 << 50]):
        tokens = np.flatnonzero(rng.random(m) < 0.6)
        out = torch.from_numpy(rng.standard_normal((tokens.size, h), dtype=np.float32))
        out = out.to(torch.bfloat16)
        raw = codec.encode_forward_response(
            request_id, pb.BF16, tuple(out.shape), out.view(torch.int16).numpy().tobytes(), None
        )
        t = torch.from_numpy(tokens)
        pieces.append(Piece(s, t, codec.parse_forward_response(raw).output))
        plain.append(Piece(s, t, wire.encode(out)))
    assert_same(combine(inputs_for(m, h), h, pieces), reference(m, h, plain))


def test_combine_refuses_malformed_answers(sum_path):
    m, h = 4, 512
    pieces = make_pieces(m, h, 2, seed=1, full=(0,))
    inputs = inputs_for(m, h)
    bad = Piece(9, pieces[0].tokens, wire.encode(torch.zeros((1, 3), dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="expected"):
        combine(inputs, h, [*pieces, bad])
    short = pb.Tensor(dtype=pb.BF16, shape=[m, h], data=b"\0" * (m * h * 2 - 2))
    with pytest.raises(wire.WireError, match="output"):
        combine(inputs, h, [Piece(9, pieces[0].tokens, short)])
    fp32 = wire.encode(torch.zeros((m, h), dtype=torch.float32))
    with pytest.raises(ValueError, match="bfloat16"):
        combine(inputs, h, [Piece(9, pieces[0].tokens, fp32)])
    unsorted = torch.tensor([2, 1])
    rows = wire.encode(torch.zeros((2, h), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="ascending"):
        combine(inputs, h, [Piece(0, unsorted, rows)])


@pytest.mark.parametrize("m,h", [(1, 512), (7, 512), (64, 4096), (300, 1000)])
def test_forward_request_rows_are_torchs(m, h):
    x = torch.from_numpy(np.random.default_rng(m).standard_normal((m, h), dtype=np.float32))
    inputs = Inputs(x.to(torch.bfloat16), torch.zeros((m, 1), dtype=torch.int32), x, x.device)
    for tokens in (torch.arange(m), torch.arange(0, m, 3), torch.arange(0)):
        part = ShardPart(0, tokens, torch.zeros((1, 1), dtype=torch.int32), torch.ones(1, 1))
        rows = forward_request(0, inputs, part).hidden_states
        assert rows.dtype == torch.bfloat16 and rows.shape == (tokens.numel(), h)
        assert torch.equal(rows.view(torch.int16), inputs.x[tokens].view(torch.int16))


PROBE = textwrap.dedent(
    """
    import os, sys
    import numpy as np, torch
    sys.path.insert(0, {tests!r})
    from test_client_combine import inputs_for, make_pieces
    from expertd.client.core import Inputs, combine, forward_request
    from expertd.client.routing import ShardPart

    def threads():
        return len(os.listdir("/proc/self/task"))

    m, h = 1024, 4096  # 16 blocks, 1024 rounding pieces
    pieces = make_pieces(m, h, 8, seed=0)
    inputs = inputs_for(m, h)
    parts = [
        ShardPart(p.shard, p.tokens, torch.zeros((1, 1), dtype=torch.int32), inputs.weights)
        for p in pieces
    ]
    before = threads()
    combine(inputs, h, pieces)
    for part in parts:
        forward_request(0, inputs, part)
    after = threads()
    {control}
    print(before, after, threads())
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_combine_and_gather_open_no_openmp_region(tmp_path):
    """libgomp starts its workers at the first parallel region: in a fresh process, none
    may appear through combine and forward_request. The control (index_add_ of one
    4096-wide row, as a torch sum would run) shows that the count does move."""
    tests = str(Path(__file__).parent)
    control = "torch.zeros(2, 4096).index_add_(0, torch.tensor([1]), torch.ones(1, 4096))"
    script = tmp_path / "probe.py"
    script.write_text(PROBE.format(tests=tests, control=control))
    env = {**os.environ, "OMP_NUM_THREADS": "4"}  # a region starts workers on any machine
    res = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    before, after, with_control = map(int, res.stdout.split())
    assert after == before, res.stdout
    assert with_control > after, res.stdout
