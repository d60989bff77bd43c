"""Prometheus metrics of one shard server (its own registry, so several servers
can live in one process), served on an HTTP port when asked.

The registry also holds the standard process_* and python_* collectors (a scrape
of several servers in one process reports that process in each). Counters and
histograms carry no *_created series unless asked (`created=True`): a sample per
series that dashboards never read."""

from __future__ import annotations

import torch
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

_TOKEN_BUCKETS = tuple(2.0**i for i in range(15))  # 1 .. 16384
_SECONDS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)
_BYTES = tuple(4.0**i for i in range(5, 16))  # 1 KiB .. 1 GiB


class _DeviceMemory:
    """GPU memory at scrape time (nothing on a CPU server)."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = device

    def collect(self):
        family = GaugeMetricFamily(
            "expertd_device_memory_bytes", "Device memory held by this process", labels=["kind"]
        )
        if self.device is not None and self.device.type == "cuda":
            family.add_metric(["allocated"], torch.cuda.memory_allocated(self.device))
            family.add_metric(["reserved"], torch.cuda.memory_reserved(self.device))
        yield family


class _Exposition:
    """What /metrics serves: the registry, less the *_created samples (unless kept)."""

    def __init__(self, registry: CollectorRegistry, created: bool) -> None:
        self.registry = registry
        self.created = created

    def collect(self):
        for family in self.registry.collect():
            if self.created or not any(s.name.endswith("_created") for s in family.samples):
                yield family
                continue
            kept = Metric(family.name, family.documentation, family.type, family.unit)
            kept.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield kept

    def restricted_registry(self, names):  # /metrics?name[]=...
        return _Exposition(self.registry.restricted_registry(names), self.created)


class Metrics:
    def __init__(self, created: bool = False) -> None:
        r = self.registry = CollectorRegistry()
        self.created = created  # serve the *_created series too
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)  # the process's standard series, as the default registry
        self.requests = Counter(
            "expertd_requests", "Requests by method and status code", ["method", "code"], registry=r
        )
        self.tokens = Counter("expertd_tokens", "Tokens computed", registry=r)
        self.lane_calls = Counter(
            "expertd_lane_calls",
            "Slot calls answered on the slot's own thread, outside the batcher (server/lane.py)",
            registry=r,
        )
        self.overload = Counter(
            "expertd_overload",
            "Requests refused with RESOURCE_EXHAUSTED for overload, by the limit reached: "
            "inflight (--max-inflight), queue_requests, queue_tokens",
            ["limit"],
            registry=r,
        )
        self.nonfinite = Counter(
            "expertd_nonfinite",
            "Requests refused for NaN/Inf, by cause: in the input, or an output that "
            "overflowed (finite but huge inputs)",
            ["cause"],
            registry=r,
        )
        self.batch_tokens = Histogram(
            "expertd_batch_tokens", "Tokens per merged forward", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.batch_requests = Histogram(
            "expertd_batch_requests",
            "Requests per merged forward",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            registry=r,
        )
        self.queue_seconds = Histogram(
            "expertd_queue_seconds", "Received -> compute start", buckets=_SECONDS, registry=r
        )
        self.compute_seconds = Histogram(
            "expertd_compute_seconds",
            "One merged forward: staging, copies, kernels",
            buckets=_SECONDS,
            registry=r,
        )
        self.encode_seconds = Histogram(
            "expertd_encode_seconds", "Output to response bytes", buckets=_SECONDS, registry=r
        )
        self.request_seconds = Histogram(
            "expertd_request_seconds",
            "One request end to end in the server: received (parsed) -> its answer ready "
            "(admission, validation, queue, forward, encode), every transport",
            buckets=_SECONDS,
            registry=r,
        )
        self.request_bytes = Histogram(
            "expertd_request_bytes",
            "Tensor bytes received per request (hidden states, ids, weights)",
            buckets=_BYTES,
            registry=r,
        )
        self.response_bytes = Histogram(
            "expertd_response_bytes",
            "Output tensor bytes sent per request",
            buckets=_BYTES,
            registry=r,
        )
        self.inflight = Gauge("expertd_inflight_requests", "Requests being served", registry=r)
        self.queued_tokens = Gauge(
            "expertd_queued_tokens", "Tokens waiting for compute", registry=r
        )
        self.resident_bytes = Gauge(
            "expertd_resident_weight_bytes", "Expert weights resident on the device", registry=r
        )
        self.gpu_mps = Gauge(
            "expertd_gpu_mps",
            "1 when an MPS control daemon serves this shard's GPU (processes sharing it run "
            "side by side), 0 when the GPU time-slices between them or the shard is on the CPU",
            registry=r,
        )
        self.dataplane_leases = Gauge(
            "expertd_dataplane_leases",
            "Data plane leases held by clients, by transport (shm, cuda-ipc, tcp, nixl)",
            ["transport"],
            registry=r,
        )
        self.dataplane_slots = Gauge(
            "expertd_dataplane_slots",
            "Data plane slots held by clients, by transport (shm, cuda-ipc, tcp, nixl)",
            ["transport"],
            registry=r,
        )
        self._memory = _DeviceMemory(None)
        r.register(self._memory)

    def watch_device(self, device: torch.device) -> None:
        self._memory.device = device

    def serve(self, port: int, host: str = "127.0.0.1"):
        """Start the /metrics HTTP endpoint on host:port; returns the bound port."""
        exposition = _Exposition(self.registry, self.created)
        server, _thread = start_http_server(port, addr=host, registry=exposition)
        self._http = server
        return server.server_port

    def close(self) -> None:
        server = getattr(self, "_http", None)
        if server is not None:
            server.shutdown()
            server.server_close()
