"""grpc.health.v1 Watch on the main port and on the plaintext health-only port:
it streams SERVING / NOT_SERVING like Check, and a drain (SIGTERM, or stopping an
embedded server) sends NOT_SERVING and ends every open Watch, so a watching client
never holds shutdown for the grace period."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time

import grpc
import pytest
from conftest import shard_config
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertd.launcher import start_shard, wait_serving
from expertd.server.app import BackgroundServer
from expertd.server.health import HealthServicer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
GRACE_S = 60  # a watch still open at SIGTERM would hold the process this long


class Watcher:
    """A Watch call read on a thread: the statuses seen, and how it ended."""

    def __init__(self, address: str, service: str = "") -> None:
        self.channel = grpc.insecure_channel(address)
        self.call = health_pb2_grpc.HealthStub(self.channel).Watch(
            health_pb2.HealthCheckRequest(service=service), timeout=GRACE_S * 2
        )
        self.statuses: list[int] = []
        self.error: grpc.RpcError | None = None
        self.ended = threading.Event()
        self.first = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for reply in self.call:
                self.statuses.append(reply.status)
                self.first.set()
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.first.set()
            self.ended.set()

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()


class HeldWrites:
    """A Watch's context whose writes finish only when released: a write still in
    flight (queued behind a loaded event loop) when the drain begins."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.writing = asyncio.Event()
        self.release = asyncio.Event()

    async def write(self, reply) -> None:
        self.writing.set()
        await self.release.wait()
        self.sent.append(reply.status)


def test_watch_sends_not_serving_when_shutdown_lands_during_a_write():
    async def scenario() -> list[int]:
        health = HealthServicer()
        await health.set("", SERVING)
        context = HeldWrites()
        watch = asyncio.create_task(health.Watch(health_pb2.HealthCheckRequest(), context))
        await asyncio.wait_for(context.writing.wait(), 5)  # SERVING's write under way
        await health.shutdown()
        context.release.set()
        await asyncio.wait_for(watch, 5)
        return context.sent

    assert asyncio.run(scenario()) == [SERVING, NOT_SERVING]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_watch_streams_like_check_and_ends_when_stopped():
    server = BackgroundServer(shard_config(0))
    watchers = [
        Watcher(server.address, name)
        for name in ("", "expertd.v1.ExpertService", "inference.GRPCInferenceService")
    ]
    unknown = Watcher(server.address, "no.such.Service")
    try:
        for w in [*watchers, unknown]:
            assert w.first.wait(30)
            assert w.error is None, (w.error.code(), w.error.details())
            assert not w.ended.is_set()  # still open: a watch streams until told otherwise
        assert [w.statuses for w in watchers] == [[SERVING]] * 3
        assert unknown.statuses == [SERVICE_UNKNOWN]
        with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10
            )
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "class" not in info.value.details() and "Error" not in info.value.details()
        t0 = time.monotonic()
        server.stop(grace_s=GRACE_S)
        assert time.monotonic() - t0 < 10, "an open Watch held the stop"
        for w in [*watchers, unknown]:
            assert w.ended.wait(10)
            assert w.error is None, (w.error.code(), w.error.details())
        assert [w.statuses for w in watchers] == [[SERVING, NOT_SERVING]] * 3
        assert unknown.statuses == [SERVICE_UNKNOWN, NOT_SERVING]
    finally:
        for w in [*watchers, unknown]:
            w.close()
        server.stop()


def test_sigterm_ends_watches_on_both_ports():
    health_address = f"127.0.0.1:{free_port()}"
    shard = start_shard(
        [
            *("--synthetic", "small", "--layers", "1", "--num-shards", "8"),
            *("--torch-threads", "1", "--grace", str(GRACE_S), "--drain-delay", "0.5"),
            *("--health-listen", health_address),
        ]
    )
    watchers = []
    try:
        wait_serving([shard], timeout=120)
        watchers = [Watcher(shard.address), Watcher(health_address)]
        for w in watchers:
            assert w.first.wait(30)
            assert w.error is None, (w.error.code(), w.error.details())
        assert [w.statuses for w in watchers] == [[SERVING], [SERVING]]
        t0 = time.monotonic()
        shard.process.send_signal(signal.SIGTERM)
        for w in watchers:
            assert w.ended.wait(GRACE_S / 2), "the watch was not ended by the drain"
            assert w.error is None, (w.error.code(), w.error.details())
        assert [w.statuses for w in watchers] == [[SERVING, NOT_SERVING]] * 2
        rc = shard.process.wait(timeout=GRACE_S)
        took = time.monotonic() - t0
        assert rc == 0, "\n".join(shard.log[-20:])
        assert took < 15, f"shutdown took {took:.1f} s with a watching client"
    finally:
        for w in watchers:
            w.close()
        if shard.alive():
            shard.process.kill()
            shard.process.wait()
