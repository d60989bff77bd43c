"""The `expertd` command: serve, make-checkpoint, describe, health, cluster, demo.

Every `serve` flag also reads an EXPERTD_* environment variable (flag wins), so
a container is configured by either.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
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
        help="generate weights in memory: small | muse-spark",
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
    run.add_argument("--max-tokens", type=int, default=_env("MAX_TOKENS", 16384, int))
    run.add_argument("--max-top-k", type=int, default=_env("MAX_TOP_K", 64, int))
    run.add_argument("--grace", type=float, default=_env("GRACE_S", 30.0, float))
    run.add_argument("--torch-threads", type=int, default=_env("TORCH_THREADS", None, int))
    run.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"))


def _resolve_device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def cmd_serve(args) -> int:
    import torch

    from expertd.server.app import serve
    from expertd.server.config import ServerConfig, parse_expert_list

    if bool(args.checkpoint) == bool(args.synthetic):
        print(
            "expertd serve: give exactly one of --checkpoint DIR or --synthetic PRESET",
            file=sys.stderr,
        )
        return 2
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
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
        device=_resolve_device(args.device),
        backend=args.backend,
        max_tokens=args.max_tokens,
        max_top_k=args.max_top_k,
        grace_s=args.grace,
        torch_threads=args.torch_threads,
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
    mk.add_argument("--preset", default="small", choices=["small", "muse-spark"])
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
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
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
