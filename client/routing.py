"""Routing: which shard owns which expert, and what each shard is sent.

Shape legend: M tokens, K top_k, E experts, S shards, Ms / Ks a shard's share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from expertd.v1 import expertd_pb2 as pb


@dataclass(frozen=True, slots=True)
class ShardInfo:
    address: str
    describe: pb.DescribeResponse

    @property
    def experts(self) -> list[int]:
        return list(self.describe.experts)

    @property
    def layers(self) -> set[int]:
        return set(self.describe.layers)


@dataclass(frozen=True, slots=True)
class Topology:
    """The model shape the shards agree on, and who owns what."""

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    shards: tuple[ShardInfo, ...]

    @classmethod
    def from_shards(cls, shards: list[ShardInfo]) -> Topology:
        if not shards:
            raise ValueError("no shard answered Describe")
        first = shards[0].describe
        for s in shards[1:]:
            d = s.describe
            got = (d.hidden_size, d.intermediate_size, d.num_experts)
            want = (first.hidden_size, first.intermediate_size, first.num_experts)
            if got != want:
                raise ValueError(
                    f"shards disagree on (H, I, E): {shards[0].address} has {want}, "
                    f"{s.address} has {got}"
                )
        return cls(
            first.hidden_size,
            first.intermediate_size,
            first.num_experts,
            max(s.describe.top_k for s in shards),
            tuple(shards),
        )

    def owner_table(self, layer: int) -> torch.Tensor:
        """int64 [E + 1]: shard index owning each expert for `layer`, -1 if none.

        Index E (where id -1 lands) is -1. When several shards own an expert,
        the first listed owns it here.
        """
        owner = torch.full((self.num_experts + 1,), -1, dtype=torch.int64)
        for index in reversed(range(len(self.shards))):
            shard = self.shards[index]
            if layer in shard.layers:
                owner[torch.tensor(shard.experts, dtype=torch.int64)] = index
        owner[self.num_experts] = -1
        return owner


@dataclass(frozen=True, slots=True)
class ShardPart:
    shard: int  # index into Topology.shards
    tokens: torch.Tensor  # int64 [Ms]: rows of the call that go to this shard
    topk_ids: torch.Tensor  # int32 [Ms, Ks]: this shard's routes, -1 padded
    topk_weights: torch.Tensor  # float32 [Ms, Ks]
    experts: list[int]  # distinct experts of this part (for error messages)


def route_owners(owner: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """int64 [M, K]: owning shard of each route, -1 for no route."""
    return owner[topk_ids.long() % owner.numel()]


def missing_experts(owner: torch.Tensor, topk_ids: torch.Tensor) -> list[int]:
    """Routed experts (ids >= 0) that no shard owns."""
    ids = topk_ids.long()
    lost = ids[(ids >= 0) & (owner[ids % owner.numel()] < 0)]
    return sorted(set(lost.tolist()))


def split_routes(
    owner: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> list[ShardPart]:
    """One part per shard with >= 1 owned route: the tokens that have one, and
    only their routes to this shard, packed to the left ([Ms, Ks], -1 padded)."""
    routes = route_owners(owner, topk_ids)  # [M, K]
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
