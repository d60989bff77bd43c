"""Finite but huge inputs whose output overflows: the request is refused with
INVALID_ARGUMENT naming the token and the cause, counted in the metrics, and a
neighbour merged into the same batch still gets its correct answer."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from conftest import hidden, routing, shard_config

from expertd import wire
from expertd.client import ExpertClient, ShardCallError
from expertd.kernels import reference_forward, relative_error
from expertd.server.app import BackgroundServer
from expertd.server.bank import ExpertBank
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import expertd_pb2_grpc as pb_grpc

ALL = dict(num_shards=1)  # one shard owning all 64 experts


@pytest.fixture(scope="module")
def bank_all():
    return ExpertBank.load(shard_config(0, **ALL), progress=lambda _m: None)


def nonfinite_count(server, cause: str) -> float:
    value = server.servicer.metrics.registry.get_sample_value(
        "expertd_nonfinite_total", {"cause": cause}
    )
    return value or 0.0


def request(x, ids, w, rid: int = 0) -> pb.ForwardRequest:
    return pb.ForwardRequest(
        layer=0,
        request_id=rid,
        hidden_states=wire.encode(x),
        topk_ids=wire.encode(ids),
        topk_weights=wire.encode(w),
    )


def huge_cases():
    """(x, ids, w, the bad token): rows scaled by 1e20, a route weight of 3e38."""
    gen = torch.Generator().manual_seed(40)
    x = hidden(6, gen)
    ids, w = routing(6, gen)
    scaled = x.clone()
    scaled[3] = (x[3].float() * 1e20).to(torch.bfloat16)
    assert torch.isfinite(scaled).all()
    heavy = w.clone()
    heavy[4, 0] = 3e38
    return [(scaled, ids, w, 3), (x, ids, heavy, 4)]


def test_overflowing_output_is_refused_and_counted(bank_all):
    with BackgroundServer(shard_config(0, **ALL), bank=bank_all) as server:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.ExpertServiceStub(ch)
            for x, ids, w, token in huge_cases():
                with pytest.raises(grpc.RpcError) as info:
                    stub.Forward(request(x, ids, w), timeout=30)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                details = info.value.details()
                assert f"token {token}" in details and "overflow" in details, details
                # The same over the stream: an error answer, never an output.
                (reply,) = stub.ForwardStream(iter([request(x, ids, w, rid=5)]), timeout=30)
                assert reply.HasField("error") and not reply.HasField("output")
                assert reply.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                assert f"token {token}" in reply.error.message
        assert nonfinite_count(server, "output") == 4
        assert nonfinite_count(server, "input") == 0
        # NaN in the input is counted apart, and named as an input.
        with grpc.insecure_channel(server.address) as ch:
            x, ids, w, _ = huge_cases()[1]
            x = x.clone()
            x[1, 7] = float("nan")
            with pytest.raises(grpc.RpcError, match=r"hidden_states\[1, 7\]"):
                pb_grpc.ExpertServiceStub(ch).Forward(request(x, ids, w), timeout=30)
        assert nonfinite_count(server, "input") == 1


def test_the_sdk_raises_a_shard_error_for_an_overflow(bank_all):
    with BackgroundServer(shard_config(0, **ALL), bank=bank_all) as server:
        for transport in ("stream", "unary"):
            with ExpertClient([server.address], timeout=10, transport=transport) as client:
                x, ids, w, token = huge_cases()[0]
                with pytest.raises(ShardCallError) as info:
                    client.forward(0, x, ids, w)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert server.address in str(info.value) and f"token {token}" in str(info.value)


def test_one_overflowing_request_does_not_fail_its_batch_neighbours(bank_all, full_layers):
    """Requests held for 300 ms so they merge: the bad one fails, the others are right."""
    config = shard_config(0, batch_window_us=300_000, **ALL)
    gen = torch.Generator().manual_seed(41)
    good = []
    for m in (3, 5):
        x = hidden(m, gen)
        good.append((x, *routing(m, gen)))
    bad_x, bad_ids, bad_w, token = huge_cases()[0]

    async def go(address: str):
        async with grpc.aio.insecure_channel(address) as ch:
            stub = pb_grpc.ExpertServiceStub(ch)
            calls = [stub.Forward(request(x, i, w), timeout=30) for x, i, w in good]
            calls.insert(1, stub.Forward(request(bad_x, bad_ids, bad_w), timeout=30))
            return await asyncio.gather(*calls, return_exceptions=True)

    with BackgroundServer(config, bank=bank_all) as server:
        first, refused, second = asyncio.run(go(server.address))
    assert isinstance(refused, grpc.aio.AioRpcError)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"token {token}" in refused.details()
    for reply, (x, ids, w) in zip((first, second), good, strict=True):
        assert reply.timing.batch_requests == 3  # merged with the bad one
        out = wire.decode(reply.output, "output")
        assert torch.isfinite(out.float()).all()
        assert relative_error(out, reference_forward(full_layers[0], x, ids, w)) <= 1e-2
