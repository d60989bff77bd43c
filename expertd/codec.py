"""ForwardRequest and ForwardResponse read straight off the received bytes.

protobuf (upb) copies a message's bytes into its arena when it parses, and
copies a bytes field again each time it is read: two full copies of every
tensor before we see it. These readers walk the wire format of the two messages
that carry tensors (the server reads requests, the client responses) and return
memoryviews into the received buffer: no copy.
It reads exactly the proto3 encoding protobuf writes (fields in any order,
unknown fields skipped, packed or unpacked `shape`, last scalar wins) and raises
protobuf's DecodeError where protobuf would refuse the bytes.
"""

from __future__ import annotations

import torch
from google.protobuf.message import DecodeError

from expertd.v1 import expertd_pb2 as pb
from expertd.wire import WIRE_DTYPE

_TENSORS = {2: "hidden_states", 3: "topk_ids", 4: "topk_weights"}
# ForwardRequest's fields, as both request classes below name them.
_REQUEST_FIELDS = (
    "hidden_states",
    "instance_id",
    "layer",
    "request_id",
    "timeout_us",
    "topk_ids",
    "topk_weights",
    "trace_id",
)


class TensorView:
    """A Tensor message's fields; `data` is a memoryview into the request."""

    __slots__ = ("data", "dtype", "shape")

    def __init__(self) -> None:
        self.dtype = 0
        self.shape: list[int] = []
        self.data = memoryview(b"")


class ForwardRequestView:
    """What the server reads of a ForwardRequest, with pb.ForwardRequest's names."""

    __slots__ = _REQUEST_FIELDS

    def __init__(self) -> None:
        self.layer = 0
        self.request_id = 0
        self.trace_id = ""
        self.instance_id = ""
        self.timeout_us = 0
        self.hidden_states = self.topk_ids = self.topk_weights = None

    def HasField(self, name: str) -> bool:  # protobuf's name, so both kinds read alike
        return getattr(self, name) is not None


def _varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise DecodeError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _int32(value: int) -> int:
    return ((value & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000


def _fields(buf: memoryview, pos: int, end: int):
    """(field number, wire type, value) for each field; value: int or memoryview."""
    while pos < end:
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise DecodeError("field number 0")
        if wire == 0:
            value, pos = _varint(buf, pos, end)
        elif wire == 2:
            size, pos = _varint(buf, pos, end)
            if size > end - pos:
                raise DecodeError("truncated length-delimited field")
            value, pos = buf[pos : pos + size], pos + size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if width > end - pos:
                raise DecodeError("truncated fixed-width field")
            value, pos = int.from_bytes(buf[pos : pos + width], "little"), pos + width
        else:
            raise DecodeError(f"unsupported wire type {wire}")
        yield number, wire, value


def _tensor(buf: memoryview, into: TensorView | None) -> TensorView:
    t = into or TensorView()  # a repeated embedded message merges, as protobuf does
    for number, wire, value in _fields(buf, 0, len(buf)):
        if number == 1 and wire == 0:
            t.dtype = _int32(value)
        elif number == 2 and wire == 0:
            t.shape.append(_signed(value))
        elif number == 2 and wire == 2:  # packed
            pos = 0
            while pos < len(value):
                item, pos = _varint(value, pos, len(value))
                t.shape.append(_signed(item))
        elif number == 3 and wire == 2:
            t.data = value
        # anything else (unknown fields, a known number with another wire type) is
        # skipped, as protobuf keeps it as an unknown field
    return t


def _text(value) -> str:
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise DecodeError("string field is not valid UTF-8") from None


def parse_forward_request(data: bytes) -> ForwardRequestView:
    """Received bytes -> ForwardRequestView (tensor bytes not copied)."""
    buf = memoryview(data)
    req = ForwardRequestView()
    for number, wire, value in _fields(buf, 0, len(buf)):
        if number in _TENSORS and wire == 2:
            name = _TENSORS[number]
            setattr(req, name, _tensor(value, getattr(req, name)))
        elif number == 1 and wire == 0:
            req.layer = value & 0xFFFFFFFF
        elif number == 5 and wire == 0:
            req.request_id = value
        elif number == 6 and wire == 2:
            req.trace_id = _text(value)
        elif number == 7 and wire == 2:
            req.instance_id = _text(value)
        elif number == 8 and wire == 0:
            req.timeout_us = value
    return req


class ErrorView:
    __slots__ = ("code", "message")

    def __init__(self) -> None:
        self.code = 0
        self.message = ""


class ForwardResponseView:
    """What the client reads of a ForwardResponse, with pb.ForwardResponse's names."""

    __slots__ = ("_timing", "error", "output", "request_id")

    def __init__(self) -> None:
        self.request_id = 0
        self.output = self.error = None
        self._timing = None

    def HasField(self, name: str) -> bool:  # protobuf's name, so both kinds read alike
        return getattr(self, name) is not None

    @property
    def timing(self) -> pb.Timing:
        """Small: parsed by protobuf, on demand."""
        return pb.Timing.FromString(bytes(self._timing or b""))


def parse_forward_response(data: bytes) -> ForwardResponseView:
    """Received bytes -> ForwardResponseView (the output's bytes not copied)."""
    buf = memoryview(data)
    resp = ForwardResponseView()
    for number, wire, value in _fields(buf, 0, len(buf)):
        if number == 1 and wire == 0:
            resp.request_id = value
        elif number == 2 and wire == 2:
            resp.output = _tensor(value, resp.output)
        elif number == 3 and wire == 2:
            resp.error = resp.error or ErrorView()
            for n, w, v in _fields(value, 0, len(value)):
                if n == 1 and w == 0:
                    resp.error.code = _int32(v)
                elif n == 2 and w == 2:
                    resp.error.message = _text(v)
        elif number == 4 and wire == 2:
            resp._timing = bytes(resp._timing or b"") + bytes(value)  # merges, as protobuf
    return resp


def _put_varint(value: int) -> bytes:
    out = bytearray()
    value &= 0xFFFFFFFFFFFFFFFF
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _len_field(number: int, size: int) -> bytes:
    return _put_varint(number << 3 | 2) + _put_varint(size)


def encode_forward_response(
    request_id: int, dtype: int, shape: tuple[int, ...], payload, timing: pb.Timing | None
) -> bytes:
    """A serialized ForwardResponse with `payload` (any buffer: e.g. a memoryview
    of pinned memory) as output.data, copied once, straight into the result.
    Byte for byte what protobuf writes for the same message."""
    parts = [_scalar(1, request_id), *_tensor_parts(2, dtype, shape, payload)]
    if timing is not None:
        t = timing.SerializeToString()
        parts += [_len_field(4, len(t)), t]
    return b"".join(parts)


def serialize_forward_response(response) -> bytes:
    """Response serializer: prebuilt bytes pass through, messages serialize."""
    return response if isinstance(response, bytes) else response.SerializeToString()


class ForwardRequestOut:
    """A ForwardRequest to send, its tensors kept as tensors until the wire: the
    serializer copies each once, from the tensor into the request bytes (protobuf
    would copy to bytes, into its field, then into its serialization)."""

    __slots__ = _REQUEST_FIELDS

    def __init__(self, layer: int, hidden_states, topk_ids, topk_weights) -> None:
        self.layer = layer
        self.hidden_states = hidden_states  # CPU tensors, contiguous
        self.topk_ids = topk_ids
        self.topk_weights = topk_weights
        self.request_id = 0
        self.trace_id = ""
        self.instance_id = ""
        self.timeout_us = 0


def _tensor_parts(number: int, dtype: int, shape, payload) -> list:
    """Field `number` holding a Tensor message: header pieces, then `payload` (any
    buffer) as its data, left for the final join to copy once."""
    payload = memoryview(payload)
    payload = payload.cast("B") if payload.nbytes else b""
    packed = b"".join(_put_varint(d) for d in shape)
    head = _scalar(1, dtype)
    if packed:
        head += _len_field(2, len(packed)) + packed
    data_head = _len_field(3, len(payload)) if len(payload) else b""
    return [_len_field(number, len(head) + len(data_head) + len(payload)), head, data_head, payload]


def _host_bytes(t: torch.Tensor):
    """A contiguous CPU tensor's bytes, viewed (no copy)."""
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def _scalar(number: int, value: int) -> bytes:
    return _put_varint(number << 3) + _put_varint(value) if value else b""


def _string(number: int, value: str) -> bytes:
    raw = value.encode()
    return _len_field(number, len(raw)) + raw if raw else b""


def serialize_forward_request(request) -> bytes:
    """Request serializer: ForwardRequestOut written here, messages by protobuf."""
    if not isinstance(request, ForwardRequestOut):
        return request.SerializeToString()
    parts = [_scalar(1, request.layer)]
    for number, t in ((2, request.hidden_states), (3, request.topk_ids), (4, request.topk_weights)):
        parts += _tensor_parts(number, WIRE_DTYPE[t.dtype], t.shape, _host_bytes(t))
    parts += [
        _scalar(5, request.request_id),
        _string(6, request.trace_id),
        _string(7, request.instance_id),
        _scalar(8, request.timeout_us),
    ]
    return b"".join(parts)
