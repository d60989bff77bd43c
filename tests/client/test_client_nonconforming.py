"""A server that does not speak the protocol (a real grpc.aio server on a real
socket, answering badly): the SDK raises its own error at once, naming the
shard's address and the problem, and a shard whose Describe makes no sense is
taken out of rotation with the reason while the others serve. A server that is
busy (refuses for overload, or cancels) is retried, never taken for down."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch
from conftest import PRESET, hidden, shard_config

from expertd import wire
from expertd.aioloop import start_loop_thread, stop_loop_thread
from expertd.client import CoverageError, ExpertClient, ExpertdError, ShardCallError
from expertd.kernels import reference_forward, relative_error
from expertd.server.app import BackgroundServer
from expertd.v1 import expertd_pb2 as pb

SERVICE = "expertd.v1.ExpertService"
REAL = list(range(32))  # experts of the real shard (shard 0 of 2)
FAKE = list(range(32, 64))  # experts the fake claims


class FakeShard:
    """A grpc.aio server on its own loop thread that describes itself as shard 1
    of 2 of the `small` preset and answers Forward as `mode` says."""

    def __init__(self, mode: str, describe: dict | None = None, refusals: int = 0) -> None:
        self.mode = mode
        self.refusals = refusals  # refuse_<status> modes: refuse this many calls first
        fields = dict(
            version="0",
            backend="fake",
            device="cpu",
            hidden_size=PRESET.hidden_size,
            intermediate_size=PRESET.intermediate_size,
            num_experts=PRESET.num_experts,
            top_k=8,
            layers=[0, 1],
            experts=FAKE,
            activation_dtype=pb.BF16,
            output_dtype=pb.BF16,
            instance_id="fake",
            max_tokens_per_request=16384,
            max_message_bytes=1 << 30,
            shard_index=1,
            num_shards=2,
        )
        fields.update(describe or {})
        self.info = pb.DescribeResponse(**fields)
        self.forwards = 0
        self.streams = 0
        self._loop, self._thread = start_loop_thread("fake-shard")
        self._server, port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        self.address = f"127.0.0.1:{port}"

    async def _start(self):
        raw = bytes  # answers are serialized here (or are garbage on purpose)
        handlers = {
            "Describe": grpc.unary_unary_rpc_method_handler(
                self.describe,
                request_deserializer=pb.DescribeRequest.FromString,
                response_serializer=pb.DescribeResponse.SerializeToString,
            ),
            "Forward": grpc.unary_unary_rpc_method_handler(
                self.forward,
                request_deserializer=pb.ForwardRequest.FromString,
                response_serializer=raw,
            ),
            "ForwardStream": grpc.stream_stream_rpc_method_handler(
                self.stream,
                request_deserializer=pb.ForwardRequest.FromString,
                response_serializer=raw,
            ),
        }
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    async def describe(self, request, context):
        return self.info

    def answer(self, req: pb.ForwardRequest) -> bytes:
        self.forwards += 1
        rows = req.hidden_states.shape[0]
        out = wire.encode(torch.zeros((rows, PRESET.hidden_size), dtype=torch.bfloat16))
        rid = req.request_id
        if self.mode == "error_ok":  # status OK, an error inside
            code = grpc.StatusCode.INTERNAL.value[0]
            reply = pb.ForwardResponse(request_id=rid, error=pb.Error(code=code, message="boom"))
        elif self.mode == "empty":
            reply = pb.ForwardResponse(request_id=rid)
        elif self.mode == "short":  # one row short
            out.shape[0] = rows - 1
            out.data = out.data[: (rows - 1) * PRESET.hidden_size * 2]
            reply = pb.ForwardResponse(request_id=rid, output=out)
        elif self.mode == "garbage":
            return b"\x0f\xff\xff"  # field 1 with wire type 7: not protobuf
        else:
            reply = pb.ForwardResponse(request_id=rid, output=out)
        return reply.SerializeToString()

    async def forward(self, request, context):
        if self.mode.startswith("refuse_") and self.forwards < self.refusals:
            self.forwards += 1
            code = grpc.StatusCode[self.mode.removeprefix("refuse_").upper()]
            await context.abort(code, "server overloaded: 9 requests in flight (limit 8)")
        return self.answer(request)

    async def stream(self, requests, context):
        self.streams += 1
        if self.mode == "wedge_first_stream" and self.streams == 1:
            async for _req in requests:  # reads on, never answers
                self.forwards += 1
            return
        async for req in requests:
            yield self.answer(req)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result(30)
        stop_loop_thread(self._loop, self._thread)


@pytest.fixture(scope="module")
def real():
    server = BackgroundServer(shard_config(0, num_shards=2))
    yield server
    server.stop()


def case(experts: list[int], m: int = 4):
    gen = torch.Generator().manual_seed(sum(experts))
    x = hidden(m, gen)
    ids = torch.tensor([experts] * m, dtype=torch.int32)
    return x, ids, torch.rand((m, len(experts)), generator=gen)


@pytest.mark.parametrize(
    ("transport", "mode", "says"),
    [
        ("unary", "error_ok", "status OK but an error inside: INTERNAL: boom"),
        ("stream", "error_ok", "INTERNAL: boom"),  # the stream's own error answer
        *((t, "empty", "no output") for t in ("unary", "stream")),
        *((t, "short", "output shape [3, 512], expected [4, 512]") for t in ("unary", "stream")),
        ("unary", "garbage", "could not be decoded"),
        ("stream", "garbage", "undecodable answer"),
    ],
)
def test_bad_answer_is_an_sdk_error_at_once(real, full_layers, transport, mode, says):
    fake = FakeShard(mode)
    try:
        with ExpertClient([real.address, fake.address], timeout=20, transport=transport) as c:
            x, ids, w = case([FAKE[0], FAKE[5]])
            t0 = time.monotonic()
            with pytest.raises(ShardCallError) as info:
                c.forward(0, x, ids, w)
            assert time.monotonic() - t0 < 5  # at once, not at the 20 s deadline
            assert isinstance(info.value, ExpertdError)
            assert info.value.address == fake.address
            assert fake.address in str(info.value) and says in str(info.value), str(info.value)
            assert fake.forwards >= 1
            # The real shard is untouched by its neighbour's failure.
            x, ids, w = case([REAL[1], REAL[9]])
            out = c.forward(0, x, ids, w)
            assert relative_error(out, reference_forward(full_layers[0], x, ids, w)) <= 1e-2
    finally:
        fake.stop()


@pytest.mark.parametrize(
    ("describe", "says"),
    [
        ({"experts": [*FAKE, 64]}, "expert ids 64 are outside [0, 64)"),
        ({"experts": [*FAKE, 100]}, "expert ids 100 are outside [0, 64)"),
        ({"hidden_size": 0}, "hidden_size is 0"),
    ],
)
def test_bad_describe_takes_only_that_shard_out(real, full_layers, describe, says):
    fake = FakeShard("good", describe)
    try:
        with ExpertClient([real.address, fake.address], timeout=20) as client:
            why = client.unreachable.get(fake.address, "")
            assert says in why and "Describe" in why, client.unreachable
            assert real.address not in client.unreachable
            # Calls that only need the real shard are served, and right.
            x, ids, w = case([REAL[0], REAL[17], REAL[31]])
            out = client.forward(1, x, ids, w)
            assert relative_error(out, reference_forward(full_layers[1], x, ids, w)) <= 1e-2
            # Calls that need the fake's experts name it and why.
            x, ids, w = case([REAL[0], FAKE[3]])
            t0 = time.monotonic()
            with pytest.raises(CoverageError) as info:
                client.forward(0, x, ids, w)
            assert time.monotonic() - t0 < 5
            assert fake.address in str(info.value) and says in str(info.value)
        assert fake.forwards == 0
    finally:
        fake.stop()


def test_only_bad_describes_fail_discovery_with_the_reason():
    fake = FakeShard("good", {"experts": [*FAKE, 99]})
    try:
        with pytest.raises(CoverageError, match="expert ids 99 are outside"):
            ExpertClient([fake.address], discover_timeout=5)
    finally:
        fake.stop()


def test_a_wedged_stream_is_replaced_for_the_next_call():
    """The first stream takes requests and never answers (the replica is otherwise
    healthy): the call waiting on it times out, and the next call goes out on a
    fresh stream instead of waiting behind it."""
    fake = FakeShard("wedge_first_stream")
    try:
        with ExpertClient([fake.address], timeout=20, transport="stream") as client:
            x, ids, w = case([FAKE[0], FAKE[1]])
            with pytest.raises(ShardCallError) as info:
                client.forward(0, x, ids, w, timeout=1.0)
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            out = client.forward(0, x, ids, w, timeout=5.0)
            assert out.shape == (4, PRESET.hidden_size)
            assert fake.streams == 2 and fake.address not in client.unreachable
    finally:
        fake.stop()


def test_a_busy_replica_is_retried_after_a_pause_and_kept():
    """Overload refusals (RESOURCE_EXHAUSTED for a request within the limits its
    Describe gave): the SDK pauses and sends again, within the deadline, and the
    only replica stays in rotation."""
    fake = FakeShard("refuse_resource_exhausted", refusals=3)
    try:
        with ExpertClient([fake.address], timeout=20, transport="unary") as client:
            x, ids, w = case([FAKE[2], FAKE[7]])
            out = client.forward(0, x, ids, w)
            assert out.shape == (4, PRESET.hidden_size)
            assert fake.forwards == 4  # three refusals, then the answer
            assert client.unreachable == {}
    finally:
        fake.stop()


def test_overload_past_the_retries_is_resource_exhausted_and_the_replica_stays():
    fake = FakeShard("refuse_resource_exhausted", refusals=1000)
    try:
        with ExpertClient([fake.address], timeout=20, transport="unary", busy_retries=2) as c:
            x, ids, w = case([FAKE[2]])
            t0 = time.monotonic()
            with pytest.raises(ShardCallError) as info:
                c.forward(0, x, ids, w)
            assert time.monotonic() - t0 < 5
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "overloaded" in str(info.value) and fake.address in str(info.value)
            assert fake.forwards == 3 and c.unreachable == {}
    finally:
        fake.stop()


def test_a_request_over_the_described_limit_is_not_retried():
    """RESOURCE_EXHAUSTED for a request larger than the server said it takes is
    the caller's problem: raised at once, not sent again."""
    fake = FakeShard("refuse_resource_exhausted", {"max_tokens_per_request": 2}, refusals=1000)
    try:
        with ExpertClient([fake.address], timeout=20, transport="unary") as client:
            x, ids, w = case([FAKE[2]])  # 4 tokens
            with pytest.raises(ShardCallError) as info:
                client.forward(0, x, ids, w)
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert fake.forwards == 1
    finally:
        fake.stop()


def test_a_cancelled_call_does_not_take_the_replica_out():
    fake = FakeShard("refuse_cancelled", refusals=1)
    try:
        with ExpertClient([fake.address], timeout=20, transport="unary") as client:
            x, ids, w = case([FAKE[4]])
            with pytest.raises(ShardCallError) as info:
                client.forward(0, x, ids, w)
            assert info.value.code == grpc.StatusCode.CANCELLED
            assert client.unreachable == {}
            assert client.forward(0, x, ids, w).shape == (4, PRESET.hidden_size)
    finally:
        fake.stop()
