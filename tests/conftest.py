"""Shared fixtures: a real 8-shard service on loopback (in-process servers,
each with its own event loop and port), and the full layers it serves.

The tests live in folders by what they protect (unit, service, client,
reliability, gpu). This file and the helper modules beside it (loadgen.py,
faultproxy.py) are imported by name (`from conftest import hidden`), so this
folder goes on sys.path whichever import mode pytest runs in."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

import grpc
import pytest
import torch

from expertd.client.channels import ExpertStub
from expertd.client.shm import ShmChannel
from expertd.launcher import start_shard, stop_shards, wait_serving
from expertd.server.app import BackgroundServer
from expertd.server.config import ServerConfig
from expertd.server.synthetic import get_preset, synthetic_layer
from expertd.v1 import expertd_pb2 as pb

# EXPERTD_TEST_TRANSPORT=shm (or grpc, ...) runs every test's client on that transport
# unless the test names one: a test-only switch, the product reads no such variable.
_FORCED_TRANSPORT = os.environ.get("EXPERTD_TEST_TRANSPORT")
if _FORCED_TRANSPORT:
    from expertd.client import aio as _aio

    _client_init = _aio.AsyncExpertClient.__init__

    def _init_with_transport(self, addresses, **options):
        options.setdefault("transport", _FORCED_TRANSPORT)
        _client_init(self, addresses, **options)

    _aio.AsyncExpertClient.__init__ = _init_with_transport


def pytest_collection_finish(session):
    """Make the second host of tests/client/test_crosshost.py before any test runs:
    UCX learns a process's network interfaces once, when NIXL first starts in it, so a
    veth made after an earlier test used NIXL stays out of this process's reach."""
    if not any("test_crosshost" in item.nodeid for item in session.items):
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from netns import Far, NetnsUnavailable

    try:
        session.config.expertd_far = Far.create()
    except NetnsUnavailable as e:
        session.config.expertd_far_why = str(e)


def pytest_sessionfinish(session):
    far = getattr(session.config, "expertd_far", None)
    if far is not None:
        far.close()


PRESET = get_preset("small")  # H=512, I=256, E=64, top_k=8
SEED = 7
LAYERS = 2
SHARDS = 8


def routing(m: int, gen: torch.Generator, num_experts: int = 64, top_k: int = 8):
    """Top-k routing as a router makes it: distinct ids per token, softmax weights."""
    logits = torch.randn((m, num_experts), generator=gen)
    top = logits.topk(top_k, dim=1)
    return top.indices.to(torch.int32), torch.softmax(top.values, dim=1)


@contextlib.contextmanager
def serving_shards(*args: str, num_shards: int = 2, timeout: float = 300):
    """`num_shards` `expertd serve` processes of one model (`args`, then --shard S
    --num-shards N), SERVING; stopped at the end."""
    procs = []
    try:
        for s in range(num_shards):
            procs.append(start_shard([*args, "--shard", str(s), "--num-shards", str(num_shards)]))
        wait_serving(procs, timeout=timeout)
        yield procs
    finally:
        stop_shards(procs)


def cuda_inputs(preset: str, m: int, seed: int, id_dtype=torch.int32):
    """A call's (x, ids, weights) on the GPU for synthetic `preset`: random hidden
    states, each token's top-k of random logits, softmax weights (GPU tests)."""
    p = get_preset(preset)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((m, p.hidden_size), device="cuda", generator=gen).bfloat16()
    logits = torch.randn((m, p.num_experts), device="cuda", generator=gen)
    top = logits.topk(p.top_k, dim=1)
    return x, top.indices.to(id_dtype), torch.softmax(top.values, dim=1)


def hidden(m: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn((m, PRESET.hidden_size), generator=gen).to(torch.bfloat16)


@pytest.fixture(scope="session")
def full_layers():
    """Every expert of each served layer, for the reference."""
    return [
        synthetic_layer(PRESET, SEED, layer, list(range(PRESET.num_experts)))
        for layer in range(LAYERS)
    ]


def shard_config(shard: int, **overrides) -> ServerConfig:
    config = ServerConfig(
        synthetic="small", layers=LAYERS, seed=SEED, shard=shard, num_shards=SHARDS
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


@pytest.fixture(scope="session")
def cluster():
    """8 shard servers of the `small` preset on loopback ports; yields them."""
    servers = [BackgroundServer(shard_config(s)) for s in range(SHARDS)]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def addresses(cluster) -> list[str]:
    return [s.address for s in cluster]


@contextlib.contextmanager
def slowed_launch(server: BackgroundServer, seconds: float):
    """Within the block every batch `server` launches sleeps `seconds` first (a slow or
    hung shard); a call already sleeping finishes after the block."""
    runner = server.servicer.batcher.runner
    inner = runner.launch

    def slow(*a, **k):
        time.sleep(seconds)
        return inner(*a, **k)

    runner.launch = slow
    try:
        yield
    finally:
        runner.launch = inner


def lease_shm_slots(address: str, plain: int = 2, kept: int = 0):
    """A client's shm slots with the server at `address`, leased as the client leases
    them -> (the channel, the slots kept for captured calls: `kept` of them, held)."""

    async def lease():
        ch = grpc.aio.insecure_channel(address)
        stub = ExpertStub(ch)
        info = await stub.Describe(pb.DescribeRequest(), timeout=10)
        plane = ShmChannel(address, info.instance_id)
        await plane.grow(stub, (), plain, 10)
        slots = await plane.grow(stub, (), kept, 10, keep=True) if kept else []
        await ch.close()
        return plane, slots

    return asyncio.run(lease())
