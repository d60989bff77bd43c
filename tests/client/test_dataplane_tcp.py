"""The raw TCP data plane (docs/dataplane.md, "Across hosts: raw TCP") end to end:
real shard processes, the real client, real sockets. `transport="tcp"` forces it
between processes of one host. Results are bit for bit those of the gRPC path; a
shard's checks answer through the connection and it keeps serving; a stopped
shard costs the call its deadline and a killed one fails it at once; a hostile
connection (no token, a stale one, an impossible header) is refused or cut off
without touching anyone else's calls; a vanished client frees its lease."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import numpy as np
import pytest
import torch
from conftest import hidden, routing, shard_config

from expertd import rawtcp
from expertd.client import AsyncExpertClient, ExpertClient, ShardCallError
from expertd.client.channels import ExpertStub
from expertd.client.stream import StreamCallError
from expertd.launcher import start_shard, stop_shards, wait_serving
from expertd.server.app import BackgroundServer
from expertd.v1 import expertd_pb2 as pb

SERVE = ["--synthetic", "small", "--layers", "1", "--seed", "7", "--device", "cpu"]
SERVE += ["--log-level", "WARNING", "--torch-threads", "1"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def case(m: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return hidden(m, gen), *routing(m, gen)


@pytest.fixture(scope="module")
def shards8():
    shards = [start_shard([*SERVE, "--num-shards", "8", "--shard", str(s)]) for s in range(8)]
    try:
        wait_serving(shards, timeout=300)
        yield shards
    finally:
        stop_shards(shards)


@pytest.fixture
def one_shard():
    shard = start_shard([*SERVE, "--num-shards", "1", "--shard", "0"])
    try:
        wait_serving([shard], timeout=300)
        yield shard
    finally:
        stop_shards([shard])


def register(address: str, **fields) -> pb.RegisterSlotsResponse:
    async def run():
        channel = grpc.aio.insecure_channel(address)
        try:
            request = pb.RegisterSlotsRequest(transport="tcp", **fields)
            return await ExpertStub(channel).RegisterSlots(request, timeout=10)
        finally:
            await channel.close()

    return asyncio.run(run())


def connect(address: str, port: int) -> socket.socket:
    sock = socket.create_connection((rawtcp.host_of(address), port), timeout=10)
    rawtcp.tune(sock)
    return sock


def closed(sock: socket.socket) -> bool:
    """Has the shard closed this connection (EOF, or a reset: it had unread bytes)?"""
    sock.settimeout(10)
    try:
        return sock.recv(256) == b""
    except ConnectionResetError:
        return True


def test_tcp_matches_grpc_bit_for_bit_on_8_shards(shards8):
    addresses = [s.address for s in shards8]
    with (
        ExpertClient(addresses, transport="tcp") as raw,
        ExpertClient(addresses, transport="grpc") as rpc,
    ):
        assert {s["transport"] for s in raw.stats().values()} == {"tcp"}
        for m in (0, 1, 7, 300):
            x, ids, w = case(m, 100 + m)
            if m > 2:  # some rows with a padded route
                ids[::2, -1] = -1
                w[::2, -1] = 0.0
            a, b = raw.forward(0, x, ids, w), rpc.forward(0, x, ids, w)
            assert a.shape == (m, 512) and a.dtype == torch.bfloat16
            assert torch.equal(bits(a), bits(b)), m
            sub = raw.submit(0, x, ids, w).result()  # the event loop's path, same bits
            assert torch.equal(bits(sub), bits(b)), m
        stats = raw.stats()
        assert all(s["calls"] > 0 for s in stats.values())
        timing = next(iter(stats.values()))["last_timing"]
        assert timing["batch_requests"] >= 1 and timing["compute_us"] > 0


def test_async_callers_share_the_slots_and_get_their_own_answers(shards8):
    """64 concurrent calls from one event loop over 8 shards: more calls than slots
    (the rest go over gRPC), each caller gets the answer to its own rows. (The shards
    batch concurrent calls together, and a CPU shard's sums may then round
    differently in the last bit, over gRPC as here: close, not equal.)"""
    addresses = [s.address for s in shards8]
    cases = [case(1 + i % 5, 500 + i) for i in range(64)]
    with ExpertClient(addresses, transport="grpc") as rpc:
        want = [rpc.forward(0, *c) for c in cases]

    async def run():
        async with await AsyncExpertClient.connect(addresses, transport="tcp") as client:
            got = await asyncio.gather(*(client.forward(0, *c) for c in cases))
            return got, client.stats()

    got, stats = asyncio.run(run())
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    assert {s["transport"] for s in stats.values()} == {"tcp"}


def test_concurrent_first_calls_wait_for_one_lease(shards8):
    """Calls made at once on a fresh client with a forced transport: one of them
    leases each replica's slots and the others wait for that lease (they used to
    find the choice under way and fail with "no data plane slots")."""
    addresses = [s.address for s in shards8]
    x, ids, w = case(6, 21)

    async def run():
        async with AsyncExpertClient(addresses, transport="tcp") as client:
            outs = await asyncio.gather(*(client.forward(0, x, ids, w) for _ in range(6)))
            return outs, client.stats()

    outs, stats = asyncio.run(run())
    assert all(o.shape == (6, 512) for o in outs)
    assert {s["transport"] for s in stats.values()} == {"tcp"}


def test_a_bad_call_gets_forwards_error_and_the_shard_keeps_serving(one_shard):
    """Calls the client would refuse, sent through a slot as they are: the shard's
    checks answer with Forward's codes and messages on the connection."""
    with ExpertClient([one_shard.address], transport="tcp", max_attempts=1) as client:
        x, ids, w = case(3, 2)
        good = client.forward(0, x, ids, w)
        plane = client._client._pool.endpoints[one_shard.address].dataplane
        assert plane is not None and plane.name == "tcp"

        def through_slot(layer, ids, x=x):
            slot = plane.acquire()
            try:
                x_bits = x.view(torch.int16).numpy().view(np.uint16)
                slot.start(layer, x_bits, None, ids.numpy(), w.numpy(), 10.0, notify=False)
                assert slot.wait(time.monotonic() + 10)
                return slot.result().copy()
            finally:
                slot.release()

        bad = ids.clone()
        bad[1, 2] = 64  # an expert id outside [-1, 64)
        with pytest.raises(StreamCallError) as err:
            through_slot(0, bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "64" in err.value.details()
        with pytest.raises(StreamCallError) as err:
            through_slot(99, ids)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        nan = x.clone()
        nan[2, 5] = float("nan")
        with pytest.raises(StreamCallError) as err:
            through_slot(0, ids, nan)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "hidden_states[2, 5]" in err.value.details()
        assert torch.equal(bits(client.forward(0, x, ids, w)), bits(good))
        assert client.stats()[one_shard.address]["transport"] == "tcp"


def test_hostile_connections_are_refused_and_cut_off(one_shard):
    """No hello, a wrong token, a replayed token, an impossible header: each gets a
    refusal or INVALID_ARGUMENT and a closed connection; a client's lease beside them
    keeps working."""
    address = one_shard.address
    with ExpertClient([address], transport="tcp", max_attempts=1) as client:
        x, ids, w = case(4, 9)
        good = client.forward(0, x, ids, w)
        reply = register(address, slots=1, max_tokens=8, top_k=8)
        port = reply.data_port
        assert port and reply.layout.max_tokens == 8

        with connect(address, port) as sock:  # not a hello at all
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 8)
            answer = sock.recv(256)
            assert answer[:1] == rawtcp.REFUSED and b"hello" in answer
            assert closed(sock)
        with connect(address, port) as sock:  # a token nobody was given
            sock.sendall(rawtcp.pack_hello(b"\1" * rawtcp.TOKEN_BYTES, 0))
            answer = sock.recv(256)
            assert answer[:1] == rawtcp.REFUSED and b"token" in answer
            assert closed(sock)
        with connect(address, port) as sock:  # a slot index outside the registration
            sock.sendall(rawtcp.pack_hello(reply.token, 5))
            assert sock.recv(256)[:1] == rawtcp.REFUSED
        with connect(address, port) as sock:
            sock.sendall(rawtcp.pack_hello(reply.token, 0))
            assert sock.recv(1) == rawtcp.READY
            with connect(address, port) as again:  # the token was spent
                again.sendall(rawtcp.pack_hello(reply.token, 0))
                assert again.recv(256)[:1] == rawtcp.REFUSED
            # 9 rows into a slot of 8: refused by name, and the connection ends
            sock.sendall(rawtcp.CALL.pack(1, 0, 9, 8, 1_000_000, 0, 0, 0, 0, 0))
            head = bytearray(rawtcp.ANSWER.size)
            rawtcp.recv_into(sock, memoryview(head))
            seq, status, rows, error_len, *_ = rawtcp.ANSWER.unpack(head)
            assert (seq, status, rows) == (1, grpc.StatusCode.INVALID_ARGUMENT.value[0], 0)
            text = sock.recv(error_len).decode()
            assert "m = 9 rows exceed the slot's 8" in text
            assert closed(sock)
        assert torch.equal(bits(client.forward(0, x, ids, w)), bits(good))
        assert client.stats()[address]["transport"] == "tcp"


def test_a_shard_stopped_or_killed_mid_call(one_shard):
    """Stopped with a call in flight: the call fails at its deadline; killed with a call
    in flight: its connection ends and the call fails at once with UNAVAILABLE."""
    with ExpertClient([one_shard.address], transport="tcp", max_attempts=1) as client:
        x, ids, w = case(3, 3)
        client.forward(0, x, ids, w)
        os.kill(one_shard.process.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(ShardCallError, match="DEADLINE_EXCEEDED"):
            client.forward(0, x, ids, w, timeout=0.5)
        assert time.monotonic() - t0 < 5
        box = {}

        def call():
            try:
                box["out"] = client.forward(0, x, ids, w, timeout=60)
            except Exception as e:
                box["error"] = e

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        os.kill(one_shard.process.pid, signal.SIGKILL)
        caller.join(30)
        assert not caller.is_alive()
        assert time.monotonic() - t0 < 10
        error = box.get("error")
        assert isinstance(error, ShardCallError), box
        assert "UNAVAILABLE" in str(error), error
        assert one_shard.address in str(error)


def test_registration_refusals_and_credentials():
    shard = start_shard(
        [*SERVE, "--num-shards", "1", "--shard", "0"],
        env={**os.environ, "EXPERTD_AUTH_TOKEN": "s3cret"},
    )
    try:
        wait_serving([shard], timeout=300)
        with pytest.raises(grpc.RpcError) as err:
            register(shard.address, slots=1)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with ExpertClient([shard.address], transport="tcp", token="s3cret") as client:
            assert client.stats()[shard.address]["transport"] == "tcp"
            x, ids, w = case(4, 6)
            assert client.forward(0, x, ids, w).shape == (4, 512)
    finally:
        stop_shards([shard])


def test_a_shard_without_the_tcp_plane_is_named_and_auto_uses_grpc(tmp_path):
    """--tcp-data-port off: Describe offers no tcp, a forced client says why, and an
    auto client on a host where shared memory is not used falls back to gRPC."""
    with BackgroundServer(shard_config(0, num_shards=1, tcp_data_port=None)) as server:
        assert "tcp" not in server.servicer.dataplanes()
        with ExpertClient([server.address], transport="tcp", max_attempts=1) as client:
            x, ids, w = case(2, 1)
            with pytest.raises(ShardCallError, match="offers no tcp data plane"):
                client.forward(0, x, ids, w)


VANISHING_CLIENT = textwrap.dedent(
    """
    import sys, time, torch
    from expertd.client import ExpertClient
    client = ExpertClient([sys.argv[1]], transport="tcp")
    assert client.stats()[sys.argv[1]]["transport"] == "tcp"
    x = torch.zeros((2, 512), dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    client.forward(0, x, ids, torch.full((2, 2), 0.5))
    print("READY", flush=True)
    time.sleep(600)
    """
)


def test_a_vanished_client_frees_its_lease():
    """A client process killed while it holds a tcp lease: its connections close, the
    shard frees the slots, and goes on serving."""
    with BackgroundServer(shard_config(0, num_shards=1)) as server:
        registry = server.servicer.tcp
        assert registry is not None and not registry.stats()
        proc = subprocess.Popen(
            [sys.executable, "-c", VANISHING_CLIENT, server.address],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout.readline().strip() == "READY"
            assert len(registry.stats()) == 1
            proc.kill()
            proc.wait(30)
            proc.stdout.close()
            deadline = time.monotonic() + 10
            while registry.stats():
                assert time.monotonic() < deadline, "the dead client's lease is held"
                time.sleep(0.05)
            with ExpertClient([server.address], transport="tcp") as client:
                assert client.stats()[server.address]["transport"] == "tcp"
                x, ids, w = case(2, 3)
                assert client.forward(0, x, ids, w).shape == (2, 512)
        finally:
            if proc.poll() is None:
                proc.kill()


def test_a_killed_replica_fails_over_to_the_other():
    """Two replicas of one shard, both on tcp slots: one killed between calls, the
    next calls are answered by the other with the same bits."""
    replicas = [start_shard([*SERVE, "--num-shards", "1", "--shard", "0"]) for _ in range(2)]
    try:
        wait_serving(replicas, timeout=300)
        addresses = [r.address for r in replicas]
        x, ids, w = case(5, 11)
        with ExpertClient(addresses, transport="tcp", timeout=20) as client:
            want = client.forward(0, x, ids, w)
            assert {s["transport"] for s in client.stats().values()} == {"tcp"}
            for _ in range(4):  # both replicas hold slots now (calls alternate)
                assert torch.equal(bits(client.forward(0, x, ids, w)), bits(want))
            replicas[0].process.kill()
            replicas[0].process.wait(30)
            for _ in range(6):
                assert torch.equal(bits(client.forward(0, x, ids, w)), bits(want))
            assert client.stats()[addresses[1]]["calls"] > 0
    finally:
        stop_shards(replicas)


def test_a_hello_of_another_wire_version_is_named():
    """A client of another version of this wire is told which versions met; anything
    else is not a hello at all."""
    token = bytes(rawtcp.TOKEN_BYTES)
    assert rawtcp.unpack_hello(rawtcp.pack_hello(token, 3)) == (token, 3)
    old = rawtcp.HELLO.pack(b"EXD1", token, 0)
    with pytest.raises(ValueError, match=r"EXD1 from the client, this shard speaks EXD2"):
        rawtcp.unpack_hello(old)
    with pytest.raises(ValueError, match="not an expertd tcp data plane hello"):
        rawtcp.unpack_hello(rawtcp.HELLO.pack(b"GET ", token, 0))
