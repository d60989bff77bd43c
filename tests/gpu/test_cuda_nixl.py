"""The NIXL data plane on GPU memory: two GPU shard processes and the real client,
all on one GPU, with the slots' rows in device memory at both ends (UCX moves them
GPU to GPU). Answers are bit-identical to the gRPC path's, on the caller's thread
and on the event loop's path; a host caller's calls use the same device slots.
Skipped without CUDA or without NIXL (nixl_cu13)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import cuda_inputs, serving_shards

from expertd import nixl
from expertd.client import AsyncExpertClient, ExpertClient

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if not nixl.available():
    pytest.skip(f"NIXL is not importable: {nixl.why()}", allow_module_level=True)

PRESET = "small"


@pytest.fixture(scope="module")
def shards():
    with serving_shards(
        "--synthetic", PRESET, "--layers", "2", "--seed", "5", "--device", "cuda"
    ) as procs:
        yield procs


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_device_slots_are_chosen_and_match_grpc_bit_for_bit(shards):
    addresses = [s.address for s in shards]
    torch.cuda.init()
    with (
        ExpertClient(addresses, transport="nixl") as client,
        ExpertClient(addresses, transport="grpc") as ref,
    ):
        stats = client.stats()
        assert {v["transport"] for v in stats.values()} == {nixl.NIXL}, stats
        assert {v["slot_memory"] for v in stats.values()} == {"device"}, stats
        for m in (1, 7, 64, 300):
            for layer in (0, 1):
                x, ids, w = cuda_inputs(PRESET, m, seed=m + layer)
                got = client.forward(layer, x, ids, w)
                assert got.dtype == torch.bfloat16
                assert _same(got, ref.forward(layer, x, ids, w)), (m, layer)
        # partial routes (some tokens reach one shard only), an empty call
        x, ids, w = cuda_inputs(PRESET, 33, seed=3)
        ids[:, 1:] = -1
        assert _same(client.forward(0, x, ids, w), ref.forward(0, x, ids, w))
        x0, ids0, w0 = cuda_inputs(PRESET, 0, seed=4)
        assert client.forward(0, x0, ids0, w0).shape == (0, x.shape[1])
        # a host caller's call goes through the same device slots, its answer to the host
        x, ids, w = cuda_inputs(PRESET, 9, seed=5)
        host = client.forward(0, x.cpu(), ids.cpu(), w.cpu())
        assert _same(host, ref.forward(0, x.cpu(), ids.cpu(), w.cpu()))
        assert client.stats()[addresses[0]]["slot_memory"] == "device"


def test_device_slots_on_the_event_loops_path(shards):
    """Calls made concurrently on the event loop (the path with retries and failover)."""
    addresses = [s.address for s in shards]
    torch.cuda.init()
    cases = [cuda_inputs(PRESET, m, seed=40 + m) for m in (1, 16, 128, 700)]

    async def run(transport: str):
        async with AsyncExpertClient(addresses, transport=transport) as client:
            outs = await asyncio.gather(*(client.forward(1, *c) for c in cases))
            return outs, client.stats()

    got, stats = asyncio.run(run("nixl"))
    want, _ = asyncio.run(run("grpc"))
    assert {v["slot_memory"] for v in stats.values()} == {"device"}, stats
    for a, b in zip(got, want, strict=True):
        assert _same(a, b)
