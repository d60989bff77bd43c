"""What a small request costs this host before any expert math: the gRPC framework's
round trip and the server's per-request Python, measured apart.

    python benchmarks/rpc_floor.py --out $OUT [--m 1] [--reps 2000]

1. Python steps of one request of M tokens (preset muse-spark's hidden size, top-8,
   shard 0 of 8), timed in a loop: the request's parse (expertd/codec.py), its
   validation (server/validate.py), the pack into a slot's host buffer
   (server/staging.py) and the response's encode; plus a pure-Python loop, to
   compare hosts.
2. Round trips of a sync client against grpc.aio servers on loopback TCP that
   answer a request of the same size with a response of the same size as ours:
     echo         the handler answers at once
     hop          the handler awaits one thread-pool round trip (loop -> thread -> loop)
     intercepted  echo behind the server's MalformedRequestInterceptor (server/malformed.py)
Writes JSON; prints a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch

from expertd import codec, wire
from expertd.server.bank import ModelInfo
from expertd.server.graphs import Layout
from expertd.server.malformed import MalformedRequestInterceptor
from expertd.server.staging import HostStaging
from expertd.server.validate import Limits, parse_forward
from expertd.v1 import expertd_pb2 as pb

OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def per_call_us(fn, reps: int) -> float:
    for _ in range(min(reps, 200)):
        fn()
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best.append((time.perf_counter() - t0) / reps * 1e6)
    return min(best)


def python_steps(m: int, reps: int) -> dict:
    h, e, k = 4096, 256, 8
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((m, h), generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, 32, (m, k), generator=gen, dtype=torch.int32)
    w = torch.rand((m, k), generator=gen)
    data = pb.ForwardRequest(
        layer=0,
        hidden_states=wire.encode(x),
        topk_ids=wire.encode(ids),
        topk_weights=wire.encode(w),
    ).SerializeToString()
    info = ModelInfo(h, h, e, k, (0,), tuple(range(32)), "synthetic")
    limits = Limits(16384, 64)
    req = codec.parse_forward_request(data)
    args = parse_forward(req, info, limits, lambda layer: layer == 0)
    layout = Layout(max(m, 1), k, h)
    staging = HostStaging(pin=False, in_bytes=layout.in_bytes, out_bytes=layout.out_bytes)
    out = bytes(2 * m * h)
    timing = pb.Timing(queue_us=1, compute_us=2, total_us=3, stage_us=4, device_us=5)

    def loop() -> None:
        s = 0
        for i in range(1000):
            s += i

    return {
        "request_bytes": len(data),
        "parse_us": per_call_us(lambda: codec.parse_forward_request(data), reps),
        "validate_us": per_call_us(
            lambda: parse_forward(req, info, limits, lambda layer: layer == 0), reps
        ),
        "pack_us": per_call_us(
            lambda: staging.pack(layout, [args.x], [args.ids], [args.weights]), reps
        ),
        "encode_us": per_call_us(
            lambda: codec.encode_forward_response(0, pb.BF16, (m, h), out, timing), reps
        ),
        "python_loop_1000_us": per_call_us(loop, reps),
    }


class _Echo:
    """A grpc.aio server on a thread whose one method answers `reply` bytes."""

    def __init__(self, mode: str, reply: bytes) -> None:
        self.mode, self.reply = mode, reply
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.ready.wait(30)

    async def _handle(self, request: bytes, context) -> bytes:
        if self.mode == "hop":
            return await asyncio.get_running_loop().run_in_executor(self.pool, bytes, self.reply)
        return self.reply

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            interceptors = [MalformedRequestInterceptor()] if self.mode == "intercepted" else []
            self.server = grpc.aio.server(options=OPTIONS, interceptors=interceptors)
            handler = grpc.unary_unary_rpc_method_handler(
                self._handle, request_deserializer=bytes, response_serializer=bytes
            )
            self.server.add_generic_rpc_handlers(
                [grpc.method_handlers_generic_handler("floor.Echo", {"Call": handler})]
            )
            self.port = self.server.add_insecure_port("127.0.0.1:0")
            await self.server.start()
            self.ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def round_trips(request: bytes, reply: bytes, reps: int) -> dict:
    out = {}
    for mode in ("echo", "hop", "intercepted"):
        server = _Echo(mode, reply)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=OPTIONS) as ch:
                call = ch.unary_unary("/floor.Echo/Call")
                for _ in range(200):
                    call(request, timeout=10)
                rtt = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    call(request, timeout=10)
                    rtt.append((time.perf_counter() - t0) * 1e6)
            rtt.sort()
            out[mode] = {"median_us": statistics.median(rtt), "p90_us": rtt[int(0.9 * (reps - 1))]}
        finally:
            server.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--kind", default="nvidia-h200" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    steps = python_steps(args.m, args.reps)
    print(json.dumps(steps), flush=True)
    request = bytes(steps["request_bytes"])
    reply = bytes(2 * args.m * 4096 + 40)
    rpc = round_trips(request, reply, args.reps)
    print(json.dumps(rpc), flush=True)
    result = {
        "date": dt.date.today().isoformat(),
        "kind": args.kind,
        "M": args.m,
        "python": f"{sys.version.split()[0]}, grpcio {grpc.__version__}",
        "steps": steps,
        "round_trip": rpc,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rpc-floor-{args.kind}-{result['date']}{args.tag}.json").write_text(
        json.dumps(result, indent=1)
    )
    print(f"\nper request, M = {args.m}, {args.kind} ({result['python']}), us")
    for key, value in steps.items():
        if key.endswith("_us"):
            print(f"  {key[:-3]:<18} {value:8.1f}")
    for mode, r in rpc.items():
        print(f"  round trip {mode:<7} {r['median_us']:8.0f} (p90 {r['p90_us']:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
