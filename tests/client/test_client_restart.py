"""An address that restarts with another placement is never trusted with the old
one: the server refuses requests routed for its previous life, the client
re-describes it, and no route is silently dropped."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from conftest import hidden, shard_config

from expertd import wire
from expertd.client import CoverageError, ExpertClient, ShardCallError
from expertd.kernels import reference_forward, relative_error
from expertd.server.app import BackgroundServer
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import expertd_pb2_grpc as pb_grpc


def routed_to(experts: list[int], m: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    pick = torch.randint(0, len(experts), (m, 2), generator=gen)
    return torch.tensor(experts, dtype=torch.int32)[pick], torch.rand((m, 2), generator=gen)


def test_stale_instance_is_refused():
    with BackgroundServer(shard_config(0, num_shards=2)) as server:
        gen = torch.Generator().manual_seed(0)
        ids, w = routed_to([1, 2], 3, gen)
        req = pb.ForwardRequest(
            layer=0,
            hidden_states=wire.encode(hidden(3, gen)),
            topk_ids=wire.encode(ids),
            topk_weights=wire.encode(w),
            instance_id="an-earlier-life",
        )
        channel = grpc.insecure_channel(server.address)
        with channel, pytest.raises(grpc.RpcError) as info:
            pb_grpc.ExpertServiceStub(channel).Forward(req, timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "describe it again" in info.value.details()


def test_restart_with_another_placement_on_the_same_address(full_layers):
    first = BackgroundServer(shard_config(0, num_shards=2))  # experts 0-31
    address = first.address
    gen = torch.Generator().manual_seed(1)
    x = hidden(4, gen)
    low = routed_to(list(range(32)), 4, gen)
    high = routed_to(list(range(32, 64)), 4, gen)
    with ExpertClient([address], timeout=5, discover_timeout=2) as client:
        out = client.forward(0, x, *low)
        assert relative_error(out, reference_forward(full_layers[0], x, *low)) <= 1e-2
        first.stop()
        second = BackgroundServer(shard_config(1, num_shards=2, listen=address))  # 32-63
        try:
            # Routed by the old placement: refused and reported, never zeros.
            with pytest.raises((ShardCallError, CoverageError)):
                client.forward(0, x, *low)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the client re-describes the address
                if list(client.topology.shards[0].experts) == list(range(32, 64)):
                    break
                time.sleep(0.1)
            out = client.forward(0, x, *high)
            assert relative_error(out, reference_forward(full_layers[0], x, *high)) <= 1e-2
            with pytest.raises(CoverageError):  # 0-31 are served by no one now
                client.forward(0, x, *low)
        finally:
            second.stop()
