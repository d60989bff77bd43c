"""A flood against one real shard process (`expertd serve`, loopback): 2000
concurrent calls from one SDK client. Every call ends OK, RESOURCE_EXHAUSTED,
UNAVAILABLE or DEADLINE_EXCEEDED (never CANCELLED, never a hang); the server's
metrics count each overload refusal; the replica stays in rotation (busy is not
down) and a normal call right after the flood is answered at once.

The figures printed here (pytest -s) are for whatever machine runs it; the test
asserts outcomes, never speed.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import time
import urllib.request

import grpc
import pytest
import torch
from conftest import SEED, hidden, routing
from prometheus_client.parser import text_string_to_metric_families

from expertd.client import AsyncExpertClient, ShardCallError
from expertd.launcher import start_shard, stop_shards, wait_serving

pytestmark = pytest.mark.slow

CALLS = 2000
MAX_INFLIGHT = 128  # the server's admission limit here: a flood is sure to pass it
ENDINGS = {"OK", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED"}
SLACK_S = 10.0  # a flood's last call may end this long after its deadline (2-core CI)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def shard():
    """One process serving every expert of one layer, and its metrics port."""
    port = free_port()
    args = [
        *("--synthetic", "small", "--layers", "1", "--seed", str(SEED), "--num-shards", "1"),
        *("--torch-threads", "1", "--max-inflight", str(MAX_INFLIGHT)),
        *("--metrics-port", str(port)),
    ]
    proc = start_shard(args)
    wait_serving([proc], timeout=180)
    yield proc, port
    stop_shards([proc], timeout=10)


def scrape(port: int) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value, from the server's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


async def flood(address, transport, timeout, calls=CALLS, m=4, after_timeout=2.0):
    gen = torch.Generator().manual_seed(3)
    x = hidden(m, gen)
    ids, w = routing(m, gen)
    async with await AsyncExpertClient.connect([address], transport=transport) as client:
        await client.forward(0, x, ids, w, timeout=30)  # the stream is open, all is warm

        async def one() -> str:
            try:
                await client.forward(0, x, ids, w, timeout=timeout)
                return "OK"
            except ShardCallError as e:
                return e.code.name

        t0 = time.monotonic()
        endings = await asyncio.wait_for(
            asyncio.gather(*(one() for _ in range(calls))), timeout + SLACK_S
        )
        took = time.monotonic() - t0
        alive = client.stats()[address]["alive"]
        t1 = time.monotonic()
        after = await client.forward(0, x, ids, w, timeout=after_timeout)
        recover = time.monotonic() - t1
    return collections.Counter(endings), took, alive, after, recover


# The 1 s deadline is shorter than the flood: most calls give up while their
# requests are queued, and the next call must not wait behind them.
@pytest.mark.parametrize(
    ("transport", "timeout"), [("stream", 5.0), ("unary", 5.0), ("stream", 1.0)]
)
def test_flood_ends_in_clear_statuses_and_the_shard_recovers(shard, transport, timeout):
    proc, port = shard
    before = scrape(port)
    endings, took, alive, after, recover = asyncio.run(flood(proc.address, transport, timeout))
    now = scrape(port)
    refused = total(now, "expertd_overload_total") - total(before, "expertd_overload_total")
    exhausted = total(now, "expertd_requests_total", code="RESOURCE_EXHAUSTED") - total(
        before, "expertd_requests_total", code="RESOURCE_EXHAUSTED"
    )
    print(
        f"\n{CALLS} calls over {transport}, deadline {timeout} s: {dict(endings)} in {took:.1f} s;"
        f" server refused {refused:.0f} for overload; next call answered in {recover * 1e3:.0f} ms"
    )
    assert set(endings) <= ENDINGS, endings
    assert sum(endings.values()) == CALLS
    # Overload is refused explicitly and counted; gRPC core cancelled nothing.
    assert refused == exhausted
    if timeout >= 5:  # time enough: overload was met, and calls got through it
        assert refused > 0 and endings["OK"] > 0
    assert total(now, "expertd_requests_total", code="CANCELLED") == 0
    assert alive  # busy is not down
    assert after.shape == (4, 512) and torch.isfinite(after.float()).all()
    assert proc.alive()


def test_calls_that_gave_up_leave_no_backlog_on_the_stream(shard):
    """Calls of 32 tokens, far more than the shard computes within their 0.5 s: once
    they have given up, their requests must not still be sent and computed ahead
    of the next call on the same stream (that backlog was seconds of compute). The
    next call waits at most for the batch in flight when the flood ended."""
    proc, _ = shard
    endings, took, alive, after, recover = asyncio.run(
        flood(proc.address, "stream", 0.5, calls=1000, m=32, after_timeout=4.0)
    )
    print(
        f"\n1000 calls of 32 tokens, deadline 0.5 s: {dict(endings)} in {took:.1f} s;"
        f" next call answered in {recover * 1e3:.0f} ms"
    )
    assert set(endings) <= ENDINGS, endings
    assert alive and after.shape == (32, 512)


def test_core_does_not_cancel_a_burst_of_unary_calls(shard):
    """Raw unary calls, no SDK retries: every call is answered by the service,
    OK or RESOURCE_EXHAUSTED, and every refusal is in the metrics."""
    from expertd import wire
    from expertd.v1 import expertd_pb2 as pb
    from expertd.v1 import expertd_pb2_grpc as pb_grpc

    proc, port = shard
    gen = torch.Generator().manual_seed(4)
    x = hidden(2, gen)
    ids, w = routing(2, gen)
    request = pb.ForwardRequest(
        layer=0,
        hidden_states=wire.encode(x),
        topk_ids=wire.encode(ids),
        topk_weights=wire.encode(w),
    )

    async def burst():
        async with grpc.aio.insecure_channel(proc.address) as ch:
            stub = pb_grpc.ExpertServiceStub(ch)

            async def one() -> str:
                try:
                    await stub.Forward(request, timeout=30)
                    return "OK"
                except grpc.aio.AioRpcError as e:
                    return e.code().name

            return collections.Counter(await asyncio.gather(*(one() for _ in range(CALLS))))

    before = scrape(port)
    endings = asyncio.run(burst())
    now = scrape(port)
    print(f"\n{CALLS} raw unary calls at once: {dict(endings)}")
    assert set(endings) <= {"OK", "RESOURCE_EXHAUSTED"}, endings
    refused = total(now, "expertd_overload_total") - total(before, "expertd_overload_total")
    assert refused == endings["RESOURCE_EXHAUSTED"] > 0
