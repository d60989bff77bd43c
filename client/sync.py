"""ExpertClient: the synchronous SDK.

    with ExpertClient(["10.0.0.1:50051", "10.0.0.2:50051"]) as client:
        out = client.forward(layer, hidden_states, topk_ids, topk_weights)

It asks every address `Describe`, builds the expert -> shard map from the
answers, and for each call sends each shard only the tokens (and routes) it
owns, all shards at once, then sums the partial outputs.
"""

from __future__ import annotations

import time

import grpc
import torch

from expertd.client.core import CHANNEL_OPTIONS, combine, metadata_tuples, prepare_call
from expertd.client.errors import CoverageError, ShardCallError
from expertd.client.routing import ShardInfo, Topology
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import expertd_pb2_grpc as pb_grpc


class ExpertClient:
    def __init__(
        self,
        addresses: list[str],
        *,
        timeout: float = 30.0,
        discover_timeout: float = 5.0,
        metadata=None,
    ) -> None:
        if not addresses:
            raise ValueError("ExpertClient needs at least one address")
        self.addresses = list(dict.fromkeys(addresses))
        self.timeout = timeout
        self.discover_timeout = discover_timeout
        self._metadata = metadata_tuples(metadata)
        self._channels = {
            a: grpc.insecure_channel(a, options=CHANNEL_OPTIONS) for a in self.addresses
        }
        self._stubs = {a: pb_grpc.ExpertServiceStub(c) for a, c in self._channels.items()}
        self.unreachable: dict[str, str] = {}
        self.topology: Topology | None = None
        self.refresh()

    def refresh(self, timeout: float | None = None) -> Topology:
        """Describe every address (concurrently) and rebuild the expert -> shard map."""
        timeout = self.discover_timeout if timeout is None else timeout
        futures = {
            a: s.Describe.future(pb.DescribeRequest(), timeout=timeout, metadata=self._metadata)
            for a, s in self._stubs.items()
        }
        shards, unreachable = [], {}
        for address, fut in futures.items():
            try:
                shards.append(ShardInfo(address, fut.result()))
            except grpc.RpcError as e:
                unreachable[address] = f"{e.code().name}: {e.details()}"
        self.unreachable = unreachable
        if not shards:
            raise CoverageError(-1, [], unreachable)
        self.topology = Topology.from_shards(shards)
        return self.topology

    def forward(
        self,
        layer: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        timeout: float | None = None,
        metadata=None,
    ) -> torch.Tensor:
        """-> bf16 [M, H] on hidden_states' device: the layer's expert output."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        try:
            call = prepare_call(
                self.topology, self.unreachable, layer, hidden_states, topk_ids, topk_weights
            )
        except CoverageError:
            if not self.unreachable:
                raise
            # A shard that was down may be back: look once more, within the deadline.
            self.refresh(min(self.discover_timeout, max(deadline - time.monotonic(), 0.01)))
            call = prepare_call(
                self.topology, self.unreachable, layer, hidden_states, topk_ids, topk_weights
            )
        md = self._metadata + metadata_tuples(metadata)
        shards = self.topology.shards
        futures = [
            self._stubs[shards[p.shard].address].Forward.future(
                req, timeout=max(deadline - time.monotonic(), 0.001), metadata=md
            )
            for p, req in zip(call.parts, call.requests, strict=True)
        ]
        outputs = []
        try:
            for part, fut in zip(call.parts, futures, strict=True):
                try:
                    outputs.append(fut.result())
                except grpc.RpcError as e:
                    raise ShardCallError(
                        shards[part.shard].address, layer, part.experts, e.code(), e.details()
                    ) from None
        finally:
            for fut in futures:
                fut.cancel()
        return combine(call, self.topology.hidden_size, outputs)

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()

    def __enter__(self) -> ExpertClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
