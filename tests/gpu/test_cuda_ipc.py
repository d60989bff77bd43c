"""The cuda-ipc data plane between separate processes on one GPU: shard processes
started as an operator would, the real client with its tensors on the GPU. The
answers are bit-identical to the gRPC path's, the path is chosen by itself and
reported, a bad call gets its error and the shard keeps serving, a killed shard
is seen within the call's deadline. Skipped without CUDA."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from conftest import cuda_inputs, serving_shards

from expertd import dataplane as dp
from expertd.client import ExpertClient, ExpertdError, ShardCallError
from expertd.launcher import start_shard, stop_shards, wait_serving
from expertd.server.synthetic import get_preset

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

PRESET = "small"


@pytest.fixture(scope="module")
def shards():
    with serving_shards(
        "--synthetic", PRESET, "--layers", "2", "--seed", "5", "--device", "cuda"
    ) as procs:
        yield procs


def _inputs(m: int, seed: int):
    return cuda_inputs(PRESET, m, seed)


def test_cuda_ipc_is_chosen_and_matches_grpc_bit_for_bit(shards):
    addresses = [s.address for s in shards]
    torch.cuda.init()
    with ExpertClient(addresses) as auto, ExpertClient(addresses, transport="grpc") as ref:
        stats = auto.stats()
        assert {v["transport"] for v in stats.values()} == {dp.CUDA_IPC}, stats
        for m in (1, 7, 64, 300):
            for layer in (0, 1):
                x, ids, w = _inputs(m, seed=m + layer)
                got = auto.forward(layer, x, ids, w)
                want = ref.forward(layer, x, ids, w)
                assert got.device == x.device and got.dtype == torch.bfloat16
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (m, layer)
        # partial routes (some tokens reach one shard only) and empty calls
        x, ids, w = _inputs(33, seed=3)
        ids[:, 1:] = -1
        assert torch.equal(auto.forward(0, x, ids, w), ref.forward(0, x, ids, w))
        x0, ids0, w0 = _inputs(0, seed=4)
        assert auto.forward(0, x0, ids0, w0).shape == (0, x.shape[1])


def test_cuda_ipc_back_to_back_answers_of_one_shard_stay_intact(shards):
    """Calls whose routes all reach one shard: its answer is summed on the caller's
    stream after forward returns, and the slot's next call must not let the shard
    overwrite that answer before the sum read it. Many calls in a row, each output
    kept unread until the end, each equal to gRPC's."""
    addresses = [s.address for s in shards]
    p = get_preset(PRESET)
    with (
        ExpertClient(addresses, transport="cuda-ipc") as client,
        ExpertClient(addresses, transport="grpc") as ref,
    ):
        calls = []
        for seed in range(24):
            x, _, _ = _inputs(1 + seed % 5, seed=100 + seed)
            logits = torch.randn((x.shape[0], p.num_experts // 2), device="cuda")
            top = logits.topk(p.top_k, dim=1)  # shard 0's experts only
            ids, w = top.indices.int(), torch.softmax(top.values, dim=1)
            calls.append((x, ids, w, client.forward(0, x, ids, w)))
        for x, ids, w, got in calls:
            want = ref.forward(0, x, ids, w)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_cuda_ipc_errors_reach_the_caller_and_the_shard_keeps_serving(shards):
    addresses = [s.address for s in shards]
    with ExpertClient(addresses, transport="cuda-ipc") as client:
        x, ids, w = _inputs(4, seed=1)
        bad = x.clone()
        bad[2, 5] = float("nan")
        with pytest.raises(ShardCallError) as info:
            client.forward(0, bad, ids, w)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "NaN" in str(info.value)
        out = client.forward(0, x, ids, w)
        assert out.shape == x.shape and bool(torch.isfinite(out.float()).all())


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_host_slots_of_gpu_shards_match_grpc_bit_for_bit(shards, transport):
    """A CPU caller's shm or tcp slots on GPU shards: from M = 65 the shard copies x
    and out by DMA straight from the page-locked slot (the locked rows grow 256 -> 512
    -> 1024 -> 2048 here); below that through its staging buffer. Both give gRPC's
    bits, an Inf on the direct path still reaches its caller and the shard keeps
    serving."""
    addresses = [s.address for s in shards]
    with (
        ExpertClient(addresses, transport=transport) as client,
        ExpertClient(addresses, transport="grpc") as ref,
    ):
        assert {v["transport"] for v in client.stats().values()} == {transport}
        for m in (1, 64, 65, 300, 700, 2000, 300):
            x, ids, w = (t.cpu() for t in _inputs(m, seed=m))
            got = client.forward(1, x, ids, w)
            want = ref.forward(1, x, ids, w)
            assert got.device.type == "cpu"
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), m
        x, ids, w = (t.cpu() for t in _inputs(300, seed=9))
        bad = x.clone()
        bad[200, 3] = float("inf")
        with pytest.raises(ShardCallError) as info:
            client.forward(0, bad, ids, w)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert torch.equal(client.forward(0, x, ids, w), ref.forward(0, x, ids, w))


def test_cuda_ipc_dead_shard_is_seen_within_the_deadline():
    procs = [
        start_shard([*("--synthetic", PRESET, "--layers", "1"), "--device", "cuda", "--grace", "0"])
    ]
    try:
        wait_serving(procs, timeout=300)
        with ExpertClient([procs[0].address], transport="cuda-ipc", timeout=5.0) as client:
            x, ids, w = _inputs(8, seed=2)
            client.forward(0, x, ids, w)
            procs[0].process.kill()
            procs[0].process.wait()
            t0 = time.monotonic()
            with pytest.raises(ExpertdError) as info:
                client.forward(0, x, ids, w)
            took = time.monotonic() - t0
            assert took < 5.5, f"a dead shard took {took:.1f} s to notice: {info.value}"
    finally:
        stop_shards(procs)
