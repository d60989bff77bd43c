"""Server configuration: one dataclass, filled from flags or EXPERTD_* variables."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ServerConfig:
    # Where the weights come from: a checkpoint directory or a synthetic preset.
    checkpoint: str | None = None
    synthetic: str | None = None  # preset name
    layers: int | None = (
        None  # synthetic: how many layers; checkpoint: serve the first N (None = all)
    )
    seed: int = 0  # synthetic seed
    prefix: str = "model."  # checkpoint tensor-name prefix
    # Which experts: shard s of n (contiguous ranges), or an explicit list.
    shard: int = 0
    num_shards: int = 1
    experts: list[int] | None = None
    # Where and how it runs.
    listen: str = "127.0.0.1:0"
    device: str = "cpu"
    backend: str | None = None  # None = the best one for the device
    # Limits.
    max_tokens: int = 16384  # tokens per request
    max_top_k: int = 64  # routes per token
    max_inflight: int = 512  # concurrent requests before RESOURCE_EXHAUSTED
    max_queue_requests: int = 1024  # requests waiting for compute
    max_queue_tokens: int = 65536  # tokens waiting for compute
    grace_s: float = 30.0  # drain time on SIGTERM
    drain_delay_s: float = 1.0  # SIGTERM: health NOT_SERVING, calls still admitted this long
    torch_threads: int | None = None  # intra-op threads (None = torch's default)
    # Batching: merge concurrent requests of one layer into one forward.
    batch_window_us: int = 0  # extra wait for company (0: merge only what is already queued)
    max_batch_tokens: int = 16384
    max_batch_requests: int = 256  # 1 turns batching off
    graph_max_tokens: int = 1024  # CUDA graphs for merged batches up to this many tokens (0: off)
    pipeline_depth: int | None = None  # batches in flight on a GPU (None: runner's default, 2)
    # Connections and calls: caps on what clients can hold open (0 or None: no cap).
    # calls in progress, every method, then RESOURCE_EXHAUSTED: a backstop far above
    # max_inflight, so overload stays the service's own counted refusal
    max_concurrent_rpcs: int = 8192
    max_connections: int = 1024  # open client connections; more are closed at once
    max_streams_per_connection: int = 4096  # concurrent calls on one connection (HTTP/2)
    receive_timeout_s: float = 30.0  # a call's request message must arrive within this
    stream_idle_timeout_s: float = 300.0  # a stream's next request, else its requests end
    connection_idle_s: float = 600.0  # connections without calls for this long are closed
    max_connection_age_s: float = 0.0  # connections are asked to reconnect after this long
    keepalive_s: float = 60.0  # ping a quiet connection this often; no answer in 20 s: closed
    # Security: bearer token (from a file or EXPERTD_AUTH_TOKEN), TLS from PEM files.
    auth_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None  # set: clients must present a certificate it signed
    # OIP shared-memory extensions: clients may register their shared memory (off by default,
    # as in Triton: a registered client reads and writes any object the server may open).
    allow_client_shm: bool = False
    # Observability.
    metrics_port: int | None = None  # Prometheus /metrics on this port (None: off)
    # HOST:PORT for /metrics (overrides metrics_port's host, the serving host), or "off"
    metrics_listen: str | None = None
    metrics_created: bool = False  # also serve the *_created series of counters, histograms
    trace: str | None = None  # tracing (expertd/tracing.py): off, on, console, otlp, jsonl:PATH
    health_listen: str | None = None  # extra plaintext grpc.health.v1-only address
    # The raw TCP data plane (server/tcpslots.py) on this port of the serving host (0: any
    # free port; None: off). Never with TLS: its tensors travel in the clear.
    tcp_data_port: int | None = 0
    # NIXL clients wake the shard's progress thread with a datagram on this UDP port of
    # the serving host (expertd/nixl.py WakePort; 0: any free port; None: off).
    nixl_wake_port: int | None = 0
    # A GPU shard page-locks the shm slot rows its calls use, so its copies to and from
    # the GPU are DMA straight from the client's slot (server/slots.py).
    pin_slots: bool = True
    # A GPU shard runs a cuda-ipc slot call (up to its largest graph bucket) on the slot's
    # thread, outside the batcher, when the batcher is idle (server/lane.py).
    lane: bool = True

    def source(self) -> str:
        if self.synthetic:
            return f"synthetic:{self.synthetic}:seed={self.seed}"
        return self.checkpoint or ""


def parse_expert_list(text: str) -> list[int]:
    """'0-27,200,201' -> [0, 1, ..., 27, 200, 201] (sorted, distinct)."""
    experts: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(
                f"bad expert range {part!r} in {text!r} (want e.g. 0-27,200)"
            ) from None
        if a < 0 or b < a:
            raise ValueError(f"bad expert range {part!r} in {text!r}")
        experts.update(range(a, b + 1))
    if not experts:
        raise ValueError(f"empty expert list {text!r}")
    return sorted(experts)


def shard_experts(num_experts: int, shard: int, num_shards: int) -> list[int]:
    """Shard s of n owns the contiguous range [s*E/n, (s+1)*E/n) (docs/protocol.md)."""
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is not in [0, {num_shards})")
    if num_shards > num_experts:
        raise ValueError(f"{num_shards} shards for {num_experts} experts: some would own none")
    return list(range(shard * num_experts // num_shards, (shard + 1) * num_experts // num_shards))
