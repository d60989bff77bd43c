"""The client's API edges, against a tiny fake shard of our own (so they need no
server feature): bearer token, request id and metadata on the wire, which
statuses are retried, TLS and mutual TLS; then submit() and asyncio concurrency
and RemoteExperts against the real 8-shard service."""

from __future__ import annotations

import asyncio
import gc
import logging
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from conftest import PRESET, hidden, routing

from expertd import wire
from expertd.aioloop import run, start_loop_thread, stop_loop_thread
from expertd.client import (
    TLS,
    AsyncExpertClient,
    CoverageError,
    ExpertClient,
    RemoteExperts,
    ShardCallError,
)
from expertd.kernels import reference_forward, relative_error
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import expertd_pb2_grpc as pb_grpc

H = 16


class FakeShard(pb_grpc.ExpertServiceServicer, grpc.aio.ServerInterceptor):
    """Owns experts 0-7 of layer 0 (H=16), answers zeros or `fail_with`, and
    keeps the metadata of every call."""

    def __init__(self, credentials: grpc.ServerCredentials | None = None) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []
        self.fail_with: grpc.StatusCode | None = None
        self._loop, self._thread = start_loop_thread("fake-shard")
        self.port = asyncio.run_coroutine_threadsafe(self._start(credentials), self._loop).result()
        self.address = f"127.0.0.1:{self.port}"

    async def _start(self, credentials) -> int:
        self._server = grpc.aio.server(interceptors=[self])
        pb_grpc.add_ExpertServiceServicer_to_server(self, self._server)
        if credentials is None:
            port = self._server.add_insecure_port("127.0.0.1:0")
        else:
            port = self._server.add_secure_port("127.0.0.1:0", credentials)
        await self._server.start()
        return port

    async def intercept_service(self, continuation, details):
        method = details.method.rsplit("/", 1)[-1]
        self.calls.append((method, dict(details.invocation_metadata)))
        return await continuation(details)

    def forwards(self) -> list[dict[str, str]]:
        return [md for method, md in self.calls if method == "Forward"]

    async def Describe(self, request, context):
        return pb.DescribeResponse(
            hidden_size=H, intermediate_size=H, num_experts=8, top_k=2,
            layers=[0], experts=range(8), instance_id=str(self.port),
        )  # fmt: skip

    async def Forward(self, request, context):
        if self.fail_with is not None:
            await context.abort(self.fail_with, f"told to fail with {self.fail_with.name}")
        rows = request.hidden_states.shape[0]
        return pb.ForwardResponse(output=wire.encode(torch.zeros(rows, H, dtype=torch.bfloat16)))

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result()
        stop_loop_thread(self._loop, self._thread)


@pytest.fixture
def fakes():
    shards = [FakeShard(), FakeShard()]
    yield shards
    for shard in shards:
        shard.stop()


def call(client, **kwargs):
    ids = torch.tensor([[0, 5], [3, -1]], dtype=torch.int32)
    return client.forward(0, torch.ones(2, H), ids, torch.ones(2, 2), **kwargs)


def test_token_request_id_and_metadata_on_the_wire(fakes):
    fake = fakes[0]
    # The fake shard answers unary Forward only: these tests look at unary metadata.
    md = {"X-Tenant": "a"}
    with ExpertClient([fake.address], token="s3cret", metadata=md, transport="unary") as client:
        assert call(client, request_id="req-42").shape == (2, H)
        call(client, token="other", metadata=[("x-trace", "t1")])
    describe = next(md for method, md in fake.calls if method == "Describe")
    first, second = fake.forwards()
    assert describe["authorization"] == "Bearer s3cret"
    assert first["authorization"] == "Bearer s3cret" and first["x-request-id"] == "req-42"
    assert first["x-tenant"] == "a"
    assert second["authorization"] == "Bearer other" and second["x-trace"] == "t1"
    assert second["x-request-id"]  # one is made up when the caller gives none


def test_unavailable_goes_to_the_other_replica(fakes):
    with ExpertClient([f.address for f in fakes], timeout=5, transport="unary") as client:
        assert len(client.topology.shards) == 1  # same experts and layers: replicas
        fakes[0].fail_with = grpc.StatusCode.UNAVAILABLE
        for _ in range(3):
            assert (call(client) == 0).all()
        assert not client.stats()[fakes[0].address]["alive"]
    assert len(fakes[0].forwards()) == 1  # tried once, then out of rotation
    assert len(fakes[1].forwards()) == 3


def test_caller_errors_are_not_retried(fakes):
    with ExpertClient([f.address for f in fakes], timeout=5, transport="unary") as client:
        for fake in fakes:
            fake.fail_with = grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(ShardCallError) as info:
            call(client)
        assert client.stats()[fakes[0].address]["alive"]
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert sum(len(f.forwards()) for f in fakes) == 1


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_mutual_tls_with_server_name_override(tmp_path):
    """A private CA signs a server cert for expertd.test and a client cert; the
    client reaches 127.0.0.1 by checking the name expertd.test."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=ca",
            "-keyout", "ca.key", "-out", "ca.pem", cwd=tmp_path)  # fmt: skip
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=tmp_path)  # fmt: skip
        (tmp_path / "ext").write_text("subjectAltName=DNS:expertd.test\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "1", "-extfile", "ext", "-out", f"{name}.pem",
                cwd=tmp_path)  # fmt: skip
    read = lambda name: (tmp_path / name).read_bytes()  # noqa: E731
    credentials = grpc.ssl_server_credentials(
        [(read("server.key"), read("server.pem"))], read("ca.pem"), require_client_auth=True
    )
    fake = FakeShard(credentials)
    try:
        tls = TLS(tmp_path / "ca.pem", tmp_path / "client.key", tmp_path / "client.pem",
                  server_name="expertd.test")  # fmt: skip
        with ExpertClient([fake.address], tls=tls, timeout=5, transport="unary") as client:
            assert (call(client) == 0).all()
        with pytest.raises(CoverageError, match=fake.address):  # no client certificate
            ExpertClient([fake.address], tls=TLS(read("ca.pem"), server_name="expertd.test"),
                         discover_timeout=2)  # fmt: skip
    finally:
        fake.stop()
    with pytest.raises(ValueError, match="mutual TLS"):
        TLS(private_key=b"key only")


def test_submit_and_threads_many_in_flight(addresses, full_layers):
    gen = torch.Generator().manual_seed(11)
    work = []
    for i in range(24):
        ids, w = routing(1 + i % 5, gen)
        work.append((i % 2, hidden(1 + i % 5, gen), ids, w))
    with ExpertClient(addresses, timeout=30) as client:
        futures = [client.submit(*c) for c in work]  # all in flight at once
        with ThreadPoolExecutor(4) as pool:
            threaded = list(pool.map(lambda c: client.forward(*c), work))
        outs = [f.result() for f in futures]
    for out, other in zip(outs, threaded, strict=True):
        assert relative_error(out, other) <= 1e-2
    for (layer, x, ids, w), out in zip(work[:4], outs, strict=False):
        assert relative_error(out, reference_forward(full_layers[layer], x, ids, w)) <= 1e-2


def test_on_stream_client_runs_a_cpu_callers_calls_the_usual_way(addresses):
    """on_stream only changes calls of a CUDA caller: a CPU caller's answers are those
    of a default client, synchronize has nothing to wait for, none went on a stream."""
    gen = torch.Generator().manual_seed(5)
    x = hidden(3, gen)
    ids, w = routing(3, gen)
    with (
        ExpertClient(addresses, on_stream=True) as client,
        ExpertClient(addresses) as plain,
    ):
        got = client.forward(0, x, ids, w)
        client.synchronize()
        assert torch.equal(got, plain.forward(0, x, ids, w))
        assert all(s["stream_calls"] == 0 for s in client.stats().values())
        plain.synchronize()  # no on_stream: nothing to do


def test_clients_share_one_loop_and_close_alone(addresses, full_layers, caplog):
    """Every ExpertClient runs on the process's one client loop (shared_loop), which closing a
    client leaves running: the other client still answers, the closed one refuses with a clear
    error, and nothing is logged. (With a loop per client, each close logged "Task was destroyed
    but it is pending!" per shard stream, and grpc.aio's poller later raised "Event loop is
    closed" for events of the closed loop.)"""
    gen = torch.Generator().manual_seed(14)
    ids, w = routing(4, gen)
    x = hidden(4, gen)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        a = ExpertClient(addresses, timeout=30)
        b = ExpertClient(addresses, timeout=30)
        assert a._loop is b._loop and a._loop.is_running()
        a.forward(0, x, ids, w)
        a.close()
        a.close()  # twice: nothing more to do
        out = b.forward(0, x, ids, w)
        with pytest.raises(RuntimeError, match="closed"):
            a.forward(0, x, ids, w)
        b.close()
        del a, b
        gc.collect()
    assert relative_error(out, reference_forward(full_layers[0], x, ids, w)) <= 1e-2
    # (other loggers' INFO lines, such as an in-process server returning freed memory,
    # may land here too: only errors count)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_asyncio_many_in_flight(addresses, full_layers):
    gen = torch.Generator().manual_seed(12)
    work = [(i % 2, hidden(3, gen), *routing(3, gen)) for i in range(32)]

    async def go():
        async with await AsyncExpertClient.connect(addresses) as client:
            return await asyncio.gather(*(client.forward(*c) for c in work))

    outs = run(go())
    for (layer, x, ids, w), out in list(zip(work, outs, strict=True))[:6]:
        assert relative_error(out, reference_forward(full_layers[layer], x, ids, w)) <= 1e-2


def test_remote_experts_module_keeps_shape_and_dtype(addresses, full_layers):
    gen = torch.Generator().manual_seed(13)
    x = hidden(6, gen).float().reshape(2, 3, PRESET.hidden_size)  # [batch, seq, H], fp32
    ids, w = routing(6, gen)
    with ExpertClient(addresses) as client:
        experts = RemoteExperts(client, layer=1)
        out = experts(x, ids.reshape(2, 3, -1), w.reshape(2, 3, -1))
    assert out.shape == x.shape and out.dtype == torch.float32
    ref = reference_forward(full_layers[1], x.reshape(6, -1).to(torch.bfloat16), ids, w)
    assert relative_error(out.reshape(6, -1), ref) <= 1e-2
    assert "layer=1" in repr(experts)
