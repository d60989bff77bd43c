"""The cross-host data plane over NIXL (docs/dataplane.md, "Across hosts: NIXL") end
to end: real shard processes, the real client, NIXL agents talking over UCX on
host memory (loopback here; `transport="nixl"` forces it between processes of one
host). Results are bit for bit those of the gRPC path; a shard killed mid-call
fails the call within its deadline; mismatched registrations are refused; a client
without NIXL says so once and uses gRPC."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
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

from expertd import nixl
from expertd.client import ExpertClient, ShardCallError
from expertd.client import nixl as nixl_client
from expertd.client.channels import ExpertStub
from expertd.client.stream import StreamCallError
from expertd.launcher import start_shard, stop_shards, wait_serving
from expertd.server.app import BackgroundServer
from expertd.v1 import expertd_pb2 as pb

pytestmark = pytest.mark.skipif(
    not nixl.available(), reason=f"NIXL is not importable: {nixl.why()} (pip install expertd[nixl])"
)

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


def describe(address: str) -> pb.DescribeResponse:
    async def run():
        channel = grpc.aio.insecure_channel(address)
        try:
            return await ExpertStub(channel).Describe(pb.DescribeRequest(), timeout=10)
        finally:
            await channel.close()

    return asyncio.run(run())


def test_nixl_matches_grpc_bit_for_bit_on_8_shards(shards8):
    addresses = [s.address for s in shards8]
    assert "nixl" in describe(addresses[0]).dataplanes
    with (
        ExpertClient(addresses, transport="nixl") as remote,
        ExpertClient(addresses, transport="grpc") as rpc,
    ):
        assert {s["transport"] for s in remote.stats().values()} == {"nixl"}
        assert all(s["slots"] >= 1 for s in remote.stats().values())
        for m in (0, 1, 7, 300):
            x, ids, w = case(m, 100 + m)
            if m > 2:  # some rows with a padded route
                ids[::2, -1] = -1
                w[::2, -1] = 0.0
            a, b = remote.forward(0, x, ids, w), rpc.forward(0, x, ids, w)
            assert a.shape == (m, 512) and a.dtype == torch.bfloat16
            assert torch.equal(bits(a), bits(b)), m
            sub = remote.submit(0, x, ids, w).result()  # the event loop's path, same bits
            assert torch.equal(bits(sub), bits(b)), m
        stats = remote.stats()
        assert all(s["calls"] > 0 for s in stats.values())
        timing = next(iter(stats.values()))["last_timing"]
        assert timing["batch_requests"] >= 1 and timing["compute_us"] > 0


def test_a_bad_call_gets_forwards_error_and_the_shard_keeps_serving(one_shard):
    """Calls the client would refuse, sent through a slot as they are: the shard's
    checks answer with Forward's codes and messages in the ANSWER notification."""
    with ExpertClient([one_shard.address], transport="nixl", max_attempts=1) as client:
        x, ids, w = case(3, 2)
        good = client.forward(0, x, ids, w)
        plane = client._client._pool.endpoints[one_shard.address].dataplane
        assert plane is not None and plane.name == "nixl"

        def through_slot(layer, ids):
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
        assert torch.equal(bits(client.forward(0, x, ids, w)), bits(good))
        stats = client.stats()[one_shard.address]
        assert stats["transport"] == "nixl" and stats["slot_memory"] == "host"


def test_a_shard_killed_mid_call_fails_it_within_the_deadline(one_shard):
    """Stopped with a call in flight: the call fails at its deadline; killed with a call
    in flight: the lease's stream breaks and the call fails at once with UNAVAILABLE."""
    with ExpertClient([one_shard.address], transport="nixl", max_attempts=1) as client:
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


def test_mismatched_registrations_are_refused(one_shard):
    info = describe(one_shard.address)
    agent = nixl.make_agent("test")
    hidden_size = info.hidden_size
    need = nixl_layout_bytes(64, 8, hidden_size)

    def ask(**changes):
        fields = dict(
            transport="nixl",
            slots=1,
            max_tokens=64,
            top_k=8,
            instance_id=info.instance_id,
            activation_dtype=pb.BF16,
            nixl=pb.NixlPeer(
                agent_name=agent.name,
                agent_metadata=agent.get_agent_metadata(),
                regions=[pb.NixlRegion(address=4096, byte_size=need, memory="DRAM")],
            ),
        )
        fields.update(changes)

        async def run():
            channel = grpc.aio.insecure_channel(one_shard.address)
            try:
                call = ExpertStub(channel).RegisterRemoteSlots(pb.RegisterSlotsRequest(**fields))
                return await asyncio.wait_for(call.read(), 20)
            finally:
                await channel.close()

        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(run())
        return err.value.code(), err.value.details()

    code, text = ask(instance_id="0" * 32)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "restarted" in text
    code, text = ask(activation_dtype=pb.FP32)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "FP32" in text
    small = pb.NixlPeer(
        agent_name=agent.name,
        agent_metadata=agent.get_agent_metadata(),
        regions=[pb.NixlRegion(address=4096, byte_size=need - 1, memory="DRAM")],
    )
    code, text = ask(nixl=small)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"needs {need}" in text
    code, text = ask(slots=2)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "1 registered regions for 2 slots" in text
    code, text = ask(max_tokens=10**9)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in text

    def peer(*memories):
        return pb.NixlPeer(
            agent_name=agent.name,
            agent_metadata=agent.get_agent_metadata(),
            regions=[pb.NixlRegion(address=4096, byte_size=need, memory=m) for m in memories],
        )

    # GPU memory needs a GPU shard; one registration is all host or all device memory
    code, text = ask(nixl=peer("VRAM"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "serves from the host" in text
    code, text = ask(slots=2, nixl=peer("DRAM", "VRAM"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "all host (DRAM)" in text
    code, text = ask(nixl=peer("FILE"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'FILE'" in text
    # the shard still registers a well-formed client and serves it
    with ExpertClient([one_shard.address], transport="nixl") as client:
        x, ids, w = case(2, 4)
        assert client.forward(0, x, ids, w).shape == (2, hidden_size)
        assert client.stats()[one_shard.address]["transport"] == "nixl"


def nixl_layout_bytes(max_tokens: int, top_k: int, hidden_size: int) -> int:
    from expertd.dataplane import Layout

    return Layout(max_tokens, top_k, hidden_size).byte_size


def test_without_nixl_the_client_warns_once_and_uses_grpc(shards8, monkeypatch, caplog):
    monkeypatch.setattr(nixl, "_module", None)
    monkeypatch.setattr(nixl, "_why", "nixl_cu13 is not importable (test)")
    monkeypatch.setattr(nixl_client, "_warned", threading.Event())
    addresses = [s.address for s in shards8]
    x, ids, w = case(5, 5)
    with (
        caplog.at_level(logging.WARNING, logger="expertd.client"),
        ExpertClient(addresses, transport="nixl") as a,
        ExpertClient(addresses, transport="nixl") as b,
        ExpertClient(addresses, transport="grpc") as rpc,
    ):
        for client in (a, b):
            stats = client.stats()
            assert {s["transport"] for s in stats.values()} == {"grpc"}
            assert "NIXL unavailable" in next(iter(stats.values()))["transport_why"]
        out = a.forward(0, x, ids, w)
        assert torch.equal(bits(out), bits(rpc.forward(0, x, ids, w)))
        assert torch.equal(bits(b.forward(0, x, ids, w)), bits(out))
    warnings = [r for r in caplog.records if "cross-host data plane off" in r.getMessage()]
    assert len(warnings) == 1


def test_registration_needs_the_credentials_every_rpc_needs():
    shard = start_shard(
        [*SERVE, "--num-shards", "1", "--shard", "0"],
        env={**os.environ, "EXPERTD_AUTH_TOKEN": "s3cret"},
    )
    try:
        wait_serving([shard], timeout=300)
        agent = nixl.make_agent("test")

        async def register():
            channel = grpc.aio.insecure_channel(shard.address)
            try:
                request = pb.RegisterSlotsRequest(
                    transport="nixl",
                    nixl=pb.NixlPeer(
                        agent_name=agent.name, agent_metadata=agent.get_agent_metadata()
                    ),
                )
                call = ExpertStub(channel).RegisterRemoteSlots(request)
                return await asyncio.wait_for(call.read(), 20)
            finally:
                await channel.close()

        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(register())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with ExpertClient([shard.address], transport="nixl", token="s3cret") as client:
            assert client.stats()[shard.address]["transport"] == "nixl"
            x, ids, w = case(4, 6)
            assert client.forward(0, x, ids, w).shape == (4, 512)
    finally:
        stop_shards([shard])


VANISHING_CLIENT = textwrap.dedent(
    """
    import sys, time, torch
    from expertd.client import ExpertClient
    client = ExpertClient([sys.argv[1]], transport="nixl")
    assert client.stats()[sys.argv[1]]["transport"] == "nixl"
    x = torch.zeros((2, 512), dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    client.forward(0, x, ids, torch.full((2, 2), 0.5))
    print("READY", flush=True)
    time.sleep(600)
    """
)


def test_a_vanished_client_frees_its_registration():
    """A client process killed while it holds a NIXL lease: its stream ends, the shard
    unloads its agent and frees its slots, and goes on serving."""
    with BackgroundServer(shard_config(0, num_shards=1)) as server:
        registry = server.servicer.remote
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
                assert time.monotonic() < deadline, "the dead client's registration is held"
                time.sleep(0.05)
            with ExpertClient([server.address], transport="nixl") as client:
                assert client.stats()[server.address]["transport"] == "nixl"
                x, ids, w = case(2, 3)
                assert client.forward(0, x, ids, w).shape == (2, 512)
        finally:
            if proc.poll() is None:
                proc.kill()


def test_calls_after_a_quiet_time_ring_the_shards_wake_port():
    """The shard gives each NIXL lease a token for its wake port (nixl.WakePort); a
    call the client sends after the lease was quiet for longer than the shard's
    progress thread stays hot rings it, so that thread leaves its naps at once.
    Answers are the gRPC path's bits, and the token stops waking once the client
    closed."""
    with BackgroundServer(shard_config(0, num_shards=1)) as server:
        with (
            ExpertClient([server.address], transport="nixl") as remote,
            ExpertClient([server.address], transport="grpc") as rpc,
        ):
            x, ids, w = case(3, 11)
            want = bits(rpc.forward(0, x, ids, w))
            assert torch.equal(bits(remote.forward(0, x, ids, w)), want)  # registers
            registry = server.servicer.remote
            port = registry.wake_port
            assert port is not None
            (lease,) = registry.leases.values()
            assert len(lease.wake_token) == nixl.WakePort.TOKEN_BYTES
            quiet = nixl.Progress.HOT_S * 2
            before = port.rung
            for _ in range(3):
                time.sleep(quiet)
                assert torch.equal(bits(remote.forward(0, x, ids, w)), want)
            deadline = time.monotonic() + 5
            while port.rung < before + 3 and time.monotonic() < deadline:
                time.sleep(0.01)  # each datagram is read by the progress thread
            assert port.rung == before + 3
            token = lease.wake_token
        deadline = time.monotonic() + 10
        while registry.leases and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not registry.leases and token not in port._tokens
