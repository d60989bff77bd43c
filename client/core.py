"""What the sync and asyncio clients share outside the event loop: input
checks, staging to and from the caller's device, and the fixed-order float32
sum of the shards' partial outputs.

CUDA inputs are copied into pinned host buffers (one stream sync for all
three), and the result goes back from a pinned buffer with a non-blocking copy;
on CPU nothing is pinned (pinning needs a CUDA driver).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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


# Up to this many elements the client loop's per-call tensor work (each shard's rows, the sum
# of the answers) runs in numpy, on the loop's thread alone. torch's CPU ops open an OpenMP
# region (index_add_ at any size, others from 32768 elements), and in a busy process (shard
# servers beside it, the caller's threads) the loop thread then waits at the region's barrier
# for a worker the OS has not run yet: on this project's 2-core CI machine, with 3 busy
# processes beside it, index_add_ of one 4096-wide row averaged 870 us against a median of 5,
# and 8 local CPU shards answered M = 1 in 5.7-6.2 ms instead of 8.0-8.3. On the H200 host (8
# shard processes, 16 cores; benchmarks/service.py, session 24) end to end went from 9.2 to
# 3.9 ms at M = 1 and from 10.1 to 6.5 at M = 16. A bound of 2^22 also took M = 256 from 29.0
# to 35.6-36.9 ms: numpy on one thread costs more than the stalls there, and above this bound
# torch's threads pay for themselves.
NUMPY_MAX_ELEMENTS = 1 << 17


def _bf16_bits(t: torch.Tensor) -> np.ndarray:
    """A contiguous bf16 CPU tensor's bits as uint16 (a view)."""
    return t.view(torch.int16).numpy().view(np.uint16)


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bits -> float32, exactly (bf16 is float32's top half)."""
    u = bits.astype(np.uint32)
    np.left_shift(u, 16, out=u)
    return u.view(np.float32)


def _f32_to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, rounded to nearest even as torch rounds; NaN -> a quiet NaN
    (0x7FC0; torch's vectorized conversion writes 0xFFFF, also a NaN)."""
    u = a.view(np.uint32)
    out = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def forward_request(layer: int, inputs: Inputs, part: ShardPart) -> ForwardRequestOut:
    """This shard's request; its tensors reach the wire in one copy (expertd/codec.py)."""
    if part.tokens.numel() * inputs.x.shape[1] <= NUMPY_MAX_ELEMENTS:
        rows = _bf16_bits(inputs.x)[part.tokens.numpy()]
        x = torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16)
    else:
        x = inputs.x[part.tokens]
    return ForwardRequestOut(layer, x, part.topk_ids, part.topk_weights)


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
    parts = []
    for piece in sorted(pieces, key=lambda p: p.shard):  # stable: same order every time
        partial = wire.decode(piece.output, "output")
        if tuple(partial.shape) != (piece.tokens.numel(), hidden_size):
            raise ValueError(
                f"shard returned output of shape {list(partial.shape)}, "
                f"expected [{piece.tokens.numel()}, {hidden_size}]"
            )
        parts.append((piece.tokens, partial))
    out = torch.empty((m, hidden_size), dtype=torch.bfloat16, pin_memory=inputs.pinned)
    if m * hidden_size <= NUMPY_MAX_ELEMENTS:  # the same float32 sums, in numpy
        acc = np.zeros((m, hidden_size), dtype=np.float32)
        for tokens, partial in parts:  # a part's tokens: distinct, ascending (split_routes)
            f = _bf16_to_f32(_bf16_bits(partial))
            if tokens.numel() == m:  # every row, in order
                acc += f
            else:  # distinct rows: += adds each once
                acc[tokens.numpy()] += f
        _bf16_bits(out)[:] = _f32_to_bf16(acc)
        return out
    total = torch.zeros((m, hidden_size), dtype=torch.float32)
    for tokens, partial in parts:
        total.index_add_(0, tokens, partial.float())
    return out.copy_(total)


def to_caller(out: torch.Tensor, inputs: Inputs, non_blocking: bool = True) -> torch.Tensor:
    """The host result onto the caller's device: non-blocking from pinned memory
    when run on the caller's thread (so the copy is ordered on its stream)."""
    if inputs.device.type == "cpu":
        return out
    return out.to(inputs.device, non_blocking=non_blocking and inputs.pinned)
