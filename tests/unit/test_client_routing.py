"""Routing, exhaustively on random cases: every owned route goes to exactly one
shard that owns its expert, with its weight, in its original order; nothing else
is sent; unowned experts are reported."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from expertd.client import routing
from expertd.client.routing import RouteTable, assign_owners, missing_experts, split_routes


@st.composite
def cases(draw):
    e = draw(st.integers(1, 24))
    s = draw(st.integers(1, 5))
    cand = torch.tensor(
        draw(st.lists(st.lists(st.booleans(), min_size=e, max_size=e), min_size=s, max_size=s))
    )
    candidates = torch.cat((cand, torch.zeros((s, 1), dtype=torch.bool)), dim=1)  # [S, E + 1]
    m = draw(st.integers(0, 12))
    k = draw(st.integers(1, 6))
    ids = torch.tensor(
        draw(
            st.lists(
                st.lists(st.integers(-1, e - 1), min_size=k, max_size=k), min_size=m, max_size=m
            )
        ),
        dtype=torch.int32,
    ).reshape(m, k)
    weights = torch.rand((m, k), generator=torch.Generator().manual_seed(m * 31 + k))
    return candidates, ids, weights, draw(st.integers(0, 9))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(cases())
def test_every_owned_route_once_to_an_owner(case):
    candidates, ids, weights, turn = case
    owner = assign_owners(candidates, ids, turn)
    e = candidates.shape[1] - 1
    assert owner.shape == (e + 1,) and owner[-1] == -1
    for x in range(e):  # an owner is a candidate; no candidate, no owner
        assert (owner[x] == -1) == (not candidates[:, x].any())
        if owner[x] >= 0:
            assert candidates[owner[x], x]
    parts = split_routes(owner, ids, weights)
    sent = {}
    for p in parts:
        assert p.topk_ids.dtype == torch.int32 and p.topk_weights.dtype == torch.float32
        assert p.topk_ids.shape == p.topk_weights.shape == (p.tokens.numel(), p.topk_ids.shape[1])
        for row, t in enumerate(p.tokens.tolist()):
            got = [
                (int(i), float(w))
                for i, w in zip(p.topk_ids[row], p.topk_weights[row], strict=True)
                if i >= 0
            ]
            assert got, "a token is sent only with at least one route"
            assert all(owner[i] == p.shard for i, _ in got)
            assert (p.topk_weights[row][p.topk_ids[row] < 0] == 0).all()
            sent[(t, p.shard)] = got
    for t in range(ids.shape[0]):  # exactly the owned routes, in their order, per shard
        for shard in range(candidates.shape[0]):
            want = [
                (int(i), float(w))
                for i, w in zip(ids[t], weights[t], strict=True)
                if i >= 0 and owner[i] == shard
            ]
            assert sent.get((t, shard), []) == want
    lost = sorted({int(i) for i in ids.flatten() if i >= 0 and owner[i] < 0})
    assert missing_experts(owner, ids) == lost


def same_parts(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shard == w.shard and g.experts == w.experts
        for a, b in ((g.tokens, w.tokens), (g.topk_ids, w.topk_ids)):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert g.topk_weights.dtype == w.topk_weights.dtype
        assert torch.equal(g.topk_weights, w.topk_weights)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(cases())
def test_small_calls_split_as_the_numpy_path_does(case):
    """A few routes are split over lists (RouteTable.route below SMALL_ROUTES): the same
    parts, in the same order and dtypes, and the same lost experts as the numpy path."""
    candidates, ids, weights, turn = case
    owner = assign_owners(candidates, ids, turn)
    want = split_routes(owner, ids, weights), missing_experts(owner, ids)
    parts, lost = routing._split_small(owner.tolist(), ids.tolist(), weights.tolist())
    same_parts(parts, want[0])
    assert lost == want[1]
    table = RouteTable(candidates)
    if table.fixed is not None:  # no redundant expert: the owners do not depend on the call
        assert torch.equal(table.fixed, owner)
    for small in (0, 10**6):  # both paths of route
        routing.SMALL_ROUTES, saved = small, routing.SMALL_ROUTES
        try:
            parts, lost = table.route(ids, weights, turn)
        finally:
            routing.SMALL_ROUTES = saved
        same_parts(parts, want[0])
        assert lost == want[1]


def test_redundant_experts_are_balanced():
    candidates = torch.zeros((2, 5), dtype=torch.bool)
    candidates[:, :4] = True  # both shards own experts 0-3
    ids = torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3]], dtype=torch.int32)
    owner = assign_owners(candidates, ids)
    per_shard = [sum(int((ids == x).sum()) for x in range(4) if owner[x] == s) for s in (0, 1)]
    assert per_shard == [4, 4]


def test_large_calls_split_as_the_plain_python_path_does():
    """split_routes' one-pass grouping on calls far larger than the property cases
    (up to 8 shards, some experts on several shards or none, padded routes, one
    shard holding everything): the same parts as the plain-Python split."""
    gen = np.random.default_rng(5)
    for trial in range(60):
        s = int(gen.integers(1, 9))
        e = int(gen.integers(8, 65))
        m = int(gen.integers(1, 700))
        k = int(gen.integers(1, 9))
        cand = gen.random((s, e)) < (1.0 if trial % 5 == 0 else 1.5 / s)
        candidates = torch.from_numpy(np.concatenate((cand, np.zeros((s, 1), bool)), axis=1))
        ids = torch.from_numpy(gen.integers(-1, e, size=(m, k)).astype(np.int32))
        weights = torch.from_numpy(gen.random((m, k)).astype(np.float32))
        owner = assign_owners(candidates, ids, trial)
        want, lost = routing._split_small(owner.tolist(), ids.tolist(), weights.tolist())
        same_parts(split_routes(owner, ids, weights), want)
        assert missing_experts(owner, ids) == lost


def test_one_shard_owning_every_expert_gets_the_call_as_it_is():
    """With one shard owning every expert and no padded route, route hands over the
    caller's ids and weights unchanged (no split); with a padded route it splits. The
    parts are the plain-Python split's either way."""
    gen = np.random.default_rng(11)
    e, k = 32, 8
    candidates = torch.zeros((3, e + 1), dtype=torch.bool)
    candidates[1, :e] = True  # shard 1 of 3 owns everything
    table = RouteTable(candidates)
    for m, padded in ((300, False), (300, True), (17, False)):
        ids = torch.from_numpy(gen.integers(0, e, size=(m, k)).astype(np.int32))
        if padded:
            ids[5, 3] = -1
        weights = torch.from_numpy(gen.random((m, k)).astype(np.float32))
        parts, lost = table.route(ids, weights)
        want, want_lost = routing._split_small(table.fixed.tolist(), ids.tolist(), weights.tolist())
        same_parts(parts, want)
        assert lost == want_lost == []
        assert parts[0].shard == 1
        if m * k > routing.SMALL_ROUTES and not padded:
            assert parts[0].topk_ids is ids and parts[0].topk_weights is weights
