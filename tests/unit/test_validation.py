"""Every bad input of docs/protocol.md gets the right status and a message naming
the problem, and the server answers a good request correctly afterwards."""

from __future__ import annotations

import re

import grpc
import pytest
import torch
from conftest import hidden, shard_config

from expertd import wire
from expertd.kernels import reference_forward, relative_error
from expertd.server.app import BackgroundServer
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import expertd_pb2_grpc as pb_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def good_parts(m: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = hidden(m, gen)
    ids = torch.randint(0, 8, (m, 2), generator=gen, dtype=torch.int32)  # shard 0's experts
    w = torch.rand((m, 2), generator=gen)
    return x, ids, w


def request(x, ids, w, layer: int = 0) -> pb.ForwardRequest:
    return pb.ForwardRequest(
        layer=layer,
        hidden_states=wire.encode(x),
        topk_ids=wire.encode(ids),
        topk_weights=wire.encode(w),
    )


def raw(dtype, shape, data: bytes) -> pb.Tensor:
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


def _bad_cases():
    x, ids, w = good_parts()
    r = lambda: request(x, ids, w)  # noqa: E731
    cases = {}

    def case(name, code, match, mutate):
        req = r()
        mutate(req)
        cases[name] = (req, code, match)

    case(
        "hidden dtype",
        INVALID,
        "hidden_states: dtype FP32",
        lambda q: q.hidden_states.CopyFrom(wire.encode(x.float())),
    )
    case(
        "hidden width",
        INVALID,
        "width 256",
        lambda q: q.hidden_states.CopyFrom(wire.encode(x[:, :256])),
    )
    case(
        "hidden rank",
        INVALID,
        "rank 1",
        lambda q: q.hidden_states.CopyFrom(wire.encode(x.flatten())),
    )
    case(
        "hidden short bytes",
        INVALID,
        "hidden_states: 4094 bytes",
        lambda q: setattr(q.hidden_states, "data", q.hidden_states.data[:-2]),
    )
    case(
        "huge declared shape",
        INVALID,
        "hidden_states",
        lambda q: q.hidden_states.CopyFrom(raw(pb.BF16, [1 << 40, 512], b"\0" * 64)),
    )
    case(
        "negative dim",
        INVALID,
        "negative dimension",
        lambda q: q.hidden_states.CopyFrom(raw(pb.BF16, [-1, 512], b"")),
    )
    case(
        "unknown dtype",
        INVALID,
        "unsupported dtype|dtype",
        lambda q: setattr(q.topk_ids, "dtype", 42),
    )
    case(
        "ids dtype",
        INVALID,
        "topk_ids: dtype FP32",
        lambda q: q.topk_ids.CopyFrom(wire.encode(ids.float())),
    )
    case(
        "rows disagree",
        INVALID,
        "topk_ids: 3 rows",
        lambda q: q.topk_ids.CopyFrom(wire.encode(ids[:3])),
    )
    case(
        "weights shape",
        INVALID,
        "topk_weights: shape",
        lambda q: q.topk_weights.CopyFrom(wire.encode(w[:, :1])),
    )
    case(
        "weights dtype",
        INVALID,
        "topk_weights: dtype INT32",
        lambda q: q.topk_weights.CopyFrom(wire.encode(ids)),
    )
    big = ids.clone()
    big[1, 1] = 64
    case(
        "id too large",
        INVALID,
        r"topk_ids\[1, 1\] = 64",
        lambda q: q.topk_ids.CopyFrom(wire.encode(big)),
    )
    small = ids.clone()
    small[0, 0] = -2
    case(
        "id too small",
        INVALID,
        r"topk_ids\[0, 0\] = -2",
        lambda q: q.topk_ids.CopyFrom(wire.encode(small)),
    )
    nan_x = x.clone()
    nan_x[2, 7] = float("nan")
    case(
        "NaN hidden",
        INVALID,
        r"hidden_states\[2, 7\] is nan",
        lambda q: q.hidden_states.CopyFrom(wire.encode(nan_x)),
    )
    inf_w = w.clone()
    inf_w[0, 1] = float("inf")
    case(
        "Inf weight",
        INVALID,
        r"topk_weights\[0, 1\] is inf",
        lambda q: q.topk_weights.CopyFrom(wire.encode(inf_w)),
    )
    case("missing ids", INVALID, "missing input topk_ids", lambda q: q.ClearField("topk_ids"))
    case(
        "missing hidden",
        INVALID,
        "missing input hidden_states",
        lambda q: q.ClearField("hidden_states"),
    )
    case(
        "top_k zero",
        INVALID,
        "top_k 0",
        lambda q: (
            q.topk_ids.CopyFrom(wire.encode(ids[:, :0])),
            q.topk_weights.CopyFrom(wire.encode(w[:, :0])),
        ),
    )
    case(
        "unknown layer",
        grpc.StatusCode.NOT_FOUND,
        "layer 7 is not served",
        lambda q: setattr(q, "layer", 7),
    )
    return cases


BAD = _bad_cases()


@pytest.fixture(scope="module")
def stub(addresses):
    with grpc.insecure_channel(addresses[0]) as ch:
        yield pb_grpc.ExpertServiceStub(ch)


def assert_good_request_works(stub, full_layers):
    x, ids, w = good_parts(5, seed=9)
    out = wire.decode(stub.Forward(request(x, ids, w), timeout=10).output, "output")
    assert relative_error(out, reference_forward(full_layers[0], x, ids, w)) <= 1e-2


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_refused_then_good_served(stub, full_layers, name):
    req, code, match = BAD[name]
    with pytest.raises(grpc.RpcError) as info:
        stub.Forward(req, timeout=10)
    assert info.value.code() == code, info.value.details()
    assert re.search(match, info.value.details()), info.value.details()
    assert_good_request_works(stub, full_layers)


@pytest.fixture(scope="module")
def limited(full_layers):
    """A shard that accepts at most 64 tokens per request (so ~1.1 MiB messages)."""
    with (
        BackgroundServer(shard_config(0, max_tokens=64)) as server,
        grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", -1)]) as ch,
    ):
        yield pb_grpc.ExpertServiceStub(ch)


def test_just_under_the_limit_succeeds(limited, full_layers):
    x, ids, w = good_parts(64, seed=3)
    out = wire.decode(limited.Forward(request(x, ids, w), timeout=30).output, "output")
    assert relative_error(out, reference_forward(full_layers[0], x, ids, w)) <= 1e-2


def test_too_many_tokens_is_resource_exhausted(limited, full_layers):
    x, ids, w = good_parts(65, seed=4)
    with pytest.raises(grpc.RpcError) as info:
        limited.Forward(request(x, ids, w), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "at most 64" in info.value.details()
    assert_good_request_works(limited, full_layers)


def test_oversized_message_is_resource_exhausted(limited, full_layers):
    x, ids, w = good_parts(2000, seed=5)  # ~2 MiB: over the server's receive limit
    with pytest.raises(grpc.RpcError) as info:
        limited.Forward(request(x, ids, w), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_good_request_works(limited, full_layers)


@pytest.mark.parametrize("method", ["Forward", "ForwardStream", "Describe"])
def test_undecodable_bytes_are_invalid_argument(addresses, stub, full_layers, method):
    path = f"/expertd.v1.ExpertService/{method}"
    with grpc.insecure_channel(addresses[0]) as ch, pytest.raises(grpc.RpcError) as info:
        if method == "ForwardStream":  # raw bytes: no serializer on this side
            list(ch.stream_stream(path)(iter([b"\xff\xff\xff"]), timeout=10))
        else:
            ch.unary_unary(path)(b"\xff\xff\xff", timeout=10)
    assert info.value.code() == INVALID
    assert f"not a valid message for {path}" in info.value.details()
    assert_good_request_works(stub, full_layers)
