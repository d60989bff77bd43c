"""What the sync and asyncio clients share: input checks, request building,
and the fixed-order float32 sum of the shards' partial outputs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from expertd import wire
from expertd.client.errors import CoverageError
from expertd.client.routing import ShardPart, Topology, missing_experts, split_routes
from expertd.v1 import expertd_pb2 as pb

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
]
_request_ids = itertools.count(1)


@dataclass(slots=True)
class Call:
    """One forward, split: the parts and their requests, ready to send."""

    layer: int
    m: int
    device: torch.device
    parts: list[ShardPart]
    requests: list[pb.ForwardRequest]


def prepare_call(
    topology: Topology,
    unreachable: dict[str, str],
    layer: int,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> Call:
    """Check the inputs, route them, build one request per shard that has work."""
    h = topology.hidden_size
    if hidden_states.dim() != 2 or hidden_states.shape[1] != h:
        raise ValueError(f"hidden_states: shape {tuple(hidden_states.shape)}, expected [M, {h}]")
    m = hidden_states.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != m:
        raise ValueError(f"topk_ids: shape {tuple(topk_ids.shape)}, expected [{m}, top_k]")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights: shape {tuple(topk_weights.shape)} != topk_ids {tuple(topk_ids.shape)}"
        )
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids: dtype {topk_ids.dtype}, expected an integer dtype")
    device = hidden_states.device
    x = hidden_states.detach().to("cpu", torch.bfloat16).contiguous()
    ids = topk_ids.detach().to("cpu", torch.int32)
    weights = topk_weights.detach().to("cpu", torch.float32)
    if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= topology.num_experts):
        raise ValueError(f"topk_ids: values must be in [-1, {topology.num_experts})")
    if not any(layer in s.layers for s in topology.shards):
        raise CoverageError(layer, sorted(set(ids[ids >= 0].tolist())), unreachable)
    owner = topology.owner_table(layer)
    lost = missing_experts(owner, ids)
    if lost:
        raise CoverageError(layer, lost, unreachable)
    parts = split_routes(owner, ids, weights)
    requests = [
        pb.ForwardRequest(
            layer=layer,
            hidden_states=wire.encode(x[p.tokens]),
            topk_ids=wire.encode(p.topk_ids),
            topk_weights=wire.encode(p.topk_weights),
            request_id=next(_request_ids),
        )
        for p in parts
    ]
    return Call(layer, m, device, parts, requests)


def combine(call: Call, hidden_size: int, outputs: list[pb.ForwardResponse]) -> torch.Tensor:
    """Sum the partial outputs in float32, in shard order (independent of arrival order)."""
    total = torch.zeros((call.m, hidden_size), dtype=torch.float32)
    for part, resp in zip(call.parts, outputs, strict=True):
        partial = wire.decode(resp.output, "output")
        if tuple(partial.shape) != (part.tokens.numel(), hidden_size):
            raise ValueError(
                f"shard returned output of shape {list(partial.shape)}, "
                f"expected [{part.tokens.numel()}, {hidden_size}]"
            )
        total.index_add_(0, part.tokens, partial.float())
    return total.to(torch.bfloat16).to(call.device)


def metadata_tuples(metadata) -> list[tuple[str, str]]:
    if not metadata:
        return []
    items = metadata.items() if isinstance(metadata, dict) else metadata
    return [(str(k).lower(), str(v)) for k, v in items]
