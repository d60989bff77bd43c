"""The real command line: make-checkpoint, serve from the checkpoint in a child
process, and a graceful SIGTERM while calls are in flight."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from conftest import hidden, routing
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from expertd import wire
from expertd.kernels import reference_forward, relative_error
from expertd.launcher import health_status, start_shard, stop_shards, wait_serving
from expertd.server.checkpoint import CheckpointReader
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import expertd_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "small"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "expertd",
            "make-checkpoint",
            str(path),
            "--preset",
            "small",
            "--layers",
            "1",
            "--seed",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout
    return path


@pytest.fixture(scope="module")
def served(checkpoint):
    shard = start_shard(
        [
            "--checkpoint",
            str(checkpoint),
            "--shard",
            "1",
            "--num-shards",
            "4",
            "--torch-threads",
            "1",
        ]
    )
    try:
        wait_serving([shard], timeout=120)
        yield shard
    finally:
        stop_shards([shard])


def test_serve_from_checkpoint(served, checkpoint):
    with grpc.insecure_channel(served.address) as ch:
        stub = pb_grpc.ExpertServiceStub(ch)
        d = stub.Describe(pb.DescribeRequest(), timeout=5)
        assert list(d.experts) == list(range(16, 32)) and d.model == str(checkpoint)
        gen = torch.Generator().manual_seed(0)
        x = hidden(9, gen)
        ids, w = routing(9, gen)
        reply = stub.Forward(
            pb.ForwardRequest(
                layer=0,
                hidden_states=wire.encode(x),
                topk_ids=wire.encode(ids),
                topk_weights=wire.encode(w),
            ),
            timeout=30,
        )
    layer = CheckpointReader(str(checkpoint)).load_layer(0, list(range(16, 32)))
    assert (
        relative_error(wire.decode(reply.output, "output"), reference_forward(layer, x, ids, w))
        <= 1e-2
    )


def _forward_request(m: int, seed: int) -> pb.ForwardRequest:
    gen = torch.Generator().manual_seed(seed)
    x = hidden(m, gen)
    ids, w = routing(m, gen)
    return pb.ForwardRequest(
        layer=0,
        hidden_states=wire.encode(x),
        topk_ids=wire.encode(ids),
        topk_weights=wire.encode(w),
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inflight(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return next(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "expertd_inflight_requests"
    )


def test_sigterm_finishes_calls_in_flight(checkpoint):
    metrics = _free_port()
    shard = start_shard(
        [
            "--checkpoint",
            str(checkpoint),
            "--torch-threads",
            "1",
            "--grace",
            "60",
            "--metrics-port",
            str(metrics),
        ]
    )
    wait_serving([shard], timeout=120)
    req = _forward_request(2048, seed=1)
    with grpc.insecure_channel(
        shard.address, options=[("grpc.max_receive_message_length", -1)]
    ) as ch:
        stub = pb_grpc.ExpertServiceStub(ch)
        calls = [stub.Forward.future(req, timeout=120) for _ in range(6)]
        # In flight = received by the server: a request still uploading when the signal
        # comes is a new call, refused while draining. Wait until all six arrived.
        deadline = time.monotonic() + 60
        while _inflight(metrics) + sum(c.done() for c in calls) < 6:
            assert time.monotonic() < deadline, "the six calls never all reached the server"
            time.sleep(0.01)
        shard.process.send_signal(signal.SIGTERM)
        results = [c.result() for c in calls]  # each one completes despite the signal
    assert shard.process.wait(timeout=60) == 0
    first = wire.decode(results[0].output, "output")
    assert all(torch.equal(wire.decode(r.output, "output"), first) for r in results)
    assert health_status(shard.address, timeout=0.5) is None  # gone


def test_sigterm_admits_calls_during_the_drain_delay(checkpoint):
    """SIGTERM: health goes NOT_SERVING at once, but for --drain-delay seconds new calls are
    still answered (clients and load balancers need that long to see the change); then the
    process exits 0."""
    shard = start_shard(["--checkpoint", str(checkpoint), "--drain-delay", "3", "--grace", "30"])
    wait_serving([shard], timeout=120)
    req = _forward_request(5, seed=2)
    with grpc.insecure_channel(shard.address) as ch:
        stub = pb_grpc.ExpertServiceStub(ch)
        before = stub.Forward(req, timeout=60)
        shard.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 2.0
        while (
            health_status(shard.address, timeout=0.5) != health_pb2.HealthCheckResponse.NOT_SERVING
        ):
            assert time.monotonic() < deadline, "health still SERVING after SIGTERM"
            time.sleep(0.05)
        after = stub.Forward(req, timeout=60)  # inside the delay: admitted
    assert after.output == before.output
    assert shard.process.wait(timeout=60) == 0


def test_bad_checkpoint_exits_nonzero(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "expertd",
            "serve",
            "--checkpoint",
            str(empty),
            "--listen",
            "127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert str(empty) in done.stderr


def test_serve_needs_one_weight_source():
    done = subprocess.run(
        [sys.executable, "-m", "expertd", "serve"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "--checkpoint" in done.stderr


def test_concurrent_clients_on_one_process(served, checkpoint):
    layer = CheckpointReader(str(checkpoint)).load_layer(0, list(range(16, 32)))
    gen = torch.Generator().manual_seed(2)
    cases = [(hidden(m, gen), *routing(m, gen)) for m in (1, 5, 80, 300)]

    def call(case):
        x, ids, w = case
        with grpc.insecure_channel(served.address) as ch:
            r = pb_grpc.ExpertServiceStub(ch).Forward(
                pb.ForwardRequest(
                    layer=0,
                    hidden_states=wire.encode(x),
                    topk_ids=wire.encode(ids),
                    topk_weights=wire.encode(w),
                ),
                timeout=60,
            )
        return relative_error(wire.decode(r.output, "output"), reference_forward(layer, x, ids, w))

    with ThreadPoolExecutor(4) as pool:
        assert max(pool.map(call, cases)) <= 1e-2
