"""Routing: which shard owns which expert, and what each shard is sent.

A *shard* here is a set of replicas: the addresses whose Describe names the
same experts and layers. An expert may also be owned by several shards (a
redundant expert); each call then gives each such expert to exactly one of its
live owners, the least loaded one by routes in that call.

Shape legend: M tokens, K top_k, E experts, S shards, Ms / Ks a shard's share.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def assign_owners(candidates: torch.Tensor, topk_ids: torch.Tensor, turn: int = 0) -> torch.Tensor:
    """int64 [E + 1]: the one shard each expert's routes go to in this call, -1 if none.

    An expert with one candidate goes to it; the redundant ones, busiest first,
    go to their candidate with the fewest routes so far (ties rotate with
    `turn`, so equal loads alternate between calls). Index E (id -1) is -1."""
    num_shards, width = candidates.shape
    ids = topk_ids.long()
    counts = torch.bincount(ids[ids >= 0], minlength=width)  # [E + 1] routes per expert
    how_many = candidates.sum(dim=0)
    owner = torch.where(how_many > 0, candidates.int().argmax(dim=0), -1).long()
    owner[-1] = -1
    single = how_many == 1
    load = torch.zeros(num_shards, dtype=torch.int64)
    load.index_add_(0, owner[single], counts[single])
    redundant = ((how_many > 1) & (counts > 0)).nonzero().squeeze(1)
    for e in sorted(redundant.tolist(), key=lambda e: -int(counts[e])):
        options = candidates[:, e].nonzero().squeeze(1).tolist()
        best = min(options, key=lambda s: (int(load[s]), (s - turn) % num_shards))
        owner[e] = best
        load[best] += counts[e]
    return owner


def missing_experts(owner: torch.Tensor, topk_ids: torch.Tensor) -> list[int]:
    """Routed experts (ids >= 0) that no shard owns."""
    ids = topk_ids.long()
    lost = ids[(ids >= 0) & (owner[ids % owner.numel()] < 0)]
    return sorted(set(lost.tolist()))


@dataclass(frozen=True, slots=True)
class ShardPart:
    shard: int  # index into Topology.shards
    tokens: torch.Tensor  # int64 [Ms]: rows of the call that go to this shard
    topk_ids: torch.Tensor  # int32 [Ms, Ks]: this shard's routes, -1 padded
    topk_weights: torch.Tensor  # float32 [Ms, Ks]
    experts: list[int]  # distinct experts of this part (for error messages)


def split_routes(
    owner: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> list[ShardPart]:
    """One part per shard with >= 1 owned route: the tokens that have one, and
    only their routes to this shard, packed to the left ([Ms, Ks], -1 padded)."""
    routes = owner[topk_ids.long() % owner.numel()]  # [M, K]: owning shard, -1 = none
    parts = []
    for shard in sorted(set(routes[routes >= 0].tolist())):
        mine = routes == shard  # [M, K]
        tokens = mine.any(dim=1).nonzero().squeeze(1)  # [Ms]
        mine = mine[tokens]  # [Ms, Ks_full]
        width = int(mine.sum(dim=1).max())
        # Stable sort puts the owned routes first, in their original order.
        order = torch.sort((~mine).to(torch.int8), dim=1, stable=True).indices[:, :width]
        keep = torch.gather(mine, 1, order)
        ids = torch.gather(topk_ids[tokens].to(torch.int32), 1, order)
        weights = torch.gather(topk_weights[tokens].to(torch.float32), 1, order)
        ids = torch.where(keep, ids, torch.full_like(ids, -1))
        weights = torch.where(keep, weights, torch.zeros_like(weights))
        experts = sorted(set(ids[keep].tolist()))
        parts.append(ShardPart(shard, tokens, ids, weights, experts))
    return parts
