"""The `expertd` command: serve, make-checkpoint, describe, health, cluster, demo, build-kernels.

Every `serve` flag also reads an EXPERTD_* environment variable (the flag wins), so a container
is configured by either; each option's help names its variable and default. Variables are read
when the command line is parsed, not when the parser is built. A bad value, from a flag or a
variable, is one line on stderr and exit status 2.

Building the parser imports nothing heavy (no torch, no grpc): each command imports what it
needs when it runs, so `--help` and `expertd health` answer at once.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import expertd

ENV_PREFIX = "EXPERTD_"
DEFAULT_PORT = 50051
DEFAULT_LISTEN = f"127.0.0.1:{DEFAULT_PORT}"  # serve's default, and where health looks
# The synthetic presets of server/synthetic.py, named here so that help imports no torch
# (tests/unit/test_cli_parse.py checks the two lists agree).
PRESETS = (
    "small",
    "muse-spark",
    "deepseek-v3",
    "qwen3-235b-a22b",
    "qwen3-30b-a3b",
    "llama4-scout",
    "llama4-maverick",
)
_UNSET = object()  # "not on the command line": the environment or the default decides
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


# ---- value types: each raises ArgumentTypeError with a message naming what is wanted -------


def _number(kind, lo=None, hi=None, what=None):
    what = what or {int: "an integer", float: "a number"}[kind]
    bounds = (
        f" in [{lo}, {hi}]"
        if lo is not None and hi is not None
        else f" >= {lo}"
        if lo is not None
        else ""
    )

    def convert(text: str):
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {what}{bounds}, got {text!r}") from None
        if value != value or (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"expected {what}{bounds}, got {text!r}")
        return value

    convert.__name__ = what  # argparse names the type in some messages
    return convert


def _int(lo=None, hi=None):
    return _number(int, lo, hi)


def _float(lo=None, hi=None):
    return _number(float, lo, hi)


_PORT = _number(int, 0, 65535, "a port")


def _port_or_off(text: str):
    """A port (0: any free one), or off -> None."""
    return None if text.strip().lower() == "off" else _PORT(text)


_port_or_off.__name__ = "port"


def _address(text: str) -> str:
    """host:port ([v6]:port too) or unix:PATH."""
    if text.startswith(("unix:", "unix-abstract:")):
        if text.partition(":")[2]:
            return text
    else:
        host, sep, port = text.rpartition(":")
        if sep and host and port.isdigit() and int(port) <= 65535:
            return text
    raise argparse.ArgumentTypeError(f"expected HOST:PORT or unix:PATH, got {text!r}")


_address.__name__ = "address"


def _metrics_listen(text: str) -> str:
    """HOST:PORT ([v6]:PORT; an empty host: every interface), or off (kept as text: serve
    parses it)."""
    if text.strip().lower() == "off":
        return text
    host, sep, port = text.rpartition(":")
    if sep and not host.startswith("unix") and port.isdigit() and int(port) <= 65535:
        return text
    raise argparse.ArgumentTypeError(f"expected HOST:PORT or off, got {text!r}")


_metrics_listen.__name__ = "metrics address"

# expertd/tracing.py's SDK exporters, with the module each needs.
_TRACE_NEEDS = {
    "console": "opentelemetry.sdk",
    "jsonl": "opentelemetry.sdk",
    "otlp": "opentelemetry.exporter.otlp.proto.grpc",
}


def _trace(text: str) -> str:
    """off | on | console | otlp | jsonl:PATH (kept as text), with OpenTelemetry installed
    for any but off; found without importing it."""
    import importlib.util

    from expertd.tracing import OFF_VALUES, ON_VALUES

    spec = text.strip()
    kind, _, path = spec.partition(":")
    kind = kind.lower()
    if spec.lower() in OFF_VALUES:
        return text
    if spec.lower() in ON_VALUES:
        needs = "opentelemetry.trace"
    elif kind in _TRACE_NEEDS and (kind == "jsonl") == bool(path) and (path or ":" not in spec):
        needs = _TRACE_NEEDS[kind]
    else:
        raise argparse.ArgumentTypeError(
            f"expected off, on, console, otlp or jsonl:PATH, got {text!r}"
        )
    try:
        found = importlib.util.find_spec(needs) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    if not found:
        extra = "opentelemetry-exporter-otlp" if kind == "otlp" else "'expertd[otel]'"
        raise argparse.ArgumentTypeError(f"{text!r} needs {needs}: pip install {extra}")
    return text


_trace.__name__ = "trace"


def _log_level(text: str) -> str:
    if text.upper() in _LOG_LEVELS:
        return text.upper()
    raise argparse.ArgumentTypeError(
        f"expected one of {', '.join(_LOG_LEVELS)} (any case), got {text!r}"
    )


_log_level.__name__ = "log level"


def _device(text: str) -> str:
    if re.fullmatch(r"cpu|cuda|cuda:\d+|auto", text):
        return text
    raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N or auto, got {text!r}")


_device.__name__ = "device"


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected 1/true/yes or 0/false/no, got {text!r}")


def _int_list(text: str) -> str:
    """Comma-separated positive integers (kept as text: the command splits it)."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}"
        )
    return text


def _experts(text: str) -> str:
    """An expert list such as 0-27,200,201 (kept as text: serve parses it)."""
    from expertd.server.config import parse_expert_list  # light: no torch

    try:
        parse_expert_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


_experts.__name__ = "expert list"


# ---- the parser --------------------------------------------------------------------------

# Variables that are no option's but change what a command does (kernels/build.py, demo.py),
# listed after its options in --help.
KERNEL_VARIABLES = (
    (
        "EXPERTD_KERNEL_LIB",
        "a prebuilt libexpertd_kernels.so to load instead of building the CUDA kernels "
        "[default: none: build them into the kernel cache]",
    ),
    ("EXPERTD_KERNEL_CACHE", "the kernels' build cache [default: ~/.cache/expertd/kernels]"),
    ("EXPERTD_KERNEL_VERBOSE", "1: print the ninja / nvcc / ptxas log [default: 0]"),
    ("EXPERTD_NVCC", "the nvcc that builds the kernels [default: $CUDA_HOME/bin/nvcc, then PATH]"),
)
DEMO_VARIABLES = (
    (
        "EXPERTD_CACHE_DIR",
        "where the demo keeps its synthetic checkpoint, under checkpoints/ "
        "[default: ~/.cache/expertd]",
    ),
)


def _environment(*variables: tuple[str, str]) -> str:
    """An epilog naming variables a command reads beside its options' own."""
    width = max(len(name) for name, _ in variables) + 2
    lines = [f"  {name:<{width}}{meaning}" for name, meaning in variables]
    return "\n".join(["environment (besides the options' own variables):", *lines])


class _Formatter(argparse.HelpFormatter):
    """argparse's help, except that descriptions and epilogs keep their lines: each line is
    wrapped on its own, an indented `NAME  meaning` line's continuation under its meaning."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        out = []
        for line in text.splitlines():
            if not line.strip():
                out.append("")
                continue
            entry = re.match(r"\s+\S+\s{2,}", line)
            more = indent + " " * (entry.end() if entry else 0)
            lead = indent + line[: len(line) - len(line.lstrip())]
            out.append(
                textwrap.fill(line.strip(), width, initial_indent=lead, subsequent_indent=more)
            )
        return "\n".join(out)


def given(args, dest: str) -> str:
    """How the user gave an option's value, for a message: `--device cuda` from the command
    line, `EXPERTD_DEVICE='cuda'` from the environment."""
    env = getattr(args, "_from_env", {}).get(dest)
    value = getattr(args, dest)
    if env:
        return f"{env}={os.environ.get(env, value)!r}"
    return f"--{dest.replace('_', '-')} {value}"


class Parser(argparse.ArgumentParser):
    """argparse with EXPERTD_* fallbacks applied at parse time, and one-line errors."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)
        self._fallbacks: list[tuple] = []  # (dest, env name, type, default, choices)

    def option(
        self, *flags: str, env=None, default=None, type=None, help="", group=None, **kw
    ) -> None:
        """Add an option whose value comes from its flag, else EXPERTD_<env>, else `default`;
        its help gets both. One line per option: a new flag is one call."""
        name = f"{ENV_PREFIX}{env}" if env else None
        shown = kw.pop("shown", None)
        if shown is None:
            shown = "off" if default is None else str(default) if default != "" else "''"
        extra = f"default: {shown}" + (f"; env {name}" if name else "")
        if kw.get("action") == "store_true":
            type = _bool
        else:
            kw["type"] = type
        target = group or self
        action = target.add_argument(*flags, default=_UNSET, help=f"{help} [{extra}]", **kw)
        self._fallbacks.append((action.dest, name, type, default, action.choices))

    def parse_known_args(self, args=None, namespace=None):
        namespace, rest = super().parse_known_args(args, namespace)
        self._apply_fallbacks(namespace)
        # The chosen command's parser too: whether argparse calls its parse_known_args
        # differs between Python versions (values already set are left alone).
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(namespace, action.dest, None) or "")
                if isinstance(chosen, Parser):
                    chosen._apply_fallbacks(namespace)
        return namespace, rest

    def _apply_fallbacks(self, namespace) -> None:
        for dest, env, convert, default, choices in self._fallbacks:
            if getattr(namespace, dest, _UNSET) is not _UNSET:
                continue
            raw = os.environ.get(env, "") if env else ""
            value = default
            if raw != "":
                try:
                    value = convert(raw) if convert else raw
                    if choices is not None and value not in choices:
                        raise ValueError(f"expected one of {', '.join(map(str, choices))}")
                except (argparse.ArgumentTypeError, ValueError) as e:
                    self.error(f"{env}={raw!r}: {e}")
                if not hasattr(namespace, "_from_env"):
                    namespace._from_env = {}
                namespace._from_env[dest] = env  # where the value came from, for messages
            setattr(namespace, dest, value)

    def parse_args(self, args=None, namespace=None):
        namespace, rest = self.parse_known_args(args, namespace)
        if rest:  # name the command whose options these are not
            command = getattr(namespace, "command", None)
            prog = f"{self.prog} {command}" if command else self.prog
            message = f"unrecognized arguments: {' '.join(rest)} (see {prog} --help)"
            self.exit(2, f"{prog}: error: {message}\n")
        return namespace

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve one shard of experts over gRPC",
        description="Serve one shard of every layer's experts over gRPC (one process per GPU).",
        epilog=_environment(*KERNEL_VARIABLES),
    )
    o = p.option
    src = p.add_argument_group("weights (one of)")
    o("--checkpoint", env="CHECKPOINT", help="NVFP4 safetensors dir", group=src)
    o(
        "--synthetic",
        env="SYNTHETIC",
        metavar="PRESET",
        choices=PRESETS,
        help="generate weights in memory: " + " | ".join(PRESETS),
        group=src,
    )
    o("--layers", env="LAYERS", type=_int(1), help="layers to serve", shown="all", group=src)
    o("--seed", env="SEED", type=_int(0), default=0, help="synthetic weights' seed", group=src)
    o("--prefix", env="PREFIX", default="model.", help="tensor-name prefix", group=src)
    own = p.add_argument_group("which experts")
    o("--shard", env="SHARD", type=_int(0), default=0, help="this shard's index", group=own)
    o("--num-shards", env="NUM_SHARDS", type=_int(1), default=1, help="shards", group=own)
    o(
        "--experts",
        env="EXPERTS",
        type=_experts,
        help="explicit list, e.g. 0-27,200,201",
        shown="an even split by --shard",
        group=own,
    )
    run = p.add_argument_group("runtime")
    o(
        "--listen",
        env="LISTEN",
        type=_address,
        default=DEFAULT_LISTEN,
        help="host:port or unix:PATH (port 0: any free port)",
        group=run,
    )
    o(
        "--device",
        env="DEVICE",
        type=_device,
        default="auto",
        help="cpu|cuda|cuda:N|auto",
        group=run,
    )
    o(
        "--backend",
        env="BACKEND",
        choices=("reference", "cuda"),
        help="reference | cuda",
        shown="cuda on an sm_90 GPU that has the kernels, else reference (logged)",
        group=run,
    )
    o("--grace", env="GRACE_S", type=_float(0), default=30.0, help="drain seconds", group=run)
    o(
        "--drain-delay",
        env="DRAIN_DELAY_S",
        type=_float(0),
        default=1.0,
        help="after SIGTERM, seconds of NOT_SERVING health during which calls are still admitted",
        group=run,
    )
    o(
        "--torch-threads",
        env="TORCH_THREADS",
        type=_int(1),
        help="host threads",
        shown="4 on a GPU, torch's own on CPU",
        group=run,
    )
    o(
        "--log-level",
        env="LOG_LEVEL",
        type=_log_level,
        default="INFO",
        help="DEBUG|INFO|WARNING|ERROR",
        group=run,
    )
    o(
        "--log-format",
        env="LOG_FORMAT",
        choices=("text", "json"),
        default="text",
        help="text | json",
        group=run,
    )
    o(
        "--metrics-port",
        env="METRICS_PORT",
        type=_PORT,
        help="Prometheus /metrics on this port of the serving host (0: any free port)",
        group=run,
    )
    o(
        "--metrics-listen",
        env="METRICS_LISTEN",
        type=_metrics_listen,
        metavar="HOST:PORT|off",
        help="serve /metrics here instead (off: no endpoint, whatever the port says)",
        group=run,
    )
    o(
        "--metrics-created",
        env="METRICS_CREATED",
        action="store_true",
        default=False,
        help="also serve the *_created series of counters and histograms",
        group=run,
    )
    o(
        "--trace",
        env="TRACE",
        type=_trace,
        metavar="off|on|console|otlp|jsonl:PATH",
        help="OpenTelemetry spans (needs expertd[otel])",
        group=run,
    )
    o(
        "--tcp-data-port",
        env="TCP_DATA_PORT",
        type=_port_or_off,
        default=0,
        metavar="PORT|off",
        help="raw TCP data plane (tensors outside gRPC) on this port of the serving host "
        "(0: any free port; off: none; never offered with TLS on)",
        group=run,
    )
    o(
        "--nixl-wake-port",
        env="NIXL_WAKE_PORT",
        type=_port_or_off,
        default=0,
        metavar="PORT|off",
        help="UDP port of the serving host where NIXL clients wake this shard's progress "
        "thread after a quiet time (0: any free port; off: none, calls wait out its naps)",
        group=run,
    )
    o(
        "--pin-slots",
        env="PIN_SLOTS",
        choices=("on", "off"),
        default="on",
        help="a GPU shard page-locks the shared-memory slot rows its calls use and copies "
        "them to and from the GPU by DMA (off: through a staging buffer; pinned rows stay "
        "resident while the client's lease lasts)",
        group=run,
    )
    o(
        "--lane",
        env="LANE",
        choices=("on", "off"),
        default="on",
        help="a GPU shard runs a cuda-ipc slot's call of up to 1024 tokens to its answer on "
        "the slot's own thread when nothing else is queued or running (off: every call "
        "through the batcher)",
        group=run,
    )
    o(
        "--health-listen",
        env="HEALTH_LISTEN",
        type=_address,
        help="also serve grpc.health.v1 alone, in plaintext, here (for probes when TLS is on)",
        group=run,
    )
    lim = p.add_argument_group("limits and batching")
    for flag, env, lo, default, text in (
        ("--max-tokens", "MAX_TOKENS", 1, 16384, "tokens in one request"),
        ("--max-top-k", "MAX_TOP_K", 1, 64, "top_k of one request"),
        ("--max-inflight", "MAX_INFLIGHT", 1, 512, "requests admitted at once"),
        ("--max-queue-requests", "MAX_QUEUE_REQUESTS", 1, 1024, "requests waiting"),
        ("--max-queue-tokens", "MAX_QUEUE_TOKENS", 1, 65536, "tokens waiting"),
        (
            "--batch-window-us",
            "BATCH_WINDOW_US",
            0,
            0,
            "extra wait for requests to merge with (0: merge what is queued)",
        ),
        ("--max-batch-tokens", "MAX_BATCH_TOKENS", 1, 16384, "tokens merged into one forward"),
        (
            "--max-batch-requests",
            "MAX_BATCH_REQUESTS",
            1,
            256,
            "requests merged into one forward (1: batching off)",
        ),
        (
            "--graph-max-tokens",
            "GRAPH_MAX_TOKENS",
            0,
            1024,
            "CUDA graphs for batches up to this many tokens (0: off)",
        ),
    ):
        o(flag, env=env, type=_int(lo), default=default, help=text, group=lim)
    o(
        "--pipeline-depth",
        env="PIPELINE_DEPTH",
        type=_int(1),
        help="batches in flight on a GPU (2: one computing, the next copying in; 1: none)",
        shown="2",
        group=lim,
    )
    cap = p.add_argument_group("connections and calls (0: no cap)")
    for flag, env, kind, default, text in (
        (
            "--max-concurrent-rpcs",
            "MAX_CONCURRENT_RPCS",
            _int(0),
            8192,
            "calls in progress, every method (more: RESOURCE_EXHAUSTED)",
        ),
        (
            "--max-connections",
            "MAX_CONNECTIONS",
            _int(0),
            1024,
            "open client connections (more are closed at once)",
        ),
        (
            "--max-streams-per-connection",
            "MAX_STREAMS_PER_CONNECTION",
            _int(0),
            4096,
            "concurrent calls on one connection",
        ),
        (
            "--receive-timeout",
            "RECEIVE_TIMEOUT_S",
            _float(0),
            30.0,
            "seconds for a call's request message to arrive (then DEADLINE_EXCEEDED)",
        ),
        (
            "--stream-idle-timeout",
            "STREAM_IDLE_TIMEOUT_S",
            _float(0),
            300.0,
            "seconds a ForwardStream may go without a request before its requests end",
        ),
        (
            "--connection-idle-timeout",
            "CONNECTION_IDLE_S",
            _float(0),
            600.0,
            "close connections without calls after this many seconds",
        ),
        (
            "--max-connection-age",
            "MAX_CONNECTION_AGE_S",
            _float(0),
            0.0,
            "ask clients to reconnect after this many seconds (spreads them over replicas)",
        ),
        (
            "--keepalive",
            "KEEPALIVE_S",
            _float(0),
            60.0,
            "ping quiet connections this often; close them when 20 s go without an answer",
        ),
    ):
        o(flag, env=env, type=kind, default=default, help=text, group=cap)
    sec = p.add_argument_group("security")
    o(
        "--auth-token-file",
        env="AUTH_TOKEN_FILE",
        help="bearer token file (else EXPERTD_AUTH_TOKEN; neither: no auth)",
        group=sec,
    )
    o("--tls-cert", env="TLS_CERT", help="server certificate (PEM)", group=sec)
    o("--tls-key", env="TLS_KEY", help="server private key (PEM)", group=sec)
    o("--tls-client-ca", env="TLS_CLIENT_CA", help="require client certs from this CA", group=sec)
    o(
        "--allow-client-shm",
        env="ALLOW_CLIENT_SHM",
        action="store_true",
        default=False,
        help="let OIP clients register system / CUDA shared-memory regions for their tensors",
        group=sec,
    )


def _resolve_device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _device_problem(device: str) -> str | None:
    """Why this machine cannot run on `device` (None: it can)."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        build = "built without CUDA" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        return (
            f"torch sees no CUDA device on this machine (torch {torch.__version__}, {build}); "
            "use --device cpu or auto"
        )
    count = torch.cuda.device_count()
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        return f"this machine has {count} CUDA device(s): cuda:0 to cuda:{count - 1}"
    return None


def cmd_serve(args) -> int:
    if bool(args.checkpoint) == bool(args.synthetic):
        print(
            "expertd serve: error: give exactly one of --checkpoint DIR or --synthetic PRESET",
            file=sys.stderr,
        )
        return 2
    if args.experts is None and args.shard >= args.num_shards:
        print(
            f"expertd serve: error: --shard {args.shard} is not below --num-shards "
            f"{args.num_shards}",
            file=sys.stderr,
        )
        return 2

    import asyncio

    import torch

    from expertd.server.app import serve
    from expertd.server.config import ServerConfig, parse_expert_list
    from expertd.server.security import load_token

    device = _resolve_device(args.device)
    unusable = _device_problem(device)
    if unusable:  # before binding: a server that cannot load must not look like one
        print(f"expertd serve: error: {given(args, 'device')}: {unusable}", file=sys.stderr)
        return 2
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
        metrics_listen=args.metrics_listen,
        metrics_created=args.metrics_created,
        trace=args.trace,
        health_listen=args.health_listen,
        tcp_data_port=args.tcp_data_port,
        nixl_wake_port=args.nixl_wake_port,
        pin_slots=args.pin_slots == "on",
        lane=args.lane == "on",
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


# ---- client-side commands: describe, health ----------------------------------------------


def _client_options(p: Parser, what: str) -> None:
    """TLS and auth for a command that calls a server (plaintext and no token by default)."""
    g = p.add_argument_group("connecting (when the server has TLS or auth on)")
    o = p.option
    o(
        "--tls-ca",
        metavar="PEM",
        help=f"connect with TLS, trusting this CA {what}",
        shown="none: plaintext",
        group=g,
    )
    o(
        "--tls-cert",
        metavar="PEM",
        help="client certificate (mutual TLS; with --tls-key and --tls-ca)",
        shown="none: no client certificate",
        group=g,
    )
    o(
        "--tls-key",
        metavar="PEM",
        help="client private key (mutual TLS; with --tls-cert)",
        shown="none",
        group=g,
    )
    o(
        "--tls-server-name",
        metavar="NAME",
        help="the name the server certificate must carry",
        shown="the address's host",
        group=g,
    )


def _quiet_grpc() -> None:
    """gRPC core's own log lines (a failed TLS handshake, at INFO) would add lines to a
    command's one-line answer; keep them to errors unless the user asked for more."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def _channel(args, address: str):
    import grpc

    if not args.tls_ca:
        return grpc.insecure_channel(address)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("give both --tls-cert and --tls-key, or neither")

    def read(path):
        with open(path, "rb") as f:
            return f.read()

    creds = grpc.ssl_channel_credentials(
        read(args.tls_ca),
        read(args.tls_key) if args.tls_key else None,
        read(args.tls_cert) if args.tls_cert else None,
    )
    options = [("grpc.ssl_target_name_override", args.tls_server_name)]
    return grpc.secure_channel(address, creds, options if args.tls_server_name else None)


def _rpc_failure(address: str, error) -> str:
    line = f"{address}: {error.code().name}: {error.details()}"
    if os.environ.get(f"{ENV_PREFIX}TLS_CERT") and error.code().name == "UNAVAILABLE":
        line += (
            " (the server has TLS on: probe its plaintext --health-listen / "
            "EXPERTD_HEALTH_LISTEN port, or pass --tls-ca)"
        )
    return line


def ranges(ids) -> str:
    """Sorted integers as ranges: [0, 1, 2, 3, 7, 9, 10] -> '0-3,7,9-10'."""
    out: list[str] = []
    ids = sorted(ids)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out) or "none"


def describe_summary(address: str, reply) -> list[str]:
    """Lines that say what one server serves (experts and layers as ranges)."""
    dataplanes = ", ".join(reply.dataplanes) or "none"
    return [
        f"{address}: expertd {reply.version}, backend {reply.backend} on {reply.device}, "
        f"model {reply.model}",
        f"  shard {reply.shard_index}/{reply.num_shards}: experts {ranges(reply.experts)} "
        f"({len(reply.experts)} of {reply.num_experts}), layers {ranges(reply.layers)}",
        f"  H {reply.hidden_size}, I {reply.intermediate_size}, top_k {reply.top_k or 'any'}, "
        f"weights {reply.weight_dtype}, up to {reply.max_tokens_per_request} tokens a request, "
        f"dataplanes: {dataplanes}",
    ]


def coverage(replies) -> str:
    """Which layer's experts the servers together leave uncovered, in one line."""
    num_experts = max(r.num_experts for r in replies)
    layers = sorted({layer for r in replies for layer in r.layers})
    missing = {}
    for layer in layers:
        have = {e for r in replies if layer in r.layers for e in r.experts}
        gap = sorted(set(range(num_experts)) - have)
        if gap:
            missing[layer] = gap
    if not missing:
        return f"together: all {num_experts} experts of layers {ranges(layers)}"
    return "together: missing " + "; ".join(
        f"layer {layer}: experts {ranges(gap)}" for layer, gap in missing.items()
    )


def cmd_describe(args) -> int:
    _quiet_grpc()
    import grpc

    from expertd.v1 import expertd_pb2 as pb
    from expertd.v1 import expertd_pb2_grpc as pb_grpc

    metadata = ()
    token = os.environ.get(f"{ENV_PREFIX}AUTH_TOKEN")
    if args.auth_token_file:
        with open(args.auth_token_file) as f:
            token = f.read()
    if token and token.strip():
        metadata = (("authorization", f"Bearer {token.strip()}"),)
    replies, failed = [], 0
    for address in args.addresses:
        try:
            with _channel(args, address) as channel:
                reply = pb_grpc.ExpertServiceStub(channel).Describe(
                    pb.DescribeRequest(), timeout=args.timeout, metadata=metadata
                )
        except grpc.RpcError as e:
            print(_rpc_failure(address, e), file=sys.stderr)
            failed += 1
            continue
        replies.append(reply)
        if args.full:
            print(f"{address}: {reply}")
        else:
            print("\n".join(describe_summary(address, reply)))
    if len(replies) > 1 and not args.full:
        print(coverage(replies))
    return 1 if failed else 0


def health_address(explicit: str | None) -> str:
    """Where `expertd health` looks without an address: EXPERTD_HEALTH_LISTEN (the plaintext
    health port, there when TLS is on), else EXPERTD_LISTEN, else serve's default; a wildcard
    host is reached on loopback."""
    if explicit:
        return explicit
    address = (
        os.environ.get(f"{ENV_PREFIX}HEALTH_LISTEN")
        or os.environ.get(f"{ENV_PREFIX}LISTEN")
        or DEFAULT_LISTEN
    )
    if address.startswith("unix"):
        return address
    host, _, port = address.rpartition(":")
    return f"{'127.0.0.1' if host in ('0.0.0.0', '[::]', '::', '') else host}:{port}"


def cmd_health(args) -> int:
    """Exit 0 when the server answers SERVING on grpc.health.v1: a container health check."""
    _quiet_grpc()
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address = health_address(args.address)
    if address.endswith(":0"):
        print(f"expertd health: error: {address}: port 0 is not an address", file=sys.stderr)
        return 2
    request = health_pb2.HealthCheckRequest(service=args.service)
    with _channel(args, address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=args.timeout)
        except grpc.RpcError as e:
            print(_rpc_failure(address, e), file=sys.stderr)
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address}: {name}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


# ---- local services: cluster, demo; kernels ----------------------------------------------


def _cluster_parser(sub) -> None:
    p = sub.add_parser(
        "cluster",
        help="start and supervise N local shards",
        description="Start N local `expertd serve` shards, restart any that dies, stop them "
        "together (SIGTERM or Ctrl-C drains).",
        epilog=_environment(*KERNEL_VARIABLES),
    )
    o = p.option
    src = p.add_argument_group("weights (one of)")
    o("--checkpoint", help="NVFP4 safetensors dir", group=src)
    o(
        "--synthetic",
        metavar="PRESET",
        choices=PRESETS,
        help=" | ".join(PRESETS),
        group=src,
    )
    o("--layers", type=_int(1), help="layers to serve", shown="all", group=src)
    o("--seed", type=_int(0), default=0, help="synthetic weights' seed", group=src)
    o("--shards", type=_int(1), default=8, help="number of shard servers")
    o("--gpus", help="e.g. 0,1,2,3: shard s uses GPU gpus[s %% len]", shown="none")
    o("--device", type=_device, default="auto", help="without --gpus: cpu | cuda | auto")
    o("--host", default="127.0.0.1", help="address the shards listen on")
    o("--base-port", type=_PORT, default=0, help="shard s listens on base+s (0: free ports)")
    o("--grace", type=_float(0), default=30.0, help="each shard's drain on stop, s")
    o("--startup-timeout", type=_float(0), default=900.0, help="until all SERVING, s")
    o("--torch-threads", type=_int(1), help="per shard", shown="cores / shards")
    o("--log-level", type=_log_level, default="INFO", help="the shards' and the cluster's")


def _demo_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="run a local 8-shard service and check it",
        description="Start a local N-shard service, call it with the real client at a few "
        "batch sizes, check every result against the reference, stop it.",
        epilog=_environment(*KERNEL_VARIABLES, *DEMO_VARIABLES),
    )
    o = p.option
    o("--shards", type=_int(1), default=8, help="shard servers")
    o(
        "--preset",
        choices=("small", "muse-spark", "auto"),
        default="auto",
        help="small | muse-spark | auto (GPU: muse-spark)",
    )
    o("--layers", type=_int(1), help="layers", shown="2 (small), 1 (muse-spark)")
    o("--seed", type=_int(0), default=0, help="synthetic weights' seed")
    o("--device", type=_device, default="auto", help="cpu | cuda | auto")
    o("--batch-sizes", type=_int_list, default="1,7,64,512", help="comma-separated token counts")
    o("--repeats", type=_int(1), default=5, help="calls per size (the median is shown)")
    o("--log-level", type=_log_level, default="WARNING", help="the demo's own log level")


def _refuse_device(command: str, args) -> bool:
    """One line and True when this machine cannot run the command's --device (before
    any child starts: each would fail with the same line)."""
    if getattr(args, "gpus", None):
        return False
    unusable = _device_problem(_resolve_device(args.device))
    if unusable:
        print(f"expertd {command}: error: {given(args, 'device')}: {unusable}", file=sys.stderr)
    return bool(unusable)


def cmd_cluster(args) -> int:
    if _refuse_device("cluster", args):
        return 2
    from expertd.cluster import run_cluster

    return run_cluster(args)


def cmd_demo(args) -> int:
    if _refuse_device("demo", args):
        return 2
    from expertd.demo import run_demo

    return run_demo(args)


def cmd_build_kernels(args) -> int:
    if args.cache:
        os.environ["EXPERTD_KERNEL_CACHE"] = args.cache
    from expertd.kernels.build import main as build_main

    return build_main()


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="expertd",
        description=__doc__.split("\n\n")[0]
        + "\n\n`expertd COMMAND --help` lists a command's options, their defaults and variables.",
    )
    parser.add_argument("--version", action="version", version=f"expertd {expertd.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _serve_parser(sub)

    mk = sub.add_parser("make-checkpoint", help="write a synthetic NVFP4 checkpoint")
    mk.add_argument("dir", help="directory to write (created) [required; no default]")
    mk.option("--preset", default="small", choices=PRESETS, help="model shape")
    mk.option("--layers", type=_int(1), default=2, help="layers")
    mk.option("--seed", type=_int(0), default=0, help="weights' seed")
    mk.option("--prefix", default="model.", help="tensor-name prefix")

    ds = sub.add_parser(
        "describe",
        help="ask shard servers what they serve",
        description="Ask shard servers what they serve (Describe): one summary each, experts "
        "and layers as ranges, then whether together they cover every expert.",
    )
    ds.add_argument(
        "addresses",
        nargs="+",
        type=_address,
        metavar="ADDRESS",
        help="a shard server's HOST:PORT or unix:PATH, one or more [required; no default]",
    )
    ds.option("--timeout", type=_float(0), default=5.0, help="seconds per server")
    ds.option("--full", action="store_true", default=False, help="print the whole reply")
    ds.option(
        "--auth-token-file",
        env="AUTH_TOKEN_FILE",
        help="bearer token file (else EXPERTD_AUTH_TOKEN)",
        shown="none: EXPERTD_AUTH_TOKEN, else no token",
    )
    _client_options(ds, "(the server's certificate's)")

    hc = sub.add_parser(
        "health",
        help="exit 0 if a server reports SERVING (grpc.health.v1)",
        description="Exit 0 when the server answers SERVING on grpc.health.v1, 1 otherwise: "
        "the container's health check. Without an address it probes "
        "EXPERTD_HEALTH_LISTEN (the plaintext health port, for servers with TLS on), else "
        f"EXPERTD_LISTEN, else {DEFAULT_LISTEN} (serve's default); a wildcard host "
        "(0.0.0.0, [::]) is reached on 127.0.0.1.",
    )
    hc.add_argument(
        "address",
        nargs="?",
        type=_address,
        help="the server's HOST:PORT [default: EXPERTD_HEALTH_LISTEN, else EXPERTD_LISTEN, "
        f"else {DEFAULT_LISTEN}]",
    )
    hc.option("--service", default="", help="health service name ('' = the server)")
    hc.option("--timeout", type=_float(0), default=3.0, help="seconds")
    _client_options(hc, "(only for the main port with TLS on)")

    _cluster_parser(sub)
    _demo_parser(sub)

    bk = sub.add_parser(
        "build-kernels",
        help="compile the CUDA kernel library now (nvcc) and print its path",
        description="Compile the CUDA kernels (sm_90a, for H100/H200) into the kernel cache, "
        "once, and print the library's path; shard servers then load it instead of compiling. "
        "Needs nvcc (EXPERTD_NVCC, $CUDA_HOME/bin, PATH), not a GPU. Processes that build at "
        "once wait for the first. Progress goes to stderr.",
        epilog=_environment(*KERNEL_VARIABLES),
    )
    bk.option(
        "--cache",
        env="KERNEL_CACHE",
        help="the kernel cache directory",
        shown="~/.cache/expertd/kernels",
    )
    return parser


# What `expertd[server]` adds to the client-only install (pyproject.toml).
SERVER_PACKAGES = {"torch", "grpc_health", "grpc_reflection", "safetensors", "prometheus_client"}


def env_variables() -> set[str]:
    """Every EXPERTD_* variable an option of some command falls back to."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {env for p in sub.choices.values() for _, env, *_ in p._fallbacks if env}


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in SERVER_PACKAGES:
            raise
        print(
            f"expertd: {e}; the command line needs pip install 'expertd[server]'", file=sys.stderr
        )
        return 1


def _main(argv: list[str] | None) -> int:
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
        "build-kernels": cmd_build_kernels,
    }[args.command]
    try:
        return handler(args)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"expertd {args.command}: {e}", file=sys.stderr)
        return 1
