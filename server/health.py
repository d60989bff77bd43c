"""grpc.health.v1 for the shard server: Check and Watch, and an end to every Watch
when the server drains.

grpc's own aio servicer keeps a Watch open until the server stops, so a watching
client (a load balancer, a probe) would hold shutdown for the whole grace period.
Here, once `shutdown()` is called, every status reads NOT_SERVING, each watcher (of
any service name) is sent that, and its stream ends (OK): nothing of health is left for the drain to
wait on.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self._status: dict[str, int] = {}
        self._changed = asyncio.Event()  # set (and replaced) on every change
        self._closing = False

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def set(self, service: str, status: int) -> None:
        """Set a service's status (ignored once shutting down)."""
        if not self._closing:
            self._status[service] = status
            self._notify()

    async def shutdown(self) -> None:
        """Every status NOT_SERVING for good; open Watch streams send it and end."""
        self._closing = True
        for service in self._status:
            self._status[service] = NOT_SERVING
        self._notify()

    async def Check(self, request, context):
        status = self._status.get(request.service)
        if status is None:
            name = request.service if len(request.service) <= 64 else request.service[:64] + "..."
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {name!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, context) -> None:
        """The status now, then each change; ends after shutdown()'s NOT_SERVING."""
        sent = None
        while True:
            # Event, closing flag and status are read together, before any await: a
            # shutdown() while a write below is in flight sets `changed`, and the next
            # pass sends NOT_SERVING. (Deciding to end on `_closing` read after the
            # write would end the stream without it.)
            changed = self._changed
            closing = self._closing
            status = self._status.get(request.service, SERVICE_UNKNOWN)
            if closing:  # the whole server is going away, whatever the service
                status = NOT_SERVING
            if status != sent:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                sent = status
            if closing:
                return
            await changed.wait()
