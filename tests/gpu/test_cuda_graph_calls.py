"""Layer calls captured in the caller's CUDA graph (ExpertClient(on_stream=True,
graph_slots=N), client/onstream.GraphCalls) against two GPU shard processes: each
replay computes the layers of its inputs (gRPC's answers), a refused replay's error is
raised by synchronize and the next replay is right, capture without kept slots is a
clear error, and a killed shard releases the replaying stream. Skipped without CUDA."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from conftest import cuda_inputs

from expertd.client import ExpertClient, ShardCallError
from expertd.kernels.reference import relative_error
from expertd.launcher import start_shard, stop_shards, wait_serving

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

PRESET = "small"


def _start(n: int = 2):
    procs = [
        start_shard(
            [
                *("--synthetic", PRESET, "--layers", "2", "--seed", "7", "--device", "cuda"),
                *("--shard", str(s), "--num-shards", str(n)),
            ]
        )
        for s in range(n)
    ]
    wait_serving(procs, timeout=300)
    return procs


@pytest.fixture(scope="module")
def shards():
    procs = _start()
    try:
        yield procs
    finally:
        stop_shards(procs)


def _inputs(m: int, seed: int):
    return cuda_inputs(PRESET, m, seed, torch.int64)


def _step(client: ExpertClient, x, ids, w) -> tuple[torch.Tensor, torch.Tensor]:
    """Two MoE layers as a decode step chains them: layer 1 takes layer 0's output."""
    h0 = client.forward(0, x, ids, w)
    h1 = client.forward(1, h0, ids, w)
    return h0, h1


def _capture(client: ExpertClient, static):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager on-stream calls first, as torch advises
        _step(client, *static)
    side.synchronize()
    client.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _step(client, *static)
    return graph, outs


def _replay(graph, static, inputs) -> None:
    for dst, src in zip(static, inputs, strict=True):
        dst.copy_(src)
    graph.replay()
    torch.cuda.current_stream().synchronize()


def _same(got: torch.Tensor, want: torch.Tensor, m: int) -> None:
    if m == 1:  # one token: every shard picks the tile of the split path
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    else:  # all tokens to every shard may pick another tile: bf16 rounding apart
        assert relative_error(got, want) < 1e-2


@pytest.mark.parametrize("m", [1, 24])
def test_replays_compute_each_replays_inputs(shards, m):
    addresses = [p.address for p in shards]
    with (
        ExpertClient(addresses, on_stream=True, graph_slots=2) as client,
        ExpertClient(addresses, transport="grpc") as ref,
    ):
        static = [t.clone() for t in _inputs(m, seed=0)]
        graph, (h0, h1) = _capture(client, static)
        for i in range(12):
            inputs = _inputs(m, seed=10 + i)
            _replay(graph, static, inputs)
            client.synchronize()
            want0 = ref.forward(0, *inputs)
            want1 = ref.forward(1, want0, inputs[1], inputs[2])
            _same(h0, want0, m)
            _same(h1, want1, m)
        t0 = time.perf_counter()
        for _ in range(20):  # replays back to back, waited for once
            graph.replay()
        torch.cuda.current_stream().synchronize()
        assert time.perf_counter() - t0 < 10
        client.synchronize()
        for address in addresses:
            assert client.stats()[address]["transport"] == "cuda-ipc"


def test_a_refused_replay_raises_and_the_next_is_right(shards):
    addresses = [p.address for p in shards]
    with (
        ExpertClient(addresses, on_stream=True, graph_slots=2) as client,
        ExpertClient(addresses, transport="grpc") as ref,
    ):
        static = [t.clone() for t in _inputs(4, seed=1)]
        graph, (h0, _h1) = _capture(client, static)
        x, ids, w = _inputs(4, seed=2)
        bad = x.clone()
        bad[1, 3] = float("nan")
        _replay(graph, static, (bad, ids, w))  # the stream goes on: no host waits
        errors = []
        while len(errors) < 8:  # one per shard that refused it (both: every shard gets x)
            try:
                client.synchronize()
                break
            except ShardCallError as e:
                errors.append(e)
        assert errors and errors[0].code == grpc.StatusCode.INVALID_ARGUMENT
        assert "NaN" in str(errors[0])
        _replay(graph, static, (x, ids, w))
        client.synchronize()  # nothing left to raise: the shards took the good replay
        _same(h0, ref.forward(0, x, ids, w), 4)


def test_capture_needs_kept_slots(shards):
    addresses = [p.address for p in shards]
    with ExpertClient(addresses, on_stream=True, graph_slots=1) as client:
        static = [t.clone() for t in _inputs(2, seed=3)]
        client.forward(0, *static)
        client.synchronize()
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="graph_slots"), torch.cuda.graph(graph):
            _step(client, *static)  # two calls, one kept slot per shard
    with ExpertClient(addresses, on_stream=True) as client:
        client.forward(0, *static)
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="graph_slots"), torch.cuda.graph(graph):
            client.forward(0, *static)


def test_a_killed_shard_releases_the_replaying_stream():
    procs = _start()
    try:
        addresses = [p.address for p in procs]
        with ExpertClient(addresses, on_stream=True, graph_slots=2, timeout=5) as client:
            static = [t.clone() for t in _inputs(3, seed=4)]
            graph, _outs = _capture(client, static)
            _replay(graph, static, _inputs(3, seed=5))
            client.synchronize()
            procs[1].process.kill()
            procs[1].process.wait(timeout=30)
            t0 = time.perf_counter()
            _replay(graph, static, _inputs(3, seed=6))  # returns: the host released it
            assert time.perf_counter() - t0 < 10
            with pytest.raises(ShardCallError) as info:
                client.synchronize()
            assert info.value.code in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
    finally:
        stop_shards(procs)
