"""Missing coverage and dead shards: a clear error naming experts and addresses,
within the deadline, never a hang and never a silent zero."""

from __future__ import annotations

import socket
import time

import pytest
import torch
from conftest import hidden, routing, shard_config

from expertd.client import CoverageError, ExpertClient, ShardCallError
from expertd.kernels import reference_forward, relative_error
from expertd.server.app import BackgroundServer


def free_address() -> str:
    """A loopback port with nothing listening on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_down_shard_named_in_coverage_error(addresses):
    dead = free_address()
    live = [a for i, a in enumerate(addresses) if i != 2]  # shard 2 (experts 16-23) is missing
    t0 = time.monotonic()
    with ExpertClient([*live, dead], timeout=5, discover_timeout=2) as client:
        assert dead in client.unreachable
        gen = torch.Generator().manual_seed(0)
        x = hidden(4, gen)
        ids = torch.tensor([[1, 17, 30, -1]] * 4, dtype=torch.int32)
        with pytest.raises(CoverageError) as info:
            client.forward(0, x, ids, torch.rand((4, 4)))
    assert time.monotonic() - t0 < 10
    assert info.value.experts == [17]
    assert dead in str(info.value) and "17" in str(info.value)


def test_routes_that_avoid_the_missing_shard_still_work(addresses, full_layers):
    live = [a for i, a in enumerate(addresses) if i != 2]
    with ExpertClient([*live, free_address()], discover_timeout=2) as client:
        gen = torch.Generator().manual_seed(1)
        x = hidden(3, gen)
        ids = torch.tensor([[0, 9, 40, 63]] * 3, dtype=torch.int32)
        w = torch.rand((3, 4), generator=gen)
        out = client.forward(1, x, ids, w)
    assert relative_error(out, reference_forward(full_layers[1], x, ids, w)) <= 1e-2


def test_shard_dies_after_discovery(addresses):
    victim = BackgroundServer(shard_config(7))  # a second owner of experts 56-63
    others = [a for i, a in enumerate(addresses) if i != 7]
    with ExpertClient([*others, victim.address], timeout=5) as client:
        victim.stop()
        gen = torch.Generator().manual_seed(2)
        x = hidden(2, gen)
        ids = torch.tensor([[60, 1], [2, 3]], dtype=torch.int32)
        t0 = time.monotonic()
        with pytest.raises(ShardCallError) as info:
            client.forward(0, x, ids, torch.rand((2, 2)))
        assert time.monotonic() - t0 < 6
    assert info.value.address == victim.address and info.value.experts == [60]
    assert victim.address in str(info.value)


def test_no_shard_reachable():
    with pytest.raises(CoverageError) as info:
        ExpertClient([free_address(), free_address()], discover_timeout=1)
    assert "unreachable" in str(info.value)


def test_deadline_is_honoured(addresses):
    with ExpertClient(addresses) as client:
        gen = torch.Generator().manual_seed(3)
        x = hidden(4096, gen)
        ids, w = routing(4096, gen)
        t0 = time.monotonic()
        with pytest.raises(ShardCallError) as info:
            client.forward(0, x, ids, w, timeout=0.001)
        assert time.monotonic() - t0 < 3
    assert info.value.code.name == "DEADLINE_EXCEEDED"


def test_local_input_errors_before_sending(addresses):
    with ExpertClient(addresses) as client:
        with pytest.raises(ValueError, match="hidden_states"):
            client.forward(
                0, torch.zeros(2, 100), torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, 8)
            )
        with pytest.raises(ValueError, match=r"\[-1, 64\)"):
            client.forward(0, torch.zeros(1, 512), torch.tensor([[64]]), torch.ones(1, 1))
        with pytest.raises(CoverageError, match="layer 5"):
            client.forward(5, torch.zeros(1, 512), torch.tensor([[3]]), torch.ones(1, 1))
