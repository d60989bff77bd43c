"""The `expertd` command: serve, make-checkpoint, describe, health, cluster, demo.

Every `serve` flag also reads an EXPERTD_* environment variable (flag wins), so
a container is configured by either.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import expertd


def _env(name: str, default=None, kind=str):
    value = os.environ.get(f"EXPERTD_{name}")
    return default if value in (None, "") else kind(value)


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve one shard of experts over gRPC")
    src = p.add_argument_group("weights (one of)")
    src.add_argument("--checkpoint", default=_env("CHECKPOINT"), help="NVFP4 safetensors dir")
    src.add_argument(
        "--synthetic",
        default=_env("SYNTHETIC"),
        metavar="PRESET",
        help="generate weights in memory: small | muse-spark | deepseek-v3 | qwen3-235b-a22b | qwen3-30b-a3b",
    )
    src.add_argument("--layers", type=int, default=_env("LAYERS", None, int))
    src.add_argument("--seed", type=int, default=_env("SEED", 0, int))
    src.add_argument("--prefix", default=_env("PREFIX", "model."), help="tensor-name prefix")
    own = p.add_argument_group("which experts")
    own.add_argument("--shard", type=int, default=_env("SHARD", 0, int))
    own.add_argument("--num-shards", type=int, default=_env("NUM_SHARDS", 1, int))
    own.add_argument("--experts", default=_env("EXPERTS"), help="explicit list, e.g. 0-27,200,201")
    run = p.add_argument_group("runtime")
    run.add_argument(
        "--listen", default=_env("LISTEN", "127.0.0.1:0"), help="host:port or unix:PATH"
    )
    run.add_argument("--device", default=_env("DEVICE", "auto"), help="cpu | cuda | cuda:N | auto")
    run.add_argument("--backend", default=_env("BACKEND"), help="reference | cuda (default: best)")
    run.add_argument("--grace", type=float, default=_env("GRACE_S", 30.0, float))
    run.add_argument(
        "--drain-delay",
        type=float,
        default=_env("DRAIN_DELAY_S", 1.0, float),
        help="after SIGTERM, seconds of NOT_SERVING health during which calls are still admitted",
    )
    run.add_argument("--torch-threads", type=int, default=_env("TORCH_THREADS", None, int))
    run.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"))
    run.add_argument("--log-format", default=_env("LOG_FORMAT", "text"), choices=["text", "json"])
    run.add_argument(
        "--metrics-port", type=int, default=_env("METRICS_PORT", None, int), help="Prometheus port"
    )
    run.add_argument(
        "--health-listen",
        default=_env("HEALTH_LISTEN"),
        help="also serve grpc.health.v1 alone, in plaintext, here (for probes when TLS is on)",
    )
    lim = p.add_argument_group("limits and batching")
    lim.add_argument("--max-tokens", type=int, default=_env("MAX_TOKENS", 16384, int))
    lim.add_argument("--max-top-k", type=int, default=_env("MAX_TOP_K", 64, int))
    lim.add_argument("--max-inflight", type=int, default=_env("MAX_INFLIGHT", 512, int))
    lim.add_argument(
        "--max-queue-requests", type=int, default=_env("MAX_QUEUE_REQUESTS", 1024, int)
    )
    lim.add_argument("--max-queue-tokens", type=int, default=_env("MAX_QUEUE_TOKENS", 65536, int))
    lim.add_argument(
        "--batch-window-us",
        type=int,
        default=_env("BATCH_WINDOW_US", 0, int),
        help="extra wait for requests to merge with (0: merge what is queued)",
    )
    lim.add_argument("--max-batch-tokens", type=int, default=_env("MAX_BATCH_TOKENS", 16384, int))
    lim.add_argument(
        "--max-batch-requests",
        type=int,
        default=_env("MAX_BATCH_REQUESTS", 256, int),
        help="requests merged into one forward (1: batching off)",
    )
    lim.add_argument(
        "--graph-max-tokens",
        type=int,
        default=_env("GRAPH_MAX_TOKENS", 1024, int),
        help="CUDA graphs for batches up to this many tokens (0: off)",
    )
    lim.add_argument(
        "--pipeline-depth",
        type=int,
        default=_env("PIPELINE_DEPTH", None, int),
        help="batches in flight on a GPU (default 2: one computing, the next copying in; 1: none)",
    )
    cap = p.add_argument_group("connections and calls (0: no cap)")
    cap.add_argument(
        "--max-concurrent-rpcs",
        type=int,
        default=_env("MAX_CONCURRENT_RPCS", 8192, int),
        help="calls in progress, every method (more: RESOURCE_EXHAUSTED)",
    )
    cap.add_argument(
        "--max-connections",
        type=int,
        default=_env("MAX_CONNECTIONS", 1024, int),
        help="open client connections (more are closed at once)",
    )
    cap.add_argument(
        "--max-streams-per-connection",
        type=int,
        default=_env("MAX_STREAMS_PER_CONNECTION", 4096, int),
        help="concurrent calls on one connection",
    )
    cap.add_argument(
        "--receive-timeout",
        type=float,
        default=_env("RECEIVE_TIMEOUT_S", 30.0, float),
        help="seconds for a call's request message to arrive (then DEADLINE_EXCEEDED)",
    )
    cap.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=_env("STREAM_IDLE_TIMEOUT_S", 300.0, float),
        help="seconds a ForwardStream may go without a request before its requests end",
    )
    cap.add_argument(
        "--connection-idle-timeout",
        type=float,
        default=_env("CONNECTION_IDLE_S", 600.0, float),
        help="close connections without calls after this many seconds",
    )
    cap.add_argument(
        "--max-connection-age",
        type=float,
        default=_env("MAX_CONNECTION_AGE_S", 0.0, float),
        help="ask clients to reconnect after this many seconds (spreads them over replicas)",
    )
    cap.add_argument(
        "--keepalive",
        type=float,
        default=_env("KEEPALIVE_S", 60.0, float),
        help="ping quiet connections this often; close them when 20 s go without an answer",
    )
    sec = p.add_argument_group("security")
    sec.add_argument(
        "--auth-token-file",
        default=_env("AUTH_TOKEN_FILE"),
        help="bearer token file (else EXPERTD_AUTH_TOKEN; neither: no auth)",
    )
    sec.add_argument("--tls-cert", default=_env("TLS_CERT"), help="server certificate (PEM)")
    sec.add_argument("--tls-key", default=_env("TLS_KEY"), help="server private key (PEM)")
    sec.add_argument(
        "--tls-client-ca",
        default=_env("TLS_CLIENT_CA"),
        help="require client certs signed by this CA",
    )
    sec.add_argument(
        "--allow-client-shm",
        action="store_true",
        default=_env("ALLOW_CLIENT_SHM", False, lambda v: v.lower() in ("1", "true", "yes")),
        help="let OIP clients register system / CUDA shared-memory regions for their tensors",
    )


def _resolve_device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def cmd_serve(args) -> int:
    import torch

    from expertd.server.app import serve
    from expertd.server.config import ServerConfig, parse_expert_list
    from expertd.server.security import load_token

    if bool(args.checkpoint) == bool(args.synthetic):
        print(
            "expertd serve: give exactly one of --checkpoint DIR or --synthetic PRESET",
            file=sys.stderr,
        )
        return 2
    device = _resolve_device(args.device)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    elif device.startswith("cuda"):
        # The host side of a GPU shard is copies and small ops: a few threads do. torch's
        # default (one per core, spinning after each parallel op) starves the other shard
        # processes of the host, and with them their kernel launches.
        torch.set_num_threads(min(4, torch.get_num_threads()))
    config = ServerConfig(
        checkpoint=args.checkpoint,
        synthetic=args.synthetic,
        layers=args.layers,
        seed=args.seed,
        prefix=args.prefix,
        shard=args.shard,
        num_shards=args.num_shards,
        experts=parse_expert_list(args.experts) if args.experts else None,
        listen=args.listen,
        device=device,
        backend=args.backend,
        max_tokens=args.max_tokens,
        max_top_k=args.max_top_k,
        max_inflight=args.max_inflight,
        max_queue_requests=args.max_queue_requests,
        max_queue_tokens=args.max_queue_tokens,
        grace_s=args.grace,
        drain_delay_s=args.drain_delay,
        torch_threads=args.torch_threads,
        batch_window_us=args.batch_window_us,
        max_batch_tokens=args.max_batch_tokens,
        graph_max_tokens=args.graph_max_tokens,
        pipeline_depth=args.pipeline_depth,
        max_batch_requests=args.max_batch_requests,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        max_connections=args.max_connections,
        max_streams_per_connection=args.max_streams_per_connection,
        receive_timeout_s=args.receive_timeout,
        stream_idle_timeout_s=args.stream_idle_timeout,
        connection_idle_s=args.connection_idle_timeout,
        max_connection_age_s=args.max_connection_age,
        keepalive_s=args.keepalive,
        auth_token=load_token(args.auth_token_file),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        allow_client_shm=args.allow_client_shm,
        metrics_port=args.metrics_port,
        health_listen=args.health_listen,
    )

    def announce(address: str) -> None:  # one machine-readable line for launchers
        print(f"LISTENING {address}", flush=True)

    return asyncio.run(serve(config, on_listening=announce))


def cmd_make_checkpoint(args) -> int:
    from expertd.server.checkpoint import write_checkpoint
    from expertd.server.synthetic import get_preset

    preset = get_preset(args.preset)

    def progress(layer: int, layers: int, nbytes: int) -> None:
        print(f"  layer {layer + 1}/{layers} written ({nbytes / 2**20:.1f} MiB)", flush=True)

    write_checkpoint(
        args.dir, preset, args.layers, args.seed, prefix=args.prefix, progress=progress
    )
    print(f"wrote {args.dir}: preset {preset.name}, {args.layers} layers, seed {args.seed}")
    return 0


def cmd_describe(args) -> int:
    import grpc

    from expertd.v1 import expertd_pb2 as pb
    from expertd.v1 import expertd_pb2_grpc as pb_grpc

    for address in args.addresses:
        with grpc.insecure_channel(address) as channel:
            reply = pb_grpc.ExpertServiceStub(channel).Describe(
                pb.DescribeRequest(), timeout=args.timeout
            )
        print(f"{address}: {reply}")
    return 0


def cmd_health(args) -> int:
    """Exit 0 when the server answers SERVING on grpc.health.v1: a container health check."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address = args.address
    if address is None:  # the address this container serves on, reached from inside it
        host, _, port = _env("LISTEN", "127.0.0.1:50051").rpartition(":")
        address = f"{'127.0.0.1' if host in ('0.0.0.0', '[::]', '') else host}:{port}"
    request = health_pb2.HealthCheckRequest(service=args.service)
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"{address}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address}: {name}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def cmd_cluster(args) -> int:
    from expertd.cluster import run_cluster

    return run_cluster(args)


def cmd_demo(args) -> int:
    from expertd.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="expertd", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"expertd {expertd.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)

    mk = sub.add_parser("make-checkpoint", help="write a synthetic NVFP4 checkpoint")
    mk.add_argument("dir")
    mk.add_argument("--preset", default="small", choices=["small", "muse-spark", "deepseek-v3", "qwen3-235b-a22b", "qwen3-30b-a3b"])  # fmt: skip
    mk.add_argument("--layers", type=int, default=2)
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--prefix", default="model.")

    ds = sub.add_parser("describe", help="ask shard servers what they serve")
    ds.add_argument("addresses", nargs="+")
    ds.add_argument("--timeout", type=float, default=5.0)

    hc = sub.add_parser("health", help="exit 0 if a server reports SERVING (grpc.health.v1)")
    hc.add_argument("address", nargs="?", help="default: EXPERTD_LISTEN, wildcard as 127.0.0.1")
    hc.add_argument("--service", default="", help="health service name ('' = the server)")
    hc.add_argument("--timeout", type=float, default=3.0)

    from expertd.cluster import add_cluster_arguments

    add_cluster_arguments(sub.add_parser("cluster", help="start and supervise N local shards"))

    from expertd.demo import add_demo_arguments

    add_demo_arguments(sub.add_parser("demo", help="run a local 8-shard service and check it"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from expertd.logs import setup_logging

    setup_logging(getattr(args, "log_level", "INFO"), getattr(args, "log_format", "text"))
    handler = {
        "serve": cmd_serve,
        "make-checkpoint": cmd_make_checkpoint,
        "describe": cmd_describe,
        "demo": cmd_demo,
        "health": cmd_health,
        "cluster": cmd_cluster,
    }[args.command]
    try:
        return handler(args)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"expertd {args.command}: {e}", file=sys.stderr)
        return 1
