"""The zero-copy ForwardRequest reader agrees with protobuf on every message
protobuf writes, and refuses what protobuf refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from expertd import codec, wire
from expertd.codec import (
    ForwardRequestOut,
    encode_forward_response,
    parse_forward_request,
    parse_forward_response,
    serialize_forward_request,
)
from expertd.v1 import expertd_pb2 as pb

i64 = st.integers(-(2**63), 2**63 - 1)
tensors = st.builds(
    pb.Tensor,
    dtype=st.integers(-(2**31), 2**31 - 1),
    shape=st.lists(i64, max_size=4),
    data=st.binary(max_size=64),
)


@st.composite
def requests(draw):
    fields = {
        "layer": draw(st.integers(0, 2**32 - 1)),
        "request_id": draw(st.integers(0, 2**64 - 1)),
        "trace_id": draw(st.text(max_size=8)),
        "instance_id": draw(st.text(max_size=8)),
        "timeout_us": draw(st.integers(0, 2**64 - 1)),
    }
    for name in ("hidden_states", "topk_ids", "topk_weights"):
        if draw(st.booleans()):
            fields[name] = draw(tensors)
    return pb.ForwardRequest(**fields)


def same(view, msg: pb.ForwardRequest) -> None:
    for name in ("layer", "request_id", "trace_id", "instance_id", "timeout_us"):
        assert getattr(view, name) == getattr(msg, name), name
    for name in ("hidden_states", "topk_ids", "topk_weights"):
        assert view.HasField(name) == msg.HasField(name), name
        if msg.HasField(name):
            got, want = getattr(view, name), getattr(msg, name)
            assert (got.dtype, list(got.shape), bytes(got.data)) == (
                want.dtype,
                list(want.shape),
                want.data,
            ), name


@settings(max_examples=300, deadline=None, derandomize=True)
@given(requests(), st.binary(max_size=16))
def test_agrees_with_protobuf(msg, unknown_tail):
    raw = msg.SerializeToString()
    same(parse_forward_request(raw), msg)
    # Unknown fields after the known ones (field 99, length-delimited) are skipped.
    extra = raw + b"\x9a\x06" + bytes([len(unknown_tail)]) + unknown_tail
    same(parse_forward_request(extra), pb.ForwardRequest.FromString(extra))


def test_unpacked_shape_and_repeated_messages_merge():
    a = pb.ForwardRequest(hidden_states=pb.Tensor(dtype=1, shape=[2]))
    b = pb.ForwardRequest(hidden_states=pb.Tensor(shape=[3], data=b"xy"))
    raw = a.SerializeToString() + b.SerializeToString()  # protobuf merges the two
    same(parse_forward_request(raw), pb.ForwardRequest.FromString(raw))


@settings(max_examples=500, deadline=None, derandomize=True)
@given(st.binary(max_size=64))
def test_refuses_what_protobuf_refuses(raw):
    try:
        msg = pb.ForwardRequest.FromString(raw)
    except DecodeError:
        try:
            parse_forward_request(raw)
        except DecodeError:
            return
        raise AssertionError(f"accepted bytes protobuf refuses: {raw!r}") from None
    try:
        view = parse_forward_request(raw)
    except DecodeError:
        return  # stricter on odd encodings (groups): still the caller's mistake
    same(view, msg)


@st.composite
def responses(draw):
    fields = {"request_id": draw(st.integers(0, 2**64 - 1))}
    if draw(st.booleans()):
        fields["output"] = draw(tensors)
    if draw(st.booleans()):
        fields["error"] = pb.Error(
            code=draw(st.integers(-(2**31), 2**31 - 1)), message=draw(st.text(max_size=8))
        )
    if draw(st.booleans()):
        fields["timing"] = pb.Timing(
            queue_us=draw(st.integers(0, 2**64 - 1)), batch_tokens=draw(st.integers(0, 2**32 - 1))
        )
    return pb.ForwardResponse(**fields)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(responses())
def test_response_reader_agrees_with_protobuf(msg):
    view = parse_forward_response(msg.SerializeToString())
    assert view.request_id == msg.request_id
    for name in ("output", "error"):
        assert view.HasField(name) == msg.HasField(name), name
    if msg.HasField("output"):
        got = view.output
        assert (got.dtype, list(got.shape), bytes(got.data)) == (
            msg.output.dtype,
            list(msg.output.shape),
            msg.output.data,
        )
    if msg.HasField("error"):
        assert (view.error.code, view.error.message) == (msg.error.code, msg.error.message)
    assert view.timing == msg.timing


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    st.integers(0, 2**64 - 1),
    st.integers(0, 6),
    st.lists(st.integers(0, 2**40), max_size=3),
    st.binary(max_size=64),
    st.none()
    | st.builds(pb.Timing, queue_us=st.integers(0, 2**40), batch_tokens=st.integers(0, 9)),
)
def test_response_writer_is_protobufs_bytes(request_id, dtype, shape, payload, timing):
    msg = pb.ForwardResponse(
        request_id=request_id, output=pb.Tensor(dtype=dtype, shape=shape, data=payload)
    )
    if timing is not None:
        msg.timing.CopyFrom(timing)
    got = encode_forward_response(request_id, dtype, tuple(shape), payload, timing)
    assert pb.ForwardResponse.FromString(got) == msg
    assert got == msg.SerializeToString()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    st.integers(0, 2**32 - 1),
    st.integers(0, 6),
    st.integers(1, 4),
    st.integers(0, 2**64 - 1),
    st.text(max_size=6),
    st.text(max_size=6),
    st.integers(0, 2**64 - 1),
)
def test_request_writer_is_protobufs_bytes(layer, m, k, request_id, trace, instance, timeout):
    gen = torch.Generator().manual_seed(m * 7 + k)
    x = torch.randn((m, 16), generator=gen).to(torch.bfloat16)
    ids = torch.randint(-1, 9, (m, k), generator=gen, dtype=torch.int32)
    w = torch.rand((m, k), generator=gen)
    out = ForwardRequestOut(layer, x, ids, w)
    out.request_id, out.trace_id, out.instance_id, out.timeout_us = (
        request_id,
        trace,
        instance,
        timeout,
    )
    msg = pb.ForwardRequest(
        layer=layer,
        hidden_states=wire.encode(x),
        topk_ids=wire.encode(ids),
        topk_weights=wire.encode(w),
        request_id=request_id,
        trace_id=trace,
        instance_id=instance,
        timeout_us=timeout,
    )
    assert serialize_forward_request(out) == msg.SerializeToString()


@pytest.mark.parametrize("in_place_min", [1 << 16, 0])  # joined, and written in place
@pytest.mark.parametrize(
    "m,picked,h",
    [(6, [0, 2, 5], 16), (6, [], 16), (3, [0, 1, 2], 8), (900, list(range(1, 900, 2)), 512)],
)
def test_request_writer_gathers_picked_rows_into_protobufs_bytes(
    monkeypatch, in_place_min, m, picked, h
):
    """A shard's share of the call's rows, gathered straight into the request bytes,
    gives protobuf's bytes for the message holding those rows; the caller's tensors
    and the varints shared between messages stay as they were."""
    monkeypatch.setattr(codec, "IN_PLACE_MIN", in_place_min)
    gen = torch.Generator().manual_seed(m + len(picked))
    x = torch.randn((m, h), generator=gen).to(torch.bfloat16)
    before = x.clone()
    rows = np.array(picked, dtype=np.int64)
    ids = torch.randint(-1, 9, (len(picked), 8), generator=gen, dtype=torch.int32)
    w = torch.rand((len(picked), 8), generator=gen)
    out = ForwardRequestOut(3, x, ids, w, rows=rows)
    out.request_id, out.trace_id, out.timeout_us = 77, "trace", 1_000_000
    sent = x[torch.from_numpy(rows)] if picked else x[:0]
    msg = pb.ForwardRequest(
        layer=3,
        hidden_states=wire.encode(sent),
        topk_ids=wire.encode(ids),
        topk_weights=wire.encode(w),
        request_id=77,
        trace_id="trace",
        timeout_us=1_000_000,
    )
    want = msg.SerializeToString()
    for _ in range(2):  # the second time from the cached headers
        assert serialize_forward_request(out) == want
    assert torch.equal(out.hidden_states.view(torch.int16), sent.view(torch.int16))
    assert torch.equal(x.view(torch.int16), before.view(torch.int16))
    assert [codec._put_varint(i) for i in range(0x80)] == [bytes((i,)) for i in range(0x80)]
    if picked:
        with pytest.raises(ValueError, match="rows to send"):
            serialize_forward_request(ForwardRequestOut(3, x, ids, w, rows=rows + m))
