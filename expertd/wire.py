"""Tensors on the wire (docs/protocol.md): raw little-endian row-major bytes with
dtype and shape beside them. Shared by the server and the client."""

from __future__ import annotations

import math
import sys
import warnings

import torch

from expertd.v1 import expertd_pb2 as pb

if sys.byteorder != "little":  # the wire is little-endian and we view bytes in place
    raise ImportError("expertd needs a little-endian host")

TORCH_DTYPE = {
    pb.BF16: torch.bfloat16,
    pb.FP32: torch.float32,
    pb.INT32: torch.int32,
    pb.INT64: torch.int64,
    pb.FP16: torch.float16,
    pb.UINT8: torch.uint8,
}
WIRE_DTYPE = {v: k for k, v in TORCH_DTYPE.items()}


class WireError(ValueError):
    """A tensor message that cannot be read as it declares itself."""


def dtype_name(code: int) -> str:
    try:
        return pb.DType.Name(code)
    except ValueError:
        return f"dtype {code}"


def encode(t: torch.Tensor) -> pb.Tensor:
    """torch tensor (any device) -> Tensor message (one copy into the bytes field)."""
    if t.dtype not in WIRE_DTYPE:
        raise WireError(f"dtype {t.dtype} has no wire form")
    t = t.detach().to("cpu").contiguous()
    data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return pb.Tensor(dtype=WIRE_DTYPE[t.dtype], shape=list(t.shape), data=data)


def decode(msg: pb.Tensor, name: str, max_elements: int = 2**40) -> torch.Tensor:
    """Tensor message -> CPU tensor viewed over the message's bytes (no copy, read-only).

    Raises WireError naming `name` when the dtype is unknown, a dimension is
    negative, the declared size is absurd, or the byte length does not match.
    """
    dtype = TORCH_DTYPE.get(msg.dtype)
    if dtype is None:
        raise WireError(f"{name}: unsupported dtype {dtype_name(msg.dtype)}")
    shape = tuple(msg.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"{name}: negative dimension in shape {list(shape)}")
    numel = math.prod(shape)
    if numel > max_elements:
        raise WireError(f"{name}: declared shape {list(shape)} is larger than any accepted request")
    itemsize = dtype.itemsize
    data = msg.data  # each access of a bytes field copies it (upb): read it once
    if len(data) != numel * itemsize:
        raise WireError(
            f"{name}: {len(data)} bytes for shape {list(shape)} of "
            f"{dtype_name(msg.dtype)}, expected {numel * itemsize}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if torch.is_warn_always_enabled():  # then torch warns on every read-only view
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(data, dtype=dtype).view(shape)
    return torch.frombuffer(data, dtype=dtype).view(shape)


def _quiet_read_only_views() -> None:
    """torch warns once per process (TORCH_WARN_ONCE) when it views read-only bytes,
    as `decode` does (bytes are immutable; we never write through the view). Have
    that one warning here, silenced: silencing each call instead (catch_warnings)
    costs more than the view itself, three times per request."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(b"\0\0", dtype=torch.uint8)


_quiet_read_only_views()
