"""Where a client's calls spend their time, stage by stage (docs/operations.md).

Every call adds its stages to running totals (`AsyncExpertClient.timings()`);
given a Prometheus registry (`metrics=`), the client also observes each stage
in the histogram `expertd_client_stage_seconds{stage}`. The stages:

    stage           checks and the inputs' copy to the host (prepare)
    route           splitting the routes over the shards
    encode          a request to bytes (gRPC; grpc's serializer, timed)
    rpc             one shard's attempt: sent -> answered (any transport)
    server          the shard's own time for it (its Timing: received -> answer ready)
    server_queue    of which waiting for the batch to start
    server_compute  of which the merged forward
    transfer        rpc - server: the wire both ways, the event loops, the waits
    doorbell        of which, same-host slots: the ring -> the shard's waiter running
    wake            of which, same-host slots: the shard's answer -> the caller seeing it
    decode          an answer's bytes to a view (gRPC; grpc's deserializer, timed)
    sum             the shards' partials summed into the result
    call            route + fan-out + sum, the whole call after staging

Totals are kept without a lock: calls on several threads at once may lose an
update now and then (they are statistics, not accounts).
"""

from __future__ import annotations

import time
import weakref

STAGES = (
    "stage",
    "route",
    "encode",
    "rpc",
    "server",
    "server_queue",
    "server_compute",
    "transfer",
    "doorbell",
    "wake",
    "decode",
    "sum",
    "call",
)
_histograms: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # registry -> histogram
_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)


class Telemetry:
    def __init__(self, registry=None) -> None:
        self.count = dict.fromkeys(STAGES, 0)
        self.total_ns = dict.fromkeys(STAGES, 0)
        self._hist = None
        if registry is not None:
            h = _histograms.get(registry)
            if h is None:  # one per registry: the clients that share it add up there
                from prometheus_client import Histogram

                h = _histograms[registry] = Histogram(
                    "expertd_client_stage_seconds",
                    "Time of one stage of the client's calls (client/telemetry.py)",
                    ["stage"],
                    buckets=_BUCKETS,
                    registry=registry,
                )
            self._hist = {s: h.labels(s) for s in STAGES}

    def add(self, stage: str, ns: int) -> None:
        self.count[stage] += 1
        self.total_ns[stage] += ns
        if self._hist is not None:
            self._hist[stage].observe(ns / 1e9)

    def answered(self, rpc_ns: int, timing) -> None:
        """One shard's attempt answered in `rpc_ns`, with the shard's Timing (a
        pb.Timing or a slot's dict of its fields)."""
        self.add("rpc", rpc_ns)
        if timing is None:
            return
        if isinstance(timing, dict):
            total, queue, compute = timing["total_us"], timing["queue_us"], timing["compute_us"]
        else:
            total, queue, compute = timing.total_us, timing.queue_us, timing.compute_us
        self.add("server", total * 1000)
        self.add("server_queue", queue * 1000)
        self.add("server_compute", compute * 1000)
        self.add("transfer", max(rpc_ns - total * 1000, 0))
        if isinstance(timing, dict) and "doorbell_us" in timing:
            self.add("doorbell", int(timing["doorbell_us"] * 1000))
            self.add("wake", int(timing["wake_us"] * 1000))

    def timed(self, stage: str, fn):
        """`fn` (one argument), its time added to `stage` on every call."""
        clock, add = time.perf_counter_ns, self.add

        def run(arg):
            t0 = clock()
            try:
                return fn(arg)
            finally:
                add(stage, clock() - t0)

        return run

    def summary(self) -> dict[str, dict]:
        """stage -> {"count", "total_s", "mean_us"} for the stages seen so far."""
        out = {}
        for s in STAGES:
            n = self.count[s]
            if n:
                t = self.total_ns[s]
                out[s] = {"count": n, "total_s": t / 1e9, "mean_us": t / n / 1e3}
        return out


def transfer_attributes(sent_ns: int, timing) -> dict:
    """A shard call's span attributes: the shard's own time and the rest (the
    transfer both ways), in microseconds, from its Timing."""
    rpc_us = (time.perf_counter_ns() - sent_ns) // 1000
    if timing is None:
        return {"expertd.rpc_us": rpc_us}
    total = timing["total_us"] if isinstance(timing, dict) else timing.total_us
    attrs = {
        "expertd.rpc_us": rpc_us,
        "expertd.server_us": total,
        "expertd.transfer_us": max(rpc_us - total, 0),
    }
    if isinstance(timing, dict) and "doorbell_us" in timing:  # a same-host slot's wake-ups
        attrs["expertd.doorbell_us"] = round(timing["doorbell_us"], 1)
        attrs["expertd.wake_us"] = round(timing["wake_us"], 1)
    return attrs
