"""The stream transport (the SDK's gRPC path): calls multiplexed over one
ForwardStream per replica; credentials, drain and failover behave as on unary."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import hidden, routing, shard_config

from expertd.client import CoverageError, ExpertClient
from expertd.kernels import reference_forward, relative_error
from expertd.server.app import BackgroundServer
from expertd.server.bank import ExpertBank

ALL = dict(num_shards=1)  # one shard owning all 64 experts


@pytest.fixture(scope="module")
def bank_all():
    return ExpertBank.load(shard_config(0, **ALL), progress=lambda _m: None)


def count(server, method: str) -> float:
    value = server.servicer.metrics.registry.get_sample_value(
        "expertd_requests_total", {"method": method, "code": "OK"}
    )
    return value or 0.0


def test_stream_is_the_grpc_default_and_matches_reference(bank_all, full_layers):
    with BackgroundServer(shard_config(0, **ALL), bank=bank_all) as server:
        with ExpertClient([server.address], transport="grpc") as client:
            gen = torch.Generator().manual_seed(0)
            for m in (1, 5, 300):
                x = hidden(m, gen)
                ids, w = routing(m, gen)
                out = client.forward(0, x, ids, w, request_id=f"r{m}")
                assert relative_error(out, reference_forward(full_layers[0], x, ids, w)) <= 1e-2
            client.forward(0, x, ids, w, token="per-call")  # other metadata: unary
        assert count(server, "ForwardStream") == 3 and count(server, "Forward") == 1


def test_stream_carries_the_token(bank_all):
    config = shard_config(0, auth_token="tok", **ALL)
    with BackgroundServer(config, bank=bank_all) as server:
        gen = torch.Generator().manual_seed(1)
        x = hidden(3, gen)
        ids, w = routing(3, gen)
        with ExpertClient([server.address], token="tok", transport="grpc") as client:
            assert client.forward(0, x, ids, w).shape == (3, 512)
        assert count(server, "ForwardStream") == 1
        with pytest.raises(CoverageError, match="UNAUTHENTICATED"):
            ExpertClient([server.address], token="nope", discover_timeout=2)


def test_draining_replica_ends_its_streams_and_calls_move_on(bank_all, full_layers):
    a = BackgroundServer(shard_config(0, **ALL), bank=bank_all)
    b = BackgroundServer(shard_config(0, **ALL), bank=bank_all)
    gen = torch.Generator().manual_seed(2)
    cases = [(hidden(8, gen), *routing(8, gen)) for _ in range(6)]
    try:
        with ExpertClient([a.address, b.address], timeout=10) as client:
            for x, ids, w in cases[:2]:  # streams open to both replicas
                client.forward(0, x, ids, w)
            t0 = time.monotonic()
            stopper = threading.Thread(target=a.stop, kwargs={"grace_s": 30})
            stopper.start()
            for x, ids, w in cases:  # keep calling while A drains and stops
                out = client.forward(0, x, ids, w)
                assert relative_error(out, reference_forward(full_layers[0], x, ids, w)) <= 1e-2
            stopper.join(timeout=30)
            # The open stream did not hold A's shutdown for the 30 s grace.
            assert time.monotonic() - t0 < 10
    finally:
        a.stop()
        b.stop()
