"""Request validation (docs/protocol.md): every malformed request gets the right
status code and a message that names the problem, before any compute."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np
import torch

from expertd import wire
from expertd.server.bank import ModelInfo
from expertd.v1 import expertd_pb2 as pb


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True, slots=True)
class Limits:
    max_tokens: int
    max_top_k: int

    def max_message_bytes(self, hidden_size: int) -> int:
        """Largest request accepted: M*H bf16 + 2 * M*top_k 8-byte entries, plus framing."""
        per_token = hidden_size * 2 + self.max_top_k * (8 + 4)
        return self.max_tokens * per_token + (1 << 20)


@dataclass(frozen=True, slots=True)
class ForwardArgs:
    layer: int
    x: torch.Tensor  # bf16 [M, H] (CPU, viewed over the request bytes)
    ids: torch.Tensor  # int32/int64 [M, K]
    weights: torch.Tensor  # fp32/bf16 [M, K]


def _tensor(req: pb.ForwardRequest, name: str, allowed: tuple[int, ...]) -> torch.Tensor:
    if not req.HasField(name):
        raise invalid(f"missing input {name}")
    msg = getattr(req, name)
    if msg.dtype not in allowed:
        want = " or ".join(wire.dtype_name(d) for d in allowed)
        raise invalid(f"{name}: dtype {wire.dtype_name(msg.dtype)}, expected {want}")
    if len(msg.shape) != 2:
        raise invalid(f"{name}: shape {list(msg.shape)} has rank {len(msg.shape)}, expected rank 2")
    try:
        return wire.decode(msg, name, max_elements=2**34)
    except wire.WireError as e:
        raise invalid(str(e)) from None


def parse_forward(
    req: pb.ForwardRequest, info: ModelInfo, limits: Limits, has_layer
) -> ForwardArgs:
    """Check a ForwardRequest against the served model; raise RequestError on any problem."""
    if not has_layer(req.layer):
        raise RequestError(
            grpc.StatusCode.NOT_FOUND,
            f"layer {req.layer} is not served here (layers {_ranges(info.layers)})",
        )
    x = _tensor(req, "hidden_states", (pb.BF16,))
    ids = _tensor(req, "topk_ids", (pb.INT32, pb.INT64))
    w = _tensor(req, "topk_weights", (pb.FP32, pb.BF16))
    return check_forward(req.layer, x, ids, w, info, limits, lambda _layer: True)


def check_forward(
    layer: int,
    x: torch.Tensor,
    ids: torch.Tensor,
    w: torch.Tensor,
    info: ModelInfo,
    limits,
    has_layer,
) -> ForwardArgs:
    """Check one call's tensors (however they arrived: a message, a shared-memory slot)
    against the served model; raise RequestError on any problem."""
    if not has_layer(layer):
        raise RequestError(
            grpc.StatusCode.NOT_FOUND,
            f"layer {layer} is not served here (layers {_ranges(info.layers)})",
        )
    m, h = x.shape
    if m > limits.max_tokens:
        raise RequestError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"request has {m} tokens; this server accepts at most {limits.max_tokens} per request",
        )
    if h != info.hidden_size:
        raise invalid(f"hidden_states: width {h}, expected hidden size {info.hidden_size}")
    if ids.shape[0] != m:
        raise invalid(f"topk_ids: {ids.shape[0]} rows, but hidden_states has {m}")
    if w.shape != ids.shape:
        raise invalid(
            f"topk_weights: shape {list(w.shape)} differs from topk_ids shape {list(ids.shape)}"
        )
    top_k = ids.shape[1]
    if m and not 1 <= top_k <= limits.max_top_k:
        raise invalid(f"topk_ids: top_k {top_k} outside [1, {limits.max_top_k}]")
    if ids.numel():
        a = ids.numpy()  # numpy's reductions cost a third of torch's on a small tensor
        if a.min() < -1 or a.max() >= info.num_experts:
            t, j = (int(v) for v in np.argwhere((a < -1) | (a >= info.num_experts))[0])
            raise invalid(f"topk_ids[{t}, {j}] = {int(a[t, j])} outside [-1, {info.num_experts})")
    # NaN/Inf are checked where the data is touched anyway: on the device after
    # the copy (CUDA) or in the batch runner (CPU); see server/runner.py.
    return ForwardArgs(layer, x, ids, w)


def _ranges(values) -> str:
    """(0, 1, 2, 5) -> '0-2,5'."""
    values = sorted(values)
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(out) or "none"
