"""AsyncExpertClient: the asyncio twin of ExpertClient (same routing, same sum).

client = await AsyncExpertClient.connect(addresses)
out = await client.forward(layer, hidden_states, topk_ids, topk_weights)
"""

from __future__ import annotations

import asyncio
import time

import grpc
import torch

from expertd.client.core import CHANNEL_OPTIONS, combine, metadata_tuples, prepare_call
from expertd.client.errors import CoverageError, ShardCallError
from expertd.client.routing import ShardInfo, Topology
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import expertd_pb2_grpc as pb_grpc


class AsyncExpertClient:
    def __init__(
        self,
        addresses: list[str],
        *,
        timeout: float = 30.0,
        discover_timeout: float = 5.0,
        metadata=None,
    ) -> None:
        """Makes channels only; `await client.refresh()` (or `connect`) before forward."""
        if not addresses:
            raise ValueError("AsyncExpertClient needs at least one address")
        self.addresses = list(dict.fromkeys(addresses))
        self.timeout = timeout
        self.discover_timeout = discover_timeout
        self._metadata = metadata_tuples(metadata)
        self._channels = {
            a: grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in self.addresses
        }
        self._stubs = {a: pb_grpc.ExpertServiceStub(c) for a, c in self._channels.items()}
        self.unreachable: dict[str, str] = {}
        self.topology: Topology | None = None

    @classmethod
    async def connect(cls, addresses: list[str], **kwargs) -> AsyncExpertClient:
        client = cls(addresses, **kwargs)
        await client.refresh()
        return client

    async def _describe(self, address: str, timeout: float):
        try:
            reply = await self._stubs[address].Describe(
                pb.DescribeRequest(), timeout=timeout, metadata=self._metadata
            )
            return ShardInfo(address, reply)
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}"

    async def refresh(self, timeout: float | None = None) -> Topology:
        timeout = self.discover_timeout if timeout is None else timeout
        answers = await asyncio.gather(*(self._describe(a, timeout) for a in self.addresses))
        shards = [a for a in answers if isinstance(a, ShardInfo)]
        self.unreachable = {
            addr: a for addr, a in zip(self.addresses, answers, strict=True) if isinstance(a, str)
        }
        if not shards:
            raise CoverageError(-1, [], self.unreachable)
        self.topology = Topology.from_shards(shards)
        return self.topology

    async def forward(
        self,
        layer: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        timeout: float | None = None,
        metadata=None,
    ) -> torch.Tensor:
        if self.topology is None:
            await self.refresh()
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        try:
            call = prepare_call(
                self.topology, self.unreachable, layer, hidden_states, topk_ids, topk_weights
            )
        except CoverageError:
            if not self.unreachable:
                raise
            await self.refresh(min(self.discover_timeout, max(deadline - time.monotonic(), 0.01)))
            call = prepare_call(
                self.topology, self.unreachable, layer, hidden_states, topk_ids, topk_weights
            )
        md = self._metadata + metadata_tuples(metadata)
        shards = self.topology.shards

        async def send(part, req):
            address = shards[part.shard].address
            try:
                return await self._stubs[address].Forward(
                    req, timeout=max(deadline - time.monotonic(), 0.001), metadata=md
                )
            except grpc.RpcError as e:
                raise ShardCallError(address, layer, part.experts, e.code(), e.details()) from None

        tasks = [
            asyncio.ensure_future(send(p, r))
            for p, r in zip(call.parts, call.requests, strict=True)
        ]
        try:
            outputs = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        return combine(call, self.topology.hidden_size, list(outputs))

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels.values()))

    async def __aenter__(self) -> AsyncExpertClient:
        if self.topology is None:
            await self.refresh()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
