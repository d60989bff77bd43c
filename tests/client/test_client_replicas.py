"""Replicas, failover and redundant placements against real servers on loopback:
a replica stopped under load (results stay right), a shard with every replica
down (a clear error within the deadline), a replica probed back in, and experts
owned by two shards (each route computed exactly once, load on both)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from conftest import PRESET, hidden, routing, shard_config

from expertd import wire
from expertd.aioloop import run
from expertd.client import AsyncExpertClient, CoverageError, ExpertClient, ShardCallError
from expertd.kernels import reference_forward, relative_error
from expertd.server.app import BackgroundServer
from expertd.server.bank import ExpertBank

TOL = 1e-2
HALF = PRESET.num_experts // 2  # shard 0 of 2 owns [0, 32), shard 1 owns [32, 64)


_banks: dict[tuple, ExpertBank] = {}


def start(shard: int = 0, experts: list[int] | None = None, **overrides) -> BackgroundServer:
    """Layer 0 of half `shard` of 2 (or of `experts`); replicas share one loaded bank."""
    config = shard_config(shard, num_shards=2, experts=experts, layers=1, **overrides)
    key = (shard, tuple(experts or ()))
    if key not in _banks:
        _banks[key] = ExpertBank.load(config, progress=lambda _msg: None)
    return BackgroundServer(config, bank=_banks[key])


@pytest.fixture
def replicas():
    """Two replicas of each half: [a0, a1] own experts 0-31, [b0, b1] own 32-63."""
    servers = {name: start(shard=int(name[0] == "b")) for name in ("a0", "a1", "b0", "b1")}
    yield servers
    for server in servers.values():
        server.stop()


def cases(n: int, m: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids, w = routing(m, gen)
        out.append((0, hidden(m, gen), ids, w))
    return out


def check(full_layers, case, out) -> None:
    layer, x, ids, w = case
    assert relative_error(out, reference_forward(full_layers[layer], x, ids, w)) <= TOL


def healthy_answers(client, work, full_layers) -> list[torch.Tensor]:
    """The answers of the healthy service (a few checked against the reference,
    which costs ~40 ms a token): what the calls under failure must reproduce.
    A lost contribution moves a result by ~1/top_k, far above TOL."""
    outs = [f.result() for f in [client.submit(*c) for c in work]]
    for case, out in list(zip(work, outs, strict=True))[:3]:
        check(full_layers, case, out)
    return outs


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_replica_stopped_under_load_then_probed_back(replicas, full_layers):
    addresses = [s.address for s in replicas.values()]
    work = cases(48, 6, seed=1)
    with ExpertClient(addresses, timeout=10) as client:
        assert len(client.topology.shards) == 2  # four addresses, two sets of replicas
        want = healthy_answers(client, work, full_layers)
        futures = [client.submit(*c) for c in work[:24]]
        killer = threading.Thread(target=replicas["a0"].stop)
        killer.start()  # while those 24 are in flight
        futures += [client.submit(*c) for c in work[24:]]
        killer.join()
        for ref, fut in zip(want, futures, strict=True):
            assert relative_error(fut.result(), ref) <= TOL
        stats = client.stats()
        assert not stats[replicas["a0"].address]["alive"]
        assert stats[replicas["a1"].address]["calls"] > 0
        # The same address comes back (a new process): probes put it back in rotation.
        old = stats[replicas["a0"].address]["instance_id"]
        replicas["a0"] = start(shard=0, listen=replicas["a0"].address)
        wait_until(lambda: client.stats()[replicas["a0"].address]["alive"])
        assert client.stats()[replicas["a0"].address]["instance_id"] != old
        before = client.stats()[replicas["a0"].address]["calls"]
        for ref, case in zip(want[:8], work[:8], strict=True):
            assert relative_error(client.forward(*case), ref) <= TOL
        assert client.stats()[replicas["a0"].address]["calls"] > before


def test_async_replica_stopped_under_load(replicas, full_layers):
    work = cases(40, 6, seed=2)
    addresses = [s.address for s in replicas.values()]
    with ExpertClient(addresses) as healthy:
        want = healthy_answers(healthy, work, full_layers)

    async def go():
        async with await AsyncExpertClient.connect(addresses, timeout=10) as client:
            calls = [asyncio.ensure_future(client.forward(*c)) for c in work]
            await asyncio.sleep(0.02)
            await asyncio.to_thread(replicas["b1"].stop)
            return await asyncio.gather(*calls), client.stats()

    outs, stats = run(go())
    for ref, out in zip(want, outs, strict=True):
        assert relative_error(out, ref) <= TOL
    assert not stats[replicas["b1"].address]["alive"]


def test_every_replica_of_a_shard_down(replicas, full_layers):
    addresses = [s.address for s in replicas.values()]
    dead = {replicas["b0"].address, replicas["b1"].address}
    gen = torch.Generator().manual_seed(3)
    x = hidden(4, gen)
    ids = torch.tensor([[1, 40, 5, -1]] * 4, dtype=torch.int32)
    w = torch.rand((4, 4), generator=gen)
    with ExpertClient(addresses, timeout=2) as client:
        replicas["b0"].stop()
        replicas["b1"].stop()
        for _ in range(2):  # the first call finds them dead, the next knows it
            t0 = time.monotonic()
            with pytest.raises((ShardCallError, CoverageError)) as info:
                client.forward(0, x, ids, w)
            assert time.monotonic() - t0 < 2.5
            err = info.value
            assert 40 in err.experts and all(a in str(err) for a in dead)
        # Routes that avoid the dead shard still work.
        only_a = torch.tensor([[1, 2, 30, -1]] * 4, dtype=torch.int32)
        check(full_layers, (0, x, only_a, w), client.forward(0, x, only_a, w))


@pytest.fixture
def redundant():
    """Non-contiguous, overlapping placements: 24-39 on p and q, 0-3 on p and r."""
    placements = {
        "p": list(range(0, 40)),
        "q": list(range(24, 64)),
        "r": [*range(0, 4), *range(44, 48)],
    }
    servers = {n: start(experts=e) for n, e in placements.items()}
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in servers}
    for name, server in servers.items():
        record(server, seen[name])
    yield servers, placements, seen
    for server in servers.values():
        server.stop()


def record(server: BackgroundServer, sink: list) -> None:
    """Keep every Forward's topk_ids this server is asked to compute."""
    servicer = server.servicer
    inner = servicer._forward

    async def forward(req, deadline):
        sink.append(wire.decode(req.topk_ids, "topk_ids").clone())
        return await inner(req, deadline)

    servicer._forward = forward


def test_redundant_experts_each_route_once_and_balanced(redundant, full_layers):
    servers, placements, seen = redundant
    work = cases(6, 10, seed=4)
    # The servers record what they are sent on the gRPC path (`record` above).
    addresses = [s.address for s in servers.values()]
    with ExpertClient(addresses, timeout=10, transport="grpc") as client:
        assert len(client.topology.shards) == 3
        futures = [client.submit(*c) for c in work]
        for case, fut in zip(work, futures, strict=True):
            check(full_layers, case, fut.result())
    sent = {n: torch.cat([t.flatten() for t in ts]) for n, ts in seen.items()}
    sent = {n: t[t >= 0] for n, t in sent.items()}
    for name, ids in sent.items():  # nobody is sent an expert it does not own
        assert set(ids.tolist()) <= set(placements[name])
    routed = torch.cat([c[2].flatten() for c in work])
    total = torch.bincount(routed[routed >= 0].long(), minlength=PRESET.num_experts)
    got = sum(torch.bincount(t.long(), minlength=PRESET.num_experts) for t in sent.values())
    assert torch.equal(got, total)  # every route computed exactly once
    shared = set(placements["p"]) & set(placements["q"])
    p_share = sum(int(e in shared) for e in sent["p"].tolist())
    q_share = sum(int(e in shared) for e in sent["q"].tolist())
    assert p_share > 0 and q_share > 0  # the redundant experts' load is spread


def test_redundant_owner_takes_over_when_one_dies(redundant, full_layers):
    servers, _, _ = redundant
    gen = torch.Generator().manual_seed(5)
    x = hidden(6, gen)
    ids = torch.tensor([[25, 30, 1, 50]] * 6, dtype=torch.int32)  # 25, 30 on p and q
    w = torch.rand((6, 4), generator=gen)
    with ExpertClient([s.address for s in servers.values()], timeout=5) as client:
        servers["q"].stop()
        for _ in range(2):  # found dead during the call, then known dead
            with pytest.raises((ShardCallError, CoverageError), match="50"):
                client.forward(0, x, ids, w)  # 50 lives only on q
        ids[:, 3] = 2
        for _ in range(3):  # 25 and 30 go to p now
            check(full_layers, (0, x, ids, w), client.forward(0, x, ids, w))
