"""What the sync and asyncio clients share outside the event loop: input
checks, staging to and from the caller's device, and the fixed-order float32
sum of the shards' partial outputs.

CUDA inputs are copied into pinned host buffers (one stream sync for all
three), and the result goes back from a pinned buffer with a non-blocking copy;
on CPU nothing is pinned (pinning needs a CUDA driver).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from expertd import wire
from expertd.client.routing import ShardPart, Topology
from expertd.codec import ForwardRequestOut
from expertd.v1 import expertd_pb2 as pb


@dataclass(frozen=True, slots=True)
class Inputs:
    """One call's inputs, checked and on the host."""

    x: torch.Tensor  # bf16 [M, H]
    ids: torch.Tensor  # int32 [M, K]
    weights: torch.Tensor  # float32 [M, K]
    device: torch.device  # where the caller wants the result

    @property
    def pinned(self) -> bool:
        return self.device.type == "cuda"


def _to_host(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t = t.detach()
    if t.device.type == "cpu":
        return t.to(dtype).contiguous()
    host = torch.empty(t.shape, dtype=dtype, pin_memory=t.device.type == "cuda")
    host.copy_(t.to(dtype), non_blocking=True)
    return host


def stage_inputs(
    topology: Topology,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> Inputs:
    """Check shapes, dtypes and ids against the topology; copy to the host."""
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
    x = _to_host(hidden_states, torch.bfloat16)
    ids = _to_host(topk_ids, torch.int32)
    weights = _to_host(topk_weights, torch.float32)
    for t in (hidden_states, topk_ids, topk_weights):
        if t.device.type == "cuda":
            torch.cuda.current_stream(t.device).synchronize()
            break
    if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= topology.num_experts):
        raise ValueError(f"topk_ids: values must be in [-1, {topology.num_experts})")
    return Inputs(x, ids, weights, hidden_states.device)


def forward_request(layer: int, inputs: Inputs, part: ShardPart) -> ForwardRequestOut:
    """This shard's request; its tensors reach the wire in one copy (expertd/codec.py)."""
    return ForwardRequestOut(layer, inputs.x[part.tokens], part.topk_ids, part.topk_weights)


@dataclass(frozen=True, slots=True)
class Piece:
    """One shard's answer: its partial output for some of the call's tokens."""

    shard: int
    tokens: torch.Tensor  # int64 [Ms]: rows of the call
    output: pb.Tensor  # bf16 [Ms, H] on the wire


def combine(inputs: Inputs, hidden_size: int, pieces: list[Piece]) -> torch.Tensor:
    """Sum the partial outputs in float32 in shard order (independent of which
    answers first), round once to bf16 -> [M, H] on the host (pinned for CUDA)."""
    m = inputs.x.shape[0]
    total = torch.zeros((m, hidden_size), dtype=torch.float32)
    for piece in sorted(pieces, key=lambda p: p.shard):  # stable: same order every time
        partial = wire.decode(piece.output, "output")
        if tuple(partial.shape) != (piece.tokens.numel(), hidden_size):
            raise ValueError(
                f"shard returned output of shape {list(partial.shape)}, "
                f"expected [{piece.tokens.numel()}, {hidden_size}]"
            )
        total.index_add_(0, piece.tokens, partial.float())
    out = torch.empty((m, hidden_size), dtype=torch.bfloat16, pin_memory=inputs.pinned)
    return out.copy_(total)


def to_caller(out: torch.Tensor, inputs: Inputs, non_blocking: bool = True) -> torch.Tensor:
    """The host result onto the caller's device: non-blocking from pinned memory
    when run on the caller's thread (so the copy is ordered on its stream)."""
    if inputs.device.type == "cpu":
        return out
    return out.to(inputs.device, non_blocking=non_blocking and inputs.pinned)
