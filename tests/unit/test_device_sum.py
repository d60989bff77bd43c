"""The partial sum where the caller's tensors live (client/devsum.py): answers staged
as they arrive, in any order, summed in shard order, must give the host sum's bits
(zeros + index_add_ in float32 in shard order, then .to(bfloat16)). Run on the CPU
here; the same checks on a GPU are marked `cuda`."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_client_combine import assert_same, inputs_for, make_pieces, reference

from expertd import wire
from expertd.client import devsum
from expertd.client.core import Piece, combine
from expertd.client.devsum import DeviceSum

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def device_sum(m, h, pieces, device, rows=None, seed=0):
    """Stage the pieces in a shuffled order (as answers arrive), finish in call order."""
    rows = sum(p.tokens.numel() for p in pieces) if rows is None else rows
    sums = DeviceSum(m, h, torch.device(device), rows)
    for piece in random.Random(seed).sample(pieces, len(pieces)):
        sums.stage(piece)
    out = sums.finish(pieces)
    assert out.device.type == device and out.dtype == torch.bfloat16
    return out.cpu()


def param_devices(fn):
    marks = [pytest.param(d, marks=pytest.mark.cuda) if d == "cuda" else d for d in DEVICES]
    return pytest.mark.parametrize("device", marks)(fn)


@param_devices
@pytest.mark.parametrize("m,h,shards", [(1, 512, 8), (7, 512, 8), (65, 4096, 8), (300, 96, 3)])
def test_device_sum_gives_the_host_sums_bits(device, m, h, shards):
    pieces = make_pieces(m, h, shards, seed=m + h)
    want = reference(m, h, pieces)
    assert_same(device_sum(m, h, pieces, device, seed=m), want)
    assert_same(combine(inputs_for(m, h), h, pieces), want)


@param_devices
def test_device_sum_special_values_full_empty_and_missing_rows(device):
    m, h = 20, 64
    cases = [
        make_pieces(m, h, 6, seed=4, full=(2,), empty=(0, 5), special=0.05),
        make_pieces(m, h, 4, seed=5, full=(0, 1, 2, 3)),  # every answer holds every row
        make_pieces(m, h, 3, seed=6, keep=0.2),  # rows no answer holds: zeros
        make_pieces(m, h, 3, seed=8, empty=(0, 1, 2)),
        [],
    ]
    for pieces in cases:
        assert_same(device_sum(m, h, pieces, device), reference(m, h, pieces))


@param_devices
def test_device_sum_two_answers_of_one_shard_keep_the_call_order(device):
    """Routes moved off a shard with no replica left come back as a second piece of
    another shard: its additions follow the call's order, as the host sum's do."""
    m, h = 16, 32
    pieces = make_pieces(m, h, 3, seed=21)
    moved = make_pieces(m, h, 3, seed=22)[1]
    pieces = [pieces[0], pieces[1], Piece(1, moved.tokens, moved.output), pieces[2]]
    assert_same(device_sum(m, h, pieces, device), reference(m, h, pieces))


@param_devices
def test_device_sum_more_rows_than_foreseen_and_buffers_reused(device):
    """An answer that does not fit the pinned buffer gets its own; buffers go back to the
    pool and a later call of another size finds nothing of the earlier one."""
    for m, h, seed, rows in [(64, 512, 9, 1), (3, 512, 10, None), (200, 96, 11, 0)]:
        pieces = make_pieces(m, h, 8, seed, keep=0.5)
        assert_same(device_sum(m, h, pieces, device, rows=rows), reference(m, h, pieces))
    assert 0 < len(devsum._POOL._free) <= devsum._PinnedPool.KEEP


@param_devices
def test_device_sum_reads_slot_answers_and_refuses_malformed_ones(device):
    m, h = 8, 32
    pieces = make_pieces(m, h, 2, seed=30)
    slot_like = [  # a slot's output region: bf16 bits uint16 [rows, H]
        Piece(p.shard, p.tokens, np.frombuffer(p.output.data, np.uint16).reshape(-1, h))
        for p in pieces
    ]
    assert_same(device_sum(m, h, slot_like, device), reference(m, h, pieces))
    bad = Piece(0, pieces[0].tokens, wire.encode(torch.zeros((1, h), dtype=torch.bfloat16)))
    sums = DeviceSum(m, h, torch.device(device), m)
    with pytest.raises(ValueError, match="shape"):
        sums.stage(bad)
    sums.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("m", [1, 64, 333])
def test_device_sum_of_one_answer_already_on_the_gpu_gives_the_host_bits(m):
    """A cuda-ipc slot's answer holding every row is summed in one kernel (0.0 + it,
    rounded back): -0, NaN payloads and infinities come out as the host sum writes them."""
    h = 512
    piece = make_pieces(m, h, 1, seed=40 + m, full=(0,), special=0.1)[0]
    host = np.frombuffer(piece.output.data, np.uint16).reshape(m, h).copy()
    on_gpu = torch.from_numpy(host.view(np.int16)).view(torch.bfloat16).cuda()
    got = device_sum(m, h, [Piece(0, piece.tokens, on_gpu)], "cuda")
    assert_same(got, reference(m, h, [piece]))
