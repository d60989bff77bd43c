"""ForwardRequest and ForwardResponse read straight off the received bytes, and
the limits on what reading any request may cost.

protobuf (upb) copies a message's bytes into its arena when it parses, and
copies a bytes field again each time it is read: two full copies of every
tensor before we see it. These readers walk the wire format of the two messages
that carry tensors (the server reads requests, the client responses) and return
memoryviews into the received buffer: no copy.
They read exactly what protobuf reads (fields in any order, unknown fields and
groups skipped, packed or unpacked `shape`, last scalar wins, keys and lengths of
at most 5 bytes) and raise protobuf's DecodeError where protobuf would refuse the
bytes (tests/test_hardening_codec_fuzz.py checks both against protobuf).

Their work is bounded whatever the message: a request of ~30 MiB made of millions
of tiny fields would keep a Python reader busy for seconds (and protobuf's for up
to a second). Past MAX_FIELDS fields, MAX_REPEATED entries of one repeated number
field (a shape's rank) or MAX_DEPTH levels of nesting, a message is refused with
MessageLimitError (a DecodeError) naming the limit. `check_limits` applies the same
limits, walking a message by its descriptor, before protobuf parses the requests
it reads (server/malformed.py).
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch
from google.protobuf.descriptor import FieldDescriptor
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
    "traceparent",
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
        self.traceparent = ""
        self.hidden_states = self.topk_ids = self.topk_weights = None

    def HasField(self, name: str) -> bool:  # protobuf's name, so both kinds read alike
        return getattr(self, name) is not None


# Limits on the work any one message may cause. A message of up to ~30 MiB made of
# tiny fields would otherwise keep a pure-Python reader busy for many seconds (and
# protobuf's own for up to a second): past these limits it is refused, not read.
MAX_FIELDS = 1024  # fields read in one message: sub-messages, groups and packed entries included
MAX_REPEATED = 64  # entries of one repeated number field (a tensor's shape: its rank)
MAX_DEPTH = 100  # nesting of sub-messages and groups; protobuf's own recursion limit
# Entries of one repeated number field of a message that holds a tensor's values (the
# OIP's typed contents, see check_limits): a packed run protobuf reads in one pass.
MAX_TENSOR_VALUES = 1 << 20
# Bytes of one text field of a ForwardRequest (trace_id, instance_id, traceparent):
# ids of a few dozen bytes, never megabytes a server would copy and decode per call.
MAX_TEXT_BYTES = 4096
_TERMINATORS = bytes(range(0x80))  # the last byte of every varint
_MASK64 = (1 << 64) - 1


class MessageLimitError(DecodeError):
    """Bytes that may well be a message, but one costing more to read than any
    request may: the message names the limit it breaks."""


class _Budget:
    """What is left of MAX_FIELDS while reading one message."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_FIELDS

    def spend(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise MessageLimitError(
                f"message has more than {MAX_FIELDS} fields (limit {MAX_FIELDS})"
            )


def _deeper(depth: int) -> int:
    if depth >= MAX_DEPTH:
        raise MessageLimitError(f"message nests deeper than {MAX_DEPTH} levels (limit {MAX_DEPTH})")
    return depth + 1


def _varint(buf: memoryview, pos: int, end: int, max_bytes: int = 10) -> tuple[int, int]:
    """A varint of at most `max_bytes` bytes (protobuf: 10 for values, 5 for keys and
    lengths), kept to 64 bits."""
    if pos < end and buf[pos] < 0x80:
        return buf[pos], pos + 1
    value = shift = 0
    stop = min(end, pos + max_bytes)
    while pos < stop:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & _MASK64, pos
        shift += 7
    raise DecodeError("truncated or overlong varint")


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _int32(value: int) -> int:
    return ((value & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000


def _key(buf: memoryview, pos: int, end: int) -> tuple[int, int, int]:
    """A field key -> (number, wire type, position after it)."""
    key, pos = _varint(buf, pos, end, 5)
    if key >> 32:
        raise DecodeError("field key out of range")
    if key >> 3 == 0:
        raise DecodeError("field number 0")
    return key >> 3, key & 7, pos


def _value(buf: memoryview, pos: int, end: int, number: int, wire: int, budget, depth: int):
    """The value of a field whose key was read -> (value, position after it).
    value: int (varint, fixed), memoryview (length-delimited) or None (a group,
    skipped whole, as protobuf keeps an unknown group)."""
    if wire == 0:
        return _varint(buf, pos, end)
    if wire == 2:
        size, pos = _varint(buf, pos, end, 5)
        if size > end - pos:
            raise DecodeError("truncated length-delimited field")
        return buf[pos : pos + size], pos + size
    if wire in (1, 5):
        width = 8 if wire == 1 else 4
        if width > end - pos:
            raise DecodeError("truncated fixed-width field")
        return int.from_bytes(buf[pos : pos + width], "little"), pos + width
    if wire == 3:
        return None, _skip_group(buf, pos, end, number, budget, _deeper(depth))
    raise DecodeError(f"unexpected wire type {wire}")


def _skip_group(buf: memoryview, pos: int, end: int, number: int, budget, depth: int) -> int:
    """Past the end of the group that started with field `number`."""
    while True:
        if pos >= end:
            raise DecodeError("unterminated group")
        budget.spend()
        inner, wire, pos = _key(buf, pos, end)
        if wire == 4:
            if inner != number:
                raise DecodeError("mismatched end of group")
            return pos
        _, pos = _value(buf, pos, end, inner, wire, budget, depth)


def _fields(buf: memoryview, pos: int, end: int, budget: _Budget, depth: int = 0):
    """(field number, wire type, value) for each field of a message at nesting
    `depth`; value: int or memoryview. Groups are skipped (as unknown fields)."""
    while pos < end:
        budget.spend()
        key = buf[pos]
        if 8 <= key < 0x80:  # the usual one-byte key (fields 1-15)
            number, wire, pos = key >> 3, key & 7, pos + 1
        else:
            number, wire, pos = _key(buf, pos, end)
        if wire == 2:
            size, pos = _varint(buf, pos, end, 5)
            if size > end - pos:
                raise DecodeError("truncated length-delimited field")
            yield number, 2, buf[pos : pos + size]
            pos += size
            continue
        if wire == 4:
            raise DecodeError("end of group outside a group")
        value, pos = _value(buf, pos, end, number, wire, budget, depth)
        if value is not None:
            yield number, wire, value


def _packed(value: memoryview, out: list[int], budget: _Budget, what: str) -> None:
    """Append a packed run of varints to `out` (at most MAX_REPEATED in all)."""
    pos, end = 0, len(value)
    while pos < end:
        item, pos = _varint(value, pos, end)
        _append(out, _signed(item), budget, what)


def _append(out: list[int], item: int, budget: _Budget, what: str) -> None:
    if len(out) >= MAX_REPEATED:
        raise MessageLimitError(
            f"{what} has more than {MAX_REPEATED} entries (limit {MAX_REPEATED})"
        )
    budget.spend()
    out.append(item)


def _tensor(buf: memoryview, into: TensorView | None, budget: _Budget, depth: int) -> TensorView:
    t = into or TensorView()  # a repeated embedded message merges, as protobuf does
    depth = _deeper(depth)
    for number, wire, value in _fields(buf, 0, len(buf), budget, depth):
        if number == 1 and wire == 0:
            t.dtype = _int32(value)
        elif number == 2 and wire == 0:
            _append(t.shape, _signed(value), budget, "a tensor shape")
        elif number == 2 and wire == 2:  # packed
            _packed(value, t.shape, budget, "a tensor shape")
        elif number == 3 and wire == 2:
            t.data = value
        # anything else (unknown fields, a known number with another wire type) is
        # skipped, as protobuf keeps it as an unknown field
    return t


_FIXED = {  # protobuf field type -> bytes per entry of a packed run (0: varints)
    FieldDescriptor.TYPE_DOUBLE: 8,
    FieldDescriptor.TYPE_FIXED64: 8,
    FieldDescriptor.TYPE_SFIXED64: 8,
    FieldDescriptor.TYPE_FLOAT: 4,
    FieldDescriptor.TYPE_FIXED32: 4,
    FieldDescriptor.TYPE_SFIXED32: 4,
}
_SCHEMAS: dict[str, dict[int, tuple]] = {}


def _schema(descriptor) -> dict[int, tuple]:
    """field number -> (sub-message descriptor or None, width of a repeated number
    field's entries or None, field name)."""
    schema = _SCHEMAS.get(descriptor.full_name)
    if schema is None:
        schema = {}
        for f in descriptor.fields:
            numbers = f.is_repeated and f.message_type is None and f.type not in _BLOBS
            schema[f.number] = (f.message_type, _FIXED.get(f.type, 0) if numbers else None, f.name)
        _SCHEMAS[descriptor.full_name] = schema
    return schema


_BLOBS = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)


def check_limits(data, descriptor, values: frozenset[str] = frozenset()) -> None:
    """Raise MessageLimitError if protobuf, reading `data` as a `descriptor` message,
    would read more than MAX_FIELDS fields, MAX_REPEATED entries of one repeated
    number field or MAX_DEPTH levels. Bytes that are no message end the walk: the
    parse that follows refuses them. Costs at most MAX_FIELDS steps, whatever the
    size of `data`, after which protobuf's own parse is bounded too.

    `values`: full names of messages whose repeated number fields hold a tensor's
    values. There a packed run counts as one field (protobuf reads it in one pass,
    as it reads a bytes field) and may hold up to MAX_TENSOR_VALUES entries."""
    buf = memoryview(data)
    try:
        _walk(buf, descriptor, _Budget(), 0, values)
    except MessageLimitError:
        raise
    except DecodeError:
        return


def _walk(buf: memoryview, descriptor, budget: _Budget, depth: int, values: frozenset[str]) -> None:
    schema = _schema(descriptor)
    tensor = descriptor.full_name in values
    limit = MAX_TENSOR_VALUES if tensor else MAX_REPEATED
    counts: dict[int, int] = {}
    for number, wire, value in _fields(buf, 0, len(buf), budget, depth):
        sub, width, name = schema.get(number, (None, None, ""))
        if sub is not None and wire == 2:
            _walk(value, sub, budget, _deeper(depth), values)
        elif width is not None:
            if wire == 2:  # a packed run
                if width:
                    n = len(value) // width
                elif len(value) > 10 * limit:
                    n = limit + 1  # that many bytes hold more varints than that
                else:
                    n = len(value) - len(bytes(value).translate(None, _TERMINATORS))
            elif wire == (0 if width == 0 else 1 if width == 8 else 5):
                n = 1
            else:
                continue  # another wire type: an unknown field
            counts[number] = counts.get(number, 0) + n
            if counts[number] > limit:
                raise MessageLimitError(
                    f"field {name!r} has more than {limit} entries (limit {limit})"
                )
            budget.spend(1 if tensor and wire == 2 else n)


def _text(value, name: str = "") -> str:
    if name and len(value) > MAX_TEXT_BYTES:
        raise MessageLimitError(f"field {name!r} is {len(value)} bytes (limit {MAX_TEXT_BYTES})")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise DecodeError("string field is not valid UTF-8") from None


def parse_forward_request(data: bytes) -> ForwardRequestView:
    """Received bytes -> ForwardRequestView (tensor bytes not copied)."""
    buf = memoryview(data)
    req = ForwardRequestView()
    budget = _Budget()
    for number, wire, value in _fields(buf, 0, len(buf), budget):
        if number in _TENSORS and wire == 2:
            name = _TENSORS[number]
            setattr(req, name, _tensor(value, getattr(req, name), budget, 0))
        elif number == 1 and wire == 0:
            req.layer = value & 0xFFFFFFFF
        elif number == 5 and wire == 0:
            req.request_id = value
        elif number == 6 and wire == 2:
            req.trace_id = _text(value, "trace_id")
        elif number == 7 and wire == 2:
            req.instance_id = _text(value, "instance_id")
        elif number == 8 and wire == 0:
            req.timeout_us = value
        elif number == 9 and wire == 2:
            req.traceparent = _text(value, "traceparent")
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
    budget = _Budget()
    for number, wire, value in _fields(buf, 0, len(buf), budget):
        if number == 1 and wire == 0:
            resp.request_id = value
        elif number == 2 and wire == 2:
            resp.output = _tensor(value, resp.output, budget, 0)
        elif number == 3 and wire == 2:
            resp.error = resp.error or ErrorView()
            for n, w, v in _fields(value, 0, len(value), budget, _deeper(0)):
                if n == 1 and w == 0:
                    resp.error.code = _int32(v)
                elif n == 2 and w == 2:
                    resp.error.message = _text(v)
        elif number == 4 and wire == 2:
            resp._timing = bytes(resp._timing or b"") + bytes(value)  # merges, as protobuf
    return resp


_VARINTS = [bytes((i,)) for i in range(0x80)]  # the one-byte varints, made once


def _put_varint(value: int) -> bytes:
    if 0 <= value < 0x80:
        return _VARINTS[value]
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
    would copy to bytes, into its field, then into its serialization).

    `rows` (int64 indices, numpy or torch), when given, picks the rows of
    `hidden_states` to send: the serializer gathers them straight into the request
    bytes, so a shard's share of the call's rows is copied once, not gathered into a
    tensor first and copied again. Reading `.hidden_states` gathers them."""

    __slots__ = (*(f for f in _REQUEST_FIELDS if f != "hidden_states"), "_rows", "_x")

    def __init__(self, layer: int, hidden_states, topk_ids, topk_weights, rows=None) -> None:
        self.layer = layer
        self._x = hidden_states  # CPU tensors
        self._rows = None if rows is None else np.asarray(rows, dtype=np.int64)
        self.topk_ids = topk_ids
        self.topk_weights = topk_weights
        self.request_id = 0
        self.trace_id = ""
        self.instance_id = ""
        self.timeout_us = 0
        self.traceparent = ""

    @property
    def hidden_states(self) -> torch.Tensor:
        """The rows sent, as a tensor (gathered, in numpy, when `rows` picks them)."""
        if self._rows is None:
            return self._x
        picked = _array(self._x)[self._rows]
        return torch.from_numpy(picked).view(self._x.dtype)


def _array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's elements as a C-contiguous numpy array over its memory (bf16 as
    int16: numpy has no bf16); copied only where the tensor is not contiguous."""
    if not t.is_contiguous():
        t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


# (field, dtype, shape, data bytes) -> the Tensor field's bytes before its data
_HEADS: dict[tuple, bytes] = {}


def _tensor_head(number: int, dtype: int, shape: tuple, nbytes: int) -> bytes:
    """Field `number` holding a Tensor message of `nbytes` data bytes: everything
    before the data (the field's key and length, dtype, packed shape, data's key and
    length). Kept per (field, dtype, shape, nbytes): calls of one size repeat it."""
    key = (number, dtype, shape, nbytes)
    head = _HEADS.get(key)
    if head is None:
        packed = b"".join(_put_varint(d) for d in shape)
        inner = _scalar(1, dtype)
        if packed:
            inner += _len_field(2, len(packed)) + packed
        if nbytes:
            inner += _len_field(3, nbytes)
        head = _len_field(number, len(inner) + nbytes) + inner
        if len(_HEADS) >= 4096:  # bounded: a client sees a few sizes per M
            _HEADS.clear()
        _HEADS[key] = head
    return head


def _tensor_parts(number: int, dtype: int, shape, payload) -> list:
    """Field `number` holding a Tensor message: its header, then `payload` (any
    buffer) as its data, left for the final join to copy once."""
    payload = memoryview(payload)
    payload = payload.cast("B") if payload.nbytes else b""
    return [_tensor_head(number, dtype, tuple(shape), len(payload)), payload]


def _scalar(number: int, value: int) -> bytes:
    return _put_varint(number << 3) + _put_varint(value) if value else b""


def _string(number: int, value: str) -> bytes:
    raw = value.encode()
    return _len_field(number, len(raw)) + raw if raw else b""


# Requests at least this large whose rows are picked are written into a fresh bytes
# object in place (the rows gathered straight into it); smaller ones are joined (the
# join's second copy of a few KiB costs less than writing in place does).
IN_PLACE_MIN = 1 << 16

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
_bytes_data = ctypes.pythonapi.PyBytes_AsString
_bytes_data.restype = ctypes.c_void_p
_bytes_data.argtypes = (ctypes.py_object,)


def _fresh_bytes(n: int) -> tuple[bytes, np.ndarray]:
    """A new bytes object of n >= 2 uninitialized bytes and a writable view of them.

    The C API's way of building a bytes object in place (PyBytes_FromStringAndSize
    with no source): it is ours alone until we return it, so writing it before
    anyone else sees it is sound. Drop the view before handing the bytes on."""
    data = _new_bytes(None, n)
    view = np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(_bytes_data(data)))
    return data, view


def serialize_forward_request(request) -> bytes:
    """Request serializer: ForwardRequestOut written here, messages by protobuf.
    Byte for byte what protobuf writes for the same message."""
    if not isinstance(request, ForwardRequestOut):
        return request.SerializeToString()
    parts = [_scalar(1, request.layer)]  # bytes, and numpy arrays for the data
    rows = request._rows
    picked = None  # (index in parts, x as numpy) when x's rows are picked
    for number, t in ((2, request._x), (3, request.topk_ids), (4, request.topk_weights)):
        arr = _array(t)
        shape = arr.shape
        if number == 2 and rows is not None:
            shape = (rows.size, *shape[1:])
        nbytes = math.prod(shape) * arr.itemsize
        parts.append(_tensor_head(number, WIRE_DTYPE[t.dtype], shape, nbytes))
        if not nbytes:
            continue
        if number == 2 and rows is not None:
            picked = (len(parts), arr)
            arr = None
        parts.append(arr)
    parts += [
        _scalar(5, request.request_id),
        _string(6, request.trace_id),
        _string(7, request.instance_id),
        _scalar(8, request.timeout_us),
        _string(9, request.traceparent),
    ]
    if picked is None:
        return b"".join(parts)
    at, x = picked
    if rows.min() < 0 or rows.max() >= x.shape[0]:  # never a silent wrong row below
        raise ValueError(f"rows to send must be in [0, {x.shape[0]})")
    size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts if p is not None)
    row_bytes = math.prod(x.shape[1:]) * x.itemsize
    size += rows.size * row_bytes
    if size < IN_PLACE_MIN:
        parts[at] = x[rows]
        return b"".join(parts)
    data, out = _fresh_bytes(size)
    pos = 0
    for i, p in enumerate(parts):
        if i == at:  # the picked rows, gathered straight into the message
            n = rows.size * row_bytes
            dest = out[pos : pos + n].view(x.dtype).reshape(rows.size, *x.shape[1:])
            np.take(x, rows, axis=0, out=dest, mode="clip")  # (valid rows; clip: unbuffered)
        else:
            n = len(p) if isinstance(p, bytes) else p.nbytes
            if n:
                out[pos : pos + n] = (
                    np.frombuffer(p, np.uint8)
                    if isinstance(p, bytes)
                    else p.reshape(-1).view(np.uint8)
                )
        pos += n
    del out
    return data
