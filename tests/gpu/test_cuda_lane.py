"""The lane (server/lane.py): cuda-ipc slot calls answered on the slot's own thread
through the lane graphs. Two GPU shard processes of one model, one with the lane and
one with `--lane off`, each owning every expert: their answers are the same bits as
each other's and gRPC's at bucket sizes from 1 to 1000 tokens and at several top-k,
over plain and on-stream calls; the lane's metric shows it answered them; calls it must
not take (a NaN, a layer not served, a call larger than the largest bucket) get the
general path's answer and the shard keeps serving. Skipped without CUDA."""

from __future__ import annotations

import socket
import urllib.request

import grpc
import pytest
import torch
from conftest import cuda_inputs
from prometheus_client.parser import text_string_to_metric_families

from expertd import dataplane as dp
from expertd.client import ExpertClient, ExpertdError, ShardCallError
from expertd.launcher import start_shard, stop_shards, wait_serving

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

PRESET = "small"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    )


@pytest.fixture(scope="module")
def shards():
    """(lane on, its metrics port), (lane off, its metrics port): one shard each."""
    procs, ports = [], []
    try:
        for lane in ("on", "off"):
            port = _free_port()
            procs.append(
                start_shard(
                    [
                        *("--synthetic", PRESET, "--layers", "2", "--seed", "5"),
                        *("--device", "cuda", "--num-shards", "1", "--lane", lane),
                        *("--metrics-port", str(port)),
                    ]
                )
            )
            ports.append(port)
        wait_serving(procs, timeout=300)
        yield list(zip(procs, ports, strict=True))
    finally:
        stop_shards(procs)


def test_lane_answers_are_the_general_paths_bits(shards):
    (lane, lane_port), (plain, plain_port) = shards
    torch.cuda.init()
    before = _metric(lane_port, "expertd_lane_calls_total")
    calls = 0
    with (
        ExpertClient([lane.address]) as a,
        ExpertClient([plain.address]) as b,
        ExpertClient([lane.address], on_stream=True) as s,
        ExpertClient([lane.address], transport="grpc") as ref,
    ):
        assert a.stats()[lane.address]["transport"] == dp.CUDA_IPC
        for m in (1, 2, 3, 8, 17, 64, 100, 1000):
            for layer in (0, 1):
                x, ids, w = cuda_inputs(PRESET, m, seed=10 * m + layer)
                if m == 3:
                    ids[:, 5:] = -1  # fewer routes than top-k on some tokens
                want = ref.forward(layer, x, ids, w)
                for client in (a, b, s):
                    got = client.forward(layer, x, ids, w)
                    torch.cuda.synchronize()
                    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (m, layer)
                calls += 2  # a and s reach the lane's shard over cuda-ipc
        # top-k below the slot's: a narrower call
        x, ids, w = cuda_inputs(PRESET, 5, seed=99)
        ids, w = ids[:, :3].contiguous(), w[:, :3].contiguous()
        assert torch.equal(a.forward(0, x, ids, w), ref.forward(0, x, ids, w))
        calls += 1
    assert _metric(lane_port, "expertd_lane_calls_total") - before >= calls
    assert _metric(plain_port, "expertd_lane_calls_total") == 0


def test_calls_the_lane_declines_get_the_general_answer(shards):
    (lane, lane_port), _ = shards
    with (
        ExpertClient([lane.address], transport="cuda-ipc") as client,
        ExpertClient([lane.address], transport="grpc") as ref,
    ):
        x, ids, w = cuda_inputs(PRESET, 4, seed=7)
        before = _metric(lane_port, "expertd_lane_calls_total")
        bad = x.clone()
        bad[2, 11] = float("nan")
        with pytest.raises(ShardCallError) as e:
            client.forward(0, bad, ids, w)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "hidden_states[2, 11]" in str(e.value)
        with pytest.raises(ExpertdError) as e:  # a layer the shard does not serve
            client.forward(7, x, ids, w)
        assert "layer 7" in str(e.value)
        assert _metric(lane_port, "expertd_lane_calls_total") == before
        big_x, big_ids, big_w = cuda_inputs(PRESET, 1500, seed=8)  # past the largest bucket
        assert torch.equal(
            client.forward(0, big_x, big_ids, big_w), ref.forward(0, big_x, big_ids, big_w)
        )
        assert _metric(lane_port, "expertd_lane_calls_total") == before
        # and the shard keeps serving through the lane
        assert torch.equal(client.forward(0, x, ids, w), ref.forward(0, x, ids, w))
        assert _metric(lane_port, "expertd_lane_calls_total") == before + 1


def test_graph_replays_take_the_lane(shards):
    """Calls captured in the caller's CUDA graph: each replay through the lane gives the
    `--lane off` shard's bits for its inputs, and the lane's metric counts them."""
    (lane, lane_port), (plain, _) = shards
    replays = 6
    with (
        ExpertClient([lane.address], on_stream=True, graph_slots=2) as a,
        ExpertClient([plain.address], transport="cuda-ipc") as ref,
    ):
        static = [t.clone() for t in cuda_inputs(PRESET, 8, seed=40)]

        def step():
            h0 = a.forward(0, *static)
            return h0, a.forward(1, h0, static[1], static[2])

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # eager on-stream calls first, as torch advises
            step()
        side.synchronize()
        a.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            h0, h1 = step()
        before = _metric(lane_port, "expertd_lane_calls_total")
        for i in range(replays):
            inputs = cuda_inputs(PRESET, 8, seed=41 + i)
            for dst, src in zip(static, inputs, strict=True):
                dst.copy_(src)
            graph.replay()
            torch.cuda.current_stream().synchronize()
            a.synchronize()
            want0 = ref.forward(0, *inputs)
            want1 = ref.forward(1, want0, inputs[1], inputs[2])
            assert torch.equal(h0.view(torch.int16), want0.view(torch.int16)), i
            assert torch.equal(h1.view(torch.int16), want1.view(torch.int16)), i
    assert _metric(lane_port, "expertd_lane_calls_total") - before == 2 * replays
