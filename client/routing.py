"""Routing: which shard owns which expert, and what each shard is sent.

A *shard* here is a set of replicas: the addresses whose Describe names the
same experts and layers. An expert may also be owned by several shards (a
redundant expert); each call then gives each such expert to exactly one of its
live owners, the least loaded one by routes in that call.

Shape legend: M tokens, K top_k, E experts, S shards, Ms / Ks a shard's share.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from expertd.v1 import expertd_pb2 as pb


@dataclass(frozen=True, slots=True)
class Shard:
    experts: tuple[int, ...]
    layers: frozenset[int]
    addresses: tuple[str, ...]  # its replicas, in the order they were given


@dataclass(frozen=True, slots=True)
class Topology:
    """The model shape the servers agree on, and who owns what (a snapshot)."""

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    shards: tuple[Shard, ...]

    @classmethod
    def from_describe(cls, answers: dict[str, pb.DescribeResponse]) -> Topology:
        """Group the answers (address -> Describe, in address order) into shards."""
        if not answers:
            raise ValueError("no shard answered Describe")
        (first_address, first), *rest = answers.items()
        want = (first.hidden_size, first.intermediate_size, first.num_experts)
        for address, d in rest:
            got = (d.hidden_size, d.intermediate_size, d.num_experts)
            if got != want:
                raise ValueError(
                    f"shards disagree on (H, I, E): {first_address} has {want}, {address} has {got}"
                )
        groups: dict[tuple, list[str]] = {}
        for address, d in answers.items():
            groups.setdefault((tuple(d.experts), frozenset(d.layers)), []).append(address)
        shards = tuple(Shard(e, ls, tuple(a)) for (e, ls), a in groups.items())
        top_k = max(d.top_k for d in answers.values())
        return cls(*want, top_k, shards)

    def candidates(self, layer: int, live: set[int]) -> torch.Tensor:
        """bool [S, E + 1]: shard s serves `layer`, owns the expert and has a live replica."""
        table = torch.zeros((len(self.shards), self.num_experts + 1), dtype=torch.bool)
        for s, shard in enumerate(self.shards):
            if s in live and layer in shard.layers:
                table[s, list(shard.experts)] = True
        return table


def describe_problem(d: pb.DescribeResponse) -> str | None:
    """What makes a Describe answer unusable for routing, or None."""
    for name in ("hidden_size", "intermediate_size", "num_experts"):
        if getattr(d, name) == 0:
            return f"{name} is 0"
    e = d.num_experts
    bad = [x for x in d.experts if x >= e]
    if bad:
        return f"expert ids {_few(bad)} are outside [0, {e}) (num_experts {e})"
    if len(set(d.experts)) != len(d.experts):
        return "expert ids repeat"
    if d.top_k > e:
        return f"top_k {d.top_k} is larger than num_experts {e}"
    return None


def _few(values, limit: int = 8) -> str:
    text = ",".join(map(str, values[:limit]))
    return text + (f",... ({len(values)} in all)" if len(values) > limit else "")


def assign_owners(candidates: torch.Tensor, topk_ids: torch.Tensor, turn: int = 0) -> torch.Tensor:
    """int64 [E + 1]: the one shard each expert's routes go to in this call, -1 if none.

    An expert with one candidate goes to it; the redundant ones, busiest first,
    go to their candidate with the fewest routes so far (ties rotate with
    `turn`, so equal loads alternate between calls). Index E (id -1) is -1.
    Host work per call is a few numpy operations: it sits on every call's path."""
    cand = candidates.numpy()  # [S, E + 1]
    num_shards, width = cand.shape
    how_many = cand.sum(axis=0)
    owner = np.where(how_many > 0, cand.argmax(axis=0), -1).astype(np.int64)
    owner[-1] = -1
    if how_many.max(initial=0) > 1:  # redundant experts: balance this call's routes
        ids = topk_ids.numpy().ravel()
        counts = np.bincount(ids[ids >= 0], minlength=width)  # [E + 1] routes per expert
        single = how_many == 1
        load = np.zeros(num_shards, dtype=np.int64)
        np.add.at(load, owner[single], counts[single])
        redundant = np.flatnonzero((how_many > 1) & (counts > 0))
        for e in sorted(redundant.tolist(), key=lambda e: -int(counts[e])):
            options = np.flatnonzero(cand[:, e]).tolist()
            best = min(options, key=lambda s: (int(load[s]), (s - turn) % num_shards))
            owner[e] = best
            load[best] += counts[e]
    return torch.from_numpy(owner)


def missing_experts(owner: torch.Tensor, topk_ids: torch.Tensor) -> list[int]:
    """Routed experts (ids >= 0) that no shard owns."""
    ids = topk_ids.numpy().astype(np.int64)
    own = owner.numpy()
    lost = ids[(ids >= 0) & (own[ids % own.size] < 0)]
    return np.unique(lost).tolist()


@dataclass(frozen=True, slots=True)
class ShardPart:
    shard: int  # index into Topology.shards
    tokens: torch.Tensor  # int64 [Ms]: rows of the call that go to this shard
    topk_ids: torch.Tensor  # int32 [Ms, Ks]: this shard's routes, -1 padded
    topk_weights: torch.Tensor  # float32 [Ms, Ks]

    @property
    def experts(self) -> list[int]:
        """The part's distinct experts, ascending (for error messages)."""
        ids = self.topk_ids.numpy().reshape(-1)
        return np.flatnonzero(np.bincount(ids[ids >= 0])).tolist()


def split_routes(
    owner: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> list[ShardPart]:
    """One part per shard with >= 1 owned route: the tokens that have one, and
    only their routes to this shard, packed to the left ([Ms, Ks], -1 padded).

    numpy on views of the host tensors, every shard in one pass: the owned routes
    (in row-major order: token, then route) are grouped by shard with a stable sort
    on the shard's index (a radix sort on a small integer), which keeps each shard's
    routes in token order and each token's routes in their order; a route's column
    in its part is its rank among its token's routes to that shard. At M = 4096,
    top-8 over 8 shards this costs about a tenth of a per-shard argsort of the
    [M, K] route masks (tests/unit/test_client_routing.py checks both give the same
    parts as the plain-Python split)."""
    own = owner.numpy()
    ids_all = topk_ids.numpy()
    k = ids_all.shape[1]
    flat_ids = ids_all.reshape(-1)
    flat_w = topk_weights.numpy().reshape(-1)
    # Small dtypes throughout: at M = 4096, K = 8 an int64 temporary is 256 KiB, which
    # malloc maps fresh (and the kernel faults in) on every call.
    own_small = own.astype(np.int16 if own.max(initial=0) < np.iinfo(np.int16).max else np.int64)
    routes = own_small[flat_ids.astype(np.int64) % own.size]  # owning shard, -1 = none
    valid = np.flatnonzero(routes >= 0).astype(np.int32)
    n = valid.size
    if n == 0:
        return []
    shard_of = routes[valid]
    if shard_of[0] == shard_of[-1] and (shard_of == shard_of[0]).all():  # one shard
        pos, shard_sorted = valid, shard_of
    else:  # numpy's stable sort of a small integer is a radix sort
        order = np.argsort(shard_of, kind="stable")
        pos, shard_sorted = valid[order], shard_of[order]
    token = pos // np.int32(k)
    new_shard = np.empty(n, dtype=bool)
    new_shard[0] = True
    np.not_equal(shard_sorted[1:], shard_sorted[:-1], out=new_shard[1:])
    new_row = np.empty(n, dtype=bool)  # the first route of a (shard, token) row
    new_row[0] = True
    np.not_equal(token[1:], token[:-1], out=new_row[1:])
    new_row |= new_shard
    idx = np.arange(n, dtype=np.int32)
    col = idx - np.maximum.accumulate(np.where(new_row, idx, np.int32(0)))  # within its row
    row = np.cumsum(new_row, dtype=np.int32) - 1  # the row's number, over every shard's rows
    ids_sorted = flat_ids[pos].astype(np.int32, copy=False)
    w_sorted = flat_w[pos].astype(np.float32, copy=False)
    starts = np.flatnonzero(new_shard).tolist()
    parts = []
    for a, b in zip(starts, [*starts[1:], n], strict=True):
        r = row[a:b]
        r0 = int(r[0])
        rows = int(r[-1]) - r0 + 1
        c = col[a:b]
        width = int(c.max()) + 1
        if b - a == rows * width:  # every row full: the routes are the array, row-major
            ids = ids_sorted[a:b].reshape(rows, width)
            weights = w_sorted[a:b].reshape(rows, width)
        else:
            ids = np.full((rows, width), -1, dtype=np.int32)
            weights = np.zeros((rows, width), dtype=np.float32)
            ids[r - r0, c] = ids_sorted[a:b]
            weights[r - r0, c] = w_sorted[a:b]
        parts.append(
            ShardPart(
                int(shard_sorted[a]),
                torch.from_numpy(token[a:b][new_row[a:b]].astype(np.int64)),
                torch.from_numpy(ids),
                torch.from_numpy(weights),
            )
        )
    return parts


# Up to this many routes (M * K) a call is split in plain Python over lists: at M = 1 and
# K = 8 that is a few microseconds per shard where split_routes' numpy calls (a dozen per
# shard, each a microsecond or more) cost ten times as much.
SMALL_ROUTES = 128


@dataclass(slots=True)
class RouteTable:
    """Who may take which expert in one (topology, layer, live shards): the candidates,
    and, when no expert has two of them, the owners once for all calls (they do not
    depend on the call's routes then)."""

    candidates: torch.Tensor  # bool [S, E + 1]
    fixed: torch.Tensor | None = field(init=False)  # int64 [E + 1], or None: balance per call
    _fixed_list: list[int] | None = field(init=False)
    _sole: int | None = field(init=False)  # the shard that owns every expert, if one does

    def __post_init__(self) -> None:
        self._sole = None
        if int(self.candidates.numpy().sum(axis=0).max(initial=0)) > 1:
            self.fixed, self._fixed_list = None, None
        else:
            none = torch.zeros((0, 1), dtype=torch.int32)
            self.fixed = assign_owners(self.candidates, none)
            self._fixed_list = self.fixed.tolist()
            owners = set(self._fixed_list[:-1])
            if len(owners) == 1 and min(owners) >= 0:  # one shard owns every expert
                self._sole = owners.pop()

    def route(
        self, topk_ids: torch.Tensor, topk_weights: torch.Tensor, turn: int = 0
    ) -> tuple[list[ShardPart], list[int]]:
        """-> (one part per shard with routes, experts no shard owns): the same parts as
        split_routes and the same list as missing_experts, for host int32 ids and float32
        weights."""
        if self._sole is not None and topk_ids.numel():
            ids = topk_ids.numpy()
            if ids.min() >= 0:  # no padded route: the one part is the call as it is
                m = ids.shape[0]
                tokens = torch.from_numpy(np.arange(m, dtype=np.int64))
                return [ShardPart(self._sole, tokens, topk_ids, topk_weights)], []
        owner = self.fixed
        if owner is None:
            owner = assign_owners(self.candidates, topk_ids, turn)
        if topk_ids.numel() <= SMALL_ROUTES:
            own = self._fixed_list if self.fixed is not None else owner.tolist()
            return _split_small(own, topk_ids.tolist(), topk_weights.tolist())
        return split_routes(owner, topk_ids, topk_weights), missing_experts(owner, topk_ids)


def _split_small(own: list[int], ids: list, weights: list) -> tuple[list[ShardPart], list[int]]:
    """split_routes and missing_experts for a few routes, over lists."""
    per: dict[int, tuple[list, list, list]] = {}  # shard -> (tokens, ids rows, weights rows)
    lost = set()
    for t, (id_row, w_row) in enumerate(zip(ids, weights, strict=True)):
        mine: dict[int, tuple[list, list]] = {}
        for i, w in zip(id_row, w_row, strict=True):
            if i < 0:
                continue
            s = own[i]
            if s < 0:
                lost.add(i)
                continue
            got = mine.get(s)
            if got is None:
                got = mine[s] = ([], [])
            got[0].append(i)
            got[1].append(w)
        for s, (i_list, w_list) in mine.items():
            part = per.get(s)
            if part is None:
                part = per[s] = ([], [], [])
            part[0].append(t)
            part[1].append(i_list)
            part[2].append(w_list)
    parts = []
    for s in sorted(per):
        tokens, id_rows, w_rows = per[s]
        width = max(map(len, id_rows))
        for i_list, w_list in zip(id_rows, w_rows, strict=True):
            if len(i_list) < width:
                pad = width - len(i_list)
                i_list.extend([-1] * pad)
                w_list.extend([0.0] * pad)
        parts.append(
            ShardPart(
                s,
                torch.from_numpy(np.array(tokens, np.int64)),
                torch.from_numpy(np.array(id_rows, np.int32)),
                torch.from_numpy(np.array(w_rows, np.float32)),
            )
        )
    return parts, sorted(lost)
