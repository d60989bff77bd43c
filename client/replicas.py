"""Replica state: which addresses are in rotation, how busy each is, when to
probe a dead one again. Touched only from the client's event loop, so no locks.

An address leaves rotation on a failed call or Describe (UNAVAILABLE, refused
connection, draining, a Describe that makes no sense) and comes back when a
probe's Describe answers; probes of a dead address back off exponentially
(0.2 s doubling to `max_backoff`), and a live address is re-described every
`refresh_s` so a restart with a new placement (new instance_id) is noticed.

Busy is not down: a replica that refuses a call for overload (RESOURCE_EXHAUSTED
while the request is within its limits) stays in rotation; the call backs off
and tries again (client/aio.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from expertd.client.channels import ExpertStub
from expertd.client.stream import ForwardStream
from expertd.v1 import expertd_pb2 as pb

# Statuses after which another replica may well succeed: the replica is down,
# draining or its connection broke, or it restarted since we described it
# (FAILED_PRECONDITION: it is re-described before it gets another call). Never
# the caller's mistake (INVALID_ARGUMENT, NOT_FOUND...), never DEADLINE_EXCEEDED
# (the deadline is the call's). RESOURCE_EXHAUSTED is overload when the request
# is within the server's limits: retried after a pause, the replica kept.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)
# Of those, the ones that do not take the replica out of rotation: a call the
# server (or gRPC on its behalf) cancelled says nothing about the replica's health;
# if it is down, the next call or probe finds out.
KEEPS_REPLICA = frozenset({grpc.StatusCode.CANCELLED})


@dataclass(slots=True, eq=False)
class Endpoint:
    address: str
    channel: grpc.aio.Channel
    stub: ExpertStub
    info: pb.DescribeResponse | None = None  # last Describe answer
    alive: bool = False
    why: str = "not described yet"  # why it is out of rotation
    outstanding: int = 0  # Forward calls in flight
    calls: int = 0  # Forward calls answered (for stats and tests)
    stream_calls: int = 0  # of them, queued on a caller's CUDA stream (client/onstream.py)
    failures: int = 0  # consecutive failures (drives the probe backoff)
    next_probe: float = 0.0  # monotonic time of the next Describe
    stream: ForwardStream | None = None  # the multiplexed ForwardStream, opened on first use
    dataplane: Any = None  # the same-host transport's channel (client/shm.py), when leased
    dataplane_for: str = ""  # the instance_id the data plane was last decided for
    dataplane_why: str = ""  # why this replica is on gRPC (when it is)
    last_timing: Any = None  # the shard's Timing of the last call it answered


@dataclass(slots=True)
class Pool:
    endpoints: dict[str, Endpoint]
    refresh_s: float = 10.0
    base_backoff: float = 0.2
    max_backoff: float = 5.0
    _turns: dict = field(default_factory=dict)  # per replica set: the tie-break rotation

    def mark_up(self, ep: Endpoint, info: pb.DescribeResponse) -> bool:
        """Back in rotation; True when what it serves (or its process) changed."""
        changed = ep.info is None or not _same(ep.info, info) or not ep.alive
        ep.info, ep.alive, ep.why, ep.failures = info, True, "", 0
        ep.next_probe = time.monotonic() + self.refresh_s
        return changed

    def mark_down(self, ep: Endpoint, why: str) -> None:
        """Out of rotation until a probe answers. The probe backoff grows with each
        failed probe, not with each call that failed meanwhile: the calls in flight
        when a replica went down all fail at once, and that is one failure."""
        was_alive, ep.alive, ep.why = ep.alive, False, why
        if not was_alive and ep.next_probe > time.monotonic():
            return  # already down, its next probe is set
        ep.failures = min(ep.failures + 1, 32)
        backoff = min(self.base_backoff * 2.0 ** (ep.failures - 1), self.max_backoff)
        ep.next_probe = time.monotonic() + backoff

    def due(self, now: float) -> list[Endpoint]:
        return [ep for ep in self.endpoints.values() if ep.next_probe <= now]

    def pick(self, addresses: tuple[str, ...], exclude) -> Endpoint | None:
        """The live replica with the fewest calls in flight (ties rotate)."""
        turn = self._turns[addresses] = self._turns.get(addresses, -1) + 1
        live = [
            (ep.outstanding, (i - turn) % len(addresses), ep)
            for i, a in enumerate(addresses)
            if (ep := self.endpoints[a]).alive and a not in exclude
        ]
        return min(live, key=lambda t: t[:2])[2] if live else None

    def has_live(self, addresses: tuple[str, ...], exclude) -> bool:
        """Is any of `addresses` in rotation, besides those in `exclude`?"""
        return any(self.endpoints[a].alive for a in addresses if a not in exclude)

    def down(self, addresses=None) -> dict[str, str]:
        """address -> why, for those out of rotation (of `addresses`, or all)."""
        names = self.endpoints if addresses is None else addresses
        return {a: self.endpoints[a].why for a in names if not self.endpoints[a].alive}

    def stats(self) -> dict[str, dict]:
        return {
            a: {
                "alive": ep.alive,
                "why": ep.why,
                "outstanding": ep.outstanding,
                "calls": ep.calls,
                "stream_calls": ep.stream_calls,
                "instance_id": ep.info.instance_id if ep.info else "",
                "transport": ep.dataplane.name if ep.dataplane is not None else "grpc",
                "transport_why": ep.dataplane_why,
                "slots": ep.dataplane.size if ep.dataplane is not None else 0,
                "slot_rows": ep.dataplane.rows if ep.dataplane is not None else 0,
                # where the slots' rows live: "device" (cuda-ipc, NIXL on GPU memory)
                "slot_memory": (
                    ""
                    if ep.dataplane is None
                    else "device"
                    if getattr(ep.dataplane, "on_device", False)
                    else "host"
                ),
                "last_timing": _timing_dict(ep.last_timing),
            }
            for a, ep in self.endpoints.items()
        }


def _timing_dict(timing) -> dict:
    if timing is None or isinstance(timing, dict):
        return timing or {}
    return {f.name: getattr(timing, f.name) for f in pb.Timing.DESCRIPTOR.fields}


def _same(a: pb.DescribeResponse, b: pb.DescribeResponse) -> bool:
    return (a.instance_id, list(a.experts), list(a.layers)) == (
        b.instance_id,
        list(b.experts),
        list(b.layers),
    )
