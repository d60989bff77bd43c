"""Assembling and running a shard server: our service, the Open Inference Protocol,
grpc.health.v1, reflection (v1 and v1alpha).

The server binds first (port 0 allowed) and answers health NOT_SERVING while it
loads; it reports SERVING once every layer is resident, and NOT_SERVING again
while it drains on SIGTERM/SIGINT (health Watch streams end then). A signal while
the experts are still loading stops the process at once, exit code 0.

Every call passes the request guard (server/malformed.py: receive timeout, bounded
parse) and, with a token, the auth check before it (server/security.py); the
transport caps connections, streams per connection and calls in progress.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2_grpc

from expertd import cudamem, tracing
from expertd.aioloop import start_loop_thread, stop_loop_thread
from expertd.codec import parse_forward_request, serialize_forward_response
from expertd.server import reflection
from expertd.server.bank import ExpertBank, WeightSource
from expertd.server.batcher import BatchPolicy
from expertd.server.config import ServerConfig
from expertd.server.health import NOT_SERVING, SERVING, HealthServicer
from expertd.server.health import SERVICE_NAME as HEALTH_SERVICE_NAME
from expertd.server.malformed import ReceiveLimits, RequestGuard
from expertd.server.memory import HeapTrimmer
from expertd.server.metrics import Metrics
from expertd.server.oip import InferenceServicer
from expertd.server.runner import BatchRunner
from expertd.server.security import BearerAuthInterceptor, server_credentials
from expertd.server.service import ExpertServicer, server_options
from expertd.server.validate import Limits
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import inference_pb2 as oip
from expertd.v1 import inference_pb2_grpc as oip_grpc

log = logging.getLogger("expertd.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ExpertService"].full_name
OIP_SERVICE_NAME = oip.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name


@dataclass(slots=True)
class RunningServer:
    server: grpc.aio.Server
    servicer: ExpertServicer
    health: HealthServicer
    address: str  # host:port actually bound (or the unix: address)
    port: int
    metrics: Metrics
    metrics_port: int | None = None
    metrics_host: str | None = None
    health_server: grpc.aio.Server | None = None  # plaintext health-only port (TLS setups)
    health_port: int | None = None
    tcp_port: int | None = None  # the raw TCP data plane's port (None: off)
    inference: InferenceServicer | None = None  # the OIP service (holds shared-memory regions)
    trimmer: HeapTrimmer | None = None  # returns freed memory after large requests

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        for name in ("", SERVICE_NAME, OIP_SERVICE_NAME):
            await self.health.set(name, status)

    async def attach(self, bank: ExpertBank, runner: BatchRunner) -> None:
        self.servicer.attach(bank, runner)
        await self.set_serving(True)

    async def drain_and_stop(self, grace_s: float, delay_s: float = 0.0) -> None:
        """Health NOT_SERVING; for delay_s keep admitting calls (those already on the wire,
        and whatever arrives before clients and load balancers see the health change); then
        refuse new calls, let in-flight ones finish (up to grace_s), stop. Health
        Watch streams get their NOT_SERVING and end at once."""
        await self.health.shutdown()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        self.servicer.draining = True
        await self.server.stop(grace_s)
        if self.health_server is not None:
            # Its calls end by themselves once health is shut down (a Check at once, a
            # Watch after its NOT_SERVING), so a graceful stop returns as soon as they
            # have; stop(0) would cancel a Watch whose last write is still in flight on
            # a loaded machine, and its client would never see NOT_SERVING.
            await self.health_server.stop(grace_s)
        await self.servicer.close()
        if self.inference is not None:
            self.inference.close()  # unregisters every shared-memory region
        self.metrics.close()
        if self.trimmer is not None:
            await self.trimmer.stop()


def message_limits(config: ServerConfig, hidden_size: int) -> tuple[Limits, list[tuple[str, int]]]:
    limits = Limits(config.max_tokens, config.max_top_k)
    receive = limits.max_message_bytes(hidden_size)
    send = config.max_tokens * hidden_size * 2 + (1 << 20)
    options = [
        ("grpc.max_receive_message_length", receive),
        ("grpc.max_send_message_length", send),
        ("grpc.so_reuseport", 0),
        *transport_options(config),
    ]
    return limits, options


def _ms(seconds: float) -> int:
    return max(int(seconds * 1000), 1)


def transport_options(config: ServerConfig) -> list[tuple[str, int]]:
    """Caps on what clients hold open, as grpc's channel arguments (0: no cap)."""
    options = [
        # Clients may ping (keepalive) at most every 10 s, more is closed off after two
        # strikes; the server pings quiet connections itself to find dead peers.
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.keepalive_timeout_ms", 20_000),
    ]
    if config.keepalive_s > 0:
        options.append(("grpc.keepalive_time_ms", _ms(config.keepalive_s)))
    if config.max_connections > 0:
        options.append(("grpc.max_allowed_incoming_connections", config.max_connections))
    if config.max_streams_per_connection > 0:
        options.append(("grpc.max_concurrent_streams", config.max_streams_per_connection))
    if config.connection_idle_s > 0:
        options.append(("grpc.max_connection_idle_ms", _ms(config.connection_idle_s)))
    if config.max_connection_age_s > 0:
        options.append(("grpc.max_connection_age_ms", _ms(config.max_connection_age_s)))
        options.append(("grpc.max_connection_age_grace_ms", _ms(config.grace_s)))
    return options


def receive_limits(config: ServerConfig) -> ReceiveLimits:
    return ReceiveLimits(
        receive_timeout_s=config.receive_timeout_s or None,
        stream_idle_s=config.stream_idle_timeout_s or None,
    )


def add_expert_service(servicer: ExpertServicer, server: grpc.aio.Server) -> None:
    """Register expertd.v1.ExpertService like the generated code does, except that
    requests carrying tensors are read off the received bytes without a copy
    (expertd/codec.py) instead of through protobuf's parse."""
    response = serialize_forward_response  # answers come serialized, errors as messages
    handlers = {
        "Forward": grpc.unary_unary_rpc_method_handler(
            servicer.Forward,
            request_deserializer=parse_forward_request,
            response_serializer=response,
        ),
        "ForwardStream": grpc.stream_stream_rpc_method_handler(
            servicer.ForwardStream,
            request_deserializer=parse_forward_request,
            response_serializer=response,
        ),
        "Describe": grpc.unary_unary_rpc_method_handler(
            servicer.Describe,
            request_deserializer=pb.DescribeRequest.FromString,
            response_serializer=pb.DescribeResponse.SerializeToString,
        ),
        "RegisterSlots": grpc.unary_unary_rpc_method_handler(
            servicer.RegisterSlots,
            request_deserializer=pb.RegisterSlotsRequest.FromString,
            response_serializer=pb.RegisterSlotsResponse.SerializeToString,
        ),
        "RegisterRemoteSlots": grpc.unary_stream_rpc_method_handler(
            servicer.RegisterRemoteSlots,
            request_deserializer=pb.RegisterSlotsRequest.FromString,
            response_serializer=pb.RegisterSlotsResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def batch_policy(config: ServerConfig) -> BatchPolicy:
    return BatchPolicy(
        window_s=config.batch_window_us / 1e6,
        max_batch_tokens=max(config.max_batch_tokens, config.max_tokens),
        max_batch_requests=max(config.max_batch_requests, 1),
        max_queue_requests=config.max_queue_requests,
        max_queue_tokens=max(config.max_queue_tokens, config.max_tokens),
    )


async def start(config: ServerConfig, hidden_size: int) -> RunningServer:
    """Bind and start answering (health NOT_SERVING until a bank is attached)."""
    limits, options = message_limits(config, hidden_size)
    interceptors = [BearerAuthInterceptor(config.auth_token)] if config.auth_token else []
    interceptors.append(RequestGuard(receive_limits(config)))
    options += server_options(config.max_inflight)  # overload: RESOURCE_EXHAUSTED, counted
    server = grpc.aio.server(
        options=options,
        interceptors=interceptors,
        maximum_concurrent_rpcs=config.max_concurrent_rpcs or None,
    )
    metrics = Metrics(created=config.metrics_created)
    servicer = ExpertServicer(
        limits,
        batch_policy(config),
        metrics,
        config.shard,
        config.num_shards,
        max_inflight=config.max_inflight,
        pin_slots=config.pin_slots,
        lane=config.lane,
    )
    add_expert_service(servicer, server)
    inference = InferenceServicer(servicer, allow_shm=config.allow_client_shm)
    oip_grpc.add_GRPCInferenceServiceServicer_to_server(inference, server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable((SERVICE_NAME, OIP_SERVICE_NAME, HEALTH_SERVICE_NAME), server)
    credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
    if credentials is None:
        port = server.add_insecure_port(config.listen)
    else:
        port = server.add_secure_port(config.listen, credentials)
    if port == 0 and not config.listen.startswith("unix:"):
        raise OSError(f"could not bind {config.listen}")
    await server.start()
    running = RunningServer(
        server, servicer, health_servicer, _bound(config.listen, port), port, metrics
    )
    if servicer.remote is not None:
        if config.nixl_wake_port is None or config.listen.startswith("unix"):
            servicer.remote.wake_at = None
        else:
            host = config.listen.rpartition(":")[0].strip("[]") or None
            servicer.remote.wake_at = (host, config.nixl_wake_port)
    if (
        config.tcp_data_port is not None
        and credentials is None
        and not config.listen.startswith("unix")
    ):
        host = config.listen.rpartition(":")[0].strip("[]")
        try:
            running.tcp_port = servicer.open_tcp(
                host, config.tcp_data_port, config.receive_timeout_s
            )
        except OSError:  # its port is taken: say so and stop, as for the gRPC port
            await server.stop(None)
            raise
    running.inference = inference
    where = metrics_address(config)
    if where is not None:
        running.metrics_host = where[0]
        running.metrics_port = metrics.serve(where[1], where[0])
    if config.health_listen:
        # Kubernetes' gRPC probes and most health checkers speak plaintext only: with TLS
        # on the main port, serve grpc.health.v1 (and nothing else) here in the clear.
        running.health_server = grpc.aio.server(
            options=transport_options(config),
            interceptors=[RequestGuard(receive_limits(config))],
            maximum_concurrent_rpcs=config.max_concurrent_rpcs or None,
        )
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, running.health_server)
        running.health_port = running.health_server.add_insecure_port(config.health_listen)
        await running.health_server.start()
    running.trimmer = HeapTrimmer()
    running.trimmer.start()
    await running.set_serving(False)
    return running


def metrics_address(config: ServerConfig) -> tuple[str, int] | None:
    """(host, port) for /metrics, or None: off. `metrics_listen` HOST:PORT, or "off";
    else `metrics_port` on the serving host (a unix socket's server: 127.0.0.1), so
    the metrics are exposed no wider than the service itself."""
    listen = config.metrics_listen
    if listen is not None and listen.strip().lower() == "off":
        return None
    if listen:
        host, sep, port = listen.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"metrics address {listen!r}: want HOST:PORT or off")
        return host.strip("[]") or "0.0.0.0", int(port)
    if config.metrics_port is None:
        return None
    if config.listen.startswith("unix:"):
        return "127.0.0.1", config.metrics_port
    return config.listen.rpartition(":")[0].strip("[]") or "0.0.0.0", config.metrics_port


def _bound(listen: str, port: int) -> str:
    if listen.startswith("unix:"):
        return listen
    host = listen.rsplit(":", 1)[0]
    return f"{host}:{port}"


def load_and_warm(
    config: ServerConfig, source: WeightSource | None = None, bank: ExpertBank | None = None
) -> tuple[ExpertBank, BatchRunner]:
    """Load the experts (unless given) and warm up (CUDA graphs captured) before SERVING."""
    if bank is None:
        bank = ExpertBank.load(config, source=source)
    runner = BatchRunner(
        bank,
        graph_max_tokens=config.graph_max_tokens,
        depth=config.pipeline_depth,
        lane=config.lane,
    )
    runner.warmup()
    return bank, runner


async def _load_in_thread(config: ServerConfig, source: WeightSource):
    """Load on a daemon thread, so a SIGTERM during loading can still exit promptly."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def work() -> None:
        try:
            loaded = load_and_warm(config, source)
        except BaseException as e:
            loop.call_soon_threadsafe(_settle, done, None, e)
        else:
            loop.call_soon_threadsafe(_settle, done, loaded, None)

    threading.Thread(target=work, name="expertd-load", daemon=True).start()
    return await done


def _settle(fut: asyncio.Future, value, error) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


def gpu_sharing_line() -> str:
    """How processes sharing this shard's GPU are scheduled, in one line."""
    pipe = cudamem.mps_control_pipe()
    if pipe:
        return f"GPU sharing: MPS ({pipe}): processes on this GPU run side by side"
    return (
        "GPU sharing: no MPS control daemon (CUDA_MPS_PIPE_DIRECTORY or /tmp/nvidia-mps): "
        "processes sharing this GPU (a frontend, other shards) are time-sliced, 0.1-0.3 ms "
        "a call between two of them, tens of ms among three "
        '(docs/operations.md, "Several processes on one GPU")'
    )


def security_posture(config: ServerConfig, running: RunningServer) -> tuple[int, str]:
    """(log level, one line): what a client must present, and what is exposed where."""
    auth = "bearer token" if config.auth_token else "off"
    tls = "off (plaintext)"
    if config.tls_cert:
        tls = "mutual (client certificates required)" if config.tls_client_ca else "on"
    metrics = "off"
    if running.metrics_port is not None:
        host = running.metrics_host
        host = f"[{host}]" if ":" in host else host
        metrics = f"{host}:{running.metrics_port} (plaintext, no auth)"
    tcp = "off" if running.tcp_port is None else f"port {running.tcp_port} (plaintext)"
    health = "off"
    if running.health_server is not None:
        health = f"{_bound(config.health_listen, running.health_port)} (plaintext)"
    line = (
        f"security: listening on {running.address}, auth {auth}, TLS {tls}, "
        f"metrics {metrics}, health-only port {health}, tcp data plane {tcp}"
    )
    host = running.address.rsplit(":", 1)[0].strip("[]")
    local = running.address.startswith("unix:") or host in ("127.0.0.1", "::1", "localhost")
    if not local and not config.auth_token and not config.tls_client_ca:
        return logging.WARNING, line + ": anyone who reaches this address can call every method"
    return logging.INFO, line


def _exit_now(code: int) -> None:
    """Leave the process at once, logs flushed: for a stop while the loader thread
    is still inside torch (reading, repacking, capturing graphs), which cannot be
    interrupted, and around which the interpreter's own exit aborts the process."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


async def serve(config: ServerConfig, on_listening=None) -> int:
    """The `expertd serve` main loop; returns the process exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        metrics_address(config)  # a bad address or tracing spec: say so, exit 2
        if tracing.configure(config.trace):
            log.info("tracing on (%s)", config.trace or os.environ.get(tracing.ENV))
    except (ValueError, RuntimeError) as e:
        log.error("%s", e)
        return 2
    try:
        return await _serve(config, stop, on_listening)
    finally:
        tracing.shutdown()  # spans still held are exported


async def _serve(config: ServerConfig, stop: asyncio.Event, on_listening) -> int:
    source = WeightSource(config)
    running = await start(config, source.shape[0])
    log.info("listening on %s (loading %s)", running.address, config.source())
    log.log(*security_posture(config, running))
    if on_listening is not None:
        on_listening(running.address)
    loader = asyncio.ensure_future(_load_in_thread(config, source))
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loader, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if loader.done() and loader.exception() is not None:
        log.error("loading failed: %s", loader.exception())
        await running.server.stop(0)
        return 1
    if loader.done():
        bank, runner = loader.result()
        await running.attach(bank, runner)
        log.info(
            "serving %d layers x %d experts on %s (backend %s, %.1f MiB resident)",
            len(bank.info.layers),
            len(bank.info.experts),
            bank.backend.device,
            bank.backend.name,
            bank.resident_bytes / 2**20,
        )
        if bank.backend.device.type == "cuda":
            log.info("%s", gpu_sharing_line())
        await stopper
    delay_s = config.drain_delay_s if loader.done() else 0.0  # nothing to admit while loading
    log.info("draining (admitting for %.1f s more, grace %.0f s)", delay_s, config.grace_s)
    await running.drain_and_stop(config.grace_s, delay_s)
    if not loader.done():
        log.info("stopped while loading")
        tracing.shutdown()
        _exit_now(0)
    log.info("stopped")
    return 0


class BackgroundServer:
    """A shard server on its own thread and event loop: for tests and embedding.

    `BackgroundServer(config)` loads from the config; `bank=` reuses a loaded bank.
    """

    def __init__(self, config: ServerConfig, bank: ExpertBank | None = None) -> None:
        self.config = config
        self._loop, self._thread = start_loop_thread("expertd-server")
        if bank is None:
            bank = ExpertBank.load(config, progress=lambda _msg: None)
        self.bank, runner = load_and_warm(config, bank=bank)
        self._running: RunningServer = self._call(self._start(bank, runner))
        self.address = self._running.address
        self.port = self._running.port

    async def _start(self, bank: ExpertBank, runner: BatchRunner) -> RunningServer:
        running = await start(self.config, bank.info.hidden_size)
        await running.attach(bank, runner)
        return running

    def _call(self, coro, timeout: float | None = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def servicer(self) -> ExpertServicer:
        return self._running.servicer

    def stop(self, grace_s: float = 0.0) -> None:
        if not self._thread.is_alive():  # stopped already (its loop may run another server now)
            return
        self._call(self._running.drain_and_stop(grace_s), timeout=grace_s + 30)
        stop_loop_thread(self._loop, self._thread)

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
